//! hf2q-cpu: the CPU backend, [`CpuBackend`], implementing `hf2q_tensor`'s `Backend` and
//! `TrainBackend`.
//!
//! The reference path is scalar, obvious f32 code (parallel over rows/heads with rayon); every
//! faster kernel, CPU SIMD ([`kernels`]) or CUDA (`hf2q-cuda`), is held to its results. Also here:
//! the tiled attention (`attention.rs`) and its dispatch over a cache's key and value types
//! ([`kv_view`]), the paged KV cache's host twin ([`paged`]), dense f32 products ([`dense`]) and the training ops
//! (`train/`). Not here: the op set's types and checks (`hf2q_tensor::op`, `train_op`).

use rayon::prelude::*;

mod attention;
mod decode;
pub mod dense;
pub mod kernels;
pub mod kv_view;
mod low_rank;
pub mod paged;
pub(crate) mod train;

pub use attention::{BlockRead, KvRead};

use kernels::ActBits;

use hf2q_tensor::kv::KvStore;
use hf2q_tensor::op::{
    check_rows, same_shape, AttentionParams, Backend, GateAct, LayerCache, MatmulSpec, RopeParams,
    RopeStyle,
};
use hf2q_tensor::paged::{HostPaged, PagedStep, PagedStore};
use hf2q_tensor::weight::dot;
use hf2q_tensor::{Error, QTensor, Result, Tensor};

/// Which matmul `CpuBackend::linear` runs.
///
/// The reference is the golden-parity path (it matches transformers). `Fast` runs the SIMD
/// kernels with 16-bit-equivalent activations (two 8-bit parts) and meets the end-to-end gate
/// against the reference (argmax >= 98/100, mean KL <= 1e-3 on SmolLM2, Gemma 3 and Qwen2.5).
/// `Fast8` rounds activations to one 8-bit part as llama.cpp does: faster prefill, and about
/// llama.cpp's accuracy (SmolLM2 mean KL 3e-3, Gemma 3 1.4e-2), which is below the gate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulPath {
    /// SIMD kernels, activations in two 8-bit parts ([`kernels::ActBits::Split16`]).
    Fast,
    /// SIMD kernels, activations in one 8-bit part ([`kernels::ActBits::Q8`]).
    Fast8,
    /// The scalar reference: rows dequantized to f32, f32 activations ([`QTensor::matmul`]).
    #[default]
    Reference,
}

/// Sees the input of every `linear` before the matmul (importance-matrix collection).
pub trait LinearObserver: Send + Sync + std::fmt::Debug {
    /// `x (T, C)` is about to be multiplied by `w (R, C)`.
    fn observe(&self, w: &QTensor, x: &Tensor);
}

#[derive(Clone, Debug, Default)]
pub struct CpuBackend {
    pub matmul: MatmulPath,
    /// Called at the start of every `linear`.
    pub observer: Option<std::sync::Arc<dyn LinearObserver>>,
    /// The fast paths' re-laid-out weights, made as each weight is first used.
    pub packed: PackedWeights,
}

/// Weights re-laid out for the fast kernels ([`kernels::pack`]), made on a weight's first use
/// and kept by the address and length of its stored bytes, each entry with a handle on those
/// bytes (as the GPU backend's weight cache: while the entry lives, the address cannot be
/// reused by another weight). Packing hands the weight's mapped pages back as it copies them
/// ([`hf2q_tensor::Bytes::release_pages`]): the copy replaces them in memory, it does not add to it.
/// A clone starts empty (it is a cache).
#[derive(Default)]
pub struct PackedWeights(PackedMap);

/// By weight: its bytes and its packed copy (`None`: packing failed, not tried again).
type PackedMap = std::sync::Mutex<(
    std::collections::BTreeMap<
        (usize, usize),
        (hf2q_tensor::Bytes, Option<std::sync::Arc<kernels::Packed>>),
    >,
    kernels::PackArena,
)>;

