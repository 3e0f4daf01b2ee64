//! Prefix caching on a real server over loopback, with the tiny random Llama (f32 weights, so
//! every path is batch-invariant and greedy outputs must match exactly): a request served from
//! a cached prefix answers what it answers with caching off, the reuse is visible in the usage
//! and the metrics (so a cache that silently does nothing fails), a tight KV budget evicts
//! cached prefixes instead of refusing or stalling requests, and cancellation still frees blocks.
//! The same with the paged KV cache, whose prefix cache shares full blocks.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use hf2q_server::{ServerConfig, ServerHandle};
use serde_json::{json, Value};

use common::*;

/// The tiny model's KV bytes per token: 2 layers x 2 KV heads x 16 dims x (K, V) x f16 (the
/// default cache type).
const BYTES_PER_TOKEN: u64 = 2 * 2 * 16 * 2 * 2;
const BLOCK: usize = hf2q_server::engine::BLOCK_TOKENS;

fn prefix_cfg(on: bool) -> ServerConfig {
    let mut c = cfg();
    c.engine.prefix_cache = on;
    c
}

fn hits(h: &ServerHandle) -> u64 {
    h.engine
        .shared()
        .metrics
        .prefix_cache_hits
        .load(Ordering::Relaxed)
}

/// Waits until the prefix cache holds `n` entries.
async fn entries(h: &ServerHandle, n: usize) -> bool {
    wait_until(Duration::from_secs(3), || {
        h.engine.shared().gauges().prefix_cache_entries == n
    })
    .await
}

fn cached_of(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {v}"))
}

