//! The web chat at `/`: plain HTML, CSS and JavaScript embedded in the binary (no build step).
//! It talks only to the public API (`/v1/models`, `/v1/chat/completions` with streaming), so
//! it needs nothing the API does not offer; history and settings stay in the browser's
//! localStorage. In agent mode (`agent.js`, when the server has a workspace) it runs the agent
//! loop: the model's tool calls go to `/api/agent`, and changes wait for the person's click.

use axum::http::header;
use axum::response::{IntoResponse, Response};

const INDEX_HTML: &str = include_str!("index.html");
const APP_JS: &str = include_str!("app.js");
const AGENT_JS: &str = include_str!("agent.js");
const STYLE_CSS: &str = include_str!("style.css");

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

pub async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

pub async fn app_js() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

pub async fn agent_js() -> Response {
    asset("text/javascript; charset=utf-8", AGENT_JS)
}

pub async fn style_css() -> Response {
    asset("text/css; charset=utf-8", STYLE_CSS)
}
