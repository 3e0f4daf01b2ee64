//! Key/value caches: [`KvStore`] is one layer's cache, on the host ([`HostKv`], f16, f32 or
//! ggml Q8_0 blocks) or on a device. A backend writes and reads it (`Backend::kv_write` / `Backend::attend`); model
//! code only passes it along.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::op::LayerCache;
use crate::{Error, Result, Tensor};

pub use crate::kv_blocks::{
    BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, KvBlock, Q8_0_VALUES,
};

/// What a KV cache stores keys and values as.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    /// Half precision (the default, as llama.cpp's): half the memory of f32, and less to read per
    /// decoded token; values are rounded to nearest even once, when written.
    #[default]
    F16,
    /// Single precision: what the model computed, bit for bit (for exact comparisons with the
    /// reference).
    F32,
    /// ggml's Q8_0 (llama.cpp's `-ctk/-ctv q8_0`): each row of `Dh` values as `Dh / 32` blocks
    /// of an f16 scale and 32 i8 ([`BlockQ8_0`]), 34 bytes per 32 values (17/32 of f16). The head
    /// width must be a multiple of 32.
    Q8_0,
    /// ggml's Q4_0 (`-ctk/-ctv q4_0`): rows as `Dh / 32` blocks of an f16 scale and 32 4-bit
    /// values ([`BlockQ4_0`]), 18 bytes per 32 values (9/32 of f16). Head widths as Q8_0.
    Q4_0,
}

impl KvType {
    /// Bytes of one cache row (one head's `dh` values at one position); for a block type, `dh`
    /// must be a whole number of blocks ([`KvType::check_head_dim`]).
    pub fn row_bytes(self, dh: usize) -> usize {
        match self {
            KvType::F16 => 2 * dh,
            KvType::F32 => 4 * dh,
            KvType::Q8_0 => dh / Q8_0_VALUES * std::mem::size_of::<BlockQ8_0>(),
            KvType::Q4_0 => dh / Q8_0_VALUES * std::mem::size_of::<BlockQ4_0>(),
        }
    }
    /// Values per stored element (1, or the block size).
    pub fn block_values(self) -> usize {
        match self {
            KvType::F16 | KvType::F32 => 1,
            KvType::Q8_0 | KvType::Q4_0 => Q8_0_VALUES,
        }
    }
    /// Whether heads of width `dh` can be stored: a block type needs whole blocks.
    pub fn check_head_dim(self, dh: usize) -> Result<()> {
        let b = self.block_values();
        if dh == 0 || !dh.is_multiple_of(b) {
            return Err(Error::Msg(format!(
                "a {} KV cache stores heads in blocks of {b} values; this model's head width \
                 {dh} is not a multiple of {b} (use --kv-type f16)",
                self.name()
            )));
        }
        Ok(())
    }
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
        }
    }
}

/// One layer's keys and values.
pub enum KvStore {
    Host(HostKv),
    /// A device backend's cache (allocated at its full capacity on the first write).
    Device(Box<dyn DeviceKv>),
}

/// A device backend's layer cache; the backend that made it downcasts it back.
pub trait DeviceKv: Send + Sync {
    /// Bytes of device memory held.
    fn bytes(&self) -> usize;
    fn as_any(&self) -> &dyn std::any::Any;
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

impl KvStore {
    /// An empty host cache of `ty` values; a device backend replaces it with its own (of the
    /// backend's type) on first write.
    pub fn new(n_kv_heads: usize, head_dim: usize, ty: KvType) -> KvStore {
        KvStore::Host(HostKv::new(n_kv_heads, head_dim, ty))
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            KvStore::Host(h) => h.bytes(),
            KvStore::Device(d) => d.bytes(),
        }
    }
}

/// Keys and values of one element type, each `(Hkv, S_cap, Dh)`.
struct Planes<T> {
    k: Vec<T>,
    v: Vec<T>,
}

