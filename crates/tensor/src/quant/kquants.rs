//! ggml's "k-quant" super-block formats, 256 elements per block: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
//! and Q8_K (the last is ggml's activation format for k-quant dot products; it is also a valid
//! tensor type).
//!
//! Byte layouts are the `block_q*_K` structs of `ggml-common.h` (QK_K = 256, K_SCALE_SIZE = 12);
//! dequantization follows `dequantize_row_q*_K` in `ggml-quants.c` with the float operations in
//! the same order (`dl * q - ml`, `(d * sc) * q`), so results are bit-identical to ggml's scalar
//! code and to gguf-py's numpy dequantizers.
//!
//! Dequantization only: the k-quant quantizers (ggml's `quantize_row_q*_K_ref`, with their
//! iterative scale search) are in `kquant_quantize`.

use super::float::f16_bits_to_f32;

/// Elements per super-block.
pub const QK_K: usize = 256;

#[inline]
fn half_at(b: &[u8], off: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

/// `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes
/// shared by Q4_K and Q5_K. Sub-blocks 0..4 keep their 6 bits in bytes 0..4 (scale) and 4..8
/// (min); sub-blocks 4..8 take 4 low bits from bytes 8..12 and their top 2 bits from the spare
/// top bits of bytes 0..8.
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

// Each function gets whole blocks: `src.len() == n_blocks * type_size` and
// `dst.len() == n_blocks * 256`, checked by the caller (`quant::dequantize`).

/// `block_q2_K { u8 scales[16]; u8 qs[64]; half d; half dmin; }` (84 bytes). Sixteen sub-blocks
/// of 16; byte `scales[i]` holds sub-block i's 4-bit scale (low) and 4-bit min (high).
/// x = (d * sc) * q - (dmin * m), q in 0..4.
pub(crate) fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(84).zip(dst.chunks_exact_mut(QK_K)) {
        let scales = &b[0..16];
        let d = half_at(b, 80);
        let min = half_at(b, 82);
        let mut out = 0;
        let mut is = 0;
        for n in 0..2 {
            let q = &b[16 + 32 * n..16 + 32 * (n + 1)];
            for shift in [0u32, 2, 4, 6] {
                for half in 0..2 {
                    let sc = scales[is];
                    is += 1;
                    let dl = d * (sc & 0x0f) as f32;
                    let ml = min * (sc >> 4) as f32;
                    for &ql in &q[16 * half..16 * (half + 1)] {
                        y[out] = dl * ((ql >> shift) & 3) as f32 - ml;
                        out += 1;
                    }
                }
            }
        }
    }
}

/// `block_q3_K { u8 hmask[32]; u8 qs[64]; u8 scales[12]; half d; }` (110 bytes). Sixteen
/// sub-blocks of 16 with 6-bit signed scales (stored + 32). x = (d * (sc - 32)) * (q - 4 *
/// !hbit), q in 0..4; the high bit *clear* means subtract 4, as in ggml.
pub(crate) fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(110).zip(dst.chunks_exact_mut(QK_K)) {
        let hm = &b[0..32];
        let sc = &b[96..108];
        let d_all = half_at(b, 108);
        // Scale i: low 4 bits from byte i (i < 8) or the high nibble of byte i - 8; top 2 bits
        // from byte 8 + i % 4, at bit 2 * (i / 4). Same as ggml's kmask1/kmask2 shuffle.
        let mut scales = [0i32; 16];
        for (i, s) in scales.iter_mut().enumerate() {
            let lo = if i < 8 { sc[i] & 0x0f } else { sc[i - 8] >> 4 };
            let hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
            *s = (lo | (hi << 4)) as i32 - 32;
        }
        let mut out = 0;
        let mut is = 0;
        let mut m = 1u8;
        for n in 0..2 {
            let q = &b[32 + 32 * n..32 + 32 * (n + 1)];
            for shift in [0u32, 2, 4, 6] {
                for half in 0..2 {
                    let dl = d_all * scales[is] as f32;
                    is += 1;
                    for l in 16 * half..16 * (half + 1) {
                        let low = ((q[l] >> shift) & 3) as i32;
                        let sub = if hm[l] & m != 0 { 0 } else { 4 };
                        y[out] = dl * (low - sub) as f32;
                        out += 1;
                    }
                }
                m <<= 1;
            }
        }
    }
}

