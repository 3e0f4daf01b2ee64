//! The ggml block types a quantized KV cache stores: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, each 32
//! values in ggml's byte layout (`block_q*` in `ggml-common.h`), and [`KvBlock`], the one
//! description of a block that the cache writer and the attention kernels read: its bytes, how
//! it is quantized, and its values as `x * d` or `x * d + m` with small integers `x`, in parts of
//! 32 (one part for ggml's blocks; mlx-lm's affine groups, `kv_affine`, have 1, 2 or 4).
//!
//! Not here: the quantizers and dequantizers of weights (`quant::legacy`, which a block's
//! bytes go through when written), the cache itself (`kv`), the kernels (the CPU crate).

use half::f16;

use crate::op::KvElem;
use crate::{GgmlType, Result};

/// Values per block of every type here, and per part of any [`KvBlock`].
pub const Q8_0_VALUES: usize = 32;

// The structs are ggml's bytes in memory only on a little-endian machine.
const _: () = assert!(cfg!(target_endian = "little"));

/// A block of KV values: `SUBS` parts of 32 values (ggml's blocks: one). Every implementor is a
/// `#[repr(C)]` struct of f16 and byte fields without padding whose memory is its format's bytes
/// of the block (checked by size), so any bytes are a valid block.
///
/// # Safety
/// `size_of::<Self>() == Self::BYTES`, no padding, every bit pattern valid.
pub unsafe trait KvBlock:
    Copy + Default + PartialEq + std::fmt::Debug + Send + Sync + 'static
{
    /// The type's name in messages (`Q8_0`, `affine8g64`).
    const NAME: &'static str;
    /// Bytes per block.
    const BYTES: usize;
    /// Whether a value is `x * d + m` (the `_1` types, affine groups) rather than `x * d`.
    const HAS_MIN: bool;
    /// Parts of 32 values per block (sharing its `d` and `m`).
    const SUBS: usize = 1;
    /// The scale `d`, the offset `m` (0 without one) and part `sub`'s 32 integers `x` as f32
    /// (signed: `q - 8` for Q4_0, `q - 16` for Q5_0); `sub < SUBS`.
    fn unpack(&self, sub: usize) -> (f32, f32, [f32; Q8_0_VALUES]);
    /// `out` (whole blocks) from `src` (`out.len() * SUBS * 32` values) by the format's
    /// reference quantizer.
    fn quantize(src: &[f32], out: &mut [Self]) -> Result<()>;

    /// The block from its bytes (`b.len() == BYTES`).
    fn from_bytes(b: &[u8]) -> Self {
        assert_eq!(b.len(), Self::BYTES, "{} block bytes", Self::NAME);
        // SAFETY: BYTES bytes are read into a Self of that size, for which any bytes are valid
        // (the trait's contract).
        unsafe { std::ptr::read_unaligned(b.as_ptr() as *const Self) }
    }
    /// The bytes of blocks `v`, to write into.
    fn slice_bytes_mut(v: &mut [Self]) -> &mut [u8] {
        // SAFETY: blocks are BYTES bytes each without padding, and any bytes are valid blocks
        // (the trait's contract).
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * Self::BYTES) }
    }
    /// The bytes of the block.
    fn bytes(&self) -> &[u8] {
        // SAFETY: a Self is BYTES bytes without padding (the trait's contract).
        unsafe { std::slice::from_raw_parts(self as *const Self as *const u8, Self::BYTES) }
    }
}

/// Every block type's values through [`KvBlock::unpack`], in ggml's `dequantize_row_q*` order
/// of operations (`x * d`, then `+ m`; no fused multiply-add), so bit for bit ggml's (and
/// mlx's `q * scale + bias` for an affine group).
impl<B: KvBlock> KvElem for B {
    const VALUES: usize = Q8_0_VALUES * B::SUBS;
    fn dequantize_row(row: &[B], out: &mut [f32]) {
        assert_eq!(row.len() * Self::VALUES, out.len());
        for (i, o) in out.chunks_exact_mut(Q8_0_VALUES).enumerate() {
            let (d, m, x) = row[i / B::SUBS].unpack(i % B::SUBS);
            for (y, &x) in o.iter_mut().zip(&x) {
                *y = if B::HAS_MIN { x * d + m } else { x * d };
            }
        }
    }
}

