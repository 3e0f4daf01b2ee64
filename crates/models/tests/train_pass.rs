//! The model-level training pass on the tiny random checkpoints of every family (Llama with
//! llama3 RoPE scaling, Qwen2's biases, Qwen3's q/k norms, Gemma 3's sandwich norms and sliding
//! window), held to the model's own inference forward and to finite differences:
//!
//! - the training forward's log-probabilities equal the inference forward's (`forward_all`, the
//!   path golden-tested against transformers) of each sequence run alone, adapters included;
//! - the gradient of the adapters, as a directional derivative, equals a central difference of
//!   the loss (f32 model: eps 1e-3 along a unit-scale direction, tolerance 2e-3 of
//!   max(|derivative|, 1) — the difference quotient's own rounding is ~2e-4);
//! - checkpointing changes nothing (the same operations, so the same bits).

use std::path::{Path, PathBuf};

use hf2q_cpu::MatmulPath;
use hf2q_models::adapter::LoraConfig;
use hf2q_models::layers::lora::LoraGrads;
use hf2q_models::train_pass::{PassOptions, TrainBatch};
use hf2q_models::Model;
use hf2q_tensor::kv::KvType;
use hf2q_tensor::train_op::SeqLayout;
use hf2q_tensor::Tensor;

fn tiny(name: &str) -> Model {
    let p: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tiny")
        .join(name);
    let mut m = Model::load(&p).unwrap();
    m.set_matmul_path(MatmulPath::Reference);
    m.set_kv_type(KvType::F32);
    m
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

/// Adapters on every linear with random B (B = 0 would leave A without a gradient).
fn with_adapters(m: &mut Model, r: &mut Rng) {
    let cfg = LoraConfig {
        r: 4,
        alpha: 8.0,
        ..LoraConfig::default()
    };
    m.attach_lora(&cfg, 7).unwrap();
    for (_, l) in m.adapters_mut() {
        let shape = l.b.shape().to_vec();
        l.b = Tensor::new(&shape, (0..l.b.len()).map(|_| r.next() * 0.2).collect()).unwrap();
    }
}

/// Two sequences of byte tokens (one longer than Gemma's window of 4), next-token targets,
/// some rows unlabelled.
fn batch() -> TrainBatch {
    let seqs: [Vec<u32>; 2] = [
        (0..7)
            .map(|i| if i == 0 { 256 } else { 60 + i * 3 })
            .collect(),
        (0..12).map(|i| 70 + (i * 7) % 40).collect(),
    ];
    let mut ids = Vec::new();
    let mut targets = Vec::new();
    for s in &seqs {
        for (i, &t) in s.iter().enumerate() {
            ids.push(t);
            targets.push(match s.get(i + 1) {
                Some(&n) if i != 2 => n as i32,
                _ => -100,
            });
        }
    }
    TrainBatch {
        ids,
        targets,
        layout: SeqLayout::from_lengths(&[seqs[0].len(), seqs[1].len()]).unwrap(),
    }
}

fn loss(m: &Model, b: &TrainBatch) -> f64 {
    let out = m.eval_pass(b).unwrap();
    -out.logp.iter().map(|&x| x as f64).sum::<f64>() / b.labelled() as f64
}

const FAMILIES: [&str; 10] = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma3",
    "tiny-phi3",
    "tiny-mistral",
    "tiny-smollm3",
    "tiny-granite",
    "tiny-olmo2",
    "tiny-minicpm",
];

#[test]
fn training_forward_equals_inference_forward() {
    for name in FAMILIES {
        let mut m = tiny(name);
        with_adapters(&mut m, &mut Rng(0x1234));
        let b = batch();
        let out = m.eval_pass(&b).unwrap();
        let mut row = 0;
        for len in b.layout.lengths() {
            let ids = &b.ids[row..row + len];
            let logits = m.session(len).forward_all(ids).unwrap();
            for i in 0..len {
                let t = b.targets[row + i];
                if t < 0 {
                    assert_eq!(out.logp[row + i], 0.0);
                    continue;
                }
                let l = logits.row(i);
                let mx = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let lse = mx + l.iter().map(|v| (v - mx).exp()).sum::<f32>().ln();
                let want = l[t as usize] - lse;
                assert!(
                    (out.logp[row + i] - want).abs() < 1e-4,
                    "{name} row {}: {} vs {want}",
                    row + i,
                    out.logp[row + i]
                );
            }
            row += len;
        }
    }
}

#[test]
fn adapter_gradients_match_finite_differences_and_checkpointing() {
    for name in FAMILIES {
        let mut m = tiny(name);
        let mut rng = Rng(0x9876);
        with_adapters(&mut m, &mut rng);
        let b = batch();
        let n = b.labelled() as f32;
        let w: Vec<f32> = b
            .targets
            .iter()
            .map(|&t| if t >= 0 { -1.0 / n } else { 0.0 })
            .collect();
        // No block recomputed, the first of two, both.
        let mut grads = [LoraGrads::new(), LoraGrads::new(), LoraGrads::new()];
        for (g, recompute_blocks) in grads.iter_mut().zip([0, 1, usize::MAX]) {
            let opts = PassOptions {
                recompute_blocks,
                dropout: false,
                seed: 0,
            };
            m.train_pass(&b, &w, &opts, g).unwrap();
        }
        for other in &grads[1..] {
            for (a, c) in grads[0].tensors().zip(other.tensors()) {
                assert_eq!(a, c, "{name}: checkpointing changed a gradient");
            }
        }
        // Direction: random values on every factor.
        let dirs: Vec<(Vec<f32>, Vec<f32>)> = m
            .adapters()
            .iter()
            .map(|(_, l)| {
                (
                    (0..l.a.len()).map(|_| rng.next()).collect(),
                    (0..l.b.len()).map(|_| rng.next()).collect(),
                )
            })
            .collect();
        let mut analytic = 0f64;
        for ((_, l), (da, db)) in m.adapters().iter().zip(&dirs) {
            let (ga, gb) = grads[0].get(l.id).expect("every adapter has a gradient");
            analytic += ga
                .data()
                .iter()
                .zip(da)
                .map(|(g, d)| (g * d) as f64)
                .sum::<f64>();
            analytic += gb
                .data()
                .iter()
                .zip(db)
                .map(|(g, d)| (g * d) as f64)
                .sum::<f64>();
        }
        let eps = 1e-3f32;
        let shift = |m: &mut Model, s: f32| {
            for ((_, l), (da, db)) in m.adapters_mut().into_iter().zip(&dirs) {
                l.a.data_mut()
                    .iter_mut()
                    .zip(da)
                    .for_each(|(x, d)| *x += s * d);
                l.b.data_mut()
                    .iter_mut()
                    .zip(db)
                    .for_each(|(x, d)| *x += s * d);
            }
        };
        shift(&mut m, eps);
        let lp = loss(&m, &b);
        shift(&mut m, -2.0 * eps);
        let lm = loss(&m, &b);
        let numeric = (lp - lm) / (2.0 * eps as f64);
        // The loss (~5) is rounded to f32 per row: ~3e-7 of noise each side, ~2e-4 in the
        // quotient, so small derivatives are held to an absolute bound instead.
        let rel = (analytic - numeric).abs() / numeric.abs().max(1.0);
        eprintln!("{name}: directional derivative {analytic:.6} vs {numeric:.6} ({rel:.1e})");
        assert!(
            rel < 2e-3,
            "{name}: directional derivative {analytic} vs {numeric} ({rel:.2e})"
        );
    }
}
