//! Router tests in process (no socket): every route, request validation, the OpenAI error shape,
//! SSE framing, auth, CORS, body limit, queue limit, engine death. The model is the tiny random
//! Llama checkpoint of the models crate, so generation is real but takes milliseconds.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use hf2q_server::routes::{router, AppState};
use hf2q_server::{Engine, ServerConfig};
use serde_json::{json, Value};
use tower::ServiceExt;

use common::*;

fn app_with(cfg: ServerConfig) -> (Router, Engine) {
    let engine = Engine::start(tiny(), cfg.engine.clone()).unwrap();
    let state = Arc::new(AppState::new(engine.clone(), cfg).unwrap());
    (router(state), engine)
}

fn app() -> Router {
    app_with(cfg()).0
}

struct Out {
    status: StatusCode,
    content_type: String,
    body: String,
}

impl Out {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
    /// Asserts the OpenAI error shape and returns the error object.
    fn error(&self, status: u16) -> Value {
        assert_eq!(self.status.as_u16(), status, "{}", self.body);
        let v = self.json();
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
        e.clone()
    }
}

async fn call(
    app: &Router,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<String>,
) -> Out {
    let mut b = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(body.map_or_else(Body::empty, Body::from)).unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let content_type = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    Out {
        status,
        content_type,
        body: String::from_utf8_lossy(&bytes).to_string(),
    }
}

async fn post_json(app: &Router, path: &str, v: Value) -> Out {
    call(
        app,
        "POST",
        path,
        &[("content-type", "application/json")],
        Some(v.to_string()),
    )
    .await
}

#[tokio::test]
async fn models_health_metrics() {
    let app = app();
    let m = call(&app, "GET", "/v1/models", &[], None).await;
    assert_eq!(m.status, 200);
    let v = m.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tiny");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["meta"]["context_length"], 256);
    assert_eq!(
        call(&app, "GET", "/v1/models/tiny", &[], None).await.status,
        200
    );
    call(&app, "GET", "/v1/models/gpt-4", &[], None)
        .await
        .error(404);

    let h = call(&app, "GET", "/health", &[], None).await;
    assert_eq!(
        (h.status.as_u16(), h.json()["status"].as_str()),
        (200, Some("ok"))
    );

    let _ = post_json(&app, "/v1/chat/completions", chat_body("hi", 3, false)).await;
    let m = call(&app, "GET", "/metrics", &[], None).await;
    assert!(
        m.content_type.starts_with("text/plain; version=0.0.4"),
        "{}",
        m.content_type
    );
    for name in [
        "hf2q_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 1",
        "hf2q_queue_depth 0",
        "hf2q_running_sequences 0",
        "hf2q_kv_capacity_bytes",
        "hf2q_generation_tokens_per_second",
        "hf2q_time_to_first_token_seconds_count 1",
        "hf2q_prompt_tokens_total",
    ] {
        assert!(m.body.contains(name), "{name} missing:\n{}", m.body);
    }
}

#[tokio::test]
async fn chat_non_streaming() {
    let app = app();
    let o = post_json(
        &app,
        "/v1/chat/completions",
        chat_body("Hello there", 6, false),
    )
    .await;
    assert_eq!(o.status, 200, "{}", o.body);
    assert!(o.content_type.starts_with("application/json"));
    let v = o.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], "tiny");
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["message"]["role"], "assistant");
    assert!(c["message"]["content"].is_string());
    assert!(["stop", "length"].contains(&c["finish_reason"].as_str().unwrap()));
    assert_eq!(c["logprobs"], Value::Null);
    let u = &v["usage"];
    assert!(u["prompt_tokens"].as_u64().unwrap() > 3);
    assert!(u["completion_tokens"].as_u64().unwrap() <= 6);
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap())
    );

    // Greedy is deterministic.
    let again = post_json(
        &app,
        "/v1/chat/completions",
        chat_body("Hello there", 6, false),
    )
    .await
    .json();
    assert_eq!(again["choices"][0]["message"], c["message"]);
}

