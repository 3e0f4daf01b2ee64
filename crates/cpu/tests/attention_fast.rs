//! The tiled CPU attention of the fast paths against the scalar reference, on random inputs:
//! decode (T = 1) and prefill shapes, GQA ratios, head widths, sliding windows, caches with
//! spare capacity, f32 and f16 caches, attention sinks (every other case).

use half::f16;
use hf2q_cpu::KvRead;
use hf2q_cpu::{CpuBackend, MatmulPath};
use hf2q_tensor::op::{AttentionParams, LayerCache};
use hf2q_tensor::Tensor;

struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
    }
}

#[test]
fn tiled_attention_matches_reference() {
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let fast = CpuBackend {
        matmul: MatmulPath::Fast,
        ..CpuBackend::default()
    };
    let mut cases = 0;
    for &(h, hkv) in &[(1, 1), (9, 3), (8, 2), (4, 4), (16, 2)] {
        for &dh in &[32, 64, 256] {
            for &(t, pos0) in &[(1, 0), (1, 5), (1, 300), (17, 0), (40, 23), (3, 70)] {
                for &window in &[None, Some(7), Some(64)] {
                    let cap = pos0 + t + 13;
                    // Sinks (GPT-OSS) on every other case, some above every score.
                    let sinks = (cases % 2 == 1)
                        .then(|| (0..h).map(|_| 6.0 * rng.f()).collect::<Vec<f32>>().into());
                    let p = AttentionParams {
                        n_heads: h,
                        n_kv_heads: hkv,
                        head_dim: dh,
                        scale: 1.0 / (dh as f32).sqrt(),
                        window,
                        sinks,
                    };
                    // Large-ish scores so that the online rescaling matters.
                    let k: Vec<f32> = (0..hkv * cap * dh).map(|_| 3.0 * rng.f()).collect();
                    let v: Vec<f32> = (0..hkv * cap * dh).map(|_| rng.f()).collect();
                    let q = Tensor::new(
                        &[t, h * dh],
                        (0..t * h * dh).map(|_| 3.0 * rng.f()).collect(),
                    )
                    .unwrap();
                    let c = LayerCache {
                        k: &k,
                        v: &v,
                        capacity: cap,
                        centre: None,
                    };
                    let what = format!("h={h} hkv={hkv} dh={dh} t={t} pos0={pos0} {window:?}");
                    let want32 = check(&fast, &q, &c, pos0, &p, &format!("f32 {what}"));
                    // The same values in an f16 cache: the kernels read what is stored, so the
                    // same bound holds against the reference over the f16 cache.
                    let (kh, vh): (Vec<f16>, Vec<f16>) = (
                        k.iter().map(|&x| f16::from_f32(x)).collect(),
                        v.iter().map(|&x| f16::from_f32(x)).collect(),
                    );
                    let c = LayerCache {
                        k: &kh,
                        v: &vh,
                        capacity: cap,
                        centre: None,
                    };
                    let want16 = check(&fast, &q, &c, pos0, &p, &format!("f16 {what}"));
                    // And the rounding itself stays small: 2^-12 relative on each key and value
                    // (|v| <= 1 moves by <= 2.4e-4; a score by about Σ|q·k|·scale·2^-12, a few
                    // 1e-3 here, and the output by that times its spread): measured at most
                    // 1.5e-3; 5e-3 still catches a wrong conversion, which moves outputs by 0.1+.
                    let e = max_err(&want32, &want16);
                    assert!(e < 5e-3, "{what}: f16 vs f32 cache {e}");
                    cases += 1;
                }
            }
        }
    }
    assert!(cases > 200);
}

fn max_err(a: &Tensor, b: &Tensor) -> f32 {
    a.data()
        .iter()
        .zip(b.data())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// The fast attention against the reference over one cache; returns the reference's output.
fn check<T: KvRead>(
    fast: &CpuBackend,
    q: &Tensor,
    c: &LayerCache<'_, T>,
    pos0: usize,
    p: &AttentionParams,
    what: &str,
) -> Tensor {
    let want = CpuBackend::REFERENCE.attention(q, c, pos0, p).unwrap();
    let got = fast.attention(q, c, pos0, p).unwrap();
    let err = max_err(&want, &got);
    // Outputs are convex combinations of values in [-1, 1]; f32 sums of up to a few hundred
    // terms in another order, and a polynomial exp (2e-7 relative).
    assert!(err < 2e-5, "{what}: max err {err}");
    want
}

/// A sink is one more softmax column whose value is zero: with one key, the output is the key's
/// value times `e^s / (e^s + e^sink)`; and a sink count other than the heads is refused.
#[test]
fn sinks_join_the_denominator() {
    let (h, dh) = (2, 32);
    let k: Vec<f32> = (0..dh).map(|i| (i as f32 * 0.1).sin()).collect();
    let v: Vec<f32> = (0..dh).map(|i| (i as f32 * 0.3).cos()).collect();
    let q = Tensor::new(
        &[1, h * dh],
        (0..h * dh).map(|i| (i % 7) as f32 * 0.2).collect(),
    )
    .unwrap();
    let c = LayerCache {
        k: &k,
        v: &v,
        capacity: 1,
        centre: None,
    };
    let sinks = [0.5f32, -2.0];
    let p = AttentionParams {
        n_heads: h,
        n_kv_heads: 1,
        head_dim: dh,
        scale: 0.25,
        window: None,
        sinks: Some(sinks.to_vec().into()),
    };
    let fast = CpuBackend {
        matmul: MatmulPath::Fast,
        ..CpuBackend::default()
    };
    for be in [&CpuBackend::REFERENCE, &fast] {
        let out = be.attention(&q, &c, 0, &p).unwrap();
        for hi in 0..h {
            let qh = &q.data()[hi * dh..(hi + 1) * dh];
            let s = qh.iter().zip(&k).map(|(a, b)| a * b).sum::<f32>() * 0.25;
            let w = s.exp() / (s.exp() + sinks[hi].exp());
            for d in 0..dh {
                let got = out.data()[hi * dh + d];
                assert!((got - w * v[d]).abs() < 1e-5, "head {hi} dim {d}: {got}");
            }
        }
    }
    let bad = AttentionParams {
        sinks: Some(vec![0.0; 3].into()),
        ..p
    };
    let e = CpuBackend::REFERENCE
        .attention(&q, &c, 0, &bad)
        .unwrap_err();
    assert!(e.to_string().contains("3 sinks for 2 heads"), "{e}");
}

#[test]
fn tiled_attention_checks_shapes() {
    let fast = CpuBackend {
        matmul: MatmulPath::Fast,
        ..CpuBackend::default()
    };
    let p = AttentionParams {
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 4,
        scale: 1.0,
        window: None,
        sinks: None,
    };
    let kv = vec![0.5f32; 4 * 4];
    let c = LayerCache {
        k: &kv,
        v: &kv,
        capacity: 4,
        centre: None,
    };
    let q = Tensor::new(&[2, 8], vec![0.1; 16]).unwrap();
    assert!(fast.attention(&q, &c, 3, &p).is_err(), "past the capacity");
    let bad = Tensor::new(&[2, 6], vec![0.1; 12]).unwrap();
    assert!(fast.attention(&bad, &c, 0, &p).is_err(), "wrong width");
}
