//! Quantizers for ggml's k-quant super-block formats (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K), and
//! the importance-weighted ("imatrix") quantizers of the k-quants and of Q4_0, Q4_1, Q5_0, Q5_1.
//!
//! This is a transcription of `ggml-quants.c`: `quantize_row_q*_K_ref` (no importance weights)
//! and `quantize_row_q*_K_impl` / `quantize_row_q*_impl` (with them), with the helpers
//! `nearest_int`, `make_qx_quants`, `make_q3_quants`, `make_qkx2_quants`, `make_qkx3_quants` and
//! `make_qp_quants`. Float operations happen in the same order and precision as the C (no fused
//! multiply-add: ggml-base is built without FMA contraction), integer conversions truncate where
//! C's implicit conversions truncate, so the bytes equal ggml's `ggml_quantize_chunk` output; the
//! contract test `tests/quantize_kquants.rs` holds us to vectors produced by ggml itself.
//!
//! Which function ggml uses, and so which one [`crate::quant::quantize`] /
//! [`quantize_weighted`] use: without importance weights every k-quant uses its `_ref` row
//! quantizer; with them, `_impl`. Q8_0 ignores importance weights in ggml, and so do we.
//!
//! Not here: the block layouts' dequantizers (`kquants.rs`), IQ* formats, SIMD.

// Index loops on purpose: they mirror ggml's C loops line for line, which is what keeps the
// float operations in the same order (and the review against ggml-quants.c easy).
#![allow(clippy::needless_range_loop)]

use super::float::{f16_bits_to_f32, f32_to_f16_bits};
use super::kquants::QK_K;
use crate::{Error, GgmlType, Result};

mod search;

use search::{
    make_q3_quants, make_qkx_quants, make_qp_quants, make_qx_quants, nearest_int, Search,
    GROUP_MAX_EPS,
};

/// Rounds to half and back, as `GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(x))`.
#[inline]
fn to_half(x: f32) -> (u16, f32) {
    let h = f32_to_f16_bits(x);
    (h, f16_bits_to_f32(h))
}

#[inline]
fn put_u16(b: &mut [u8], off: usize, h: u16) {
    b[off..off + 2].copy_from_slice(&h.to_le_bytes());
}

// ---------------------------------------------------------------------------------------------
// Packing shared by the `_ref` and `_impl` quantizers.
// ---------------------------------------------------------------------------------------------

/// Packs 2-bit values: `qs[j/4 + l]` holds elements j+l, j+l+32, j+l+64, j+l+96 (Q2_K, Q3_K).
fn pack_2bit(l: &[u8; QK_K], qs: &mut [u8]) {
    for j in (0..QK_K).step_by(128) {
        for i in 0..32 {
            qs[j / 4 + i] =
                l[j + i] | (l[j + i + 32] << 2) | (l[j + i + 64] << 4) | (l[j + i + 96] << 6);
        }
    }
}

/// Q4_K / Q5_K 12-byte packing of eight 6-bit scales and mins.
fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8], out: &mut [u8]) {
    out[..12].iter_mut().for_each(|v| *v = 0);
    for j in 0..8 {
        if j < 4 {
            out[j] = ls[j];
            out[j + 4] = lm[j];
        } else {
            out[j + 4] = (ls[j] & 0xf) | ((lm[j] & 0xf) << 4);
            out[j - 4] |= (ls[j] >> 4) << 6;
            out[j] |= (lm[j] >> 4) << 6;
        }
    }
}

fn get_scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q2_K tail shared by ref and impl: requantize with the stored (half) scales, then pack.
/// `b`: one 84-byte block whose scales/d/dmin are already written.
fn q2_k_finish(x: &[f32], l: &mut [u8; QK_K], b: &mut [u8]) {
    let dm = f16_bits_to_f32(u16::from_le_bytes([b[80], b[81]]));
    let mm = f16_bits_to_f32(u16::from_le_bytes([b[82], b[83]]));
    for j in 0..16 {
        let d = dm * (b[j] & 0xf) as f32;
        if d == 0.0 {
            continue;
        }
        let m = mm * (b[j] >> 4) as f32;
        for ii in 0..16 {
            l[16 * j + ii] = nearest_int((x[16 * j + ii] + m) / d).clamp(0, 3) as u8;
        }
    }
    pack_2bit(l, &mut b[16..80]);
}

