//! Block formats: scalar reference dequantization with ggml's exact byte layouts, and MLX affine.
//!
//! OWNED BY THE QUANT WORK ITEM: replace the stubs below. Public API (keep it):
//! - `dequantize(ty, src, dst)`: `src` holds exactly `ty.row_bytes(dst.len())` bytes.
//! - `mlx::dequantize_affine(params, packed, scales, biases, dst)`.

pub mod mlx;

use crate::{Error, GgmlType, Result};

/// Dequantizes `dst.len()` elements of type `ty` from `src` (exactly `ty.row_bytes(dst.len())`).
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let need = ty.row_bytes(dst.len()).ok_or_else(|| {
        Error::Shape(format!("{} elements is not a whole number of {} blocks", dst.len(), ty))
    })?;
    if src.len() != need {
        return Err(Error::Shape(format!("{} bytes given, {} needed for {} {} elements", src.len(), need, dst.len(), ty)));
    }
    match ty {
        GgmlType::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            Ok(())
        }
        GgmlType::F16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
            Ok(())
        }
        GgmlType::BF16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
            Ok(())
        }
        other => Err(Error::UnsupportedType { ty: other.to_string(), tensor: String::new() }),
    }
}
