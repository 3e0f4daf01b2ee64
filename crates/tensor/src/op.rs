//! The closed op set every model is written against, and the `Backend` trait with one method per
//! op: a device that lacks an op fails to compile, not at run time.
//!
//! Shapes (letters used throughout): T tokens in this call, D model width, H query heads,
//! Hkv key/value heads, Dh head width, R/C a weight's output/input features, S cached positions.

use crate::kv::{KvStore, KvType};
use crate::paged::{PagedLayout, PagedStep, PagedStore};
use crate::{QTensor, Result, Tensor};

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs (i, i + Dh/2): Hugging Face `rotate_half`, ggml NEOX.
    Neox,
    /// Pairs (2i, 2i+1): ggml's "normal" mode, used with GGUF Llama weights (whose q/k rows the
    /// converter permuted so that this equals the checkpoint's `rotate_half`).
    Interleaved,
}

#[derive(Clone, Debug)]
pub struct RopeParams {
    pub style: RopeStyle,
    /// Base θ.
    pub theta: f32,
    /// Rotated dimensions (Dh for every model we load).
    pub dims: usize,
    /// Per-frequency divisors (Llama 3 scaling, `rope_freqs.weight`), `dims / 2` values.
    pub freq_factors: Option<Vec<f32>>,
    /// Linear position scaling: positions are divided by this (1.0 = none).
    pub linear_scale: f32,
}

impl RopeParams {
    /// Inverse frequencies θ^(-2i/dims) / factor_i, computed in f64 and rounded once.
    pub fn inv_freqs(&self) -> Vec<f32> {
        (0..self.dims / 2)
            .map(|i| {
                let f = (self.theta as f64).powf(-(2.0 * i as f64) / self.dims as f64);
                let div = self.freq_factors.as_ref().map_or(1.0, |ff| ff[i] as f64);
                (f / div) as f32
            })
            .collect()
    }
}

#[derive(Clone, Debug)]
pub struct AttentionParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplier applied to q·k.
    pub scale: f32,
    /// Keys at distance >= window from the query are masked (Gemma 3 local layers).
    pub window: Option<usize>,
    /// Attention sinks (GPT-OSS), `(H)`: per query head a learned logit that joins the softmax
    /// as one more column whose value is zero, i.e. `exp(sink - m)` is added to the softmax's
    /// denominator and nothing to its numerator. `None`: a plain softmax.
    pub sinks: Option<std::sync::Arc<[f32]>>,
}

impl AttentionParams {
    /// Head `h`'s sink logit, or `-inf` (no sink: `exp(-inf) = 0` adds nothing).
    #[inline]
    pub fn sink(&self, h: usize) -> f32 {
        self.sinks
            .as_ref()
            .and_then(|s| s.get(h).copied())
            .unwrap_or(f32::NEG_INFINITY)
    }
}

/// Key/value cache of one layer, laid out `(Hkv, S_cap, Dh)` so a head's keys are contiguous.
/// `K` and `V` are what the cache stores keys and values as (each its own, as llama.cpp's
/// `-ctk/-ctv`): f32, f16 (half the memory; attention widens each row to f32 as it reads it, so
/// only the rounding of the stored values differs), or blocks of several values
/// ([`crate::kv::BlockQ8_0`]: a row of `Dh` values is `Dh / 32` blocks, so the slices hold
/// `Hkv * S_cap * Dh / K::VALUES` elements).
pub struct LayerCache<'a, K = f32, V = K> {
    pub k: &'a [K],
    pub v: &'a [V],
    /// S_cap: capacity in positions (stride between heads).
    pub capacity: usize,
    /// Centred keys (a quantized key plane of a [`crate::kv::HostKv`] that centres them:
    /// [`crate::kv::KeyCentering`]); `None`: every key is its plane row as stored.
    pub centre: Option<KeyCentre<'a>>,
}

pub use crate::kv_centre::{KeyCentre, QCentre, Rotated};

