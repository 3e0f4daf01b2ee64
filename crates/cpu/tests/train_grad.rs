//! Every backward op of the training op set against finite differences of an independent f64
//! forward written here (the obvious formula, no shared code with the backend), on random
//! inputs of awkward shapes.
//!
//! Method: for an op `y = f(x)` and a random cotangent `c`, the backend's backward gives
//! `∂(c·y)/∂x`; the reference is the central difference `(L(x + e) − L(x − e)) / 2e` of
//! `L = c·f64(x)` for every element, with `e = 1e-5` in f64 (truncation error ~e² ≈ 1e-10,
//! rounding ~1e-16/e ≈ 1e-11: the reference is exact to far below what is tested). The
//! backend computes in f32, so the tolerance is on ‖ours − ref‖ / ‖ref‖ <= 1e-4: f32 sums of a
//! few hundred terms round at ~1e-6 relative, and 1e-4 leaves room for cancellation.

use hf2q_cpu::CpuBackend;
use hf2q_tensor::op::{AttentionParams, Backend, GateAct, RopeParams, RopeStyle};
use hf2q_tensor::train_op::{AdamStep, SeqLayout, TrainAttention, TrainBackend};
use hf2q_tensor::{GgmlType, QTensor, Tensor};

const TOL: f64 = 1e-4;
const EPS: f64 = 1e-5;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [-s, s).
    fn vec(&mut self, n: usize, s: f64) -> Vec<f64> {
        (0..n).map(|_| (self.next() * 2.0 - 1.0) * s).collect()
    }
}

fn t32(shape: &[usize], v: &[f64]) -> Tensor {
    Tensor::new(shape, v.iter().map(|&x| x as f32).collect()).unwrap()
}

/// ∂(c·f(x))/∂x by central differences.
fn fd(x: &[f64], c: &[f64], f: &dyn Fn(&[f64]) -> Vec<f64>) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            xp[i] = x[i] + EPS;
            let lp: f64 = f(&xp).iter().zip(c).map(|(a, b)| a * b).sum();
            xp[i] = x[i] - EPS;
            let lm: f64 = f(&xp).iter().zip(c).map(|(a, b)| a * b).sum();
            xp[i] = x[i];
            (lp - lm) / (2.0 * EPS)
        })
        .collect()
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den.max(1e-300)).sqrt()
}

fn assert_close(what: &str, got: &[f32], want: &[f64]) {
    let e = rel_err(got, want);
    assert!(e <= TOL, "{what}: relative error {e:.3e} > {TOL:.0e}");
}

// ---- references (f64) ---------------------------------------------------------------------

fn rms_norm_ref(x: &[f64], w: &[f64], eps: f64, offset: f64) -> Vec<f64> {
    let c = w.len();
    x.chunks(c)
        .flat_map(|r| {
            let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / c as f64 + eps).sqrt();
            r.iter()
                .zip(w)
                .map(move |(v, wi)| v * inv * (wi + offset))
                .collect::<Vec<_>>()
        })
        .collect()
}

fn rope_ref(x: &[f64], heads: usize, positions: &[u32], p: &RopeParams) -> Vec<f64> {
    let width = x.len() / positions.len();
    let dh = width / heads;
    let half = p.dims / 2;
    let mut out = x.to_vec();
    for (ti, &pos) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = ti * width + h * dh;
            for i in 0..half {
                let f = (p.theta as f64).powf(-(2.0 * i as f64) / p.dims as f64)
                    / p.freq_factors.as_ref().map_or(1.0, |ff| ff[i] as f64);
                let a = pos as f64 / p.linear_scale as f64 * f;
                let (ia, ib) = match p.style {
                    RopeStyle::Neox => (i, i + half),
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (x[base + ia], x[base + ib]);
                out[base + ia] = x0 * a.cos() - x1 * a.sin();
                out[base + ib] = x0 * a.sin() + x1 * a.cos();
            }
        }
    }
    out
}

