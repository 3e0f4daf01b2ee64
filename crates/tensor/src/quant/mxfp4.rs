//! MXFP4 (the OCP Microscaling format's FP4: E2M1 values sharing one E8M0 scale per 32), in
//! ggml's `block_mxfp4 { u8 e; u8 qs[16]; }` (17 bytes, GGML_TYPE_MXFP4): element `j < 16` is
//! the low nibble of `qs[j]`, element `j + 16` its high nibble (Q4_0's order), and
//! `x = kvalues_mxfp4[code] * 2^(e - 128)`, the table holding the E2M1 values doubled as
//! integers (so code 8, E2M1's -0, gives +0 as ggml's int8 table does).
//!
//! Also the layout of Hugging Face checkpoints (gpt-oss's `*_blocks (…, C/32, 16)` and
//! `*_scales (…, C/32)`, as transformers' `convert_moe_packed_tensors` reads them: element `2i`
//! is the low nibble of byte `i`, element `2i + 1` its high nibble, scale `2^(s - 127)`):
//! [`from_hf_blocks`] repacks it into ggml's blocks without changing a value.
//!
//! Quantizing (ggml's `quantize_row_mxfp4_ref`, through `quant::quantize`): per block of 32
//! values one E8M0 scale byte `e = floor(log2(amax)) - 2 + 127` (amax the block's largest
//! magnitude, 0 for an all-zero block), so the largest E2M1 magnitude 6 covers it, then each
//! value's code the nearest of `KVALUES[i] · 2^(e - 128)` (ties to the lower code, so ±0 give
//! code 0). ggml ignores importance weights for MXFP4, and so does this. Where ggml's
//! `(uint8_t)` cast of the exponent is undefined (amax below 2^-125, or non-finite values), hf2q
//! defines it: the scale byte is 0 for such tiny blocks, and non-finite values are refused.

use crate::{Error, Result};

/// Values per block.
pub const QK_MXFP4: usize = 32;
/// Bytes per block.
pub const BLOCK_BYTES: usize = 17;

/// ggml's `kvalues_mxfp4`: E2M1 code -> twice its value.
const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `2^(e - 128)` as f32, exactly (ggml's `GGML_E8M0_TO_FP32_HALF`): subnormal for `e < 2`.
fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// ggml's `dequantize_row_mxfp4`: whole blocks on both sides (checked by the caller).
pub(crate) fn dequantize_mxfp4(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(QK_MXFP4))
    {
        let d = e8m0_half(b[0]);
        for (j, &q) in b[1..].iter().enumerate() {
            y[j] = KVALUES[(q & 0x0f) as usize] as f32 * d;
            y[j + QK_MXFP4 / 2] = KVALUES[(q >> 4) as usize] as f32 * d;
        }
    }
}

/// ggml's `best_index_mxfp4`: the first code whose value under `d` is nearest `x`.
fn best_index(x: f32, d: f32) -> u8 {
    let mut best = 0;
    let mut best_err = (KVALUES[0] as f32 * d - x).abs();
    for (i, &v) in KVALUES.iter().enumerate().skip(1) {
        let err = (v as f32 * d - x).abs();
        if err < best_err {
            best = i;
            best_err = err;
        }
    }
    best as u8
}

/// ggml's `quantize_row_mxfp4_ref` (see the module header): whole blocks on both sides (checked
/// by the caller); non-finite values are refused.
pub(crate) fn quantize_mxfp4(x: &[f32], dst: &mut [u8]) -> Result<()> {
    if let Some(bad) = x.iter().find(|v| !v.is_finite()) {
        return Err(Error::Msg(format!("MXFP4: cannot quantize {bad}")));
    }
    for (xb, y) in x
        .chunks_exact(QK_MXFP4)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
    {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        // f32 arithmetic as ggml's `floorf(log2f(amax)) - 2 + 127`; `as` saturates below 0.
        let e = if amax > 0.0 {
            (amax.log2().floor() - 2.0 + 127.0) as u8
        } else {
            0
        };
        let d = e8m0_half(e);
        y[0] = e;
        for j in 0..QK_MXFP4 / 2 {
            y[1 + j] = best_index(xb[j], d) | (best_index(xb[j + QK_MXFP4 / 2], d) << 4);
        }
    }
    Ok(())
}