/// Q3_K tail: unpack each stored 6-bit scale, requantize, split off the high bit into `hmask`,
/// pack the low 2 bits. `b`: one 110-byte block whose scales and d are written; `l` holds
/// values in 0..8.
fn q3_k_finish(x: &[f32], l: &mut [i8; QK_K], b: &mut [u8]) {
    let d_all = f16_bits_to_f32(u16::from_le_bytes([b[108], b[109]]));
    for j in 0..16 {
        let sc = &b[96..108];
        let lo = if j < 8 { sc[j] & 0xf } else { sc[j - 8] >> 4 };
        let s = (lo | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) as i32 - 32;
        let d = d_all * s as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-4, 3) + 4) as i8;
        }
    }
    b[0..32].iter_mut().for_each(|v| *v = 0);
    let mut m = 0;
    let mut hm = 1u8;
    let mut low = [0u8; QK_K];
    for j in 0..QK_K {
        let mut v = l[j];
        if v > 3 {
            b[m] |= hm;
            v -= 4;
        }
        low[j] = v as u8;
        m += 1;
        if m == QK_K / 8 {
            m = 0;
            hm <<= 1;
        }
    }
    pack_2bit(&low, &mut b[32..96]);
}

/// Writes Q3_K's 16 six-bit scales (already offset to 0..63) into the 12 scale bytes.
fn q3_k_put_scales(ls: &[i32; 16], sc: &mut [u8]) {
    sc[..12].iter_mut().for_each(|v| *v = 0);
    for (j, &l) in ls.iter().enumerate() {
        if j < 8 {
            sc[j] = (l & 0xf) as u8;
        } else {
            sc[j - 8] |= ((l & 0xf) << 4) as u8;
        }
        let hi = l >> 4;
        sc[j % 4 + 8] |= (hi << (2 * (j / 4))) as u8;
    }
}

/// Q4_K / Q5_K tail: requantize every sub-block of 32 against the stored scales. `b` starts with
/// d, dmin and the 12 scale bytes.
fn q45_k_requantize(x: &[f32], l: &mut [u8; QK_K], b: &[u8], nmax: i32) {
    let d0 = f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
    let m0 = f16_bits_to_f32(u16::from_le_bytes([b[2], b[3]]));
    for j in 0..8 {
        let (sc, m) = get_scale_min_k4(j, &b[4..16]);
        let d = d0 * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = m0 * m as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax) as u8;
        }
    }
}

fn q4_k_pack(l: &[u8; QK_K], qs: &mut [u8]) {
    for (c, j) in (0..QK_K).step_by(64).enumerate() {
        for i in 0..32 {
            qs[32 * c + i] = l[j + i] | (l[j + i + 32] << 4);
        }
    }
}