/// `out` from `src` by ggml's reference quantizer of `ty` (`quant::quantize`): the
/// [`KvBlock::quantize`] of ggml's blocks.
fn quantize_ggml<B: KvBlock>(ty: GgmlType, src: &[f32], out: &mut [B]) -> Result<()> {
    crate::quant::quantize(ty, src, B::slice_bytes_mut(out))
}

/// The 32 integers of a 4- or 5-bit block, less `bias`, as f32: value `j < 16` in the low
/// nibble of byte `j`, value `j + 16` in its high nibble, with a fifth bit from `qh` (bit `j`
/// for value `j`) when `FIVE`. Plain loops over fixed lengths, so that they vectorise where
/// they are inlined.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn nibbles<const FIVE: bool>(qs: &[u8; 16], qh: u32, bias: i32) -> [f32; Q8_0_VALUES] {
    let mut x = [0f32; Q8_0_VALUES];
    for j in 0..16 {
        let (mut lo, mut hi) = ((qs[j] & 0x0f) as i32, (qs[j] >> 4) as i32);
        if FIVE {
            lo |= (((qh >> j) & 1) << 4) as i32;
            hi |= (((qh >> (j + 16)) & 1) << 4) as i32;
        }
        x[j] = (lo - bias) as f32;
        x[j + 16] = (hi - bias) as f32;
    }
    x
}

#[inline(always)]
fn f16_f32(x: f16) -> f32 {
    crate::op::f16_bits_to_f32(x.to_bits())
}

/// One ggml `block_q8_0`: 32 values as `d * q` with `d` an f16 scale (`amax / 127`) and `q` i8
/// (34 bytes). A Q8_0 cache row (one head's `Dh` values at one position) is `Dh / 32` of them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; Q8_0_VALUES],
}

/// One ggml `block_q4_0`: 32 values as `d * (q - 8)` with `d` an f16 scale and `q` 4-bit
/// (18 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; 16],
}

/// One ggml `block_q4_1`: 32 values as `d * q + m` with `d`, `m` f16 and `q` 4-bit (20 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; 16],
}

/// One ggml `block_q5_0`: 32 values as `d * (q - 16)` with `q` 5-bit: 4 bits in `qs`, the fifth
/// in `qh` (22 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// One ggml `block_q5_1`: 32 values as `d * q + m` with `q` 5-bit as Q5_0's (24 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);

// SAFETY (each): the struct is f16 and byte fields, its size (asserted above) the sum of
// theirs, so no padding; any bits are a valid f16, u8 or i8.
unsafe impl KvBlock for BlockQ8_0 {
    const NAME: &'static str = "Q8_0";
    fn quantize(src: &[f32], out: &mut [Self]) -> Result<()> {
        quantize_ggml(GgmlType::Q8_0, src, out)
    }
    const BYTES: usize = 34;
    const HAS_MIN: bool = false;
    #[inline(always)]
    fn unpack(&self, _: usize) -> (f32, f32, [f32; Q8_0_VALUES]) {
        let mut x = [0f32; Q8_0_VALUES];
        for (y, &q) in x.iter_mut().zip(&self.qs) {
            *y = q as f32;
        }
        (f16_f32(self.d), 0.0, x)
    }
}

unsafe impl KvBlock for BlockQ4_0 {
    const NAME: &'static str = "Q4_0";
    fn quantize(src: &[f32], out: &mut [Self]) -> Result<()> {
        quantize_ggml(GgmlType::Q4_0, src, out)
    }
    const BYTES: usize = 18;
    const HAS_MIN: bool = false;
    #[inline(always)]
    fn unpack(&self, _: usize) -> (f32, f32, [f32; Q8_0_VALUES]) {
        (f16_f32(self.d), 0.0, nibbles::<false>(&self.qs, 0, 8))
    }
}

