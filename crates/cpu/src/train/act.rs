//! Backward of the gated activations `act(gate) * up`: SiLU (`g · σ(g)`) and GELU with the tanh
//! approximation (PyTorch's `gelu(approximate="tanh")`).
//!
//! - `silu'(g) = σ(g) · (1 + g · (1 − σ(g)))`
//! - `gelu'(g) = ½(1 + tanh a) + ½ g (1 − tanh² a) · c (1 + 3 · 0.044715 g²)`,
//!   `a = c (g + 0.044715 g³)`, `c = √(2/π)`

use rayon::prelude::*;

use hf2q_tensor::op::{same_shape, GateAct};
use hf2q_tensor::{Result, Tensor};

const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// `(act(g), act'(g))`.
#[inline]
fn act_and_slope(act: GateAct, g: f32) -> (f32, f32) {
    match act {
        GateAct::Silu => {
            let s = 1.0 / (1.0 + (-g).exp());
            (g * s, s * (1.0 + g * (1.0 - s)))
        }
        GateAct::GeluTanh => {
            let a = SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g);
            let t = a.tanh();
            let da = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044_715 * g * g);
            (
                0.5 * g * (1.0 + t),
                0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * da,
            )
        }
        // Not of the form act(g) · up: refused by `gated_act_backward` before any element.
        GateAct::ClampedSwiglu { .. } => (0.0, 0.0),
    }
}

/// `gate, up, dy (.., F)` -> `(dgate, dup)`.
pub fn gated_act_backward(
    gate: &Tensor,
    up: &Tensor,
    dy: &Tensor,
    act: GateAct,
) -> Result<(Tensor, Tensor)> {
    if let GateAct::ClampedSwiglu { .. } = act {
        return Err(hf2q_tensor::Error::Msg(
            "training through the clamped SwiGLU (GPT-OSS experts) is not supported".into(),
        ));
    }
    same_shape(gate, up, "gated_act_backward")?;
    same_shape(gate, dy, "gated_act_backward")?;
    let (dg, du): (Vec<f32>, Vec<f32>) = gate
        .data()
        .par_iter()
        .zip(up.data().par_iter())
        .zip(dy.data().par_iter())
        .map(|((&g, &u), &d)| {
            let (a, slope) = act_and_slope(act, g);
            (d * u * slope, d * a)
        })
        .unzip();
    Ok((
        Tensor::new(gate.shape(), dg)?,
        Tensor::new(gate.shape(), du)?,
    ))
}
