//! The mixture-of-experts path of [`CudaBackend`]: a layer's experts as stacked device
//! matrices (stacked once on the host where they are stored one tensor per expert), and the
//! device form of `moe_ffn` / `moe_ffn_add` over the kernels of `cuda/moe.rs` (routing,
//! expert products and their sum, nothing on the host). `CudaBackend`'s `Backend` methods call
//! it and fall back to the composed form where it does not apply.
//!
//! Not here: the kernels and their launchers (`cuda/moe.rs`), the routing rule
//! ([`hf2q_tensor::moe::route`]).

use std::collections::HashMap;
use std::sync::Arc;

use crate::backend::{lock, weight_key, CudaBackend};
use crate::moe::{ExpertAct, ExpertOps};
use crate::DeviceWeight;
use hf2q_tensor::moe::{Experts, MoeSpec};
use hf2q_tensor::op::{Backend, GateAct};
use hf2q_tensor::{Error, QTensor, Result, Tensor};

/// Where the device path of a mixture-of-experts MLP gets its router logits: given, or the
/// product of its input with the router.
pub(crate) enum RouteIn<'a> {
    Logits(&'a Tensor),
    Router(&'a QTensor),
}

/// What the device path of a mixture-of-experts MLP gave: its output, or nothing because it
/// added the output into the residual stream itself.
pub(crate) enum MoeOut {
    Out(Tensor),
    Added,
}

/// Most (token, expert) pairs whose down products are summed into the residual stream by one
/// kernel (`moe_down_sum`): decode steps; longer batches take the expert-ordered pairs.
const DOWN_SUM_MAX_PAIRS: usize = 64;

/// Experts stored one tensor per expert, stacked once for the device's expert kernels: gate,
/// up and down by the key of expert 0's gate (whose bytes the entry keeps alive).
pub(crate) type StackCache = HashMap<(usize, usize), (hf2q_tensor::Bytes, [Arc<DeviceWeight>; 3])>;

impl CudaBackend {
    /// A layer's experts as three stacked device matrices (gate, up, down), or None where they
    /// cannot be (MLX affine parts, or parts of different formats): the stacked tensors they
    /// came from, or, for experts stored one tensor per expert, their rows concatenated once on
    /// the host and uploaded.
    fn expert_weights(&self, ex: &Experts) -> Result<Option<[Arc<DeviceWeight>; 3]>> {
        if let Some([g, u, d]) = ex.stacked() {
            return Ok(Some([self.weight(g)?, self.weight(u)?, self.weight(d)?]));
        }
        let (key, bytes) = weight_key(&ex.expert(0)[0]);
        if let Some((_, w)) = lock(&self.stacks).get(&key) {
            return Ok(Some(w.clone()));
        }
        let mut out = Vec::with_capacity(3);
        for m in 0..3 {
            let parts: Vec<&QTensor> = (0..ex.n_experts()).map(|e| &ex.expert(e)[m]).collect();
            let Some(q) = stack_rows(&parts)? else {
                return Ok(None);
            };
            out.push(Arc::new(self.device().upload_weight(&q)?));
        }
        let w: [Arc<DeviceWeight>; 3] = [out[0].clone(), out[1].clone(), out[2].clone()];
        lock(&self.stacks).insert(key, (bytes.clone(), w.clone()));
        Ok(Some(w))
    }

    /// The device path of [`Backend::moe_ffn`] and [`Backend::moe_ffn_add`] (`residual`):
    /// routing, expert products and the sum over a token's experts in four or five kernels
    /// (cuda/moe.rs), nothing on the host; with a residual and few pairs, three, the last adding
    /// into it; prefill batches on the integer tensor cores ([`CudaBackend::moe_int8`]). None
    /// where it does not apply (experts without the one-token kernels, misaligned input), for
    /// the composed path.
    pub(crate) fn moe_ffn_device(
        &self,
        x: &Tensor,
        route_in: RouteIn<'_>,
        ex: &Experts,
        spec: &MoeSpec<'_>,
        t: usize,
        residual: Option<&mut Tensor>,
    ) -> Result<Option<MoeOut>> {
        use crate::moe::{has_id_kernels, MOE_MAX_EXPERTS, MOE_MAX_K};
        let (e, k, d, f) = (ex.n_experts(), spec.top_k, ex.hidden(), ex.width());
        let xi = self.raw(x, "moe_ffn")?;
        if k == 0 || k > e.min(MOE_MAX_K) || e > MOE_MAX_EXPERTS || t * k > 65535 {
            return Ok(None);
        }
        if xi.ptr % 16 != 0 || d % 4 != 0 || f % 4 != 0 {
            return Ok(None);
        }
        let Some([g, u, dn]) = self.expert_weights(ex)? else {
            return Ok(None);
        };
        if !(has_id_kernels(&g) && has_id_kernels(&u) && has_id_kernels(&dn)) {
            return Ok(None);
        }
        // An f32 router is read by the routing kernel itself; any other is an ordinary product.
        let (logits, router) = match route_in {
            RouteIn::Logits(l) => (l.clone(), None),
            RouteIn::Router(r) => {
                let rw = self.weight(r)?;
                if self.device().moe_fused() && rw.kind == "f32" && rw.rows == e && rw.cols == d {
                    (x.clone(), Some(rw))
                } else {
                    (self.linear(x, r, None)?, None)
                }
            }
        };
        let li = self.raw(&logits, "moe_ffn")?;
        let scale = spec.expert_scale.map(|s| self.vector(s)).transpose()?;
        // GPT-OSS's expert biases (kept alive to the launches) and activation.
        let biases = ex
            .all_biases()
            .map(|b| -> Result<_> {
                Ok([
                    self.vector(&b.gate)?,
                    self.vector(&b.up)?,
                    self.vector(&b.down)?,
                ])
            })
            .transpose()?;
        let addr = |i: usize| biases.as_ref().map_or(0, |b| self.device().ptr(&*b[i]));
        let ops = ExpertOps {
            act: match spec.act {
                GateAct::Silu => ExpertAct::Silu,
                GateAct::GeluTanh => ExpertAct::GeluTanh,
                GateAct::ClampedSwiglu { alpha, limit } => {
                    ExpertAct::ClampedSwiglu { alpha, limit }
                }
            },
            gate_bias: addr(0),
            up_bias: addr(1),
            down_bias: addr(2),
        };
        let (ids, wts) = (self.alloc(&[t, k])?, self.alloc(&[t, k])?);
        let (mut idi, mut wti) = (self.raw(&ids, "moe_ffn")?, self.raw(&wts, "moe_ffn")?);
        self.device().moe_route(
            &li,
            router.as_deref(),
            t,
            e,
            k,
            spec.renormalize,
            scale.as_deref(),
            &mut idi,
            &mut wti,
        )?;
        // The integer prefill products know neither biases nor the clamped SwiGLU.
        let plain = biases.is_none() && matches!(spec.act, GateAct::Silu | GateAct::GeluTanh);
        if plain && self.device().int8_experts(t, &[&g, &u, &dn]) {
            let gelu = matches!(spec.act, GateAct::GeluTanh);
            let out = self.moe_int8(xi.ptr, t, k, [&g, &u, &dn], e, gelu, &idi, wti.ptr)?;
            return Ok(Some(MoeOut::Out(out)));
        }
        // A few tokens into a residual stream (fused form): the down products, their sum and
        // the add in one kernel.
        let fused = residual.filter(|_| self.device().moe_fused() && t * k <= DOWN_SUM_MAX_PAIRS);
        if let Some(r) = &fused {
            if r.len() != t * d {
                return Err(Error::Shape(format!(
                    "moe_ffn_add: residual of {} values for {t} tokens of {d}",
                    r.len()
                )));
            }
        }
        // More than one token, unfused: pairs taken in expert order (one expert's reads then
        // share L2). The buffer holds i32 values.
        let order = if t > 1 && fused.is_none() {
            let perm = self.alloc(&[t * k])?;
            let pp = self.raw(&perm, "moe_ffn")?.ptr;
            self.device().moe_sort(&idi, t * k, e, pp, None)?;
            Some((perm, pp))
        } else {
            None
        };
        let pp = order.as_ref().map(|o| o.1);
        let h = self.alloc(&[t * k, f])?;
        let mut hi = self.raw(&h, "moe_ffn")?;
        self.device()
            .moe_gated(&xi, t, k, &g, &u, e, &ops, &idi, pp, &mut hi)?;
        if let Some(r) = fused {
            let mut ri = self.raw(r, "moe_ffn")?;
            self.device().moe_down_sum(
                &hi,
                t,
                k,
                &dn,
                e,
                &idi,
                &wti,
                true,
                ops.down_bias,
                &mut ri,
            )?;
            return Ok(Some(MoeOut::Added));
        }
        let y = self.alloc(&[t * k, d])?;
        let mut yi = self.raw(&y, "moe_ffn")?;
        self.device()
            .moe_down(&hi, t * k, &dn, e, &idi, &wti, pp, ops.down_bias, &mut yi)?;
        let out = self.alloc(&[t, d])?;
        let mut oi = self.raw(&out, "moe_ffn")?;
        self.device().moe_combine(&yi, t, k, d, &mut oi)?;
        Ok(Some(MoeOut::Out(out)))
    }
}

impl CudaBackend {
    /// The routed MLP of a prefill batch on the integer tensor cores: the pairs sorted by
    /// expert, `x (t, D)` quantized once for the gate and up products of every pair, the gated
    /// activations `(t·k, F)` quantized for the down products (scaled by the routing weights
    /// `wts`), then each token's k rows summed. Eight launches whatever the expert count.
    #[allow(clippy::too_many_arguments)]
    fn moe_int8(
        &self,
        x: u64,
        t: usize,
        k: usize,
        [g, u, dn]: [&DeviceWeight; 3],
        e: usize,
        gelu: bool,
        ids: &crate::backend::Raw<'_>,
        wts: u64,
    ) -> Result<Tensor> {
        use crate::quantized_bytes;
        let dev = self.device();
        let (p, d, f) = (t * k, g.cols, dn.cols);
        let ptr = |a: &Tensor| self.raw(a, "moe_ffn").map(|r| r.ptr);
        // i32 values in f32-sized slots.
        let (perm, offs) = (self.alloc(&[p])?, self.alloc(&[e + 1])?);
        let order = (ptr(&perm)?, ptr(&offs)?);
        dev.moe_sort(ids, p, e, order.0, Some(order.1))?;
        let xq = self.alloc(&[quantized_bytes(t * d).div_ceil(4)])?;
        let xqp = ptr(&xq)?;
        let xs = dev.quantize_split(x, t * d, xqp)?;
        let (gate, up) = (self.alloc(&[p, f])?, self.alloc(&[p, f])?);
        dev.mmq_experts((xqp, xs, t), g, e, (order.0, order.1, k), t, 0, ptr(&gate)?)?;
        dev.mmq_experts((xqp, xs, t), u, e, (order.0, order.1, k), t, 0, ptr(&up)?)?;
        let h = if gelu {
            self.gelu_tanh_mul(&gate, &up)?
        } else {
            self.silu_mul(&gate, &up)?
        };
        drop((gate, up, xq));
        let hq = self.alloc(&[quantized_bytes(p * f).div_ceil(4)])?;
        let hqp = ptr(&hq)?;
        let hs = dev.quantize_split(ptr(&h)?, p * f, hqp)?;
        let y = self.alloc(&[p, d])?;
        dev.mmq_experts((hqp, hs, p), dn, e, (order.0, order.1, 1), t, wts, ptr(&y)?)?;
        let out = self.alloc(&[t, d])?;
        let (yi, mut oi) = (self.raw(&y, "moe_ffn")?, self.raw(&out, "moe_ffn")?);
        dev.moe_combine(&yi, t, k, d, &mut oi)?;
        Ok(out)
    }
}

/// Same-format ggml tensors of equal width as one tensor of all their rows, in order (None for
/// MLX affine parts or mixed formats).
fn stack_rows(parts: &[&QTensor]) -> Result<Option<QTensor>> {
    let Some(first) = parts.first() else {
        return Ok(None);
    };
    let hf2q_tensor::WeightData::Ggml { ty, .. } = &first.data else {
        return Ok(None);
    };
    let mut bytes = Vec::new();
    for p in parts {
        match &p.data {
            hf2q_tensor::WeightData::Ggml { ty: t, data } if t == ty && p.cols == first.cols => {
                bytes.extend_from_slice(data.as_slice())
            }
            _ => return Ok(None),
        }
    }
    let rows = parts.iter().map(|p| p.rows).sum();
    let name = format!("{} (stacked experts)", first.name);
    Ok(Some(QTensor::ggml(
        &name,
        *ty,
        rows,
        first.cols,
        hf2q_tensor::Bytes::from_vec(bytes),
    )?))
}
