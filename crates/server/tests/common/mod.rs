//! Shared helpers for the server tests: models, server configs, a raw HTTP/1.1 client over
//! loopback (raw so that a test can drop a connection at an exact moment), SSE parsing.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use hf2q_models::Model;
use hf2q_server::{EngineConfig, ServerConfig, ServerHandle};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

pub fn tiny_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny/tiny-llama")
}

/// The tiny random Llama checkpoint of the models crate (259-token byte-level vocabulary,
/// 256 positions): real code paths, milliseconds per step.
pub fn tiny() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| Arc::new(Model::load(&tiny_path()).expect("tiny model")))
        .clone()
}

/// SmolLM2-135M-Instruct when `HF2Q_TEST_SMOLLM2_GGUF` names it; prints "skipped" otherwise.
pub fn smollm2(test: &str) -> Option<Arc<Model>> {
    match std::env::var("HF2Q_TEST_SMOLLM2_GGUF") {
        Ok(p) if !p.is_empty() => Some(Arc::new(Model::load(Path::new(&p)).expect("SmolLM2 GGUF"))),
        _ => {
            eprintln!("{test}: skipped (HF2Q_TEST_SMOLLM2_GGUF is not set)");
            None
        }
    }
}

/// Qwen2.5-Coder-0.5B-Instruct (Hermes-style tool calls) when `HF2Q_TEST_QWEN25_GGUF` names
/// it, on the fast CPU kernels the server runs with; prints "skipped" otherwise.
pub fn qwen25(test: &str) -> Option<Arc<Model>> {
    match std::env::var("HF2Q_TEST_QWEN25_GGUF") {
        Ok(p) if !p.is_empty() => {
            let mut m = Model::load(Path::new(&p)).expect("Qwen2.5 GGUF");
            m.set_matmul_path(hf2q_cpu::MatmulPath::Fast);
            m.warm_up().expect("warm-up");
            Some(Arc::new(m))
        }
        _ => {
            eprintln!("{test}: skipped (HF2Q_TEST_QWEN25_GGUF is not set)");
            None
        }
    }
}

/// A server config for a real model: a context that holds tool prompts.
pub fn real_cfg(model_id: &str) -> ServerConfig {
    let mut c = cfg();
    c.model_id = model_id.into();
    c.engine.ctx_size = 2048;
    c.engine.kv_mem_bytes = 512 << 20;
    c.engine.max_batch_tokens = 512;
    c
}

pub fn cfg() -> ServerConfig {
    ServerConfig {
        port: 0,
        model_id: "tiny".into(),
        engine: EngineConfig {
            ctx_size: 256,
            kv_mem_bytes: 64 << 20,
            max_seqs: 16,
            max_queue: 64,
            max_batch_tokens: 256,
            ..Default::default()
        },
        ..Default::default()
    }
}

pub async fn start(model: Arc<Model>, cfg: ServerConfig) -> ServerHandle {
    hf2q_server::start(model, cfg).await.expect("server starts")
}

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).to_string()
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn request_bytes(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Vec<u8> {
    let mut r = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        r.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    r.push_str("\r\n");
    let mut bytes = r.into_bytes();
    if let Some(b) = body {
        bytes.extend_from_slice(b.as_bytes());
    }
    bytes
}

/// An open response whose body is read incrementally.
pub struct Open {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    chunked: bool,
}

pub async fn open(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Open {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(&request_bytes(addr, method, path, headers, body))
        .await
        .expect("write");
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    reader.read_line(&mut line).await.expect("status line");
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line).await.expect("header");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    Open {
        status,
        headers,
        reader,
        chunked,
    }
}

impl Open {
    /// The next piece of body (`None` at the end).
    pub async fn next(&mut self) -> Option<Vec<u8>> {
        if !self.chunked {
            let mut buf = vec![0u8; 8192];
            let n = self.reader.read(&mut buf).await.ok()?;
            return (n > 0).then(|| buf[..n].to_vec());
        }
        let mut line = String::new();
        self.reader.read_line(&mut line).await.ok()?;
        let size = usize::from_str_radix(line.trim(), 16).ok()?;
        if size == 0 {
            return None;
        }
        let mut buf = vec![0u8; size + 2];
        self.reader.read_exact(&mut buf).await.ok()?;
        buf.truncate(size);
        Some(buf)
    }

    pub async fn body(mut self) -> Resp {
        let mut body = Vec::new();
        while let Some(b) = self.next().await {
            body.extend(b);
        }
        Resp {
            status: self.status,
            headers: self.headers,
            body,
        }
    }
}

pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Resp {
    open(addr, method, path, headers, body).await.body().await
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    http(addr, "POST", path, &[], Some(&body.to_string())).await
}

/// `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|f| f.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

/// The text of a streamed chat (all `delta.content`) or completion (all `text`).
pub fn streamed_text(body: &str) -> String {
    let mut out = String::new();
    for d in sse_data(body) {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&d).unwrap_or_else(|e| panic!("{e}: {d}"));
        for c in v["choices"].as_array().into_iter().flatten() {
            if let Some(t) = c["delta"]["content"]
                .as_str()
                .or_else(|| c["text"].as_str())
            {
                out.push_str(t);
            }
        }
    }
    out
}

/// Polls `f` until it holds or `limit` passes.
pub async fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}

pub fn chat_body(content: &str, max_tokens: usize, stream: bool) -> Value {
    serde_json::json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
}

/// One generated token: (token, logprob, [(top token, logprob)]).
type Tok = (String, f64, Vec<(String, f64)>);

