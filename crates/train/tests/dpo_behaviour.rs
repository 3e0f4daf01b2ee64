//! DPO end to end on the CPU with real weights and real data: SmolLM2-135M-Instruct
//! (`HF2Q_TEST_SMOLLM2_GGUF`) on pairs built from the short answers of LLaMA-Factory's
//! `alpaca_en_demo.json` (`HF2Q_TEST_ALPACA_JSON`): the chosen reply is the answer in
//! uppercase (the marked style), the rejected one the answer as written. After a short run the
//! held-out pairs' chosen-minus-rejected log-probability margin rises and the held-out
//! rewards/accuracies exceed 0.8. Skipped (prints "skipped") without the two files.

mod common;
use common::env_path;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use hf2q_models::Model;
use hf2q_train::data::Dataset;
use hf2q_train::report::{Event, Observer};
use hf2q_train::trainer::{prepare, Length, Objective, Outcome, TrainConfig, Trainer};

/// Pairs (prompt messages, chosen, rejected) from short Alpaca answers: `train` pairs, then
/// `held` held-out pairs of other questions.
fn uppercase_pairs(alpaca: &Path, dir: &Path, train: usize, held: usize) -> (PathBuf, PathBuf) {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(alpaca).unwrap()).unwrap();
    let short: Vec<&serde_json::Value> = v
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| {
            let out = r["output"].as_str().unwrap_or("");
            out.len() < 120
                && r["input"].as_str().unwrap_or("").is_empty()
                && out.chars().filter(|c| c.is_lowercase()).count() > 10
        })
        .collect();
    assert!(
        short.len() >= train + held,
        "only {} short records",
        short.len()
    );
    let write = |name: &str, recs: &[&serde_json::Value]| {
        let p = dir.join(name);
        let lines: Vec<String> = recs
            .iter()
            .map(|r| {
                let out = r["output"].as_str().unwrap();
                serde_json::json!({
                    "prompt": [{"role": "user", "content": r["instruction"]}],
                    "chosen": [{"role": "assistant", "content": out.to_uppercase()}],
                    "rejected": [{"role": "assistant", "content": out}],
                })
                .to_string()
            })
            .collect();
        std::fs::write(&p, lines.join("\n") + "\n").unwrap();
        p
    };
    (
        write("train.jsonl", &short[..train]),
        write("held.jsonl", &short[train..train + held]),
    )
}

struct Log(Vec<Event>);
impl Observer for Log {
    fn event(&mut self, e: &Event) {
        if let Event::Step(s) = e {
            eprintln!(
                "step {}: loss {:.4} margins {:.3} accuracies {:.2} ({:.0} tok/s)",
                s.step,
                s.loss,
                s.dpo.as_ref().unwrap().rewards_margins,
                s.dpo.as_ref().unwrap().rewards_accuracies,
                s.tokens_per_s
            );
        }
        self.0.push(e.clone());
    }
}

