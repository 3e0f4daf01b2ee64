//! `hf2q train sft` as a user runs it, on the committed tiny Llama checkpoint (byte-level
//! vocabulary, its own chat template): a short run writes a PEFT adapter that `hf2q run
//! --adapter` loads, NDJSON events on stdout with `--json`, and bad input — empty or malformed
//! data, a template that cannot render, r = 0, a target the model does not have, a resume
//! folder of another model, an output folder that already holds an adapter — gives a clear
//! error, a failing exit status, and overwrites nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn tiny(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures/tiny")
        .join(name)
}

fn hf2q(home: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hf2q"))
        .env("HF2Q_HOME", home)
        .stdin(Stdio::null())
        .args(args)
        .output()
        .expect("spawn hf2q")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Chats whose answers the tiny model can learn in a few steps.
fn chats(dir: &Path, n: usize) -> PathBuf {
    let p = dir.join("chats.jsonl");
    let mut s = String::new();
    for i in 0..n {
        s.push_str(
            &serde_json::json!({"messages": [
                {"role": "user", "content": format!("say {i}")},
                {"role": "assistant", "content": format!("OK {i}!")},
            ]})
            .to_string(),
        );
        s.push('\n');
    }
    std::fs::write(&p, s).unwrap();
    p
}

fn sft<'a>(data: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "train", "sft", "--data", data, "-o", out, "--device", "cpu", "--batch", "2", "--lora-r",
        "4",
    ];
    v.extend_from_slice(extra);
    v
}

fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = walk(dir)
        .into_iter()
        .map(|p| {
            (
                p.strip_prefix(dir).unwrap().display().to_string(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn a_short_run_writes_an_adapter_that_run_loads() {
    let h = tempfile::tempdir().unwrap();
    let data = chats(h.path(), 8);
    let out = h.path().join("adapter");
    let model = tiny("tiny-llama");
    let (d, o, m) = (
        data.to_str().unwrap(),
        out.to_str().unwrap(),
        model.to_str().unwrap(),
    );
    let mut args = sft(d, o, &["--steps", "4", "--json", "--lr", "1e-2"]);
    args.insert(2, m);
    let r = hf2q(h.path(), &args);
    assert!(r.status.success(), "{}", text(&r.stderr));
    let events: Vec<serde_json::Value> = text(&r.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect();
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(kinds.first(), Some(&"plan"));
    assert_eq!(kinds.iter().filter(|k| **k == "step").count(), 4);
    assert_eq!(kinds.last(), Some(&"done"));
    let step = events.iter().find(|e| e["event"] == "step").unwrap();
    for k in ["loss", "lr", "grad_norm", "tokens_per_s", "epoch"] {
        assert!(step[k].is_number(), "step event lacks {k}: {step}");
    }
    let plan = &events[0];
    assert!(plan["train"]["histogram"].is_array());
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "train_log.jsonl",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["r"], 4);
    let r = hf2q(
        h.path(),
        &[
            "run",
            m,
            "--adapter",
            o,
            "-p",
            "say 3",
            "-n",
            "4",
            "--temp",
            "0",
            "--device",
            "cpu",
        ],
    );
    assert!(r.status.success(), "{}", text(&r.stderr));
    assert!(text(&r.stderr).contains("adapter:"), "{}", text(&r.stderr));
}

/// Runs `args` expecting failure with `msg` in stderr.
fn fails(h: &Path, args: &[&str], msg: &str) {
    let r = hf2q(h, args);
    let err = text(&r.stderr);
    assert!(!r.status.success(), "succeeded: {args:?}");
    assert!(err.contains(msg), "{args:?}: expected '{msg}' in:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_input_is_named_and_nothing_is_overwritten() {
    let h = tempfile::tempdir().unwrap();
    let hp = h.path();
    let model = tiny("tiny-llama");
    // Paths as 'static strings, for argument lists built in several places.
    let leak =
        |s: &Path| -> &'static str { Box::leak(s.to_str().unwrap().to_string().into_boxed_str()) };
    let data = chats(hp, 6);
    let d = leak(&data);
    let out = hp.join("out");
    let o = leak(&out);
    let m: &'static str = leak(&model);
    let with_model = |mut v: Vec<&'static str>| {
        v.insert(2, m);
        v
    };

    std::fs::write(hp.join("empty.jsonl"), "").unwrap();
    fails(
        hp,
        &with_model(sft(leak(&hp.join("empty.jsonl")), leak(&out), &[])),
        "no records",
    );
    std::fs::write(hp.join("bad.jsonl"), "{\"text\": \"a\"}\n{\"text\": \n").unwrap();
    fails(
        hp,
        &with_model(sft(leak(&hp.join("bad.jsonl")), leak(&out), &[])),
        "bad.jsonl:2: not a JSON object",
    );
    fails(
        hp,
        &with_model(sft(d, o, &["--lora-r", "0"])),
        "LoRA rank r must be at least 1",
    );
    fails(
        hp,
        &with_model(sft(d, o, &["--targets", "q_proj,wq"])),
        "unknown LoRA target module 'wq'",
    );
    assert!(!out.exists(), "a failed run created its output folder");

    // A template that refuses system turns: the record's line is named.
    let tdir = hp.join("strict-model");
    std::fs::create_dir(&tdir).unwrap();
    for e in std::fs::read_dir(&model).unwrap().flatten() {
        std::fs::copy(e.path(), tdir.join(e.file_name())).unwrap();
    }
    let tc = tdir.join("tokenizer_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
    cfg["chat_template"] = serde_json::json!("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System roles are not supported') }}{% endif %}{{ m['content'] }}{% endfor %}");
    std::fs::write(&tc, cfg.to_string()).unwrap();
    std::fs::write(
        hp.join("sys.jsonl"),
        "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\",\"content\":\"b\"}]}\n{\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\",\"content\":\"b\"}]}\n",
    )
    .unwrap();
    let mut a = sft(leak(&hp.join("sys.jsonl")), o, &[]);
    a.insert(2, leak(&tdir));
    fails(hp, &a, "sys.jsonl:2");
    fails(hp, &a, "System roles are not supported");

    // A finished adapter is not overwritten by a second run; its checkpoint cannot be resumed
    // by another model.
    let r = hf2q(
        hp,
        &with_model(sft(d, o, &["--steps", "2", "--save-every", "1"])),
    );
    assert!(r.status.success(), "{}", text(&r.stderr));
    let before = snapshot(&out);
    assert!(
        before
            .iter()
            .any(|(n, _)| n.starts_with("checkpoint-000001")),
        "{:?}",
        before.iter().map(|b| &b.0).collect::<Vec<_>>()
    );
    fails(
        hp,
        &with_model(sft(d, o, &["--steps", "2"])),
        "already holds an adapter",
    );
    let mut other = sft(d, leak(&hp.join("other")), &["--steps", "2", "--resume", o]);
    other.insert(2, leak(&tiny("tiny-qwen2")));
    fails(hp, &other, "made for another model");
    let after: Vec<_> = snapshot(&out)
        .into_iter()
        .filter(|(n, _)| n != "train_log.jsonl")
        .collect();
    let before: Vec<_> = before
        .into_iter()
        .filter(|(n, _)| n != "train_log.jsonl")
        .collect();
    assert_eq!(before, after, "a refused run changed the output folder");
}

/// A base in another stored form trains too: the tiny Llama converted to an MLX 4-bit folder
/// (affine weights, dequantized on the fly in the backward) and to a Q8_0 GGUF.
#[test]
fn mlx_and_gguf_bases_train() {
    let h = tempfile::tempdir().unwrap();
    let hp = h.path();
    let data = chats(hp, 6);
    let model = tiny("tiny-llama");
    let m = model.to_str().unwrap();
    for (name, to, ty) in [("mlx4", "mlx", "mlx4"), ("q8.gguf", "gguf", "Q8_0")] {
        let conv = hp.join(name);
        let c = conv.to_str().unwrap();
        let r = hf2q(hp, &["convert", m, c, "--to", to, "--type", ty]);
        assert!(r.status.success(), "convert {name}: {}", text(&r.stderr));
        let out = hp.join(format!("out-{name}"));
        let mut args = sft(
            data.to_str().unwrap(),
            out.to_str().unwrap(),
            &["--steps", "2"],
        );
        args.insert(2, c);
        let r = hf2q(hp, &args);
        assert!(r.status.success(), "train on {name}: {}", text(&r.stderr));
        assert!(out.join("adapter_model.safetensors").is_file());
    }
}

/// Preference pairs in LLaMA-Factory's shape (a JSON array): chosen replies end with "!".
fn pairs(dir: &Path, n: usize) -> PathBuf {
    let p = dir.join("pairs.json");
    let v: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            serde_json::json!({
                "conversations": [{"from": "human", "value": format!("say {i}")}],
                "chosen": {"from": "gpt", "value": format!("OK {i}!")},
                "rejected": {"from": "gpt", "value": format!("no {i}.")},
            })
        })
        .collect();
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    p
}

fn events(out: &Output) -> Vec<serde_json::Value> {
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect()
}

#[test]
fn dpo_writes_an_adapter_with_trl_metrics_and_starts_from_one() {
    let h = tempfile::tempdir().unwrap();
    let data = pairs(h.path(), 8);
    let out = h.path().join("dpo");
    let model = tiny("tiny-llama");
    let (d, o, m) = (
        data.to_str().unwrap(),
        out.to_str().unwrap(),
        model.to_str().unwrap(),
    );
    let base = [
        "train", "dpo", m, "--data", d, "--device", "cpu", "--batch", "2", "--lora-r", "4",
        "--json",
    ];
    let mut args = base.to_vec();
    args.extend([
        "-o",
        o,
        "--steps",
        "3",
        "--lr",
        "1e-2",
        "--valid-split",
        "0.25",
        "--beta",
        "0.2",
    ]);
    let r = hf2q(h.path(), &args);
    assert!(r.status.success(), "{}", text(&r.stderr));
    let ev = events(&r);
    let steps: Vec<&serde_json::Value> = ev.iter().filter(|e| e["event"] == "step").collect();
    assert_eq!(steps.len(), 3);
    for k in [
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
    ] {
        assert!(
            steps[0][k].is_number(),
            "step event lacks {k}: {}",
            steps[0]
        );
    }
    // A fresh adapter: the first step's loss is ln 2 exactly (printed as the f64 it is).
    assert_eq!(
        steps[0]["loss"].as_f64().unwrap(),
        std::f64::consts::LN_2,
        "{}",
        steps[0]
    );
    let eval = ev
        .iter()
        .find(|e| e["event"] == "eval")
        .expect("an eval event");
    assert!(eval["rewards/accuracies"].is_number(), "{eval}");
    assert_eq!(
        ev[0]["train"]["samples"], 12,
        "6 training pairs = 12 samples: {}",
        ev[0]
    );
    assert!(
        text(&r.stderr).contains("8 training pairs"),
        "{}",
        text(&r.stderr)
    );
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "train_log.jsonl",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    // Start from that adapter with it as the reference: the policy equals the reference again.
    let out2 = h.path().join("dpo2");
    let mut args = base.to_vec();
    args.extend([
        "-o",
        out2.to_str().unwrap(),
        "--steps",
        "1",
        "--adapter",
        o,
        "--ref-adapter",
        o,
    ]);
    let r = hf2q(h.path(), &args);
    assert!(r.status.success(), "{}", text(&r.stderr));
    let step = events(&r)
        .into_iter()
        .find(|e| e["event"] == "step")
        .unwrap();
    assert_eq!(
        step["loss"].as_f64().unwrap(),
        std::f64::consts::LN_2,
        "{step}"
    );
    assert_eq!(step["rewards/margins"].as_f64().unwrap(), 0.0, "{step}");
}

#[test]
fn dpo_names_bad_pairs_and_writes_nothing() {
    let h = tempfile::tempdir().unwrap();
    let hp = h.path();
    let m = tiny("tiny-llama");
    let out = hp.join("out");
    let run = |data: &Path, extra: &[&str], msg: &str| {
        let mut args = vec![
            "train",
            "dpo",
            m.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--device",
            "cpu",
        ];
        args.extend_from_slice(extra);
        fails(hp, &args, msg);
    };
    let bad = hp.join("pairs.jsonl");
    std::fs::write(
        &bad,
        "{\"prompt\": \"Q\", \"chosen\": \"a\", \"rejected\": \"b\"}\n{\"prompt\": \"Q\", \"chosen\": \"a\"}\n",
    )
    .unwrap();
    run(
        &bad,
        &[],
        "pairs.jsonl:2: not a preference pair (fields: prompt, chosen)",
    );
    let sft_data = chats(hp, 3);
    run(&sft_data, &[], "chats.jsonl:1: not a preference pair");
    let good = pairs(hp, 4);
    run(&good, &["--beta", "0"], "--beta 0 must be positive");
    run(
        &good,
        &["--train-on-prompt"],
        "--train-on-prompt does not apply to DPO",
    );
    run(
        &good,
        &["--ref-adapter", hp.join("nowhere").to_str().unwrap()],
        "nowhere",
    );
    assert!(
        !out.join("adapter_config.json").exists(),
        "a failed run wrote an adapter"
    );
}
