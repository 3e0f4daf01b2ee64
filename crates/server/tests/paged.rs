//! The engine with its paged KV cache (`EngineConfig::paged_kv`, `serve --kv-paged`) on a real
//! server over loopback with the tiny random Llama: 16 concurrent streams each equal the same
//! request run alone (the paged attention computes each row on its own, so a batch changes no
//! bit), the answers equal those of the per-request caches up to the attention's summation
//! order, and the blocks all come back when the requests finish. With a pool too small for the
//! load, sequences are preempted and recomputed: every answer (greedy or seeded sampling) still
//! equals the same request run alone, and a prompt larger than the pool is refused at once.

mod common;

use std::time::Duration;

use std::sync::atomic::Ordering;

use hf2q_server::engine::BLOCK_TOKENS;
use serde_json::{json, Value};

use common::*;

fn paged_cfg() -> hf2q_server::ServerConfig {
    let mut c = cfg();
    c.engine.paged_kv = true;
    c.engine.prefix_cache = false;
    c
}

/// [`paged_cfg`] with a KV pool of `blocks` blocks (`--kv-mem` in bytes).
fn small_pool_cfg(blocks: usize) -> hf2q_server::ServerConfig {
    let mut c = paged_cfg();
    c.engine.kv_mem_bytes = (blocks * BLOCK_TOKENS * tiny().kv_bytes_per_token()) as u64;
    c
}

/// The text of a chat response, streamed or not.
fn answer(r: &Resp, stream: bool) -> String {
    assert_eq!(r.status, 200, "{}", r.text());
    if stream {
        assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());
        streamed_text(&r.text())
    } else {
        r.json()["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_string()
    }
}

fn preemptions(h: &hf2q_server::ServerHandle) -> u64 {
    h.engine
        .shared()
        .metrics
        .preemptions
        .load(Ordering::Relaxed)
}

/// Waits until nothing runs or waits and every block is back in the pool.
async fn assert_all_blocks_back(h: &hf2q_server::ServerHandle) {
    assert!(
        wait_until(Duration::from_secs(5), || {
            let g = h.engine.shared().gauges();
            g.running == 0 && g.queued == 0 && g.kv_blocks_used == 0 && g.kv_used_bytes == 0
        })
        .await,
        "blocks still held: {:?}",
        h.engine.shared().gauges()
    );
}

/// A 14-block pool with slow steps (5 ms each, so that a later request streams for a while
/// before the pool runs out) running one long greedy request (180 tokens): the next request
/// to arrive is the youngest, preempted when the long one needs its blocks. Returns the server,
/// the long request's body and its task.
async fn pool_busy_with_a_long_request() -> (
    hf2q_server::ServerHandle,
    Value,
    tokio::task::JoinHandle<Resp>,
) {
    let mut c = small_pool_cfg(14);
    c.engine.step_delay = Duration::from_millis(5);
    let h = start(tiny(), c).await;
    let addr = h.addr;
    let long = json!({"model": "tiny", "messages": [{"role": "user", "content": "Tell me about the sea."}],
                      "max_tokens": 180, "temperature": 0, "ignore_eos": true});
    let b = long.clone();
    let first = tokio::spawn(async move { post(addr, "/v1/chat/completions", &b).await });
    assert!(
        wait_until(Duration::from_secs(5), || h
            .engine
            .shared()
            .gauges()
            .running
            == 1)
        .await,
        "the long request did not start"
    );
    (h, long, first)
}

#[tokio::test]
async fn paged_concurrent_streams_equal_each_alone() {
    concurrent_equals_alone(tiny(), "tiny", &["tiny"], 16, 24, None, paged_cfg()).await;
}

#[tokio::test]
async fn paged_answers_equal_per_request_caches_and_free_their_blocks() {
    let paged = start(tiny(), paged_cfg()).await;
    let mut plain_cfg = cfg();
    plain_cfg.engine.prefix_cache = false;
    let plain = start(tiny(), plain_cfg).await;
    for q in [
        "Tell me about cats.",
        "Write a long story about the sea and its boats.",
    ] {
        let body = json!({"model": "tiny", "messages": [{"role": "user", "content": q}],
                          "max_tokens": 32, "temperature": 0, "ignore_eos": true,
                          "logprobs": true, "top_logprobs": 2});
        let a = post(paged.addr, "/v1/chat/completions", &body).await;
        let b = post(plain.addr, "/v1/chat/completions", &body).await;
        assert_eq!(a.status, 200, "{}", a.text());
        assert_eq!(b.status, 200, "{}", b.text());
        let (a, b) = (a.json(), b.json());
        assert_eq!(
            a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"],
            "{q}"
        );
        // The same tokens' log-probabilities, up to f32 summation order in attention.
        let lp = |v: &serde_json::Value| -> Vec<f64> {
            v["choices"][0]["logprobs"]["content"]
                .as_array()
                .expect("logprobs")
                .iter()
                .map(|t| t["logprob"].as_f64().unwrap())
                .collect()
        };
        let (la, lb) = (lp(&a), lp(&b));
        assert_eq!(la.len(), 32);
        for (i, (x, y)) in la.iter().zip(&lb).enumerate() {
            assert!((x - y).abs() <= 1e-4, "{q}: token {i}: {x} vs {y}");
        }
    }
    // Every block is back once nothing runs.
    assert!(
        wait_until(Duration::from_secs(3), || {
            let g = paged.engine.shared().gauges();
            g.running == 0 && g.kv_used_bytes == 0
        })
        .await,
        "blocks still held: {:?}",
        paged.engine.shared().gauges()
    );
}

