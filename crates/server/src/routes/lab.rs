//! `/api/jobs`, `/api/models`, `/api/datasets` and `/api/files`: the Lab's HTTP surface over
//! [`hf2q_lab::Lab`] (jobs: submit, list, get, cancel, resume, delete, and the event log as SSE
//! with replay from `Last-Event-ID`; models: [`super::lab_models`]; datasets:
//! [`super::lab_datasets`]; settings (the Hub token): [`super::lab_settings`]). Errors in the `/v1` shape. Guarded by the
//! API key like `/v1` (the caller's layer) and, for state-changing requests, by [`guard`]:
//! `Content-Type: application/json` and a same-origin `Origin` when one is sent, so a page
//! elsewhere cannot drive the Lab through a browser.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hf2q_lab::{Event, Lab};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{json_body, Shared};
use crate::error::{ApiError, ApiResult};

/// How often an idle event stream sends a comment, so proxies keep it open.
const KEEPALIVE: Duration = Duration::from_secs(15);

pub fn router() -> Router<Shared> {
    Router::new()
        .route("/api/jobs", get(list).post(submit))
        .route("/api/jobs/{id}", get(job).delete(delete))
        .route("/api/jobs/{id}/cancel", post(cancel))
        .route("/api/jobs/{id}/resume", post(resume))
        .route("/api/jobs/{id}/events", get(events))
        .route("/api/models", get(super::lab_models::list))
        .route("/api/models/pull", post(super::lab_models::pull))
        .route(
            "/api/models/{*path}",
            axum::routing::delete(super::lab_models::delete),
        )
        .route(
            "/api/datasets",
            get(super::lab_datasets::list).post(super::lab_datasets::create),
        )
        .route(
            "/api/datasets/{name}",
            axum::routing::delete(super::lab_datasets::delete),
        )
        .route(
            "/api/datasets/{name}/preview",
            get(super::lab_datasets::preview),
        )
        .route(
            "/api/datasets/{name}/stats",
            get(super::lab_datasets::stats),
        )
        .route("/api/settings", get(super::lab_settings::get))
        .route(
            "/api/settings/hub-token",
            post(super::lab_settings::set_hub_token).delete(super::lab_settings::clear_hub_token),
        )
        .route(
            "/api/files",
            get(super::lab_files::list).post(super::lab_files::upload),
        )
        .route(
            "/api/files/{*path}",
            axum::routing::delete(super::lab_files::delete),
        )
        .route_layer(middleware::from_fn(guard))
}

/// State-changing requests: JSON only (a form post from another site cannot send it without a
/// preflight) and same-origin.
async fn guard(req: Request, next: Next) -> Response {
    if !matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        let json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.split(';')
                    .next()
                    .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
            });
        if !json {
            return ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                "state-changing /api requests need 'Content-Type: application/json'",
            )
            .into_response();
        }
        return super::agent::same_origin(req, next).await;
    }
    next.run(req).await
}

pub(super) fn lab(st: &Shared) -> ApiResult<&Lab> {
    st.cfg.lab.as_ref().ok_or_else(|| {
        ApiError::not_found(
            "the Lab is off on this server (started with --no-lab, or another server runs it)",
        )
    })
}

pub(super) fn lab_error(e: hf2q_lab::Error) -> ApiError {
    use hf2q_lab::Error as E;
    match e {
        E::Param { param, message } | E::Path { param, message } => {
            ApiError::invalid(&param, format!("{param}: {message}"))
        }
        E::NotFound(m) => ApiError::not_found(m),
        E::Conflict(m) => {
            ApiError::new(StatusCode::CONFLICT, "invalid_request_error", m).with_code("conflict")
        }
        e => ApiError::internal(e.to_string()),
    }
}

/// Runs a Lab call (SQLite, files, signals) off the async runtime.
pub(super) async fn blocking<T: Send + 'static>(
    st: &Shared,
    f: impl FnOnce(Lab) -> hf2q_lab::Result<T> + Send + 'static,
) -> ApiResult<T> {
    let lab = lab(st)?.clone();
    tokio::task::spawn_blocking(move || f(lab))
        .await
        .map_err(|e| ApiError::internal(format!("the Lab call failed: {e}")))?
        .map_err(lab_error)
}

async fn list(State(st): State<Shared>) -> ApiResult<Json<Value>> {
    let jobs = blocking(&st, |l| l.list()).await?;
    Ok(Json(json!({"object": "list", "data": jobs})))
}

