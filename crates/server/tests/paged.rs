//! The engine with its paged KV cache (`EngineConfig::paged_kv`, `serve --kv-paged`) on a real
//! server over loopback with the tiny random Llama: 16 concurrent streams each equal the same
//! request run alone (the paged attention computes each row on its own, so a batch changes no
//! bit), the answers equal those of the per-request caches up to the attention's summation
//! order, and the blocks all come back when the requests finish.

mod common;

use std::time::Duration;

use serde_json::json;

use common::*;

fn paged_cfg() -> hf2q_server::ServerConfig {
    let mut c = cfg();
    c.engine.paged_kv = true;
    c.engine.prefix_cache = false;
    c
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
