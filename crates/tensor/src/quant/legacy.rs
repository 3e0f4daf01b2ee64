//! ggml's first-generation block formats, 32 elements per block: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
//! (stored in GGUF files) and Q8_1 (the activation format of ggml's dot products; dequantization
//! only).
//!
//! Byte layouts are ggml's `block_q*` structs in `ggml-common.h` (little-endian, packed, half
//! floats as IEEE binary16). Dequantization follows `dequantize_row_q*` in `ggml-quants.c`, with
//! the float operations in the same order (`d * q`, `d * q + m`, no fused multiply-add) so results
//! are bit-identical to ggml's scalar code and to gguf-py's numpy dequantizers. Quantization
//! follows `quantize_row_q*_ref`: the scale is computed and inverted in f32 and only then rounded
//! to half for storage, exactly as ggml does.
//!
//! Within a block of 32, element `j < 16` sits in the low nibble of byte `j` and element `j + 16`
//! in its high nibble; the fifth bit of the 5-bit formats comes from the 32-bit word `qh`, bit `j`
//! for element `j`.
//!
//! Not here: the 256-element super-block formats (`kquants.rs`), SIMD paths.

use super::float::{f16_bits_to_f32, f32_to_f16_bits};

/// Elements per block for every format in this file.
pub const QK: usize = 32;

#[inline]
fn half_at(b: &[u8], off: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

#[inline]
fn put_half(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f32_to_f16_bits(v).to_le_bytes());
}

// ---------------------------------------------------------------------------------------------
// Dequantization. Each function gets whole blocks: `src.len() == n_blocks * type_size` and
// `dst.len() == n_blocks * 32`, checked by the caller (`quant::dequantize`).
// ---------------------------------------------------------------------------------------------

/// `block_q4_0 { half d; u8 qs[16]; }` (18 bytes): x = d * (q - 8).
pub(crate) fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(QK)) {
        let d = half_at(b, 0);
        let qs = &b[2..18];
        for j in 0..QK / 2 {
            let x0 = (qs[j] & 0x0f) as i32 - 8;
            let x1 = (qs[j] >> 4) as i32 - 8;
            y[j] = x0 as f32 * d;
            y[j + QK / 2] = x1 as f32 * d;
        }
    }
}

/// `block_q4_1 { half d; half m; u8 qs[16]; }` (20 bytes): x = d * q + m.
pub(crate) fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(20).zip(dst.chunks_exact_mut(QK)) {
        let d = half_at(b, 0);
        let m = half_at(b, 2);
        let qs = &b[4..20];
        for j in 0..QK / 2 {
            let x0 = (qs[j] & 0x0f) as f32;
            let x1 = (qs[j] >> 4) as f32;
            y[j] = x0 * d + m;
            y[j + QK / 2] = x1 * d + m;
        }
    }
}

/// `block_q5_0 { half d; u8 qh[4]; u8 qs[16]; }` (22 bytes): x = d * (q - 16).
pub(crate) fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(22).zip(dst.chunks_exact_mut(QK)) {
        let d = half_at(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        for j in 0..QK / 2 {
            let xh0 = (((qh >> j) << 4) & 0x10) as u8;
            let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
            let x0 = ((qs[j] & 0x0f) | xh0) as i32 - 16;
            let x1 = ((qs[j] >> 4) | xh1) as i32 - 16;
            y[j] = x0 as f32 * d;
            y[j + QK / 2] = x1 as f32 * d;
        }
    }
}

/// `block_q5_1 { half d; half m; u8 qh[4]; u8 qs[16]; }` (24 bytes): x = d * q + m.
pub(crate) fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(24).zip(dst.chunks_exact_mut(QK)) {
        let d = half_at(b, 0);
        let m = half_at(b, 2);
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let qs = &b[8..24];
        for j in 0..QK / 2 {
            let xh0 = (((qh >> j) << 4) & 0x10) as u8;
            let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
            let x0 = ((qs[j] & 0x0f) | xh0) as f32;
            let x1 = ((qs[j] >> 4) | xh1) as f32;
            y[j] = x0 * d + m;
            y[j + QK / 2] = x1 * d + m;
        }
    }
}

/// `block_q8_0 { half d; i8 qs[32]; }` (34 bytes): x = q * d.
pub(crate) fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(34).zip(dst.chunks_exact_mut(QK)) {
        let d = half_at(b, 0);
        for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
            *yj = (q as i8) as f32 * d;
        }
    }
}

