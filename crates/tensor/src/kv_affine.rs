//! mlx-lm's affine KV layout (`QuantizedKVCache`, `--kv-bits 4|8 --kv-group-size 32|64|128`):
//! each group of `group` consecutive values of a cache row (along the head dimension) stored as
//! an f16 scale, an f16 bias and `group` unsigned `bits`-bit integers `q`, value `q * scale +
//! bias`. [`AffineKv`] names the six (bits, group) pairs; [`BlockAffine`] is one group as the
//! cache stores it and the kernels read it (a [`KvBlock`] of `group / 32` 32-value parts that
//! share the group's scale and bias).
//!
//! Quantized as `mx.quantize` does on the CPU (`quant::mlx::quantize_affine`, from f32: scale
//! from the group's range, nudged so that its larger-magnitude edge is on the grid, ties to
//! even), the scale and bias then stored as f16 (what mlx-lm stores for an f16 model); the
//! integers packed as mlx packs them (value `i` of a group in bits `i * bits ..` of its bytes,
//! little-endian).
//!
//! Not here: ggml's block types (`kv_blocks`), the cache (`kv`), the kernels (the CPU crate).

use half::f16;

use crate::kv_blocks::{KvBlock, Q8_0_VALUES};
use crate::quant::mlx::{quantize_affine, AffineParams};
use crate::{Error, Result};

/// One of mlx-lm's affine KV layouts: 4 or 8 bits, groups of 32, 64 or 128 values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AffineKv {
    B8G32,
    B8G64,
    B8G128,
    B4G32,
    B4G64,
    B4G128,
}

impl AffineKv {
    /// Every layout.
    pub const ALL: [AffineKv; 6] = [
        AffineKv::B8G32,
        AffineKv::B8G64,
        AffineKv::B8G128,
        AffineKv::B4G32,
        AffineKv::B4G64,
        AffineKv::B4G128,
    ];

    /// The layout of `bits` (4 or 8) and `group` (32, 64 or 128: mlx's group sizes), or an
    /// error naming the value it does not take.
    pub fn new(bits: u32, group: usize) -> Result<AffineKv> {
        let layout = match (bits, group) {
            (8, 32) => AffineKv::B8G32,
            (8, 64) => AffineKv::B8G64,
            (8, 128) => AffineKv::B8G128,
            (4, 32) => AffineKv::B4G32,
            (4, 64) => AffineKv::B4G64,
            (4, 128) => AffineKv::B4G128,
            (4 | 8, g) => {
                return Err(Error::Msg(format!(
                    "affine KV cache: group size {g} is not one of mlx's 32, 64, 128"
                )))
            }
            (b, _) => {
                return Err(Error::Msg(format!(
                    "affine KV cache: {b} bits is not one of 4, 8"
                )))
            }
        };
        Ok(layout)
    }
    pub fn bits(self) -> u32 {
        match self {
            AffineKv::B8G32 | AffineKv::B8G64 | AffineKv::B8G128 => 8,
            AffineKv::B4G32 | AffineKv::B4G64 | AffineKv::B4G128 => 4,
        }
    }
    /// Values per group.
    pub fn group(self) -> usize {
        match self {
            AffineKv::B8G32 | AffineKv::B4G32 => 32,
            AffineKv::B8G64 | AffineKv::B4G64 => 64,
            AffineKv::B8G128 | AffineKv::B4G128 => 128,
        }
    }
    /// Bytes of one group: the f16 scale and bias, and `group * bits / 8` of integers.
    pub fn group_bytes(self) -> usize {
        4 + self.group() * self.bits() as usize / 8
    }
    /// `affine8g64` and so on (what `--kv-type`-style names and reports show).
    pub fn name(self) -> &'static str {
        match self {
            AffineKv::B8G32 => "affine8g32",
            AffineKv::B8G64 => "affine8g64",
            AffineKv::B8G128 => "affine8g128",
            AffineKv::B4G32 => "affine4g32",
            AffineKv::B4G64 => "affine4g64",
            AffineKv::B4G128 => "affine4g128",
        }
    }
}

