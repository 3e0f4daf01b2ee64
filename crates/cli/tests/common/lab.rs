//! A real `hf2q serve` with the Lab for the `/api` tests: started with the committed tiny Llama
//! and an API key, and a small HTTP client of its `/api` (JSON calls, jobs, SSE).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The API key the test servers are started with.
pub const KEY: &str = "lab-test-key";

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// The server (killed when dropped) and its `127.0.0.1:PORT`.
pub struct Server {
    pub served: super::Served,
    pub addr: String,
}

impl Server {
    pub fn start(home: &Path) -> Server {
        Server::start_env(home, &[])
    }

    /// With `env` added to the server's environment (and so its jobs').
    pub fn start_env(home: &Path, env: &[(&str, &str)]) -> Server {
        let tiny = super::tiny();
        let s = super::serve_env(
            home,
            &[
                tiny.to_str().unwrap(),
                "--api-key",
                KEY,
                "--lab-jobs",
                "2",
                "--lab-grace",
                "10",
                "-c",
                "256",
                "--kv-mem",
                "64M",
            ],
            env,
        );
        let addr = s.addr.clone();
        Server { served: s, addr }
    }

    pub fn kill9(mut self) {
        unsafe { libc::kill(self.served.child.id() as i32, libc::SIGKILL) };
        let _ = self.served.child.wait();
    }

    /// One request; `headers` replace the default key and JSON content type when given.
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> (u16, String, String) {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n",
            self.addr
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        let body = body.unwrap_or("");
        req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
        s.write_all(req.as_bytes()).unwrap();
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).unwrap();
        let resp = String::from_utf8_lossy(&resp).into_owned();
        let (head, rest) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(rest)
        } else {
            rest.to_string()
        };
        (status, head.to_string(), body)
    }

    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let auth = format!("Bearer {KEY}");
        let mut h = vec![("Authorization", auth.as_str())];
        if method != "GET" {
            h.push(("Content-Type", "application/json"));
        }
        let b = body.map(|b| b.to_string());
        let (st, _, text) = self.raw(method, path, &h, b.as_deref());
        (
            st,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub fn submit(&self, kind: &str, params: Value) -> i64 {
        let (st, v) = self.call(
            "POST",
            "/api/jobs",
            Some(json!({"kind": kind, "params": params})),
        );
        assert_eq!(st, 201, "{v}");
        v["id"].as_i64().unwrap()
    }

    pub fn wait(&self, id: i64, done: impl Fn(&Value) -> bool) -> Value {
        let t0 = Instant::now();
        loop {
            let (st, j) = self.call("GET", &format!("/api/jobs/{id}"), None);
            assert_eq!(st, 200, "{j}");
            if done(&j) {
                return j;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "job {id} stuck: {j}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn wait_final(&self, id: i64) -> Value {
        self.wait(id, |j| {
            !matches!(j["state"].as_str(), Some("queued" | "running"))
        })
    }

    /// The SSE stream of a job from `after`, read to its end: (ids, events).
    pub fn events(&self, id: i64, after: Option<u64>) -> Vec<(u64, Value)> {
        let auth = format!("Bearer {KEY}");
        let last = after.map(|a| a.to_string());
        let mut h = vec![("Authorization", auth.as_str())];
        if let Some(l) = &last {
            h.push(("Last-Event-ID", l.as_str()));
        }
        let (st, head, body) = self.raw("GET", &format!("/api/jobs/{id}/events"), &h, None);
        assert_eq!(st, 200, "{head}");
        assert!(head.to_ascii_lowercase().contains("text/event-stream"));
        parse_sse(&body)
    }
}

pub fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

pub fn parse_sse(body: &str) -> Vec<(u64, Value)> {
    let mut out = Vec::new();
    for frame in body.split("\n\n") {
        let mut id = None;
        let mut data = None;
        for l in frame.lines() {
            if let Some(v) = l.strip_prefix("id: ") {
                id = v.parse().ok();
            } else if let Some(v) = l.strip_prefix("data: ") {
                data = serde_json::from_str(v).ok();
            }
        }
        if let (Some(i), Some(d)) = (id, data) {
            out.push((i, d));
        }
    }
    out
}