/// Rows that pick their token without the host's logits (greedy, and seeded draws the device
/// sampler can make: on the CPU those come back as logits and the request's sampler draws with
/// the number it set aside) mixed with rows that need them (log-probabilities, a penalty), all
/// in one batch: each answer equals the same request sent alone, and a seeded request gives the
/// same text twice.
#[tokio::test]
async fn paged_device_picks_and_host_rows_mixed_equal_each_alone() {
    let mut c = paged_cfg();
    c.engine.ctx_size = 512;
    c.engine.kv_mem_bytes = 1 << 30;
    let h = start(tiny(), c).await;
    let addr = h.addr;
    let body = |i: usize| {
        let mut b = json!({"model": "tiny",
            "messages": [{"role": "user", "content": format!("Story number {i} about the sea.")}],
            "max_tokens": 20, "ignore_eos": true});
        match i % 4 {
            0 => b["temperature"] = json!(0),
            1 => {
                b["temperature"] = json!(0.9);
                b["top_k"] = json!(40);
                b["top_p"] = json!(0.95);
                b["seed"] = json!(1000 + i);
            }
            2 => {
                b["temperature"] = json!(0);
                b["logprobs"] = json!(true);
            }
            _ => {
                b["temperature"] = json!(0.7);
                b["seed"] = json!(2000 + i);
                b["frequency_penalty"] = json!(0.5);
            }
        }
        b
    };
    let content = |r: &Resp| -> String {
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_string()
    };
    let mut tasks = Vec::new();
    for i in 0..12 {
        let b = body(i);
        tasks.push(tokio::spawn(async move {
            post(addr, "/v1/chat/completions", &b).await
        }));
    }
    let mut together = Vec::new();
    for t in tasks {
        together.push(content(&t.await.unwrap()));
    }
    for (i, got) in together.iter().enumerate() {
        let alone = content(&post(addr, "/v1/chat/completions", &body(i)).await);
        assert_eq!(
            got,
            &alone,
            "request {i} (kind {}) in a batch vs alone",
            i % 4
        );
    }
}

/// Ten greedy requests of different lengths at once on a pool that holds about two and a half of
/// them at full length: sequences are preempted and recomputed, yet every answer (streamed or
/// not) equals the same request run alone, and every block comes back.
#[tokio::test]
async fn paged_preemption_keeps_every_answer_exact() {
    let h = start(tiny(), small_pool_cfg(20)).await;
    let addr = h.addr;
    let topics = &common::TOPICS[..10];
    let body = |i: usize, stream: bool| {
        json!({"model": "tiny",
               "messages": [{"role": "user", "content": format!("Tell me about {}.", topics[i])}],
               "max_tokens": 40 + 10 * i, "temperature": 0, "ignore_eos": true, "stream": stream})
    };
    let mut tasks = Vec::new();
    for i in 0..topics.len() {
        let b = body(i, i % 2 == 1);
        tasks.push(tokio::spawn(async move {
            post(addr, "/v1/chat/completions", &b).await
        }));
    }
    let mut together = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        together.push(answer(&t.await.unwrap(), i % 2 == 1));
    }
    let preempted = preemptions(&h);
    assert!(
        preempted > 0,
        "the pool was large enough: nothing was preempted"
    );
    let metrics = http(addr, "GET", "/metrics", &[], None).await.text();
    assert!(
        metrics.contains(&format!("hf2q_preemptions_total {preempted}")),
        "{metrics}"
    );
    assert_all_blocks_back(&h).await;
    for (i, got) in together.iter().enumerate() {
        let alone = post(addr, "/v1/chat/completions", &body(i, false)).await;
        let usage = alone.json()["usage"].clone();
        assert_eq!(usage["completion_tokens"], 40 + 10 * i, "{usage}");
        assert_eq!(
            got,
            &answer(&alone, false),
            "request {i} with others vs alone"
        );
    }
    assert_eq!(preemptions(&h), preempted, "a request alone fits the pool");
    eprintln!("{preempted} preemptions");
    assert_all_blocks_back(&h).await;
}

