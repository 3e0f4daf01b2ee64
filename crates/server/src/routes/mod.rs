//! The HTTP surface: routes, and the layers every request passes through (CORS, API key,
//! body-size limit, request metrics, JSON errors for unknown routes).
//!
//! Layer order, outermost first: request metrics -> CORS (answers preflights before auth, as
//! browsers send no credentials on them) -> body limit (413 in OpenAI's shape; see
//! `body_limit`) -> routes; the API key guards the `/v1`,
//! `/tokenize`, `/detokenize`, `/metrics`, `/api/agent` and the Lab's `/api` routes, never `/health` or the static
//! web chat; `/api/agent` is also same-origin only.

mod adapters;
mod agent;
mod body_limit;
mod generate;
mod lab;
mod lab_datasets;
mod lab_files;
mod lab_models;
mod lab_settings;
mod misc;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use hf2q_models::chat_template::ChatTemplate;
use hf2q_models::constraint::ConstraintEnv;
use hf2q_models::tool_calls::ToolFormat;
use serde_json::Value;

use crate::engine::adapters::AdapterRef;
use crate::engine::Engine;
use crate::error::{ApiError, ApiResult};
use crate::openai::Limits;
use crate::ServerConfig;

/// Everything a handler needs.
pub struct AppState {
    pub engine: Engine,
    pub cfg: ServerConfig,
    /// The model's chat template, or the generic fallback when it ships none.
    pub template: ChatTemplate,
    /// Unix time the server started (the model's `created`).
    pub created: u64,
    /// The tool-call format of the template's model, and whether the template renders `tools`.
    pub tool_format: ToolFormat,
    pub renders_tools: bool,
    /// Constrained decoding's token trie, built on the first request that needs it.
    constraint_env: std::sync::OnceLock<Result<ConstraintEnv, String>>,
    /// Agent mode's tools and approvals (`--workspace`), or `None` when off.
    pub agent: Option<crate::agent::Agent>,
}

pub type Shared = Arc<AppState>;

