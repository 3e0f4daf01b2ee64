//! Parity with PEFT (PyTorch + transformers + peft, float32, TF32 off): goldens made by
//! `scripts/goldens/make_peft_goldens.py` on the GPU machine (versions in each `golden.json`'s
//! `meta`) from adapters and batches this file writes (`write_adapter_fixtures`, ignored; run it
//! with `--ignored` to regenerate the inputs, then the script to regenerate the goldens).
//!
//! Per model (tiny random Llama / Qwen2 / Qwen3 / Gemma 3 checkpoints, and SmolLM2-135M's real
//! weights from `HF2Q_TEST_SMOLLM2_GGUF`, skipped without it), fixtures under
//! `tests/fixtures/peft/NAME/`:
//! - `batch.json`: two sequences, their targets (some rows unlabelled) and a probe sequence;
//! - `ours_random/`: an adapter written by hf2q with random A and B (B = 0 would leave A's
//!   gradient 0), `ours_init/`: hf2q's PEFT-style initialisation (B = 0);
//! - `golden.json`: PEFT's loss of the batch under `ours_random`, its probe logits (PEFT
//!   loading our file), the 20-step AdamW loss curve from `ours_init`, the probe logits of
//!   `peft_trained/` (the adapter PEFT wrote after those steps);
//! - `grads.safetensors`: PEFT's gradient of every LoRA factor under `ours_random`.
//!
//! Tolerances (float32 on both sides, different summation orders): loss 1e-5 relative, every
//! gradient tensor 1e-3 relative (‖ours − PEFT‖ / ‖PEFT‖), probe logits 1e-4 absolute (the
//! inference parity tolerance of the tiny models), loss curve 1e-3 absolute per step.

use std::path::{Path, PathBuf};

use hf2q_cpu::MatmulPath;
use hf2q_models::adapter::LoraConfig;
use hf2q_models::Model;
use hf2q_tensor::kv::KvType;
use hf2q_tensor::Tensor;
use serde_json::{json, Value};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/peft")
}

fn tiny_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures/tiny")
        .join(name)
}

/// One parity case: the model, where it comes from, the adapter settings.
struct Case {
    name: &'static str,
    lora: LoraConfig,
}

fn cases() -> Vec<Case> {
    let tiny = |name| Case {
        name,
        lora: LoraConfig {
            r: 4,
            alpha: 8.0,
            ..LoraConfig::default()
        },
    };
    vec![
        tiny("tiny-llama"),
        tiny("tiny-qwen2"),
        tiny("tiny-qwen3"),
        tiny("tiny-gemma3"),
        // Real weights: three layers (first, middle, last) keep the fixtures under 1 MB; rsLoRA
        // exercises the other scale.
        Case {
            name: "smollm2",
            lora: LoraConfig {
                r: 4,
                alpha: 8.0,
                rslora: true,
                layers: Some(vec![0, 14, 29]),
                ..LoraConfig::default()
            },
        },
    ]
}

/// The case's model on the reference path (f32 activations, f32 cache), or `None` (skipped)
/// when it is SmolLM2 and its file is not given.
fn load(name: &str) -> Option<Model> {
    let path = if name == "smollm2" {
        match std::env::var("HF2Q_TEST_SMOLLM2_GGUF") {
            Ok(p) if !p.is_empty() => PathBuf::from(p),
            _ => {
                eprintln!("skipped {name}: HF2Q_TEST_SMOLLM2_GGUF is not set");
                return None;
            }
        }
    } else {
        tiny_dir(name)
    };
    let mut m = Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    m.set_matmul_path(MatmulPath::Reference);
    m.set_kv_type(KvType::F32);
    Some(m)
}

/// Token ids of the case's texts: bytes for the tiny models' byte-level vocabulary (BOS 256
/// first), the real tokenizer for SmolLM2.
fn encode(m: &Model, name: &str, text: &str) -> Vec<u32> {
    if name == "smollm2" {
        m.tokenizer().encode(text, true, false).unwrap()
    } else {
        std::iter::once(256)
            .chain(text.bytes().map(u32::from))
            .collect()
    }
}

const TEXTS: [&str; 3] = [
    "The printing press spread across Europe within fifty years, and ideas moved faster.",
    "Q: What is two plus three? A: Five.",
    "def add(a, b):\n    return a + b",
];