/// A weight's key in [`PackedWeights`]: the address and length of its stored bytes.
fn packed_key(w: &QTensor) -> Option<((usize, usize), &hf2q_tensor::Bytes)> {
    match &w.data {
        hf2q_tensor::WeightData::Ggml { data, .. } => {
            Some(((data.as_slice().as_ptr() as usize, data.len()), data))
        }
        hf2q_tensor::WeightData::Affine { .. } => None,
    }
}

impl PackedWeights {
    pub const fn new() -> PackedWeights {
        PackedWeights(std::sync::Mutex::new((
            std::collections::BTreeMap::new(),
            kernels::PackArena::new(),
        )))
    }

    /// The packed copy of `w` if one was made (by [`PackedWeights::get`]).
    pub fn existing(&self, w: &QTensor) -> Option<std::sync::Arc<kernels::Packed>> {
        let (key, _) = packed_key(w)?;
        let guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        guard.0.get(&key).and_then(|(_, p)| p.clone())
    }

    /// The packed copy of `w`, made now if this is its first use; `None` for weights the fast
    /// kernels read as they are.
    pub fn get(&self, w: &QTensor) -> Option<std::sync::Arc<kernels::Packed>> {
        if !kernels::packs(w) {
            return None;
        }
        let (key, data) = packed_key(w)?;
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (map, arena) = &mut *guard;
        if let Some((_, p)) = map.get(&key) {
            return p.clone();
        }
        let p = kernels::pack_in(arena, w).map(std::sync::Arc::new);
        map.insert(key, (data.clone(), p.clone()));
        p
    }

    /// Drops the packed copy of `w` and the handle on its bytes, if one was made (a weight
    /// taken out of a model); a later use of `w` packs it again.
    pub fn forget(&self, w: &QTensor) {
        if let Some((key, _)) = packed_key(w) {
            let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
            guard.0.remove(&key);
        }
    }
}

impl Clone for PackedWeights {
    fn clone(&self) -> PackedWeights {
        PackedWeights::new()
    }
}

impl std::fmt::Debug for PackedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let bytes: usize = guard
            .0
            .values()
            .flat_map(|(_, p)| p)
            .map(|p| p.bytes())
            .sum();
        write!(f, "PackedWeights({} weights, {bytes} bytes)", guard.0.len())
    }
}

impl CpuBackend {
    /// The end of `linear`: the bias added to the (T, R) product.
    fn finish_linear(
        w: &QTensor,
        bias: Option<&[f32]>,
        t: usize,
        mut out: Vec<f32>,
    ) -> Result<Tensor> {
        if let Some(b) = bias {
            if b.len() != w.rows {
                return Err(Error::Shape(format!(
                    "linear '{}': bias has {} values, {} rows",
                    w.name,
                    b.len(),
                    w.rows
                )));
            }
            out.chunks_mut(w.rows)
                .for_each(|r| r.iter_mut().zip(b).for_each(|(o, bi)| *o += bi));
        }
        Tensor::new(&[t, w.rows], out)
    }

    /// Causal attention over a host cache view (f32 or f16 values, or Q8_0 blocks): the tiled kernel
    /// (`attention.rs`) on the fast paths, the scalar reference of every device's `attend` on
    /// the reference path.
    pub fn attention<K: KvRead, V: KvRead>(
        &self,
        q: &Tensor,
        cache: &LayerCache<'_, K, V>,
        pos0: usize,
        p: &AttentionParams,
    ) -> Result<Tensor> {
        match self.matmul {
            MatmulPath::Reference => self.attention_reference(q, cache, pos0, p),
            MatmulPath::Fast | MatmulPath::Fast8 => attention::attention(q, cache, pos0, p),
        }
    }

