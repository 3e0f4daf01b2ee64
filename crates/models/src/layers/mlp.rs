//! Gated MLP: `down(act(gate(x)) * up(x))`, SiLU (Llama, Qwen) or GELU-tanh (Gemma).

use hf2q_tensor::op::{Backend, GateAct, PreNorm};
use hf2q_tensor::Tensor;

use crate::config::Activation;
use crate::layers::linear::Linear;
use crate::source::WeightSource;
use crate::Result;

pub struct Mlp {
    /// (F, D)
    pub gate: Linear,
    /// (F, D)
    pub up: Linear,
    /// (D, F)
    pub down: Linear,
    pub act: Activation,
}

impl Mlp {
    pub fn load(src: &WeightSource, prefix: &str, act: Activation) -> Result<Mlp> {
        Ok(Mlp {
            gate: Linear::load(src, &format!("{prefix}.mlp.gate_proj"), false)?,
            up: Linear::load(src, &format!("{prefix}.mlp.up_proj"), false)?,
            down: Linear::load(src, &format!("{prefix}.mlp.down_proj"), false)?,
            act,
        })
    }
    /// `act(gate(x)) * up(x)`, `(T, D) -> (T, F)`.
    fn hidden(&self, be: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        let act = self.gate_act();
        if self.gate.b.is_some() || self.up.b.is_some() {
            let g = self.gate.forward(be, x)?;
            let u = self.up.forward(be, x)?;
            return Ok(match act {
                GateAct::Silu => be.silu_mul(&g, &u)?,
                GateAct::GeluTanh => be.gelu_tanh_mul(&g, &u)?,
            });
        }
        Ok(be.linear_gated(x, &self.gate.w, &self.up.w, act)?)
    }
    /// `x (T, D) -> (T, D)`.
    pub fn forward(&self, be: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        let h = self.hidden(be, x)?;
        self.down.forward(be, &h)
    }
    /// `x += forward(rms_norm(x))`: a pre-norm block's MLP half (the backend may fold the norm
    /// into the gate and up product).
    pub fn forward_residual(
        &self,
        be: &dyn Backend,
        norm: PreNorm<'_>,
        x: &mut Tensor,
    ) -> Result<()> {
        let h = if self.gate.b.is_some() || self.up.b.is_some() {
            let n = be.rms_norm(x, norm.w, norm.eps, norm.offset)?;
            self.hidden(be, &n)?
        } else {
            be.norm_linear_gated(x, norm, &self.gate.w, &self.up.w, self.gate_act())?
        };
        self.down.forward_add(be, &h, x)
    }

    fn gate_act(&self) -> GateAct {
        match self.act {
            Activation::Silu => GateAct::Silu,
            Activation::GeluTanh => GateAct::GeluTanh,
        }
    }
}
