//! Per-sequence key/value cache (f32, the reference layout): for each layer, keys and values laid
//! out `(Hkv, S_cap, Dh)`. Capacity grows by doubling up to the session's context limit, so short
//! sessions of long-context models stay small.

use hf2q_tensor::op::LayerCache;
use hf2q_tensor::Tensor;

use crate::{Error, Result};

pub struct LayerKv {
    k: Vec<f32>,
    v: Vec<f32>,
    capacity: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl LayerKv {
    pub fn new(n_kv_heads: usize, head_dim: usize) -> LayerKv {
        LayerKv {
            k: Vec::new(),
            v: Vec::new(),
            capacity: 0,
            n_kv_heads,
            head_dim,
        }
    }

    fn grow(&mut self, need: usize, limit: usize) {
        if need <= self.capacity {
            return;
        }
        let cap = need.next_power_of_two().max(256).min(limit.max(need));
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

    /// Writes `k`, `v` `(T, Hkv*Dh)` at positions `pos0..pos0+T`.
    pub fn write(&mut self, k: &Tensor, v: &Tensor, pos0: usize, limit: usize) -> Result<()> {
        let (t, w) = k.dims2();
        let (h, d) = (self.n_kv_heads, self.head_dim);
        if w != h * d || v.dims2() != (t, w) {
            return Err(Error::Msg(format!(
                "kv write: k {:?} / v {:?} for {h} heads of {d}",
                k.shape(),
                v.shape()
            )));
        }
        if pos0 + t > limit {
            return Err(Error::Msg(format!(
                "context full: {} tokens exceed the limit of {limit}",
                pos0 + t
            )));
        }
        self.grow(pos0 + t, limit);
        let cap = self.capacity;
        for ti in 0..t {
            for hi in 0..h {
                let dst = hi * cap * d + (pos0 + ti) * d;
                self.k[dst..dst + d]
                    .copy_from_slice(&k.data()[ti * w + hi * d..ti * w + (hi + 1) * d]);
                self.v[dst..dst + d]
                    .copy_from_slice(&v.data()[ti * w + hi * d..ti * w + (hi + 1) * d]);
            }
        }
        Ok(())
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

/// One sequence's rows inside a batched forward, for one layer: rows `start..start+len` of the
/// batch activation are this sequence's tokens at positions `pos0..pos0+len`.
pub struct SeqRef<'a> {
    pub kv: &'a mut LayerKv,
    pub start: usize,
    pub len: usize,
    pub pos0: usize,
    pub limit: usize,
}

pub struct KvCache {
    pub layers: Vec<LayerKv>,
    /// Most positions this cache may hold.
    pub limit: usize,
}

impl KvCache {
    pub fn new(n_layers: usize, n_kv_heads: usize, head_dim: usize, limit: usize) -> KvCache {
        KvCache {
            layers: (0..n_layers)
                .map(|_| LayerKv::new(n_kv_heads, head_dim))
                .collect(),
            limit,
        }
    }
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerKv::bytes).sum()
    }
}
