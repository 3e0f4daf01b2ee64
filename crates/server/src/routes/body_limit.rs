//! The request-body size limit as clients see it: a body over `--max-body` gets HTTP 413 with
//! the OpenAI error JSON, whether its `Content-Length` says so up front or a chunked body
//! crosses the limit on the way, and whatever the route did with it (the extractors stop
//! reading at the limit; auth and unknown routes read nothing).
//!
//! Why this is more than `DefaultBodyLimit`: a server that answers and closes while the client
//! is still sending leaves unread bytes in its socket, and the kernel then resets the
//! connection; the client, busy writing, sees a broken pipe instead of the answer. So an error
//! answer to a request whose body was left unread first reads and discards the rest (a
//! lingering close, as nginx and Go's net/http do), for at most [`DRAIN_TOTAL`], giving up
//! when the client sends nothing for [`DRAIN_IDLE`]; only then is the answer sent (with
//! `Connection: close` when the rest could not be read). A client that sent
//! `Expect: 100-continue` has sent no body yet: it is answered at once.
//!
//! Not here: the limit itself (the extractors' `DefaultBodyLimit`, set in `router`) and the
//! JSON decoding (`json_body`).

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, BodyDataStream};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt};
use tokio::time::Instant;

use super::Shared;
use crate::error::ApiError;

/// The longest an error answer waits for the rest of an unread body.
pub const DRAIN_TOTAL: Duration = Duration::from_secs(30);
/// Reading the rest of an unread body stops after this long without data.
pub const DRAIN_IDLE: Duration = Duration::from_secs(2);

/// The middleware: 413 for a declared length over the limit; for everything else the route
/// answers, and an error answer reads the rest of a body it left unread first.
pub async fn limit(State(st): State<Shared>, req: Request, next: Next) -> Response {
    let max = st.cfg.max_body_bytes;
    if declared_length(req.headers()).is_some_and(|n| n > max) {
        let read_all = if expects_continue(req.headers()) {
            false
        } else {
            drain(req.into_body().into_data_stream()).await
        };
        return closing(ApiError::too_large(max).into_response(), read_all);
    }
    let slot = Arc::new(Mutex::new(None));
    let (parts, body) = req.into_parts();
    let tracked = Tracked {
        inner: Some(body.into_data_stream()),
        slot: slot.clone(),
        ended: false,
    };
    let resp = next
        .run(Request::from_parts(parts, Body::from_stream(tracked)))
        .await;
    if resp.status().as_u16() < 400 {
        return resp;
    }
    let rest = slot.lock().ok().and_then(|mut s| s.take());
    match rest {
        Some(rest) => {
            let read_all = drain(rest).await;
            closing(resp, read_all)
        }
        None => resp,
    }
}

/// `Content-Length`, when present and a number.
fn declared_length(h: &HeaderMap) -> Option<usize> {
    h.get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn expects_continue(h: &HeaderMap) -> bool {
    h.get(header::EXPECT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("100-continue"))
}

/// `resp`, marked to close the connection unless the request's body was read to its end.
fn closing(mut resp: Response, read_all: bool) -> Response {
    if !read_all {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// Reads and discards `rest` until it ends (`true`), fails, goes quiet for [`DRAIN_IDLE`] or
/// [`DRAIN_TOTAL`] passes (`false`).
async fn drain(mut rest: BodyDataStream) -> bool {
    let deadline = Instant::now() + DRAIN_TOTAL;
    loop {
        let wait = DRAIN_IDLE.min(deadline.saturating_duration_since(Instant::now()));
        match tokio::time::timeout(wait, rest.next()).await {
            Ok(None) => return true,
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(_))) | Err(_) => return false,
        }
    }
}

/// The request body as the route sees it; if the route drops it before its end (an extractor
/// over the limit, a rejection that never read it), the unread rest goes back into `slot` for
/// [`limit`] to drain.
struct Tracked {
    inner: Option<BodyDataStream>,
    slot: Arc<Mutex<Option<BodyDataStream>>>,
    ended: bool,
}

impl Stream for Tracked {
    type Item = Result<axum::body::Bytes, axum::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let r = inner.poll_next_unpin(cx);
        if let Poll::Ready(None) = r {
            self.ended = true;
        }
        r
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        if let (Some(rest), Ok(mut slot)) = (self.inner.take(), self.slot.lock()) {
            *slot = Some(rest);
        }
    }
}