/// One group of an affine cache row: `BITS`-bit integers in `N` bytes (`N * 8 / BITS` values, a
/// multiple of 32), with the group's f16 `scale` and `bias`. Only the six aliases below are
/// used ([`AffineKv`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockAffine<const BITS: usize, const N: usize> {
    pub scale: f16,
    pub bias: f16,
    pub qs: [u8; N],
}

impl<const BITS: usize, const N: usize> Default for BlockAffine<BITS, N> {
    fn default() -> Self {
        BlockAffine {
            scale: f16::ZERO,
            bias: f16::ZERO,
            qs: [0; N],
        }
    }
}

pub type BlockA8G32 = BlockAffine<8, 32>;
pub type BlockA8G64 = BlockAffine<8, 64>;
pub type BlockA8G128 = BlockAffine<8, 128>;
pub type BlockA4G32 = BlockAffine<4, 16>;
pub type BlockA4G64 = BlockAffine<4, 32>;
pub type BlockA4G128 = BlockAffine<4, 64>;

impl<const BITS: usize, const N: usize> BlockAffine<BITS, N> {
    /// Values per group.
    pub const GROUP: usize = N * 8 / BITS;
    /// The layout's checks, evaluated where the block is used: 4 or 8 bits, whole 32-value
    /// parts, and a size without padding (two f16 and `N` bytes, `N` even).
    const LAYOUT_OK: () = assert!(
        (BITS == 4 || BITS == 8)
            && (N * 8 / BITS).is_multiple_of(Q8_0_VALUES)
            && N.is_multiple_of(2)
            && std::mem::size_of::<Self>() == 4 + N
    );
}

// SAFETY: `LAYOUT_OK` (evaluated in `unpack` and `quantize`, so in every use) holds the size to
// two f16 and `N` bytes, no padding; any bits are a valid f16 or u8.
unsafe impl<const BITS: usize, const N: usize> KvBlock for BlockAffine<BITS, N> {
    const NAME: &'static str = match (BITS, N) {
        (8, 32) => "affine8g32",
        (8, 64) => "affine8g64",
        (8, 128) => "affine8g128",
        (4, 16) => "affine4g32",
        (4, 32) => "affine4g64",
        (4, 64) => "affine4g128",
        _ => "affine",
    };
    const BYTES: usize = 4 + N;
    const HAS_MIN: bool = true;
    const SUBS: usize = N * 8 / BITS / Q8_0_VALUES;

    /// Part `sub`'s integers: 8 bits, one byte each; 4 bits, value `2i` in the low nibble of
    /// byte `i` and `2i + 1` in its high nibble (mlx's little-endian packing).
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    fn unpack(&self, sub: usize) -> (f32, f32, [f32; Q8_0_VALUES]) {
        let () = Self::LAYOUT_OK;
        let mut x = [0f32; Q8_0_VALUES];
        if BITS == 8 {
            let qs: &[u8; Q8_0_VALUES] = self.qs[sub * Q8_0_VALUES..(sub + 1) * Q8_0_VALUES]
                .try_into()
                .expect("32 bytes");
            for i in 0..Q8_0_VALUES {
                x[i] = qs[i] as f32;
            }
        } else {
            let qs: &[u8; 16] = self.qs[sub * 16..(sub + 1) * 16]
                .try_into()
                .expect("16 bytes");
            for i in 0..16 {
                x[2 * i] = (qs[i] & 0x0f) as f32;
                x[2 * i + 1] = (qs[i] >> 4) as f32;
            }
        }
        (f16_f32(self.scale), f16_f32(self.bias), x)
    }

    fn quantize(src: &[f32], out: &mut [Self]) -> Result<()> {
        let () = Self::LAYOUT_OK;
        let g = Self::GROUP;
        if src.len() != out.len() * g {
            return Err(Error::Shape(format!(
                "{}: {} values for {} groups of {g}",
                Self::NAME,
                src.len(),
                out.len()
            )));
        }
        let p = AffineParams {
            bits: BITS as u32,
            group_size: g,
        };
        for (x, b) in src.chunks_exact(g).zip(out.iter_mut()) {
            let (mut scale, mut bias) = ([0f32], [0f32]);
            quantize_affine(p, x, &mut b.qs, &mut scale, &mut bias)?;
            b.scale = f16::from_f32(scale[0]);
            b.bias = f16::from_f32(bias[0]);
        }
        Ok(())
    }
}

