//! Contract: every fast matmul kernel (each ISA level this CPU runs, scalar included) against the
//! reference `QTensor::matmul`, for every weight type, on random data with awkward shapes (odd
//! row counts, T = 1, 2, 3, 7, 8, 9, 17, 33, 40, C a multiple of the block but not of 256 where the format
//! allows, and a final 32-element half step).
//!
//! Two checks per output, both with their bound derived below:
//! 1. Against the reference (f32 weights x f32 activations): the kernels round activations to
//!    8 bits, `|x - dx*q| <= max|x_block| / 254` (q8act.rs), so the output may move by
//!    `B = Σ_i |w_i| * max|x_block(i)| / 254`; allowed: `1.01 * B` plus the f32 slack of (2).
//! 2. Against an exact (f64) product of the dequantized weights with the *quantized*
//!    activations (from the library's own quantizer): this isolates the engines' integer dots,
//!    scales and offsets from the activation rounding, so a wrong scale, offset or code in any
//!    16-element group shows. Allowed: f32 rounding only, `(1e-5 + C/16 * 2^-22) * Σ|w||dx*q|`
//!    (one rounding per 16-group partial sum and scale product, four ulps each, plus the
//!    reference dequantizer's own rounding).
//!
//! Float weights (F32/F16/BF16) are not rounded: `1e-5 * Σ|w||x|` (summation order only).

mod kernels_util;

use hf2q_cpu::kernels::{self, q8act, ActBits, Isa};
use hf2q_tensor::GgmlType;
use kernels_util::{all_kinds, make_weight, make_x, Kind, Rng};

/// Column counts to try for a kind: small, not a multiple of 64 (the 32-element tail) and not
/// a multiple of 256 where the block allows.
fn cols_for(kind: Kind) -> Vec<usize> {
    if kind.is_float() {
        return vec![1, 7, 33, 96, 577];
    }
    match kind.col_multiple() {
        32 => vec![32, 96, 576],
        64 => vec![64, 192, 576],
        128 => vec![128, 384],
        _ => vec![256, 768],
    }
}

/// Quantized activation values `dx * q` as the kernels see them.
/// The activations as the engines see them after quantization with `bits`.
fn quantized_x(x: &[f32], k: usize, bits: ActBits) -> Vec<f32> {
    let (mut q, mut d, mut s) = (vec![0i8; k], vec![0f32; k / 16], vec![0f32; k / 16]);
    let (mut l, mut dl, mut sl) = (vec![0i8; k], vec![0f32; k / 16], vec![0f32; k / 16]);
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(k) {
        match bits {
            ActBits::Q8 => {
                q8act::quantize_row_scalar(row, &mut q, &mut d, &mut s);
                out.extend(q.iter().enumerate().map(|(i, &v)| d[i / 16] * v as f32));
            }
            ActBits::Split16 => {
                q8act::quantize_row_split_scalar(
                    row, &mut q, &mut d, &mut s, &mut l, &mut dl, &mut sl,
                );
                out.extend((0..k).map(|i| d[i / 16] * q[i] as f32 + dl[i / 16] * l[i] as f32));
            }
        }
    }
    out
}

/// Largest activation rounding error per unit of a block's max |x| (see `q8act`): half a step
/// of 1/127 for one 8-bit part; for two parts the remainder is rounded to 1/256 of a step, and
/// the clamp of a remainder of exactly +-128/256 to 127 makes the worst case a full 1/256 step.
fn act_bound(bits: ActBits) -> f64 {
    match bits {
        ActBits::Q8 => 1.0 / 254.0,
        ActBits::Split16 => 1.0 / (127.0 * 256.0),
    }
}

fn check(kind: Kind, isa: Isa, bits: ActBits, rows: usize, k: usize, t: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let w = make_weight(kind, rows, k, &mut rng);
    let x = make_x(t, k, &mut rng);
    let mut got = vec![f32::NAN; t * rows];
    kernels::linear_with(isa, bits, &w, &x, t, &mut got).unwrap();
    check_outputs(kind, isa, bits, &w, &x, rows, k, t, &got, "");
    // The weight re-laid out for this CPU's kernels, where it has such a layout: the same
    // bounds (only the f32 summation order differs).
    if let Some(p) = kernels::pack(&w) {
        let mut got = vec![f32::NAN; t * rows];
        kernels::linear_packed_with(isa, bits, &w, &p, &x, t, &mut got).unwrap();
        check_outputs(kind, isa, bits, &w, &x, rows, k, t, &got, " packed");
    }
}