fn q5_k_pack(l: &[u8; QK_K], qh: &mut [u8], ql: &mut [u8]) {
    qh[..32].iter_mut().for_each(|v| *v = 0);
    let (mut m1, mut m2) = (1u8, 2u8);
    for (c, n) in (0..QK_K).step_by(64).enumerate() {
        for j in 0..32 {
            let mut l1 = l[n + j];
            if l1 > 15 {
                l1 -= 16;
                qh[j] |= m1;
            }
            let mut l2 = l[n + j + 32];
            if l2 > 15 {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql[32 * c + j] = l1 | (l2 << 4);
        }
        m1 <<= 2;
        m2 <<= 2;
    }
}

/// Q6_K tail from per-sub-block scales (shared by ref and impl, which differ only in how the
/// scales are searched). `l` holds make_qx_quants' values for sub-blocks whose stored scale is 0.
fn q6_k_finish(x: &[f32], l: &mut [i8; QK_K], scales: &[f32; 16], b: &mut [u8]) {
    let mut max_scale = 0f32;
    let mut max_abs_scale = 0f32;
    for &s in scales {
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        b.iter_mut().for_each(|v| *v = 0);
        return;
    }
    let iscale = -128.0 / max_scale;
    let (dh, d0) = to_half(1.0 / iscale);
    put_u16(b, 208, dh);
    for (ib, &s) in scales.iter().enumerate() {
        b[192 + ib] = nearest_int(iscale * s).min(127) as i8 as u8;
    }
    for j in 0..16 {
        let d = d0 * (b[192 + j] as i8) as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-32, 31) + 32) as i8;
        }
    }
    let (ql, rest) = b.split_at_mut(128);
    let qh = &mut rest[..64];
    for (c, j) in (0..QK_K).step_by(128).enumerate() {
        for i in 0..32 {
            let q = |k: usize| l[j + i + k] as u8;
            ql[64 * c + i] = (q(0) & 0xf) | ((q(64) & 0xf) << 4);
            ql[64 * c + i + 32] = (q(32) & 0xf) | ((q(96) & 0xf) << 4);
            qh[32 * c + i] =
                (q(0) >> 4) | ((q(32) >> 4) << 2) | ((q(64) >> 4) << 4) | ((q(96) >> 4) << 6);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// `quantize_row_q*_K_ref`: whole blocks in, whole blocks out (checked by `quant::quantize`).
// ---------------------------------------------------------------------------------------------

pub(crate) fn quantize_q2_k(src: &[f32], dst: &mut [u8]) {
    const Q4SCALE: f32 = 15.0;
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(84)) {
        let mut l = [0u8; QK_K];
        let mut laux = [0u8; 16];
        let mut weights = [0f32; 16];
        let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
        let (mut max_scale, mut max_min) = (0f32, 0f32);
        let s = Search {
            rmin: -0.5,
            rdelta: 0.1,
            nstep: 15,
            use_mad: true,
        };
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            for (w, &xi) in weights.iter_mut().zip(xs) {
                *w = xi.abs();
            }
            (scales[j], mins[j]) = make_qkx_quants(
                3,
                xs,
                Some(&weights),
                &mut l[16 * j..16 * j + 16],
                &mut laux,
                s,
                false,
            );
            if scales[j] > max_scale {
                max_scale = scales[j];
            }
            if mins[j] > max_min {
                max_min = mins[j];
            }
        }
        if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for j in 0..16 {
                b[j] = nearest_int(iscale * scales[j]) as u8;
            }
            put_u16(b, 80, f32_to_f16_bits(max_scale / Q4SCALE));
        } else {
            b[..16].iter_mut().for_each(|v| *v = 0);
            put_u16(b, 80, f32_to_f16_bits(0.0));
        }
        if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for j in 0..16 {
                b[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
            }
            put_u16(b, 82, f32_to_f16_bits(max_min / Q4SCALE));
        } else {
            put_u16(b, 82, f32_to_f16_bits(0.0));
        }
        q2_k_finish(x, &mut l, b);
    }
}

pub(crate) fn quantize_q3_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(110)) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let (mut max_scale, mut amax) = (0f32, 0f32);
        for j in 0..16 {
            scales[j] = make_q3_quants(
                4,
                &x[16 * j..16 * j + 16],
                &mut l[16 * j..16 * j + 16],
                true,
            );
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            let mut ls = [0i32; 16];
            for j in 0..16 {
                let v = nearest_int(iscale * scales[j]) as i8 as i32;
                ls[j] = v.clamp(-32, 31) + 32;
            }
            q3_k_put_scales(&ls, &mut b[96..108]);
            put_u16(b, 108, f32_to_f16_bits(1.0 / iscale));
        } else {
            b[96..108].iter_mut().for_each(|v| *v = 0);
            put_u16(b, 108, f32_to_f16_bits(0.0));
        }
        q3_k_finish(x, &mut l, b);
    }
}

/// Q4_K and Q5_K share the scale search of their `_ref` quantizers; they differ in nmax and in
/// the search range.
fn q45_k_ref_scales(x: &[f32], l: &mut [u8; QK_K], nmax: i32, s: Search, b: &mut [u8]) {
    let mut laux = [0u8; 32];
    let mut weights = [0f32; 32];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for &xi in xs {
            sum_x2 += xi * xi;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &xi) in weights.iter_mut().zip(xs) {
            *w = av_x + xi.abs();
        }
        (scales[j], mins[j]) = make_qkx_quants(
            nmax,
            xs,
            Some(&weights),
            &mut l[32 * j..32 * j + 32],
            &mut laux,
            s,
            false,
        );
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let (mut ls, mut lm) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    pack_scale_min_k4(&ls, &lm, &mut b[4..16]);
    put_u16(b, 0, f32_to_f16_bits(max_scale / 63.0));
    put_u16(b, 2, f32_to_f16_bits(max_min / 63.0));
}

