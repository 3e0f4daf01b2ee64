//! Routed-experts MLP (Qwen3-MoE, Mixtral, GPT-OSS): a router product `(E, D)` picks `k`
//! experts per token and the backend's [`hf2q_tensor::op::Backend::moe_ffn`] runs them
//! ([`hf2q_tensor::moe`] says how the weights are computed). GPT-OSS's router has a bias, its
//! experts biases and the clamped SwiGLU ([`crate::config::MoeConfig::clamped_swiglu`]).
//! Inference only: a block with routed experts refuses the training forward.

use hf2q_tensor::moe::{Experts, MoeSpec};
use hf2q_tensor::op::{GateAct, PreNorm};
use hf2q_tensor::{QTensor, Tensor};

use crate::config::gpt_oss::SWIGLU_ALPHA;
use crate::config::{Activation, MoeConfig};
use crate::layers::mlp::gate_act;
use crate::layers::served::Fwd;
use crate::source::WeightSource;
use crate::Result;

pub struct MoeMlp {
    /// (E, D). A plain stored weight, not a [`crate::layers::linear::Linear`]: adapters do not
    /// reach the router.
    pub router: QTensor,
    /// (E): GPT-OSS's router bias.
    pub router_bias: Option<Vec<f32>>,
    pub experts: Experts,
    pub top_k: usize,
    pub renormalize: bool,
    pub act: GateAct,
}

impl MoeMlp {
    /// The router and experts of the layer under `prefix` (`model.layers.N`): Qwen3-MoE's
    /// `mlp.gate`, Mixtral's `block_sparse_moe.gate`, or GPT-OSS's `mlp.router` (weight and
    /// bias) with its MXFP4 experts.
    pub fn load(
        src: &WeightSource,
        prefix: &str,
        moe: &MoeConfig,
        act: Activation,
    ) -> Result<MoeMlp> {
        if let Some(limit) = moe.clamped_swiglu {
            let router = src.matrix(&format!("{prefix}.mlp.router.weight"))?;
            let bias = src.vector(&format!("{prefix}.mlp.router.bias"))?;
            if bias.len() != moe.n_experts {
                return Err(crate::Error::Config(format!(
                    "router bias of {prefix} has {} values for {} experts",
                    bias.len(),
                    moe.n_experts
                )));
            }
            return MoeMlp {
                router,
                router_bias: Some(bias),
                experts: src.gpt_oss_experts(prefix, moe.n_experts)?,
                top_k: moe.n_used,
                renormalize: moe.renormalize,
                act: GateAct::ClampedSwiglu {
                    alpha: SWIGLU_ALPHA,
                    limit,
                },
            }
            .checked(moe);
        }
        let qwen = format!("{prefix}.mlp.gate.weight");
        let router = if src.contains(&qwen) {
            src.matrix(&qwen)?
        } else {
            src.matrix(&format!("{prefix}.block_sparse_moe.gate.weight"))?
        };
        MoeMlp {
            router,
            router_bias: None,
            experts: src.experts(prefix, moe.n_experts)?,
            top_k: moe.n_used,
            renormalize: moe.renormalize,
            act: gate_act(act),
        }
        .checked(moe)
    }

    /// The router's rows against the config's experts.
    fn checked(self, moe: &MoeConfig) -> Result<MoeMlp> {
        let router = &self.router;
        if router.rows != moe.n_experts {
            return Err(crate::Error::Config(format!(
                "router '{}' has {} rows for {} experts",
                router.name, router.rows, moe.n_experts
            )));
        }
        Ok(self)
    }

    /// `x (T, D) -> (T, D)`.
    pub fn forward(&self, cx: &Fwd, x: &Tensor) -> Result<Tensor> {
        let be = cx.be;
        let logits = be.linear(x, &self.router, self.router_bias.as_deref())?;
        Ok(be.moe_ffn(x, &logits, &self.experts, &self.spec())?)
    }

    fn spec(&self) -> MoeSpec<'static> {
        MoeSpec {
            top_k: self.top_k,
            renormalize: self.renormalize,
            expert_scale: None,
            act: self.act,
        }
    }

    /// `x += forward(rms_norm(x))`: a pre-norm block's MLP half.
    pub fn forward_residual(&self, cx: &Fwd, norm: PreNorm<'_>, x: &mut Tensor) -> Result<()> {
        let be = cx.be;
        let h = be.rms_norm(x, norm.w, norm.eps, norm.offset)?;
        if self.router_bias.is_some() {
            // The backends' fused router takes no bias: the logits first.
            let y = self.forward(cx, &h)?;
            return Ok(be.add_assign(x, &y)?);
        }
        Ok(be.moe_ffn_add(&h, &self.router, &self.experts, &self.spec(), x)?)
    }
}

/// A block's MLP half: dense, or routed experts.
pub enum Ffn {
    Dense(crate::layers::mlp::Mlp),
    Routed(MoeMlp),
}

impl Ffn {
    /// The routed experts of layer `i` where the config routes it, else the dense MLP.
    pub fn load(
        src: &WeightSource,
        cfg: &crate::config::ModelConfig,
        prefix: &str,
        i: usize,
    ) -> Result<Ffn> {
        Ok(match cfg.moe.as_ref().filter(|m| m.layers[i]) {
            Some(m) => Ffn::Routed(MoeMlp::load(src, prefix, m, cfg.activation)?),
            None => Ffn::Dense(crate::layers::mlp::Mlp::load(src, prefix, cfg.activation)?),
        })
    }
    /// `x += mlp(rms_norm(x))`.
    pub fn forward_residual(&self, cx: &Fwd, norm: PreNorm<'_>, x: &mut Tensor) -> Result<()> {
        match self {
            Ffn::Dense(m) => m.forward_residual(cx, norm, x),
            Ffn::Routed(m) => m.forward_residual(cx, norm, x),
        }
    }
    /// `x (T, D) -> (T, D)`.
    pub fn forward(&self, cx: &Fwd, x: &Tensor) -> Result<Tensor> {
        match self {
            Ffn::Dense(m) => m.forward(cx, x),
            Ffn::Routed(m) => m.forward(cx, x),
        }
    }
    /// The dense MLP, for training; routed experts have no training forward yet.
    pub fn dense(&self) -> Result<&crate::layers::mlp::Mlp> {
        match self {
            Ffn::Dense(m) => Ok(m),
            Ffn::Routed(_) => Err(crate::Error::Msg(
                "training a model with routed experts (mixture of experts) is not supported yet"
                    .into(),
            )),
        }
    }
}
