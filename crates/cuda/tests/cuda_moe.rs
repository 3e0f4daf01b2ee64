//! The CUDA mixture-of-experts path (`CudaBackend::moe_ffn`: routing, expert products and the
//! sum on the device, cuda/moe.rs) against the CPU reference, for every format with device
//! expert kernels, stacked and stored one tensor per expert; and inside a captured graph.
//!
//! Routing cases: random logits, every token to one expert, an expert never chosen, k = 1, 2, 8
//! and k = E. Tolerance: max |GPU - CPU| <= 1e-4 · max |CPU| + 1e-6. Both dequantize the same
//! blocks exactly and sum in f32, in different orders: a few hundred roundings at 2^-24 of
//! values of order 1; batches of 9 tokens or more (the integer expert products) also round
//! the activations to 16 bits twice (at most 2^-15 of a block's largest, before the gate/up
//! and before the down products); a wrong expert, weight or row moves the result by its own
//! size. Without
//! a GPU each test prints "skipped: no CUDA device" and passes.

use std::sync::Arc;

use hf2q_cpu::CpuBackend;
use hf2q_cuda::backend::{CudaBackend, StepOutput};
use hf2q_cuda::{CudaDev, KvDtype, MvMode};
use hf2q_tensor::moe::{Experts, MoeSpec};
use hf2q_tensor::op::{Backend, GateAct};
use hf2q_tensor::quant;
use hf2q_tensor::{Bytes, GgmlType, QTensor, Tensor};

fn gpu(relaid: bool) -> Option<CudaBackend> {
    let dev = match CudaDev::open(
        0,
        &hf2q_cuda::CudaOptions::from_environment(|k| std::env::var_os(k)).unwrap(),
    ) {
        Ok(Some(d)) => d,
        Ok(None) => {
            println!("skipped: no CUDA device");
            return None;
        }
        Err(e) => panic!("a CUDA device is present but could not be opened: {e}"),
    };
    let m = if relaid { MvMode::All } else { MvMode::Off };
    dev.set_q4k_relayout(m);
    dev.set_q6k_relayout(m);
    Some(CudaBackend::new(dev, KvDtype::F16).unwrap())
}

/// Deterministic values in about [-mag, mag).
fn noise(n: usize, seed: u32, mag: f32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h =
                (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)).wrapping_mul(2246822519);
            ((h >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 2.0 * mag
        })
        .collect()
}

fn weight(ty: GgmlType, name: &str, rows: usize, cols: usize, seed: u32) -> QTensor {
    let w = noise(rows * cols, seed, 0.5);
    let rb = ty.row_bytes(cols).unwrap();
    let mut bytes = vec![0u8; rows * rb];
    for (src, dst) in w.chunks(cols).zip(bytes.chunks_mut(rb)) {
        quant::quantize(ty, src, dst).unwrap();
    }
    QTensor::ggml(name, ty, rows, cols, Bytes::from_vec(bytes)).unwrap()
}

/// `E` experts of width `f` over hidden size `d`, stacked, and the same as one tensor each.
fn experts(ty: GgmlType, e: usize, f: usize, d: usize, seed: u32) -> (Experts, Experts) {
    let g = weight(ty, "gate_exps", e * f, d, seed);
    let u = weight(ty, "up_exps", e * f, d, seed + 1);
    let dn = weight(ty, "down_exps", e * d, f, seed + 2);
    let stacked = Experts::from_stacked(e, g, u, dn).unwrap();
    // Copies of the views (own bytes), so nothing records them as stacked.
    let own = |q: &QTensor, name: String| {
        let hf2q_tensor::WeightData::Ggml { ty, data } = &q.data else {
            unreachable!()
        };
        QTensor::ggml(
            &name,
            *ty,
            q.rows,
            q.cols,
            Bytes::from_vec(data.as_slice().to_vec()),
        )
        .unwrap()
    };
    let parts = (0..e)
        .map(|i| {
            let [g, u, dn] = stacked.expert(i);
            [
                own(g, format!("e{i}.gate")),
                own(u, format!("e{i}.up")),
                own(dn, format!("e{i}.down")),
            ]
        })
        .collect();
    (stacked, Experts::from_parts(parts).unwrap())
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        err <= 1e-4 * scale + 1e-6 && got.len() == want.len(),
        "{what}: max |diff| {err} (values up to {scale})"
    );
}

