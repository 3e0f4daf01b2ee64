//! Plain float element types: F32, F16, BF16 (one element per "block").
//!
//! Follows ggml: `ggml_fp32_to_fp16_row` (IEEE half, round to nearest even) and
//! `ggml_compute_fp32_to_bf16` in `ggml-impl.h` (round to nearest even on the top 16 bits, NaN
//! forced quiet by setting bit 6 of the kept half). gguf-py's `BF16.quantize_blocks` is the same
//! rule written in numpy; the fixtures under `tests/fixtures/quant/` hold its output.
//!
//! Not here: any scaling or blocking (see `legacy.rs` and `kquants.rs`).

/// f32 -> IEEE half bits, round to nearest even, overflow to +-inf. NaN stays NaN (quiet); its
/// payload follows the x86 F16C instruction ggml uses on this platform (top mantissa bits kept).
#[inline]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

#[inline]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

/// f32 -> bfloat16 bits exactly as `ggml_compute_fp32_to_bf16`: NaN keeps its top half with the
/// quiet bit forced; everything else rounds to nearest even (so large finite values may round to
/// inf, as in ggml). Subnormals are kept, not flushed.
#[inline]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    // Cannot overflow: the largest non-NaN pattern is 0xff80_0000 (-inf).
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

#[inline]
pub fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `src.len() == 4 * dst.len()` (checked by the caller).
pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// `src.len() == 2 * dst.len()` (checked by the caller).
pub(crate) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16_bits_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

/// `src.len() == 2 * dst.len()` (checked by the caller).
pub(crate) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

/// `dst.len() == 4 * src.len()` (checked by the caller).
pub(crate) fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (x, c) in src.iter().zip(dst.chunks_exact_mut(4)) {
        c.copy_from_slice(&x.to_le_bytes());
    }
}

/// `dst.len() == 2 * src.len()` (checked by the caller).
pub(crate) fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (x, c) in src.iter().zip(dst.chunks_exact_mut(2)) {
        c.copy_from_slice(&f32_to_f16_bits(*x).to_le_bytes());
    }
}

/// `dst.len() == 2 * src.len()` (checked by the caller).
pub(crate) fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (x, c) in src.iter().zip(dst.chunks_exact_mut(2)) {
        c.copy_from_slice(&f32_to_bf16_bits(*x).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_quiets_nan() {
        // Exactly halfway between two bf16 values: ties go to the even one.
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f80_8001)), 0x3f81);
        // Signalling NaN 0x7f80_0001 becomes a quiet NaN.
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x7f80_0001)), 0x7fc0);
        assert_eq!(f32_to_bf16_bits(f32::INFINITY), 0x7f80);
        assert_eq!(f32_to_bf16_bits(f32::MAX), 0x7f80); // rounds up to inf, as ggml does
                                                        // A subnormal is kept (no flush to zero).
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x0001_0000)), 0x0001);
    }

    #[test]
    fn round_trip_error_is_within_half_an_ulp() {
        // Relative error of round-to-nearest: 2^-11 for half (10 mantissa bits + 1), 2^-8 for
        // bfloat16 (7 + 1), for values in the normal range of each format.
        let mut x = 1.0e-3f32;
        while x < 6.0e4 {
            for v in [x, -x] {
                let h = f16_bits_to_f32(f32_to_f16_bits(v));
                assert!((h - v).abs() <= v.abs() * 2f32.powi(-11), "f16 {v} -> {h}");
                let b = bf16_bits_to_f32(f32_to_bf16_bits(v));
                assert!((b - v).abs() <= v.abs() * 2f32.powi(-8), "bf16 {v} -> {b}");
            }
            x *= 1.0137;
        }
    }
}
