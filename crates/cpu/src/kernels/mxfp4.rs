//! MXFP4 (ggml's `block_mxfp4 { u8 e; u8 qs[16]; }`, GGML_TYPE_MXFP4) in the integer engines'
//! form `weight = a * u + c` (`unpack.rs`): the E2M1 code's value doubled (`kvalues_mxfp4`,
//! -12..12, not evenly spaced) shifted to an unsigned code `u = kvalue - kmin` (0..24), with
//! `a = 2^(e - 128)` (ggml's `GGML_E8M0_TO_FP32_HALF`) and `c = kmin * a`. So
//! `Σ w * x = Σ_b a_b * dx_b * (Σ u * q + kmin * Σ q)`: the same integer dot of the activation's
//! 8-bit block as ggml's `ggml_vec_dot_mxfp4_q8_0` (a table lookup per code, scaled by the
//! block's E8M0 half-scale times the activation's scale), with the signed table moved to the
//! offset that every format here carries. `u <= 24`, so the codes are never "wide".
//!
//! The tables are read from the decoder (`hf2q_tensor::quant::mxfp4`) once per process, so the
//! values the kernels compute with are the reference dequantizer's, not a second copy.
//!
//! Here: the tables, one row's decode for the generic engines, and (x86) the vector pieces the
//! fused one-token kernel and the GEMM panels use (the code lookup, the scales of 16 blocks).
//! Not here: the engines themselves (`fused_x86.rs`, `gemm_x86.rs`, `dot_*.rs`, `scalar.rs`).

use std::sync::OnceLock;

use hf2q_tensor::quant::mxfp4::{BLOCK_BYTES, QK_MXFP4};
use hf2q_tensor::GgmlType;

/// The decoder's values as the engines read them.
pub(crate) struct Tables {
    /// E2M1 code -> unsigned code `kvalue - kmin`.
    pub u: [u8; 16],
    /// The smallest doubled value (-12): `c = kmin * a`.
    pub kmin: f32,
    /// E8M0 byte -> `2^(e - 128)`.
    pub scale: [f32; 256],
}

/// One block's 32 decoded values under scale byte `e`, codes 0..16 in its low nibbles.
fn decode_block(e: u8) -> [f32; QK_MXFP4] {
    let mut block = [0u8; BLOCK_BYTES];
    block[0] = e;
    for (j, b) in block[1..].iter_mut().enumerate() {
        *b = j as u8;
    }
    let mut v = [0f32; QK_MXFP4];
    hf2q_tensor::quant::dequantize(GgmlType::MXFP4, &block, &mut v)
        .expect("one whole MXFP4 block decodes");
    v
}

/// The tables, read from the decoder on first use.
pub(crate) fn tables() -> &'static Tables {
    static T: OnceLock<Tables> = OnceLock::new();
    T.get_or_init(|| {
        // Scale byte 128 is the unit half-scale: element j is code j's doubled value.
        let unit = decode_block(128);
        let kmin = unit[..16].iter().fold(f32::INFINITY, |m, &v| m.min(v));
        let u = std::array::from_fn(|j| (unit[j] - kmin) as u8);
        // Code 1 (E2M1's 0.5, doubled 1) decodes to the half-scale itself.
        let scale = std::array::from_fn(|e| decode_block(e as u8)[1]);
        Tables { u, kmin, scale }
    })
}

