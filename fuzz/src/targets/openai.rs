//! OpenAI-style request bodies through the real router, handlers and engine of `hf2q serve`, in
//! process (no socket: `tower::ServiceExt::oneshot`), on the tiny model with its 256-token context.
//! Input: the first byte picks the route, the rest is the body.
//!
//! Invariants: no 5xx other than 503 (a full queue or a timeout are answers; a 500 is a bug), the
//! answer comes within [`ANSWER_LIMIT`] (else a hang), an error body is OpenAI's error JSON, a
//! JSON answer parses, and every SSE frame of a stream is JSON or `[DONE]`.

use std::sync::OnceLock;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::Router;
use hf2q_server::routes::{self, AppState};
use hf2q_server::{Engine, EngineConfig, ServerConfig};
use serde_json::Value;
use tower::ServiceExt;

pub const ROUTES: [&str; 4] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/tokenize",
    "/detokenize",
];

/// Far above the slowest legitimate answer (256 tokens of the tiny model: well under a second).
pub const ANSWER_LIMIT: Duration = Duration::from_secs(20);

struct Server {
    rt: tokio::runtime::Runtime,
    app: Router,
}

fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let app = rt.block_on(async {
            let cfg = ServerConfig {
                port: 0,
                model_id: "tiny".into(),
                max_body_bytes: 1 << 20,
                engine: EngineConfig {
                    ctx_size: 256,
                    kv_mem_bytes: 16 << 20,
                    max_seqs: 8,
                    max_queue: 32,
                    max_batch_tokens: 256,
                    ..Default::default()
                },
                ..Default::default()
            };
            let engine =
                Engine::start(super::tiny::model(), cfg.engine.clone()).expect("the engine starts");
            let state = AppState::new(engine, cfg).expect("the server state");
            routes::router(std::sync::Arc::new(state))
        });
        Server { rt, app }
    })
}

pub fn run(data: &[u8]) {
    let _ = answer(data);
}

/// Runs one input and checks the invariants; returns the status and the body (`None` for an
/// empty input).
pub fn answer(data: &[u8]) -> Option<(StatusCode, String)> {
    let (&sel, body) = data.split_first()?;
    let path = ROUTES[sel as usize % ROUTES.len()];
    let s = server();
    let req = Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_vec()))
        .expect("a request");
    let (status, ctype, bytes) = s.rt.block_on(async {
        let answer = async {
            let resp = s
                .app
                .clone()
                .oneshot(req)
                .await
                .expect("the router answers");
            let status = resp.status();
            let ctype = resp
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let bytes = axum::body::to_bytes(resp.into_body(), 64 << 20)
                .await
                .expect("the body reads");
            (status, ctype, bytes)
        };
        tokio::time::timeout(ANSWER_LIMIT, answer)
            .await
            .unwrap_or_else(|_| panic!("{path}: no answer within {ANSWER_LIMIT:?}"))
    });
    let text = String::from_utf8_lossy(&bytes);
    assert!(
        !status.is_server_error() || status == StatusCode::SERVICE_UNAVAILABLE,
        "{path}: {status}: {text}"
    );
    if ctype.starts_with("text/event-stream") {
        for frame in text.split("\n\n").filter(|f| !f.is_empty()) {
            let data = frame
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("{path}: SSE frame without 'data: ': {frame:?}"));
            if data != "[DONE]" {
                serde_json::from_str::<Value>(data)
                    .unwrap_or_else(|e| panic!("{path}: SSE frame is not JSON ({e}): {data:?}"));
            }
        }
    } else {
        let v: Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|e| panic!("{path}: {status}: answer is not JSON ({e}): {text}"));
        if !status.is_success() {
            assert!(
                v["error"]["message"].is_string(),
                "{path}: {status}: error without OpenAI's error object: {text}"
            );
        }
    }
    Some((status, text.into_owned()))
}
