//! `/api/models`: the models and adapters under `$HF2Q_HOME/models` and `$HF2Q_HOME/adapters`
//! with what `hf2q inspect` says of them (cached by path, size and time), the built-in names,
//! pulling one (a `pull` job), deleting one. Dot-names (a job's temporary outputs) are never
//! listed; nothing outside the home is read or removed (symbolic links that point out are
//! skipped and refused).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::SystemTime;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use hf2q_lab::paths::Home;
use serde_json::{json, Value};

use super::lab::blocking;
use super::{json_body, Shared};
use crate::error::{ApiError, ApiResult};

/// The folders of the home that hold models and adapters.
const ROOTS: &[&str] = &["models", "adapters"];
/// How deep below them models are looked for.
const DEPTH: usize = 3;

type Key = (PathBuf, u64, Option<SystemTime>);

/// `inspect` data by (path, size, modified): loading a model to describe it takes a while.
fn cache() -> &'static Mutex<HashMap<Key, Value>> {
    static C: OnceLock<Mutex<HashMap<Key, Value>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

fn describe(path: &Path) -> Value {
    let meta = std::fs::metadata(path).ok();
    let key = (
        path.to_path_buf(),
        meta.as_ref().map_or(0, |m| m.len()),
        meta.and_then(|m| m.modified().ok()),
    );
    if let Some(v) = cache().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return v.clone();
    }
    let v = match hf2q_models::Model::load(path) {
        Ok(m) => json!({"info": m.info()}),
        Err(e) => json!({"error": e.to_string()}),
    };
    cache()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, v.clone());
    v
}

fn bytes_of(p: &Path) -> u64 {
    match std::fs::metadata(p) {
        Ok(m) if m.is_dir() => std::fs::read_dir(p)
            .map(|rd| rd.flatten().map(|e| bytes_of(&e.path())).sum())
            .unwrap_or(0),
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}

fn walk(home: &Home, dir: &Path, depth: usize, out: &mut Vec<Value>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = rd.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with('.') {
            continue;
        }
        let p = e.path();
        let Ok(c) = p.canonicalize() else { continue };
        if !c.starts_with(home.root()) {
            continue;
        }
        let rel = home.relative(&p);
        if c.is_dir() {
            if c.join("adapter_config.json").is_file() {
                let config = std::fs::read(c.join("adapter_config.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice::<Value>(&b).ok());
                out.push(json!({"path": rel, "kind": "adapter", "bytes": bytes_of(&c), "config": config}));
            } else if c.join("config.json").is_file() {
                let mut v = json!({"path": rel, "kind": "model", "bytes": bytes_of(&c)});
                merge(&mut v, describe(&c));
                out.push(v);
            } else if depth > 0 {
                walk(home, &p, depth - 1, out);
            }
        } else if name.to_ascii_lowercase().ends_with(".gguf") {
            let mut v = json!({"path": rel, "kind": "model", "bytes": bytes_of(&c)});
            merge(&mut v, describe(&c));
            out.push(v);
        }
    }
}

fn merge(into: &mut Value, from: Value) {
    if let (Some(a), Value::Object(b)) = (into.as_object_mut(), from) {
        a.extend(b);
    }
}

/// `GET /api/models`.
pub async fn list(State(st): State<Shared>) -> ApiResult<Json<Value>> {
    let (data, builtin, root) = blocking(&st, |lab| {
        let home = lab.home();
        let mut data = Vec::new();
        for r in ROOTS {
            walk(home, &home.root().join(r), DEPTH, &mut data);
        }
        let builtin: Vec<Value> = lab
            .config()
            .builtin_models
            .iter()
            .map(|n| {
                let dir = home.root().join("models").join(n);
                let cached = std::fs::read_dir(&dir).is_ok_and(|rd| {
                    rd.flatten()
                        .any(|e| e.file_name().to_string_lossy().ends_with(".gguf"))
                });
                json!({"name": n, "cached": cached})
            })
            .collect();
        Ok((data, builtin, home.root().display().to_string()))
    })
    .await?;
    Ok(Json(
        json!({"object": "list", "data": data, "builtin": builtin, "home": root}),
    ))
}

/// `POST /api/models/pull {"name"}`: a `pull` job.
pub async fn pull(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let v = json_body(body, st.cfg.max_body_bytes)?;
    let name = match v.get("name") {
        Some(Value::String(n)) => n.clone(),
        Some(_) => return Err(ApiError::wrong_type("name", "a string")),
        None => return Err(ApiError::missing("name")),
    };
    let job = blocking(&st, move |l| l.submit("pull", json!({"name": name}))).await?;
    Ok((StatusCode::CREATED, Json(job)).into_response())
}

/// `DELETE /api/models/{path}`: a model file or folder, or an adapter folder, under
/// `models/` or `adapters/` of the home; a symbolic link is refused, not followed.
pub async fn delete(
    State(st): State<Shared>,
    UrlPath(path): UrlPath<String>,
) -> ApiResult<Json<Value>> {
    let rel = path.clone();
    blocking(&st, move |lab| {
        let home = lab.home();
        let bad = |m: String| hf2q_lab::Error::path("path", m);
        let first = Path::new(&rel)
            .components()
            .next()
            .map(|c| c.as_os_str().to_string_lossy().to_string());
        if !first.as_deref().is_some_and(|f| ROOTS.contains(&f)) {
            return Err(bad(format!(
                "'{rel}' is not under models/ or adapters/ of $HF2Q_HOME"
            )));
        }
        let c = home.existing("path", "", &rel)?;
        let joined = home.root().join(&rel);
        if std::fs::symlink_metadata(&joined).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(bad(format!(
                "'{rel}' is a symbolic link; it is not followed"
            )));
        }
        let top = home.root().join(first.unwrap_or_default());
        if c == top || !c.starts_with(&top) {
            return Err(bad(format!(
                "'{rel}' is not a model under {}",
                home.relative(&top)
            )));
        }
        let r = if c.is_dir() {
            std::fs::remove_dir_all(&c)
        } else {
            std::fs::remove_file(&c)
        };
        r.map_err(|e| hf2q_lab::Error::io(&c, e))
    })
    .await?;
    Ok(Json(json!({"path": path, "deleted": true})))
}