/// Row `src` (whole blocks) into `codes` (C), `a` and `c` (C/16 each), as `unpack.rs`'s other
/// formats.
#[inline(always)]
pub(crate) fn unpack_row(src: &[u8], codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
    let t = tables();
    for (((b, u), a), c) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(codes.chunks_exact_mut(QK_MXFP4))
        .zip(a.chunks_exact_mut(2))
        .zip(c.chunks_exact_mut(2))
    {
        // Byte j holds elements j (low nibble) and j + 16 (high nibble).
        for j in 0..16 {
            u[j] = t.u[(b[1 + j] & 0x0f) as usize];
            u[j + 16] = t.u[(b[1 + j] >> 4) as usize];
        }
        let d = t.scale[b[0] as usize];
        a.fill(d);
        c.fill(t.kmin * d);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// The code table in each 128-bit lane, for [`lookup`].
    ///
    /// # Safety
    /// The CPU must have AVX-512 F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn lut() -> __m512i {
        _mm512_broadcast_i32x4(_mm_loadu_si128(super::tables().u.as_ptr() as *const __m128i))
    }

    /// E2M1 codes (bytes 0..16) to unsigned codes: one byte shuffle.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(crate) unsafe fn lookup(lut: __m512i, nibbles: __m512i) -> __m512i {
        _mm512_shuffle_epi8(lut, nibbles)
    }

    /// `2^(e - 128)` for the scale byte in each 32-bit lane (the rest of the lane zero), exact:
    /// the f32 with exponent field `e - 1` for `e >= 2`, the subnormals `2^-127`, `2^-128`
    /// below (the decoder's values; checked for every byte in the tests).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn half_scales(e: __m512i) -> __m512 {
        let normal = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
        let sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
        let big = _mm512_cmpgt_epu32_mask(e, _mm512_set1_epi32(1));
        _mm512_castsi512_ps(_mm512_mask_blend_epi32(big, sub, normal))
    }

    /// The half-scales of `n` (at most 8) blocks `bs` bytes apart from `base` (the block's first
    /// byte), in the low 8 lanes; lanes from `n` on are zero (not the subnormal `2^-128` of a
    /// zero byte: products with subnormals take microcode assists, measured 3x slower on a row
    /// of 18 blocks).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F; the `n` bytes must be readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    pub(crate) unsafe fn half_scales8(base: *const u8, bs: usize, n: usize) -> __m256 {
        // Inserted from scalar loads, as the fused kernel's f16 scales (a gather, or a store
        // and reload of the bytes, costs more).
        let ld = |l: usize| *base.add(l * bs) as i32;
        let mut h = _mm_setzero_si128();
        macro_rules! put {
            ($($l:literal),*) => {
                $(if $l < n {
                    h = _mm_insert_epi16::<$l>(h, ld($l));
                })*
            };
        }
        put!(0, 1, 2, 3, 4, 5, 6, 7);
        let e = _mm512_castsi256_si512(_mm256_cvtepu16_epi32(h));
        let valid = ((1u32 << n) - 1) as __mmask16;
        _mm512_castps512_ps256(_mm512_maskz_mov_ps(valid, half_scales(e)))
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn vector_scales_equal_the_decoders_for_every_byte() {
            if !crate::kernels::Isa::Avx512Vnni.is_available() {
                eprintln!("skipped: no AVX-512 on this CPU");
                return;
            }
            let t = super::super::tables();
            let bytes: Vec<u8> = (0..=255u8).collect();
            for first in (0..256).step_by(8) {
                let mut got = [0f32; 8];
                // SAFETY: AVX-512 checked above; 8 bytes one apart from `first`.
                unsafe {
                    std::arch::x86_64::_mm256_storeu_ps(
                        got.as_mut_ptr(),
                        super::half_scales8(bytes[first..].as_ptr(), 1, 8),
                    )
                };
                for (l, g) in got.iter().enumerate() {
                    let want = t.scale[first + l];
                    assert_eq!(g.to_bits(), want.to_bits(), "e = {}", first + l);
                }
            }
            // A partial chunk: the lanes past it are zeros.
            let mut got = [f32::NAN; 8];
            // SAFETY: as above, 3 bytes.
            unsafe {
                std::arch::x86_64::_mm256_storeu_ps(
                    got.as_mut_ptr(),
                    super::half_scales8(bytes[100..].as_ptr(), 1, 3),
                )
            };
            assert_eq!(&got[..3], &t.scale[100..103]);
            assert!(got[3..].iter().all(|v| v.to_bits() == 0), "{got:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_the_doubled_e2m1_values_and_the_half_scales() {
        let t = tables();
        assert_eq!(t.kmin, -12.0);
        assert_eq!(
            t.u.map(|u| u as i32 - 12),
            [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
        );
        assert_eq!(t.scale[128], 1.0);
        assert_eq!(t.scale[127], 0.5);
        assert_eq!(t.scale[0], f32::from_bits(0x0020_0000));
    }

    #[test]
    fn a_decoded_row_gives_the_reference_values() {
        // Every code under a few scales, subnormal ones included.
        let mut src = Vec::new();
        for e in [0u8, 1, 2, 100, 127, 128, 140] {
            src.push(e);
            src.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        }
        let n = src.len() / BLOCK_BYTES * QK_MXFP4;
        let mut want = vec![0f32; n];
        hf2q_tensor::quant::dequantize(GgmlType::MXFP4, &src, &mut want).unwrap();
        let (mut u, mut a, mut c) = (vec![0u8; n], vec![0f32; n / 16], vec![0f32; n / 16]);
        unpack_row(&src, &mut u, &mut a, &mut c);
        for i in 0..n {
            // Exact: a power of two times a small integer, then an exact difference.
            let got = a[i / 16] * u[i] as f32 + c[i / 16];
            assert_eq!(got, want[i], "element {i}");
        }
    }
}
