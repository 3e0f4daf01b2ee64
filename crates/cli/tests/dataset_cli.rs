//! `hf2q dataset build` and `hf2q dataset stats` as a user runs them: files written (and not
//! overwritten), the report, bad rows rejected by default with their line and skipped with
//! `--on-error skip`, the split the same for the same seed, token lengths with the committed
//! tiny Llama's template.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../train/tests/fixtures/dataset")
        .join(name)
}

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny/tiny-llama")
}

fn hf2q(home: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hf2q"))
        .env("HF2Q_HOME", home)
        .args(args)
        .output()
        .unwrap()
}

fn lines(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn build_writes_a_seeded_split_and_a_report() {
    let d = tempfile::tempdir().unwrap();
    let qa = fixture("qa.csv");
    let chats = fixture("chats.jsonl");
    let out = |n: &str| d.path().join(n);
    let args = |o: &Path, seed: &str| {
        vec![
            "dataset".to_string(),
            "build".into(),
            qa.to_str().unwrap().into(),
            chats.to_str().unwrap().into(),
            "-o".into(),
            o.to_str().unwrap().into(),
            "--map".into(),
            "instruction=question".into(),
            "--map".into(),
            "output=answer".into(),
            "--to".into(),
            "messages".into(),
            "--valid-split".into(),
            "0.4".into(),
            "--seed".into(),
            seed.into(),
        ]
    };
    let run = |a: Vec<String>| hf2q(d.path(), &a.iter().map(String::as_str).collect::<Vec<_>>());
    // Bad rows (qa.csv:5, chats.jsonl:4) fail the build by default, naming their lines.
    let o = run(args(&out("strict"), "1"));
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("qa.csv:5: 2 cells where the header has 3")
            && e.contains("chats.jsonl:4: not JSON"),
        "{e}"
    );
    assert!(!out("strict").join("train.jsonl").exists());

    let skip = |o: &Path, seed: &str| {
        let mut a = args(o, seed);
        a.extend(["--on-error".into(), "skip".into(), "--json".into()]);
        a
    };
    let o = run(skip(&out("a"), "1"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (report["rows"].as_u64(), report["skipped"].as_u64()),
        (Some(8), Some(2)),
        "{report}"
    );
    // 6 records: round(6 * 0.4) = 2 held out.
    assert_eq!(
        (report["train"].as_u64(), report["valid"].as_u64()),
        (Some(4), Some(2))
    );
    let on_disk: Value =
        serde_json::from_slice(&std::fs::read(out("a").join("report.json")).unwrap()).unwrap();
    assert_eq!(on_disk, report);
    let (train, valid) = (
        lines(&out("a").join("train.jsonl")),
        lines(&out("a").join("valid.jsonl")),
    );
    assert!(train.iter().chain(&valid).all(|r| r["messages"].is_array()));
    // The same seed, the same files; another seed, another order.
    assert!(run(skip(&out("b"), "1")).status.success());
    for f in ["train.jsonl", "valid.jsonl"] {
        assert_eq!(
            std::fs::read(out("a").join(f)).unwrap(),
            std::fs::read(out("b").join(f)).unwrap()
        );
    }
    assert!(run(skip(&out("c"), "2")).status.success());
    assert_ne!(
        std::fs::read(out("a").join("train.jsonl")).unwrap(),
        std::fs::read(out("c").join("train.jsonl")).unwrap()
    );
    // Never over an existing dataset.
    let o = run(skip(&out("a"), "3"));
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("not empty"));
    assert_eq!(
        std::fs::read(out("a").join("train.jsonl")).unwrap(),
        std::fs::read(out("b").join("train.jsonl")).unwrap()
    );
}

#[test]
fn stats_counts_tokens_with_the_model_s_template() {
    let d = tempfile::tempdir().unwrap();
    let chats = fixture("chats.jsonl");
    let o = hf2q(
        d.path(),
        &[
            "dataset",
            "stats",
            chats.to_str().unwrap(),
            "--model",
            tiny().to_str().unwrap(),
            "--max-len",
            "24",
            "--on-error",
            "skip",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    let t = &r["tokens"];
    assert_eq!(t["records"], 3, "{r}");
    assert_eq!(t["max_len"], 24);
    let (min, max) = (t["min"].as_u64().unwrap(), t["max"].as_u64().unwrap());
    assert!(min > 0 && min <= max, "{t}");
    let counted: u64 = t["histogram"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["count"].as_u64().unwrap())
        .sum();
    assert_eq!(counted, 3);
    // A bad --map is named.
    let o = hf2q(
        d.path(),
        &[
            "dataset",
            "stats",
            chats.to_str().unwrap(),
            "--model",
            tiny().to_str().unwrap(),
            "--map",
            "oops",
        ],
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("expected FIELD=COLUMN"));
}
