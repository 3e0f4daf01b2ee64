//! MLX affine quantization: the layout of `mx.quantize(w, group_size, bits)` (mode "affine"), as
//! stored in mlx-lm checkpoints (`weight` uint32, `scales`, `biases`).
//!
//! Each row of `C` elements is cut into groups of `group_size`; element `x` of a group is stored
//! as an unsigned `bits`-bit integer `q` with `x ~= scale * q + bias`.
//!
//! Packing, checked against the real library: the packed words, read as little-endian bytes, are
//! one little-endian bit stream: element `i` of a row occupies bits `i*bits .. (i+1)*bits`,
//! counting from bit 0 of byte 0. For 2, 4 and 8 bits that is "element k of a uint32 in bits
//! k*bits"; for 3 and 5 bits MLX writes 8 elements into 3 or 5 bytes and for 6 bits 4 elements
//! into 3 bytes, which is the same stream, so values straddle uint32 word boundaries.
//!
//! Quantization follows the CPU kernel of `mx.quantize` (mlx/backend/cpu/quantized.cpp): scale
//! from the group's range, then nudged so that the larger-magnitude edge of the range is exactly
//! on the grid (`bias = edge`), with `rint` (ties to even) rounding. Scales and biases are f32
//! here; an mlx-lm checkpoint stores them in the model's dtype (usually bf16), and the caller
//! converts.
//!
//! [`quantize_affine_weighted`] is hf2q's own (mlx has no importance matrices): the same layout,
//! but each group's scale and bias chosen to minimise an importance-weighted squared error.
//!
//! Not here: MLX's other modes (mxfp4, nvfp4, mxfp8).

use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AffineParams {
    /// 2, 3, 4, 5, 6 or 8.
    pub bits: u32,
    /// 32, 64 or 128.
    pub group_size: usize,
}

impl AffineParams {
    /// Checks the pair is one MLX supports.
    pub fn validate(self) -> Result<()> {
        if !matches!(self.bits, 2 | 3 | 4 | 5 | 6 | 8) {
            return Err(Error::Msg(format!(
                "MLX affine: {} bits is not one of 2, 3, 4, 5, 6, 8",
                self.bits
            )));
        }
        if !matches!(self.group_size, 32 | 64 | 128) {
            return Err(Error::Msg(format!(
                "MLX affine: group size {} is not one of 32, 64, 128",
                self.group_size
            )));
        }
        Ok(())
    }

    /// Packed bytes for a row of `n` elements (`n * bits / 8`).
    pub fn packed_bytes(self, n: usize) -> Option<usize> {
        n.checked_mul(self.bits as usize).map(|b| b / 8)
    }
}

/// Checks every length of one row of `n` elements; returns the number of groups.
fn check_row(
    p: AffineParams,
    n: usize,
    packed: usize,
    scales: usize,
    biases: usize,
) -> Result<usize> {
    p.validate()?;
    if !n.is_multiple_of(p.group_size) {
        return Err(Error::Shape(format!(
            "MLX affine: row of {n} is not a whole number of groups of {}",
            p.group_size
        )));
    }
    let groups = n / p.group_size;
    // n is a multiple of 32, so n * bits / 8 is a whole number of uint32 words.
    let need = p
        .packed_bytes(n)
        .ok_or_else(|| Error::Shape(format!("MLX affine: row of {n} overflows")))?;
    if packed != need {
        return Err(Error::Shape(format!(
            "MLX affine: {packed} packed bytes given, {need} needed for {n} elements at {} bits",
            p.bits
        )));
    }
    if scales != groups || biases != groups {
        return Err(Error::Shape(format!(
            "MLX affine: {scales} scales and {biases} biases given, {groups} groups of {} in a row of {n}",
            p.group_size
        )));
    }
    Ok(groups)
}

/// Reads `bits` bits starting at bit `off` of the little-endian stream `b`. `bits <= 8`, so the
/// value spans at most two bytes; the second is only read when the value reaches into it.
#[inline]
fn get_bits(b: &[u8], off: usize, bits: u32) -> u8 {
    let (byte, shift) = (off / 8, (off % 8) as u32);
    let mut v = (b[byte] as u32) >> shift;
    if shift + bits > 8 {
        v |= (b[byte + 1] as u32) << (8 - shift);
    }
    (v & ((1u32 << bits) - 1)) as u8
}

/// ORs `q` (< 2^bits) into the stream `b` at bit `off`; `b` starts zeroed.
#[inline]
fn put_bits(b: &mut [u8], off: usize, bits: u32, q: u8) {
    let (byte, shift) = (off / 8, (off % 8) as u32);
    let v = (q as u32) << shift;
    b[byte] |= v as u8;
    if shift + bits > 8 {
        b[byte + 1] |= (v >> 8) as u8;
    }
}