/// Attention over lengths (one sequence after another), causal, window, soft cap.
fn attention_ref(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    lengths: &[usize],
    a: &TrainAttention,
) -> Vec<f64> {
    let p = &a.p;
    let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
    let n: usize = lengths.iter().sum();
    let mut out = vec![0f64; n * h * dh];
    let mut start = 0;
    for &len in lengths {
        for row in start..start + len {
            for hi in 0..h {
                let g = hi / (h / hkv);
                let lo = match p.window {
                    Some(w) => start.max((row + 1).saturating_sub(w)),
                    None => start,
                };
                let qv = &q[row * h * dh + hi * dh..][..dh];
                let s: Vec<f64> = (lo..=row)
                    .map(|j| {
                        let kv = &k[j * hkv * dh + g * dh..][..dh];
                        let r = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f64>() * p.scale as f64;
                        match a.softcap {
                            Some(cap) => cap as f64 * (r / cap as f64).tanh(),
                            None => r,
                        }
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for (sj, j) in s.iter().zip(lo..=row) {
                    let w = (sj - m).exp() / z;
                    for d in 0..dh {
                        out[row * h * dh + hi * dh + d] += w * v[j * hkv * dh + g * dh + d];
                    }
                }
            }
        }
        start += len;
    }
    out
}

fn act_ref(act: GateAct, g: f64) -> f64 {
    match act {
        GateAct::Silu => g / (1.0 + (-g).exp()),
        GateAct::GeluTanh => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh())
        }
        GateAct::ClampedSwiglu { .. } => unreachable!("no training backward (refused)"),
    }
}

/// log p(target) of each row under `h · Wᵀ` (soft-capped); 0 for rows without a target.
fn logprobs_ref(h: &[f64], w: &[f64], v: usize, targets: &[i32], cap: Option<f64>) -> Vec<f64> {
    let d = w.len() / v;
    h.chunks(d)
        .zip(targets)
        .map(|(hr, &t)| {
            if t < 0 {
                return 0.0;
            }
            let z: Vec<f64> = w
                .chunks(d)
                .map(|wr| {
                    let r: f64 = hr.iter().zip(wr).map(|(a, b)| a * b).sum();
                    cap.map_or(r, |c| c * (r / c).tanh())
                })
                .collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            z[t as usize] - lse
        })
        .collect()
}

// ---- tests --------------------------------------------------------------------------------

const BE: CpuBackend = CpuBackend::REFERENCE;

#[test]
fn rms_norm_backward_matches_finite_differences() {
    let mut r = Rng(0x5eed_0001);
    // (C = 1 is left out on purpose: x / sqrt(x² + eps) has a derivative of ~eps there, the
    // difference of two terms near 1, which no f32 computation resolves to 1e-4.)
    for (rows, c, offset) in [(3, 7, 0.0), (2, 64, 1.0), (1, 3, 0.0)] {
        let x = r.vec(rows * c, 1.5);
        let w = r.vec(c, 1.0);
        let dy = r.vec(rows * c, 1.0);
        let eps = 1e-5;
        let wf: Vec<f32> = w.iter().map(|&v| v as f32).collect();
        let got = BE
            .rms_norm_backward(
                &t32(&[rows, c], &x),
                &wf,
                eps as f32,
                offset as f32,
                &t32(&[rows, c], &dy),
            )
            .unwrap();
        let want = fd(&x, &dy, &|xx| rms_norm_ref(xx, &w, eps, offset));
        assert_close(
            &format!("rms_norm {rows}x{c} offset {offset}"),
            got.data(),
            &want,
        );
    }
}

