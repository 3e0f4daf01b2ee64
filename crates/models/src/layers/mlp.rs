//! Gated MLP: `down(act(gate(x)) * up(x))`, SiLU (Llama, Qwen) or GELU-tanh (Gemma); its
//! training forward and backward.

use hf2q_tensor::op::{GateAct, PreNorm};
use hf2q_tensor::Tensor;

use crate::config::Activation;
use crate::layers::linear::{Linear, LinearSaved};
use crate::layers::lora::{LoraGrads, TrainCtx};
use crate::layers::served::Fwd;
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
        let fused = format!("{prefix}.mlp.gate_up_proj");
        if src.contains(&format!("{fused}.weight")) {
            // Phi-3: gate rows then up rows in one product, split on load.
            let w = src.matrix(&format!("{fused}.weight"))?;
            if w.rows % 2 != 0 {
                return Err(crate::Error::Config(format!(
                    "'{}' has an odd number of rows",
                    w.name
                )));
            }
            let f = w.rows / 2;
            let mut parts = Linear::load_split(src, &fused, false, &[f, f])?.into_iter();
            let (Some(gate), Some(up)) = (parts.next(), parts.next()) else {
                return Err(crate::Error::Msg("gate_up_proj split failed".into()));
            };
            return Ok(Mlp {
                gate,
                up,
                down: Linear::load(src, &format!("{prefix}.mlp.down_proj"), false)?,
                act,
            });
        }
        Ok(Mlp {
            gate: Linear::load(src, &format!("{prefix}.mlp.gate_proj"), false)?,
            up: Linear::load(src, &format!("{prefix}.mlp.up_proj"), false)?,
            down: Linear::load(src, &format!("{prefix}.mlp.down_proj"), false)?,
            act,
        })
    }
    /// `act(gate(x)) * up(x)`, `(T, D) -> (T, F)`.
    fn hidden(&self, cx: &Fwd, x: &Tensor) -> Result<Tensor> {
        let (be, act) = (cx.be, self.gate_act());
        if !self.gate.is_plain() || !self.up.is_plain() {
            let g = self.gate.forward(cx, x)?;
            let u = self.up.forward(cx, x)?;
            return Ok(be.gated_act(&g, &u, act)?);
        }
        if self.served(cx) {
            return self.hidden_served(cx, x);
        }
        Ok(be.linear_gated(x, &self.gate.w, &self.up.w, act)?)
    }
    /// Whether served adapters add to the gate or up product in this forward.
    fn served(&self, cx: &Fwd) -> bool {
        cx.lora
            .is_some_and(|b| b.touches(self.gate.site) || b.touches(self.up.site))
    }
    /// [`Mlp::hidden`] with served adapters: the gate and up products together over every
    /// row, each adapter's terms added to its rows, then the activation.
    fn hidden_served(&self, cx: &Fwd, x: &Tensor) -> Result<Tensor> {
        let be = cx.be;
        let mut gu = be
            .linear_many(x, &[(&self.gate.w, None), (&self.up.w, None)])?
            .into_iter();
        let (Some(mut g), Some(mut u)) = (gu.next(), gu.next()) else {
            return Err(crate::Error::Msg(
                "linear_many gave fewer than two outputs".into(),
            ));
        };
        self.gate.add_served(cx, x, &mut g)?;
        self.up.add_served(cx, x, &mut u)?;
        Ok(be.gated_act(&g, &u, self.gate_act())?)
    }
    /// `x (T, D) -> (T, D)`.
    pub fn forward(&self, cx: &Fwd, x: &Tensor) -> Result<Tensor> {
        let h = self.hidden(cx, x)?;
        self.down.forward(cx, &h)
    }
    /// `x += forward(rms_norm(x))`: a pre-norm block's MLP half (the backend may fold the norm
    /// into the gate and up product; not when served adapters need the normed rows too).
    pub fn forward_residual(&self, cx: &Fwd, norm: PreNorm<'_>, x: &mut Tensor) -> Result<()> {
        let be = cx.be;
        let h = if !self.gate.is_plain() || !self.up.is_plain() || self.served(cx) {
            let n = be.rms_norm(x, norm.w, norm.eps, norm.offset)?;
            self.hidden(cx, &n)?
        } else {
            be.norm_linear_gated(x, norm, &self.gate.w, &self.up.w, self.gate_act())?
        };
        self.down.forward_add(cx, &h, x)
    }

    /// The training forward of `h (N, D)` -> `(N, D)`.
    pub fn forward_train(&self, cx: &TrainCtx, h: &Tensor) -> Result<(Tensor, MlpSaved)> {
        let (g, sg) = self.gate.forward_train(cx, h)?;
        let (u, su) = self.up.forward_train(cx, h)?;
        let a = cx.be.gated_act(&g, &u, self.gate_act())?;
        let (y, sd) = self.down.forward_train(cx, &a)?;
        Ok((
            y,
            MlpSaved {
                g,
                u,
                a,
                lin: [sg, su, sd],
            },
        ))
    }

    /// From `dy (N, D)`, the gradient of [`Mlp::forward_train`]'s input `h (N, D)`.
    pub fn backward(
        &self,
        cx: &TrainCtx,
        h: &Tensor,
        s: &MlpSaved,
        dy: &Tensor,
        grads: &mut LoraGrads,
    ) -> Result<Tensor> {
        let [sg, su, sd] = &s.lin;
        let da = self.down.backward(cx, &s.a, sd, dy, grads)?;
        let (dg, du) = cx.be.gated_act_backward(&s.g, &s.u, &da, self.gate_act())?;
        let mut dh = self.gate.backward(cx, h, sg, &dg, grads)?;
        cx.be
            .add_assign(&mut dh, &self.up.backward(cx, h, su, &du, grads)?)?;
        Ok(dh)
    }

    fn gate_act(&self) -> GateAct {
        gate_act(self.act)
    }
}

/// The backend's name for a gated MLP's activation.
pub(crate) fn gate_act(act: Activation) -> GateAct {
    match act {
        Activation::Silu => GateAct::Silu,
        Activation::GeluTanh => GateAct::GeluTanh,
    }
}

/// What [`Mlp::forward_train`] keeps for the backward: `(N, F)` each.
pub struct MlpSaved {
    g: Tensor,
    u: Tensor,
    a: Tensor,
    lin: [LinearSaved; 3],
}
