//! Real clients against a real server on loopback:
//! - the official `openai` Python package (`HF2Q_TEST_PYTHON`: a Python that can import it);
//! - the web chat in headless Chromium driven by playwright-core (`HF2Q_TEST_CHROMIUM`: the
//!   browser, `HF2Q_TEST_NODE_MODULES`: a node_modules folder holding playwright-core);
//! - the web Lab in the same browser against the `hf2q serve` binary and its child jobs
//!   (`HF2Q_TEST_BIN`, `HF2Q_TEST_SMOLLM2_GGUF`), with screenshots of every section;
//! - the `hf2q serve` binary itself (`HF2Q_TEST_BIN`): SIGTERM drains and exits 0.
//!
//! `scripts/test.sh` installs the tools into caches outside the repository and sets the
//! variables; without them each test prints "skipped" and passes.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

fn env_path(var: &str, test: &str) -> Option<PathBuf> {
    match std::env::var(var) {
        Ok(p) if !p.is_empty() && Path::new(&p).exists() => Some(PathBuf::from(p)),
        _ => {
            eprintln!("{test}: skipped ({var} is not set or does not exist)");
            None
        }
    }
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/clients")
        .join(name)
}

/// Runs a command to completion off the async runtime; panics with its output on failure.
async fn run_ok(mut cmd: Command, what: &str) -> String {
    let what = what.to_string();
    tokio::task::spawn_blocking(move || {
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{text}");
        assert!(
            out.status.success(),
            "{what} failed ({}):\n{text}",
            out.status
        );
        text
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_python_client() {
    let test = "official_openai_python_client";
    let Some(python) = env_path("HF2Q_TEST_PYTHON", test) else {
        return;
    };
    let probe = Command::new(&python).args(["-c", "import openai"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!(
            "{test}: skipped ({} cannot import openai)",
            python.display()
        );
        return;
    }
    let mut c = cfg();
    c.api_key = Some("test-key".into());
    let h = start(tiny(), c).await;
    let mut cmd = Command::new(python);
    cmd.arg(script("openai_client.py"))
        .arg(format!("http://{}", h.addr))
        .arg("test-key")
        .arg("tiny");
    let out = run_ok(cmd, "openai client").await;
    assert!(out.contains(" 0 failed"), "{out}");
}

/// The Python interpreter with `openai` importable, or `None` (the test prints "skipped").
fn openai_python(test: &str) -> Option<PathBuf> {
    let python = env_path("HF2Q_TEST_PYTHON", test)?;
    let probe = Command::new(&python).args(["-c", "import openai"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!(
            "{test}: skipped ({} cannot import openai)",
            python.display()
        );
        return None;
    }
    Some(python)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_python_client_tools_and_structured_output() {
    let test = "official_openai_python_client_tools_and_structured_output";
    let Some(python) = openai_python(test) else {
        return;
    };
    let Some(model) = qwen25(test) else {
        return;
    };
    let h = start(model, real_cfg("qwen")).await;
    let mut cmd = Command::new(python);
    cmd.arg(script("tools_client.py"))
        .arg(format!("http://{}", h.addr))
        .arg("qwen");
    let out = run_ok(cmd, "openai client (tools)").await;
    assert!(out.contains(" 0 failed"), "{out}");
}

/// Chromium and a node_modules folder with playwright-core, or `None` ("skipped").
fn browser(test: &str) -> Option<(PathBuf, PathBuf)> {
    let chromium = env_path("HF2Q_TEST_CHROMIUM", test)?;
    let modules = env_path("HF2Q_TEST_NODE_MODULES", test)?;
    if !modules.join("playwright-core").is_dir()
        || Command::new("node").arg("--version").output().is_err()
    {
        eprintln!("{test}: skipped (node or playwright-core is missing)");
        return None;
    }
    Some((chromium, modules))
}

/// Agent mode in the web chat, with Qwen2.5-Coder-0.5B and a fixture workspace: a listing runs
/// at once, a file is written after the click on Approve, a denied command does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_chat_agent_mode_in_headless_chromium() {
    let test = "web_chat_agent_mode_in_headless_chromium";
    let Some((chromium, modules)) = browser(test) else {
        return;
    };
    let Some(model) = qwen25(test) else {
        return;
    };
    let ws = tempfile::tempdir().unwrap();
    std::fs::write(ws.path().join("readme.md"), "# Fixture\n").unwrap();
    std::fs::create_dir(ws.path().join("src")).unwrap();
    std::fs::write(ws.path().join("src/main.rs"), "fn main() {}\n").unwrap();
    let mut c = real_cfg("qwen");
    c.agent = Some(hf2q_server::agent::AgentConfig::new(ws.path()).unwrap());
    let h = start(model, c).await;
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = Command::new("node");
    cmd.env("NODE_PATH", &modules)
        .arg(script("agent.cjs"))
        .arg(format!("http://{}", h.addr))
        .arg(&chromium)
        .arg(profile.path())
        .arg(ws.path());
    let out = run_ok(cmd, "web chat agent").await;
    assert!(out.contains(" 0 failed"), "{out}");
    assert!(ws.path().join("notes.txt").exists());
    assert!(!ws.path().join("ran.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_chat_in_headless_chromium() {
    let test = "web_chat_in_headless_chromium";
    let Some((chromium, modules)) = browser(test) else {
        return;
    };
    let mut c = cfg();
    // Slow enough that the stop button is pressed mid-reply (~40 tokens/s).
    c.engine.step_delay = Duration::from_millis(25);
    let h = start(tiny(), c).await;
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = Command::new("node");
    cmd.env("NODE_PATH", &modules)
        .arg(script("webchat.cjs"))
        .arg(format!("http://{}", h.addr))
        .arg(&chromium)
        .arg(profile.path());
    let out = run_ok(cmd, "web chat").await;
    assert!(out.contains(" 0 failed"), "{out}");
}

/// A child process killed (and reaped) when the test ends, passed or not.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The question/answer fixture of the Lab test: answers in uppercase, every row distinct.
fn upper_csv() -> String {
    let facts = [
        ("the largest planet", "Jupiter"),
        ("the closest star to Earth", "the Sun"),
        ("the capital of Italy", "Rome"),
        ("the capital of Japan", "Tokyo"),
        (
            "the boiling point of water at sea level",
            "100 degrees Celsius",
        ),
        ("the chemical symbol for gold", "Au"),
        ("the author of Hamlet", "William Shakespeare"),
        ("the longest river in Africa", "the Nile"),
        ("the smallest prime number", "two"),
        ("the capital of Canada", "Ottawa"),
        ("the fastest land animal", "the cheetah"),
        ("the main gas in the air", "nitrogen"),
    ];
    let mut s = String::from("question,answer\n");
    for (what, ans) in facts {
        s.push_str(&format!("What is {what}?,\"{}.\"\n", ans.to_uppercase()));
        s.push_str(&format!(
            "Tell me {what}.,\"IT IS {}.\"\n",
            ans.to_uppercase()
        ));
    }
    s
}

/// The web Lab in headless Chromium against the real binary: a dataset built from an uploaded
/// CSV, SmolLM2 quantized to Q4_0 with its report card, a short SFT run whose loss plot moves,
/// a reload mid-run that finds the job still running with its log replayed, a cancelled job,
/// and a chat with the trained adapter. Screenshots land in the test's temporary folder
/// (`lab-screens/`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_lab_in_headless_chromium() {
    let test = "web_lab_in_headless_chromium";
    let Some((chromium, modules)) = browser(test) else {
        return;
    };
    let Some(bin) = env_path("HF2Q_TEST_BIN", test) else {
        return;
    };
    let Some(smollm2) = env_path("HF2Q_TEST_SMOLLM2_GGUF", test) else {
        return;
    };
    let home = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(home.path().join("models")).unwrap();
    let model = home.path().join("models/smollm2.gguf");
    if std::fs::hard_link(&smollm2, &model).is_err() {
        std::fs::copy(&smollm2, &model).unwrap();
    }
    let fixtures = tempfile::tempdir().unwrap();
    std::fs::write(fixtures.path().join("upper.csv"), upper_csv()).unwrap();
    // Real English for the report card: the start of this project's README (a few chunks).
    let readme = include_str!("../../../README.md");
    let cut = readme
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| i >= 6000)
        .unwrap_or(readme.len());
    std::fs::write(fixtures.path().join("eval.txt"), &readme[..cut]).unwrap();
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("lab-screens");
    std::fs::create_dir_all(&shots).unwrap();
    let mut server = KillOnDrop(
        Command::new(bin)
            .env("HF2Q_HOME", home.path())
            .args([
                "serve",
                model.to_str().unwrap(),
                "--port",
                "0",
                "--device",
                "cpu",
            ])
            .args([
                "--lab-jobs",
                "2",
                "--lab-grace",
                "20",
                "-c",
                "512",
                "--kv-mem",
                "64M",
            ])
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("start hf2q serve"),
    );
    let stderr = server.0.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if let Some(a) = line.strip_prefix("listening on http://") {
                let _ = tx.send(a.trim().to_string());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("listening line");
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = Command::new("node");
    cmd.env("NODE_PATH", &modules)
        .arg(script("lab.cjs"))
        .arg(format!("http://{addr}"))
        .arg(&chromium)
        .arg(profile.path())
        .arg(fixtures.path())
        .arg(&shots);
    let out = run_ok(cmd, "web lab").await;
    drop(server);
    eprintln!("{test}: screenshots in {}", shots.display());
    assert!(out.contains(" 0 failed"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_serves_and_exits_0_on_sigterm() {
    let test = "binary_serves_and_exits_0_on_sigterm";
    let Some(bin) = env_path("HF2Q_TEST_BIN", test) else {
        return;
    };
    let mut child = Command::new(bin)
        .args([
            "serve",
            tiny_path().to_str().unwrap(),
            "--port",
            "0",
            "--model-name",
            "tiny",
            "--drain-timeout",
            "20",
        ])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("start hf2q serve");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            eprintln!("[serve] {line}");
            if let Some(a) = line.strip_prefix("listening on http://") {
                let _ = tx.send(a.trim().to_string());
            }
        }
    });
    let addr: std::net::SocketAddr = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("listening line")
        .parse()
        .unwrap();
    assert_eq!(http(addr, "GET", "/health", &[], None).await.status, 200);
    let r = post(addr, "/v1/chat/completions", &chat_body("hi", 4, false)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    // A stream in flight when SIGTERM arrives still completes.
    let mut body = chat_body("a long one", 200, true);
    body["ignore_eos"] = serde_json::json!(true);
    let mut s = open(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(&body.to_string()),
    )
    .await;
    s.next().await.expect("first frame");
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(kill.success());
    let rest = s.body().await;
    assert!(rest.text().ends_with("data: [DONE]\n\n"), "{}", rest.text());
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "hf2q serve exit status after SIGTERM"
    );
}