#[test]
fn rope_inverse_is_the_backward_for_both_styles_and_llama3_factors() {
    let mut r = Rng(0x5eed_0002);
    let layout = SeqLayout::from_lengths(&[3, 1, 4]).unwrap();
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        for factors in [None, Some(vec![1.0, 2.5, 8.0, 1.0])] {
            let p = RopeParams {
                style,
                theta: 500.0,
                dims: 8,
                freq_factors: factors.clone(),
                linear_scale: 1.5,
            };
            let (heads, n) = (2, layout.rows());
            let x = r.vec(n * heads * 8, 1.0);
            let dy = r.vec(n * heads * 8, 1.0);
            // Forward against the reference.
            let mut y = t32(&[n, heads * 8], &x);
            BE.rope_rows(&mut y, heads, &layout, &p, false).unwrap();
            let want_y = rope_ref(&x, heads, layout.positions(), &p);
            assert_close("rope forward", y.data(), &want_y);
            // Backward: the inverse rotation of dy.
            let mut g = t32(&[n, heads * 8], &dy);
            BE.rope_rows(&mut g, heads, &layout, &p, true).unwrap();
            let want = fd(&x, &dy, &|xx| rope_ref(xx, heads, layout.positions(), &p));
            assert_close(&format!("rope {style:?} {factors:?}"), g.data(), &want);
        }
    }
}

#[test]
fn attention_forward_and_backward_match_the_reference() {
    let mut r = Rng(0x5eed_0003);
    // GQA (4 heads over 2), three sequences of awkward lengths; with and without a window and
    // a soft cap.
    let lengths = [5, 1, 7];
    let layout = SeqLayout::from_lengths(&lengths).unwrap();
    let n = layout.rows();
    for (window, softcap) in [
        (None, None),
        (Some(3), None),
        (None, Some(2.0)),
        (Some(2), Some(1.5)),
    ] {
        let a = TrainAttention {
            p: AttentionParams {
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: 6,
                scale: 0.45,
                window,
                sinks: None,
            },
            softcap,
        };
        let (qw, kw) = (4 * 6, 2 * 6);
        let q = r.vec(n * qw, 1.5);
        let k = r.vec(n * kw, 1.5);
        let v = r.vec(n * kw, 1.0);
        let dout = r.vec(n * qw, 1.0);
        let (qt, kt, vt) = (t32(&[n, qw], &q), t32(&[n, kw], &k), t32(&[n, kw], &v));
        let fwd = BE.attention_train(&qt, &kt, &vt, &layout, &a).unwrap();
        let case = format!("window {window:?} softcap {softcap:?}");
        assert_close(
            &format!("attention forward {case}"),
            fwd.out.data(),
            &attention_ref(&q, &k, &v, &lengths, &a),
        );
        let g = BE
            .attention_backward(&qt, &kt, &vt, &fwd, &t32(&[n, qw], &dout), &layout, &a)
            .unwrap();
        let dq = fd(&q, &dout, &|x| attention_ref(x, &k, &v, &lengths, &a));
        let dk = fd(&k, &dout, &|x| attention_ref(&q, x, &v, &lengths, &a));
        let dv = fd(&v, &dout, &|x| attention_ref(&q, &k, x, &lengths, &a));
        assert_close(&format!("dq {case}"), g.dq.data(), &dq);
        assert_close(&format!("dk {case}"), g.dk.data(), &dk);
        assert_close(&format!("dv {case}"), g.dv.data(), &dv);
    }
}

#[test]
fn attention_never_crosses_sequences() {
    // The first sequence's outputs and gradients do not depend on the second's values.
    let mut r = Rng(0x5eed_0004);
    let layout = SeqLayout::from_lengths(&[3, 4]).unwrap();
    let a = TrainAttention {
        p: AttentionParams {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            scale: 0.5,
            window: None,
            sinks: None,
        },
        softcap: None,
    };
    let q = r.vec(7 * 8, 1.0);
    let k = r.vec(7 * 4, 1.0);
    let mut v = r.vec(7 * 4, 1.0);
    let o1 = BE
        .attention_train(
            &t32(&[7, 8], &q),
            &t32(&[7, 4], &k),
            &t32(&[7, 4], &v),
            &layout,
            &a,
        )
        .unwrap();
    for x in v[12..].iter_mut() {
        *x += 10.0;
    }
    let o2 = BE
        .attention_train(
            &t32(&[7, 8], &q),
            &t32(&[7, 4], &k),
            &t32(&[7, 4], &v),
            &layout,
            &a,
        )
        .unwrap();
    assert_eq!(o1.out.data()[..24], o2.out.data()[..24]);
    assert_ne!(o1.out.data()[24..], o2.out.data()[24..]);
}

