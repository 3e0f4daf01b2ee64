//! `Linear`: `y = x Wᵀ (+ b)`. Dense, quantized and (later) LoRA weights differ only in here.

use hf2q_tensor::op::Backend;
use hf2q_tensor::{QTensor, Tensor};

use crate::source::WeightSource;
use crate::Result;

pub struct Linear {
    /// (R, C)
    pub w: QTensor,
    /// (R)
    pub b: Option<Vec<f32>>,
}

impl Linear {
    /// Loads `{stem}.weight` and, when `bias`, `{stem}.bias`.
    pub fn load(src: &WeightSource, stem: &str, bias: bool) -> Result<Linear> {
        let w = src.matrix(&format!("{stem}.weight"))?;
        let b = if bias {
            Some(src.vector(&format!("{stem}.bias"))?)
        } else {
            None
        };
        Ok(Linear { w, b })
    }
    /// `x (T, C) -> (T, R)`.
    pub fn forward(&self, be: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        Ok(be.linear(x, &self.w, self.b.as_deref())?)
    }
    /// `residual (T, R) += forward(x)`.
    pub fn forward_add(&self, be: &dyn Backend, x: &Tensor, residual: &mut Tensor) -> Result<()> {
        if self.b.is_some() {
            let y = self.forward(be, x)?;
            return Ok(be.add_assign(residual, &y)?);
        }
        Ok(be.linear_add(x, &self.w, residual)?)
    }
}
