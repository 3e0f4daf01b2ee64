//! Block formats: scalar reference dequantization and quantization with ggml's exact byte
//! layouts, and MLX affine quantization.
//!
//! This is the slow, obvious reference every fast path (SIMD, CUDA) is held to. It follows
//! ggml's `ggml-common.h` block structs and the scalar `dequantize_row_*` / `quantize_row_*_ref`
//! functions of `ggml-quants.c`, float operation for float operation; the contract tests in
//! `tests/quant_ggml.rs` hold it to gguf-py's numpy implementation bit for bit.
//!
//! - [`float`]: F32, F16, BF16.
//! - [`legacy`]: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 (32-element blocks).
//! - [`kquants`]: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K (256-element super-blocks).
//! - [`mlx`]: MLX affine (`mx.quantize` / `mx.dequantize`), 2..8 bits.
//! - [`mxfp4`]: MXFP4 (E2M1 codes, an E8M0 scale per 32): ggml's dequantization and reference
//!   quantizer, and the Hugging Face checkpoints' packing of it.
//! - [`kquant_quantize`]: the k-quant quantizers (ggml's `quantize_row_q*_K_ref` and their
//!   importance-weighted variants).
//!
//! Not here: the IQ* and TQ* families (named in [`GgmlType`] so files holding them can be
//! inspected, but [`Error::UnsupportedType`] here).

pub mod float;
pub mod kquant_quantize;
pub mod kquants;
pub mod legacy;
pub mod mlx;
pub mod mxfp4;

use crate::{Error, GgmlType, Result};

fn unsupported(ty: GgmlType) -> Error {
    Error::UnsupportedType {
        ty: ty.to_string(),
        tensor: String::new(),
    }
}

/// Bytes for `n` elements of `ty`, or a shape error naming the problem.
fn bytes_for(ty: GgmlType, n: usize) -> Result<usize> {
    ty.row_bytes(n).ok_or_else(|| {
        Error::Shape(format!(
            "{n} elements is not a whole number of {ty} blocks ({} each)",
            ty.block_size()
        ))
    })
}

/// Dequantizes `dst.len()` elements of type `ty` from `src` (exactly `ty.row_bytes(dst.len())`
/// bytes). Results are bit-identical to ggml's scalar `dequantize_row_*`.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let need = bytes_for(ty, dst.len())?;
    if src.len() != need {
        return Err(Error::Shape(format!(
            "{} bytes given, {} needed for {} {} elements",
            src.len(),
            need,
            dst.len(),
            ty
        )));
    }
    // From here on every function below gets whole blocks on both sides.
    match ty {
        GgmlType::F32 => float::dequantize_f32(src, dst),
        GgmlType::F16 => float::dequantize_f16(src, dst),
        GgmlType::BF16 => float::dequantize_bf16(src, dst),
        GgmlType::Q4_0 => legacy::dequantize_q4_0(src, dst),
        GgmlType::Q4_1 => legacy::dequantize_q4_1(src, dst),
        GgmlType::Q5_0 => legacy::dequantize_q5_0(src, dst),
        GgmlType::Q5_1 => legacy::dequantize_q5_1(src, dst),
        GgmlType::Q8_0 => legacy::dequantize_q8_0(src, dst),
        GgmlType::Q8_1 => legacy::dequantize_q8_1(src, dst),
        GgmlType::Q2_K => kquants::dequantize_q2_k(src, dst),
        GgmlType::Q3_K => kquants::dequantize_q3_k(src, dst),
        GgmlType::Q4_K => kquants::dequantize_q4_k(src, dst),
        GgmlType::Q5_K => kquants::dequantize_q5_k(src, dst),
        GgmlType::Q6_K => kquants::dequantize_q6_k(src, dst),
        GgmlType::Q8_K => kquants::dequantize_q8_k(src, dst),
        GgmlType::MXFP4 => mxfp4::dequantize_mxfp4(src, dst),
        other => return Err(unsupported(other)),
    }
    Ok(())
}

/// Whether [`quantize`] can produce `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::Q8_K
            | GgmlType::MXFP4
    )
}