#[tokio::test]
async fn chat_streaming_framing() {
    let app = app();
    let mut body = chat_body("Hello there", 5, true);
    body["stream_options"] = json!({"include_usage": true});
    let o = post_json(&app, "/v1/chat/completions", body).await;
    assert_eq!(o.status, 200);
    assert!(
        o.content_type.starts_with("text/event-stream"),
        "{}",
        o.content_type
    );
    assert!(o.body.ends_with("data: [DONE]\n\n"), "{}", o.body);
    // Every frame is exactly `data: ...\n\n`.
    for frame in o.body.split_terminator("\n\n") {
        assert!(
            frame.starts_with("data: ") && !frame.contains('\n'),
            "{frame:?}"
        );
    }
    let data = sse_data(&o.body);
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let id = chunks[0]["id"].clone();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        assert!(
            c.get("usage").is_some(),
            "include_usage: every chunk has a usage field: {c}"
        );
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": "", "refusal": null})
    );
    let n = chunks.len();
    let last_choice = &chunks[n - 2]["choices"][0];
    assert_eq!(last_choice["delta"], json!({}));
    assert!(last_choice["finish_reason"].is_string());
    assert_eq!(chunks[n - 1]["choices"], json!([]));
    let usage = &chunks[n - 1]["usage"];
    assert!(usage["completion_tokens"].as_u64().unwrap() <= 5);
    for c in &chunks[..n - 1] {
        assert_eq!(c["usage"], Value::Null);
    }
    // The streamed text equals the non-streamed one.
    let full = post_json(
        &app,
        "/v1/chat/completions",
        chat_body("Hello there", 5, false),
    )
    .await
    .json();
    assert_eq!(
        streamed_text(&o.body),
        full["choices"][0]["message"]["content"].as_str().unwrap()
    );
    // Without include_usage there is no usage field at all.
    let o = post_json(
        &app,
        "/v1/chat/completions",
        chat_body("Hello there", 2, true),
    )
    .await;
    let first: Value = serde_json::from_str(&sse_data(&o.body)[0]).unwrap();
    assert!(first.get("usage").is_none(), "{first}");
}

#[tokio::test]
async fn completions_both_ways() {
    let app = app();
    let body = json!({"model": "tiny", "prompt": ["The cat", "A dog"], "max_tokens": 4, "temperature": 0, "n": 2});
    let v = post_json(&app, "/v1/completions", body.clone())
        .await
        .json();
    assert_eq!(v["object"], "text_completion");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    // Greedy: the n copies of one prompt agree.
    assert_eq!(choices[0]["text"], choices[1]["text"]);

    let mut s = body.clone();
    s["stream"] = json!(true);
    let o = post_json(&app, "/v1/completions", s).await;
    assert!(o.body.ends_with("data: [DONE]\n\n"));
    let mut texts = vec![String::new(); 4];
    let mut finished = 0;
    for d in sse_data(&o.body) {
        if d == "[DONE]" {
            continue;
        }
        let c: Value = serde_json::from_str(&d).unwrap();
        assert_eq!(c["object"], "text_completion");
        let ch = &c["choices"][0];
        texts[ch["index"].as_u64().unwrap() as usize].push_str(ch["text"].as_str().unwrap());
        finished += ch["finish_reason"].is_string() as usize;
    }
    assert_eq!(finished, 4);
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(t, choices[i]["text"].as_str().unwrap(), "choice {i}");
    }

    // echo and token-id prompts.
    let v = post_json(
        &app,
        "/v1/completions",
        json!({"prompt": "Hi", "echo": true, "max_tokens": 2, "temperature": 0}),
    )
    .await
    .json();
    assert!(
        v["choices"][0]["text"].as_str().unwrap().starts_with("Hi"),
        "{v}"
    );
    let v = post_json(
        &app,
        "/v1/completions",
        json!({"prompt": [256, 72, 105], "max_tokens": 2}),
    )
    .await
    .json();
    assert_eq!(v["usage"]["prompt_tokens"], 3);
}

#[tokio::test]
async fn logprobs() {
    let app = app();
    let mut b = chat_body("Hi", 4, false);
    b["logprobs"] = json!(true);
    b["top_logprobs"] = json!(3);
    b["ignore_eos"] = json!(true);
    let v = post_json(&app, "/v1/chat/completions", b).await.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4, "{v}");
    for t in content {
        let lp = t["logprob"].as_f64().unwrap();
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy picks the most likely token.
        assert!((lp - top[0]["logprob"].as_f64().unwrap()).abs() < 1e-6);
        assert!(lp <= 0.0);
        assert!(t["bytes"].is_array());
    }
    let v = post_json(
        &app,
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 3, "logprobs": 2, "ignore_eos": true}),
    )
    .await
    .json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3, "{v}");
    assert_eq!(lp["text_offset"][0], 0);
    assert_eq!(
        lp["top_logprobs"][0].as_object().unwrap().len().min(2),
        lp["top_logprobs"][0].as_object().unwrap().len()
    );
}