/// `block_q8_1 { half d; half s; i8 qs[32]; }` (36 bytes): x = q * d. `s` (= d * sum(q)) is a
/// cached sum for dot products and plays no part in the values.
pub(crate) fn dequantize_q8_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(36).zip(dst.chunks_exact_mut(QK)) {
        let d = half_at(b, 0);
        for (yj, &q) in y.iter_mut().zip(&b[4..36]) {
            *yj = (q as i8) as f32 * d;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Quantization (`quantize_row_*_ref`). Each function gets whole blocks: `src.len() ==
// n_blocks * 32`, `dst.len() == n_blocks * type_size`, checked by the caller.
// ---------------------------------------------------------------------------------------------

/// ggml's `1.0f/d` guarded against a zero scale.
#[inline]
fn inv(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// The element of largest magnitude, keeping its sign; the first one wins a tie (ggml's strict
/// `amax < fabsf(v)` test, numpy's `argmax`).
#[inline]
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// ggml's `min`/`max` loop starting from +-FLT_MAX.
#[inline]
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// C's `(int8_t)f` / `(uint8_t)f` for the small non-negative values these formats produce:
/// truncation toward zero. Rust's `as` saturates instead of being undefined out of range, and
/// maps NaN to 0.
#[inline]
fn trunc_u8(f: f32) -> u8 {
    f as u8
}

pub(crate) fn quantize_q4_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(18)) {
        let max = signed_absmax(x);
        let d = max / -8.0;
        let id = inv(d);
        put_half(b, 0, d);
        for j in 0..QK / 2 {
            let xi0 = trunc_u8(x[j] * id + 8.5).min(15);
            let xi1 = trunc_u8(x[j + QK / 2] * id + 8.5).min(15);
            b[2 + j] = xi0 | (xi1 << 4);
        }
    }
}

pub(crate) fn quantize_q4_1(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(20)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = inv(d);
        put_half(b, 0, d);
        put_half(b, 2, min);
        for j in 0..QK / 2 {
            let xi0 = trunc_u8((x[j] - min) * id + 0.5).min(15);
            let xi1 = trunc_u8((x[j + QK / 2] - min) * id + 0.5).min(15);
            b[4 + j] = xi0 | (xi1 << 4);
        }
    }
}

pub(crate) fn quantize_q5_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(22)) {
        let max = signed_absmax(x);
        let d = max / -16.0;
        let id = inv(d);
        put_half(b, 0, d);
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let xi0 = trunc_u8(x[j] * id + 16.5).min(31);
            let xi1 = trunc_u8(x[j + QK / 2] * id + 16.5).min(31);
            b[6 + j] = (xi0 & 0x0f) | ((xi1 & 0x0f) << 4);
            qh |= (((xi0 & 0x10) >> 4) as u32) << j;
            qh |= (((xi1 & 0x10) >> 4) as u32) << (j + QK / 2);
        }
        b[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}

pub(crate) fn quantize_q5_1(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(24)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = inv(d);
        put_half(b, 0, d);
        put_half(b, 2, min);
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            // ggml has no clamp here ((max - min) * id rounds to at most 31.5); gguf-py clips to
            // 31. The clamp only matters for NaN/inf input, where both are garbage anyway.
            let xi0 = trunc_u8((x[j] - min) * id + 0.5).min(31);
            let xi1 = trunc_u8((x[j + QK / 2] - min) * id + 0.5).min(31);
            b[8 + j] = (xi0 & 0x0f) | ((xi1 & 0x0f) << 4);
            qh |= (((xi0 & 0x10) >> 4) as u32) << j;
            qh |= (((xi1 & 0x10) >> 4) as u32) << (j + QK / 2);
        }
        b[4..8].copy_from_slice(&qh.to_le_bytes());
    }
}

