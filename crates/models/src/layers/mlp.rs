//! Gated MLP: `down(act(gate(x)) * up(x))`, SiLU (Llama, Qwen) or GELU-tanh (Gemma).

use hf2q_tensor::op::Backend;
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
    /// `x (T, D) -> (T, D)`.
    pub fn forward(&self, be: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        let g = self.gate.forward(be, x)?;
        let u = self.up.forward(be, x)?;
        let h = match self.act {
            Activation::Silu => be.silu_mul(&g, &u)?,
            Activation::GeluTanh => be.gelu_tanh_mul(&g, &u)?,
        };
        self.down.forward(be, &h)
    }
}