impl<K: KvElem, V> LayerCache<'_, K, V> {
    /// The keys as attention reads them, in f32, `(Hkv, S_cap, Dh)` for `hkv` heads of `dh`:
    /// each plane row dequantized, or with centred keys ([`KeyCentre`]) a sink position's f16
    /// row and a later position's row plus its head's centre at that position. What the
    /// kernels' tests hold attention over the cache to.
    pub fn keys_f32(&self, hkv: usize, dh: usize) -> Vec<f32> {
        let mut out = vec![0f32; self.k.len() * K::VALUES];
        K::dequantize_row(self.k, &mut out);
        if let Some(c) = &self.centre {
            let mut centre = vec![0f32; dh];
            for (g, head) in out
                .chunks_exact_mut(self.capacity * dh)
                .take(hkv)
                .enumerate()
            {
                for (j, row) in head.chunks_exact_mut(dh).enumerate() {
                    match j < c.sinks {
                        true => row
                            .iter_mut()
                            .zip(c.sink_row(g, j, dh))
                            .for_each(|(r, s)| *r = s.to_f32()),
                        false => {
                            c.centre_at(g, j, &mut centre);
                            row.iter_mut().zip(&centre).for_each(|(r, x)| *r += x)
                        }
                    }
                }
            }
        }
        out
    }
}

/// An element type a host KV cache stores ([`LayerCache`]): `f32`, `half::f16`, or a block of
/// quantized values ([`crate::kv::BlockQ8_0`]). A backend that reads host caches has a kernel for
/// each (the CPU backend's `KvRead`).
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Values one element holds (1 for f32 and f16, 32 for a Q8_0 block); a cache row of `Dh`
    /// values is `Dh / VALUES` elements.
    const VALUES: usize;
    /// `out = row` as f32 (`out.len() == row.len() * VALUES`): exact for f32 and f16, ggml's
    /// `dequantize_row_*` (bit for bit) for blocks.
    fn dequantize_row(row: &[Self], out: &mut [f32]);
}

/// A [`KvElem`] of one value (f32, f16).
pub trait KvScalar: KvElem {
    /// The value as f32 (exact for both types).
    fn to_f32(self) -> f32;
}

impl KvElem for f32 {
    const VALUES: usize = 1;
    #[inline(always)]
    fn dequantize_row(row: &[f32], out: &mut [f32]) {
        out.copy_from_slice(row)
    }
}

impl KvScalar for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl KvElem for half::f16 {
    const VALUES: usize = 1;
    #[inline(always)]
    fn dequantize_row(row: &[half::f16], out: &mut [f32]) {
        assert_eq!(row.len(), out.len());
        for (o, x) in out.iter_mut().zip(row) {
            *o = x.to_f32();
        }
    }
}

impl KvScalar for half::f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
}

/// The f32 value of f16 bits, without branches or tables so that loops of it vectorise on any
/// target: the exponent and mantissa shifted into f32 position and rescaled by 2^112 (exact for
/// normal and subnormal values alike), infinities and NaNs given the f32 all-ones exponent.
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7fff;
    let scaled = (f32::from_bits(em << 13) * f32::from_bits(0x7780_0000)).to_bits();
    let bits = if em >= 0x7c00 {
        (em << 13) | 0x7f80_0000
    } else {
        scaled
    };
    f32::from_bits(bits | sign)
}

