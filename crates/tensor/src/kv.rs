//! Key/value caches: [`KvStore`] is one layer's cache, on the host ([`HostKv`], f16 or f32) or
//! on a device. A backend writes and reads it (`Backend::kv_write` / `Backend::attend`); model
//! code only passes it along.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::op::LayerCache;
use crate::{Error, Result, Tensor};

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
}

impl KvType {
    /// Bytes per stored value.
    pub fn bytes(self) -> usize {
        match self {
            KvType::F16 => 2,
            KvType::F32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
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
    /// Planes of `cap` positions holding the first `len` positions of `self` (of `old_cap`).
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
    /// each head's `d` values through `conv`.
    #[allow(clippy::too_many_arguments)]
    fn put(
        &mut self,
        kd: &[f32],
        vd: &[f32],
        pos0: usize,
        t: usize,
        cap: usize,
        h: usize,
        d: usize,
        conv: impl Fn(&mut [T], &[f32]),
    ) {
        for ti in 0..t {
            for hi in 0..h {
                let dst = hi * cap * d + (pos0 + ti) * d;
                let src = ti * h * d + hi * d;
                conv(&mut self.k[dst..dst + d], &kd[src..src + d]);
                conv(&mut self.v[dst..dst + d], &vd[src..src + d]);
            }
        }
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
}

/// A host cache's keys and values as the attention reads them.
pub enum KvView<'a> {
    F16(LayerCache<'a, f16>),
    F32(LayerCache<'a, f32>),
}

/// Keys and values (f16 or f32, [`KvType`]) laid out `(Hkv, S_cap, Dh)` (a head's positions
/// contiguous). Capacity grows by doubling up to the session's limit, so short sessions of
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
    /// rounds them to nearest even, as `half::f16::from_f32`).
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
        check_fits(pos0, t, limit)?;
        self.grow(pos0 + t, limit);
        let (cap, kd, vd) = (self.capacity, k.data(), v.data());
        match &mut self.data {
            // Hardware conversion where the CPU has it; the same rounding either way.
            Storage::F16(p) => p.put(kd, vd, pos0, t, cap, h, d, |o, i| {
                o.convert_from_f32_slice(i)
            }),
            Storage::F32(p) => p.put(kd, vd, pos0, t, cap, h, d, |o, i| o.copy_from_slice(i)),
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
        }
    }

    /// Bytes held (keys and values at the current capacity).
    pub fn bytes(&self) -> usize {
        match &self.data {
            Storage::F16(p) => (p.k.len() + p.v.len()) * std::mem::size_of::<f16>(),
            Storage::F32(p) => (p.k.len() + p.v.len()) * std::mem::size_of::<f32>(),
        }
    }
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
            assert_eq!(kv.bytes(), 2 * h * 256 * d * ty.bytes());
            // A compact copy of 3 positions, then one grown for a larger limit.
            for (limit, cap) in [(3, 3), (1000, 256)] {
                let p = kv.prefix(3, limit).unwrap();
                assert_eq!((p.capacity(), p.kv_type()), (cap, ty));
                assert_eq!(p.bytes(), 2 * h * cap * d * ty.bytes());
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

    fn rows_of(t: &Tensor, r: std::ops::Range<usize>) -> Tensor {
        let w = t.dims2().1;
        Tensor::new(&[r.len(), w], t.data()[r.start * w..r.end * w].to_vec()).unwrap()
    }
}
