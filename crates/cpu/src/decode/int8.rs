//! What the grouped kernels of [`super::x512`] and [`super::x256`] read: blocks of 8-bit parts.

use std::arch::x86_64::*;

use hf2q_tensor::kv::{BlockAffine, BlockQ8_0, KvBlock, Q8_0_VALUES};

/// A block whose 32-value parts are 32 bytes of 8-bit integers `x`, signed (ggml's Q8_0) or
/// unsigned (mlx-lm's 8-bit affine groups), value `x * d + m` with an f16 scale `d` and
/// (`KvBlock::HAS_MIN`) an f16 bias `m`.
pub(crate) trait Int8Parts: KvBlock {
    const SIGNED: bool;
    /// Part `sub`'s scale and bias as f16 bits (bias 0 without one) and its 32 integers.
    fn part(&self, sub: usize) -> (u16, u16, *const u8);
}

impl Int8Parts for BlockQ8_0 {
    const SIGNED: bool = true;
    #[inline(always)]
    fn part(&self, _sub: usize) -> (u16, u16, *const u8) {
        (self.d.to_bits(), 0, self.qs.as_ptr() as *const u8)
    }
}

impl<const N: usize> Int8Parts for BlockAffine<8, N> {
    const SIGNED: bool = false;
    #[inline(always)]
    fn part(&self, sub: usize) -> (u16, u16, *const u8) {
        let qs = &self.qs[sub * Q8_0_VALUES..(sub + 1) * Q8_0_VALUES];
        (self.scale.to_bits(), self.bias.to_bits(), qs.as_ptr())
    }
}

/// The f32 value of f16 bits (F16C).
///
/// # Safety
/// The CPU must have F16C.
#[inline]
#[target_feature(enable = "f16c")]
pub(crate) unsafe fn f16x(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}