/// `block_q4_K { half d; half dmin; u8 scales[12]; u8 qs[128]; }` (144 bytes). Eight sub-blocks
/// of 32 with 6-bit scales and mins. x = (d * sc) * q - (dmin * m), q in 0..16.
pub(crate) fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(144).zip(dst.chunks_exact_mut(QK_K)) {
        let d = half_at(b, 0);
        let min = half_at(b, 2);
        let scales = &b[4..16];
        for (c, yc) in y.chunks_exact_mut(64).enumerate() {
            let q = &b[16 + 32 * c..16 + 32 * (c + 1)];
            let (sc1, m1) = scale_min_k4(2 * c, scales);
            let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            for l in 0..32 {
                yc[l] = d1 * (q[l] & 0x0f) as f32 - m1;
                yc[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

/// `block_q5_K { half d; half dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; }` (176 bytes). As
/// Q4_K with a fifth bit per element from `qh`: bit 2c of `qh[l]` for element l of chunk c's low
/// half, bit 2c + 1 for its high half. x = (d * sc) * q - (dmin * m), q in 0..32.
pub(crate) fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(176).zip(dst.chunks_exact_mut(QK_K)) {
        let d = half_at(b, 0);
        let min = half_at(b, 2);
        let scales = &b[4..16];
        let qh = &b[16..48];
        for (c, yc) in y.chunks_exact_mut(64).enumerate() {
            let ql = &b[48 + 32 * c..48 + 32 * (c + 1)];
            let (sc1, m1) = scale_min_k4(2 * c, scales);
            let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
            for l in 0..32 {
                let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                yc[l] = d1 * ((ql[l] & 0x0f) + h1) as f32 - m1;
                yc[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
            }
        }
    }
}

/// `block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; half d; }` (210 bytes). Sixteen
/// sub-blocks of 16 with signed 8-bit scales; 6-bit values stored + 32.
/// x = (d * sc) * (q - 32).
pub(crate) fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(210).zip(dst.chunks_exact_mut(QK_K)) {
        let d = half_at(b, 208);
        for (n, yn) in y.chunks_exact_mut(128).enumerate() {
            let ql = &b[64 * n..64 * (n + 1)];
            let qh = &b[128 + 32 * n..128 + 32 * (n + 1)];
            let sc = &b[192 + 8 * n..192 + 8 * (n + 1)];
            let s = |k: usize| (sc[k] as i8) as f32;
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                yn[l] = d * s(is) * q1 as f32;
                yn[l + 32] = d * s(is + 2) * q2 as f32;
                yn[l + 64] = d * s(is + 4) * q3 as f32;
                yn[l + 96] = d * s(is + 6) * q4 as f32;
            }
        }
    }
}

/// `block_q8_K { float d; i8 qs[256]; i16 bsums[16]; }` (292 bytes). x = d * q; `bsums` (sums
/// of 16 consecutive q) are a cache for dot products and play no part in the values.
pub(crate) fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(292).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for (yj, &q) in y.iter_mut().zip(&b[4..260]) {
            *yj = d * (q as i8) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::float::f32_to_f16_bits;

    fn put_half(b: &mut [u8], off: usize, v: f32) {
        b[off..off + 2].copy_from_slice(&f32_to_f16_bits(v).to_le_bytes());
    }

    #[test]
    fn scale_min_k4_unpacks_all_eight_sub_blocks() {
        // Pack scales 0..8 -> 10 + j*7 and mins 0..8 -> 60 - j*5 (all < 64) the way ggml's
        // quantizer does, then read them back.
        let sc: Vec<u8> = (0..8).map(|j| 10 + j * 7).collect();
        let mn: Vec<u8> = (0..8).map(|j| 60 - j * 5).collect();
        let mut q = [0u8; 12];
        for j in 0..8 {
            if j < 4 {
                q[j] = sc[j];
                q[j + 4] = mn[j];
            } else {
                q[j + 4] = (sc[j] & 0x0f) | ((mn[j] & 0x0f) << 4);
                q[j - 4] |= (sc[j] >> 4) << 6;
                q[j] |= (mn[j] >> 4) << 6;
            }
        }
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &q), (sc[j], mn[j]), "sub-block {j}");
        }
    }

    #[test]
    fn q6_k_constant_block() {
        // Every 6-bit value 33 (q - 32 = 1), every scale 3, d = 0.5: every element is 1.5.
        let mut b = [0u8; 210];
        for v in &mut b[0..128] {
            *v = 0x11; // low and high nibbles 1
        }
        for v in &mut b[128..192] {
            *v = 0b1010_1010; // each 2-bit field 2 -> bit 5 set: 1 | 32 = 33
        }
        for v in &mut b[192..208] {
            *v = 3;
        }
        put_half(&mut b, 208, 0.5);
        let mut y = [0f32; QK_K];
        dequantize_q6_k(&b, &mut y);
        assert!(y.iter().all(|v| *v == 1.5), "{y:?}");
    }

    #[test]
    fn q3_k_high_bit_clear_subtracts_four() {
        // All low bits 0, all high bits clear -> q = -4; all scales stored 33 -> sc = 1; d = 1.
        let mut b = [0u8; 110];
        // scale 33 = 0b10_0001: low nibble 1 in all 16 nibbles, top bits 2 in all 16 fields.
        for v in &mut b[96..104] {
            *v = 0x11;
        }
        for v in &mut b[104..108] {
            *v = 0b1010_1010;
        }
        put_half(&mut b, 108, 1.0);
        let mut y = [0f32; QK_K];
        dequantize_q3_k(&b, &mut y);
        assert!(y.iter().all(|v| *v == -4.0));
        for v in &mut b[0..32] {
            *v = 0xff; // high bits set -> q = 0
        }
        dequantize_q3_k(&b, &mut y);
        assert!(y.iter().all(|v| *v == 0.0));
    }
}