/// ggml MXFP4 blocks from a Hugging Face checkpoint's `blocks` (16 bytes per 32 values, two
/// codes a byte, low nibble first) and `scales` (one E8M0 byte per 32 values), in the same
/// order (`blocks.len() == 16 * scales.len()`).
pub fn from_hf_blocks(blocks: &[u8], scales: &[u8]) -> Result<Vec<u8>> {
    if blocks.len() != scales.len() * 16 {
        return Err(Error::Shape(format!(
            "MXFP4: {} bytes of codes for {} scales ({} expected)",
            blocks.len(),
            scales.len(),
            scales.len() * 16
        )));
    }
    let mut out = Vec::with_capacity(scales.len() * BLOCK_BYTES);
    for (hf, &e) in blocks.chunks_exact(16).zip(scales) {
        // Element i of the block: nibble (i & 1) of byte i / 2.
        let code = |i: usize| (hf[i / 2] >> (4 * (i & 1))) & 0x0f;
        out.push(e);
        out.extend((0..16).map(|j| code(j) | (code(j + 16) << 4)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of an E2M1 code from its bits (OCP MX v1.0: sign, two exponent bits with bias
    /// 1, one mantissa bit; exponent 0 is subnormal), independent of the table above.
    fn e2m1(code: u8) -> f64 {
        let sign = if code & 8 != 0 { -1.0 } else { 1.0 };
        let (exp, man) = ((code >> 1) & 3, code & 1);
        let mag = if exp == 0 {
            man as f64 * 0.5
        } else {
            (1.0 + man as f64 * 0.5) * 2f64.powi(exp as i32 - 1)
        };
        sign * mag
    }

    /// ggml's value of `code` under scale `e`: `e2m1 · 2^(e - 127)` rounded once to f32 (exact,
    /// or overflowing to ±inf for e = 255 and |value| > 0.5), with E2M1's -0 read as +0.
    fn expected(code: u8, e: u8) -> f32 {
        let v = e2m1(code) * 2f64.powi(e as i32 - 127);
        if v == 0.0 {
            0.0
        } else {
            v as f32
        }
    }

    #[test]
    fn every_code_under_every_scale_is_exact() {
        // One block per scale byte, its 32 elements cycling through the 16 codes twice (low
        // and high nibbles each see every code).
        let mut src = Vec::new();
        for e in 0..=255u8 {
            src.push(e);
            src.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        }
        let mut dst = vec![f32::NAN; 256 * QK_MXFP4];
        crate::quant::dequantize(crate::GgmlType::MXFP4, &src, &mut dst).unwrap();
        let mut checked = 0;
        for (e, y) in dst.chunks_exact(QK_MXFP4).enumerate() {
            for j in 0..16u8 {
                for (pos, code) in [(j as usize, j), (j as usize + 16, 15 - j)] {
                    let want = expected(code, e as u8);
                    assert_eq!(
                        y[pos].to_bits(),
                        want.to_bits(),
                        "scale {e}, code {code}: {} vs {want}",
                        y[pos]
                    );
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 256 * 32);
        // Spot values: 2^-127 · 0.5 (subnormal), 6 · 2^0, and the overflow of 6 · 2^128.
        assert_eq!(expected(1, 0), f32::from_bits(1 << 21));
        assert_eq!(expected(7, 127), 6.0);
        assert_eq!(expected(7, 255), f32::INFINITY);
        assert_eq!(expected(15, 255), f32::NEG_INFINITY);
    }

    #[test]
    fn hugging_face_blocks_repack_without_changing_a_value() {
        // Two blocks of every byte value, as transformers reads them: element 2i = low nibble
        // of byte i, 2i + 1 = high nibble, times 2^(s - 127).
        let blocks: Vec<u8> = (0..32u8)
            .map(|i| i.wrapping_mul(37).wrapping_add(11))
            .collect();
        let scales = [120u8, 131];
        let ggml = from_hf_blocks(&blocks, &scales).unwrap();
        assert_eq!(ggml.len(), 2 * BLOCK_BYTES);
        let mut got = vec![0f32; 64];
        dequantize_mxfp4(&ggml, &mut got);
        for (b, &s) in scales.iter().enumerate() {
            for i in 0..32 {
                let byte = blocks[b * 16 + i / 2];
                let code = if i % 2 == 0 { byte & 15 } else { byte >> 4 };
                assert_eq!(got[b * 32 + i], expected(code, s), "block {b} element {i}");
            }
        }
        assert!(from_hf_blocks(&blocks[..31], &scales).is_err());
    }

    fn quant(x: &[f32]) -> Result<Vec<u8>> {
        let mut q = vec![0u8; x.len() / QK_MXFP4 * BLOCK_BYTES];
        crate::quant::quantize(crate::GgmlType::MXFP4, x, &mut q)?;
        Ok(q)
    }

    fn dequant(q: &[u8]) -> Vec<f32> {
        let mut y = vec![0f32; q.len() / BLOCK_BYTES * QK_MXFP4];
        crate::quant::dequantize(crate::GgmlType::MXFP4, q, &mut y).unwrap();
        y
    }

    /// E2M1 magnitudes (OCP MX v1.0), written out independently of any table.
    const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

    /// ggml's formula written out in f64 for one value: the scale `2^(floor(log2 amax) - 2)`,
    /// the nearest signed E2M1 multiple of it (the first on a tie, positive codes first).
    fn ggml_value(x: f64, amax: f64) -> f64 {
        if amax == 0.0 {
            return 0.0;
        }
        let s = 2f64.powi(amax.log2().floor() as i32 - 2);
        let cands = E2M1
            .iter()
            .map(|&m| m as f64)
            .chain(E2M1.iter().map(|&m| -(m as f64)));
        let mut best = (f64::INFINITY, 0.0);
        for c in cands {
            let err = (c * s - x).abs();
            if err < best.0 {
                best = (err, c * s);
            }
        }
        best.1
    }

    /// Crafted blocks: every E2M1 magnitude and its midpoints (ties), both signs, under scales
    /// from tiny to large, a zero block, and a block whose amax is not a grid value; dequant of
    /// the quantized block equals ggml's formula value for value.
    #[test]
    fn dequant_of_quant_matches_ggml_formula() {
        let mut blocks: Vec<Vec<f32>> = Vec::new();
        for scale_pow in [-20, -3, 0, 1, 7, 30] {
            let s = 2f32.powi(scale_pow);
            let mut b: Vec<f32> = Vec::new();
            for w in E2M1.windows(2) {
                b.push(w[0] * s);
                b.push((w[0] + w[1]) / 2.0 * s); // a tie between two codes
            }
            b.push(6.0 * s);
            b.push(-6.0 * s);
            while b.len() < QK_MXFP4 {
                let i = b.len();
                b.push(-b[i % 15]);
            }
            blocks.push(b);
        }
        blocks.push(vec![0.0; QK_MXFP4]);
        blocks.push((0..QK_MXFP4).map(|i| (i as f32 - 13.3) * 0.071).collect());
        let x: Vec<f32> = blocks.concat();
        let y = dequant(&quant(&x).unwrap());
        for (xb, yb) in x.chunks(QK_MXFP4).zip(y.chunks(QK_MXFP4)) {
            let amax = xb.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
            for (&a, &b) in xb.iter().zip(yb) {
                assert_eq!(
                    b as f64,
                    ggml_value(a as f64, amax),
                    "{a} in block of amax {amax}"
                );
            }
        }
    }

    /// Every code under a spread of scales: a block decoded then quantized again gives the same
    /// values (E2M1's -0 comes back as +0, code 0, as ggml reads both as 0).
    #[test]
    fn every_code_round_trips() {
        for e in [1u8, 20, 100, 127, 128, 129, 200, 250] {
            // Codes 0..16 twice, so 7 or 15 (±6, the largest) fixes the block's scale.
            let mut block = vec![e];
            block.extend((0..16u8).map(|j| j | (((j + 5) % 16) << 4)));
            let x = dequant(&block);
            let q = quant(&x).unwrap();
            assert_eq!(q[0], e, "scale {e}");
            let zero_neg = |c: u8| if c == 8 { 0 } else { c };
            for j in 0..16 {
                assert_eq!(
                    q[1 + j] & 0xf,
                    zero_neg(block[1 + j] & 0xf),
                    "scale {e} code {j}"
                );
                assert_eq!(
                    q[1 + j] >> 4,
                    zero_neg(block[1 + j] >> 4),
                    "scale {e} code {j}"
                );
            }
            assert_eq!(dequant(&q), x);
        }
    }

    #[test]
    fn bad_input_is_refused() {
        let mut q = vec![0u8; BLOCK_BYTES];
        let quantize =
            |x: &[f32], q: &mut [u8]| crate::quant::quantize(crate::GgmlType::MXFP4, x, q);
        assert!(quantize(&[0.0; 31], &mut q).is_err());
        let mut x = vec![0.0; 32];
        x[3] = f32::NAN;
        assert!(quantize(&x, &mut q).is_err());
        x[3] = 1e-40; // subnormal amax: scale byte 0, values 0
        quantize(&x, &mut q).unwrap();
        assert_eq!(q[0], 0);
    }
}