/// Router logits `(t, e)`: random; every token to expert `e - 1`; expert 0 never chosen.
fn routers(t: usize, e: usize) -> Vec<(&'static str, Vec<f32>)> {
    let random = noise(t * e, 7, 4.0);
    let one = (0..t * e)
        .map(|i| if i % e == e - 1 { 9.0 } else { random[i] * 0.1 })
        .collect();
    let never0 = (0..t * e)
        .map(|i| if i % e == 0 { -60.0 } else { random[i] })
        .collect();
    vec![
        ("random", random),
        ("one expert", one),
        ("expert 0 unused", never0),
    ]
}

fn run(be: &CudaBackend, x: &Tensor, logits: &Tensor, ex: &Experts, s: &MoeSpec) -> Vec<f32> {
    let (xd, ld) = (be.upload(x).unwrap(), be.upload(logits).unwrap());
    let y = be.moe_ffn(&xd, &ld, ex, s).unwrap();
    be.to_host(&y).unwrap().into_data()
}

/// `moe_ffn_add` with a router of its own (f32, and bf16, which is always an ordinary product
/// first), in the default and the fused form (`set_moe_fused`), added into a residual stream, against the CPU's router product, experts and
/// add.
fn added(be: &CudaBackend, x: &Tensor, ex: &Experts, s: &MoeSpec, what: &str) {
    let (t, d) = x.dims2();
    for ty in [GgmlType::F32, GgmlType::BF16] {
        let router = weight(ty, "router", ex.n_experts(), d, 31);
        let logits = CpuBackend::REFERENCE.linear(x, &router, None).unwrap();
        let want = CpuBackend::REFERENCE.moe_ffn(x, &logits, ex, s).unwrap();
        let base = noise(t * d, 17, 1.0);
        let plus: Vec<f32> = want.data().iter().zip(&base).map(|(a, b)| a + b).collect();
        let r0 = Tensor::new(&[t, d], base).unwrap();
        let xd = be.upload(x).unwrap();
        for fused in [false, true] {
            be.device().set_moe_fused(fused);
            let mut r = be.upload(&r0).unwrap();
            be.moe_ffn_add(&xd, &router, ex, s, &mut r).unwrap();
            let got = be.to_host(&r).unwrap();
            close(
                &format!("{what} (added, {ty:?} router, fused {fused})"),
                got.data(),
                &plus,
            );
        }
        be.device().set_moe_fused(false);
    }
}

