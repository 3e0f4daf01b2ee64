//! `run` and `inspect` with a model's recommended sampling: a folder's generation_config.json
//! (here `do_sample: false`, greedy as transformers reads it) sets run's defaults, shown by
//! inspect; flags override it; a built-in name's card settings are in `inspect` too when the
//! model is cached (SmolLM2: temperature 0.2, top-p 0.9).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn hf2q(home: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hf2q"))
        .env("HF2Q_HOME", home)
        .stdin(Stdio::null())
        .args(args)
        .output()
        .unwrap()
}

fn tiny_with(dir: &Path, gen: &str) -> PathBuf {
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny/tiny-llama");
    let to = dir.join("tiny");
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    std::fs::write(to.join("generation_config.json"), gen).unwrap();
    to
}

fn run(home: &Path, model: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "run",
        model.to_str().unwrap(),
        "-p",
        "hello",
        "-n",
        "24",
        "--ignore-eos",
        "--raw",
    ];
    args.extend_from_slice(extra);
    let o = hf2q(home, &args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn generation_config_sets_run_s_defaults_and_flags_override_them() {
    let d = tempfile::tempdir().unwrap();
    let m = tiny_with(d.path(), r#"{"do_sample": false, "top_p": 0.5}"#);
    let o = hf2q(d.path(), &["inspect", m.to_str().unwrap(), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["generation"]["temperature"], 0.0, "{v}");
    assert_eq!(v["generation"]["source"], "generation_config.json");
    let table = hf2q(d.path(), &["inspect", m.to_str().unwrap()]);
    assert!(
        String::from_utf8_lossy(&table.stdout).contains("temperature 0 (generation_config.json)")
    );
    let greedy = run(d.path(), &m, &["--temp", "0"]);
    for seed in ["1", "2"] {
        assert_eq!(run(d.path(), &m, &["--seed", seed]), greedy, "seed {seed}");
    }
    let hot: Vec<String> = ["1", "2", "3"]
        .iter()
        .map(|s| run(d.path(), &m, &["--seed", s, "--temp", "1.5"]))
        .collect();
    assert!(
        hot.iter().any(|t| *t != greedy),
        "--temp overrides: {hot:?}"
    );
    // A bad value in the file is named, not ignored.
    let bad = tiny_with(&d.path().join("bad"), r#"{"do_sample": true, "top_p": 7}"#);
    let o = hf2q(d.path(), &["inspect", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("generation_config.json") && e.contains("'top_p'"),
        "{e}"
    );
}

#[test]
fn smollm2_carries_its_model_card_sampling() {
    let Some(p) = std::env::var_os("HF2Q_TEST_SMOLLM2_GGUF").filter(|p| !p.is_empty()) else {
        eprintln!("skipped (HF2Q_TEST_SMOLLM2_GGUF is not set)");
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let o = hf2q(
        d.path(),
        &["inspect", Path::new(&p).to_str().unwrap(), "--json"],
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let g = &v["generation"];
    assert!(
        (g["temperature"].as_f64().unwrap() - 0.2).abs() < 1e-6
            && (g["top_p"].as_f64().unwrap() - 0.9).abs() < 1e-6,
        "{g}"
    );
}