pub(crate) fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(34)) {
        let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = inv(d);
        put_half(b, 0, d);
        for (q, &v) in b[2..34].iter_mut().zip(x) {
            // roundf: half away from zero, which is what f32::round does. |v * id| <= 127
            // up to one rounding, and `as i8` saturates, so no wrap.
            *q = ((v * id).round() as i8) as u8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic awkward test data: a few magnitudes, both signs, exact zeros.
    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((s >> 40) as f32) / (1u64 << 24) as f32 - 0.5; // [-0.5, 0.5)
                let scale = [1.0f32, 1e-3, 30.0, 0.07][(i / QK) % 4];
                if i % 17 == 0 {
                    0.0
                } else {
                    u * scale
                }
            })
            .collect()
    }

    /// Half-float rounding of a stored value: at most half an ulp of binary16, 2^-11 relative.
    fn f16_slop(v: f32) -> f32 {
        v.abs() * 2f32.powi(-11) + 2f32.powi(-25) // + half the smallest subnormal
    }

    /// Checks the round-trip error of every block against the format's step `d` (as stored):
    /// `tol(d, m)` is the bound for one block.
    fn check(
        quant: fn(&[f32], &mut [u8]),
        deq: fn(&[u8], &mut [f32]),
        type_size: usize,
        tol: impl Fn(f32, f32) -> f32,
        scale_at: impl Fn(&[u8]) -> (f32, f32),
    ) {
        let x = data(QK * 16, 7);
        let mut q = vec![0u8; 16 * type_size];
        quant(&x, &mut q);
        let mut y = vec![0f32; x.len()];
        deq(&q, &mut y);
        for (bi, ((xb, yb), qb)) in x
            .chunks(QK)
            .zip(y.chunks(QK))
            .zip(q.chunks(type_size))
            .enumerate()
        {
            let (d, m) = scale_at(qb);
            let t = tol(d, m);
            for (a, b) in xb.iter().zip(yb) {
                assert!(
                    (a - b).abs() <= t,
                    "block {bi}: {a} -> {b}, step {d}, tolerance {t}"
                );
            }
        }
    }

    // Tolerances: a value is rounded to the nearest grid point (half a step) except at the
    // clamped end of the symmetric formats, where the grid stops one step short of -max (a full
    // step). On top comes the rounding of the stored half scale: the grid point q*d moves by up
    // to |q| * f16_slop(d), and the offset m by f16_slop(m).

    #[test]
    fn q8_0_round_trip_within_half_a_step() {
        check(
            quantize_q8_0,
            dequantize_q8_0,
            34,
            |d, _| d.abs() * 0.5 + 127.0 * f16_slop(d),
            |b| (half_at(b, 0), 0.0),
        );
    }

    #[test]
    fn q4_0_round_trip_within_one_step() {
        check(
            quantize_q4_0,
            dequantize_q4_0,
            18,
            |d, _| d.abs() + 8.0 * f16_slop(d),
            |b| (half_at(b, 0), 0.0),
        );
    }

    #[test]
    fn q5_0_round_trip_within_one_step() {
        check(
            quantize_q5_0,
            dequantize_q5_0,
            22,
            |d, _| d.abs() + 16.0 * f16_slop(d),
            |b| (half_at(b, 0), 0.0),
        );
    }

    #[test]
    fn q4_1_round_trip_within_half_a_step() {
        check(
            quantize_q4_1,
            dequantize_q4_1,
            20,
            |d, m| d.abs() * 0.5 + 15.0 * f16_slop(d) + f16_slop(m),
            |b| (half_at(b, 0), half_at(b, 2)),
        );
    }

    #[test]
    fn q5_1_round_trip_within_half_a_step() {
        check(
            quantize_q5_1,
            dequantize_q5_1,
            24,
            |d, m| d.abs() * 0.5 + 31.0 * f16_slop(d) + f16_slop(m),
            |b| (half_at(b, 0), half_at(b, 2)),
        );
    }

    #[test]
    fn zero_block_quantizes_to_zero_scale_and_back_to_zeros() {
        let x = [0f32; QK];
        for (quant, deq, ts) in [
            (
                quantize_q4_0 as fn(&[f32], &mut [u8]),
                dequantize_q4_0 as fn(&[u8], &mut [f32]),
                18,
            ),
            (quantize_q4_1, dequantize_q4_1, 20),
            (quantize_q5_0, dequantize_q5_0, 22),
            (quantize_q5_1, dequantize_q5_1, 24),
            (quantize_q8_0, dequantize_q8_0, 34),
        ] {
            let mut q = vec![0xaau8; ts];
            quant(&x, &mut q);
            let mut y = [1f32; QK];
            deq(&q, &mut y);
            assert!(y.iter().all(|v| *v == 0.0), "{ts}-byte block: {y:?}");
        }
    }

    #[test]
    fn q5_0_high_bits_land_in_qh() {
        // Element j has q = 0 (bit 4 clear) except j = 3 and j = 20: max = -16 * d with d = 1
        // gives q = x + 16.
        let mut x = [-16f32; QK];
        x[3] = 0.0; // q = 16: only the fifth bit
        x[20] = 15.0; // q = 31
        let mut q = [0u8; 22];
        quantize_q5_0(&x, &mut q);
        assert_eq!(half_at(&q, 0), 1.0);
        assert_eq!(
            u32::from_le_bytes([q[2], q[3], q[4], q[5]]),
            (1 << 3) | (1 << 20)
        );
        let mut y = [0f32; QK];
        dequantize_q5_0(&q, &mut y);
        assert_eq!(y, x);
    }
}