pub(crate) fn quantize_q4_k(src: &[f32], dst: &mut [u8]) {
    let s = Search {
        rmin: -1.0,
        rdelta: 0.1,
        nstep: 20,
        use_mad: false,
    };
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(144)) {
        let mut l = [0u8; QK_K];
        q45_k_ref_scales(x, &mut l, 15, s, b);
        q45_k_requantize(x, &mut l, b, 15);
        q4_k_pack(&l, &mut b[16..144]);
    }
}

pub(crate) fn quantize_q5_k(src: &[f32], dst: &mut [u8]) {
    let s = Search {
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: false,
    };
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(176)) {
        let mut l = [0u8; QK_K];
        q45_k_ref_scales(x, &mut l, 31, s, b);
        q45_k_requantize(x, &mut l, b, 31);
        let (qh, ql) = b[16..176].split_at_mut(32);
        q5_k_pack(&l, qh, ql);
    }
}

pub(crate) fn quantize_q6_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(210)) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        for ib in 0..16 {
            scales[ib] = make_qx_quants(
                32,
                &x[16 * ib..16 * ib + 16],
                &mut l[16 * ib..16 * ib + 16],
                1,
                None,
            );
        }
        q6_k_finish(x, &mut l, &scales, b);
    }
}

pub(crate) fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(292)) {
        let mut max = 0f32;
        let mut amax = 0f32;
        for &xi in x {
            if xi.abs() > amax {
                amax = xi.abs();
                max = xi;
            }
        }
        if amax == 0.0 {
            // ggml leaves bsums as they were; we write zeros (what a zeroed buffer holds).
            b.iter_mut().for_each(|v| *v = 0);
            continue;
        }
        let iscale = -127.0 / max;
        for j in 0..QK_K {
            b[4 + j] = nearest_int(iscale * x[j]).min(127) as i8 as u8;
        }
        for j in 0..16 {
            let sum: i32 = b[4 + 16 * j..4 + 16 * j + 16]
                .iter()
                .map(|&q| q as i8 as i32)
                .sum();
            b[260 + 2 * j..262 + 2 * j].copy_from_slice(&(sum as i16).to_le_bytes());
        }
        b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

// ---------------------------------------------------------------------------------------------
// Importance-weighted quantizers (`quantize_row_q*_impl`): one row at a time, `qw` has one
// weight per column of the row.
// ---------------------------------------------------------------------------------------------

fn q2_k_impl(x_row: &[f32], qw_row: &[f32], dst: &mut [u8]) {
    let s = Search {
        rmin: -0.9,
        rdelta: 0.05,
        nstep: 36,
        use_mad: false,
    };
    for ((x, qw), b) in x_row
        .chunks_exact(QK_K)
        .zip(qw_row.chunks_exact(QK_K))
        .zip(dst.chunks_exact_mut(84))
    {
        let mut l = [0u8; QK_K];
        let mut laux = [0u8; 16];
        let mut weight = [0f32; 16];
        let (mut scales, mut mins, mut sw) = ([0f32; 16], [0f32; 16], [0f32; 16]);
        let mut sumx2 = 0f32;
        for &xi in x {
            sumx2 += xi * xi;
        }
        let sigma2 = sumx2 / QK_K as f32;
        for j in 0..16 {
            for i in 0..16 {
                let xi = x[16 * j + i];
                weight[i] = qw[16 * j + i] * (sigma2 + xi * xi).sqrt();
            }
            for &w in &weight {
                sw[j] += w;
            }
            (scales[j], mins[j]) = make_qkx_quants(
                3,
                &x[16 * j..16 * j + 16],
                Some(&weight),
                &mut l[16 * j..16 * j + 16],
                &mut laux,
                s,
                true,
            );
        }
        let (mut ls, mut lm) = ([0u8; 16], [0u8; 16]);
        let dm = make_qp_quants(15, &scales, &mut ls, &sw);
        let mm = make_qp_quants(15, &mins, &mut lm, &sw);
        put_u16(b, 80, f32_to_f16_bits(dm));
        put_u16(b, 82, f32_to_f16_bits(mm));
        for j in 0..16 {
            b[j] = ls[j] | (lm[j] << 4);
        }
        q2_k_finish(x, &mut l, b);
    }
}

fn q3_k_impl(x_row: &[f32], qw_row: &[f32], dst: &mut [u8]) {
    for ((x, qw), b) in x_row
        .chunks_exact(QK_K)
        .zip(qw_row.chunks_exact(QK_K))
        .zip(dst.chunks_exact_mut(110))
    {
        let mut l = [0i8; QK_K];
        let mut weight = [0f32; 16];
        let (mut scales, mut sw) = ([0f32; 16], [0f32; 16]);
        let mut sumx2 = 0f32;
        for &xi in x {
            sumx2 += xi * xi;
        }
        let sigma2 = 2.0 * sumx2 / QK_K as f32;
        for j in 0..16 {
            for i in 0..16 {
                let xi = x[16 * j + i];
                weight[i] = qw[16 * j + i] * (sigma2 + xi * xi).sqrt();
            }
            let mut sumw = 0f32;
            for &w in &weight {
                sumw += w;
            }
            sw[j] = sumw;
            scales[j] = make_qx_quants(
                4,
                &x[16 * j..16 * j + 16],
                &mut l[16 * j..16 * j + 16],
                1,
                Some(&weight),
            );
        }
        let mut ls8 = [0i8; 16];
        let d_block = make_qx_quants(32, &scales, &mut ls8, 1, Some(&sw));
        let ls: [i32; 16] = std::array::from_fn(|j| ls8[j] as i32);
        q3_k_put_scales(&ls, &mut b[96..108]);
        put_u16(b, 108, f32_to_f16_bits(d_block));
        q3_k_finish(x, &mut l, b);
    }
}

/// Q4_K / Q5_K `_impl` scale search (shared; they differ in nmax).
fn q45_k_impl_scales(x: &[f32], qw: &[f32], l: &mut [u8; QK_K], nmax: i32, b: &mut [u8]) {
    let s = Search {
        rmin: -0.9,
        rdelta: 0.05,
        nstep: 36,
        use_mad: false,
    };
    let mut laux = [0u8; 32];
    let mut weights = [0f32; 32];
    let (mut scales, mut mins, mut sw) = ([0f32; 8], [0f32; 8], [0f32; 8]);
    let mut sum_x2 = 0f32;
    for &xi in x {
        sum_x2 += xi * xi;
    }
    let sigma2 = 2.0 * sum_x2 / QK_K as f32;
    for j in 0..8 {
        for i in 0..32 {
            let xi = x[32 * j + i];
            weights[i] = qw[32 * j + i] * (sigma2 + xi * xi).sqrt();
        }
        let mut sumw = 0f32;
        for &w in &weights {
            sumw += w;
        }
        sw[j] = sumw;
        (scales[j], mins[j]) = make_qkx_quants(
            nmax,
            &x[32 * j..32 * j + 32],
            Some(&weights),
            &mut l[32 * j..32 * j + 32],
            &mut laux,
            s,
            true,
        );
    }
    let (mut ls, mut lm) = ([0u8; 8], [0u8; 8]);
    let d_block = make_qp_quants(63, &scales, &mut ls, &sw);
    let m_block = make_qp_quants(63, &mins, &mut lm, &sw);
    // Q5_K clamps to 63 here and Q4_K does not; make_qp_quants never exceeds 63 except through
    // uint8 wrap-around of a negative value, which the clamp then maps to 63.
    if nmax == 31 {
        ls.iter_mut()
            .chain(lm.iter_mut())
            .for_each(|v| *v = (*v).min(63));
    }
    pack_scale_min_k4(&ls, &lm, &mut b[4..16]);
    put_u16(b, 0, f32_to_f16_bits(d_block));
    put_u16(b, 2, f32_to_f16_bits(m_block));
}

fn q4_k_impl(x_row: &[f32], qw_row: &[f32], dst: &mut [u8]) {
    for ((x, qw), b) in x_row
        .chunks_exact(QK_K)
        .zip(qw_row.chunks_exact(QK_K))
        .zip(dst.chunks_exact_mut(144))
    {
        let mut l = [0u8; QK_K];
        q45_k_impl_scales(x, qw, &mut l, 15, b);
        q45_k_requantize(x, &mut l, b, 15);
        q4_k_pack(&l, &mut b[16..144]);
    }
}

fn q5_k_impl(x_row: &[f32], qw_row: &[f32], dst: &mut [u8]) {
    for ((x, qw), b) in x_row
        .chunks_exact(QK_K)
        .zip(qw_row.chunks_exact(QK_K))
        .zip(dst.chunks_exact_mut(176))
    {
        let mut l = [0u8; QK_K];
        q45_k_impl_scales(x, qw, &mut l, 31, b);
        q45_k_requantize(x, &mut l, b, 31);
        let (qh, ql) = b[16..176].split_at_mut(32);
        q5_k_pack(&l, qh, ql);
    }
}

fn q6_k_impl(x_row: &[f32], qw_row: &[f32], dst: &mut [u8]) {
    for ((x, qw), b) in x_row
        .chunks_exact(QK_K)
        .zip(qw_row.chunks_exact(QK_K))
        .zip(dst.chunks_exact_mut(210))
    {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        for ib in 0..16 {
            let r = 16 * ib..16 * ib + 16;
            scales[ib] = make_qx_quants(32, &x[r.clone()], &mut l[r.clone()], 1, Some(&qw[r]));
        }
        q6_k_finish(x, &mut l, &scales, b);
    }
}

/// Row-wide σ² of the legacy `_impl` quantizers (over the whole row, not per block).
fn row_sigma2(x: &[f32]) -> f32 {
    let mut sum_x2 = 0f32;
    for &xi in x {
        sum_x2 += xi * xi;
    }
    sum_x2 / x.len() as f32
}

fn legacy_weights(xb: &[f32], qw: &[f32], sigma2: f32) -> [f32; 32] {
    std::array::from_fn(|j| qw[j] * (sigma2 + xb[j] * xb[j]).sqrt())
}

/// Q4_0 (`nmax` 8, 18-byte blocks) and Q5_0 (`nmax` 16, 22-byte blocks), importance-weighted.
fn q4_0_q5_0_impl(x_row: &[f32], qw_row: &[f32], dst: &mut [u8], five: bool) {
    let sigma2 = row_sigma2(x_row);
    let bs = if five { 22 } else { 18 };
    for ((xb, qw), b) in x_row
        .chunks_exact(32)
        .zip(qw_row.chunks_exact(32))
        .zip(dst.chunks_exact_mut(bs))
    {
        let weight = legacy_weights(xb, qw, sigma2);
        let mut l = [0i8; 32];
        let d = make_qx_quants(if five { 16 } else { 8 }, xb, &mut l, 1, Some(&weight));
        put_u16(b, 0, f32_to_f16_bits(d));
        let qs_off = if five { 6 } else { 2 };
        let mut qh = 0u32;
        for j in 0..16 {
            let (x0, x1) = (l[j] as u8, l[j + 16] as u8);
            b[qs_off + j] = (x0 & 0x0f) | ((x1 & 0x0f) << 4);
            qh |= (((x0 & 0x10) >> 4) as u32) << j;
            qh |= (((x1 & 0x10) >> 4) as u32) << (j + 16);
        }
        if five {
            b[2..6].copy_from_slice(&qh.to_le_bytes());
        }
    }
}

/// Q4_1 (`nmax` 15, 20-byte blocks) and Q5_1 (`nmax` 31, 24-byte blocks), importance-weighted.
fn q4_1_q5_1_impl(x_row: &[f32], qw_row: &[f32], dst: &mut [u8], five: bool) {
    let sigma2 = row_sigma2(x_row);
    let bs = if five { 24 } else { 20 };
    let s = Search {
        rmin: -0.9,
        rdelta: 0.05,
        nstep: 36,
        use_mad: false,
    };
    for ((xb, qw), b) in x_row
        .chunks_exact(32)
        .zip(qw_row.chunks_exact(32))
        .zip(dst.chunks_exact_mut(bs))
    {
        let weight = legacy_weights(xb, qw, sigma2);
        let (mut l, mut laux) = ([0u8; 32], [0u8; 32]);
        let (d, min) = make_qkx_quants(
            if five { 31 } else { 15 },
            xb,
            Some(&weight),
            &mut l,
            &mut laux,
            s,
            true,
        );
        put_u16(b, 0, f32_to_f16_bits(d));
        put_u16(b, 2, f32_to_f16_bits(-min));
        let qs_off = if five { 8 } else { 4 };
        let mut qh = 0u32;
        for j in 0..16 {
            let (x0, x1) = (l[j], l[j + 16]);
            b[qs_off + j] = (x0 & 0x0f) | ((x1 & 0x0f) << 4);
            qh |= (((x0 & 0x10) >> 4) as u32) << j;
            qh |= (((x1 & 0x10) >> 4) as u32) << (j + 16);
        }
        if five {
            b[4..8].copy_from_slice(&qh.to_le_bytes());
        }
    }
}

/// Quantizes rows of `weights.len()` columns with importance weights (one per column, e.g. an
/// imatrix entry: the mean squared activation feeding that column), byte for byte as ggml's
/// `ggml_quantize_chunk(ty, src, dst, 0, nrows, n_per_row, imatrix)`.
///
/// Types whose ggml quantizer ignores importance weights (F32, F16, BF16, Q8_0, Q8_K) quantize as
/// [`crate::quant::quantize`] does. `src.len()` must be a whole number of rows, each a whole
/// number of blocks, and `dst` exactly the quantized size.
pub fn quantize_weighted(ty: GgmlType, src: &[f32], dst: &mut [u8], weights: &[f32]) -> Result<()> {
    let n = weights.len();
    if n == 0 || !src.len().is_multiple_of(n) {
        return Err(Error::Shape(format!(
            "{} values are not whole rows of {n} (the importance weights' length)",
            src.len()
        )));
    }
    let row_bytes = ty.row_bytes(n).ok_or_else(|| {
        Error::Shape(format!(
            "a row of {n} is not a whole number of {ty} blocks ({} each)",
            ty.block_size()
        ))
    })?;
    let rows = src.len() / n;
    if dst.len() != rows * row_bytes {
        return Err(Error::Shape(format!(
            "{} bytes of room given, {} needed for {rows} rows of {n} {ty}",
            dst.len(),
            rows * row_bytes
        )));
    }
    let f: fn(&[f32], &[f32], &mut [u8]) = match ty {
        GgmlType::Q2_K => q2_k_impl,
        GgmlType::Q3_K => q3_k_impl,
        GgmlType::Q4_K => q4_k_impl,
        GgmlType::Q5_K => q5_k_impl,
        GgmlType::Q6_K => q6_k_impl,
        GgmlType::Q4_0 => |x, w, d| q4_0_q5_0_impl(x, w, d, false),
        GgmlType::Q5_0 => |x, w, d| q4_0_q5_0_impl(x, w, d, true),
        GgmlType::Q4_1 => |x, w, d| q4_1_q5_1_impl(x, w, d, false),
        GgmlType::Q5_1 => |x, w, d| q4_1_q5_1_impl(x, w, d, true),
        _ => return super::quantize(ty, src, dst),
    };
    for (x, d) in src.chunks_exact(n).zip(dst.chunks_exact_mut(row_bytes)) {
        f(x, weights, d);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-2.6), -3);
        assert_eq!(nearest_int(4194303.0), 4194303);
    }

    #[test]
    fn weighted_lengths_are_checked() {
        let x = vec![0.5f32; 512];
        let w = vec![1f32; 256];
        let mut q = vec![0u8; 2 * 144];
        assert!(quantize_weighted(GgmlType::Q4_K, &x, &mut q, &w).is_ok());
        assert!(quantize_weighted(GgmlType::Q4_K, &x, &mut q[..144], &w).is_err());
        assert!(quantize_weighted(GgmlType::Q4_K, &x[..300], &mut q, &w).is_err());
        assert!(quantize_weighted(GgmlType::Q4_K, &x[..96], &mut q, &w[..96]).is_err());
    }

    #[test]
    fn round_trips_stay_within_a_few_steps() {
        // Smooth data: every format must land within its step size of the input.
        let x: Vec<f32> = (0..1024).map(|i| ((i as f32) * 0.37).sin() * 2.0).collect();
        for (ty, tol) in [
            (GgmlType::Q2_K, 1.0),
            (GgmlType::Q3_K, 0.6),
            (GgmlType::Q4_K, 0.2),
            (GgmlType::Q5_K, 0.1),
            (GgmlType::Q6_K, 0.05),
            (GgmlType::Q8_K, 0.02),
        ] {
            let mut q = vec![0u8; ty.row_bytes(x.len()).unwrap()];
            crate::quant::quantize(ty, &x, &mut q).unwrap();
            let mut y = vec![0f32; x.len()];
            crate::quant::dequantize(ty, &q, &mut y).unwrap();
            let worst = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            // Tolerances: about one quantization step over a range of 4 at each bit width (4/3 at
            // 2 bits, 4/7 at 3 bits, ...), halved from 4 bits on where the min/scale search pays.
            assert!(worst < tol, "{ty}: worst error {worst}");
        }
    }
}
