//! The body limit over a real socket: a body over `max_body_bytes` gets HTTP 413 with the
//! OpenAI error JSON, not a reset connection, whether its `Content-Length` declares it or a
//! chunked body crosses the limit; the client sends its whole body first, as ordinary clients
//! do, and the body is far larger than the socket buffers, so a server that answered and
//! closed without reading the rest would reset the connection mid-send. A body of exactly the
//! limit is accepted, one byte more is not; `Expect: 100-continue` is answered before any body.
//!
//! Not here: the JSON errors of bodies under the limit (router.rs).

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use common::*;

const LIMIT: usize = 64 << 10;
/// Far over the limit and over what loopback socket buffers hold.
const HUGE: usize = 24 << 20;
/// Guards against a hang only; nothing here is timed.
const HANG: Duration = Duration::from_secs(120);

async fn server() -> hf2q_server::ServerHandle {
    let mut c = cfg();
    c.max_body_bytes = LIMIT;
    start(tiny(), c).await
}

/// A chat body of exactly `len` bytes (padded with spaces, which JSON allows).
fn chat_of_len(len: usize) -> Vec<u8> {
    let mut b = serde_json::to_vec(&chat_body("hi", 1, false)).unwrap();
    assert!(b.len() <= len);
    b.resize(len, b' ');
    b
}

fn head(addr: SocketAddr, framing: &str, extra: &str) -> Vec<u8> {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\n{framing}\r\n{extra}\r\n"
    )
    .into_bytes()
}

fn chunked(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + body.len() / 1000 + 16);
    for c in body.chunks(16 << 10) {
        out.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        out.extend_from_slice(c);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// The status and body of the response that ends the connection.
async fn read_response(s: &mut TcpStream, what: &str) -> (u16, Vec<u8>) {
    let mut raw = Vec::new();
    tokio::time::timeout(HANG, s.read_to_end(&mut raw))
        .await
        .unwrap_or_else(|_| panic!("{what}: no response"))
        .unwrap_or_else(|e| panic!("{what}: reading the response: {e}"));
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{what}: no complete response: {text:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("{what}: bad status line in {head:?}"));
    (status, body.as_bytes().to_vec())
}

/// Sends the whole request, then reads the response.
async fn send(addr: SocketAddr, request: &[u8], what: &str) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    tokio::time::timeout(HANG, s.write_all(request))
        .await
        .unwrap_or_else(|_| panic!("{what}: the server stopped reading the body"))
        .unwrap_or_else(|e| {
            panic!("{what}: the connection broke while the body was being sent: {e}")
        });
    read_response(&mut s, what).await
}

fn assert_413(status: u16, body: &[u8], what: &str) {
    let text = String::from_utf8_lossy(body);
    assert_eq!(status, 413, "{what}: {text}");
    let v: Value =
        serde_json::from_slice(body).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text}"));
    let e = &v["error"];
    assert!(
        e["message"]
            .as_str()
            .is_some_and(|m| m.contains(&LIMIT.to_string())),
        "{what}: {v}"
    );
    assert_eq!(e["type"], "invalid_request_error", "{what}: {v}");
    assert_eq!(e["code"], "request_too_large", "{what}: {v}");
}

#[tokio::test]
async fn content_length_over_the_limit_is_413_json() {
    let h = server().await;
    let body = chat_of_len(HUGE);
    let mut req = head(h.addr, &format!("Content-Length: {}", body.len()), "");
    req.extend_from_slice(&body);
    let (status, resp) = send(h.addr, &req, "Content-Length over the limit").await;
    assert_413(status, &resp, "Content-Length over the limit");
    // One byte over.
    let body = chat_of_len(LIMIT + 1);
    let mut req = head(h.addr, &format!("Content-Length: {}", body.len()), "");
    req.extend_from_slice(&body);
    let (status, resp) = send(h.addr, &req, "one byte over").await;
    assert_413(status, &resp, "one byte over");
}

#[tokio::test]
async fn chunked_body_over_the_limit_is_413_json() {
    let h = server().await;
    let req = [
        head(h.addr, "Transfer-Encoding: chunked", ""),
        chunked(&chat_of_len(HUGE)),
    ]
    .concat();
    let (status, resp) = send(h.addr, &req, "chunked over the limit").await;
    assert_413(status, &resp, "chunked over the limit");
    let req = [
        head(h.addr, "Transfer-Encoding: chunked", ""),
        chunked(&chat_of_len(LIMIT + 1)),
    ]
    .concat();
    let (status, resp) = send(h.addr, &req, "chunked one byte over").await;
    assert_413(status, &resp, "chunked one byte over");
}

#[tokio::test]
async fn a_body_of_exactly_the_limit_is_accepted() {
    let h = server().await;
    for framing in ["length", "chunked"] {
        let body = chat_of_len(LIMIT);
        let req = if framing == "length" {
            [
                head(h.addr, &format!("Content-Length: {}", body.len()), ""),
                body,
            ]
            .concat()
        } else {
            [
                head(h.addr, "Transfer-Encoding: chunked", ""),
                chunked(&body),
            ]
            .concat()
        };
        let (status, resp) = send(h.addr, &req, framing).await;
        let text = String::from_utf8_lossy(&resp);
        assert_eq!(status, 200, "{framing}: {text}");
        let v: Value = serde_json::from_slice(&resp).unwrap();
        assert_eq!(v["object"], "chat.completion", "{framing}: {v}");
    }
}

#[tokio::test]
async fn expect_continue_over_the_limit_is_answered_before_the_body() {
    let h = server().await;
    let mut s = TcpStream::connect(h.addr).await.unwrap();
    let req = head(
        h.addr,
        &format!("Content-Length: {HUGE}"),
        "Expect: 100-continue\r\n",
    );
    s.write_all(&req).await.unwrap();
    let (status, resp) = read_response(&mut s, "Expect: 100-continue").await;
    assert_413(status, &resp, "Expect: 100-continue");
}