    /// The scalar reference attention (each key and value row widened, or dequantized, to f32 as
    /// it is read).
    pub fn attention_reference<K: KvRead, V: KvRead>(
        &self,
        q: &Tensor,
        cache: &LayerCache<'_, K, V>,
        pos0: usize,
        p: &AttentionParams,
    ) -> Result<Tensor> {
        let t = hf2q_tensor::op::check_attention(q, cache, pos0, p)?;
        let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
        let width = h * dh;
        let group = h / hkv;
        let mut out = vec![0f32; t * width];
        // One task per (token, head): scores over the visible keys, softmax in f32, weighted sum.
        out.par_chunks_mut(dh).enumerate().for_each(|(idx, o)| {
            let (ti, hi) = (idx / h, idx % h);
            let qpos = pos0 + ti;
            let kvh = hi / group;
            let lo = match p.window {
                Some(w) => (qpos + 1).saturating_sub(w),
                None => 0,
            };
            let qv = &q.data()[ti * width + hi * dh..ti * width + (hi + 1) * dh];
            // A key and a value row's lengths in cache elements (Dh values, or Dh / 32 blocks).
            let (rk, rv) = (dh / K::VALUES, dh / V::VALUES);
            let (kbase, vbase) = (kvh * cache.capacity * rk, kvh * cache.capacity * rv);
            let mut row = vec![0f32; dh];
            // Centred keys: a sink position's score from its f16 row; a later one's from its
            // plane row plus `q · c(j)`, the centre at its position (`KeyCentre`).
            let centre = cache.centre.as_ref();
            let (sinks, qc) = centre.map_or((0, None), |c| (c.sinks, Some(c.q_centre(kvh, qv))));
            let mut scores: Vec<f32> = (lo..=qpos)
                .map(|j| match centre {
                    Some(c) if j < sinks => {
                        let sink = c.sink_row(kvh, j, dh);
                        row.iter_mut().zip(sink).for_each(|(r, s)| *r = s.to_f32());
                        dot(qv, &row) * p.scale
                    }
                    _ => {
                        K::dequantize_row(&cache.k[kbase + j * rk..kbase + (j + 1) * rk], &mut row);
                        match (centre, &qc) {
                            (Some(c), Some(qc)) => {
                                (dot(qv, &row) + c.q_dot_at(kvh, qc, j)) * p.scale
                            }
                            _ => dot(qv, &row) * p.scale,
                        }
                    }
                })
                .collect();
            // A sink (GPT-OSS) is one more score whose value is zero: it joins the max and
            // the denominator only (`exp(-inf) = 0` without one).
            let sink = p.sink(hi);
            let m = scores.iter().cloned().fold(sink, f32::max);
            let mut sum = if sink == f32::NEG_INFINITY {
                0f32
            } else {
                (sink - m).exp()
            };
            for s in scores.iter_mut() {
                *s = (*s - m).exp();
                sum += *s;
            }
            o.iter_mut().for_each(|v| *v = 0.0);
            for (s, j) in scores.iter().zip(lo..=qpos) {
                let w = s / sum;
                V::dequantize_row(&cache.v[vbase + j * rv..vbase + (j + 1) * rv], &mut row);
                for (ov, vv) in o.iter_mut().zip(&row) {
                    *ov += w * vv;
                }
            }
        });
        Tensor::new(&[t, width], out)
    }

