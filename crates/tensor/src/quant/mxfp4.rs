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
//! Not here: quantizing to MXFP4.

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
}