/// The generated tokens of a chat response, streamed or not.
fn tokens_of(resp: &Resp, stream: bool) -> Vec<Tok> {
    let entry = |e: &Value| {
        let top = e["top_logprobs"].as_array().unwrap().iter().map(|t| {
            (
                t["token"].as_str().unwrap().to_string(),
                t["logprob"].as_f64().unwrap(),
            )
        });
        (
            e["token"].as_str().unwrap().to_string(),
            e["logprob"].as_f64().unwrap(),
            top.collect(),
        )
    };
    let mut out = Vec::new();
    if stream {
        for d in sse_data(&resp.text()).iter().filter(|d| *d != "[DONE]") {
            let v: Value = serde_json::from_str(d).unwrap();
            for c in v["choices"].as_array().unwrap() {
                out.extend(
                    c["logprobs"]["content"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(entry),
                );
            }
        }
    } else {
        out.extend(
            resp.json()["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(entry),
        );
    }
    out
}

/// Topics of the test prompts ("Tell me about {topic}."): one per concurrent request.
pub const TOPICS: [&str; 16] = [
    "cats",
    "the sea",
    "bread",
    "winter",
    "rust code",
    "a robot",
    "the moon",
    "tea",
    "rivers",
    "music",
    "chess",
    "trains",
    "gardens",
    "clocks",
    "bees",
    "maps",
];

/// `streams` requests at once, greedy (stream `i`: model `models[i % models.len()]`, e.g. the
/// base and served adapters, and topic `i / models.len() % 16`, so each topic runs on every
/// model in turn): every stream completes and equals the same request run alone afterwards.
/// Returns the streams' texts.
///
/// `tol`: `None` demands identical tokens. `Some(t)` is for kernels whose rounding depends on
/// the batch size (a fused one-token matvec beside a tiled matmul): at every position where the
/// runs agree, the chosen token's log-probability may differ by at most `t` nats, and a run may
/// diverge only at a near tie, where the solo run's two most likely tokens are within `2 t` and
/// the batched run picked the other of the two. Mixed-up KV caches or positions move
/// log-probabilities by whole nats and fail this.
pub async fn concurrent_equals_alone(
    model: std::sync::Arc<hf2q_models::Model>,
    model_id: &str,
    models: &[&str],
    streams: usize,
    max_tokens: usize,
    tol: Option<f64>,
    cfg: ServerConfig,
) -> Vec<String> {
    let mut c = cfg;
    c.model_id = model_id.into();
    c.engine.ctx_size = 512;
    c.engine.kv_mem_bytes = 1 << 30;
    c.engine.max_batch_tokens = 2048;
    let h = start(model, c).await;
    let addr = h.addr;
    let body = |i: usize, stream: bool| {
        let (t, m) = (
            TOPICS[i / models.len() % TOPICS.len()],
            models[i % models.len()],
        );
        json!({"model": m, "messages": [{"role": "user", "content": format!("Tell me about {t}.")}],
               "max_tokens": max_tokens, "temperature": 0, "stream": stream, "logprobs": true, "top_logprobs": 2})
    };
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..streams {
        let b = body(i, true);
        tasks.push(tokio::spawn(async move {
            post(addr, "/v1/chat/completions", &b).await
        }));
    }
    let mut together = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200);
        assert!(r.text().ends_with("data: [DONE]\n\n"), "{}", r.text());
        together.push((streamed_text(&r.text()), tokens_of(&r, true)));
    }
    let t_together = t0.elapsed();
    let t0 = Instant::now();
    let (mut ties, mut max_dev) = (0, 0f64);
    for i in 0..streams {
        let t = format!(
            "{} with {}",
            TOPICS[i / models.len() % TOPICS.len()],
            models[i % models.len()]
        );
        let alone = post(addr, "/v1/chat/completions", &body(i, false)).await;
        assert_eq!(alone.status, 200, "{}", alone.text());
        let text = alone.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let (a, b) = (tokens_of(&alone, false), &together[i].1);
        let same = a.iter().zip(b).take_while(|(x, y)| x.0 == y.0).count();
        for (x, y) in a.iter().zip(b).take(same) {
            max_dev = max_dev.max((x.1 - y.1).abs());
        }
        if together[i].0 == text {
            continue;
        }
        let Some(tol) = tol else {
            panic!(
                "prompt {i} ({t}): batched {:?} != solo {text:?}",
                together[i].0
            );
        };
        assert!(
            same < a.len().min(b.len()),
            "prompt {i} ({t}): texts differ, tokens agree"
        );
        let (solo, batched) = (&a[same], &b[same]);
        let gap = solo.2[0].1 - solo.2.get(1).map_or(f64::NEG_INFINITY, |x| x.1);
        let tie = gap < 2.0 * tol
            && solo.2.iter().any(|x| x.0 == batched.0)
            && batched.2.iter().any(|x| x.0 == solo.0);
        assert!(
            tie,
            "prompt {i} ({t}): batched {:?} != solo {text:?}; first differing token {same}: solo {solo:?} (top-2 gap {gap:.3}), batched {batched:?}",
            together[i].0
        );
        eprintln!("prompt {i} ({t}): diverges at token {same} on a near tie (gap {gap:.3} nats): {:?} vs {:?}", solo.0, batched.0);
        ties += 1;
    }
    eprintln!(
        "{model_id}: {streams} streams together {t_together:?}, one after another {:?}; {ties} near-tie divergences, \
         max |logprob difference| where the runs agree {max_dev:.2e}",
        t0.elapsed()
    );
    if let Some(tol) = tol {
        assert!(
            max_dev <= tol,
            "batched log-probabilities differ from solo ones by {max_dev} > {tol}"
        );
    } else {
        assert_eq!(max_dev, 0.0, "float paths must be batch-invariant");
    }
    together.into_iter().map(|t| t.0).collect()
}