/// The batch: two sequences, targets = the next token, the first quarter of each unlabelled
/// (a prompt); the probe: a third sequence.
fn make_batch(m: &Model, name: &str) -> Value {
    let cap = if name == "smollm2" { 40 } else { 24 };
    let seqs: Vec<Vec<u32>> = TEXTS[..2]
        .iter()
        .map(|t| encode(m, name, t).into_iter().take(cap).collect())
        .collect();
    let mut ids = Vec::new();
    let mut targets = Vec::new();
    for s in &seqs {
        let prompt = s.len() / 4;
        for i in 0..s.len() {
            ids.push(s[i]);
            targets.push(match s.get(i + 1) {
                Some(&t) if i + 1 > prompt => t as i64,
                _ => -100,
            });
        }
    }
    let probe: Vec<u32> = encode(m, name, TEXTS[2]).into_iter().take(cap).collect();
    json!({
        "ids": ids,
        "targets": targets,
        "lengths": seqs.iter().map(Vec::len).collect::<Vec<_>>(),
        "probe": probe,
    })
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Writes every case's `batch.json`, `ours_init/` and `ours_random/` (the inputs of the golden
/// script). Run with `--ignored` after changing the cases; then regenerate the goldens.
#[test]
#[ignore]
fn write_adapter_fixtures() {
    for case in cases() {
        let Some(mut m) = load(case.name) else {
            continue;
        };
        let dir = fixtures().join(case.name);
        std::fs::create_dir_all(&dir).unwrap();
        let batch = make_batch(&m, case.name);
        std::fs::write(
            dir.join("batch.json"),
            serde_json::to_string(&batch).unwrap() + "\n",
        )
        .unwrap();
        let base = if case.name == "smollm2" {
            "HuggingFaceTB/SmolLM2-135M-Instruct".to_string()
        } else {
            case.name.to_string()
        };
        m.attach_lora(&case.lora, 1234).unwrap();
        m.save_adapter(&dir.join("ours_init"), &case.lora, &base)
            .unwrap();
        let mut rng = Rng(0xfeed_f00d);
        for (_, l) in m.adapters_mut() {
            let sa = l.a.shape().to_vec();
            let sb = l.b.shape().to_vec();
            let a: Vec<f32> =
                l.a.data()
                    .iter()
                    .map(|x| x + 0.5 * rng.next() * x.abs().max(0.05))
                    .collect();
            l.a = Tensor::new(&sa, a).unwrap();
            l.b = Tensor::new(&sb, (0..l.b.len()).map(|_| 0.05 * rng.next()).collect()).unwrap();
        }
        m.save_adapter(&dir.join("ours_random"), &case.lora, &base)
            .unwrap();
        eprintln!("{}: wrote {}", case.name, dir.display());
    }
}

// ---- the parity tests ---------------------------------------------------------------------

use hf2q_models::layers::lora::LoraGrads;
use hf2q_models::train_pass::{PassOptions, TrainBatch};
use hf2q_tensor::io::safetensors::SafeTensors;
use hf2q_tensor::train_op::SeqLayout;
use hf2q_train::optim::{clip_grad_norm, AdamW, AdamWConfig, Schedule, ScheduleKind};

fn read_json(p: &Path) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn batch_of(fx: &Value) -> TrainBatch {
    let lengths: Vec<usize> = u32s(&fx["lengths"])
        .into_iter()
        .map(|x| x as usize)
        .collect();
    TrainBatch {
        ids: u32s(&fx["ids"]),
        targets: fx["targets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap() as i32)
            .collect(),
        layout: SeqLayout::from_lengths(&lengths).unwrap(),
    }
}

/// SFT's weights: the mean over labelled rows.
fn mean_weights(b: &TrainBatch) -> Vec<f32> {
    let n = b.labelled() as f32;
    b.targets
        .iter()
        .map(|&t| if t >= 0 { -1.0 / n } else { 0.0 })
        .collect()
}

fn loss_of(out: &hf2q_models::train_pass::PassOut, b: &TrainBatch) -> f64 {
    -out.logp.iter().map(|&x| x as f64).sum::<f64>() / b.labelled() as f64
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

/// The case's fixture folder, golden and batch; `None` (skipped) when the model is absent.
fn setup(case: &Case) -> Option<(Model, PathBuf, Value, TrainBatch)> {
    let m = load(case.name)?;
    let dir = fixtures().join(case.name);
    let golden = read_json(&dir.join("golden.json"));
    let batch = batch_of(&read_json(&dir.join("batch.json")));
    Some((m, dir, golden, batch))
}

#[test]
fn loss_and_every_lora_gradient_match_peft() {
    for case in cases() {
        let Some((mut m, dir, golden, batch)) = setup(&case) else {
            continue;
        };
        m.load_adapter(&dir.join("ours_random")).unwrap();
        let mut grads = LoraGrads::new();
        let opts = PassOptions {
            recompute_blocks: usize::MAX,
            dropout: false,
            seed: 0,
        };
        let out = m
            .train_pass(&batch, &mean_weights(&batch), &opts, &mut grads)
            .unwrap();
        let loss = loss_of(&out, &batch);
        let want = golden["loss"].as_f64().unwrap();
        let rel = (loss - want).abs() / want.abs();
        assert!(
            rel < 1e-5,
            "{}: loss {loss} vs PEFT {want} ({rel:.2e})",
            case.name
        );
        let st = SafeTensors::open(&dir.join("grads.safetensors")).unwrap();
        let mut worst = 0f64;
        for (name, l) in m.adapters() {
            let (ga, gb) = grads.get(l.id).unwrap();
            let (rows, r) = gb.dims2();
            let mut gbv = gb.data().to_vec();
            m.b_rows_to_peft(&name, &mut gbv, rows, r).unwrap();
            for (suffix, got) in [("lora_A", ga.data().to_vec()), ("lora_B", gbv)] {
                let key = format!("base_model.model.{name}.{suffix}.weight");
                let info = st
                    .tensor(&key)
                    .unwrap_or_else(|| panic!("{}: no golden {key}", case.name));
                let e = rel_l2(&got, &st.to_f32(info).unwrap());
                worst = worst.max(e);
                assert!(e < 1e-3, "{}: {key} relative error {e:.2e}", case.name);
            }
        }
        eprintln!(
            "{}: loss {loss:.6} (PEFT {want:.6}), worst gradient error {worst:.2e}",
            case.name
        );
    }
}

/// Our probe logits under the adapter in `sub` against PEFT's in `golden[key]` (full rows for
/// the tiny models, the top 20 of every position for SmolLM2).
fn check_probe(case: &Case, m: &Model, fx: &Value, golden: &Value, key: &str) {
    let probe = u32s(&fx["probe"]);
    let logits = m.session(probe.len()).forward_all(&probe).unwrap();
    let g = &golden[key];
    let mut worst = 0f32;
    if let Some(rows) = g["logits"].as_array() {
        for (i, row) in rows.iter().enumerate() {
            for (j, v) in row.as_array().unwrap().iter().enumerate() {
                worst = worst.max((logits.row(i)[j] - v.as_f64().unwrap() as f32).abs());
            }
        }
    } else {
        for (i, st) in g["top"].as_array().unwrap().iter().enumerate() {
            for (id, v) in u32s(&st["top_ids"])
                .iter()
                .zip(st["top_logits"].as_array().unwrap())
            {
                worst = worst.max((logits.row(i)[*id as usize] - v.as_f64().unwrap() as f32).abs());
            }
        }
    }
    // Tiny models: transformers' f32 forward vs ours differs by summation order (~1e-5); the
    // real model's logits are larger (~20) and its forward longer: 1e-3.
    let tol = if case.name == "smollm2" { 1e-3 } else { 1e-4 };
    eprintln!("{} {key}: worst logit difference {worst:.2e}", case.name);
    assert!(worst < tol, "{} {key}: logits differ by {worst}", case.name);
}

#[test]
fn peft_reads_our_adapter_as_we_do() {
    for case in cases() {
        let Some((mut m, dir, golden, _)) = setup(&case) else {
            continue;
        };
        let fx = read_json(&dir.join("batch.json"));
        m.load_adapter(&dir.join("ours_random")).unwrap();
        check_probe(&case, &m, &fx, &golden, "probe_ours_random");
    }
}

#[test]
fn we_read_the_adapter_peft_wrote() {
    for case in cases() {
        let Some((mut m, dir, golden, _)) = setup(&case) else {
            continue;
        };
        let fx = read_json(&dir.join("batch.json"));
        let cfg = m.load_adapter(&dir.join("peft_trained")).unwrap();
        assert_eq!(cfg.r, case.lora.r);
        check_probe(&case, &m, &fx, &golden, "probe_peft_trained");
    }
}

#[test]
fn twenty_adamw_steps_follow_peft_loss_curve() {
    for case in cases() {
        let Some((mut m, dir, golden, batch)) = setup(&case) else {
            continue;
        };
        m.load_adapter(&dir.join("ours_init")).unwrap();
        let hp = &golden["hp"];
        let f = |k: &str| hp[k].as_f64().unwrap() as f32;
        let steps = hp["steps"].as_u64().unwrap();
        let mut adam = AdamW::new(
            &m,
            AdamWConfig {
                beta1: hp["betas"][0].as_f64().unwrap() as f32,
                beta2: hp["betas"][1].as_f64().unwrap() as f32,
                eps: f("eps"),
                weight_decay: f("weight_decay"),
            },
        )
        .unwrap();
        let sched = Schedule {
            base: f("lr"),
            warmup: hp["warmup_steps"].as_u64().unwrap(),
            total: steps,
            kind: ScheduleKind::Cosine,
        };
        let be = m.train_backend_handle();
        let curve = golden["curve"].as_array().unwrap();
        let opts = PassOptions {
            recompute_blocks: 0,
            dropout: false,
            seed: 0,
        };
        let w = mean_weights(&batch);
        let mut worst = 0f64;
        for step in 0..steps {
            let mut grads = LoraGrads::new();
            let out = m.train_pass(&batch, &w, &opts, &mut grads).unwrap();
            let loss = loss_of(&out, &batch);
            let want = curve[step as usize].as_f64().unwrap();
            worst = worst.max((loss - want).abs());
            assert!(
                (loss - want).abs() < 1e-3,
                "{} step {step}: loss {loss} vs PEFT {want}",
                case.name
            );
            let norm = clip_grad_norm(&*be, &mut grads, Some(f("max_grad_norm"))).unwrap();
            let want_norm = golden["grad_norms"][step as usize].as_f64().unwrap();
            assert!(
                (norm - want_norm).abs() < 1e-3 * want_norm.max(1.0),
                "{} step {step}: grad norm {norm} vs {want_norm}",
                case.name
            );
            adam.update(&mut m, &grads, sched.lr(step)).unwrap();
        }
        eprintln!(
            "{}: {steps} steps, worst loss difference {worst:.2e}",
            case.name
        );
    }
}
