//! Per-sequence key/value cache: one [`KvStore`] per layer (on the host, f32 `(Hkv, S_cap, Dh)`
//! growing by doubling up to the limit; or on the device, allocated by the backend on first
//! write).

use hf2q_tensor::kv::KvStore;

/// One sequence's rows inside a batched forward, for one layer: rows `start..start+len` of the
/// batch activation are this sequence's tokens at positions `pos0..pos0+len`.
pub struct SeqRef<'a> {
    pub kv: &'a mut KvStore,
    pub start: usize,
    pub len: usize,
    pub pos0: usize,
    pub limit: usize,
}

pub struct KvCache {
    pub layers: Vec<KvStore>,
    /// The captured one-token decode step over these layers (GPU only): it refers to this
    /// cache's device buffers, so it lives and dies with them.
    pub graph: Option<hf2q_tensor::cuda_backend::StepGraph>,
    /// Most positions this cache may hold.
    pub limit: usize,
}

impl KvCache {
    pub fn new(n_layers: usize, n_kv_heads: usize, head_dim: usize, limit: usize) -> KvCache {
        KvCache {
            layers: (0..n_layers)
                .map(|_| KvStore::new(n_kv_heads, head_dim))
                .collect(),
            graph: None,
            limit,
        }
    }
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(KvStore::bytes).sum()
    }
}
