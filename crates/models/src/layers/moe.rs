//! Routed-experts MLP (Qwen3-MoE, Mixtral): a router product `(E, D)` picks `k` experts per
//! token and the backend's [`hf2q_tensor::op::Backend::moe_ffn`] runs them
//! ([`hf2q_tensor::moe`] says how the weights are computed). Inference only: a block with
//! routed experts refuses the training forward.

use hf2q_tensor::moe::{Experts, MoeSpec};
use hf2q_tensor::op::PreNorm;
use hf2q_tensor::{QTensor, Tensor};

use crate::config::{Activation, MoeConfig};
use crate::layers::mlp::gate_act;
use crate::layers::served::Fwd;
use crate::source::WeightSource;
use crate::Result;

pub struct MoeMlp {
    /// (E, D). A plain stored weight, not a [`crate::layers::linear::Linear`]: adapters do not
    /// reach the router.
    pub router: QTensor,
    pub experts: Experts,
    pub top_k: usize,
    pub renormalize: bool,
    pub act: Activation,
}

impl MoeMlp {
    /// The router and experts of the layer under `prefix` (`model.layers.N`): Qwen3-MoE's
    /// `mlp.gate`, or Mixtral's `block_sparse_moe.gate`.
    pub fn load(
        src: &WeightSource,
        prefix: &str,
        moe: &MoeConfig,
        act: Activation,
    ) -> Result<MoeMlp> {
        let qwen = format!("{prefix}.mlp.gate.weight");
        let router = if src.contains(&qwen) {
            src.matrix(&qwen)?
        } else {
            src.matrix(&format!("{prefix}.block_sparse_moe.gate.weight"))?
        };
        if router.rows != moe.n_experts {
            return Err(crate::Error::Config(format!(
                "router '{}' has {} rows for {} experts",
                router.name, router.rows, moe.n_experts
            )));
        }
        Ok(MoeMlp {
            router,
            experts: src.experts(prefix, moe.n_experts)?,
            top_k: moe.n_used,
            renormalize: moe.renormalize,
            act,
        })
    }

    /// `x (T, D) -> (T, D)`.
    pub fn forward(&self, cx: &Fwd, x: &Tensor) -> Result<Tensor> {
        let be = cx.be;
        let logits = be.linear(x, &self.router, None)?;
        Ok(be.moe_ffn(x, &logits, &self.experts, &self.spec())?)
    }

    fn spec(&self) -> MoeSpec<'static> {
        MoeSpec {
            top_k: self.top_k,
            renormalize: self.renormalize,
            expert_scale: None,
            act: gate_act(self.act),
        }
    }

    /// `x += forward(rms_norm(x))`: a pre-norm block's MLP half.
    pub fn forward_residual(&self, cx: &Fwd, norm: PreNorm<'_>, x: &mut Tensor) -> Result<()> {
        let be = cx.be;
        let h = be.rms_norm(x, norm.w, norm.eps, norm.offset)?;
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