/// Dequantizes one row: `packed` is the row's packed uint32 words as little-endian bytes
/// (`dst.len() * bits / 8` bytes), `scales`/`biases` one value per group (`dst.len() / group_size`).
/// Element = scale * q + bias, a multiply then an add in f32 as `mx.dequantize` does on the CPU
/// for f32 scales (bit-identical to it).
pub fn dequantize_affine(
    p: AffineParams,
    packed: &[u8],
    scales: &[f32],
    biases: &[f32],
    dst: &mut [f32],
) -> Result<()> {
    check_row(p, dst.len(), packed.len(), scales.len(), biases.len())?;
    let bits = p.bits;
    for (g, yg) in dst.chunks_exact_mut(p.group_size).enumerate() {
        let (s, b) = (scales[g], biases[g]);
        let base = g * p.group_size;
        for (k, y) in yg.iter_mut().enumerate() {
            let q = get_bits(packed, (base + k) * bits as usize, bits);
            *y = q as f32 * s + b;
        }
    }
    Ok(())
}

/// Quantizes one row as `mx.quantize(w, group_size, bits)` does on the CPU for f32 input:
/// `packed_out` gets `src.len() * bits / 8` bytes (the uint32 words, little-endian), and
/// `scales_out`/`biases_out` one value per group. The contract test holds the bytes, scales and
/// biases to mlx's output bit for bit.
///
/// Per group: `n_bins = 2^bits - 1`; `scale = max((max - min) / n_bins, 1e-7)`, negated unless
/// |min| > |max|; `edge` is min or max accordingly; `q0 = rint(edge / scale)`; if `q0 != 0`,
/// `scale = edge / q0` and `bias = edge`, else `bias = 0`; then `q = clamp(rint((x - bias) /
/// scale), 0, n_bins)`. Because the scale is nudged to put the edge on the grid, the far end of
/// the range can fall up to one step past the last grid point and is clamped: the round-trip error
/// is at most one step (|scale|), not half.
pub fn quantize_affine(
    p: AffineParams,
    src: &[f32],
    packed_out: &mut [u8],
    scales_out: &mut [f32],
    biases_out: &mut [f32],
) -> Result<()> {
    check_row(
        p,
        src.len(),
        packed_out.len(),
        scales_out.len(),
        biases_out.len(),
    )?;
    let bits = p.bits;
    let n_bins = ((1u32 << bits) - 1) as f32;
    packed_out.fill(0);
    for (g, x) in src.chunks_exact(p.group_size).enumerate() {
        let (scale, bias) = plain_params(x, n_bins);
        put_group(packed_out, g * p.group_size, bits, x, scale, bias, n_bins);
        scales_out[g] = scale;
        biases_out[g] = bias;
    }
    Ok(())
}

/// mlx's scale and bias of one group (see [`quantize_affine`]).
fn plain_params(x: &[f32], n_bins: f32) -> (f32, f32) {
    let eps = 1e-7f32;
    // std::max / std::min starting from -inf / +inf (NaN input is skipped, as there).
    let (mut w_min, mut w_max) = (f32::INFINITY, f32::NEG_INFINITY);
    for &v in x {
        w_max = w_max.max(v);
        w_min = w_min.min(v);
    }
    let mask = w_min.abs() > w_max.abs();
    let mut scale = ((w_max - w_min) / n_bins).max(eps);
    if !mask {
        scale = -scale;
    }
    let edge = if mask { w_min } else { w_max };
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0f32;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    (scale, bias)
}

/// The grid index of `v` for `(scale, bias)`, as mlx rounds it.
#[inline]
fn grid_index(v: f32, scale: f32, bias: f32, n_bins: f32) -> f32 {
    ((v - bias) / scale).round_ties_even().clamp(0.0, n_bins)
}

/// Packs one group starting at element `base` of the row.
fn put_group(
    packed: &mut [u8],
    base: usize,
    bits: u32,
    x: &[f32],
    scale: f32,
    bias: f32,
    n_bins: f32,
) {
    for (k, &v) in x.iter().enumerate() {
        let q = grid_index(v, scale, bias, n_bins);
        put_bits(packed, (base + k) * bits as usize, bits, q as u8);
    }
}

