//! A real server on a loopback port: client disconnects (streaming, non-streaming, queued, in
//! prefill) free their slot without touching other requests; concurrent greedy streams equal the
//! same requests run alone; SIGTERM-style drain lets running streams finish.

mod common;

use std::time::Duration;

use serde_json::{json, Value};

use common::*;

fn gauges(h: &hf2q_server::ServerHandle) -> hf2q_server::metrics::Gauges {
    h.engine.shared().gauges()
}

fn cancelled(h: &hf2q_server::ServerHandle) -> u64 {
    h.engine.shared().metrics.finished("cancelled")
}

/// A long greedy chat that ignores end-of-generation tokens.
fn long_chat(content: &str, max_tokens: usize, stream: bool) -> Value {
    let mut b = chat_body(content, max_tokens, stream);
    b["ignore_eos"] = json!(true);
    b
}

#[tokio::test]
async fn disconnect_mid_stream_frees_the_slot_and_spares_others() {
    let mut c = cfg();
    c.engine.step_delay = Duration::from_millis(10);
    let h = start(tiny(), c).await;
    let addr = h.addr;
    // Reference for the bystander: the same request alone.
    let want = post(
        addr,
        "/v1/chat/completions",
        &long_chat("bystander", 40, false),
    )
    .await
    .json();
    let bystander = tokio::spawn(async move {
        post(
            addr,
            "/v1/chat/completions",
            &long_chat("bystander", 40, false),
        )
        .await
    });

    let mut s = open(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(&long_chat("leaver", 200, true).to_string()),
    )
    .await;
    assert_eq!(s.status, 200);
    let mut got = 0;
    while got < 3 {
        s.next().await.expect("frames");
        got += 1;
    }
    assert_eq!(gauges(&h).running, 2);
    drop(s);
    assert!(
        wait_until(Duration::from_secs(3), || cancelled(&h) == 1).await,
        "the stream was not cancelled"
    );
    let other = bystander.await.unwrap().json();
    assert_eq!(
        other["choices"][0]["message"],
        want["choices"][0]["message"]
    );
    assert!(
        wait_until(Duration::from_secs(3), || gauges(&h).running == 0
            && gauges(&h).kv_reserved_bytes == 0)
        .await
    );
}

#[tokio::test]
async fn disconnect_while_waiting_for_a_full_answer() {
    let mut c = cfg();
    c.engine.step_delay = Duration::from_millis(10);
    let h = start(tiny(), c).await;
    let addr = h.addr;
    // The response headers come only at the end, so open() would wait for them: drop the
    // connection from a task after the sequence is running.
    let t = tokio::spawn(async move {
        let body = long_chat("x", 200, false).to_string();
        let s = open(addr, "POST", "/v1/chat/completions", &[], Some(&body));
        let _ = tokio::time::timeout(Duration::from_millis(400), s).await;
    });
    assert!(wait_until(Duration::from_secs(3), || gauges(&h).running == 1).await);
    t.await.unwrap();
    assert!(
        wait_until(Duration::from_secs(3), || gauges(&h).running == 0).await,
        "not cancelled"
    );
    assert_eq!(cancelled(&h), 1);
}

#[tokio::test]
async fn disconnect_while_queued() {
    let mut c = cfg();
    c.engine.max_seqs = 1;
    c.engine.step_delay = Duration::from_millis(10);
    let h = start(tiny(), c).await;
    let addr = h.addr;
    let first = tokio::spawn(async move {
        post(addr, "/v1/chat/completions", &long_chat("first", 60, false)).await
    });
    assert!(wait_until(Duration::from_secs(3), || gauges(&h).running == 1).await);
    let mut queued = open(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(&long_chat("second", 50, true).to_string()),
    )
    .await;
    queued.next().await.expect("role chunk");
    assert!(wait_until(Duration::from_secs(3), || gauges(&h).queued == 1).await);
    drop(queued);
    assert!(
        wait_until(Duration::from_secs(3), || gauges(&h).queued == 0).await,
        "queued request not removed"
    );
    assert_eq!(gauges(&h).running, 1, "the running request is untouched");
    let r = first.await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["usage"]["completion_tokens"], 60);
    assert_eq!(cancelled(&h), 1);
}