fn chat(messages: Value, max_tokens: usize) -> Value {
    json!({"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true, "logprobs": true, "top_logprobs": 3})
}

/// Asserts that two answers are the same: text, and log-probabilities to the last bit (a
/// reused row that differs from a recomputed one moves them even where greedy text does not
/// change).
fn same(a: &Value, b: &Value, what: &str) {
    assert_eq!(text_of(a), text_of(b), "{what}: text");
    let (la, lb) = (&a["choices"][0]["logprobs"], &b["choices"][0]["logprobs"]);
    assert!(!la.is_null(), "{what}: no logprobs in {a}");
    assert_eq!(la, lb, "{what}: log-probabilities");
}

fn text_of(v: &Value) -> String {
    let c = &v["choices"][0];
    c["message"]["content"]
        .as_str()
        .or_else(|| c["text"].as_str())
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

async fn ok(h: &ServerHandle, path: &str, body: &Value) -> Value {
    let r = post(h.addr, path, body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

const SYSTEM: &str = "You are a terse assistant. Answer in one line.";

#[tokio::test]
async fn multi_turn_follow_up_reuses_the_history_and_answers_the_same() {
    let on = start(tiny(), prefix_cfg(true)).await;
    let off = start(tiny(), prefix_cfg(false)).await;
    let first = json!([{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": "Tell me about cats."}]);
    let t1 = ok(&on, "/v1/chat/completions", &chat(first.clone(), 24)).await;
    let t1_off = ok(&off, "/v1/chat/completions", &chat(first, 24)).await;
    same(&t1, &t1_off, "first turn");
    assert_eq!(cached_of(&t1), 0, "nothing to reuse yet");
    let reply = text_of(&t1);
    let follow = json!([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Tell me about cats."},
                        {"role": "assistant", "content": reply},
                        {"role": "user", "content": "And dogs?"}]);
    let t2 = ok(&on, "/v1/chat/completions", &chat(follow.clone(), 24)).await;
    let t2_off = ok(&off, "/v1/chat/completions", &chat(follow, 24)).await;
    same(&t2, &t2_off, "follow-up");
    // The whole first prompt (and the part of the reply that tokenizes the same) was reused.
    let p1 = t1["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = cached_of(&t2);
    assert!(
        cached >= p1 && cached < t2["usage"]["prompt_tokens"].as_u64().unwrap(),
        "cached {cached}, first prompt {p1}: {t2}"
    );
    assert_eq!(hits(&on), 1);
    assert_eq!(cached_of(&t2_off), 0);
    assert_eq!(hits(&off), 0);
    let m = on
        .engine
        .shared()
        .metrics
        .prompt_tokens_cached
        .load(Ordering::Relaxed);
    assert_eq!(m, cached);
}

#[tokio::test]
async fn requests_sharing_a_system_prompt_reuse_it() {
    let on = start(tiny(), prefix_cfg(true)).await;
    let off = start(tiny(), prefix_cfg(false)).await;
    let ask = |q: &str| {
        chat(
            json!([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]),
            16,
        )
    };
    // The system part of the prompt, "<s>system: SYSTEM</s><s>user: ", at one token per byte
    // ("<s>" and "</s>" are one token each).
    let shared = format!("<s>system: {SYSTEM}</s><s>user: ").len() as u64 - 7;
    for (i, q) in ["What is rust?", "Name a river.", "Why is the sky blue?"]
        .iter()
        .enumerate()
    {
        let a = ok(&on, "/v1/chat/completions", &ask(q)).await;
        let b = ok(&off, "/v1/chat/completions", &ask(q)).await;
        same(&a, &b, &format!("question {i}"));
        if i > 0 {
            assert!(cached_of(&a) >= shared, "question {i}: {a}");
        }
    }
    assert_eq!(hits(&on), 2);
    // The metrics page shows it.
    let page = http(on.addr, "GET", "/metrics", &[], None).await.text();
    assert!(page.contains("hf2q_prefix_cache_hits_total 2"), "{page}");
    assert!(page.contains("hf2q_prefix_cache_queries_total 3"), "{page}");
    assert!(page.contains("hf2q_prefix_cache_bytes "), "{page}");
    // The engine publishes its gauges just after the last answer was sent.
    assert!(entries(&on, 3).await);
}

/// A request arriving while another with the same start is still generating copies the running
/// sequence's rows (nothing is pooled yet), and both answers are unchanged.
#[tokio::test]
async fn a_running_sequence_serves_as_a_source() {
    let mut c = prefix_cfg(true);
    c.engine.step_delay = Duration::from_millis(10);
    let on = start(tiny(), c).await;
    let off = start(tiny(), prefix_cfg(false)).await;
    let msgs =
        |q: &str| json!([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]);
    let mut long = chat(msgs("Write a long story."), 60);
    long["stream"] = json!(true);
    let mut s = open(
        on.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(&long.to_string()),
    )
    .await;
    assert_eq!(s.status, 200);
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.extend(s.next().await.expect("frames"));
    }
    let b = ok(&on, "/v1/chat/completions", &chat(msgs("Hi."), 8)).await;
    assert!(cached_of(&b) >= BLOCK as u64, "{b}");
    // The source was the running sequence: it still runs, and only B's cache got pooled.
    // (The gauges are published just after B's answer was sent.)
    assert!(entries(&on, 1).await);
    let g = on.engine.shared().gauges();
    assert_eq!(g.running, 1, "{g:?}");
    let b_off = ok(&off, "/v1/chat/completions", &chat(msgs("Hi."), 8)).await;
    same(&b, &b_off, "B");
    // The source is unaffected.
    seen.extend(s.body().await.body);
    let all = String::from_utf8_lossy(&seen).to_string();
    assert!(all.ends_with("data: [DONE]\n\n"), "{all}");
    let want = ok(
        &off,
        "/v1/chat/completions",
        &chat(msgs("Write a long story."), 60),
    )
    .await;
    assert_eq!(streamed_text(&all), text_of(&want));
}

/// A server whose KV memory holds exactly `blocks` blocks.
fn tight(blocks: usize, on: bool) -> ServerConfig {
    let mut c = prefix_cfg(on);
    c.engine.kv_mem_bytes = blocks as u64 * BLOCK as u64 * BYTES_PER_TOKEN;
    c
}

fn completion(prompt: &[u32], max_tokens: usize) -> Value {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": true, "logprobs": 3})
}

/// 40 token ids that start differently for each `seed`.
fn prompt(seed: u32) -> Vec<u32> {
    (0..40).map(|i| 32 + (seed * 7 + i * 3) % 90).collect()
}

#[tokio::test]
async fn tight_kv_memory_evicts_cached_prefixes_instead_of_refusing() {
    // 16 blocks = 256 positions: four 64-token requests at a time, or one of 256.
    let on = start(tiny(), tight(16, true)).await;
    let off = start(tiny(), tight(16, false)).await;
    let cap = on.engine.shared().gauges().kv_capacity_bytes;
    assert_eq!(cap, 16 * BLOCK as u64 * BYTES_PER_TOKEN);
    for seed in 0..8 {
        ok(&on, "/v1/completions", &completion(&prompt(seed), 24)).await;
        let g = on.engine.shared().gauges();
        assert!(g.prefix_cache_bytes + g.kv_reserved_bytes <= cap, "{g:?}");
        // 40 + 23 fed tokens: 4 blocks per entry, so at most 4 fit.
        assert!(g.prefix_cache_entries <= 4, "{g:?}");
    }
    assert!(entries(&on, 4).await);
    // Eight at once: they run four by four, all complete.
    let mut tasks = Vec::new();
    for seed in 10..18 {
        let addr = on.addr;
        tasks.push(tokio::spawn(async move {
            post(addr, "/v1/completions", &completion(&prompt(seed), 24)).await
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().status, 200);
    }
    // Which of those are still cached depends on their arrival order; this one is, now.
    ok(&on, "/v1/completions", &completion(&prompt(17), 24)).await;
    // A request needing the whole budget, whose prompt extends a cached one: every other entry
    // is evicted, then its source too (after its rows are copied).
    let mut p = prompt(17);
    p.extend([40, 41, 42, 43, 44, 45, 46, 47, 48, 49]);
    let max = 256 - p.len();
    let big = tokio::time::timeout(
        Duration::from_secs(20),
        ok(&on, "/v1/completions", &completion(&p, max)),
    )
    .await
    .expect("the big request was admitted");
    assert!(cached_of(&big) >= 40, "{}", big["usage"]);
    let big_off = ok(&off, "/v1/completions", &completion(&p, max)).await;
    same(&big, &big_off, "big");
    assert!(
        entries(&on, 1).await,
        "only the big request's cache is left"
    );
    let g = on.engine.shared().gauges();
    assert_eq!(g.kv_reserved_bytes, 0);
    assert!(g.prefix_cache_bytes <= cap);
}

#[tokio::test]
async fn cancellation_frees_blocks_with_prefix_caching_on() {
    let mut c = tight(16, true);
    c.engine.step_delay = Duration::from_millis(10);
    let h = start(tiny(), c).await;
    let p = prompt(3);
    let mut body = completion(&p, 200);
    body["stream"] = json!(true);
    let mut s = open(
        h.addr,
        "POST",
        "/v1/completions",
        &[],
        Some(&body.to_string()),
    )
    .await;
    assert_eq!(s.status, 200);
    for _ in 0..3 {
        s.next().await.expect("frames");
    }
    assert_eq!(h.engine.shared().gauges().running, 1);
    drop(s);
    assert!(
        wait_until(Duration::from_secs(3), || {
            let g = h.engine.shared().gauges();
            g.running == 0 && g.kv_reserved_bytes == 0
        })
        .await,
        "the cancelled request's blocks were not freed"
    );
    assert_eq!(h.engine.shared().metrics.finished("cancelled"), 1);
    // The whole budget is available again: a request needing all of it runs.
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        ok(&h, "/v1/completions", &completion(&prompt(9), 256 - 40)),
    )
    .await
    .expect("admitted");
    assert_eq!(r["usage"]["completion_tokens"], 256 - 40);
    assert!(
        wait_until(Duration::from_secs(3), || {
            let g = h.engine.shared().gauges();
            (g.running, g.kv_reserved_bytes) == (0, 0)
        })
        .await
    );
}

/// The paged KV cache (`--kv-paged`) with prefix caching on or off, a pool of `blocks` blocks.
fn paged(blocks: usize, on: bool) -> ServerConfig {
    let mut c = tight(blocks, on);
    c.engine.paged_kv = true;
    c
}

/// Waits until nothing runs or waits and no sequence holds a block (cached blocks only the
/// prefix cache holds do not count).
async fn no_blocks_held(h: &ServerHandle) -> bool {
    wait_until(Duration::from_secs(5), || {
        let g = h.engine.shared().gauges();
        g.running == 0 && g.queued == 0 && g.kv_blocks_used == 0
    })
    .await
}

/// With the paged KV cache, full blocks stay cached and are shared: a request extending an
/// earlier prompt and a chat sent again start from the cached blocks (exactly the full blocks
/// of the shared tokens), and every answer equals the one computed without the cache, to the
/// last bit of its log-probabilities.
#[tokio::test]
async fn paged_blocks_are_shared_by_their_tokens_and_answers_are_unchanged() {
    let on = start(tiny(), paged(64, true)).await;
    let off = start(tiny(), paged(64, false)).await;
    let a = prompt(1);
    let ra = ok(&on, "/v1/completions", &completion(&a, 24)).await;
    same(
        &ra,
        &ok(&off, "/v1/completions", &completion(&a, 24)).await,
        "first",
    );
    assert_eq!(cached_of(&ra), 0, "nothing to reuse yet");
    assert!(no_blocks_held(&on).await);
    // 40 prompt + 23 fed tokens: 3 full blocks cached.
    assert_eq!(on.engine.shared().gauges().prefix_cache_entries, 3);

    // The same 40 tokens and 10 more: blocks 0 and 1 (32 tokens) are shared; block 2 holds
    // prompt tokens 32..40 and generated ones, so the new prompt's block 2 differs.
    let mut b = a.clone();
    b.extend(100..110);
    let rb = ok(&on, "/v1/completions", &completion(&b, 24)).await;
    same(
        &rb,
        &ok(&off, "/v1/completions", &completion(&b, 24)).await,
        "extended",
    );
    assert_eq!(cached_of(&rb), 2 * BLOCK as u64, "{}", rb["usage"]);
    assert_eq!(hits(&on), 1);

    // The same chat twice: the second starts from the first's blocks, all its full blocks but
    // the one holding its last prompt token.
    let follow = chat(
        json!([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "cats?"}]),
        16,
    );
    let f1 = ok(&on, "/v1/chat/completions", &follow).await;
    let f2 = ok(&on, "/v1/chat/completions", &follow).await;
    same(&f1, &f2, "the same chat twice");
    same(
        &f2,
        &ok(&off, "/v1/chat/completions", &follow).await,
        "chat",
    );
    let p = f2["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        cached_of(&f2),
        (p - 1) / BLOCK as u64 * BLOCK as u64,
        "{}",
        f2["usage"]
    );
    assert_eq!(
        cached_of(&ok(&off, "/v1/chat/completions", &follow).await),
        0
    );
    assert!(no_blocks_held(&on).await);
    assert!(no_blocks_held(&off).await);
    assert_eq!(off.engine.shared().gauges().prefix_cache_entries, 0);
}

/// A pool too small for the load with prefix caching on: cached blocks are evicted before any
/// sequence is preempted or waits, sequences are still preempted when the running ones need
/// every block (and readmitted with whatever of their blocks is still cached), and every answer
/// equals the same request on a large pool without the cache. Every block comes back.
#[tokio::test]
async fn paged_prefix_cache_under_a_tight_pool_evicts_and_preempts_without_changing_answers() {
    // 16 blocks: four requests of 40 + 24 positions at most.
    let on = start(tiny(), paged(16, true)).await;
    let off = start(tiny(), paged(256, false)).await;
    let mut want = Vec::new();
    for seed in 0..12 {
        want.push(ok(&off, "/v1/completions", &completion(&prompt(seed), 24)).await);
    }
    // One at a time: each leaves its blocks cached; older ones are evicted to admit new ones.
    for seed in 0..6 {
        let r = ok(&on, "/v1/completions", &completion(&prompt(seed), 24)).await;
        same(&r, &want[seed as usize], "sequential");
        assert!(on.engine.shared().gauges().prefix_cache_entries <= 16);
    }
    // Each leaves 3 full blocks (40 prompt + 8 generated tokens): the sixth needed the first
    // one's, least recently used, whose answer is computed again in full.
    let first = ok(&on, "/v1/completions", &completion(&prompt(0), 24)).await;
    same(&first, &want[0], "evicted");
    assert_eq!(cached_of(&first), 0, "{}", first["usage"]);
    // The last one again: its blocks are still cached.
    let again = ok(&on, "/v1/completions", &completion(&prompt(5), 24)).await;
    same(&again, &want[5], "again");
    assert_eq!(cached_of(&again), 2 * BLOCK as u64);
    // Twelve at once, three of them cached: all complete, each as on the large pool.
    let mut tasks = Vec::new();
    for seed in 0..12u32 {
        let addr = on.addr;
        tasks.push(tokio::spawn(async move {
            post(addr, "/v1/completions", &completion(&prompt(seed), 24)).await
        }));
    }
    for (seed, t) in tasks.into_iter().enumerate() {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        same(&r.json(), &want[seed], "concurrent");
    }
    assert!(
        no_blocks_held(&on).await,
        "{:?}",
        on.engine.shared().gauges()
    );
    assert!(on.engine.shared().gauges().prefix_cache_entries <= 16);
    let preempted = on
        .engine
        .shared()
        .metrics
        .preemptions
        .load(Ordering::Relaxed);
    assert!(preempted > 0, "the load was meant to preempt");
}

/// Requests arriving together with the same long start, prefilled in chunks: the first computes
/// the shared blocks and the others take them as they fill instead of computing them beside it
/// (a batch of chats with one system prompt, all sent at once); every answer is unchanged.
#[tokio::test]
async fn paged_requests_arriving_together_share_the_blocks_the_first_computes() {
    let mut c = paged(256, true);
    c.engine.max_batch_tokens = 32;
    let on = start(tiny(), c).await;
    arriving_together(&on).await;
}

/// The same with a budget that fits every prompt in one step, the six admitted in one iteration
/// while another request keeps the engine busy: the planner lets the first compute the shared
/// blocks and the others wait a step for them instead of computing them beside it.
#[tokio::test]
async fn paged_requests_arriving_together_under_a_large_budget_compute_the_shared_blocks_once() {
    let mut c = paged(256, true);
    c.engine.max_batch_tokens = 1024;
    c.engine.step_delay = Duration::from_millis(40);
    let on = start(tiny(), c).await;
    let busy = {
        let addr = on.addr;
        // What the tiny model's 256 positions allow (about 8 s at this pace): outlasts the
        // six, then cancelled.
        let body = completion(&prompt(99), 200);
        tokio::spawn(async move { post(addr, "/v1/completions", &body).await })
    };
    let started = wait_until(Duration::from_secs(5), || {
        on.engine.shared().gauges().running == 1
    })
    .await;
    if !started {
        let r = busy.await.unwrap();
        panic!("the busy request did not start: {} {}", r.status, r.text());
    }
    arriving_together(&on).await;
    assert_eq!(
        on.engine.shared().gauges().running,
        1,
        "the busy request ended early"
    );
    busy.abort();
}

/// Six prompts with the same 100-token start sent at once to `on` (paged, prefix cache on):
/// every answer equals the one computed without the prefix cache, and all but the one that
/// computed them take the 6 shared full blocks from the cache.
async fn arriving_together(on: &ServerHandle) {
    let off = start(tiny(), paged(256, false)).await;
    let common: Vec<u32> = (0..100).map(|i| 32 + (i * 5) % 90).collect();
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|k| {
            let mut p = common.clone();
            p.extend([40 + k, 50 + k, 60 + k]);
            p
        })
        .collect();
    let mut want = Vec::new();
    for p in &prompts {
        want.push(ok(&off, "/v1/completions", &completion(p, 16)).await);
    }
    let mut tasks = Vec::new();
    for p in prompts.clone() {
        let addr = on.addr;
        tasks.push(tokio::spawn(async move {
            post(addr, "/v1/completions", &completion(&p, 16)).await
        }));
    }
    let mut cached = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        same(&v, &want[i], "together");
        cached.push(cached_of(&v));
    }
    // 100 shared tokens: 6 full blocks; all but the request that computed them share them.
    let full = (100 / BLOCK * BLOCK) as u64;
    let sharing = cached.iter().filter(|&&c| c == full).count();
    assert!(sharing >= prompts.len() - 1, "cached tokens {cached:?}");
    let m = &on.engine.shared().metrics;
    assert_eq!(
        m.prompt_tokens_cached.load(Ordering::Relaxed),
        cached.iter().sum::<u64>()
    );
}
