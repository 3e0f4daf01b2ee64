//! The CPU backend's mixture-of-experts products against a dense reference written here, and
//! against the op set's composed form (`moe_ffn_composed`).

use hf2q_cpu::CpuBackend;
use hf2q_tensor::moe::{moe_ffn_composed, route, Experts, MoeSpec};
use hf2q_tensor::op::{Backend, GateAct};
use hf2q_tensor::{QTensor, Tensor};

fn spec(k: usize, renormalize: bool) -> MoeSpec<'static> {
    MoeSpec {
        top_k: k,
        renormalize,
        expert_scale: None,
        act: GateAct::Silu,
    }
}

/// Deterministic values in about [-0.5, 0.5).
fn noise(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h =
                (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)).wrapping_mul(2246822519);
            (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

/// Every token through every expert densely, then weighted as `route` says.
fn naive(x: &Tensor, logits: &Tensor, ex: &Experts, s: &MoeSpec<'_>) -> Vec<f32> {
    let (t, d) = x.dims2();
    let r = route(logits.data(), ex.n_experts(), s).unwrap();
    let mut out = vec![0f32; t * d];
    let (f, mut row) = (ex.width(), vec![0f32; d.max(ex.width())]);
    for tok in 0..t {
        for j in 0..r.top_k {
            let (e, w) = (
                r.experts[tok * r.top_k + j] as usize,
                r.weights[tok * r.top_k + j],
            );
            let [g, u, dn] = ex.expert(e);
            let mut h = vec![0f32; f];
            for (i, hi) in h.iter_mut().enumerate() {
                g.dequantize_row(i, &mut row[..d]).unwrap();
                let a: f32 = row[..d].iter().zip(x.row(tok)).map(|(p, q)| p * q).sum();
                u.dequantize_row(i, &mut row[..d]).unwrap();
                let b: f32 = row[..d].iter().zip(x.row(tok)).map(|(p, q)| p * q).sum();
                *hi = a / (1.0 + (-a).exp()) * b;
            }
            for o in 0..d {
                dn.dequantize_row(o, &mut row[..f]).unwrap();
                out[tok * d + o] += w * row[..f].iter().zip(&h).map(|(p, q)| p * q).sum::<f32>();
            }
        }
    }
    out
}

#[test]
fn cpu_and_composed_expert_products_match_a_dense_reference() {
    let (e, f, d, t) = (5, 6, 8, 7);
    let g = QTensor::from_f32("g", e * f, d, &noise(e * f * d, 1)).unwrap();
    let u = QTensor::from_f32("u", e * f, d, &noise(e * f * d, 2)).unwrap();
    let dn = QTensor::from_f32("dn", e * d, f, &noise(e * d * f, 3)).unwrap();
    let ex = Experts::from_stacked(e, g, u, dn).unwrap();
    let x = Tensor::new(&[t, d], noise(t * d, 4)).unwrap();
    // Routers: random; every token to expert 3; expert 0 never chosen.
    let random = noise(t * e, 5).iter().map(|v| v * 8.0).collect::<Vec<_>>();
    let one = (0..t * e)
        .map(|i| if i % e == 3 { 9.0 } else { 0.0 })
        .collect();
    let never0 = (0..t * e)
        .map(|i| if i % e == 0 { -50.0 } else { random[i] })
        .collect();
    for (name, l) in [
        ("random", random.clone()),
        ("one expert", one),
        ("expert 0 unused", never0),
    ] {
        let logits = Tensor::new(&[t, e], l).unwrap();
        for k in [1, 2, e] {
            let s = spec(k, k > 1);
            let want = naive(&x, &logits, &ex, &s);
            let cpu = CpuBackend::REFERENCE.moe_ffn(&x, &logits, &ex, &s).unwrap();
            let composed = moe_ffn_composed(&CpuBackend::REFERENCE, &x, &logits, &ex, &s).unwrap();
            for (got, what) in [(cpu.data(), "cpu"), (composed.data(), "composed")] {
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f32::max);
                // f32 sums of 6-8 products in another order: ~1e-7.
                assert!(err < 1e-5, "{name}, k={k}, {what}: max |Δ| {err}");
            }
        }
    }
    let bad = Tensor::new(&[t, e + 1], vec![0.0; t * (e + 1)]).unwrap();
    assert!(CpuBackend::REFERENCE
        .moe_ffn(&x, &bad, &ex, &spec(2, true))
        .is_err());
}