#[test]
fn gated_activations_backward_match_finite_differences() {
    let mut r = Rng(0x5eed_0005);
    for act in [GateAct::Silu, GateAct::GeluTanh] {
        let n = 37;
        let g = r.vec(n, 4.0);
        let u = r.vec(n, 2.0);
        let dy = r.vec(n, 1.0);
        let (dg, du) = BE
            .gated_act_backward(&t32(&[n], &g), &t32(&[n], &u), &t32(&[n], &dy), act)
            .unwrap();
        let f = |gg: &[f64], uu: &[f64]| -> Vec<f64> {
            gg.iter()
                .zip(uu)
                .map(|(a, b)| act_ref(act, *a) * b)
                .collect()
        };
        assert_close(
            &format!("{act:?} dgate"),
            dg.data(),
            &fd(&g, &dy, &|x| f(x, &u)),
        );
        assert_close(
            &format!("{act:?} dup"),
            du.data(),
            &fd(&u, &dy, &|x| f(&g, x)),
        );
        // The forward the backward is the derivative of is the backend's own.
        let y = BE.gated_act(&t32(&[n], &g), &t32(&[n], &u), act).unwrap();
        assert_close(&format!("{act:?} forward"), y.data(), &f(&g, &u));
    }
}

/// A weight of `ty` from random values, and its dequantized values (what the forward uses).
fn quantized(ty: GgmlType, rows: usize, cols: usize, r: &mut Rng) -> (QTensor, Vec<f64>) {
    let vals: Vec<f32> = r.vec(rows * cols, 1.0).iter().map(|&v| v as f32).collect();
    let mut bytes = vec![0u8; ty.row_bytes(cols).unwrap() * rows];
    hf2q_tensor::quant::quantize(ty, &vals, &mut bytes).unwrap();
    let q = QTensor::ggml("w", ty, rows, cols, hf2q_tensor::Bytes::from_vec(bytes)).unwrap();
    let deq = q.to_f32().unwrap().iter().map(|&v| v as f64).collect();
    (q, deq)
}

#[test]
fn linear_backward_input_through_every_stored_format() {
    let mut r = Rng(0x5eed_0006);
    let (rows, cols, n) = (19, 256, 3);
    for ty in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ] {
        let (w, deq) = quantized(ty, rows, cols, &mut r);
        let x = r.vec(n * cols, 1.0);
        let dy = r.vec(n * rows, 1.0);
        let got = BE.linear_backward_input(&t32(&[n, rows], &dy), &w).unwrap();
        let f = |xx: &[f64]| -> Vec<f64> {
            xx.chunks(cols)
                .flat_map(|xr| {
                    deq.chunks(cols)
                        .map(move |wr| xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f64>())
                })
                .collect()
        };
        assert_close(
            &format!("linear backward {ty}"),
            got.data(),
            &fd(&x, &dy, &f),
        );
    }
}

#[test]
fn lm_head_logprobs_and_gradient_match_the_reference() {
    let mut r = Rng(0x5eed_0007);
    let (n, d, v) = (6, 16, 37);
    let wv = r.vec(v * d, 1.0);
    let w = QTensor::from_f32(
        "lm_head",
        v,
        d,
        &wv.iter().map(|&x| x as f32).collect::<Vec<_>>(),
    )
    .unwrap();
    let h = r.vec(n * d, 1.0);
    let targets = [3, -100, 0, 36, 17, -1];
    let g: Vec<f64> = r.vec(n, 1.0);
    let gf: Vec<f32> = g.iter().map(|&x| x as f32).collect();
    for cap in [None, Some(2.5f32)] {
        let out = BE
            .lm_head_logprobs(&t32(&[n, d], &h), &w, &targets, cap, Some(&gf))
            .unwrap();
        let capd = cap.map(|c| c as f64);
        let want = logprobs_ref(&h, &wv, v, &targets, capd);
        assert_close(&format!("logp cap {cap:?}"), &out.logp, &want);
        let dh = fd(&h, &g, &|x| logprobs_ref(x, &wv, v, &targets, capd));
        assert_close(&format!("dh cap {cap:?}"), out.dh.unwrap().data(), &dh);
        assert!(
            !out.hit[1] && !out.hit[5],
            "rows without a target never count as hits"
        );
        // Without weights: the same log-probabilities, no gradient.
        let plain = BE
            .lm_head_logprobs(&t32(&[n, d], &h), &w, &targets, cap, None)
            .unwrap();
        assert_eq!(plain.logp, out.logp);
        assert!(plain.dh.is_none());
    }
    // A target outside the vocabulary is an error, not a panic.
    assert!(BE
        .lm_head_logprobs(&t32(&[n, d], &h), &w, &[0, 0, 0, 0, 0, 37], None, None)
        .is_err());
}