pub trait Backend: Send + Sync {
    /// Rows of an embedding table `(V, D)` for `ids` -> `(T, D)`, times `scale`.
    fn embedding(&self, table: &QTensor, ids: &[u32], scale: f32) -> Result<Tensor>;
    /// RMSNorm over the last dim: `x / rms(x) * (w + offset)`.
    fn rms_norm(&self, x: &Tensor, w: &[f32], eps: f32, offset: f32) -> Result<Tensor>;
    /// `(T, C) · Wᵀ -> (T, R)`, plus an optional bias `(R)`.
    fn linear(&self, x: &Tensor, w: &QTensor, bias: Option<&[f32]>) -> Result<Tensor>;
    /// Rotates `x (T, nh, Dh)` in place at absolute positions `pos0..pos0+T`.
    fn rope(&self, x: &mut Tensor, n_heads: usize, pos0: usize, p: &RopeParams) -> Result<()>;
    /// Writes `k`, `v` `(T, Hkv*Dh)` into one layer's cache at positions `pos0..pos0+T`; errors
    /// past `limit` positions.
    fn kv_write(
        &self,
        kv: &mut KvStore,
        k: &Tensor,
        v: &Tensor,
        pos0: usize,
        limit: usize,
    ) -> Result<()>;
    /// Causal attention of `q (T, H*Dh)` at positions `pos0..pos0+T` over a cache holding positions
    /// `0..pos0+T` -> `(T, H*Dh)`.
    fn attend(&self, q: &Tensor, kv: &KvStore, pos0: usize, p: &AttentionParams) -> Result<Tensor>;
    /// A zeroed layer of a paged KV cache where this backend keeps its caches (`ty`: f16 or
    /// f32; [`crate::paged`]).
    fn paged_alloc(&self, layout: PagedLayout, ty: KvType) -> Result<PagedStore> {
        PagedStore::host(layout, ty)
    }
    /// Makes `step`'s rows readable by this backend's paged ops (device copies on a GPU): once
    /// per step, before the first layer.
    fn paged_prepare(&self, _step: &mut PagedStep) -> Result<()> {
        Ok(())
    }
    /// RoPE on `q (R, H*Dh)` in place, row `r` at position `step.pos[r]`, and the rotated `k`
    /// with `v` `(R, Hkv*Dh)` into `kv` at the rows' slots (padding rows are not stored). `k`
    /// may be left rotated or not.
    #[allow(clippy::too_many_arguments)]
    fn paged_rope_store(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        n_heads: usize,
        kv: &mut PagedStore,
        step: &PagedStep,
        p: &RopeParams,
    ) -> Result<()>;
    /// Causal attention of `q (R, H*Dh)` over a paged layer: row `r` over its sequence's keys
    /// `0..=step.pos[r]` (within the window) -> `(R, H*Dh)`; padding rows give zeros.
    fn paged_attend(
        &self,
        q: &Tensor,
        kv: &PagedStore,
        step: &PagedStep,
        p: &AttentionParams,
    ) -> Result<Tensor>;
    /// `silu(gate) * up`.
    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor>;
    /// `gelu_tanh(gate) * up`.
    fn gelu_tanh_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor>;
    /// `act(gate, up)` element-wise for any [`GateAct`]: the plain two through
    /// [`Backend::silu_mul`] and [`Backend::gelu_tanh_mul`]; a backend that has the others
    /// overrides this (the default refuses them by name).
    fn gated_act(&self, gate: &Tensor, up: &Tensor, act: GateAct) -> Result<Tensor> {
        match act {
            GateAct::Silu => self.silu_mul(gate, up),
            GateAct::GeluTanh => self.gelu_tanh_mul(gate, up),
            GateAct::ClampedSwiglu { .. } => Err(crate::Error::Msg(
                "the clamped SwiGLU (GPT-OSS experts) is not supported on this backend yet".into(),
            )),
        }
    }
    /// `x += y`.
    fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<()>;
    /// `x = tanh(x / cap) * cap` (Gemma's final-logit soft cap).
    fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()>;
    /// Rows `start..start+len` of `x` viewed as `(rows, last_dim)`, as a new `(len, last_dim)`.
    fn rows(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor>;
    /// The rows of `parts` one after another (all with the same last dim).
    fn concat_rows(&self, parts: &[Tensor]) -> Result<Tensor>;
    /// A host copy of `x` (`x` itself, cloned, on the CPU).
    fn to_host(&self, x: &Tensor) -> Result<Tensor>;
    /// `x` where this backend keeps its tensors (`x` itself on the CPU; a device copy of a host
    /// tensor on a GPU, a device tensor as it is).
    fn upload(&self, x: &Tensor) -> Result<Tensor>;
    /// Dense product of two f32 tensors, `alpha · op(a) · op(b) -> (M, N)` (LoRA factors and
    /// training's gradient products; weights in their stored form go through `linear`).
    fn matmul(&self, a: &Tensor, b: &Tensor, spec: MatmulSpec) -> Result<Tensor>;
    /// `out += alpha · op(a) · op(b)`, `out (M, N)`.
    fn matmul_acc(&self, out: &mut Tensor, a: &Tensor, b: &Tensor, spec: MatmulSpec) -> Result<()>;
    /// `y (T, R) += scale · (x[rows] · Aᵀ) · Bᵀ` for each term on its own rows of `x (T, C)`
    /// (several served LoRA adapters over one batch, [`crate::lora_rows`]). The default gathers,
    /// multiplies and scatters through the ops above.
    fn add_row_terms(
        &self,
        x: &Tensor,
        y: &mut Tensor,
        terms: &[crate::lora_rows::RowsTerm<'_>],
    ) -> Result<()> {
        crate::lora_rows::add_row_terms_composed(self, x, y, terms)
    }

    // Fused forms of common sequences. The defaults compose the ops above; a backend overrides
    // them where one kernel does the work of several (the GPU at decode), with the same result
    // up to f32 rounding.

    /// `[x · W_iᵀ (+ b_i)]` for several matrices sharing the input (q, k and v).
    fn linear_many(&self, x: &Tensor, ws: &[(&QTensor, Option<&[f32]>)]) -> Result<Vec<Tensor>> {
        linear_many_composed(self, x, ws)
    }
    /// `residual += x · Wᵀ` (an output projection added to the residual stream).
    fn linear_add(&self, x: &Tensor, w: &QTensor, residual: &mut Tensor) -> Result<()> {
        linear_add_composed(self, x, w, residual)
    }
    /// RoPE on `q (T, H*Dh)` in place and on `k (T, Hkv*Dh)`, then the rotated keys and `v` into
    /// one layer's cache at `pos0..pos0+T` (the steps between the projections and attention).
    /// `k` may be left rotated or not.
    #[allow(clippy::too_many_arguments)]
    fn rope_store(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        n_heads: usize,
        n_kv_heads: usize,
        kv: &mut KvStore,
        pos0: usize,
        limit: usize,
        p: &RopeParams,
    ) -> Result<()> {
        rope_store_composed(self, q, k, v, (n_heads, n_kv_heads), kv, (pos0, limit), p)
    }
    /// `act(x · Gᵀ) * (x · Uᵀ)`: the first half of a gated MLP.
    fn linear_gated(
        &self,
        x: &Tensor,
        gate: &QTensor,
        up: &QTensor,
        act: GateAct,
    ) -> Result<Tensor> {
        linear_gated_composed(self, x, gate, up, act)
    }
    /// A mixture-of-experts MLP: each row of `x (T, D)` through the experts its row of router
    /// `logits (T, E)` picks, weighted as `spec` says ([`crate::moe`]) -> `(T, D)`.
    fn moe_ffn(
        &self,
        x: &Tensor,
        logits: &Tensor,
        experts: &crate::moe::Experts,
        spec: &crate::moe::MoeSpec<'_>,
    ) -> Result<Tensor> {
        crate::moe::moe_ffn_composed(self, x, logits, experts, spec)
    }
    /// `residual += moe_ffn(x, x · routerᵀ)` (a pre-norm block's routed MLP half, `router
    /// (E, D)`); a backend may fold the router product into its routing and the add into the
    /// experts' last product.
    fn moe_ffn_add(
        &self,
        x: &Tensor,
        router: &QTensor,
        experts: &crate::moe::Experts,
        spec: &crate::moe::MoeSpec<'_>,
        residual: &mut Tensor,
    ) -> Result<()> {
        let logits = self.linear(x, router, None)?;
        let y = self.moe_ffn(x, &logits, experts, spec)?;
        self.add_assign(residual, &y)
    }
    /// [`Backend::linear_many`] of `rms_norm(x)` (a pre-norm block's q, k and v).
    fn norm_linear_many(
        &self,
        x: &Tensor,
        norm: PreNorm<'_>,
        ws: &[(&QTensor, Option<&[f32]>)],
    ) -> Result<Vec<Tensor>> {
        let h = self.rms_norm(x, norm.w, norm.eps, norm.offset)?;
        self.linear_many(&h, ws)
    }
    /// [`Backend::linear_gated`] of `rms_norm(x)` (a pre-norm block's gate and up).
    fn norm_linear_gated(
        &self,
        x: &Tensor,
        norm: PreNorm<'_>,
        gate: &QTensor,
        up: &QTensor,
        act: GateAct,
    ) -> Result<Tensor> {
        let h = self.rms_norm(x, norm.w, norm.eps, norm.offset)?;
        self.linear_gated(&h, gate, up, act)
    }
}

/// How [`Backend::matmul`] reads its operands: `op(a)` is `(M, K)` (`a` stored `(K, M)` when
/// `ta`), `op(b)` is `(K, N)` (`b` stored `(N, K)` when `tb`), and the product is scaled by
/// `alpha`. `x · Aᵀ` of a LoRA factor `A (r, C)` is `{ tb: true, .. }`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MatmulSpec {
    pub ta: bool,
    pub tb: bool,
    pub alpha: f32,
}

impl MatmulSpec {
    /// `a · b`.
    pub const NN: MatmulSpec = MatmulSpec {
        ta: false,
        tb: false,
        alpha: 1.0,
    };
    /// `a · bᵀ`.
    pub const NT: MatmulSpec = MatmulSpec {
        ta: false,
        tb: true,
        alpha: 1.0,
    };
    /// `aᵀ · b`.
    pub const TN: MatmulSpec = MatmulSpec {
        ta: true,
        tb: false,
        alpha: 1.0,
    };
    pub fn scaled(self, alpha: f32) -> MatmulSpec {
        MatmulSpec { alpha, ..self }
    }
    /// `(M, K, N)` of `op(a) · op(b)` for operands of these 2-D shapes, or a shape error.
    pub fn dims(&self, a: &Tensor, b: &Tensor) -> Result<(usize, usize, usize)> {
        let (ar, ac) = a.dims2();
        let (br, bc) = b.dims2();
        let (m, k) = if self.ta { (ac, ar) } else { (ar, ac) };
        let (k2, n) = if self.tb { (bc, br) } else { (br, bc) };
        if k != k2 {
            return Err(crate::Error::Shape(format!(
                "matmul: op(a) is ({m}, {k}) and op(b) is ({k2}, {n})"
            )));
        }
        Ok((m, k, n))
    }
}

/// An RMSNorm applied to a product's input ([`Backend::rms_norm`]'s weights and parameters).
#[derive(Clone, Copy, Debug)]
pub struct PreNorm<'a> {
    pub w: &'a [f32],
    pub eps: f32,
    pub offset: f32,
}

