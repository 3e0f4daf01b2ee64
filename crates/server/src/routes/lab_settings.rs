//! `/api/settings`: the Lab's settings kept on the server. Today one: the Hub access token the
//! jobs get (push, Hub datasets), stored by [`hf2q_lab::hub_token`] in `$HF2Q_HOME/hub_token`
//! with rights 0600. `GET /api/settings` says whether a token is set, never the token;
//! `POST /api/settings/hub-token {"token"}` stores one, `DELETE` removes it.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::lab::blocking;
use super::{json_body, Shared};
use crate::error::{ApiError, ApiResult};

fn settings(token_set: bool) -> Json<Value> {
    Json(json!({"object": "settings", "hub_token_set": token_set}))
}

pub async fn get(State(st): State<Shared>) -> ApiResult<Json<Value>> {
    Ok(settings(blocking(&st, |l| Ok(l.hub_token_set())).await?))
}

pub async fn set_hub_token(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let v = json_body(body, st.cfg.max_body_bytes)?;
    let token = match v.get("token") {
        Some(Value::String(t)) => t.clone(),
        Some(_) => return Err(ApiError::wrong_type("token", "a string")),
        None => return Err(ApiError::missing("token")),
    };
    if let Some(k) = v.as_object().and_then(|o| o.keys().find(|k| *k != "token")) {
        return Err(ApiError::invalid(k, format!("unknown field '{k}'")));
    }
    blocking(&st, move |l| l.set_hub_token(Some(&token))).await?;
    Ok(settings(true))
}

pub async fn clear_hub_token(State(st): State<Shared>) -> ApiResult<Json<Value>> {
    blocking(&st, |l| l.set_hub_token(None)).await?;
    Ok(settings(false))
}