/// Σ w_j (x_j - (scale q_j + bias))² with `q_j` rounded from `(scale, bias)` as stored.
fn weighted_error(x: &[f32], w: &[f32], scale: f32, bias: f32, n_bins: f32) -> f64 {
    x.iter()
        .zip(w)
        .map(|(&v, &wi)| {
            let d = (grid_index(v, scale, bias, n_bins) * scale + bias - v) as f64;
            wi as f64 * d * d
        })
        .sum()
}

/// Weighted least squares for `x ~= scale * q + bias` with the grid indices `q` fixed; `None`
/// when the indices do not determine a scale (all equal) or the fit is not finite.
fn fit(x: &[f32], w: &[f32], q: impl Fn(usize) -> f32) -> Option<(f32, f32)> {
    let (mut sw, mut sq, mut sqq, mut sx, mut sqx) = (0f64, 0f64, 0f64, 0f64, 0f64);
    for (j, (&v, &wi)) in x.iter().zip(w).enumerate() {
        let (wi, qj, v) = (wi as f64, q(j) as f64, v as f64);
        sw += wi;
        sq += wi * qj;
        sqq += wi * qj * qj;
        sx += wi * v;
        sqx += wi * qj * v;
    }
    let det = sw * sqq - sq * sq;
    if det <= 1e-12 * sw * sqq {
        return None;
    }
    let scale = ((sw * sqx - sq * sx) / det) as f32;
    let bias = ((sqq * sx - sq * sqx) / det) as f32;
    (scale.is_finite() && bias.is_finite() && scale != 0.0).then_some((scale, bias))
}

/// Candidate grids: the group's range spread over `n_bins + STEP * k` steps, `k` in `-N..=N`
/// (as ggml's `make_qkx2_quants` searches), each refitted by weighted least squares.
const SEARCH_STEP: f32 = 0.1;
const SEARCH_N: i32 = 10;