/// `n` ggml MXFP4 blocks of deterministic codes, scale bytes 116..=122 (2^-12..2^-6).
fn mxfp4_bytes(n: usize, seed: u32) -> Vec<u8> {
    let v = noise(17 * n, seed);
    let mut b = Vec::with_capacity(17 * n);
    for blk in v.chunks(17) {
        b.push(116 + ((blk[0] + 0.5) * 7.0) as u8 % 7);
        b.extend(blk[1..].iter().map(|x| ((x + 0.5) * 256.0) as u8));
    }
    b
}

/// MXFP4 experts (GPT-OSS's: stacked, biased, clamped SwiGLU; and unbiased SiLU, the gated
/// product) on the fast path, whose expert products run the MXFP4 kernels on each expert's
/// view of the stacked bytes, against the reference path.
///
/// Tolerance: the two-part activations keep each value within 1/(127 * 256) = 3.1e-5 of its
/// block's largest (`q8act`); each of an expert's three products moves by at most that times
/// its L1 sum, and with weights of random sign an output is about sqrt(C) (8-10 here) below its
/// L1 sum, the gate's slope at most ~1.1: 3 * 3.1e-5 * 10 * 1.1 = 1e-3 of the output's scale.
#[test]
fn mxfp4_experts_on_the_fast_path_match_the_reference() {
    use hf2q_tensor::moe::ExpertBiases;
    use hf2q_tensor::GgmlType;
    let (e, f, d, t) = (4, 96, 64, 9);
    let q = |name: &str, rows: usize, cols: usize, seed: u32| {
        let bytes = mxfp4_bytes(rows * cols / 32, seed);
        QTensor::ggml(
            name,
            GgmlType::MXFP4,
            rows,
            cols,
            hf2q_tensor::Bytes::from_vec(bytes),
        )
        .unwrap()
    };
    let stacked = || {
        Experts::from_stacked(
            e,
            q("g", e * f, d, 11),
            q("u", e * f, d, 12),
            q("dn", e * d, f, 13),
        )
        .unwrap()
    };
    // Biases smaller than the products, so that the outputs' scale is the products'.
    let small = |n: usize, seed: u32| noise(n, seed).iter().map(|v| v * 0.02).collect();
    let biased = stacked()
        .with_biases(ExpertBiases {
            gate: small(e * f, 14),
            up: small(e * f, 15),
            down: small(e * d, 16),
        })
        .unwrap();
    let x = Tensor::new(&[t, d], noise(t * d, 17).iter().map(|v| v * 4.0).collect()).unwrap();
    let logits = Tensor::new(&[t, e], noise(t * e, 18).iter().map(|v| v * 8.0).collect()).unwrap();
    let swiglu = GateAct::ClampedSwiglu {
        alpha: 1.702,
        limit: 7.0,
    };
    for (what, ex, act) in [
        ("biased, clamped SwiGLU", &biased, swiglu),
        ("plain, SiLU", &stacked(), GateAct::Silu),
    ] {
        for t in [1, t] {
            let xt = Tensor::new(&[t, d], x.data()[..t * d].to_vec()).unwrap();
            let lt = Tensor::new(&[t, e], logits.data()[..t * e].to_vec()).unwrap();
            let s = MoeSpec {
                top_k: 2,
                renormalize: true,
                expert_scale: None,
                act,
            };
            let want = CpuBackend::REFERENCE.moe_ffn(&xt, &lt, ex, &s).unwrap();
            let got = CpuBackend::FAST.moe_ffn(&xt, &lt, ex, &s).unwrap();
            let scale = want.data().iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = got
                .data()
                .iter()
                .zip(want.data())
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(scale > 0.0, "{what}: an all-zero output tests nothing");
            // Not bit for bit: the fast path ran the kernels (rounded activations).
            assert!(
                err > 0.0,
                "{what}, T={t}: the fast path gave the reference's bits"
            );
            assert!(
                err <= 1e-3 * scale,
                "{what}, T={t}: max |Δ| {err} against an output scale {scale}"
            );
        }
    }
}
