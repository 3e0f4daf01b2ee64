//! Helpers shared by the CLI integration tests: the binary, the committed tiny checkpoints,
//! output text and the clean-failure check.
#![allow(dead_code)] // each test file uses a part of them

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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
