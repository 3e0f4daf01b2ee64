//! MLX affine quantization (mlx `mx.quantize` layout). STUB: owned by the quant work item.

use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AffineParams {
    /// 2, 3, 4, 5, 6 or 8.
    pub bits: u32,
    /// 32, 64 or 128.
    pub group_size: usize,
}

/// Dequantizes one row: `packed` is the row's packed uint32 words as little-endian bytes
/// (`dst.len() * bits / 8` bytes), `scales`/`biases` one value per group (`dst.len() / group_size`).
/// Element = scale * q + bias.
pub fn dequantize_affine(p: AffineParams, packed: &[u8], scales: &[f32], biases: &[f32], dst: &mut [f32]) -> Result<()> {
    let _ = (p, packed, scales, biases, dst);
    Err(Error::Msg("MLX affine dequantization not implemented yet".into()))
}