    pub const FAST: CpuBackend = CpuBackend {
        matmul: MatmulPath::Fast,
        observer: None,
        packed: PackedWeights::new(),
    };
    pub const REFERENCE: CpuBackend = CpuBackend {
        matmul: MatmulPath::Reference,
        observer: None,
        packed: PackedWeights::new(),
    };
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU with the tanh approximation (PyTorch `gelu(approximate="tanh")`).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

impl Backend for CpuBackend {
    fn embedding(&self, table: &QTensor, ids: &[u32], scale: f32) -> Result<Tensor> {
        let d = table.cols;
        let mut out = vec![0f32; ids.len() * d];
        // A table already packed (a tied output layer) is read from its packed copy: the
        // original's pages were handed back, and reading them would map them in again.
        let packed = self.packed.existing(table);
        for (row, &id) in out.chunks_mut(d.max(1)).zip(ids) {
            if id as usize >= table.rows {
                return Err(Error::Shape(format!(
                    "token id {id} is outside the vocabulary of {}",
                    table.rows
                )));
            }
            match &packed {
                Some(p) => p.dequantize_row(id as usize, row)?,
                None => table.dequantize_row(id as usize, row)?,
            }
            if scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        Tensor::new(&[ids.len(), d], out)
    }

    fn rms_norm(&self, x: &Tensor, w: &[f32], eps: f32, offset: f32) -> Result<Tensor> {
        let (_, c) = x.dims2();
        if w.len() != c {
            return Err(Error::Shape(format!(
                "rms_norm: weight has {} values, rows have {c}",
                w.len()
            )));
        }
        let mut out = x.clone();
        out.data_mut().par_chunks_mut(c).for_each(|row| {
            let ss: f32 = row.iter().map(|v| v * v).sum::<f32>() / c as f32;
            let inv = 1.0 / (ss + eps).sqrt();
            for (v, wi) in row.iter_mut().zip(w) {
                *v = *v * inv * (wi + offset);
            }
        });
        Ok(out)
    }

    fn linear(&self, x: &Tensor, w: &QTensor, bias: Option<&[f32]>) -> Result<Tensor> {
        if let Some(o) = &self.observer {
            o.observe(w, x);
        }
        let (t, c) = x.dims2();
        if c != w.cols {
            return Err(Error::Shape(format!(
                "linear '{}': input has {c} features, weight takes {}",
                w.name, w.cols
            )));
        }
        let mut out = vec![0f32; t * w.rows];
        let bits = match self.matmul {
            MatmulPath::Fast => ActBits::Split16,
            MatmulPath::Fast8 => ActBits::Q8,
            MatmulPath::Reference => {
                w.matmul(x.data(), t, &mut out)?;
                return Self::finish_linear(w, bias, t, out);
            }
        };
        match self.packed.get(w) {
            Some(p) => kernels::linear_packed(w, &p, x.data(), t, &mut out, bits)?,
            None => kernels::linear(w, x.data(), t, &mut out, bits)?,
        }
        Self::finish_linear(w, bias, t, out)
    }

    fn rope(&self, x: &mut Tensor, n_heads: usize, pos0: usize, p: &RopeParams) -> Result<()> {
        rope_at(x, n_heads, p, |ti| (pos0 + ti) as f32)
    }

    fn paged_rope_store(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        n_heads: usize,
        kv: &mut PagedStore,
        step: &PagedStep,
        p: &RopeParams,
    ) -> Result<()> {
        let r = step.len();
        if q.dims2().0 != r || k.dims2().0 != r || v.dims2() != k.dims2() {
            return Err(Error::Shape(format!(
                "paged rope_store: {r} rows, q {:?}, k {:?}, v {:?}",
                q.shape(),
                k.shape(),
                v.shape()
            )));
        }
        let n_kv_heads = match kv {
            PagedStore::Host(HostPaged::F16(l)) => l.layout.n_kv_heads,
            PagedStore::Host(HostPaged::F32(l)) => l.layout.n_kv_heads,
            PagedStore::Device(_) => {
                return Err(Error::Msg(
                    "cpu paged rope_store: the cache is a device backend's".into(),
                ))
            }
        };
        let at = |ti: usize| step.pos[ti] as f32;
        rope_at(q, n_heads, p, at)?;
        rope_at(k, n_kv_heads, p, at)?;
        match kv {
            PagedStore::Host(HostPaged::F16(l)) => l.write(k.data(), v.data(), &step.slots),
            PagedStore::Host(HostPaged::F32(l)) => l.write(k.data(), v.data(), &step.slots),
            PagedStore::Device(_) => unreachable!("refused above"),
        }
    }

    fn paged_attend(
        &self,
        q: &Tensor,
        kv: &PagedStore,
        step: &PagedStep,
        p: &AttentionParams,
    ) -> Result<Tensor> {
        let rows = step.rows();
        let out = match kv {
            PagedStore::Host(HostPaged::F16(l)) => paged::attention(l, q.data(), &rows, p)?,
            PagedStore::Host(HostPaged::F32(l)) => paged::attention(l, q.data(), &rows, p)?,
            PagedStore::Device(_) => {
                return Err(Error::Msg(
                    "cpu paged attention: the cache is a device backend's".into(),
                ))
            }
        };
        Tensor::new(&[step.len(), p.n_heads * p.head_dim], out)
    }

    fn kv_write(
        &self,
        kv: &mut KvStore,
        k: &Tensor,
        v: &Tensor,
        pos0: usize,
        limit: usize,
    ) -> Result<()> {
        match kv {
            KvStore::Host(h) => h.write(k, v, pos0, limit),
            _ => Err(Error::Msg(
                "the CPU backend was given a device KV cache".into(),
            )),
        }
    }

    fn attend(&self, q: &Tensor, kv: &KvStore, pos0: usize, p: &AttentionParams) -> Result<Tensor> {
        match kv {
            KvStore::Host(h) => kv_view::visit(
                h.view(),
                kv_view::Attend {
                    be: self,
                    q,
                    pos0,
                    p,
                },
            )?,
            _ => Err(Error::Msg(
                "the CPU backend was given a device KV cache".into(),
            )),
        }
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        same_shape(gate, up, "silu_mul")?;
        if self.matmul != MatmulPath::Reference {
            // The fast paths: a vectorised exp (relative error ~1e-6, far below the activation
            // rounding of their matmuls), rows over rayon.
            return Tensor::new(gate.shape(), attention::silu_mul(gate.data(), up.data()));
        }
        let d: Vec<f32> = gate
            .data()
            .iter()
            .zip(up.data())
            .map(|(g, u)| silu(*g) * u)
            .collect();
        Tensor::new(gate.shape(), d)
    }

    fn gelu_tanh_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        same_shape(gate, up, "gelu_tanh_mul")?;
        let d: Vec<f32> = gate
            .data()
            .iter()
            .zip(up.data())
            .map(|(g, u)| gelu_tanh(*g) * u)
            .collect();
        Tensor::new(gate.shape(), d)
    }

