//! Per-sequence key/value cache: one [`KvStore`] per layer (on the host, f16 or f32
//! `(Hkv, S_cap, Dh)` growing by doubling up to the limit; or on the device, allocated by the
//! backend on first write). Layers may differ in `Hkv` and `Dh` ([`KvCache::per_layer`]).

pub use hf2q_tensor::kv::{AffineKv, KeyCentering, KeyRope, KvType, KvTypes};
use hf2q_tensor::kv::{HostKv, KvStore};
use hf2q_tensor::paged::{PagedStep, PagedStore};

use crate::{Error, Result};

/// Where one layer's attention reads and writes keys and values in a batched forward.
pub enum LayerKv<'a> {
    /// One sequence's own cache of this layer.
    Seq(&'a mut KvStore),
    /// The layer's paged store, shared by every row of the step: one [`SeqRef`] covers the
    /// whole batch and each row's sequence, position and slot come from `step`.
    Paged {
        store: &'a mut PagedStore,
        step: &'a PagedStep,
    },
}

/// One sequence's rows inside a batched forward, for one layer: rows `start..start+len` of the
/// batch activation are this sequence's tokens at positions `pos0..pos0+len` (with a paged
/// store, all the step's rows, each at its own position).
pub struct SeqRef<'a> {
    pub kv: LayerKv<'a>,
    pub start: usize,
    pub len: usize,
    pub pos0: usize,
    pub limit: usize,
}

pub struct KvCache {
    pub layers: Vec<KvStore>,
    /// The captured one-token decode step over these layers (GPU only): it refers to this
    /// cache's device buffers, so it lives and dies with them.
    pub graph: Option<hf2q_cuda::backend::StepGraph>,
    /// Most positions this cache may hold.
    pub limit: usize,
}

impl KvCache {
    /// An empty cache whose host layers store keys and values as `ty` (one type or one each; a
    /// device backend uses its own type).
    pub fn new(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        limit: usize,
        ty: impl Into<KvTypes>,
    ) -> KvCache {
        let ty = ty.into();
        KvCache {
            layers: (0..n_layers)
                .map(|_| KvStore::new(n_kv_heads, head_dim, ty))
                .collect(),
            graph: None,
            limit,
        }
    }
    /// An empty cache of one layer per `(Hkv, Dh)` in `heads` (layers of their own head count
    /// and width, as Gemma 4's sliding and global layers).
    pub fn per_layer(heads: &[(usize, usize)], limit: usize, ty: impl Into<KvTypes>) -> KvCache {
        let types = vec![ty.into(); heads.len()];
        KvCache::per_layer_types(heads, &types, KeyCentering::DEFAULT, &[], limit)
    }
    /// [`KvCache::per_layer`] with each layer's own type (`types[i]` for `heads[i]`), quantized
    /// keys centred as `centering` says, following layer `i`'s RoPE `ropes[i]` (the rotation
    /// its keys get before they are written; none where `ropes` is shorter or holds `None`:
    /// [`HostKv::with_key_rope`]).
    pub fn per_layer_types(
        heads: &[(usize, usize)],
        types: &[KvTypes],
        centering: KeyCentering,
        ropes: &[Option<KeyRope>],
        limit: usize,
    ) -> KvCache {
        KvCache {
            layers: heads
                .iter()
                .zip(types)
                .enumerate()
                .map(|(i, (&(h, dh), &ty))| {
                    let rope = ropes.get(i).cloned().flatten();
                    let kv = HostKv::with_centering(h, dh, ty, centering).with_key_rope(rope);
                    KvStore::Host(kv)
                })
                .collect(),
            graph: None,
            limit,
        }
    }
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(KvStore::bytes).sum()
    }

    /// Whether every layer lives on the host (so [`KvCache::prefix`] can copy it). A device
    /// cache, or one with a captured decode graph, is not.
    pub fn is_host(&self) -> bool {
        self.graph.is_none() && self.layers.iter().all(|l| matches!(l, KvStore::Host(_)))
    }

    /// A new host cache of at most `limit` positions holding a copy of this cache's first
    /// `len` positions (their keys and values are final: attention at a position only reads
    /// positions before it), so a sequence whose tokens start with the same `len` tokens can
    /// skip computing them. `limit == len` gives a compact copy, of the same element type. Host
    /// caches only.
    pub fn prefix(&self, len: usize, limit: usize) -> Result<KvCache> {
        if !self.is_host() {
            return Err(Error::Msg(
                "only host KV caches can be copied (this one is on a device)".into(),
            ));
        }
        if len > self.limit || len > limit {
            return Err(Error::Msg(format!(
                "kv prefix: {len} positions from a cache of limit {} into one of limit {limit}",
                self.limit
            )));
        }
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                // A layer that never holds positions (a KV-shared layer reads another's)
                // stays empty.
                KvStore::Host(h) if h.bytes() == 0 => Ok(KvStore::Host(h.prefix(0, limit)?)),
                KvStore::Host(h) => Ok(KvStore::Host(h.prefix(len, limit)?)),
                KvStore::Device(_) => Err(Error::Msg("device KV cache".into())),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            layers,
            graph: None,
            limit,
        })
    }
}
