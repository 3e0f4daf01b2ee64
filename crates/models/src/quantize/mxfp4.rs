//! Quantizing to MXFP4 as ggml's `quantize_row_mxfp4_ref` does (the format itself, and its
//! decoding, are `hf2q_tensor::quant::mxfp4`): per block of 32 values one E8M0 scale byte
//! `e = floor(log2(amax)) - 2 + 127` (amax the block's largest magnitude, 0 for an all-zero
//! block), so the largest E2M1 magnitude 6 covers it, then each value's code the nearest of
//! `kvalues_mxfp4[i] · 2^(e - 128)` (the doubled E2M1 table under half the scale; ties to the
//! lower code, so ±0 give code 0). ggml ignores importance weights for MXFP4, and so does this.
//!
//! Where ggml's `(uint8_t)` cast of the exponent is undefined (amax below 2^-125, or non-finite
//! values), hf2q defines it: the scale byte is 0 for such tiny blocks, and non-finite values are
//! refused.

use hf2q_tensor::quant::mxfp4::{BLOCK_BYTES, QK_MXFP4};
use hf2q_tensor::GgmlType;

use crate::{Error, Result};

/// `kvalues_mxfp4` as f32: the decoder's values of codes 0..16 under the unit scale (e = 128),
/// so the table is the one ggml and hf2q decode with, not a second copy.
fn kvalues() -> Result<[f32; 16]> {
    let mut block = [0u8; BLOCK_BYTES];
    block[0] = 128;
    for (j, b) in block[1..].iter_mut().enumerate() {
        *b = j as u8;
    }
    let mut v = [0f32; QK_MXFP4];
    hf2q_tensor::quant::dequantize(GgmlType::MXFP4, &block, &mut v)?;
    let mut k = [0f32; 16];
    k.copy_from_slice(&v[..16]);
    Ok(k)
}

/// `2^(e - 128)` (ggml's `GGML_E8M0_TO_FP32_HALF`), read back through the decoder too: code 1
/// is E2M1's 0.5, doubled 1 in the table, so its decoded value under scale `e` is exactly
/// `2^(e - 128)`.
fn e8m0_half(e: u8) -> Result<f32> {
    let mut block = [0u8; BLOCK_BYTES];
    block[0] = e;
    block[1] = 1;
    let mut v = [0f32; QK_MXFP4];
    hf2q_tensor::quant::dequantize(GgmlType::MXFP4, &block, &mut v)?;
    Ok(v[0])
}

/// The code values and the 256 scales, read from the decoder once per process (quantizing
/// calls this for every chunk of rows).
fn tables() -> Result<&'static ([f32; 16], [f32; 256])> {
    static TABLES: std::sync::OnceLock<([f32; 16], [f32; 256])> = std::sync::OnceLock::new();
    if let Some(t) = TABLES.get() {
        return Ok(t);
    }
    let k = kvalues()?;
    let mut scales = [0f32; 256];
    for (e, s) in scales.iter_mut().enumerate() {
        *s = e8m0_half(e as u8)?;
    }
    Ok(TABLES.get_or_init(|| (k, scales)))
}

/// ggml's `best_index_mxfp4`: the first code whose value under `d` is nearest `x`.
fn best_index(k: &[f32; 16], x: f32, d: f32) -> u8 {
    let mut best = 0;
    let mut best_err = (k[0] * d - x).abs();
    for (i, &v) in k.iter().enumerate().skip(1) {
        let err = (v * d - x).abs();
        if err < best_err {
            best = i;
            best_err = err;
        }
    }
    best as u8
}

/// Quantizes `x` (whole blocks of 32) into ggml MXFP4 blocks in `dst` (17 bytes per block).
pub fn quantize_mxfp4(x: &[f32], dst: &mut [u8]) -> Result<()> {
    let nb = x.len() / QK_MXFP4;
    if !x.len().is_multiple_of(QK_MXFP4) || dst.len() != nb * BLOCK_BYTES {
        return Err(Error::Msg(format!(
            "MXFP4: {} values into {} bytes (whole blocks of {QK_MXFP4} values, {BLOCK_BYTES} \
             bytes each)",
            x.len(),
            dst.len()
        )));
    }
    if let Some(bad) = x.iter().find(|v| !v.is_finite()) {
        return Err(Error::Msg(format!("MXFP4: cannot quantize {bad}")));
    }
    let (k, scales) = tables()?;
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
        let d = scales[e as usize];
        y[0] = e;
        for j in 0..QK_MXFP4 / 2 {
            y[1 + j] = best_index(k, xb[j], d) | (best_index(k, xb[j + QK_MXFP4 / 2], d) << 4);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dequant(q: &[u8]) -> Vec<f32> {
        let mut y = vec![0f32; q.len() / BLOCK_BYTES * QK_MXFP4];
        hf2q_tensor::quant::dequantize(GgmlType::MXFP4, q, &mut y).unwrap();
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
        let mut q = vec![0u8; x.len() / QK_MXFP4 * BLOCK_BYTES];
        quantize_mxfp4(&x, &mut q).unwrap();
        let y = dequant(&q);
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
            let mut q = vec![0u8; BLOCK_BYTES];
            quantize_mxfp4(&x, &mut q).unwrap();
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
        assert!(quantize_mxfp4(&[0.0; 31], &mut q).is_err());
        let mut x = vec![0.0; 32];
        x[3] = f32::NAN;
        assert!(quantize_mxfp4(&x, &mut q).is_err());
        x[3] = 1e-40; // subnormal amax: scale byte 0, values 0
        quantize_mxfp4(&x, &mut q).unwrap();
        assert_eq!(q[0], 0);
    }
}