#[tokio::test]
async fn stop_strings_and_seeds() {
    let app = app();
    let base = post_json(
        &app,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 12, "temperature": 0, "ignore_eos": true}),
    )
    .await
    .json();
    let text = base["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    if chars.len() >= 4 {
        let stop: String = chars[2..4].iter().collect();
        let v = post_json(&app, "/v1/completions", json!({"prompt": "x", "max_tokens": 12, "temperature": 0, "stop": stop, "ignore_eos": true})).await.json();
        let got = v["choices"][0]["text"].as_str().unwrap();
        assert!(
            !got.contains(&stop) && text.starts_with(got),
            "{got:?} vs {text:?} stop {stop:?}"
        );
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
    let seeded = json!({"prompt": "x", "max_tokens": 8, "temperature": 1.0, "seed": 7});
    let a = post_json(&app, "/v1/completions", seeded.clone())
        .await
        .json();
    let b = post_json(&app, "/v1/completions", seeded).await.json();
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
}

#[tokio::test]
async fn validation_errors() {
    let app = app();
    let chat = |v: Value| post_json(&app, "/v1/chat/completions", v);
    let e = call(
        &app,
        "POST",
        "/v1/chat/completions",
        &[],
        Some("{not json".into()),
    )
    .await
    .error(400);
    assert_eq!(e["code"], "invalid_json");
    chat(json!({"messages": "hi"})).await.error(422);
    chat(json!({"model": "tiny"})).await.error(422);
    let e = chat(json!({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}))
        .await
        .error(404);
    assert_eq!(e["code"], "model_not_found");
    let e = chat(json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}))
        .await
        .error(400);
    assert_eq!(e["param"], "max_tokens");
    let e = chat(json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 250}))
        .await
        .error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    let long = "word ".repeat(300);
    let e = chat(json!({"messages": [{"role": "user", "content": long}]}))
        .await
        .error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    let e = chat(json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "no spaces"}}]})).await.error(400);
    assert_eq!(e["param"], "tools[0].function.name", "{e}");
    let e = chat(json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {}}})).await.error(400);
    assert_eq!(e["param"], "response_format.json_schema.name", "{e}");
    let e = chat(json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "if": {}, "then": {}}}}})).await.error(400);
    assert_eq!(e["param"], "response_format.json_schema.schema", "{e}");
    assert_eq!(e["code"], "unsupported_schema", "{e}");
    let e = chat(json!({"messages": [{"role": "user", "content": "x"}], "whatever": 1}))
        .await
        .error(400);
    assert!(e["message"].as_str().unwrap().contains("whatever"));
    call(&app, "GET", "/v1/nothing", &[], None).await.error(404);
    call(&app, "GET", "/v1/chat/completions", &[], None)
        .await
        .error(405);
    let e = post_json(&app, "/detokenize", json!({"tokens": [999999]}))
        .await
        .error(400);
    assert_eq!(e["param"], "tokens");
}