impl<T: Copy + Default> Planes<T> {
    /// Planes of `cap` positions holding the first `len` positions of `self` (of `old_cap`);
    /// `d` is a row's length in elements.
    fn copied(&self, old_cap: usize, cap: usize, len: usize, h: usize, d: usize) -> Planes<T> {
        let copy = |src: &[T]| {
            let mut n = vec![T::default(); h * cap * d];
            for hi in 0..h {
                n[hi * cap * d..hi * cap * d + len * d]
                    .copy_from_slice(&src[hi * old_cap * d..hi * old_cap * d + len * d]);
            }
            n
        };
        Planes {
            k: copy(&self.k),
            v: copy(&self.v),
        }
    }
    /// Stores rows `(T, Hkv*Dh)` of keys `kd` and values `vd` at positions `pos0..pos0+t`,
    /// each head's `d` values through `conv` into its row of `r` elements.
    #[allow(clippy::too_many_arguments)]
    fn put(
        &mut self,
        kd: &[f32],
        vd: &[f32],
        pos0: usize,
        t: usize,
        cap: usize,
        (h, d, r): (usize, usize, usize),
        mut conv: impl FnMut(&mut [T], &[f32]) -> Result<()>,
    ) -> Result<()> {
        for ti in 0..t {
            for hi in 0..h {
                let dst = hi * cap * r + (pos0 + ti) * r;
                let src = ti * h * d + hi * d;
                conv(&mut self.k[dst..dst + r], &kd[src..src + d])?;
                conv(&mut self.v[dst..dst + r], &vd[src..src + d])?;
            }
        }
        Ok(())
    }
    fn view(&self, capacity: usize) -> LayerCache<'_, T> {
        LayerCache {
            k: &self.k,
            v: &self.v,
            capacity,
        }
    }
}

/// A host cache's storage: one variant per [`KvType`].
enum Storage {
    F16(Planes<f16>),
    F32(Planes<f32>),
    Q8_0(Planes<BlockQ8_0>),
    Q4_0(Planes<BlockQ4_0>),
}

