//! The GPU trainer against the CPU trainer (GPU machine only; without a CUDA device every test
//! prints "skipped: no CUDA device" and passes): one pass's loss and every adapter gradient, then
//! a few AdamW steps, on the tiny checkpoints of every family (their head widths take the f32
//! attention kernels) and, with `HF2Q_TEST_SMOLLM2_GGUF`, SmolLM2 (head width 64: the bf16
//! tensor-core attention, and bf16 products throughout).
//!
//! Budget, stated where it is checked: the GPU's products and attention take bf16 operands with
//! f32 sums (relative error of one product ~3e-3, measured by the op tests), so a whole model's
//! loss agrees to 1e-2 relative and each gradient tensor to 5e-2 relative L2; the tiny models'
//! f32 attention and small widths keep them far closer.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hf2q_cpu::MatmulPath;
use hf2q_cuda::backend::CudaBackend;
use hf2q_cuda::{CudaDev, KvDtype, PrefillGemm};
use hf2q_models::adapter::LoraConfig;
use hf2q_models::layers::lora::LoraGrads;
use hf2q_models::train_pass::{PassOptions, TrainBatch};
use hf2q_models::Model;
use hf2q_tensor::train_op::SeqLayout;
use hf2q_tensor::Tensor;

fn gpu() -> Option<Arc<CudaBackend>> {
    match CudaDev::open(
        0,
        &hf2q_cuda::CudaOptions::from_environment(|k| std::env::var_os(k)).unwrap(),
    ) {
        Ok(Some(dev)) => {
            dev.set_prefill_gemm(PrefillGemm::F16);
            Some(Arc::new(CudaBackend::new(dev, KvDtype::F16).unwrap()))
        }
        _ => {
            eprintln!("skipped: no CUDA device");
            None
        }
    }
}

fn models() -> Vec<(String, PathBuf)> {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny");
    let mut v: Vec<(String, PathBuf)> = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"]
        .iter()
        .map(|n| (n.to_string(), tiny.join(n)))
        .collect();
    if let Ok(p) = std::env::var("HF2Q_TEST_SMOLLM2_GGUF") {
        if !p.is_empty() {
            v.push(("smollm2".into(), PathBuf::from(p)));
        }
    }
    v
}

/// Two sequences of 150 and 90 tokens (below the vocabulary), every row but the last of each
/// learned.
fn batch(vocab: usize) -> TrainBatch {
    let lengths = [150usize, 90];
    let ids: Vec<u32> = (0..240u32)
        .map(|i| (i * 7919 + 13) % (vocab as u32 - 3))
        .collect();
    let mut targets = Vec::new();
    let mut at = 0;
    for &l in &lengths {
        for k in 0..l {
            targets.push(if k + 1 < l {
                ids[at + k + 1] as i32
            } else {
                -100
            });
        }
        at += l;
    }
    TrainBatch {
        ids,
        targets,
        layout: SeqLayout::from_lengths(&lengths).unwrap(),
    }
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let n: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let d: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (n / d.max(1e-300)).sqrt()
}

/// Loss and host gradients (in adapter order) of one pass, on whatever backend `m` runs on.
fn pass(m: &Model, b: &TrainBatch, checkpoint: bool) -> (f64, Vec<Vec<f32>>) {
    let n = b.labelled() as f32;
    let w: Vec<f32> = b
        .targets
        .iter()
        .map(|&t| if t >= 0 { -1.0 / n } else { 0.0 })
        .collect();
    let mut g = LoraGrads::new();
    let out = m
        .train_pass(
            b,
            &w,
            &PassOptions {
                recompute_blocks: if checkpoint { usize::MAX } else { 0 },
                dropout: false,
                seed: 0,
            },
            &mut g,
        )
        .unwrap();
    let be = m.train_backend();
    let grads = m
        .adapters()
        .iter()
        .flat_map(|(_, l)| {
            let (a, bb) = g.get(l.id).unwrap();
            [
                be.to_host(a).unwrap().into_data(),
                be.to_host(bb).unwrap().into_data(),
            ]
        })
        .collect();
    (
        -out.logp.iter().map(|&x| x as f64).sum::<f64>() / n as f64,
        grads,
    )
}