#[tokio::test]
async fn tokenize_roundtrip() {
    let app = app();
    let v = post_json(
        &app,
        "/tokenize",
        json!({"content": "Hello world", "with_pieces": true}),
    )
    .await
    .json();
    let ids = v["tokens"].as_array().unwrap().clone();
    assert_eq!(v["count"], ids.len());
    assert_eq!(v["pieces"].as_array().unwrap().len(), ids.len());
    let plain = post_json(
        &app,
        "/tokenize",
        json!({"content": "Hello world", "add_special": false}),
    )
    .await
    .json();
    let v = post_json(&app, "/detokenize", json!({"tokens": plain["tokens"]}))
        .await
        .json();
    assert_eq!(v["content"], "Hello world");
    let chat = post_json(
        &app,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await
    .json();
    let prompt = post_json(&app, "/v1/chat/completions", chat_body("hi", 1, false))
        .await
        .json();
    assert_eq!(chat["count"], prompt["usage"]["prompt_tokens"]);
}

#[tokio::test]
async fn api_key_guards_all_but_health_and_ui() {
    let mut c = cfg();
    c.api_key = Some("sekret".into());
    let (app, _) = app_with(c);
    let e = call(&app, "GET", "/v1/models", &[], None).await.error(401);
    assert_eq!(e["code"], "invalid_api_key");
    call(
        &app,
        "GET",
        "/v1/models",
        &[("authorization", "Bearer wrong")],
        None,
    )
    .await
    .error(401);
    assert_eq!(
        call(
            &app,
            "GET",
            "/v1/models",
            &[("authorization", "Bearer sekret")],
            None
        )
        .await
        .status,
        200
    );
    post_json(&app, "/v1/chat/completions", chat_body("x", 1, false))
        .await
        .error(401);
    post_json(&app, "/tokenize", json!({"content": "x"}))
        .await
        .error(401);
    call(&app, "GET", "/metrics", &[], None).await.error(401);
    assert_eq!(call(&app, "GET", "/health", &[], None).await.status, 200);
    let ui = call(&app, "GET", "/", &[], None).await;
    assert_eq!(ui.status, 200);
    assert!(ui.content_type.starts_with("text/html"));
    assert_eq!(call(&app, "GET", "/app.js", &[], None).await.status, 200);
    assert_eq!(call(&app, "GET", "/style.css", &[], None).await.status, 200);
}

#[tokio::test]
async fn cors_only_when_configured() {
    let pre = [
        ("origin", "http://example.test"),
        ("access-control-request-method", "POST"),
    ];
    let app = app();
    let resp = app
        .clone()
        .oneshot(
            Request::builder()
                .method("GET")
                .uri("/v1/models")
                .header("origin", "http://example.test")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert!(resp.headers().get("access-control-allow-origin").is_none());

    let mut c = cfg();
    c.cors_origins = vec!["http://example.test".into()];
    c.api_key = Some("k".into());
    let (app, _) = app_with(c);
    let mut b = Request::builder()
        .method("OPTIONS")
        .uri("/v1/chat/completions");
    for (k, v) in pre {
        b = b.header(k, v);
    }
    let resp = app
        .clone()
        .oneshot(b.body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 204, "a preflight needs no API key");
    assert_eq!(
        resp.headers()["access-control-allow-origin"],
        "http://example.test"
    );
    assert!(resp.headers()["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .contains("authorization"));
    let resp = app
        .clone()
        .oneshot(
            Request::builder()
                .uri("/v1/models")
                .header("origin", "http://other.test")
                .header("authorization", "Bearer k")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert!(resp.headers().get("access-control-allow-origin").is_none());
}

#[tokio::test]
async fn body_limit_is_413() {
    let mut c = cfg();
    c.max_body_bytes = 1000;
    let (app, _) = app_with(c);
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]});
    let e = post_json(&app, "/v1/chat/completions", big)
        .await
        .error(413);
    assert!(e["message"].as_str().unwrap().contains("1000"));
}

#[tokio::test]
async fn full_queue_is_429() {
    let mut c = cfg();
    c.engine.max_seqs = 1;
    c.engine.max_queue = 1;
    c.engine.step_delay = Duration::from_millis(20);
    let (app, engine) = app_with(c);
    let long = |app: Router| async move {
        let mut b = chat_body("x", 100, false);
        b["ignore_eos"] = json!(true);
        post_json(&app, "/v1/chat/completions", b).await
    };
    let running = tokio::spawn(long(app.clone()));
    assert!(
        wait_until(Duration::from_secs(5), || engine.shared().gauges().running
            == 1)
        .await
    );
    let queued = tokio::spawn(long(app.clone()));
    assert!(
        wait_until(Duration::from_secs(5), || engine.shared().gauges().queued
            == 1)
        .await
    );
    let e = post_json(&app, "/v1/chat/completions", chat_body("x", 1, false))
        .await
        .error(429);
    assert_eq!(e["code"], "rate_limit_exceeded");
    running.abort();
    queued.abort();
    // Both aborted handlers cancel their sequences.
    assert!(wait_until(Duration::from_secs(5), || !engine.shared().busy()).await);
}

#[tokio::test]
async fn request_time_limit() {
    let mut c = cfg();
    c.request_timeout = Duration::from_millis(300);
    c.engine.step_delay = Duration::from_millis(20);
    let (app, _) = app_with(c);
    let mut b = chat_body("x", 200, false);
    b["ignore_eos"] = json!(true);
    let t0 = std::time::Instant::now();
    let v = post_json(&app, "/v1/chat/completions", b).await.json();
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < 200);
}

#[tokio::test]
async fn engine_death_is_503_and_ends_the_server() {
    let mut h = start(tiny(), cfg()).await;
    let addr = h.addr;
    assert_eq!(http(addr, "GET", "/health", &[], None).await.status, 200);
    h.engine.crash_for_test();
    assert!(wait_until(Duration::from_secs(5), || h.engine.shared().is_dead()).await);
    // The server task ends with EngineDied (the CLI then exits non-zero).
    let r = tokio::time::timeout(Duration::from_secs(5), async {
        h.shutdown();
        h.wait().await
    })
    .await
    .expect("server ends");
    assert!(matches!(r, Err(hf2q_server::Error::EngineDied)), "{r:?}");
}

#[tokio::test]
async fn dead_engine_answers_503() {
    let (app, engine) = app_with(cfg());
    engine.crash_for_test();
    assert!(wait_until(Duration::from_secs(5), || engine.shared().is_dead()).await);
    let h = call(&app, "GET", "/health", &[], None).await;
    assert_eq!(h.status, 503);
    post_json(&app, "/v1/chat/completions", chat_body("x", 1, false))
        .await
        .error(503);
    let m = call(&app, "GET", "/metrics", &[], None).await;
    assert!(m.body.contains("hf2q_up 0"));
}

#[tokio::test]
async fn health_reports_a_stuck_engine() {
    let mut c = cfg();
    // Each step "hangs" for 400 ms, longer than the 100 ms the health check tolerates.
    c.engine.step_delay = Duration::from_millis(400);
    c.stuck_after = Duration::from_millis(100);
    let (app, engine) = app_with(c);
    assert_eq!(
        call(&app, "GET", "/health", &[], None).await.status,
        200,
        "idle is healthy"
    );
    let app2 = app.clone();
    let busy = tokio::spawn(async move {
        post_json(&app2, "/v1/chat/completions", chat_body("x", 3, false)).await
    });
    assert!(
        wait_until(Duration::from_secs(3), || engine.shared().gauges().running
            == 1)
        .await
    );
    tokio::time::sleep(Duration::from_millis(250)).await;
    let h = call(&app, "GET", "/health", &[], None).await;
    assert_eq!(h.status, 503, "{}", h.body);
    assert!(h.body.contains("no progress"), "{}", h.body);
    busy.abort();
}

#[tokio::test]
async fn queued_request_times_out_with_503() {
    use hf2q_server::engine::{Event, GenRequest};
    let mut c = cfg();
    c.engine.max_seqs = 1;
    c.engine.step_delay = Duration::from_millis(10);
    let engine = Engine::start(tiny(), c.engine.clone()).unwrap();
    let req = |deadline| GenRequest {
        prompt: vec![256, 72, 105],
        max_tokens: 100,
        sampler: hf2q_models::sampler::SamplerConfig::greedy(),
        stop: vec![],
        logprobs: None,
        ignore_eos: true,
        deadline,
        constraint: None,
        keep_tokens: vec![],
        adapter: None,
    };
    let mut first = engine.submit(req(None)).unwrap();
    let mut second = engine
        .submit(req(Some(
            std::time::Instant::now() + Duration::from_millis(150),
        )))
        .unwrap();
    match second.recv().await {
        Event::Error { status, message } => assert_eq!(status, 503, "{message}"),
        other => panic!("expected a 503 error, got {other:?}"),
    }
    // The running one is unaffected and runs to its length.
    loop {
        match first.recv().await {
            Event::Done {
                completion_tokens, ..
            } => {
                assert_eq!(completion_tokens, 100);
                break;
            }
            Event::Delta { .. } => {}
            e => panic!("{e:?}"),
        }
    }
    assert_eq!(engine.shared().metrics.finished("timeout"), 1);
}
