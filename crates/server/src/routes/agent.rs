//! `/api/agent/...`: the only way the agent's tools run ([`crate::agent`]).
//!
//! - `GET /api/agent`: whether agent mode is on, the workspace, the tool definitions;
//! - `POST /api/agent/tool` `{chat_id, name, arguments}`: runs a read-only tool, or answers
//!   `pending` with an approval (id, exact preview) for a changing one;
//! - `GET /api/agent/approvals[/{id}]`: pending approvals;
//! - `POST /api/agent/approvals/{id}` `{decision: approve | deny | always}`: the person's
//!   decision; the tool runs on approve.
//!
//! Off (403) unless the server was started with `--workspace`. Behind the API key like `/v1`,
//! and same-origin only: a browser request from another origin is refused (403), whatever the
//! CORS settings, so a page elsewhere cannot drive a person's workspace.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::{json_body, Shared};
use crate::agent::{tool_definitions, Agent, Decision, Outcome, ToolError, SYSTEM_PROMPT};
use crate::error::{ApiError, ApiResult};

fn forbidden(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, "invalid_request_error", message)
}

fn agent(st: &Shared) -> ApiResult<Agent> {
    st.agent.clone().ok_or_else(|| {
        forbidden("agent mode is off: start the server with --workspace DIR to turn it on")
    })
}

/// Refuses browser requests from another origin (`Origin` not this server's own, or
/// `Sec-Fetch-Site: cross-site`).
pub async fn same_origin(req: Request, next: Next) -> Response {
    let h = req.headers();
    let host = h
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let cross_origin = h
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|o| o != format!("http://{host}") && o != format!("https://{host}"));
    let cross_site = h
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|s| s == "cross-site");
    if cross_origin || cross_site {
        return forbidden(
            "this route takes same-origin requests only (Origin or Sec-Fetch-Site says cross-site)",
        )
        .into_response();
    }
    next.run(req).await
}

pub async fn info(State(st): State<Shared>) -> Json<Value> {
    Json(match &st.agent {
        Some(a) => json!({
            "enabled": true,
            "workspace": a.cfg.workspace.root().display().to_string(),
            "tools": tool_definitions(),
            "system_prompt": SYSTEM_PROMPT,
            "approval_timeout_s": a.cfg.approval_timeout.as_secs_f64(),
            "command_timeout_s": a.cfg.command_timeout.as_secs_f64(),
        }),
        None => json!({"enabled": false}),
    })
}

fn outcome_json(o: Outcome, a: &Agent) -> Value {
    match o {
        Outcome::Done(Ok(r)) => json!({"status": "done", "result": r}),
        Outcome::Done(Err(e @ ToolError::Refused(_))) => {
            json!({"status": "refused", "error": e.to_string()})
        }
        Outcome::Done(Err(e)) => json!({"status": "error", "error": e.to_string()}),
        Outcome::Denied(why) => json!({"status": "denied", "reason": why}),
        Outcome::Pending(id) => match a.get(&id) {
            Some(p) => json!({"status": "pending", "approval": p.json(a.cfg.approval_timeout)}),
            None => json!({"status": "denied", "reason": "no decision within the time limit"}),
        },
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("the tool failed: {e}")))
}

pub async fn tool(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let a = agent(&st)?;
    let v = json_body(body, st.cfg.max_body_bytes)?;
    let chat = v
        .get("chat_id")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::missing("chat_id"))?
        .to_string();
    let name = v
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::missing("name"))?
        .to_string();
    // As the model wrote them: a JSON string, or already an object.
    let args = match v.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
            ApiError::invalid("arguments", format!("the arguments are not JSON: {e}"))
        })?,
        Some(o @ Value::Object(_)) => o.clone(),
        Some(_) => return Err(ApiError::wrong_type("arguments", "a JSON object or string")),
    };
    let a2 = a.clone();
    let o = blocking(move || a2.call(&chat, &name, &args)).await?;
    Ok(Json(outcome_json(o, &a)))
}

pub async fn approvals(State(st): State<Shared>) -> ApiResult<Json<Value>> {
    let a = agent(&st)?;
    let t = a.cfg.approval_timeout;
    let list: Vec<Value> = a.pending().iter().map(|p| p.json(t)).collect();
    Ok(Json(json!({"object": "list", "data": list})))
}

pub async fn approval(State(st): State<Shared>, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    let a = agent(&st)?;
    match a.get(&id) {
        Some(p) => Ok(Json(p.json(a.cfg.approval_timeout))),
        None => Err(ApiError::not_found(format!(
            "no pending approval '{id}' (decided already, or denied at the time limit)"
        ))),
    }
}

pub async fn decide(
    State(st): State<Shared>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<Value>> {
    let a = agent(&st)?;
    let v = json_body(body, st.cfg.max_body_bytes)?;
    let d = match v.get("decision").and_then(Value::as_str) {
        Some("approve") => Decision::Approve,
        Some("deny") => Decision::Deny,
        Some("always") => Decision::Always,
        _ => {
            return Err(ApiError::invalid(
                "decision",
                "'decision' must be 'approve', 'deny' or 'always'",
            ))
        }
    };
    let a2 = a.clone();
    let o = blocking(move || a2.decide(&id, d)).await?;
    match o {
        Some(o) => Ok(Json(outcome_json(o, &a))),
        None => Err(ApiError::not_found(
            "no pending approval with this id (decided already)",
        )),
    }
}