    /// The plain activations through their own ops; GPT-OSS's clamped SwiGLU element by
    /// element ([`hf2q_tensor::op::clamped_swiglu`]).
    fn gated_act(&self, gate: &Tensor, up: &Tensor, act: GateAct) -> Result<Tensor> {
        match act {
            GateAct::Silu => self.silu_mul(gate, up),
            GateAct::GeluTanh => self.gelu_tanh_mul(gate, up),
            GateAct::ClampedSwiglu { alpha, limit } => {
                same_shape(gate, up, "gated_act")?;
                let d = gate
                    .data()
                    .iter()
                    .zip(up.data())
                    .map(|(&g, &u)| hf2q_tensor::op::clamped_swiglu(g, u, alpha, limit))
                    .collect();
                Tensor::new(gate.shape(), d)
            }
        }
    }

    fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        same_shape(x, y, "add")?;
        x.data_mut()
            .iter_mut()
            .zip(y.data())
            .for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        x.data_mut()
            .iter_mut()
            .for_each(|v| *v = (*v / cap).tanh() * cap);
        Ok(())
    }

    fn rows(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let c = check_rows(x, start, len)?;
        Tensor::new(&[len, c], x.data()[start * c..(start + len) * c].to_vec())
    }

    fn concat_rows(&self, parts: &[Tensor]) -> Result<Tensor> {
        let c = parts.first().map_or(0, |p| p.dims2().1);
        let mut out = Vec::with_capacity(parts.iter().map(Tensor::len).sum());
        for p in parts {
            if p.dims2().1 != c {
                return Err(Error::Shape(format!(
                    "concat_rows: rows of {} and {c} values",
                    p.dims2().1
                )));
            }
            out.extend_from_slice(p.data());
        }
        Tensor::new(&[out.len() / c.max(1), c], out)
    }