#[test]
fn dropout_backward_is_the_same_mask() {
    let mut r = Rng(0x5eed_0008);
    let x = r.vec(1000, 1.0);
    let y = BE.dropout(&t32(&[10, 100], &x), 0.3, 99).unwrap();
    let again = BE.dropout(&t32(&[10, 100], &x), 0.3, 99).unwrap();
    assert_eq!(y, again, "the mask is a function of the seed");
    let zeroed = y.data().iter().filter(|&&v| v == 0.0).count();
    assert!(
        (200..400).contains(&zeroed),
        "{zeroed} of 1000 dropped at p = 0.3"
    );
    for (yv, xv) in y.data().iter().zip(&x) {
        assert!(*yv == 0.0 || ((*yv as f64) - xv / 0.7).abs() < 1e-5);
    }
    assert!(BE.dropout(&t32(&[1], &[1.0]), 1.0, 0).is_err());
}

#[test]
fn adamw_follows_torch_formula() {
    let mut r = Rng(0x5eed_0009);
    let n = 50;
    let p0 = r.vec(n, 1.0);
    let mut p = t32(&[n], &p0);
    let mut m = Tensor::zeros(&[n]);
    let mut v = Tensor::zeros(&[n]);
    let (mut pr, mut mr, mut vr) = (p0.clone(), vec![0f64; n], vec![0f64; n]);
    for step in 1..=5u64 {
        let g = r.vec(n, 0.5);
        let s = AdamStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
        };
        BE.adamw(&mut p, &t32(&[n], &g), &mut m, &mut v, &s)
            .unwrap();
        for i in 0..n {
            pr[i] *= 1.0 - 1e-2 * 0.1;
            mr[i] = 0.9 * mr[i] + 0.1 * g[i];
            vr[i] = 0.999 * vr[i] + 0.001 * g[i] * g[i];
            let mh = mr[i] / (1.0 - 0.9f64.powi(step as i32));
            let vh = vr[i] / (1.0 - 0.999f64.powi(step as i32));
            pr[i] -= 1e-2 * mh / (vh.sqrt() + 1e-8);
        }
    }
    let e = rel_err(p.data(), &pr);
    // Five f32 steps of a formula with one division: ~1e-7 relative.
    assert!(e < 1e-6, "adamw relative error {e:.3e}");
}

#[test]
fn dense_products_of_the_backend() {
    let mut r = Rng(0x5eed_000a);
    let a = r.vec(4 * 3, 1.0);
    let b = r.vec(5 * 3, 1.0);
    let at = t32(&[4, 3], &a);
    let bt = t32(&[5, 3], &b);
    let y = BE
        .matmul(&at, &bt, hf2q_tensor::op::MatmulSpec::NT.scaled(0.5))
        .unwrap();
    assert_eq!(y.shape(), &[4, 5]);
    for i in 0..4 {
        for j in 0..5 {
            let want: f64 = (0..3).map(|p| a[i * 3 + p] * b[j * 3 + p]).sum::<f64>() * 0.5;
            assert!((y.data()[i * 5 + j] as f64 - want).abs() < 1e-5);
        }
    }
    assert!(BE
        .matmul(&at, &bt, hf2q_tensor::op::MatmulSpec::NN)
        .is_err());
}
