//! `POST /v1/adapters` (`{"name": ..., "path": ...}`) and `DELETE /v1/adapters/{name}`: load
//! and unload served LoRA adapters while the server runs (behind the API key, as `/v1`).
//!
//! A loaded adapter is requested as `BASE:NAME` (or `NAME`) in a request's `model` and listed
//! by `/v1/models`. Paths must lie under one of the server's adapter roots
//! (`ServerConfig::adapter_roots`, symbolic links resolved); a relative path is taken under the
//! first root. Unloading answers at once: new requests for the name get 404, running ones
//! finish with the adapter, then its memory is freed (`engine::adapters`).

use std::path::{Path, PathBuf};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

use super::{json_body, Shared};
use crate::engine::adapters::{valid_name, AdapterRef};
use crate::error::{ApiError, ApiResult};

/// The `/v1/models` object of a served adapter.
pub fn adapter_object(st: &Shared, a: &AdapterRef) -> Value {
    json!({
        "id": format!("{}:{}", st.cfg.model_id, a.name),
        "object": "model",
        "created": a.created,
        "owned_by": "hf2q",
        // vLLM's fields for a LoRA adapter: the base it runs on and where it came from.
        "parent": st.cfg.model_id,
        "root": a.path.display().to_string(),
        "meta": {"adapter": {"name": a.name, "r": a.rank, "lora_alpha": a.alpha, "target_modules": a.targets}},
    })
}

/// `path` if it lies under one of `roots` (both canonical), relative paths under the first.
fn allowed(roots: &[PathBuf], path: &str) -> ApiResult<PathBuf> {
    let Some(first) = roots.first() else {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            "loading adapters at run time is off: this server has no adapter root",
        ));
    };
    let p = Path::new(path);
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        first.join(p)
    };
    let canon = p
        .canonicalize()
        .map_err(|e| ApiError::invalid("path", format!("adapter folder '{path}': {e}")))?;
    if !roots.iter().any(|r| canon.starts_with(r)) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            format!("adapter folder '{path}' is outside the server's adapter roots"),
        )
        .with_code("path_not_allowed"));
    }
    Ok(canon)
}

pub async fn load(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let v = json_body(body, st.cfg.max_body_bytes)?;
    let m = v
        .as_object()
        .ok_or_else(|| ApiError::wrong_type("body", "a JSON object"))?;
    if let Some(k) = m.keys().find(|k| !["name", "path"].contains(&k.as_str())) {
        return Err(ApiError::invalid(
            k,
            format!("Unrecognized request argument supplied: {k}"),
        ));
    }
    let field = |k: &str| match m.get(k) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(ApiError::wrong_type(k, "a string")),
        None => Err(ApiError::missing(k)),
    };
    let (name, path) = (field("name")?, field("path")?);
    if !valid_name(&name) {
        return Err(ApiError::invalid(
            "name",
            format!("'{name}' is not a valid adapter name (1 to 64 of A-Z a-z 0-9 . _ -)"),
        ));
    }
    if name == st.cfg.model_id {
        return Err(ApiError::invalid(
            "name",
            format!("'{name}' is the base model's name"),
        ));
    }
    if st.engine.shared().registry().contains(&name) {
        return Err(conflict(&name));
    }
    let dir = allowed(&st.cfg.adapter_roots, &path)?;
    let model = st.engine.model().clone();
    let dir2 = dir.clone();
    let read = tokio::task::spawn_blocking(move || model.read_adapter(&dir2))
        .await
        .map_err(|e| ApiError::internal(format!("reading the adapter failed: {e}")))?
        .map_err(|e| ApiError::invalid("path", e.to_string()).with_code("invalid_adapter"))?;
    let a = st.engine.install(&name, dir, read).await.map_err(|e| {
        if st.engine.shared().registry().contains(&name) {
            conflict(&name)
        } else {
            ApiError::internal(e)
        }
    })?;
    Ok((StatusCode::CREATED, Json(adapter_object(&st, &a))))
}

fn conflict(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "invalid_request_error",
        format!("an adapter named '{name}' is already loaded (unload it first)"),
    )
    .with_code("adapter_exists")
}

pub async fn unload(
    State(st): State<Shared>,
    UrlPath(name): UrlPath<String>,
) -> ApiResult<Json<Value>> {
    let base = format!("{}:", st.cfg.model_id);
    let short = name.strip_prefix(&base).unwrap_or(&name);
    match st.engine.unload(short) {
        Some(in_flight) => Ok(Json(json!({
            "id": format!("{base}{short}"),
            "object": "model",
            "deleted": true,
            // Requests still generating with it (they finish; then its memory is freed).
            "in_flight": in_flight,
        }))),
        None => Err(
            ApiError::not_found(format!("no adapter named '{short}' is loaded"))
                .with_code("model_not_found"),
        ),
    }
}