/// The bounds of the module header for the outputs `got` of `w` (rows x k) times `x` (t x k).
#[allow(clippy::too_many_arguments)]
fn check_outputs(
    kind: Kind,
    isa: Isa,
    bits: ActBits,
    w: &hf2q_tensor::QTensor,
    x: &[f32],
    rows: usize,
    k: usize,
    t: usize,
    got: &[f32],
    what: &str,
) {
    let mut want = vec![0f32; t * rows];
    w.matmul(x, t, &mut want).unwrap();
    let wd = w.to_f32().unwrap();
    let xq = if kind.is_float() {
        x.to_vec()
    } else {
        quantized_x(x, k, bits)
    };
    let f32_slack = 1e-5 + (k / 16) as f64 * 2f64.powi(-22);
    let ctx = format!(
        "{}{what} on {isa} ({bits:?}), {rows}x{k}, T={t}",
        kind.name()
    );
    for ti in 0..t {
        let xr = &x[ti * k..(ti + 1) * k];
        let xqr = &xq[ti * k..(ti + 1) * k];
        let amax: Vec<f64> = xr
            .chunks(32)
            .map(|b| b.iter().fold(0f64, |a, v| a.max(v.abs() as f64)))
            .collect();
        for r in 0..rows {
            let wr = &wd[r * k..(r + 1) * k];
            let (mut exact_q, mut l1, mut l1q, mut bound) = (0f64, 0f64, 0f64, 0f64);
            for i in 0..k {
                let wi = wr[i] as f64;
                exact_q += wi * xqr[i] as f64;
                l1 += (wi * xr[i] as f64).abs();
                l1q += (wi * xqr[i] as f64).abs();
                bound += wi.abs() * amax[i / 32] * act_bound(bits);
            }
            let (g, wv) = (got[ti * rows + r] as f64, want[ti * rows + r] as f64);
            if kind.is_float() {
                let tol = 1e-5 * l1 + 1e-30;
                assert!(
                    (g - wv).abs() <= tol,
                    "{ctx}: out[{ti}][{r}] = {g}, reference {wv}, tolerance {tol}"
                );
                continue;
            }
            let tol_ref = 1.01 * bound + f32_slack * l1 + 1e-30;
            assert!(
                (g - wv).abs() <= tol_ref,
                "{ctx}: out[{ti}][{r}] = {g}, reference {wv}, bound {tol_ref}"
            );
            let tol_q = f32_slack * l1q + 1e-30;
            assert!(
                (g - exact_q).abs() <= tol_q,
                "{ctx}: out[{ti}][{r}] = {g}, exact with quantized x {exact_q}, tolerance {tol_q}"
            );
        }
    }
}

/// Every available ISA, several shapes, for one kind.
fn check_kind(kind: Kind) {
    let mut seed = 1;
    for isa in Isa::available() {
        for k in cols_for(kind) {
            // T around the GEMM's 8-token tiles (3, 8, 9, 17, 40) and rows not a multiple of
            // its 16-row panels (17, 31, 49) as well.
            for (rows, t) in [
                (1, 1),
                (5, 2),
                (37, 7),
                (67, 1),
                (150, 33),
                (3, 33),
                (17, 3),
                (16, 8),
                (33, 9),
                (31, 17),
                (49, 40),
            ] {
                for bits in [ActBits::Q8, ActBits::Split16] {
                    seed += 1;
                    check(kind, isa, bits, rows, k, t, seed);
                }
            }
        }
    }
}

macro_rules! kind_tests {
    ($($name:ident => $kind:expr,)*) => {$(
        #[test]
        fn $name() {
            check_kind($kind);
        }
    )*};
}

kind_tests! {
    f32_matches_reference => Kind::Ggml(GgmlType::F32),
    f16_matches_reference => Kind::Ggml(GgmlType::F16),
    bf16_matches_reference => Kind::Ggml(GgmlType::BF16),
    q4_0_matches_reference => Kind::Ggml(GgmlType::Q4_0),
    q4_1_matches_reference => Kind::Ggml(GgmlType::Q4_1),
    q5_0_matches_reference => Kind::Ggml(GgmlType::Q5_0),
    q5_1_matches_reference => Kind::Ggml(GgmlType::Q5_1),
    q8_0_matches_reference => Kind::Ggml(GgmlType::Q8_0),
    q2_k_matches_reference => Kind::Ggml(GgmlType::Q2_K),
    q3_k_matches_reference => Kind::Ggml(GgmlType::Q3_K),
    q4_k_matches_reference => Kind::Ggml(GgmlType::Q4_K),
    q5_k_matches_reference => Kind::Ggml(GgmlType::Q5_K),
    q6_k_matches_reference => Kind::Ggml(GgmlType::Q6_K),
    q8_k_matches_reference => Kind::Ggml(GgmlType::Q8_K),
    mxfp4_matches_reference => Kind::Ggml(GgmlType::MXFP4),
    mlx4_matches_reference => Kind::Mlx { bits: 4, group: 64 },
    mlx8_matches_reference => Kind::Mlx { bits: 8, group: 64 },
}

