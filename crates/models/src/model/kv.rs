//! What a model's host KV caches store: one type for every layer ([`Model::set_kv_type`]), or
//! one per layer ([`Model::set_kv_layer_types`], which a folder's `kv_config.json` sets when the
//! model is loaded: `crate::kv_config`), and what that costs per position.
//!
//! Not here: the cache itself (`crate::kv_cache`, `hf2q_tensor::kv`), the device's cache type
//! (the [`hf2q_cuda::backend::CudaBackend`]'s).

use hf2q_tensor::kv::{KeyCentering, KeyRope, KvType, KvTypes};

use super::Model;
use crate::kv_cache::KvCache;
use crate::{Error, Result};

impl Model {
    /// What the host KV caches made from now on store keys and values as, in every layer (one
    /// type, or one each as `KvTypes { k, v }`): f16 (the default: half the memory, values
    /// rounded once when written), f32 (bit-exact with the reference), a ggml block type or an
    /// affine layout. Replaces per-layer types. A GPU cache's type is the [`CudaBackend`]'s.
    ///
    /// [`CudaBackend`]: hf2q_cuda::backend::CudaBackend
    pub fn set_kv_type(&mut self, ty: impl Into<KvTypes>) {
        self.kv_type = ty.into();
        self.kv_layers = None;
    }
    /// Whether the host KV caches made from now on centre quantized keys, and on how many
    /// first positions ([`KeyCentering`]: on by default, [`KeyCentering::OFF`] to store keys
    /// as written). f16 and f32 keys are never centred.
    pub fn set_kv_key_centering(&mut self, centering: KeyCentering) {
        self.kv_centering = centering;
    }
    /// How new host caches centre quantized keys.
    pub fn kv_key_centering(&self) -> KeyCentering {
        self.kv_centering
    }
    /// The one type of every layer (the default's when the layers have their own:
    /// [`Model::kv_layer_types`]).
    pub fn kv_type(&self) -> KvTypes {
        self.kv_type
    }
    /// Each layer's own type (`types[i]` for layer `i`), as a `kv_config.json` gives them;
    /// refused unless there is one per layer.
    pub fn set_kv_layer_types(&mut self, types: Vec<KvTypes>) -> Result<()> {
        if types.len() != self.config.n_layers {
            return Err(Error::Msg(format!(
                "{} KV cache types for a model of {} layers",
                types.len(),
                self.config.n_layers
            )));
        }
        self.kv_layers = Some(types);
        Ok(())
    }
    /// The layers' own types, when they have them.
    pub fn kv_layer_types(&self) -> Option<&[KvTypes]> {
        self.kv_layers.as_deref()
    }
    /// Layer `i`'s type.
    fn layer_kv_type(&self, i: usize) -> KvTypes {
        match &self.kv_layers {
            Some(t) => t.get(i).copied().unwrap_or(self.kv_type),
            None => self.kv_type,
        }
    }
    /// The cache's types in a line: `q8_0`, or each layer's, run-length counted (`affine8g64
    /// x2, affine4g64 x28`).
    pub fn kv_type_name(&self) -> String {
        let Some(types) = &self.kv_layers else {
            return self.kv_type.name();
        };
        let mut runs: Vec<(String, usize)> = Vec::new();
        for t in types {
            match runs.last_mut() {
                Some((name, n)) if *name == t.name() => *n += 1,
                _ => runs.push((t.name(), 1)),
            }
        }
        let runs: Vec<String> = runs.iter().map(|(t, n)| format!("{t} x{n}")).collect();
        runs.join(", ")
    }
    /// Whether each layer's host KV cache type suits its head width (a block type such as Q8_0
    /// needs whole blocks, an affine layout whole groups): an error naming the width when not.
    pub fn check_kv_type(&self) -> Result<()> {
        for i in 0..self.config.n_layers {
            let (_, dh) = self.config.heads_of(i);
            self.layer_kv_type(i).check_head_dim(dh)?;
        }
        Ok(())
    }
    /// Bytes of keys and values one position takes in a host cache of the model's KV types,
    /// summed over layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.kv_bytes_per_layer(|i| self.layer_kv_type(i))
    }
    /// [`Model::kv_bytes_per_token`] for a cache of type `ty` in every layer (one type, or one
    /// each).
    pub fn kv_bytes_per_token_as(&self, ty: impl Into<KvTypes>) -> usize {
        let ty = ty.into();
        self.kv_bytes_per_layer(|_| ty)
    }
    fn kv_bytes_per_layer(&self, ty: impl Fn(usize) -> KvTypes) -> usize {
        let c = &self.config;
        (0..c.n_layers)
            .map(|i| {
                let (kv, dh) = c.heads_of(i);
                kv * ty(i).row_bytes(dh)
            })
            .sum()
    }
    /// Bytes one sequence's cache holds whatever its length: the centred key planes' first
    /// positions and centres ([`KeyCentering::fixed_bytes_per_head`]) in every layer whose keys
    /// are quantized; 0 for f16 / f32 keys or with centring off. A cache of `n` tokens takes
    /// `n * kv_bytes_per_token() + kv_fixed_bytes()`.
    pub fn kv_fixed_bytes(&self) -> usize {
        let c = &self.config;
        (0..c.n_layers)
            .filter(|&i| !matches!(self.layer_kv_type(i).k, KvType::F16 | KvType::F32))
            .map(|i| {
                let (kv, dh) = c.heads_of(i);
                let rope = self
                    .blocks
                    .get(i)
                    .and_then(|b| b.rope())
                    .and_then(KeyRope::of);
                kv * self.kv_centering.fixed_bytes_per_head(dh, rope.as_ref())
            })
            .sum()
    }
    /// An empty KV cache for one sequence of at most `limit` positions (0 = context length).
    pub fn new_cache(&self, limit: usize) -> KvCache {
        let limit = if limit == 0 {
            self.config.context_length
        } else {
            limit
        };
        let c = &self.config;
        let types: Vec<KvTypes> = (0..c.layer_heads.len())
            .map(|i| self.layer_kv_type(i))
            .collect();
        // Each layer's RoPE, so that centred keys follow the rotation (`KeyCentering`).
        let ropes: Vec<Option<KeyRope>> = (0..c.layer_heads.len())
            .map(|i| {
                let b = self.blocks.get(i);
                b.and_then(|b| b.rope()).and_then(KeyRope::of)
            })
            .collect();
        KvCache::per_layer_types(&c.layer_heads, &types, self.kv_centering, &ropes, limit)
    }
}
