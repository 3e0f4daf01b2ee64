//! Small routes: `/v1/models`, `/health`, `/metrics`, `/tokenize`, `/detokenize`.
//!
//! `/tokenize` and `/detokenize` follow llama.cpp's server (`content` in, `tokens` out and back);
//! `prompt` is accepted as a synonym of `content` and `messages` tokenizes a chat with the
//! template, as vLLM's do.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use hf2q_models::chat_template::{encode_chat_json, RenderOptions};
use serde_json::{json, Value};

use super::{json_body, Shared};
use crate::error::{ApiError, ApiResult};
use crate::openai;

fn model_object(st: &Shared) -> Value {
    let info = st.engine.model().info();
    json!({
        "id": st.cfg.model_id,
        "object": "model",
        "created": st.created,
        "owned_by": "hf2q",
        // Not OpenAI's: what the web chat shows about the model.
        "meta": {
            "architecture": info.architecture,
            "name": info.name,
            "format": info.format,
            "parameters": info.parameters,
            "file_bytes": info.file_bytes,
            "bits_per_weight": info.bits_per_weight,
            "context_length": st.cfg.engine.ctx_size,
            "trained_context_length": info.context_length,
            "vocab_size": info.vocab_size,
            "chat_template": info.chat_template,
        },
    })
}

/// The base, then every served adapter (as `BASE:NAME`).
pub async fn models(State(st): State<Shared>) -> Json<Value> {
    let mut data = vec![model_object(&st)];
    let adapters = st.engine.shared().registry().list();
    data.extend(
        adapters
            .iter()
            .map(|a| super::adapters::adapter_object(&st, a)),
    );
    Json(json!({"object": "list", "data": data}))
}

pub async fn model(State(st): State<Shared>, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    Ok(Json(match st.resolve_model(Some(&id))? {
        Some(a) => super::adapters::adapter_object(&st, &a),
        None => model_object(&st),
    }))
}

/// 200 when the engine runs and makes progress; 503 when it is dead, stuck (busy without a
/// finished step for longer than `--stuck-after`) or the server is draining.
pub async fn health(State(st): State<Shared>) -> Response {
    let sh = st.engine.shared();
    let (status, state, detail) = if sh.is_dead() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "error",
            "the engine is not running".to_string(),
        )
    } else if sh.busy() && sh.since_heartbeat() > st.cfg.stuck_after {
        let secs = sh.since_heartbeat().as_secs();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "error",
            format!("the engine has made no progress for {secs} s"),
        )
    } else if sh.is_draining() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            "the server is shutting down".to_string(),
        )
    } else {
        (StatusCode::OK, "ok", String::new())
    };
    let g = sh.gauges();
    let body = json!({"status": state, "detail": detail, "queued": g.queued, "running": g.running});
    (status, Json(body)).into_response()
}

pub async fn metrics(State(st): State<Shared>) -> Response {
    let sh = st.engine.shared();
    let text = sh.metrics.render(&sh.gauges());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

pub async fn tokenize(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let v = json_body(body, st.cfg.max_body_bytes)?;
    let m = v
        .as_object()
        .ok_or_else(|| ApiError::wrong_type("body", "a JSON object"))?;
    for k in m.keys() {
        if ![
            "content",
            "prompt",
            "messages",
            "add_special",
            "with_pieces",
            "model",
        ]
        .contains(&k.as_str())
        {
            return Err(ApiError::invalid(
                k,
                format!("Unrecognized request argument supplied: {k}"),
            ));
        }
    }
    st.check_model(m.get("model").and_then(Value::as_str))?;
    let flag = |k: &str, d: bool| match m.get(k) {
        None | Some(Value::Null) => Ok(d),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::wrong_type(k, "a boolean")),
    };
    let add_special = flag("add_special", true)?;
    let with_pieces = flag("with_pieces", false)?;
    let model = st.engine.model().clone();
    let tok = model.tokenizer();
    let ids = if let Some(msgs) = m.get("messages") {
        let req = openai::parse_chat(&json!({"messages": msgs}), st.limits())?;
        let opts = RenderOptions {
            add_generation_prompt: true,
            ..Default::default()
        };
        encode_chat_json(tok, &st.template, &req.messages, &opts)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?
    } else {
        let text = match m.get("content").or_else(|| m.get("prompt")) {
            Some(Value::String(s)) => s,
            Some(_) => return Err(ApiError::wrong_type("content", "a string")),
            None => return Err(ApiError::missing("content")),
        };
        tok.encode(text, add_special, true)
            .map_err(|e| ApiError::invalid("content", e.to_string()))?
    };
    let mut out =
        json!({"tokens": ids, "count": ids.len(), "max_model_len": st.cfg.engine.ctx_size});
    if with_pieces {
        let pieces: Vec<Value> = ids
            .iter()
            .map(|&id| json!({"id": id, "piece": tok.decode(&[id], false).unwrap_or_default()}))
            .collect();
        out["pieces"] = Value::Array(pieces);
    }
    Ok(Json(out))
}

pub async fn detokenize(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let v = json_body(body, st.cfg.max_body_bytes)?;
    let m = v
        .as_object()
        .ok_or_else(|| ApiError::wrong_type("body", "a JSON object"))?;
    for k in m.keys() {
        if !["tokens", "model"].contains(&k.as_str()) {
            return Err(ApiError::invalid(
                k,
                format!("Unrecognized request argument supplied: {k}"),
            ));
        }
    }
    let arr = m.get("tokens").ok_or_else(|| ApiError::missing("tokens"))?;
    let arr = arr
        .as_array()
        .ok_or_else(|| ApiError::wrong_type("tokens", "a list of token ids"))?;
    let vocab = st.engine.model().vocab_size();
    let mut ids = Vec::with_capacity(arr.len());
    for x in arr {
        let id = x
            .as_u64()
            .ok_or_else(|| ApiError::wrong_type("tokens", "a list of token ids"))?;
        if id as usize >= vocab {
            return Err(ApiError::invalid(
                "tokens",
                format!("token id {id} is outside the vocabulary of {vocab}"),
            ));
        }
        ids.push(id as u32);
    }
    let text = st
        .engine
        .model()
        .tokenizer()
        .decode(&ids, false)
        .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
    Ok(Json(json!({"content": text})))
}