/// Checks that rows `start..start+len` exist in `x` viewed as `(rows, last_dim)` (every
/// backend's `rows`); returns the row width.
pub fn check_rows(x: &Tensor, start: usize, len: usize) -> Result<usize> {
    let (r, c) = x.dims2();
    if start.checked_add(len).is_none_or(|end| end > r) {
        return Err(crate::Error::Shape(format!(
            "rows {start}..{} of a tensor of {r} rows",
            start.saturating_add(len)
        )));
    }
    Ok(c)
}

/// Checks a RoPE call (every backend's): `x (T, nh*Dh)` splits into `n_heads` heads and the
/// rotated dimensions fit a head and are even. Returns Dh.
pub fn check_rope(x: &Tensor, n_heads: usize, p: &RopeParams) -> Result<usize> {
    let (_, width) = x.dims2();
    if n_heads == 0 || width % n_heads != 0 {
        return Err(crate::Error::Shape(format!(
            "rope: width {width} is not {n_heads} heads"
        )));
    }
    let dh = width / n_heads;
    if p.dims > dh || !p.dims.is_multiple_of(2) {
        return Err(crate::Error::Shape(format!(
            "rope: {} rotated dims for head width {dh}",
            p.dims
        )));
    }
    Ok(dh)
}

/// The activation of a gated MLP.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GateAct {
    Silu,
    GeluTanh,
    /// GPT-OSS's clamped SwiGLU (transformers' `GptOssExperts`): `g = min(gate, limit)`,
    /// `u = clamp(up, -limit, limit)`, `(u + 1) · g · σ(alpha · g)`.
    ClampedSwiglu {
        alpha: f32,
        limit: f32,
    },
}