#[test]
fn gpu_pass_equals_cpu_pass_within_the_bf16_budget() {
    let Some(gpu) = gpu() else { return };
    for (name, path) in models() {
        let mut m = Model::load(&path).unwrap();
        m.set_matmul_path(MatmulPath::Reference);
        m.attach_lora(
            &LoraConfig {
                r: 8,
                alpha: 16.0,
                ..LoraConfig::default()
            },
            3,
        )
        .unwrap();
        // Nonzero B, so every factor has a gradient.
        for (i, (_, l)) in m.adapters_mut().into_iter().enumerate() {
            let s = l.b.shape().to_vec();
            let v = (0..l.b.len())
                .map(|k| (((k * 31 + i * 17) % 23) as f32 - 11.0) * 1e-3)
                .collect();
            l.b = Tensor::new(&s, v).unwrap();
        }
        let b = batch(m.vocab_size());
        let (cpu_loss, cpu_g) = pass(&m, &b, false);
        m.set_cuda(Some(gpu.clone())).unwrap();
        for checkpoint in [false, true] {
            let (gpu_loss, gpu_g) = pass(&m, &b, checkpoint);
            let rel = (gpu_loss - cpu_loss).abs() / cpu_loss;
            let (mut worst, mut at) = (0f64, 0);
            for (i, (c, g)) in cpu_g.iter().zip(&gpu_g).enumerate() {
                let e = rel_l2(g, c);
                if e > worst {
                    (worst, at) = (e, i);
                }
            }
            let names = m
                .adapters()
                .iter()
                .flat_map(|(n, _)| [format!("{n} A"), format!("{n} B")])
                .collect::<Vec<_>>();
            eprintln!("{name}: worst gradient at {}", names[at]);
            eprintln!("{name} (checkpoint {checkpoint}): loss cpu {cpu_loss:.6} gpu {gpu_loss:.6} ({rel:.1e}), worst gradient {worst:.2e}");
            assert!(rel < 1e-2, "{name}: loss {gpu_loss} vs {cpu_loss}");
            assert!(worst < 5e-2, "{name}: a gradient differs by {worst:.2e}");
        }
    }
}

/// An adapter at inference on the GPU, decode graph included: the teacher-forced logits of a
/// prefill and of graph-replayed one-token steps equal the CPU's (f32 products on both sides
/// but the GPU's f16 KV cache and kernels: 1e-2 absolute on logits of magnitude ~5).
#[test]
fn adapters_apply_in_the_gpu_decode_graph() {
    let Some(gpu) = gpu() else { return };
    let tiny =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny/tiny-llama");
    let adapter =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/peft/tiny-llama/ours_random");
    let mut m = Model::load(&tiny).unwrap();
    m.set_matmul_path(MatmulPath::Reference);
    m.load_adapter(&adapter).unwrap();
    let ids: Vec<u32> = (0..24u32).map(|i| 60 + (i * 7) % 50).collect();
    let cpu = m.session(64).forward_all(&ids).unwrap();
    let mut base = Model::load(&tiny).unwrap();
    base.set_matmul_path(MatmulPath::Reference);
    let plain = base.session(64).forward_all(&ids).unwrap();
    let moved = cpu
        .data()
        .iter()
        .zip(plain.data())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        moved > 1e-2,
        "the adapter does not change the logits ({moved})"
    );
    m.set_cuda(Some(gpu)).unwrap();
    let mut s = m.session(64);
    s.prefill(&ids[..8]).unwrap();
    let mut worst = 0f32;
    for (k, &t) in ids[8..].iter().enumerate() {
        // From the second step on, each decode is one replay of the captured graph.
        let l = s.decode(t).unwrap();
        let want = cpu.row(8 + k);
        worst = worst.max(
            l.iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max),
        );
    }
    eprintln!("adapter decode on the GPU: worst logit difference {worst:.2e} (adapter moves logits by {moved:.2e})");
    assert!(
        worst < 1e-2,
        "GPU decode with an adapter differs by {worst}"
    );
    assert!(
        s.graph_nodes().is_some(),
        "the decode ran without a captured graph"
    );
}