#[test]
fn expert_products_match_the_cpu_every_format() {
    for relaid in [true, false] {
        let Some(be) = gpu(relaid) else { return };
        let types: &[GgmlType] = if relaid {
            &[GgmlType::Q4_K, GgmlType::Q6_K]
        } else {
            &[
                GgmlType::Q4_K,
                GgmlType::Q6_K,
                GgmlType::Q4_0,
                GgmlType::Q8_0,
                GgmlType::MXFP4,
                GgmlType::F16,
                GgmlType::BF16,
                GgmlType::F32,
            ]
        };
        for &ty in types {
            let (e, f, d) = (8, 256, 512);
            let (stacked, parts) = experts(ty, e, f, d, 11);
            let scale: Vec<f32> = (0..e).map(|i| 0.5 + i as f32 * 0.25).collect();
            for t in [1, 3, 17, 48] {
                let x = Tensor::new(&[t, d], noise(t * d, 3, 1.0)).unwrap();
                for (case, l) in routers(t, e) {
                    let logits = Tensor::new(&[t, e], l).unwrap();
                    for k in [1, 2, e] {
                        for with_scale in [false, true] {
                            let s = MoeSpec {
                                top_k: k,
                                renormalize: k > 1,
                                expert_scale: with_scale.then_some(scale.as_slice()),
                                act: if k == 2 {
                                    GateAct::GeluTanh
                                } else {
                                    GateAct::Silu
                                },
                            };
                            let want = CpuBackend::REFERENCE
                                .moe_ffn(&x, &logits, &stacked, &s)
                                .unwrap();
                            let what = format!(
                                "{ty:?} relaid {relaid} t {t} {case} k {k} scale {with_scale}"
                            );
                            close(&what, &run(&be, &x, &logits, &stacked, &s), want.data());
                            if case == "random" {
                                added(&be, &x, &stacked, &s, &what);
                            }
                            if t == 3 {
                                close(
                                    &format!("{what} (per-expert tensors)"),
                                    &run(&be, &x, &logits, &parts, &s),
                                    want.data(),
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Qwen3-30B-A3B's layer shape (128 experts, top 8, width 768, hidden 2048), Q4_K re-laid as a
/// model's stacked experts are. 150 tokens take the integer expert products (prefill), in
/// tiles of 64 pairs per expert: with every token on one expert, that expert has three tiles,
/// the last partly padding.
#[test]
fn real_shape_top8_of_128() {
    let Some(be) = gpu(true) else { return };
    let (e, f, d) = (128, 768, 2048);
    let (stacked, _) = experts(GgmlType::Q4_K, e, f, d, 5);
    for t in [1, 4, 150] {
        let x = Tensor::new(&[t, d], noise(t * d, 9, 1.0)).unwrap();
        let cases = if t > 64 {
            routers(t, e)
        } else {
            vec![("random", noise(t * e, 13, 3.0))]
        };
        for (case, l) in cases {
            let logits = Tensor::new(&[t, e], l).unwrap();
            let s = MoeSpec {
                top_k: 8,
                renormalize: true,
                expert_scale: None,
                act: GateAct::Silu,
            };
            let want = CpuBackend::REFERENCE
                .moe_ffn(&x, &logits, &stacked, &s)
                .unwrap();
            let what = format!("128 experts t {t} {case}");
            close(&what, &run(&be, &x, &logits, &stacked, &s), want.data());
            if case == "random" {
                added(&be, &x, &stacked, &s, &what);
            }
        }
    }
}

/// The device path (added into a stream) inside a captured graph: a replay gives what the eager
/// op gives, and rewriting the input buffer between replays changes the routing (the choice is
/// made on the device at replay time, not frozen at capture).
#[test]
fn moe_step_replays_in_a_graph() {
    let Some(be) = gpu(true) else { return };
    let (e, f, d) = (16, 256, 256);
    let (stacked, _) = experts(GgmlType::Q4_K, e, f, d, 21);
    let router = weight(GgmlType::F32, "router", e, d, 23);
    let s = MoeSpec {
        top_k: 4,
        renormalize: true,
        expert_scale: None,
        act: GateAct::Silu,
    };
    // The step: token ids select rows of a small embedding table on the device, the router
    // product, then the experts.
    let table = weight(GgmlType::F32, "embed", 8, d, 29);
    let be = Arc::new(be);
    let step = |id: u32| -> hf2q_tensor::Result<Tensor> {
        let x = be.embedding(&table, &[id], 1.0)?;
        // The output added into a copy of the input (decode's form).
        let mut r = be.rows(&x, 0, 1)?;
        be.moe_ffn_add(&x, &router, &stacked, &s, &mut r)?;
        Ok(r)
    };
    for fused in [false, true] {
        be.device().set_moe_fused(fused);
        let eager: Vec<Vec<f32>> = (0..4u32)
            .map(|id| be.to_host(&step(id).unwrap()).unwrap().into_data())
            .collect();
        let mut g = be
            .capture(&[0], 0, d, StepOutput::Logits, || step(0))
            .unwrap();
        for (id, want) in eager.iter().enumerate() {
            let got = be.replay(&mut g, &[id as u32], 0).unwrap();
            close(
                &format!("replay of token {id}, fused {fused}"),
                got.data(),
                want,
            );
        }
        assert_ne!(
            eager[0], eager[1],
            "different inputs must route differently"
        );
    }
    be.device().set_moe_fused(false);
}

/// MXFP4 on the device decodes every code under every scale byte as the CPU decoder does, bit
/// for bit: 256 blocks, block b with scale byte b (subnormal 2^-128 and 2^-127, and the scales
/// whose largest codes overflow to infinity) and its 32 codes every one of the 16 twice, in an
/// order that moves with b; read back through the embedding gather (scale 1, so the gathered
/// values are the decoded ones).
#[test]
fn mxfp4_decodes_every_code_and_scale_as_the_cpu() {
    let Some(be) = gpu(false) else { return };
    let (rows, cols) = (8, 32 * 32);
    let mut bytes = Vec::with_capacity(rows * cols / 32 * 17);
    for b in 0..256usize {
        bytes.push(b as u8);
        for j in 0..16 {
            let lo = (j + b) % 16;
            let hi = (j + 3 * b + 5) % 16;
            bytes.push((lo | hi << 4) as u8);
        }
    }
    let w = QTensor::ggml("mxfp4", GgmlType::MXFP4, rows, cols, Bytes::from_vec(bytes)).unwrap();
    let ids: Vec<u32> = (0..rows as u32).collect();
    let want = CpuBackend::REFERENCE.embedding(&w, &ids, 1.0).unwrap();
    let got = be.to_host(&be.embedding(&w, &ids, 1.0).unwrap()).unwrap();
    let differ = got
        .data()
        .iter()
        .zip(want.data())
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    let finite = want.data().iter().filter(|v| v.is_finite()).count();
    println!(
        "MXFP4 decode: {} values ({finite} finite), {differ} differ in their bits",
        want.len()
    );
    assert_eq!(differ, 0, "MXFP4 values differ from the CPU decoder");
    assert!(
        want.data()
            .iter()
            .any(|v| *v != 0.0 && v.abs() < f32::MIN_POSITIVE),
        "the cases include subnormal values"
    );
}

/// MXFP4 products on the device against the CPU: one token (the split-layout one-token kernel,
/// plain and with a bias), a few tokens and a prefill batch (the dequantizing products). Same
/// tolerance as the expert products (1e-4 of the largest output): the same decoded values
/// summed in another order; the prefill products round the weights to f16 for cuBLAS (2^-11
/// relative, which e2m1 values times a power of two keep exactly) and the activations too, at
/// most 2^-11 of each: 2e-3 of the largest output there.
#[test]
fn mxfp4_linear_matches_the_cpu() {
    let Some(be) = gpu(false) else { return };
    let (r, c) = (2880, 2880);
    let w = weight(GgmlType::MXFP4, "mxfp4", r, c, 41);
    let bias = noise(r, 43, 1.0);
    for t in [1, 3, 8, 64, 200] {
        let x = Tensor::new(&[t, c], noise(t * c, 45, 1.0)).unwrap();
        let xd = be.upload(&x).unwrap();
        for b in [None, Some(bias.as_slice())] {
            let want = CpuBackend::REFERENCE.linear(&x, &w, b).unwrap();
            let got = be.to_host(&be.linear(&xd, &w, b).unwrap()).unwrap();
            let scale = want.data().iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = got
                .data()
                .iter()
                .zip(want.data())
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let tol = if t > 8 { 2e-3 } else { 1e-4 };
            println!(
                "MXFP4 linear {r}x{c} t {t} bias {}: max |diff| {err:.3e} of {scale:.3e}",
                b.is_some()
            );
            assert!(
                err <= tol * scale,
                "MXFP4 linear t {t}: {err} > {tol} * {scale}"
            );
        }
    }
}

/// GPT-OSS's clamped SwiGLU on the device against the CPU reference element for element, with
/// gates and ups well past the limit on both sides. Tolerance 1e-6 relative: the same formula
/// in f32, the device's `expf` within 2 ulp of the CPU's.
#[test]
fn clamped_swiglu_matches_the_cpu() {
    let Some(be) = gpu(false) else { return };
    let n = 4096;
    let (g, u) = (noise(n, 51, 20.0), noise(n, 53, 20.0));
    let act = GateAct::ClampedSwiglu {
        alpha: 1.702,
        limit: 7.0,
    };
    let gate = Tensor::new(&[4, n / 4], g).unwrap();
    let up = Tensor::new(&[4, n / 4], u).unwrap();
    let want = CpuBackend::REFERENCE.gated_act(&gate, &up, act).unwrap();
    let (gd, ud) = (be.upload(&gate).unwrap(), be.upload(&up).unwrap());
    let got = be.to_host(&be.gated_act(&gd, &ud, act).unwrap()).unwrap();
    let mut worst = 0f32;
    for (a, b) in got.data().iter().zip(want.data()) {
        let e = (a - b).abs() / b.abs().max(1.0);
        worst = worst.max(e);
    }
    println!("clamped SwiGLU: max relative diff {worst:.3e}");
    assert!(worst <= 1e-6, "clamped SwiGLU: relative diff {worst}");
    assert!(
        want.data().iter().any(|v| *v > 7.0 * 8.0 * 0.99),
        "the cases reach the clamps (gate and up at the limit)"
    );
}

/// GPT-OSS's experts on the device: MXFP4, biases on the three products, the clamped SwiGLU,
/// top 4 of 32 with the weights a softmax over the chosen (softmax then renormalise), at its
/// hidden size (2880) and width (2880); one token, a few and a batch (pairs in expert order),
/// through `moe_ffn` and `moe_ffn_add` (default and fused forms): the device path, biases and
/// the activation inside the expert kernels. Tolerance as the expert products above, 1e-4 of
/// the largest output (the same f32 products as the other formats' expert kernels).
#[test]
fn gpt_oss_experts_match_the_cpu() {
    let Some(be) = gpu(false) else { return };
    let (e, f, d) = (32, 2880, 2880);
    let (stacked, _) = experts(GgmlType::MXFP4, e, f, d, 61);
    let ex = stacked
        .with_biases(hf2q_tensor::moe::ExpertBiases {
            gate: noise(e * f, 63, 0.5),
            up: noise(e * f, 65, 0.5),
            down: noise(e * d, 67, 0.5),
        })
        .unwrap();
    let s = MoeSpec {
        top_k: 4,
        renormalize: true,
        expert_scale: None,
        act: GateAct::ClampedSwiglu {
            alpha: 1.702,
            limit: 7.0,
        },
    };
    for t in [1, 5, 40] {
        let x = Tensor::new(&[t, d], noise(t * d, 69, 1.0)).unwrap();
        let logits = Tensor::new(&[t, e], noise(t * e, 71, 3.0)).unwrap();
        let want = CpuBackend::REFERENCE.moe_ffn(&x, &logits, &ex, &s).unwrap();
        let got = run(&be, &x, &logits, &ex, &s);
        let scale = want.data().iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = got
            .iter()
            .zip(want.data())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!("GPT-OSS experts t {t}: max |diff| {err:.3e} of {scale:.3e}");
        assert!(
            err <= 1e-4 * scale,
            "GPT-OSS experts t {t}: {err} > 1e-4 * {scale}"
        );
        added(&be, &x, &ex, &s, &format!("GPT-OSS experts t {t}"));
    }
}