#[inline(always)]
fn f16_f32(x: f16) -> f32 {
    crate::op::f16_bits_to_f32(x.to_bits())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::KvElem;
    use crate::quant::mlx::dequantize_affine;

    /// Each layout's values ([`KvElem::dequantize_row`] over [`KvBlock::unpack`]) are mlx's
    /// dequantizer's (`quant::mlx::dequantize_affine`, `q * scale + bias` in f32) over the
    /// stored f16 scale and bias, bit for bit, for random bytes (scales of both signs, zero and
    /// subnormal); the bytes round-trip.
    #[test]
    fn affine_values_are_mlxs() {
        fn case<const BITS: usize, const N: usize>() {
            type B<const BITS: usize, const N: usize> = BlockAffine<BITS, N>;
            let g = B::<BITS, N>::GROUP;
            let n = 60;
            let mut s = 0x2545_f491_4f6c_dd1du64 ^ N as u64;
            let mut bytes = vec![0u8; n * B::<BITS, N>::BYTES];
            for b in bytes.iter_mut() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                *b = s as u8;
            }
            for (i, blk) in bytes.chunks_exact_mut(B::<BITS, N>::BYTES).enumerate() {
                let d = match i % 4 {
                    0 => 0.0,
                    1 => 3e-7,
                    _ => (i as f32 - 30.0) * 0.013,
                };
                let m = -(i as f32) * 0.07;
                blk[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                blk[2..4].copy_from_slice(&f16::from_f32(m).to_bits().to_le_bytes());
            }
            let blocks: Vec<B<BITS, N>> = bytes
                .chunks_exact(B::<BITS, N>::BYTES)
                .map(B::<BITS, N>::from_bytes)
                .collect();
            let back: Vec<u8> = blocks.iter().flat_map(|b| b.bytes().to_vec()).collect();
            assert_eq!(back, bytes);
            let mut got = vec![0f32; n * g];
            B::<BITS, N>::dequantize_row(&blocks, &mut got);
            let p = AffineParams {
                bits: BITS as u32,
                group_size: g,
            };
            for (b, y) in blocks.iter().zip(got.chunks_exact(g)) {
                let mut want = vec![0f32; g];
                let (sc, bi) = ([b.scale.to_f32()], [b.bias.to_f32()]);
                dequantize_affine(p, &b.qs, &sc, &bi, &mut want).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(y), bits(&want), "{}", B::<BITS, N>::NAME);
            }
        }
        case::<8, 32>();
        case::<8, 64>();
        case::<8, 128>();
        case::<4, 16>();
        case::<4, 32>();
        case::<4, 64>();
    }

    /// The layouts' names, sizes and refusals.
    #[test]
    fn layouts() {
        for a in AffineKv::ALL {
            assert_eq!(AffineKv::new(a.bits(), a.group()).unwrap(), a);
        }
        assert_eq!(BlockA8G64::BYTES, AffineKv::B8G64.group_bytes());
        assert_eq!(BlockA4G128::BYTES, AffineKv::B4G128.group_bytes());
        assert_eq!(<BlockA4G64 as KvBlock>::NAME, AffineKv::B4G64.name());
        assert_eq!(BlockA4G64::SUBS, 2);
        let e = AffineKv::new(8, 48).unwrap_err().to_string();
        assert!(e.contains("group size 48"), "{e}");
        let e = AffineKv::new(5, 64).unwrap_err().to_string();
        assert!(e.contains("5 bits"), "{e}");
    }
}