/// Quantizes `src` into `dst` (exactly `ty.row_bytes(src.len())` bytes), byte for byte as
/// ggml's `quantize_row_*_ref` (and gguf-py's `quants.quantize`; k-quants in
/// [`kquant_quantize`], which also has the importance-weighted variants). Types without a quantizer
/// here (see [`can_quantize`]) give [`Error::UnsupportedType`].
///
/// NaN or infinite input gives garbage blocks, as in ggml; only F16/BF16 carry NaN through, and
/// MXFP4 refuses it (ggml's cast of its exponent is undefined there).
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    if !can_quantize(ty) {
        return Err(unsupported(ty));
    }
    let need = bytes_for(ty, src.len())?;
    if dst.len() != need {
        return Err(Error::Shape(format!(
            "{} bytes of room given, {} needed for {} {} elements",
            dst.len(),
            need,
            src.len(),
            ty
        )));
    }
    match ty {
        GgmlType::F32 => float::quantize_f32(src, dst),
        GgmlType::F16 => float::quantize_f16(src, dst),
        GgmlType::BF16 => float::quantize_bf16(src, dst),
        GgmlType::Q4_0 => legacy::quantize_q4_0(src, dst),
        GgmlType::Q4_1 => legacy::quantize_q4_1(src, dst),
        GgmlType::Q5_0 => legacy::quantize_q5_0(src, dst),
        GgmlType::Q5_1 => legacy::quantize_q5_1(src, dst),
        GgmlType::Q8_0 => legacy::quantize_q8_0(src, dst),
        GgmlType::Q2_K => kquant_quantize::quantize_q2_k(src, dst),
        GgmlType::Q3_K => kquant_quantize::quantize_q3_k(src, dst),
        GgmlType::Q4_K => kquant_quantize::quantize_q4_k(src, dst),
        GgmlType::Q5_K => kquant_quantize::quantize_q5_k(src, dst),
        GgmlType::Q6_K => kquant_quantize::quantize_q6_k(src, dst),
        GgmlType::Q8_K => kquant_quantize::quantize_q8_k(src, dst),
        GgmlType::MXFP4 => mxfp4::quantize_mxfp4(src, dst)?,
        other => return Err(unsupported(other)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_are_checked_not_trusted() {
        let mut dst = vec![0f32; 32];
        // One byte short, one byte over, not a whole block.
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0u8; 17], &mut dst),
            Err(Error::Shape(_))
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0u8; 19], &mut dst),
            Err(Error::Shape(_))
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_K, &[0u8; 144], &mut dst),
            Err(Error::Shape(_))
        ));
        let mut q = vec![0u8; 33];
        assert!(matches!(
            quantize(GgmlType::Q8_0, &dst, &mut q),
            Err(Error::Shape(_))
        ));
        assert!(matches!(
            quantize(GgmlType::Q8_0, &dst[..31], &mut q),
            Err(Error::Shape(_))
        ));
        // Empty rows are fine.
        assert!(dequantize(GgmlType::Q6_K, &[], &mut []).is_ok());
        assert!(quantize(GgmlType::Q4_1, &[], &mut []).is_ok());
    }

    #[test]
    fn unsupported_types_say_so() {
        for ty in GgmlType::all() {
            let n = ty.block_size();
            let src = vec![0u8; ty.type_size()];
            let mut dst = vec![0f32; n];
            let r = dequantize(ty, &src, &mut dst);
            let known = ty.is_supported() || ty == GgmlType::Q8_1;
            assert_eq!(r.is_ok(), known, "{ty}: {r:?}");
            if !known {
                assert!(matches!(r, Err(Error::UnsupportedType { .. })));
            }
            let mut q = vec![0u8; ty.type_size()];
            let r = quantize(ty, &vec![0f32; n], &mut q);
            assert_eq!(r.is_ok(), can_quantize(ty), "{ty}: {r:?}");
        }
    }

    #[test]
    fn every_supported_type_dequantizes_all_zero_bytes_to_zero() {
        // All-zero bytes mean zero scales: every format's value is then exactly zero, except Q3_K
        // whose q - 4 times a zero scale is still zero.
        for ty in GgmlType::all().filter(|t| t.is_supported()) {
            let n = ty.block_size() * 2;
            let src = vec![0u8; ty.type_size() * 2];
            let mut dst = vec![1f32; n];
            dequantize(ty, &src, &mut dst).unwrap();
            assert!(dst.iter().all(|v| *v == 0.0), "{ty}");
        }
    }
}