/// GPT-OSS's clamped SwiGLU of one element ([`GateAct::ClampedSwiglu`]): the reference every
/// backend's kernel is held to.
#[inline]
pub fn clamped_swiglu(gate: f32, up: f32, alpha: f32, limit: f32) -> f32 {
    let g = gate.min(limit);
    let u = up.clamp(-limit, limit);
    (u + 1.0) * (g / (1.0 + (-alpha * g).exp()))
}

/// [`Backend::rope_store`] as two RoPEs and a cache write (`heads`: q's and k's head counts,
/// `at`: `pos0` and the position limit).
#[allow(clippy::too_many_arguments)]
pub fn rope_store_composed<B: Backend + ?Sized>(
    be: &B,
    q: &mut Tensor,
    k: &mut Tensor,
    v: &Tensor,
    heads: (usize, usize),
    kv: &mut KvStore,
    at: (usize, usize),
    p: &RopeParams,
) -> Result<()> {
    be.rope(q, heads.0, at.0, p)?;
    be.rope(k, heads.1, at.0, p)?;
    be.kv_write(kv, k, v, at.0, at.1)
}

/// [`Backend::linear_many`] from single products.
pub fn linear_many_composed<B: Backend + ?Sized>(
    be: &B,
    x: &Tensor,
    ws: &[(&QTensor, Option<&[f32]>)],
) -> Result<Vec<Tensor>> {
    ws.iter().map(|(w, b)| be.linear(x, w, *b)).collect()
}