/// A host cache's keys and values as the attention reads them.
pub enum KvView<'a> {
    F16(LayerCache<'a, f16>),
    F32(LayerCache<'a, f32>),
    /// Rows of `Dh / 32` blocks.
    Q8_0(LayerCache<'a, BlockQ8_0>),
    /// Rows of `Dh / 32` blocks.
    Q4_0(LayerCache<'a, BlockQ4_0>),
}

/// Keys and values (f16, f32 or Q8_0 blocks, [`KvType`]) laid out `(Hkv, S_cap, Dh)` (a head's
/// positions contiguous; a Q8_0 row is its `Dh / 32` blocks). Capacity grows by doubling up to the session's limit, so short sessions of
/// long-context models stay small.
pub struct HostKv {
    data: Storage,
    capacity: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl HostKv {
    pub fn new(n_kv_heads: usize, head_dim: usize, ty: KvType) -> HostKv {
        let data = match ty {
            KvType::F16 => Storage::F16(Planes {
                k: Vec::new(),
                v: Vec::new(),
            }),
            KvType::F32 => Storage::F32(Planes {
                k: Vec::new(),
                v: Vec::new(),
            }),
            KvType::Q8_0 => Storage::Q8_0(Planes {
                k: Vec::new(),
                v: Vec::new(),
            }),
            KvType::Q4_0 => Storage::Q4_0(Planes {
                k: Vec::new(),
                v: Vec::new(),
            }),
        };
        HostKv {
            data,
            capacity: 0,
            n_kv_heads,
            head_dim,
        }
    }

    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Positions the cache holds now.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn kv_type(&self) -> KvType {
        match self.data {
            Storage::F16(_) => KvType::F16,
            Storage::F32(_) => KvType::F32,
            Storage::Q8_0(_) => KvType::Q8_0,
            Storage::Q4_0(_) => KvType::Q4_0,
        }
    }

    /// The capacity a cache that must hold `need` positions grows to under `limit`: the next
    /// power of two, at least 256, at most the limit (or `need` if that is larger).
    fn grown_capacity(need: usize, limit: usize) -> usize {
        need.next_power_of_two().max(256).min(limit.max(need))
    }

    /// Storage of `cap` positions holding this cache's first `len`.
    fn copied(&self, cap: usize, len: usize) -> Storage {
        let (old, h, d) = (self.capacity, self.n_kv_heads, self.head_dim);
        match &self.data {
            Storage::F16(p) => Storage::F16(p.copied(old, cap, len, h, d)),
            Storage::F32(p) => Storage::F32(p.copied(old, cap, len, h, d)),
            Storage::Q8_0(p) => Storage::Q8_0(p.copied(old, cap, len, h, d / Q8_0_VALUES)),
            Storage::Q4_0(p) => Storage::Q4_0(p.copied(old, cap, len, h, d / Q8_0_VALUES)),
        }
    }

    fn grow(&mut self, need: usize, limit: usize) {
        if need <= self.capacity {
            return;
        }
        let cap = Self::grown_capacity(need, limit);
        self.data = self.copied(cap, self.capacity);
        self.capacity = cap;
    }

    /// Writes host tensors `k`, `v` `(T, Hkv*Dh)` at positions `pos0..pos0+T` (an f16 cache
    /// rounds them to nearest even, as `half::f16::from_f32`; a Q8_0 cache quantizes each head's
    /// row as ggml's `quantize_row_q8_0_ref`, so a prefill and a decode of the same keys store
    /// the same blocks).
    pub fn write(&mut self, k: &Tensor, v: &Tensor, pos0: usize, limit: usize) -> Result<()> {
        let (t, w) = k.dims2();
        let (h, d) = (self.n_kv_heads, self.head_dim);
        if w != h * d || v.dims2() != (t, w) {
            return Err(Error::Shape(format!(
                "kv write: k {:?} / v {:?} for {h} heads of {d}",
                k.shape(),
                v.shape()
            )));
        }
        self.kv_type().check_head_dim(d)?;
        check_fits(pos0, t, limit)?;
        self.grow(pos0 + t, limit);
        let (cap, kd, vd) = (self.capacity, k.data(), v.data());
        match &mut self.data {
            // Hardware conversion where the CPU has it; the same rounding either way.
            Storage::F16(p) => p.put(kd, vd, pos0, t, cap, (h, d, d), |o, i| {
                o.convert_from_f32_slice(i);
                Ok(())
            })?,
            Storage::F32(p) => p.put(kd, vd, pos0, t, cap, (h, d, d), |o, i| {
                o.copy_from_slice(i);
                Ok(())
            })?,
            Storage::Q8_0(p) => put_blocks(p, kd, vd, pos0, t, cap, (h, d))?,
            Storage::Q4_0(p) => put_blocks(p, kd, vd, pos0, t, cap, (h, d))?,
        }
        Ok(())
    }

    /// A new cache holding a copy of this cache's first `len` positions, with the capacity that
    /// writing `len` positions under `limit` would have grown it to (so `limit == len` gives a
    /// compact copy of exactly `len` positions), of the same element type (the stored values are
    /// copied as they are). Prefix caching uses it to start a sequence from another one's keys
    /// and values without recomputing them, and to shrink a finished sequence's cache to what it
    /// holds.
    pub fn prefix(&self, len: usize, limit: usize) -> Result<HostKv> {
        if len > self.capacity || len > limit {
            return Err(Error::Msg(format!(
                "kv prefix: {len} positions from a cache of {} (limit {limit})",
                self.capacity
            )));
        }
        let mut out = HostKv::new(self.n_kv_heads, self.head_dim, self.kv_type());
        if len == 0 {
            return Ok(out);
        }
        let cap = Self::grown_capacity(len, limit);
        out.data = self.copied(cap, len);
        out.capacity = cap;
        Ok(out)
    }

    pub fn view(&self) -> KvView<'_> {
        match &self.data {
            Storage::F16(p) => KvView::F16(p.view(self.capacity)),
            Storage::F32(p) => KvView::F32(p.view(self.capacity)),
            Storage::Q8_0(p) => KvView::Q8_0(p.view(self.capacity)),
            Storage::Q4_0(p) => KvView::Q4_0(p.view(self.capacity)),
        }
    }

    /// Bytes held (keys and values at the current capacity).
    pub fn bytes(&self) -> usize {
        match &self.data {
            Storage::F16(p) => (p.k.len() + p.v.len()) * std::mem::size_of::<f16>(),
            Storage::F32(p) => (p.k.len() + p.v.len()) * std::mem::size_of::<f32>(),
            Storage::Q8_0(p) => (p.k.len() + p.v.len()) * std::mem::size_of::<BlockQ8_0>(),
            Storage::Q4_0(p) => (p.k.len() + p.v.len()) * std::mem::size_of::<BlockQ4_0>(),
        }
    }
}

/// [`Planes::put`] of a block type: each head's row quantized by ggml's reference quantizer
/// (`quant::quantize`, `quantize_row_*_ref`) straight into its blocks' bytes.
#[allow(clippy::too_many_arguments)]
fn put_blocks<B: KvBlock>(
    p: &mut Planes<B>,
    kd: &[f32],
    vd: &[f32],
    pos0: usize,
    t: usize,
    cap: usize,
    (h, d): (usize, usize),
) -> Result<()> {
    p.put(kd, vd, pos0, t, cap, (h, d, d / Q8_0_VALUES), |o, i| {
        crate::quant::quantize(B::GGML, i, B::slice_bytes_mut(o))
    })
}

/// The context-limit check every cache write makes.
pub fn check_fits(pos0: usize, t: usize, limit: usize) -> Result<()> {
    if pos0 + t > limit {
        return Err(Error::Msg(format!(
            "context full: {} tokens exceed the limit of {limit}",
            pos0 + t
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(t: usize, w: usize, base: f32) -> Tensor {
        let d: Vec<f32> = (0..t * w).map(|i| base + i as f32).collect();
        Tensor::new(&[t, w], d).unwrap()
    }

    /// Key and value bits of `kv` at (head, position), whatever the element type.
    fn bits_at(kv: &HostKv, hi: usize, pos: usize) -> (Vec<u32>, Vec<u32>) {
        let (cap, d) = (kv.capacity(), kv.head_dim());
        let at = hi * cap * d + pos * d;
        match kv.view() {
            KvView::F16(c) => (
                c.k[at..at + d].iter().map(|x| x.to_bits() as u32).collect(),
                c.v[at..at + d].iter().map(|x| x.to_bits() as u32).collect(),
            ),
            KvView::F32(c) => (
                c.k[at..at + d].iter().map(|x| x.to_bits()).collect(),
                c.v[at..at + d].iter().map(|x| x.to_bits()).collect(),
            ),
            KvView::Q8_0(_) | KvView::Q4_0(_) => unreachable!("block caches: block_bytes_at"),
        }
    }

    #[test]
    fn prefix_copies_the_first_positions() {
        for ty in [KvType::F16, KvType::F32] {
            let (h, d) = (2, 3);
            let mut kv = HostKv::new(h, d, ty);
            // Fractions that f16 rounds, so that a copy that converted again would show.
            let frac = |t: Tensor| {
                let d: Vec<f32> = t.data().iter().map(|x| x * 1.0001 + 0.3).collect();
                Tensor::new(t.shape(), d).unwrap()
            };
            kv.write(
                &frac(rows(5, h * d, 0.0)),
                &frac(rows(5, h * d, 100.0)),
                0,
                1000,
            )
            .unwrap();
            assert_eq!(kv.capacity(), 256);
            assert_eq!(kv.bytes(), 2 * h * 256 * ty.row_bytes(d));
            // A compact copy of 3 positions, then one grown for a larger limit.
            for (limit, cap) in [(3, 3), (1000, 256)] {
                let p = kv.prefix(3, limit).unwrap();
                assert_eq!((p.capacity(), p.kv_type()), (cap, ty));
                assert_eq!(p.bytes(), 2 * h * cap * ty.row_bytes(d));
                for hi in 0..h {
                    for pos in 0..3 {
                        assert_eq!(bits_at(&kv, hi, pos), bits_at(&p, hi, pos), "{ty:?}");
                    }
                }
            }
            // Writing after the prefix continues the sequence.
            let mut p = kv.prefix(3, 8).unwrap();
            p.write(&rows(2, h * d, 7.0), &rows(2, h * d, 9.0), 3, 8)
                .unwrap();
            assert_eq!(p.capacity(), 8);
            assert_eq!(bits_at(&p, 1, 2), bits_at(&kv, 1, 2));
            assert!(kv.prefix(300, 1000).is_err());
            assert!(kv.prefix(4, 3).is_err());
            assert_eq!(kv.prefix(0, 10).unwrap().bytes(), 0);
        }
    }

    /// An f16 cache stores what `half::f16::from_f32` gives (round to nearest, ties to even;
    /// overflow to infinity; subnormals), also checked against the crate's software rounding so
    /// that hardware conversion cannot drift from it; an f32 cache stores the bits given.
    #[test]
    fn f16_write_rounds_as_half() {
        let (h, d) = (3, 7);
        let specials = [
            0.0,
            -0.0,
            1.0,
            -2.5,
            1.0 + 1.0 / 2048.0,        // a tie: rounds down to even
            1.0 + 3.0 / 2048.0,        // a tie: rounds up to even
            1.0 + 1.0 / 2048.0 + 1e-7, // just past the tie
            65504.0,                   // the largest f16
            65519.0,                   // rounds down to it
            65520.0,                   // rounds up to infinity
            -1e9,
            f32::INFINITY,
            f32::NEG_INFINITY,
            6.0e-8, // the smallest subnormal, about
            1.0e-6, // a subnormal
            6.1e-5, // near the smallest normal
            2.0e-8, // underflows to zero
            std::f32::consts::PI,
        ];
        let n = 9;
        let vals: Vec<f32> = (0..n * h * d)
            .map(|i| {
                if i < specials.len() {
                    specials[i]
                } else {
                    ((i * 7919 % 10007) as f32 / 10007.0 - 0.5) * 2f32.powi((i % 40) as i32 - 20)
                }
            })
            .collect();
        let kt = Tensor::new(&[n, h * d], vals.clone()).unwrap();
        let vt = Tensor::new(&[n, h * d], vals.iter().map(|x| -x).collect()).unwrap();
        let mut c16 = HostKv::new(h, d, KvType::F16);
        let mut c32 = HostKv::new(h, d, KvType::F32);
        // Two writes (positions 0..4 then 4..9): the second grows nothing but must land after.
        for kv in [&mut c16, &mut c32] {
            let (k0, v0) = (rows_of(&kt, 0..4), rows_of(&vt, 0..4));
            let (k1, v1) = (rows_of(&kt, 4..n), rows_of(&vt, 4..n));
            kv.write(&k0, &v0, 0, 64).unwrap();
            kv.write(&k1, &v1, 4, 64).unwrap();
        }
        assert_eq!(c16.bytes() * 2, c32.bytes());
        for ti in 0..n {
            for hi in 0..h {
                let (k16, v16) = bits_at(&c16, hi, ti);
                let (k32, v32) = bits_at(&c32, hi, ti);
                for di in 0..d {
                    let x = vals[ti * h * d + hi * d + di];
                    let want = f16::from_f32(x).to_bits() as u32;
                    assert_eq!(want, f16::from_f32_const(x).to_bits() as u32, "{x}");
                    assert_eq!(k16[di], want, "key {x}");
                    assert_eq!(v16[di], f16::from_f32(-x).to_bits() as u32, "value {}", -x);
                    assert_eq!(k32[di], x.to_bits());
                    assert_eq!(v32[di], (-x).to_bits());
                }
            }
        }
    }

    /// ggml's bytes of the key and value rows of `kv` (a block cache) at (head, position).
    fn block_bytes_at(kv: &HostKv, hi: usize, pos: usize) -> (Vec<u8>, Vec<u8>) {
        let (cap, r) = (kv.capacity(), kv.head_dim() / Q8_0_VALUES);
        let at = hi * cap * r + pos * r;
        match kv.view() {
            KvView::Q8_0(c) => {
                let bytes = |x: &[BlockQ8_0]| x.iter().flat_map(|b| b.bytes().to_vec()).collect();
                (bytes(&c.k[at..at + r]), bytes(&c.v[at..at + r]))
            }
            KvView::Q4_0(c) => {
                let bytes = |x: &[BlockQ4_0]| x.iter().flat_map(|b| b.bytes().to_vec()).collect();
                (bytes(&c.k[at..at + r]), bytes(&c.v[at..at + r]))
            }
            _ => panic!("not a block cache"),
        }
    }

    /// Awkward values for block quantizers: blocks of very different magnitudes, exact zeros,
    /// an all-zero block, ties of the rounding (x / d at k + 0.5), both signs.
    fn awkward(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((s >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
                let block = i / 32;
                match block % 5 {
                    0 => u * 8.0,
                    1 => u * 1e-3,
                    2 if i % 32 == 0 => 127.0,
                    2 => ((i % 32) as f32 - 16.0) + 0.5, // ties at d = 1
                    3 => 0.0,
                    _ if i % 7 == 0 => 0.0,
                    _ => u * 300.0,
                }
            })
            .collect()
    }

    /// A Q8_0 cache stores, for every head's row, exactly the bytes of the reference Q8_0
    /// quantizer (`quant::quantize`), whether the positions came in one prefill or one by one
    /// (and across a growth of the capacity); prefix copies keep the blocks as they are.
    #[test]
    fn block_write_equals_the_reference_quantizer() {
        for (ty, gt) in [
            (KvType::Q8_0, crate::GgmlType::Q8_0),
            (KvType::Q4_0, crate::GgmlType::Q4_0),
        ] {
            block_write_case(ty, gt);
        }
    }

    fn block_write_case(ty: KvType, gt: crate::GgmlType) {
        let bb = ty.row_bytes(32);
        for &(h, d) in &[(1, 32), (3, 64), (2, 96), (4, 128)] {
            let n = 300; // past the first capacity of 256: one growth on the way
            let kv_vals = awkward(n * h * d, 0x1234 + d as u64);
            let vv_vals: Vec<f32> = awkward(n * h * d, 0x9876 + h as u64);
            let kt = Tensor::new(&[n, h * d], kv_vals.clone()).unwrap();
            let vt = Tensor::new(&[n, h * d], vv_vals.clone()).unwrap();
            let mut whole = HostKv::new(h, d, ty);
            whole.write(&kt, &vt, 0, 4096).unwrap();
            let mut steps = HostKv::new(h, d, ty);
            steps
                .write(&rows_of(&kt, 0..5), &rows_of(&vt, 0..5), 0, 4096)
                .unwrap();
            for ti in 5..n {
                let (k1, v1) = (rows_of(&kt, ti..ti + 1), rows_of(&vt, ti..ti + 1));
                steps.write(&k1, &v1, ti, 4096).unwrap();
            }
            assert_eq!(whole.capacity(), 512);
            assert_eq!(whole.bytes(), 2 * h * 512 * (d / 32) * bb);
            let copy = whole.prefix(n, n).unwrap();
            for ti in 0..n {
                for hi in 0..h {
                    let at = ti * h * d + hi * d;
                    let mut want_k = vec![0u8; d / 32 * bb];
                    let mut want_v = vec![0u8; d / 32 * bb];
                    crate::quant::quantize(gt, &kv_vals[at..at + d], &mut want_k).unwrap();
                    crate::quant::quantize(gt, &vv_vals[at..at + d], &mut want_v).unwrap();
                    let want = (want_k, want_v);
                    assert_eq!(block_bytes_at(&whole, hi, ti), want, "h {h} d {d} pos {ti}");
                    assert_eq!(block_bytes_at(&steps, hi, ti), want, "h {h} d {d} pos {ti}");
                    assert_eq!(block_bytes_at(&copy, hi, ti), want, "h {h} d {d} pos {ti}");
                }
            }
        }
    }

    /// A head width that is not a whole number of blocks is refused, naming it.
    #[test]
    fn q8_0_needs_whole_blocks() {
        let mut kv = HostKv::new(2, 48, KvType::Q8_0);
        let t = Tensor::new(&[1, 96], vec![0.5; 96]).unwrap();
        let e = kv.write(&t, &t, 0, 16).unwrap_err().to_string();
        assert!(e.contains("head width 48") && e.contains("q8_0"), "{e}");
        assert!(KvType::Q8_0.check_head_dim(64).is_ok());
        assert!(KvType::F16.check_head_dim(48).is_ok());
    }

    /// KV bytes per position: Q8_0 is 34 bytes per 32 values against f16's 64, 17/32 =
    /// 53.125 % (53 % to two figures; ggml's block layout allows no less).
    #[test]
    fn q8_0_bytes_per_position() {
        let bound = 0.53125;
        for d in [32, 64, 128, 256] {
            let (q8, f16b) = (KvType::Q8_0.row_bytes(d), KvType::F16.row_bytes(d));
            assert_eq!(q8 * 32, 34 * d);
            assert!(q8 as f64 <= bound * f16b as f64, "{q8} vs {f16b}");
            assert_eq!((100.0 * q8 as f64 / f16b as f64).round(), 53.0);
            // Q4_0: 18 bytes per 32 values, 9/32 = 28.1 % of f16.
            let q4 = KvType::Q4_0.row_bytes(d);
            assert_eq!(q4 * 32, 18 * d);
            assert_eq!((100.0 * q4 as f64 / f16b as f64).round(), 28.0);
            let (h, n) = (3, 40);
            let t = Tensor::new(&[n, h * d], awkward(n * h * d, 5)).unwrap();
            let (mut a, mut b) = (
                HostKv::new(h, d, KvType::Q8_0),
                HostKv::new(h, d, KvType::F16),
            );
            a.write(&t, &t, 0, n).unwrap();
            b.write(&t, &t, 0, n).unwrap();
            assert!(a.bytes() as f64 <= bound * b.bytes() as f64);
            assert_eq!(a.bytes(), 2 * h * n * q8);
        }
    }

    fn rows_of(t: &Tensor, r: std::ops::Range<usize>) -> Tensor {
        let w = t.dims2().1;
        Tensor::new(&[r.len(), w], t.data()[r.start * w..r.end * w].to_vec()).unwrap()
    }
}
