//! DPO against TRL's formula with PEFT: goldens made by `scripts/goldens/make_dpo_goldens.py`
//! (PyTorch + transformers + peft on the CPU, float32; versions in each `golden.json`'s
//! `meta`) from the `ours_random` adapters of `tests/fixtures/peft/NAME/`, and the exact
//! start of a run from a fresh adapter.
//!
//! Fixtures under `tests/fixtures/dpo/NAME/`: `golden.json` (a batch of two pairs, per case the
//! loss, the policy's and reference's summed log-probabilities and TRL's metrics),
//! `grads_CASE.safetensors` (PEFT's gradient of every LoRA factor), `dpo_ref/` (the second
//! adapter of the `ref_adapter` case, written by PEFT).
//!
//! Tolerances (float32 forward on both sides, summation orders differ): summed log-probs 1e-4
//! absolute (sums of ~10 terms each ~1e-6 apart), loss and metrics 1e-5 absolute, every
//! gradient tensor 1e-3 relative (‖ours − PEFT‖ / ‖PEFT‖), as the SFT parity test.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use hf2q_cpu::MatmulPath;
use hf2q_models::layers::lora::LoraGrads;
use hf2q_models::train_pass::{PassOptions, TrainBatch};
use hf2q_models::Model;
use hf2q_tensor::io::safetensors::SafeTensors;
use hf2q_tensor::kv::KvType;
use hf2q_tensor::train_op::SeqLayout;
use hf2q_train::data::Dataset;
use hf2q_train::dpo::{self, Reference};
use hf2q_train::report::{Event, Observer};
use hf2q_train::trainer::{prepare, Length, Objective, Outcome, TrainConfig, Trainer};
use serde_json::Value;

