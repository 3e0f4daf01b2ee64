//! The web Lab at `/`: one page of plain HTML, CSS and JavaScript embedded in the binary (no
//! build step, no network resource), hash-routed into sections. The chat (`app.js`, with agent
//! mode in `agent.js`) talks only to the public API (`/v1/models`, `/v1/chat/completions` with
//! streaming); history and settings stay in the browser's localStorage. The Lab's sections
//! (`lab.js`: router, API client, plots; `lab-jobs.js`: job logs and the Jobs section;
//! `lab-pages.js`: Models, Quantize, Datasets; `lab-generate.js`: the generation templates' form; `lab-train.js`: Fine-tune; `lab-hub.js`: the Hub token setting and the Push cards) drive `/api/*`.
//!
//! Not here: the routes those call (`crate::routes`).

use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// Every asset: (URL name, content type, body).
const ASSETS: &[(&str, &str, &str)] = &[
    ("app.js", JS, include_str!("app.js")),
    ("agent.js", JS, include_str!("agent.js")),
    ("lab.js", JS, include_str!("lab.js")),
    ("lab-jobs.js", JS, include_str!("lab-jobs.js")),
    ("lab-pages.js", JS, include_str!("lab-pages.js")),
    ("lab-generate.js", JS, include_str!("lab-generate.js")),
    ("lab-train.js", JS, include_str!("lab-train.js")),
    ("lab-hub.js", JS, include_str!("lab-hub.js")),
    ("style.css", CSS, include_str!("style.css")),
    ("lab.css", CSS, include_str!("lab.css")),
];
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";
const INDEX_HTML: &str = include_str!("index.html");

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

async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

/// `GET /NAME` for every asset in [`ASSETS`], and `GET /` for the page.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    let mut r = Router::new().route("/", get(index));
    for &(name, ty, body) in ASSETS {
        r = r.route(
            &format!("/{name}"),
            get(move || async move { asset(ty, body) }),
        );
    }
    r
}