/// A DPO policy pass on the GPU against the CPU's (the DPO parity batch of two pairs, the
/// reference a second adapter swapped in on the same backend): loss, rewards and every
/// gradient within the bf16 budget above.
#[test]
fn gpu_dpo_pass_equals_cpu_dpo_pass() {
    use hf2q_train::dpo::{self, Reference};
    let Some(gpu) = gpu() else { return };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for name in ["tiny-llama", "tiny-qwen3"] {
        let fx = root.join("tests/fixtures/dpo").join(name);
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fx.join("golden.json")).unwrap())
                .unwrap();
        let nums = |k: &str| {
            golden["batch"][k]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap())
                .collect::<Vec<_>>()
        };
        let lengths: Vec<usize> = nums("lengths").into_iter().map(|x| x as usize).collect();
        let b = TrainBatch {
            ids: nums("ids").into_iter().map(|x| x as u32).collect(),
            targets: nums("targets").into_iter().map(|x| x as i32).collect(),
            layout: SeqLayout::from_lengths(&lengths).unwrap(),
        };
        let run = |cuda: Option<Arc<CudaBackend>>, checkpoint: bool| {
            let mut m =
                Model::load(&root.join("../models/tests/fixtures/tiny").join(name)).unwrap();
            m.set_matmul_path(MatmulPath::Reference);
            m.set_cuda(cuda).unwrap();
            let mut r = Reference::load(&mut m, &fx.join("dpo_ref")).unwrap();
            m.load_adapter(
                &root
                    .join("tests/fixtures/peft")
                    .join(name)
                    .join("ours_random"),
            )
            .unwrap();
            let refs = r.logps(&mut m, &b).unwrap();
            let mut g = LoraGrads::new();
            let opts = PassOptions {
                recompute_blocks: if checkpoint { usize::MAX } else { 0 },
                dropout: false,
                seed: 0,
            };
            let st = dpo::policy_pass(&m, &b, &refs, 0.5, 2, &opts, &mut g).unwrap();
            let be = m.train_backend();
            let grads: Vec<Vec<f32>> = m
                .adapters()
                .iter()
                .flat_map(|(_, l)| {
                    let (a, bb) = g.get(l.id).unwrap();
                    [
                        be.to_host(a).unwrap().into_data(),
                        be.to_host(bb).unwrap().into_data(),
                    ]
                })
                .collect();
            (st, grads)
        };
        let (cpu, cpu_g) = run(None, false);
        for checkpoint in [false, true] {
            let (gst, gpu_g) = run(Some(gpu.clone()), checkpoint);
            let rel = (gst.mean_loss() - cpu.mean_loss()).abs() / cpu.mean_loss();
            let worst = cpu_g
                .iter()
                .zip(&gpu_g)
                .map(|(c, g)| rel_l2(g, c))
                .fold(0f64, f64::max);
            let (mc, mg) = (cpu.metrics(), gst.metrics());
            eprintln!(
                "{name} DPO (checkpoint {checkpoint}): loss cpu {:.6} gpu {:.6}, margins {:.5} / {:.5}, worst gradient {worst:.2e}",
                cpu.mean_loss(),
                gst.mean_loss(),
                mc.rewards_margins,
                mg.rewards_margins
            );
            assert!(
                rel < 1e-2,
                "{name}: DPO loss {} vs {}",
                gst.mean_loss(),
                cpu.mean_loss()
            );
            // Margins are differences of log-prob sums of ~10 tokens: 1e-2 absolute.
            assert!(
                (mc.rewards_margins - mg.rewards_margins).abs() < 1e-2,
                "{name}: margins {mg:?} vs {mc:?}"
            );
            assert!(
                worst < 5e-2,
                "{name}: a DPO gradient differs by {worst:.2e}"
            );
        }
    }
}