const CASES: [&str; 2] = ["tiny-llama", "tiny-qwen3"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn load(name: &str) -> Model {
    let path = root().join("../models/tests/fixtures/tiny").join(name);
    let mut m = Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    m.set_matmul_path(MatmulPath::Reference);
    m.set_kv_type(KvType::F32);
    m
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .unwrap()
}

fn batch_of(fx: &Value) -> TrainBatch {
    let nums = |k: &str| {
        fx[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect::<Vec<_>>()
    };
    let lengths: Vec<usize> = nums("lengths").into_iter().map(|x| x as usize).collect();
    TrainBatch {
        ids: nums("ids").into_iter().map(|x| x as u32).collect(),
        targets: nums("targets").into_iter().map(|x| x as i32).collect(),
        layout: SeqLayout::from_lengths(&lengths).unwrap(),
    }
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

#[test]
fn loss_metrics_and_lora_gradients_match_trl_formula_with_peft() {
    for name in CASES {
        let dir = root().join("tests/fixtures/dpo").join(name);
        let golden = read_json(&dir.join("golden.json"));
        let batch = batch_of(&golden["batch"]);
        for (case, recompute) in [("base", 0), ("ref_adapter", usize::MAX)] {
            let g = &golden[case];
            let beta = g["beta"].as_f64().unwrap();
            let mut m = load(name);
            let mut reference = match case {
                "base" => Reference::base(),
                _ => Reference::load(&mut m, &dir.join("dpo_ref")).unwrap(),
            };
            m.load_adapter(
                &root()
                    .join("tests/fixtures/peft")
                    .join(name)
                    .join("ours_random"),
            )
            .unwrap();
            let refs = reference.logps(&mut m, &batch).unwrap();
            let mut grads = LoraGrads::new();
            let opts = PassOptions {
                recompute_blocks: recompute,
                dropout: false,
                seed: 0,
            };
            let pairs = batch.layout.sequences() / 2;
            let st = dpo::policy_pass(&m, &batch, &refs, beta, pairs, &opts, &mut grads).unwrap();
            let want = |k: &str| g[k].as_f64().unwrap();
            let wants = |k: &str| {
                g[k].as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect::<Vec<_>>()
            };
            for (i, (a, b)) in refs.iter().zip(wants("ref_logps")).enumerate() {
                assert!(
                    (a - b).abs() < 1e-4,
                    "{name} {case}: reference log-prob {i}: {a} vs {b}"
                );
            }
            let pol = [st.logp_chosen, st.logp_rejected];
            let want_pol = wants("policy_logps");
            let sum_c: f64 = want_pol.iter().step_by(2).sum();
            let sum_r: f64 = want_pol.iter().skip(1).step_by(2).sum();
            assert!(
                (pol[0] - sum_c).abs() < 2e-4 && (pol[1] - sum_r).abs() < 2e-4,
                "{name} {case}: policy {pol:?} vs {want_pol:?}"
            );
            let loss = st.mean_loss();
            assert!(
                (loss - want("loss")).abs() < 1e-5,
                "{name} {case}: loss {loss} vs {}",
                want("loss")
            );
            let met = st.metrics();
            for (k, v) in [
                ("rewards/chosen", met.rewards_chosen),
                ("rewards/rejected", met.rewards_rejected),
                ("rewards/margins", met.rewards_margins),
                ("rewards/accuracies", met.rewards_accuracies),
                ("logps/chosen", met.logps_chosen),
                ("logps/rejected", met.logps_rejected),
            ] {
                let tol = if k.starts_with("logps") { 1e-4 } else { 1e-5 };
                assert!(
                    (v - want(k)).abs() < tol,
                    "{name} {case}: {k} {v} vs {}",
                    want(k)
                );
            }
            let st_file =
                SafeTensors::open(&dir.join(format!("grads_{case}.safetensors"))).unwrap();
            let mut worst = 0f64;
            for (module, l) in m.adapters() {
                let (ga, gb) = grads.get(l.id).unwrap();
                let (rows, r) = gb.dims2();
                let mut gbv = gb.data().to_vec();
                m.b_rows_to_peft(&module, &mut gbv, rows, r).unwrap();
                for (suffix, got) in [("lora_A", ga.data().to_vec()), ("lora_B", gbv)] {
                    let key = format!("base_model.model.{module}.{suffix}.weight");
                    let info = st_file
                        .tensor(&key)
                        .unwrap_or_else(|| panic!("{name}: no golden {key}"));
                    let e = rel_l2(&got, &st_file.to_f32(info).unwrap());
                    worst = worst.max(e);
                    assert!(e < 1e-3, "{name} {case}: {key} relative error {e:.2e}");
                }
            }
            eprintln!(
                "{name} {case}: loss {loss:.6} (PEFT {:.6}), worst gradient error {worst:.2e}",
                want("loss")
            );
        }
    }
}

struct Steps(Vec<Event>);
impl Observer for Steps {
    fn event(&mut self, e: &Event) {
        self.0.push(e.clone());
    }
}

fn pairs_file(dir: &Path) -> PathBuf {
    let p = dir.join("pairs.jsonl");
    let lines: Vec<String> = (0..6)
        .map(|i| {
            serde_json::json!({
                "prompt": format!("Question {i}: name a colour."),
                "chosen": format!(" Blue, number {i}."),
                "rejected": format!(" I do not know {i}."),
            })
            .to_string()
        })
        .collect();
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p
}

/// The first step of a run whose policy equals its reference: loss ln 2 and every reward 0,
/// exactly (the same forward on both sides; B = 0 adds exact zeros).
fn first_step(m: &mut Model, cfg: TrainConfig, dir: &Path) -> serde_json::Value {
    let data = Dataset::load_pairs(&pairs_file(dir)).unwrap();
    let prepared = prepare(m, &data, None, &cfg).unwrap();
    let mut t = Trainer::new(m, cfg, prepared, &dir.join("out"), None, true).unwrap();
    let mut obs = Steps(Vec::new());
    t.run(&mut obs, &AtomicBool::new(false)).unwrap();
    let step = obs
        .0
        .iter()
        .find(|e| matches!(e, Event::Step(_)))
        .expect("a step");
    serde_json::to_value(step).unwrap()
}

#[test]
fn a_fresh_adapter_starts_at_ln2_with_zero_rewards() {
    let tmp = tempfile::tempdir().unwrap();
    let base_cfg = TrainConfig {
        length: Length::Steps(2),
        batch: 2,
        objective: Objective::Dpo {
            beta: 0.1,
            ref_adapter: None,
        },
        ..TrainConfig::default()
    };
    let mut m = load("tiny-llama");
    let s = first_step(&mut m, base_cfg.clone(), tmp.path());
    assert_eq!(s["loss"].as_f64().unwrap(), std::f64::consts::LN_2, "{s}");
    for k in [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
    ] {
        assert_eq!(s[k].as_f64().unwrap(), 0.0, "{k}: {s}");
    }
    assert!(
        s["logps/chosen"].as_f64().unwrap() < 0.0 && s["grad_norm"].as_f64().unwrap() > 0.0,
        "{s}"
    );
    // Starting from a trained adapter with the same adapter as the reference: equal again.
    let adapter = root().join("tests/fixtures/peft/tiny-llama/ours_random");
    let cfg = TrainConfig {
        init_adapter: Some(adapter.clone()),
        objective: Objective::Dpo {
            beta: 0.1,
            ref_adapter: Some(adapter),
        },
        ..base_cfg
    };
    let mut m = load("tiny-llama");
    let s = first_step(&mut m, cfg, tmp.path());
    assert_eq!(s["loss"].as_f64().unwrap(), std::f64::consts::LN_2, "{s}");
    assert_eq!(s["rewards/margins"].as_f64().unwrap(), 0.0, "{s}");
    // The adapter written is the init adapter's shape (rank 4 of the fixture), trained.
    let cfg = hf2q_models::adapter::read_peft_config(&tmp.path().join("out")).unwrap();
    assert_eq!(cfg.config.r, 4);
}

/// Sets the stop flag once `at` steps are done.
struct StopAt<'a>(u64, &'a AtomicBool);
impl Observer for StopAt<'_> {
    fn event(&mut self, e: &Event) {
        if let Event::Step(s) = e {
            if s.step == self.0 {
                self.1.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
}

#[test]
fn a_stopped_and_resumed_dpo_run_ends_where_an_unbroken_one_ends() {
    let tmp = tempfile::tempdir().unwrap();
    let data = Dataset::load_pairs(&pairs_file(tmp.path())).unwrap();
    let reference = root().join("tests/fixtures/dpo/tiny-llama/dpo_ref");
    let cfg = TrainConfig {
        length: Length::Steps(6),
        batch: 2,
        lr: 1e-2,
        objective: Objective::Dpo {
            beta: 0.2,
            ref_adapter: Some(reference),
        },
        ..TrainConfig::default()
    };
    let run = |out: &Path, stop_at: Option<u64>, resume: Option<&Path>| -> (Outcome, Vec<u8>) {
        let mut m = load("tiny-llama");
        let prepared = prepare(&m, &data, None, &cfg).unwrap();
        let mut t = Trainer::new(&mut m, cfg.clone(), prepared, out, resume, false).unwrap();
        let stop = AtomicBool::new(false);
        let o = match stop_at {
            Some(n) => t.run(&mut StopAt(n, &stop), &stop).unwrap(),
            None => t.run(&mut Steps(Vec::new()), &stop).unwrap(),
        };
        (
            o,
            std::fs::read(out.join("adapter_model.safetensors")).unwrap_or_default(),
        )
    };
    let (_, unbroken) = run(&tmp.path().join("a"), None, None);
    let out_b = tmp.path().join("b");
    let (first, _) = run(&out_b, Some(3), None);
    let Outcome::Stopped {
        step: 3,
        checkpoint,
    } = first
    else {
        panic!("{first:?}")
    };
    let (_, resumed) = run(&out_b, None, Some(&checkpoint));
    assert!(!unbroken.is_empty());
    assert_eq!(resumed, unbroken, "the resumed DPO run ended elsewhere");
}