/// MXFP4 blocks at the scale bytes the random weights avoid: 0 and 1 (the subnormal
/// half-scales 2^-128, 2^-127), 2 (the smallest normal one) and 150 (values up to 12 * 2^22),
/// mixed in each row, on every ISA, one-token and GEMM paths, with the bounds of the header.
#[test]
fn mxfp4_extreme_scales_match_reference() {
    let mut rng = Rng::new(77);
    for isa in Isa::available() {
        for (rows, k, t) in [(16, 96, 1), (33, 576, 1), (32, 64, 9), (17, 32, 3)] {
            let mut w = make_weight(Kind::Ggml(GgmlType::MXFP4), rows, k, &mut rng);
            let hf2q_tensor::WeightData::Ggml { data, .. } = &w.data else {
                unreachable!()
            };
            let mut bytes = data.as_slice().to_vec();
            for (i, blk) in bytes.chunks_mut(17).enumerate() {
                blk[0] = [0u8, 1, 2, 150][i % 4];
            }
            w = hf2q_tensor::QTensor::ggml(
                "w",
                GgmlType::MXFP4,
                rows,
                k,
                hf2q_tensor::Bytes::from_vec(bytes),
            )
            .unwrap();
            let x = make_x(t, k, &mut rng);
            for bits in [ActBits::Q8, ActBits::Split16] {
                let mut got = vec![f32::NAN; t * rows];
                kernels::linear_with(isa, bits, &w, &x, t, &mut got).unwrap();
                let kind = Kind::Ggml(GgmlType::MXFP4);
                check_outputs(
                    kind,
                    isa,
                    bits,
                    &w,
                    &x,
                    rows,
                    k,
                    t,
                    &got,
                    " (extreme scales)",
                );
            }
        }
    }
}

#[test]
fn mlx_every_width_and_group_matches_reference() {
    for kind in all_kinds()
        .into_iter()
        .filter(|k| matches!(k, Kind::Mlx { .. }))
    {
        check_kind(kind);
    }
}

#[test]
fn dispatch_uses_an_available_isa_and_override_is_checked() {
    let best = Isa::best();
    assert!(best.is_available());
    assert!(Isa::Scalar.is_available());
    let unavailable = Isa::ALL.into_iter().find(|i| !i.is_available());
    if let Some(i) = unavailable {
        assert!(kernels::set_isa_override(Some(i)).is_err());
        let mut rng = Rng::new(9);
        let w = make_weight(Kind::Ggml(GgmlType::Q4_0), 4, 32, &mut rng);
        assert!(
            kernels::linear_with(i, ActBits::Split16, &w, &[0.0; 32], 1, &mut [0.0; 4]).is_err()
        );
    }
    // The override is process-wide; this test only checks it is accepted and cleared.
    kernels::set_isa_override(Some(Isa::Scalar)).unwrap();
    assert_eq!(kernels::active_isa(), Isa::Scalar);
    kernels::set_isa_override(None).unwrap();
    assert_eq!(kernels::active_isa(), best);
}

#[test]
fn shapes_are_checked_and_zeros_give_zeros() {
    let mut rng = Rng::new(3);
    for isa in Isa::available() {
        let w = make_weight(Kind::Ggml(GgmlType::Q4_K), 3, 256, &mut rng);
        let mut out = vec![1f32; 6];
        assert!(kernels::linear_with(isa, ActBits::Q8, &w, &[0.0; 511], 2, &mut out).is_err());
        assert!(kernels::linear_with(isa, ActBits::Q8, &w, &[0.0; 512], 2, &mut out[..5]).is_err());
        kernels::linear_with(isa, ActBits::Q8, &w, &[0.0; 512], 2, &mut out).unwrap();
        assert!(out.iter().all(|v| *v == 0.0), "{isa}: {out:?}");
        // T = 0 is an empty product.
        kernels::linear_with(isa, ActBits::Q8, &w, &[], 0, &mut []).unwrap();
    }
}

#[test]
fn inconsistent_storage_is_an_error_not_a_wild_read() {
    let mut rng = Rng::new(4);
    let mut w = make_weight(Kind::Ggml(GgmlType::Q4_0), 4, 64, &mut rng);
    w.rows = 5; // fields are public: the kernels must not trust them
    for isa in Isa::available() {
        assert!(kernels::linear_with(isa, ActBits::Q8, &w, &[0.0; 64], 1, &mut [0.0; 5]).is_err());
    }
}