#[tokio::test]
async fn disconnect_during_prefill() {
    let mut c = cfg();
    // 4 tokens per step and 20 ms per step: a 200-token prompt takes ~1 s to prefill.
    c.engine.max_seqs = 4;
    c.engine.max_batch_tokens = 4;
    c.engine.step_delay = Duration::from_millis(20);
    let h = start(tiny(), c).await;
    let prompt: Vec<u32> = (0..200).map(|i| 40 + (i % 60)).collect();
    let body = json!({"prompt": prompt, "max_tokens": 5, "stream": true});
    let s = open(
        h.addr,
        "POST",
        "/v1/completions",
        &[],
        Some(&body.to_string()),
    )
    .await;
    assert_eq!(s.status, 200);
    assert!(wait_until(Duration::from_secs(3), || gauges(&h).running == 1).await);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let tokens_before = h
        .engine
        .shared()
        .metrics
        .completion_tokens
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(tokens_before, 0, "still prefilling");
    drop(s);
    assert!(wait_until(Duration::from_secs(3), || gauges(&h).running == 0).await);
    // No token was ever sampled: the sequence left while its prompt was still being prefilled.
    assert_eq!(
        h.engine
            .shared()
            .metrics
            .completion_tokens
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(cancelled(&h), 1);
}

#[tokio::test]
async fn sixteen_concurrent_greedy_streams_equal_solo_runs_tiny() {
    // Float weights: every path is batch-invariant, so the tokens must be identical.
    concurrent_equals_alone(tiny(), "tiny", &["tiny"], 16, 24, None, cfg()).await;
}

#[tokio::test]
async fn sixteen_concurrent_greedy_streams_equal_solo_runs_smollm2() {
    let Some(m) = smollm2("sixteen_concurrent_greedy_streams_equal_solo_runs_smollm2") else {
        return;
    };
    // Why 0.25 nats: the quantized CPU kernels' one-token path and many-token path round the
    // 8-bit activations differently; over 30 layers that moves SmolLM2's log-probabilities by
    // up to ~0.15 nats (measured). A wrong cache or position moves them by whole nats.
    concurrent_equals_alone(m, "smollm2", &["smollm2"], 16, 8, Some(0.25), cfg()).await;
}

#[tokio::test]
async fn drain_finishes_running_streams_and_refuses_new_work() {
    let mut c = cfg();
    c.engine.step_delay = Duration::from_millis(10);
    let mut h = start(tiny(), c).await;
    let addr = h.addr;
    let mut s = open(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(&long_chat("x", 50, true).to_string()),
    )
    .await;
    s.next().await.expect("role chunk");
    h.shutdown();
    assert!(wait_until(Duration::from_secs(2), || h.engine.shared().is_draining()).await);
    // New connections are refused (listener closed) or answered 503.
    if let Ok(Ok(mut c)) =
        tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(addr)).await
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let _ = c
            .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await;
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), c.read_to_end(&mut buf)).await;
        let text = String::from_utf8_lossy(&buf);
        assert!(
            text.is_empty() || text.starts_with("HTTP/1.1 503"),
            "{text}"
        );
    }
    let rest = s.body().await;
    assert!(
        rest.text().ends_with("data: [DONE]\n\n"),
        "the running stream completes: {}",
        rest.text()
    );
    let r = tokio::time::timeout(Duration::from_secs(5), h.wait())
        .await
        .expect("server stops");
    assert!(r.is_ok(), "{r:?}");
}

#[tokio::test]
async fn drain_timeout_aborts_what_is_left() {
    let mut c = cfg();
    c.engine.step_delay = Duration::from_millis(10);
    c.drain_timeout = Duration::from_millis(200);
    let mut h = start(tiny(), c).await;
    let mut s = open(
        h.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(&long_chat("x", 200, true).to_string()),
    )
    .await;
    s.next().await.expect("role chunk");
    h.shutdown();
    let rest = tokio::time::timeout(Duration::from_secs(5), s.body())
        .await
        .expect("stream ends");
    assert!(
        rest.text().contains("\"error\""),
        "aborted with an error frame: {}",
        rest.text()
    );
    let r = tokio::time::timeout(Duration::from_secs(8), h.wait())
        .await
        .expect("server stops");
    assert!(r.is_ok(), "{r:?}");
}
