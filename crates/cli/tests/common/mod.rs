//! Helpers shared by the CLI integration tests: the binary, the committed tiny checkpoints,
//! output text, the clean-failure check, and a real `hf2q serve` on loopback.
#![allow(dead_code)] // each test file uses a part of them

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

pub mod lab;

/// A committed tiny checkpoint (`tiny-llama`, `tiny-qwen3`, ...).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures/tiny")
        .join(name)
}

pub fn tiny() -> PathBuf {
    fixture("tiny-llama")
}

/// Runs `hf2q args` to completion, with its model cache in a temporary folder (never the
/// user's).
pub fn hf2q(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hf2q"))
        .args(args)
        .env("HF2Q_HOME", std::env::temp_dir().join("hf2q-cli-test-home"))
        .output()
        .unwrap()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Asserts a clean failure: non-zero exit, `want` in the message, no panic.
pub fn fails_with(o: &Output, want: &str) {
    let e = stderr(o);
    assert!(!o.status.success(), "expected failure:\n{e}");
    assert!(e.contains(want), "expected '{want}' in:\n{e}");
    assert!(!e.contains("panicked"), "panic:\n{e}");
}

/// SmolLM2-135M-Instruct's GGUF when `HF2Q_TEST_SMOLLM2_GGUF` names it; prints "skipped"
/// otherwise.
pub fn smollm2(test: &str) -> Option<PathBuf> {
    match std::env::var("HF2Q_TEST_SMOLLM2_GGUF") {
        Ok(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ => {
            eprintln!("{test}: skipped (HF2Q_TEST_SMOLLM2_GGUF is not set)");
            None
        }
    }
}

/// A running `hf2q serve`, killed when dropped.
pub struct Served {
    pub child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
}

/// Starts `hf2q serve ARGS --port 0` with `$HF2Q_HOME` = `home` and waits until it listens.
pub fn serve(home: &Path, args: &[&str]) -> Served {
    serve_env(home, args, &[])
}

/// [`serve`] with `env` added to the server's environment.
pub fn serve_env(home: &Path, args: &[&str], env: &[(&str, &str)]) -> Served {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hf2q"))
        .env("HF2Q_HOME", home)
        .envs(env.iter().copied())
        .env_remove("HF2Q_API_KEY")
        .arg("serve")
        .args(args)
        .args(["--port", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let l = lines
            .next()
            .expect("the server exited before listening")
            .unwrap();
        if let Some(a) = l.strip_prefix("listening on http://") {
            break a.trim().to_string();
        }
    };
    // Keep draining stderr so that the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Served { child, addr }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