unsafe impl KvBlock for BlockQ4_1 {
    const NAME: &'static str = "Q4_1";
    fn quantize(src: &[f32], out: &mut [Self]) -> Result<()> {
        quantize_ggml(GgmlType::Q4_1, src, out)
    }
    const BYTES: usize = 20;
    const HAS_MIN: bool = true;
    #[inline(always)]
    fn unpack(&self, _: usize) -> (f32, f32, [f32; Q8_0_VALUES]) {
        let x = nibbles::<false>(&self.qs, 0, 0);
        (f16_f32(self.d), f16_f32(self.m), x)
    }
}

unsafe impl KvBlock for BlockQ5_0 {
    const NAME: &'static str = "Q5_0";
    fn quantize(src: &[f32], out: &mut [Self]) -> Result<()> {
        quantize_ggml(GgmlType::Q5_0, src, out)
    }
    const BYTES: usize = 22;
    const HAS_MIN: bool = false;
    #[inline(always)]
    fn unpack(&self, _: usize) -> (f32, f32, [f32; Q8_0_VALUES]) {
        let x = nibbles::<true>(&self.qs, u32::from_le_bytes(self.qh), 16);
        (f16_f32(self.d), 0.0, x)
    }
}

unsafe impl KvBlock for BlockQ5_1 {
    const NAME: &'static str = "Q5_1";
    fn quantize(src: &[f32], out: &mut [Self]) -> Result<()> {
        quantize_ggml(GgmlType::Q5_1, src, out)
    }
    const BYTES: usize = 24;
    const HAS_MIN: bool = true;
    #[inline(always)]
    fn unpack(&self, _: usize) -> (f32, f32, [f32; Q8_0_VALUES]) {
        let x = nibbles::<true>(&self.qs, u32::from_le_bytes(self.qh), 0);
        (f16_f32(self.d), f16_f32(self.m), x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each block type's values ([`KvElem::dequantize_row`] over [`KvBlock::unpack`]) are ggml's
    /// dequantizer's (`quant::dequantize`) bit for bit, over every byte value in every position
    /// (random blocks, plus the scales' special values), and its bytes round-trip.
    #[test]
    fn block_values_are_ggmls() {
        fn case<B: KvBlock>(ggml: GgmlType) {
            let mut s = 0x2545_f491_4f6c_dd1du64 ^ B::BYTES as u64;
            let n = 200;
            let mut bytes = vec![0u8; n * B::BYTES];
            for b in bytes.iter_mut() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                *b = s as u8;
            }
            // Scales (and offsets) kept finite, so that the comparison is of numbers: a few
            // blocks with zero and subnormal scales.
            for (i, blk) in bytes.chunks_exact_mut(B::BYTES).enumerate() {
                let d = match i % 4 {
                    0 => 0.0,
                    1 => 3e-7,
                    _ => (i as f32 - 100.0) * 0.013,
                };
                blk[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                if B::HAS_MIN {
                    let m = f16::from_f32(-(i as f32) * 0.07);
                    blk[2..4].copy_from_slice(&m.to_bits().to_le_bytes());
                }
            }
            let blocks: Vec<B> = bytes.chunks_exact(B::BYTES).map(B::from_bytes).collect();
            let back: Vec<u8> = blocks.iter().flat_map(|b| b.bytes().to_vec()).collect();
            assert_eq!(back, bytes, "{}", B::NAME);
            let mut want = vec![0f32; n * 32];
            crate::quant::dequantize(ggml, &bytes, &mut want).unwrap();
            let mut got = vec![0f32; n * 32];
            B::dequantize_row(&blocks, &mut got);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{}", B::NAME);
        }
        case::<BlockQ8_0>(GgmlType::Q8_0);
        case::<BlockQ4_0>(GgmlType::Q4_0);
        case::<BlockQ4_1>(GgmlType::Q4_1);
        case::<BlockQ5_0>(GgmlType::Q5_0);
        case::<BlockQ5_1>(GgmlType::Q5_1);
    }
}