/// A seeded sampled request, admitted after a long greedy one on a pool too small for both, is
/// preempted after it has streamed text, recomputed, and its answer equals the same request
/// run alone: its sampler (and the random numbers it drew) went on, not restarted.
#[tokio::test]
async fn paged_preempted_seeded_request_continues_its_draws() {
    let (h, long, first) = pool_busy_with_a_long_request().await;
    let addr = h.addr;
    let seeded = |stream: bool| {
        json!({"model": "tiny", "messages": [{"role": "user", "content": "Tell me about cats."}],
               "max_tokens": 120, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 7,
               "ignore_eos": true, "stream": stream})
    };
    let mut s = open(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(&seeded(true).to_string()),
    )
    .await;
    assert_eq!(s.status, 200);
    // Only the seeded request is ever preempted (the long one is older): none has happened
    // when its first text arrives, one has by its end.
    let mut body = Vec::new();
    let mut before_text = None;
    while let Some(piece) = s.next().await {
        body.extend(piece);
        if before_text.is_none() && !streamed_text(&String::from_utf8_lossy(&body)).is_empty() {
            before_text = Some(preemptions(&h));
        }
    }
    let streamed = streamed_text(&String::from_utf8_lossy(&body));
    assert_eq!(before_text, Some(0), "preempted before it streamed text");
    assert!(
        preemptions(&h) > 0,
        "the seeded request was never preempted"
    );
    let long_answer = answer(&first.await.unwrap(), false);
    assert_all_blocks_back(&h).await;
    let preempted = preemptions(&h);
    let alone = answer(
        &post(addr, "/v1/chat/completions", &seeded(false)).await,
        false,
    );
    assert_eq!(streamed, alone, "the preempted seeded request vs alone");
    let long_alone = answer(&post(addr, "/v1/chat/completions", &long).await, false);
    assert_eq!(long_answer, long_alone);
    assert_eq!(preemptions(&h), preempted, "a request alone fits the pool");
}

/// A prompt larger than the whole pool is refused at once (400, naming the pool's size); a
/// short prompt whose max_tokens exceed the pool is admitted (the paged cache takes blocks as
/// it grows) and, alone in a full pool, ends with `length`.
#[tokio::test]
async fn paged_prompt_larger_than_the_pool_is_refused() {
    let h = start(tiny(), small_pool_cfg(4)).await;
    let pool = 4 * BLOCK_TOKENS;
    let chat = |content: String, max_tokens: Option<usize>| {
        let mut b = json!({"model": "tiny", "messages": [{"role": "user", "content": content}],
                           "temperature": 0, "ignore_eos": true});
        if let Some(m) = max_tokens {
            b["max_tokens"] = json!(m);
        }
        b
    };
    let r = post(
        h.addr,
        "/v1/chat/completions",
        &chat("word ".repeat(20), Some(8)),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let e: Value = r.json()["error"].clone();
    assert_eq!(e["code"], "context_length_exceeded", "{e}");
    assert_eq!(e["param"], "messages", "{e}");
    let msg = e["message"].as_str().unwrap_or_default();
    assert!(msg.contains(&format!("holds only {pool}")), "{msg}");
    assert!(msg.contains("shorten the prompt"), "{msg}");

    // No max_tokens: up to the context size (256), which the pool (64) cannot hold.
    let r = post(h.addr, "/v1/chat/completions", &chat("Hi.".into(), None)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    // The last token is picked from position pool - 1 and is never fed.
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64().unwrap() as usize,
        pool - prompt + 1,
        "{v}"
    );
    assert_eq!(preemptions(&h), 0);
    assert_all_blocks_back(&h).await;
}

/// A preempted request whose client goes away is dropped (whether it is noticed while it waits
/// or after it is readmitted): the other request finishes and every block and queue slot comes
/// back.
#[tokio::test]
async fn paged_preempted_request_whose_client_leaves_is_dropped() {
    let (h, _, first) = pool_busy_with_a_long_request().await;
    let addr = h.addr;
    let young = json!({"model": "tiny", "messages": [{"role": "user", "content": "Tell me about cats."}],
                       "max_tokens": 120, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut s = open(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(&young.to_string()),
    )
    .await;
    assert_eq!(s.status, 200);
    while preemptions(&h) == 0 {
        assert!(s.next().await.is_some(), "the stream ended unpreempted");
    }
    drop(s);
    let r = first.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let sh = h.engine.shared();
    assert!(
        wait_until(Duration::from_secs(10), || sh.metrics.finished("cancelled")
            == 1)
        .await,
        "the preempted request was not dropped"
    );
    assert_all_blocks_back(&h).await;
}
