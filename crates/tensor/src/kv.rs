//! Key/value caches: [`KvStore`] is one layer's cache, on the host ([`HostKv`], f32) or on a
//! device. A backend writes and reads it (`Backend::kv_write` / `Backend::attend`); model code
//! only passes it along.

use crate::op::LayerCache;
use crate::{Error, Result, Tensor};

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
    /// An empty host cache; a device backend replaces it with its own on first write.
    pub fn new(n_kv_heads: usize, head_dim: usize) -> KvStore {
        KvStore::Host(HostKv::new(n_kv_heads, head_dim))
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            KvStore::Host(h) => h.bytes(),
            KvStore::Device(d) => d.bytes(),
        }
    }
}

/// f32 keys and values laid out `(Hkv, S_cap, Dh)` (a head's positions contiguous). Capacity
/// grows by doubling up to the session's limit, so short sessions of long-context models stay
/// small.
pub struct HostKv {
    k: Vec<f32>,
    v: Vec<f32>,
    capacity: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl HostKv {
    pub fn new(n_kv_heads: usize, head_dim: usize) -> HostKv {
        HostKv {
            k: Vec::new(),
            v: Vec::new(),
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

    /// The capacity a cache that must hold `need` positions grows to under `limit`: the next
    /// power of two, at least 256, at most the limit (or `need` if that is larger).
    fn grown_capacity(need: usize, limit: usize) -> usize {
        need.next_power_of_two().max(256).min(limit.max(need))
    }

    fn grow(&mut self, need: usize, limit: usize) {
        if need <= self.capacity {
            return;
        }
        let cap = Self::grown_capacity(need, limit);
        let (h, d) = (self.n_kv_heads, self.head_dim);
        let relayout = |old: &[f32], old_cap: usize| {
            let mut n = vec![0f32; h * cap * d];
            for hi in 0..h {
                if old_cap > 0 {
                    n[hi * cap * d..hi * cap * d + old_cap * d]
                        .copy_from_slice(&old[hi * old_cap * d..(hi + 1) * old_cap * d]);
                }
            }
            n
        };
        self.k = relayout(&self.k, self.capacity);
        self.v = relayout(&self.v, self.capacity);
        self.capacity = cap;
    }

    /// Writes host tensors `k`, `v` `(T, Hkv*Dh)` at positions `pos0..pos0+T`.
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
        let cap = self.capacity;
        let (kd, vd) = (k.data(), v.data());
        for ti in 0..t {
            for hi in 0..h {
                let dst = hi * cap * d + (pos0 + ti) * d;
                let src = ti * w + hi * d;
                self.k[dst..dst + d].copy_from_slice(&kd[src..src + d]);
                self.v[dst..dst + d].copy_from_slice(&vd[src..src + d]);
            }
        }
        Ok(())
    }

    /// A new cache holding a copy of this cache's first `len` positions, with the capacity that
    /// writing `len` positions under `limit` would have grown it to (so `limit == len` gives a
    /// compact copy of exactly `len` positions). Prefix caching uses it to start a sequence from
    /// another one's keys and values without recomputing them, and to shrink a finished
    /// sequence's cache to what it holds.
    pub fn prefix(&self, len: usize, limit: usize) -> Result<HostKv> {
        if len > self.capacity || len > limit {
            return Err(Error::Msg(format!(
                "kv prefix: {len} positions from a cache of {} (limit {limit})",
                self.capacity
            )));
        }
        let mut out = HostKv::new(self.n_kv_heads, self.head_dim);
        if len == 0 {
            return Ok(out);
        }
        let cap = Self::grown_capacity(len, limit);
        let (h, d, old) = (self.n_kv_heads, self.head_dim, self.capacity);
        let copy = |src: &[f32]| {
            let mut n = vec![0f32; h * cap * d];
            for hi in 0..h {
                n[hi * cap * d..hi * cap * d + len * d]
                    .copy_from_slice(&src[hi * old * d..hi * old * d + len * d]);
            }
            n
        };
        out.k = copy(&self.k);
        out.v = copy(&self.v);
        out.capacity = cap;
        Ok(out)
    }

    pub fn view(&self) -> LayerCache<'_> {
        LayerCache {
            k: &self.k,
            v: &self.v,
            capacity: self.capacity,
        }
    }

    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 4
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

    #[test]
    fn prefix_copies_the_first_positions() {
        let (h, d) = (2, 3);
        let mut kv = HostKv::new(h, d);
        kv.write(&rows(5, h * d, 0.0), &rows(5, h * d, 100.0), 0, 1000)
            .unwrap();
        assert_eq!(kv.capacity(), 256);
        // A compact copy of 3 positions, then one grown for a larger limit.
        for (limit, cap) in [(3, 3), (1000, 256)] {
            let p = kv.prefix(3, limit).unwrap();
            assert_eq!(p.capacity(), cap);
            let (a, b) = (kv.view(), p.view());
            for hi in 0..h {
                for pos in 0..3 {
                    let (s, t) = (hi * 256 * d + pos * d, hi * cap * d + pos * d);
                    assert_eq!(a.k[s..s + d], b.k[t..t + d]);
                    assert_eq!(a.v[s..s + d], b.v[t..t + d]);
                }
            }
        }
        // Writing after the prefix continues the sequence.
        let mut p = kv.prefix(3, 8).unwrap();
        p.write(&rows(2, h * d, 7.0), &rows(2, h * d, 9.0), 3, 8)
            .unwrap();
        assert_eq!(p.capacity(), 8);
        assert!(kv.prefix(300, 1000).is_err());
        assert!(kv.prefix(4, 3).is_err());
        assert_eq!(kv.prefix(0, 10).unwrap().bytes(), 0);
    }
}