    fn to_host(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }

    fn upload(&self, x: &Tensor) -> Result<Tensor> {
        if !x.is_host() {
            return Err(Error::Msg(
                "the CPU backend was given a device tensor".into(),
            ));
        }
        Ok(x.clone())
    }

    /// Each expert's tokens gathered straight from `x` and its weighted results added straight
    /// into the output, experts in ascending order (transformers' order of `index_add_`).
    fn moe_ffn(
        &self,
        x: &Tensor,
        logits: &Tensor,
        experts: &hf2q_tensor::moe::Experts,
        spec: &hf2q_tensor::moe::MoeSpec<'_>,
    ) -> Result<Tensor> {
        let t = hf2q_tensor::moe::check_moe(x, logits, experts)?;
        let route = hf2q_tensor::moe::route(logits.data(), experts.n_experts(), spec)?;
        let d = experts.hidden();
        let mut out = vec![0f32; t * d];
        for (e, hits) in route.by_expert(experts.n_experts()).iter().enumerate() {
            if hits.is_empty() {
                continue;
            }
            let mut xe = Vec::with_capacity(hits.len() * d);
            for &(tok, _) in hits {
                xe.extend_from_slice(x.row(tok));
            }
            let xe = Tensor::new(&[hits.len(), d], xe)?;
            let y = hf2q_tensor::moe::expert_mlp(self, &xe, experts, e, spec.act)?;
            for (i, &(tok, w)) in hits.iter().enumerate() {
                for (o, v) in out[tok * d..(tok + 1) * d].iter_mut().zip(y.row(i)) {
                    *o += w * v;
                }
            }
        }
        Tensor::new(&[t, d], out)
    }

    fn matmul(&self, a: &Tensor, b: &Tensor, spec: MatmulSpec) -> Result<Tensor> {
        dense::matmul(a, b, spec)
    }

    fn matmul_acc(&self, out: &mut Tensor, a: &Tensor, b: &Tensor, spec: MatmulSpec) -> Result<()> {
        dense::matmul_acc(out, a, b, spec)
    }