#[test]
fn uppercase_replies_become_preferred_on_held_out_pairs() {
    let (Some(gguf), Some(alpaca)) = (
        env_path("HF2Q_TEST_SMOLLM2_GGUF"),
        env_path("HF2Q_TEST_ALPACA_JSON"),
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (train_path, held_path) = uppercase_pairs(&alpaca, dir.path(), 48, 16);
    let (train, held) = (
        Dataset::load_pairs(&train_path).unwrap(),
        Dataset::load_pairs(&held_path).unwrap(),
    );
    let mut m = Model::load(&gguf).unwrap();
    m.set_matmul_path(hf2q_cpu::MatmulPath::Fast);
    let mut cfg = TrainConfig {
        lr: 1e-3,
        length: Length::Steps(12),
        batch: 4,
        max_seq_len: 256,
        seed: 7,
        objective: Objective::Dpo {
            beta: 0.1,
            ref_adapter: None,
        },
        ..TrainConfig::default()
    };
    cfg.lora.r = 8;
    cfg.lora.alpha = 16.0;
    let prepared = prepare(&m, &train, Some(&held), &cfg).unwrap();
    let t0 = std::time::Instant::now();
    let mut t = Trainer::new(&mut m, cfg, prepared, &dir.path().join("out"), None, false).unwrap();
    let before = t.evaluate().unwrap().unwrap().dpo.unwrap();
    let mut log = Log(Vec::new());
    assert!(matches!(
        t.run(&mut log, &AtomicBool::new(false)).unwrap(),
        Outcome::Done(_)
    ));
    let after = log
        .0
        .iter()
        .rev()
        .find_map(|e| match e {
            Event::Eval(v) => v.dpo.clone(),
            _ => None,
        })
        .expect("a final evaluation");
    let margin = |d: &hf2q_train::dpo::DpoMetrics| d.logps_chosen - d.logps_rejected;
    eprintln!(
        "held-out: log-prob margin {:.2} -> {:.2}, rewards/margins {:.3} -> {:.3}, rewards/accuracies {:.2} -> {:.2} ({:.1} s)",
        margin(&before),
        margin(&after),
        before.rewards_margins,
        after.rewards_margins,
        before.rewards_accuracies,
        after.rewards_accuracies,
        t0.elapsed().as_secs_f64()
    );
    // A fresh adapter is the reference: every reward is 0 before training.
    assert_eq!(
        (before.rewards_margins, before.rewards_accuracies),
        (0.0, 0.0)
    );
    assert!(
        margin(&after) > margin(&before) + 1.0,
        "the held-out margin did not rise"
    );
    assert!(after.rewards_margins > 0.0);
    assert!(
        after.rewards_accuracies > 0.8,
        "held-out rewards/accuracies {}",
        after.rewards_accuracies
    );
}

/// LLaMA-Factory's own DPO demo set (`dpo_en_demo.json`, `HF2Q_TEST_DPO_JSON`) is read in its
/// shape (`conversations` + `chosen`/`rejected` objects), every pair renders with SmolLM2's
/// template into a chosen and a rejected sample with learned tokens, and a first step on its
/// pairs starts at ln 2 as any fresh adapter must.
#[test]
fn llamafactory_dpo_demo_set_is_read_and_trained_on() {
    let (Some(gguf), Some(demo)) = (
        env_path("HF2Q_TEST_SMOLLM2_GGUF"),
        env_path("HF2Q_TEST_DPO_JSON"),
    ) else {
        return;
    };
    let pairs = Dataset::load_pairs(&demo).unwrap();
    assert_eq!(pairs.shape, hf2q_train::data::Shape::PairShareGpt);
    assert!(
        pairs.records.len() >= 200 && pairs.records.len() % 2 == 0,
        "{} records",
        pairs.records.len()
    );
    let mut m = Model::load(&gguf).unwrap();
    m.set_matmul_path(hf2q_cpu::MatmulPath::Fast);
    let cfg = TrainConfig {
        length: Length::Steps(1),
        batch: 2,
        max_seq_len: 8192,
        objective: Objective::Dpo {
            beta: 0.1,
            ref_adapter: None,
        },
        ..TrainConfig::default()
    };
    let prepared = prepare(&m, &pairs, None, &cfg).unwrap();
    assert_eq!(prepared.train.len(), pairs.records.len());
    assert!(
        prepared
            .train
            .iter()
            .all(|s| s.learned() > 0 && !s.truncated()),
        "a reply with no learned token"
    );
    // One step over two short pairs only (the whole set is a benchmark's work, not a test's).
    let short: Vec<_> = prepared
        .train
        .chunks(2)
        .filter(|p| p.iter().all(|s| s.ids.len() <= 256))
        .take(2)
        .flatten()
        .cloned()
        .collect();
    assert_eq!(short.len(), 4, "fewer than two short pairs");
    let few = hf2q_train::trainer::Prepared {
        train: short,
        valid: Vec::new(),
    };
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(&mut m, cfg, few, &dir.path().join("out"), None, false).unwrap();
    let mut log = Log(Vec::new());
    assert!(matches!(
        t.run(&mut log, &AtomicBool::new(false)).unwrap(),
        Outcome::Done(_)
    ));
    let first = log
        .0
        .iter()
        .find_map(|e| match e {
            Event::Step(s) => Some(s.loss),
            _ => None,
        })
        .unwrap();
    // A fresh adapter's B is zero, so policy and reference log-probabilities are the same
    // forward's and every pair's loss is ln 2; 1e-9 only leaves room for the mean over pairs
    // in f64.
    assert!(
        (first - std::f64::consts::LN_2).abs() < 1e-9,
        "first step loss {first}"
    );
}