async fn submit(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let v = json_body(body, st.cfg.max_body_bytes)?;
    let kind = match v.get("kind") {
        Some(Value::String(k)) => k.clone(),
        Some(_) => return Err(ApiError::wrong_type("kind", "a string")),
        None => return Err(ApiError::missing("kind")),
    };
    let params = match v.get("params") {
        None | Some(Value::Null) => json!({}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(ApiError::wrong_type("params", "an object")),
    };
    if let Some(k) = v
        .as_object()
        .and_then(|o| o.keys().find(|k| *k != "kind" && *k != "params"))
    {
        return Err(ApiError::invalid(
            k,
            format!("unknown field '{k}' (a job is {{\"kind\", \"params\"}})"),
        ));
    }
    let job = blocking(&st, move |l| l.submit(&kind, params)).await?;
    Ok((StatusCode::CREATED, Json(job)).into_response())
}

async fn job(State(st): State<Shared>, Path(id): Path<i64>) -> ApiResult<Json<hf2q_lab::Job>> {
    Ok(Json(blocking(&st, move |l| l.get(id)).await?))
}

async fn cancel(State(st): State<Shared>, Path(id): Path<i64>) -> ApiResult<Json<hf2q_lab::Job>> {
    Ok(Json(blocking(&st, move |l| l.cancel(id)).await?))
}

async fn resume(State(st): State<Shared>, Path(id): Path<i64>) -> ApiResult<Json<hf2q_lab::Job>> {
    Ok(Json(blocking(&st, move |l| l.resume(id)).await?))
}

async fn delete(State(st): State<Shared>, Path(id): Path<i64>) -> ApiResult<Json<Value>> {
    blocking(&st, move |l| l.delete(id)).await?;
    Ok(Json(json!({"id": id, "deleted": true})))
}

#[derive(Deserialize)]
struct EventsQuery {
    /// The same as `Last-Event-ID` (for clients that cannot set headers).
    after: Option<u64>,
}

/// `GET /api/jobs/{id}/events`: the job's events as SSE, `id:` = the sequence number, each
/// `data:` one event object. Starts after `Last-Event-ID` (or `?after=`), else from the first;
/// ends after the event that puts the job in a final state (a resume starts a new stream).
async fn events(
    State(st): State<Shared>,
    Path(id): Path<i64>,
    headers: HeaderMap,
    Query(q): Query<EventsQuery>,
) -> ApiResult<Response> {
    blocking(&st, move |l| l.get(id)).await?;
    let after = match headers
        .get("last-event-id")
        .map(|v| v.to_str().map(|s| s.trim().parse::<u64>()))
    {
        Some(Ok(Ok(n))) => n,
        Some(_) => {
            return Err(ApiError::invalid(
                "Last-Event-ID",
                "must be an event's sequence number",
            ))
        }
        None => q.after.unwrap_or(0),
    };
    let lab = lab(&st)?.clone();
    let tick = lab.events().subscribe();
    let s = Follow {
        lab,
        id,
        offset: 0,
        after,
        pending: VecDeque::new(),
        last_final: false,
        tick,
    };
    let stream = futures_util::stream::unfold(s, |mut s| async move {
        s.next().await.map(|b| (Ok::<Bytes, Infallible>(b), s))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-accel-buffering", "no")
        .body(Body::from_stream(stream))
        .map_err(|e| ApiError::internal(e.to_string()))
}

/// A reader following one job's event log.
struct Follow {
    lab: Lab,
    id: i64,
    /// Byte offset read so far.
    offset: u64,
    /// Last sequence number sent.
    after: u64,
    pending: VecDeque<Event>,
    /// The last event sent put the job in a final state.
    last_final: bool,
    tick: tokio::sync::watch::Receiver<u64>,
}

impl Follow {
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            while let Some(ev) = self.pending.pop_front() {
                if ev.seq <= self.after {
                    continue;
                }
                self.after = ev.seq;
                if ev.kind == "state" {
                    self.last_final = ev.data["state"]
                        .as_str()
                        .and_then(hf2q_lab::State::parse)
                        .is_some_and(|s| s.is_final());
                }
                let data = serde_json::to_string(&ev).unwrap_or_default();
                return Some(Bytes::from(format!("id: {}\ndata: {data}\n\n", ev.seq)));
            }
            // Mark the tick seen before reading, so an append after the read wakes us.
            self.tick.borrow_and_update();
            match self.lab.events().read_from(self.id, self.offset) {
                Ok((evs, off)) => {
                    self.offset = off;
                    self.pending.extend(evs);
                }
                Err(e) => {
                    let err = json!({"error": e.to_string()});
                    return Some(Bytes::from(format!("event: error\ndata: {err}\n\n")));
                }
            }
            if !self.pending.is_empty() {
                continue;
            }
            if self.last_final {
                return None;
            }
            match tokio::time::timeout(KEEPALIVE, self.tick.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return None,
                Err(_) => return Some(Bytes::from_static(b": keepalive\n\n")),
            }
        }
    }
}