    fn add_row_terms(
        &self,
        x: &Tensor,
        y: &mut Tensor,
        terms: &[hf2q_tensor::lora_rows::RowsTerm<'_>],
    ) -> Result<()> {
        dense::add_row_terms(x, y, terms)
    }
}

/// RoPE in place on `x (T, nh * Dh)`, row `ti` at position `pos(ti)` (divided by the linear
/// scale): the rotation of every backend's `rope` (`(pos0 + ti)`) and paged `rope_store` (each
/// row its own position).
fn rope_at(
    x: &mut Tensor,
    n_heads: usize,
    p: &RopeParams,
    pos: impl Fn(usize) -> f32 + Sync,
) -> Result<()> {
    let (_, width) = x.dims2();
    let dh = hf2q_tensor::op::check_rope(x, n_heads, p)?;
    let inv = p.inv_freqs();
    let half = p.dims / 2;
    x.data_mut()
        .par_chunks_mut(width)
        .enumerate()
        .for_each(|(ti, row)| {
            let pos = pos(ti) / p.linear_scale;
            let cs: Vec<(f32, f32)> = inv
                .iter()
                .map(|f| {
                    let a = pos * f;
                    (a.cos(), a.sin())
                })
                .collect();
            for head in row.chunks_mut(dh) {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = match p.style {
                        RopeStyle::Neox => (i, i + half),
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * c - x1 * s;
                    head[b] = x0 * s + x1 * c;
                }
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hf2q_tensor::op::RopeStyle;

    #[test]
    fn rope_styles_agree_after_permutation() {
        // Interleaved rope on a permuted head equals neox rope on the original head, permuted.
        let dh = 8;
        let x: Vec<f32> = (0..dh).map(|i| i as f32 * 0.3 - 1.0).collect();
        // GGUF permutation: neox index i (first half) -> 2i, i+half -> 2i+1.
        let mut xp = vec![0f32; dh];
        for i in 0..dh / 2 {
            xp[2 * i] = x[i];
            xp[2 * i + 1] = x[i + dh / 2];
        }
        let mk = |style| RopeParams {
            style,
            theta: 10000.0,
            dims: dh,
            freq_factors: None,
            linear_scale: 1.0,
        };
        let mut a = Tensor::new(&[1, dh], x.clone()).unwrap();
        let mut b = Tensor::new(&[1, dh], xp).unwrap();
        CpuBackend::REFERENCE
            .rope(&mut a, 1, 7, &mk(RopeStyle::Neox))
            .unwrap();
        CpuBackend::REFERENCE
            .rope(&mut b, 1, 7, &mk(RopeStyle::Interleaved))
            .unwrap();
        for i in 0..dh / 2 {
            assert!((a.data()[i] - b.data()[2 * i]).abs() < 1e-6);
            assert!((a.data()[i + dh / 2] - b.data()[2 * i + 1]).abs() < 1e-6);
        }
    }

    #[test]
    fn mxfp4_weights_run_on_every_path() {
        // Two rows of two MXFP4 blocks. The fast paths round the activations to 8-bit blocks
        // (`kernels::q8act`): two parts (`Fast`) leave at most max|x_block| / (127 * 256) per
        // value, one part (`Fast8`) max|x_block| / 254, so an output moves by at most that
        // times Σ|w| (|x| <= 1 here), plus f32 summation slack (1e-5 relative).
        let mut bytes = Vec::new();
        for b in 0..4u8 {
            bytes.push(124 + b);
            bytes.extend((0..16u8).map(|j| j.wrapping_mul(29).wrapping_add(b)));
        }
        let w = QTensor::ggml(
            "w",
            hf2q_tensor::GgmlType::MXFP4,
            2,
            64,
            hf2q_tensor::storage::Bytes::from_vec(bytes),
        )
        .unwrap();
        let x = Tensor::new(
            &[3, 64],
            (0..192).map(|i| (i as f32 * 0.37).sin()).collect(),
        )
        .unwrap();
        let want = CpuBackend::REFERENCE.linear(&x, &w, None).unwrap();
        assert!(want.data().iter().any(|v| *v != 0.0));
        let wd = w.to_f32().unwrap();
        let l1: Vec<f32> = wd
            .chunks(64)
            .map(|r| r.iter().map(|v| v.abs()).sum())
            .collect();
        for (be, per_unit) in [
            (CpuBackend::FAST, 1.0 / (127.0 * 256.0)),
            (
                CpuBackend {
                    matmul: MatmulPath::Fast8,
                    ..CpuBackend::default()
                },
                1.0 / 254.0,
            ),
        ] {
            let got = be.linear(&x, &w, None).unwrap();
            for (i, (g, r)) in got.data().iter().zip(want.data()).enumerate() {
                let tol = l1[i % 2] * (per_unit + 1e-5);
                assert!((g - r).abs() <= tol, "{:?} out[{i}]: {g} vs {r}", be.matmul);
            }
        }
    }

    #[test]
    fn attention_single_key_returns_value() {
        let p = AttentionParams {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 2,
            scale: 1.0,
            window: None,
            sinks: None,
        };
        let k = vec![1.0, 0.0, 0.0, 0.0];
        let v = vec![3.0, 4.0, 0.0, 0.0];
        let cache = LayerCache {
            k: &k,
            v: &v,
            capacity: 2,
            centre: None,
        };
        let q = Tensor::new(&[1, 4], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        let o = CpuBackend::REFERENCE.attention(&q, &cache, 0, &p).unwrap();
        assert_eq!(o.data(), &[3.0, 4.0, 3.0, 4.0]);
        assert!(CpuBackend::REFERENCE.attention(&q, &cache, 2, &p).is_err());
    }
}