/// [`Backend::linear_add`] as a product and an add.
pub fn linear_add_composed<B: Backend + ?Sized>(
    be: &B,
    x: &Tensor,
    w: &QTensor,
    residual: &mut Tensor,
) -> Result<()> {
    let y = be.linear(x, w, None)?;
    be.add_assign(residual, &y)
}

/// [`Backend::linear_gated`] as two products and the activation.
pub fn linear_gated_composed<B: Backend + ?Sized>(
    be: &B,
    x: &Tensor,
    gate: &QTensor,
    up: &QTensor,
    act: GateAct,
) -> Result<Tensor> {
    let g = be.linear(x, gate, None)?;
    let u = be.linear(x, up, None)?;
    be.gated_act(&g, &u, act)
}

/// Checks an attention call's shapes against its cache (shared by every backend): `q` is
/// `(T, H*Dh)`, heads divide into kv groups, and positions `0..pos0+T` fit the cache. Returns T.
pub fn check_attention<K: KvElem, V: KvElem>(
    q: &Tensor,
    cache: &LayerCache<'_, K, V>,
    pos0: usize,
    p: &AttentionParams,
) -> Result<usize> {
    let (t, width) = q.dims2();
    let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
    if width != h * dh || hkv == 0 || h % hkv != 0 || dh == 0 {
        return Err(crate::Error::Shape(format!(
            "attention: q width {width} for {h} heads of {dh} ({hkv} kv heads)"
        )));
    }
    for values in [K::VALUES, V::VALUES] {
        if !dh.is_multiple_of(values) {
            return Err(crate::Error::Shape(format!(
                "attention: head width {dh} is not a whole number of {values}-value cache blocks"
            )));
        }
    }
    check_sinks(p)?;
    let total = pos0 + t;
    if total > cache.capacity
        || cache.k.len() < hkv * cache.capacity * (dh / K::VALUES)
        || cache.v.len() < hkv * cache.capacity * (dh / V::VALUES)
    {
        return Err(crate::Error::Shape(format!(
            "attention: {total} positions exceed the cache capacity {}",
            cache.capacity
        )));
    }
    if let Some(c) = &cache.centre {
        c.check(hkv, dh)?;
    }
    Ok(t)
}

/// Attention sinks, when given, are one per query head (every backend's attention).
pub fn check_sinks(p: &AttentionParams) -> Result<()> {
    match &p.sinks {
        Some(s) if s.len() != p.n_heads => Err(crate::Error::Shape(format!(
            "attention: {} sinks for {} heads",
            s.len(),
            p.n_heads
        ))),
        _ => Ok(()),
    }
}

/// Element-wise ops need equal shapes (shared by every backend).
pub fn same_shape(a: &Tensor, b: &Tensor, op: &str) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(crate::Error::Shape(format!(
            "{op}: shapes {:?} and {:?} differ",
            a.shape(),
            b.shape()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// transformers' `GptOssExperts`: gate clamped above only, up both ways, `(up + 1)·glu`.
    #[test]
    fn clamped_swiglu_clamps_as_transformers() {
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        let f = |g, u| super::clamped_swiglu(g, u, 1.702, 7.0);
        assert_eq!(f(10.0, -9.0), (-7.0 + 1.0) * 7.0 * sig(1.702 * 7.0));
        assert_eq!(f(-10.0, 9.0), (7.0 + 1.0) * -10.0 * sig(1.702 * -10.0));
        assert_eq!(f(0.5, 0.25), 1.25 * 0.5 * sig(1.702 * 0.5));
    }

    /// Every f16 bit pattern widens to what `half` gives (NaNs to a NaN).
    #[test]
    fn f16_widening_is_exact() {
        for b in 0..=u16::MAX {
            let want = half::f16::from_bits(b).to_f32_const();
            let got = super::f16_bits_to_f32(b);
            if want.is_nan() {
                assert!(got.is_nan(), "{b:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{b:#06x}");
            }
        }
    }
}