/// The kernels keep the last quantized input of each thread and skip quantizing it again when
/// the next call's input is the same: runs of calls with one input, then one differing in a
/// single value, over several weights, must equal fresh calls on a new thread (bit for bit).
#[test]
fn repeated_inputs_give_the_results_of_fresh_calls() {
    let mut rng = Rng::new(99);
    let (k, t) = (96, 3);
    let w1 = make_weight(Kind::Ggml(GgmlType::Q4_1), 20, k, &mut rng);
    let w2 = make_weight(Kind::Ggml(GgmlType::Q8_0), 33, k, &mut rng);
    let x1 = make_x(t, k, &mut rng);
    let mut x2 = x1.clone();
    x2[k + 5] += 1e-3;
    let run = |w: &hf2q_tensor::QTensor, x: &[f32], bits: ActBits| {
        let mut o = vec![0f32; t * w.rows];
        kernels::linear(w, x, t, &mut o, bits).unwrap();
        o
    };
    let fresh = |w: &hf2q_tensor::QTensor, x: &[f32], bits: ActBits| {
        std::thread::scope(|s| s.spawn(|| run(w, x, bits)).join().unwrap())
    };
    for bits in [ActBits::Split16, ActBits::Q8] {
        for (w, x) in [(&w1, &x1), (&w2, &x1), (&w2, &x2), (&w1, &x2), (&w1, &x1)] {
            assert_eq!(run(w, x, bits), fresh(w, x, bits), "{bits:?}");
        }
    }
}

/// A packed copy given with another weight (other shape) is an error, not a wild read.
#[test]
fn packed_copy_of_another_weight_is_an_error() {
    let mut rng = Rng::new(3);
    let w = make_weight(Kind::Ggml(GgmlType::Q4_0), 32, 64, &mut rng);
    let other = make_weight(Kind::Ggml(GgmlType::Q4_0), 16, 64, &mut rng);
    let Some(p) = kernels::pack(&other) else {
        eprintln!("skipped: this CPU has no packed layout");
        return;
    };
    let mut out = vec![0f32; 32];
    let e = kernels::linear_packed(&w, &p, &[0.0; 64], 1, &mut out, ActBits::Split16);
    assert!(format!("{}", e.unwrap_err()).contains("another weight"));
}

/// The CPU backend's packed weights: a Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K weight in a mapped
/// file is packed on first use, its mapped pages are handed back, and every later product
/// (cached copy), every embedding lookup (read from the packed copy, a tied output layer's
/// case) and every read of the weight's own bytes (which come back from the file) give what
/// they gave before. (Where the CPU has no packed layout the products run on the original.)
#[test]
fn backend_packs_mapped_weights_and_their_bytes_stay_readable() {
    use hf2q_cpu::CpuBackend;
    use hf2q_tensor::op::Backend;
    use hf2q_tensor::{Bytes, QTensor, Tensor};
    let (rows, k) = (48, 4096);
    let mut rng = Rng::new(11);
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ] {
        let made = make_weight(Kind::Ggml(ty), rows, k, &mut rng);
        let hf2q_tensor::WeightData::Ggml { data, .. } = &made.data else {
            unreachable!()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.bin");
        std::fs::write(&path, data.as_slice()).unwrap();
        let w = QTensor::ggml("w", ty, rows, k, Bytes::map_file(&path).unwrap()).unwrap();
        let before = w.to_f32().unwrap();
        let x = make_x(3, k, &mut rng);
        let be = CpuBackend::FAST;
        let ids = [0u32, 47, 16, 17, 5];
        let emb = be.embedding(&w, &ids, 1.0).unwrap();
        for t in [1, 3] {
            let xt = Tensor::new(&[t, k], x[..t * k].to_vec()).unwrap();
            let mut want = vec![0f32; t * rows];
            kernels::linear(&w, &x[..t * k], t, &mut want, ActBits::Split16).unwrap();
            for _ in 0..2 {
                let got = be.linear(&xt, &w, None).unwrap();
                for (i, (g, wv)) in got.data().iter().zip(&want).enumerate() {
                    // Summation order only (the packed kernels add the same terms in another
                    // order): each side within the f32 slack of `check_outputs`, so twice that.
                    let (ti, r) = (i / rows, i % rows);
                    let l1: f64 = (0..k)
                        .map(|j| (before[r * k + j] as f64 * x[ti * k + j] as f64).abs())
                        .sum();
                    let tol = 2.0 * (1e-5 + (k / 16) as f64 * 2f64.powi(-22)) * l1;
                    assert!(
                        ((g - wv) as f64).abs() <= tol,
                        "{ty} T={t}: {g} vs {wv} (tol {tol})"
                    );
                }
            }
        }
        let packed = kernels::packs(&w);
        eprintln!("{ty} packed: {packed} ({be:?})");
        assert_eq!(
            be.embedding(&w, &ids, 1.0).unwrap().data(),
            emb.data(),
            "{ty}: rows read from the packed copy, bit for bit"
        );
        assert_eq!(
            w.to_f32().unwrap(),
            before,
            "{ty}: the mapped bytes read back unchanged"
        );
    }
}