impl AppState {
    pub fn new(engine: Engine, cfg: ServerConfig) -> Result<AppState, hf2q_models::Error> {
        let model = engine.model().clone();
        let template = match model.chat_template() {
            Some(t) => t.clone(),
            None => ChatTemplate::for_tokenizer(model.tokenizer())?,
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let tool_format = ToolFormat::detect(template.source());
        let renders_tools = ToolFormat::template_renders_tools(template.source());
        Ok(AppState {
            engine,
            template,
            created,
            tool_format,
            renders_tools,
            constraint_env: std::sync::OnceLock::new(),
            agent: cfg.agent.clone().map(crate::agent::Agent::new),
            cfg,
        })
    }

    /// The model's constraint environment (built once; tens to hundreds of milliseconds, so
    /// call it off the async runtime).
    pub fn constraint_env(&self) -> ApiResult<&ConstraintEnv> {
        let model = self.engine.model();
        self.constraint_env
            .get_or_init(|| {
                ConstraintEnv::new(model.tokenizer(), model.vocab_size()).map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| {
                ApiError::unsupported(
                    "response_format",
                    format!("constrained decoding is not available for this model: {e}"),
                )
            })
    }

    pub fn limits(&self) -> Limits {
        Limits {
            ctx_size: self.cfg.engine.ctx_size,
            vocab: self.engine.model().vocab_size(),
            sampling: *self.engine.model().generation_defaults(),
        }
    }

    /// 404 unless `model` is absent (or empty) or names the base or a served adapter.
    pub fn check_model(&self, model: Option<&str>) -> ApiResult<()> {
        self.resolve_model(model).map(|_| ())
    }

    /// What a request's `model` names: the base (`None`: absent, empty or the base's id) or a
    /// served adapter (`BASE:NAME`, or `NAME` alone: adapter names never equal the base's).
    /// 404 in OpenAI's shape for anything else.
    pub fn resolve_model(&self, model: Option<&str>) -> ApiResult<Option<AdapterRef>> {
        let base = &self.cfg.model_id;
        let m = match model {
            Some(m) if !m.is_empty() && m != base => m,
            _ => return Ok(None),
        };
        let name = m.strip_prefix(&format!("{base}:")).unwrap_or(m);
        let reg = self.engine.shared().registry();
        if let Some(a) = reg.get(name) {
            return Ok(Some(a));
        }
        let names: Vec<String> = reg
            .list()
            .iter()
            .map(|a| format!("'{base}:{}'", a.name))
            .collect();
        let also = if names.is_empty() {
            String::new()
        } else {
            format!(" and the adapters {}", names.join(", "))
        };
        Err(ApiError::not_found(format!(
            "The model '{m}' does not exist: this server serves '{base}'{also} (see /v1/models)"
        ))
        .with_code("model_not_found"))
    }

    /// The id a response names: the base's, or `BASE:NAME` for an adapter.
    pub fn model_id(&self, adapter: Option<&AdapterRef>) -> String {
        match adapter {
            Some(a) => format!("{}:{}", self.cfg.model_id, a.name),
            None => self.cfg.model_id.clone(),
        }
    }
}

/// The application: every route with its layers.
pub fn router(state: Shared) -> Router {
    let protected = Router::new()
        .route("/v1/chat/completions", post(generate::chat))
        .route("/v1/completions", post(generate::completions))
        .route("/v1/models", get(misc::models))
        .route("/v1/models/{*id}", get(misc::model))
        .route("/v1/adapters", post(adapters::load))
        .route("/v1/adapters/{name}", delete(adapters::unload))
        .route("/tokenize", post(misc::tokenize))
        .route("/detokenize", post(misc::detokenize))
        .route("/metrics", get(misc::metrics))
        .merge(
            Router::new()
                .route("/api/agent", get(agent::info))
                .route("/api/agent/tool", post(agent::tool))
                .route("/api/agent/approvals", get(agent::approvals))
                .route(
                    "/api/agent/approvals/{id}",
                    get(agent::approval).post(agent::decide),
                )
                .route_layer(middleware::from_fn(agent::same_origin)),
        )
        .merge(lab::router())
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    let public = Router::new()
        .route("/health", get(misc::health))
        .merge(crate::ui::routes());
    Router::new()
        .merge(protected)
        .merge(public)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.cfg.max_body_bytes))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            body_limit::limit,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), cors))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!(
            "method {} is not allowed on {}",
            req.method(),
            req.uri().path()
        ),
    )
}

/// Counts requests by route template and status.
async fn count(State(st): State<Shared>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("other", |m| m.as_str())
        .to_string();
    let resp = next.run(req).await;
    st.engine
        .shared()
        .metrics
        .count_request(&route, resp.status().as_u16());
    resp
}

/// `Authorization: Bearer KEY` when the server has a key.
async fn auth(State(st): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim);
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Compares without an early exit, so the time taken does not reveal how much of a guess was
/// right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= usize::from(a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
}

/// CORS for the configured origins (`*` = any). Preflights are answered here.
async fn cors(State(st): State<Shared>, req: Request, next: Next) -> Response {
    let origins = &st.cfg.cors_origins;
    let origin = req.headers().get(header::ORIGIN).cloned();
    let any = origins.iter().any(|o| o == "*");
    let allowed = origin
        .as_ref()
        .filter(|o| any || origins.iter().any(|a| o.as_bytes() == a.as_bytes()))
        .cloned();
    let Some(origin) = allowed else {
        return next.run(req).await;
    };
    let allow = if any {
        HeaderValue::from_static("*")
    } else {
        origin
    };
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut resp = if preflight {
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        r
    } else {
        next.run(req).await
    };
    let h = resp.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    resp
}

/// The request body as a JSON value: 413 over the size limit, 400 when it is not JSON.
pub fn json_body(body: Result<Bytes, BytesRejection>, limit: usize) -> ApiResult<Value> {
    let bytes = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(limit)
        } else {
            ApiError::invalid("body", format!("could not read the request body: {r}"))
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::invalid("body", format!("the request body is not valid JSON: {e}"))
            .with_code("invalid_json")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_is_eq() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"", b"a"));
    }
}