/// Scale and bias of one group minimising Σ w_j (x_j - dequant(q_j))²: mlx's own choice is the
/// first candidate, so the result is never worse than it under the weights.
fn weighted_params(x: &[f32], w: &[f32], n_bins: f32) -> (f32, f32) {
    let plain = plain_params(x, n_bins);
    let sw: f32 = w.iter().sum();
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for &v in x {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    // Nothing weighted, a constant group or non-finite input: mlx's choice.
    let usable = |v: f32| v.is_finite() && v > 0.0;
    if !usable(sw) || !usable(hi - lo) {
        return plain;
    }
    let mut best = plain;
    let mut best_err = weighted_error(x, w, plain.0, plain.1, n_bins);
    let mut consider = |cand: (f32, f32), best: &mut (f32, f32)| {
        let e = weighted_error(x, w, cand.0, cand.1, n_bins);
        if e < best_err {
            best_err = e;
            *best = cand;
        }
    };
    for k in -SEARCH_N..=SEARCH_N {
        let iscale = (n_bins + SEARCH_STEP * k as f32) / (hi - lo);
        let q = |j: usize| ((x[j] - lo) * iscale).round_ties_even().clamp(0.0, n_bins);
        if let Some(c) = fit(x, w, q) {
            consider(c, &mut best);
        }
    }
    // Alternate: indices from the best grid, refit, a few times while it improves.
    for _ in 0..3 {
        let (s, b) = best;
        match fit(x, w, |j| grid_index(x[j], s, b, n_bins)) {
            Some(c) if c != best => consider(c, &mut best),
            _ => break,
        }
        if best == (s, b) {
            break;
        }
    }
    best
}

/// Quantizes one row into mlx's layout (as [`quantize_affine`]) with importance weights:
/// `weights[j] >= 0` says how much the error of element `j` counts (an importance matrix's
/// mean squared activation of input column `j`). Each group gets the scale and bias that
/// minimise Σ_j weights_j (x_j - (scale q_j + bias))² over a search of candidate grids around
/// the group's min/max, each refitted by weighted least squares; mlx's own min/max choice is a
/// candidate, so the weighted error is never larger than [`quantize_affine`]'s. Elements are
/// rounded to the nearest grid point as mlx rounds them; a group whose weights are all zero
/// gets mlx's choice.
pub fn quantize_affine_weighted(
    p: AffineParams,
    src: &[f32],
    weights: &[f32],
    packed_out: &mut [u8],
    scales_out: &mut [f32],
    biases_out: &mut [f32],
) -> Result<()> {
    check_row(
        p,
        src.len(),
        packed_out.len(),
        scales_out.len(),
        biases_out.len(),
    )?;
    if weights.len() != src.len() {
        return Err(Error::Shape(format!(
            "MLX affine: {} importance weights for a row of {}",
            weights.len(),
            src.len()
        )));
    }
    let bits = p.bits;
    let n_bins = ((1u32 << bits) - 1) as f32;
    packed_out.fill(0);
    for (g, (x, w)) in src
        .chunks_exact(p.group_size)
        .zip(weights.chunks_exact(p.group_size))
        .enumerate()
    {
        let (scale, bias) = weighted_params(x, w, n_bins);
        put_group(packed_out, g * p.group_size, bits, x, scale, bias, n_bins);
        scales_out[g] = scale;
        biases_out[g] = bias;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((s >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
                u * [1.0f32, 1e-3, 30.0, 0.07][(i / 32) % 4]
                    + [0.0f32, 0.0, 5.0, -0.2][(i / 64) % 4]
            })
            .collect()
    }

    #[test]
    fn bit_stream_round_trips_every_value_at_every_width() {
        for bits in ALL_BITS {
            let n = 64;
            let mut b = vec![0u8; n * bits as usize / 8];
            let qs: Vec<u8> = (0..n)
                .map(|i| ((i * 37 + 11) % (1 << bits)) as u8)
                .collect();
            for (i, &q) in qs.iter().enumerate() {
                put_bits(&mut b, i * bits as usize, bits, q);
            }
            for (i, &q) in qs.iter().enumerate() {
                assert_eq!(
                    get_bits(&b, i * bits as usize, bits),
                    q,
                    "bits {bits} element {i}"
                );
            }
        }
    }

    #[test]
    fn three_bit_layout_matches_mlx_extract_bits() {
        // mlx's extract_bits<3>: w[2] = ((b0 & 0xc0) >> 6) + ((b1 & 1) << 2), w[5] = ((b1 & 0x80)
        // >> 7) + ((b2 & 3) << 1), w[7] = (b2 & 0xe0) >> 5.
        let b = [0b1100_0000u8, 0b1000_0001, 0b1110_0011];
        assert_eq!(get_bits(&b, 2 * 3, 3), 0b111);
        assert_eq!(get_bits(&b, 5 * 3, 3), 0b111);
        assert_eq!(get_bits(&b, 7 * 3, 3), 0b111);
        assert_eq!(get_bits(&b, 0, 3), 0);
    }

    #[test]
    fn round_trip_error_is_at_most_one_step() {
        for bits in ALL_BITS {
            for gs in [32usize, 64, 128] {
                let p = AffineParams {
                    bits,
                    group_size: gs,
                };
                let x = data(512, bits as u64 * 1000 + gs as u64);
                let g = x.len() / gs;
                let mut packed = vec![0u8; p.packed_bytes(x.len()).unwrap()];
                let (mut s, mut b) = (vec![0f32; g], vec![0f32; g]);
                quantize_affine(p, &x, &mut packed, &mut s, &mut b).unwrap();
                let mut y = vec![0f32; x.len()];
                dequantize_affine(p, &packed, &s, &b, &mut y).unwrap();
                for (i, (a, r)) in x.iter().zip(&y).enumerate() {
                    // One step (see quantize_affine), plus f32 rounding of q*scale + bias relative
                    // to the group's magnitude (a few ulps of |bias| + n_bins*|scale|).
                    let gi = i / gs;
                    let mag = b[gi].abs() + s[gi].abs() * ((1u32 << bits) as f32);
                    let tol = s[gi].abs() * 1.0001 + mag * 4.0 * f32::EPSILON;
                    assert!(
                        (a - r).abs() <= tol,
                        "bits {bits} gs {gs} [{i}]: {a} -> {r}, scale {}",
                        s[gi]
                    );
                }
            }
        }
    }

    #[test]
    fn zero_and_constant_groups_are_exact() {
        for bits in ALL_BITS {
            let p = AffineParams {
                bits,
                group_size: 32,
            };
            let mut x = vec![0f32; 32];
            x.extend(std::iter::repeat_n(-2.75f32, 32));
            x.extend(std::iter::repeat_n(1e-9f32, 32));
            let mut packed = vec![0u8; p.packed_bytes(96).unwrap()];
            let (mut s, mut b) = ([0f32; 3], [0f32; 3]);
            quantize_affine(p, &x, &mut packed, &mut s, &mut b).unwrap();
            let mut y = vec![0f32; 96];
            dequantize_affine(p, &packed, &s, &b, &mut y).unwrap();
            assert_eq!(&y[..64], &x[..64], "bits {bits}");
            // A tiny constant is below the 1e-7 minimum scale: it stays on the grid's zero.
            assert!(y[64..].iter().all(|v| (v - 1e-9).abs() <= 1e-9));
        }
    }

    #[test]
    fn every_length_is_checked() {
        let p = AffineParams {
            bits: 4,
            group_size: 32,
        };
        let mut dst = vec![0f32; 64];
        let (s, b) = ([1f32; 2], [0f32; 2]);
        assert!(dequantize_affine(p, &[0u8; 32], &s, &b, &mut dst).is_ok());
        assert!(dequantize_affine(p, &[0u8; 31], &s, &b, &mut dst).is_err());
        assert!(dequantize_affine(p, &[0u8; 33], &s, &b, &mut dst).is_err());
        assert!(dequantize_affine(p, &[0u8; 32], &s[..1], &b, &mut dst).is_err());
        assert!(dequantize_affine(p, &[0u8; 32], &s, &b[..1], &mut dst).is_err());
        assert!(dequantize_affine(p, &[0u8; 16], &s[..1], &b[..1], &mut dst[..33]).is_err());
        assert!(dequantize_affine(
            AffineParams {
                bits: 7,
                group_size: 32
            },
            &[0u8; 56],
            &s,
            &b,
            &mut dst
        )
        .is_err());
        assert!(dequantize_affine(
            AffineParams {
                bits: 4,
                group_size: 16
            },
            &[0u8; 32],
            &[1.0; 4],
            &[0.0; 4],
            &mut dst
        )
        .is_err());
        let (mut s2, mut b2) = ([0f32; 2], [0f32; 1]);
        assert!(quantize_affine(p, &dst, &mut [0u8; 32], &mut s2, &mut b2).is_err());
    }

    /// Σ w (x - y)² over a row.
    fn werr(x: &[f32], y: &[f32], w: &[f32]) -> f64 {
        x.iter()
            .zip(y)
            .zip(w)
            .map(|((a, b), wi)| *wi as f64 * ((a - b) as f64).powi(2))
            .sum()
    }

    fn round_trip(
        p: AffineParams,
        x: &[f32],
        w: Option<&[f32]>,
    ) -> (Vec<u8>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let g = x.len() / p.group_size;
        let mut packed = vec![0u8; p.packed_bytes(x.len()).unwrap()];
        let (mut s, mut b) = (vec![0f32; g], vec![0f32; g]);
        match w {
            Some(w) => quantize_affine_weighted(p, x, w, &mut packed, &mut s, &mut b).unwrap(),
            None => quantize_affine(p, x, &mut packed, &mut s, &mut b).unwrap(),
        }
        let mut y = vec![0f32; x.len()];
        dequantize_affine(p, &packed, &s, &b, &mut y).unwrap();
        (packed, s, b, y)
    }

    #[test]
    fn importance_weights_lower_the_weighted_error() {
        for bits in [2u32, 3, 4, 8] {
            for gs in [32usize, 64, 128] {
                let p = AffineParams {
                    bits,
                    group_size: gs,
                };
                let n = 1024;
                let x = data(n, 7 + bits as u64 * 31 + gs as u64);
                // Skewed importance, as activations are: a few columns dominate.
                let w: Vec<f32> = (0..n)
                    .map(|j| match (j * 7919) % 97 {
                        0..=2 => 100.0,
                        3..=20 => 1.0,
                        _ => 0.01,
                    })
                    .collect();
                let (.., plain) = round_trip(p, &x, None);
                let (.., weighted) = round_trip(p, &x, Some(&w));
                let (ep, ew) = (werr(&x, &plain, &w), werr(&x, &weighted, &w));
                assert!(
                    ew < 0.9 * ep,
                    "bits {bits} gs {gs}: weighted {ew} vs plain {ep}"
                );
                // Uniform weights: never worse than mlx's min/max in plain squared error.
                let ones = vec![1f32; n];
                let (.., u) = round_trip(p, &x, Some(&ones));
                assert!(werr(&x, &u, &ones) <= werr(&x, &plain, &ones) * (1.0 + 1e-6));
            }
        }
    }

    #[test]
    fn zero_importance_falls_back_to_mlx_bit_for_bit() {
        let p = AffineParams {
            bits: 4,
            group_size: 64,
        };
        let x = data(256, 5);
        let zeros = vec![0f32; 256];
        let a = round_trip(p, &x, None);
        let b = round_trip(p, &x, Some(&zeros));
        assert_eq!((a.0, a.1, a.2), (b.0, b.1, b.2));
        let mut packed = vec![0u8; 128];
        let (mut s, mut bi) = (vec![0f32; 4], vec![0f32; 4]);
        assert!(
            quantize_affine_weighted(p, &x, &zeros[..255], &mut packed, &mut s, &mut bi).is_err()
        );
    }
}
