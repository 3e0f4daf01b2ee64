//! End to end on the CPU with real weights and real data: SmolLM2-135M-Instruct
//! (`HF2Q_TEST_SMOLLM2_GGUF`) fine-tuned with LoRA on the short answers of LLaMA-Factory's
//! `alpaca_en_demo.json` (`HF2Q_TEST_ALPACA_JSON`), every answer rewritten in uppercase, learns
//! to answer held-out questions in uppercase, where the base model does not; and a run stopped
//! half-way and resumed from its checkpoint ends with the same adapter, bit for bit, as the
//! unbroken run. Skipped (prints "skipped") without the two files; `scripts/test.sh` fetches
//! both.

mod common;
use common::env_path;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use hf2q_models::chat_template::{encode_chat, ChatMessage};
use hf2q_models::generate::{generate, GenerateParams};
use hf2q_models::sampler::SamplerConfig;
use hf2q_models::Model;
use hf2q_train::data::Dataset;
use hf2q_train::report::{Event, Observer, Quiet};
use hf2q_train::trainer::{prepare, Length, Outcome, TrainConfig, Trainer};

/// Alpaca records with short answers (under 160 characters), answers uppercased; the held-out
/// questions are the next records of the same kind.
fn uppercase_set(alpaca: &Path, dir: &Path) -> (PathBuf, Vec<String>) {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(alpaca).unwrap()).unwrap();
    let short: Vec<&serde_json::Value> = v
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| {
            let out = r["output"].as_str().unwrap_or("");
            out.len() < 160
                && r["input"].as_str().unwrap_or("").is_empty()
                && out.chars().any(char::is_alphabetic)
        })
        .collect();
    assert!(short.len() >= 60, "only {} short records", short.len());
    let path = dir.join("upper.jsonl");
    let mut text = String::new();
    for r in &short[..48] {
        let rec = serde_json::json!({
            "messages": [
                {"role": "user", "content": r["instruction"]},
                {"role": "assistant", "content": r["output"].as_str().unwrap().to_uppercase()},
            ]
        });
        text.push_str(&rec.to_string());
        text.push('\n');
    }
    std::fs::write(&path, text).unwrap();
    let held: Vec<String> = short[48..54]
        .iter()
        .map(|r| r["instruction"].as_str().unwrap().to_string())
        .collect();
    (path, held)
}

/// Share of letters in uppercase, in `text`.
fn upper_share(text: &str) -> f64 {
    let letters: Vec<char> = text.chars().filter(|c| c.is_alphabetic()).collect();
    letters.iter().filter(|c| c.is_uppercase()).count() as f64 / letters.len().max(1) as f64
}

fn answer(m: &Model, q: &str) -> String {
    let t = m.chat_template().expect("SmolLM2 has a chat template");
    let ids = encode_chat(m.tokenizer(), t, &[ChatMessage::new("user", q)], true).unwrap();
    let params = GenerateParams {
        max_tokens: 40,
        sampler: SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        ..GenerateParams::default()
    };
    let mut out = String::new();
    generate(&mut m.session(512), &ids, &params, &mut |s| {
        out.push_str(s);
        true
    })
    .unwrap();
    out
}

fn config() -> TrainConfig {
    let mut c = TrainConfig {
        lr: 1e-3,
        length: Length::Steps(24),
        batch: 4,
        max_seq_len: 256,
        seed: 7,
        ..TrainConfig::default()
    };
    c.lora.r = 8;
    c.lora.alpha = 16.0;
    c
}

/// Sets the stop flag once `at` steps are done.
struct StopAt<'a>(u64, &'a AtomicBool);
impl Observer for StopAt<'_> {
    fn event(&mut self, e: &Event) {
        if let Event::Step(s) = e {
            if s.step == self.0 {
                self.1.store(true, Ordering::Relaxed);
            }
        }
    }
}

fn factors(m: &Model) -> Vec<Vec<f32>> {
    m.adapters()
        .iter()
        .flat_map(|(_, l)| [l.a.data().to_vec(), l.b.data().to_vec()])
        .collect()
}

#[test]
fn uppercase_answers_are_learned_and_resume_is_exact() {
    let (Some(gguf), Some(alpaca)) = (
        env_path("HF2Q_TEST_SMOLLM2_GGUF"),
        env_path("HF2Q_TEST_ALPACA_JSON"),
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (data_path, held) = uppercase_set(&alpaca, dir.path());
    let data = Dataset::load(&data_path).unwrap();
    let load = || {
        let mut m = Model::load(&gguf).unwrap();
        m.set_matmul_path(hf2q_cpu::MatmulPath::Fast);
        m
    };

    // The base model answers in ordinary case.
    let base = load();
    let base_share: Vec<f64> = held
        .iter()
        .map(|q| upper_share(&answer(&base, q)))
        .collect();
    eprintln!("base uppercase shares: {base_share:?}");
    drop(base);

    // An unbroken run.
    let mut m = load();
    let prepared = prepare(&m, &data, None, &config()).unwrap();
    let out_a = dir.path().join("a");
    let mut t = Trainer::new(&mut m, config(), prepared, &out_a, None, false).unwrap();
    assert!(matches!(
        t.run(&mut Quiet, &AtomicBool::new(false)).unwrap(),
        Outcome::Done(_)
    ));
    let unbroken = factors(&m);
    let tuned: Vec<(String, f64)> = held
        .iter()
        .map(|q| {
            let a = answer(&m, q);
            let s = upper_share(&a);
            (a, s)
        })
        .collect();
    for (q, (a, s)) in held.iter().zip(&tuned) {
        eprintln!("{q} -> {a:?} ({s:.2})");
    }
    let upper = tuned.iter().filter(|(_, s)| *s >= 0.9).count();
    let base_upper = base_share.iter().filter(|s| **s >= 0.9).count();
    assert!(
        upper >= 5,
        "only {upper} of {} held-out answers are in uppercase",
        held.len()
    );
    assert!(
        base_upper <= 1,
        "the base already answers {base_upper} in uppercase"
    );

    // Stopped after 10 steps, then resumed from the checkpoint.
    let mut m = load();
    let prepared = prepare(&m, &data, None, &config()).unwrap();
    let out_b = dir.path().join("b");
    let stop = AtomicBool::new(false);
    let mut t = Trainer::new(&mut m, config(), prepared, &out_b, None, false).unwrap();
    let first = t.run(&mut StopAt(10, &stop), &stop).unwrap();
    let Outcome::Stopped {
        step: 10,
        checkpoint,
    } = first
    else {
        panic!("expected a stop at step 10, got {first:?}");
    };
    assert!(
        !out_b.join("adapter_config.json").exists(),
        "an interrupted run left an adapter"
    );
    drop(t);
    let mut m = load();
    let prepared = prepare(&m, &data, None, &config()).unwrap();
    let mut t = Trainer::new(&mut m, config(), prepared, &out_b, Some(&checkpoint), false).unwrap();
    assert_eq!(t.state().step, 10);
    assert!(matches!(
        t.run(&mut Quiet, &AtomicBool::new(false)).unwrap(),
        Outcome::Done(_)
    ));
    assert_eq!(
        factors(&m),
        unbroken,
        "the resumed run ended elsewhere than the unbroken one"
    );
    let on_disk = std::fs::read(out_b.join("adapter_model.safetensors")).unwrap();
    assert_eq!(
        on_disk,
        std::fs::read(out_a.join("adapter_model.safetensors")).unwrap()
    );
}
