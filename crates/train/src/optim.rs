//! AdamW over a model's adapters (PyTorch's `torch.optim.AdamW`: decoupled weight decay, bias
//! corrections, moments and master weights in f32), global-norm gradient clipping
//! (`torch.nn.utils.clip_grad_norm_`), and the learning-rate schedules of transformers
//! (`get_constant_schedule_with_warmup`, `get_linear_schedule_with_warmup`,
//! `get_cosine_schedule_with_warmup`).
//!
//! The moments live where the backend keeps tensors (beside the factors on a GPU).

use std::sync::Arc;

use hf2q_models::layers::lora::LoraGrads;
use hf2q_models::Model;
use hf2q_tensor::train_op::{AdamStep, TrainBackend};
use hf2q_tensor::Tensor;

use crate::{Error, Result};

/// AdamW's settings (PyTorch's defaults but the learning rate, which the schedule gives).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    fn default() -> AdamWConfig {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// The optimizer state: the step count and both moments of every factor, by adapter id.
pub struct AdamW {
    pub config: AdamWConfig,
    /// Updates done so far.
    pub step: u64,
    /// `(m_A, v_A, m_B, v_B)` by adapter id.
    moments: Vec<[Tensor; 4]>,
    be: Arc<dyn TrainBackend>,
}

impl AdamW {
    pub fn new(model: &Model, config: AdamWConfig) -> Result<AdamW> {
        let be = model.train_backend_handle();
        let moments = model
            .adapters()
            .iter()
            .map(|(_, l)| -> Result<[Tensor; 4]> {
                let (a, b) = (l.a.shape(), l.b.shape());
                Ok([be.zeros(a)?, be.zeros(a)?, be.zeros(b)?, be.zeros(b)?])
            })
            .collect::<Result<_>>()?;
        Ok(AdamW {
            config,
            step: 0,
            moments,
            be,
        })
    }

    /// One update of every adapter from `grads` at learning rate `lr`. An adapter without a
    /// gradient is an error: every adapter takes part in every pass.
    pub fn update(&mut self, model: &mut Model, grads: &LoraGrads, lr: f32) -> Result<()> {
        self.step += 1;
        let s = AdamStep {
            lr,
            beta1: self.config.beta1,
            beta2: self.config.beta2,
            eps: self.config.eps,
            weight_decay: self.config.weight_decay,
            step: self.step,
        };
        for (name, l) in model.adapters_mut() {
            let (ga, gb) = grads
                .get(l.id)
                .ok_or_else(|| Error::Msg(format!("adapter {name} has no gradient")))?;
            let [ma, va, mb, vb] = self
                .moments
                .get_mut(l.id)
                .ok_or_else(|| Error::Msg(format!("no optimizer state for adapter {name}")))?;
            self.be.adamw(&mut l.a, ga, ma, va, &s)?;
            self.be.adamw(&mut l.b, gb, mb, vb, &s)?;
        }
        Ok(())
    }

    /// The moments as host tensors in adapter order (`m_A, v_A, m_B, v_B` each), for a
    /// checkpoint.
    pub fn state(&self) -> Result<Vec<[Tensor; 4]>> {
        self.moments
            .iter()
            .map(|ms| -> Result<[Tensor; 4]> {
                let h = |t: &Tensor| self.be.to_host(t);
                Ok([h(&ms[0])?, h(&ms[1])?, h(&ms[2])?, h(&ms[3])?])
            })
            .collect()
    }

    /// Restores moments saved by [`AdamW::state`] after `step` updates; shapes must match.
    pub fn restore(&mut self, step: u64, state: Vec<[Tensor; 4]>) -> Result<()> {
        if state.len() != self.moments.len() {
            return Err(Error::Msg(format!(
                "optimizer state for {} adapters, the model has {}",
                state.len(),
                self.moments.len()
            )));
        }
        for (i, (have, new)) in self.moments.iter_mut().zip(state).enumerate() {
            for (h, n) in have.iter_mut().zip(new) {
                if h.shape() != n.shape() {
                    return Err(Error::Msg(format!(
                        "optimizer state of adapter {i}: shape {:?}, expected {:?}",
                        n.shape(),
                        h.shape()
                    )));
                }
                *h = self.be.upload(&n)?;
            }
        }
        self.step = step;
        Ok(())
    }
}

/// The global L2 norm of every gradient, and with `max_norm` the gradients scaled by
/// `max_norm / (norm + 1e-6)` when that is below 1 (PyTorch's `clip_grad_norm_`). Returns the
/// norm before clipping.
pub fn clip_grad_norm(
    be: &dyn TrainBackend,
    grads: &mut LoraGrads,
    max_norm: Option<f32>,
) -> Result<f64> {
    let mut ss = 0f64;
    for t in grads.tensors() {
        ss += be.sum_squares(t)?;
    }
    let norm = ss.sqrt();
    if !norm.is_finite() {
        return Err(Error::Msg(format!(
            "the gradient norm is {norm}: the loss diverged (lower the learning rate)"
        )));
    }
    if let Some(max) = max_norm {
        let coef = (max as f64 / (norm + 1e-6)) as f32;
        if coef < 1.0 {
            for t in grads.tensors_mut() {
                be.scale(t, coef)?;
            }
        }
    }
    Ok(norm)
}

/// How the learning rate moves after its warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    Constant,
    Linear,
    Cosine,
}

impl ScheduleKind {
    pub fn from_name(s: &str) -> Option<ScheduleKind> {
        match s {
            "constant" => Some(ScheduleKind::Constant),
            "linear" => Some(ScheduleKind::Linear),
            "cosine" => Some(ScheduleKind::Cosine),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Linear => "linear",
            ScheduleKind::Cosine => "cosine",
        }
    }
}

/// A learning-rate schedule over `total` optimizer steps: linear warm-up from 0 over `warmup`
/// steps, then `kind`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    pub base: f32,
    pub warmup: u64,
    pub total: u64,
    pub kind: ScheduleKind,
}

impl Schedule {
    /// The rate of the update that follows `done` updates (transformers' lambda at
    /// `current_step = done`, computed in f64 as Python does).
    pub fn lr(&self, done: u64) -> f32 {
        let step = done as f64;
        let warm = self.warmup as f64;
        let mult = if done < self.warmup {
            step / warm.max(1.0)
        } else {
            let rest = (self.total as f64 - warm).max(1.0);
            let progress = (step - warm) / rest;
            match self.kind {
                ScheduleKind::Constant => 1.0,
                ScheduleKind::Linear => ((self.total as f64 - step) / rest).max(0.0),
                ScheduleKind::Cosine => {
                    (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
                }
            }
        };
        (self.base as f64 * mult) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_match_transformers() {
        // transformers: warm-up 3 of 20 steps, base 2e-3 (values printed by
        // get_cosine_schedule_with_warmup's lambda).
        let s = Schedule {
            base: 2e-3,
            warmup: 3,
            total: 20,
            kind: ScheduleKind::Cosine,
        };
        let want = [
            0.0,
            0.000_666_666_7,
            0.001_333_333_3,
            0.002,
            0.001_982_973_1,
        ];
        for (i, w) in want.iter().enumerate() {
            assert!(
                (s.lr(i as u64) - w).abs() < 1e-9,
                "step {i}: {}",
                s.lr(i as u64)
            );
        }
        assert!(s.lr(20) < 1e-12);
        let lin = Schedule {
            kind: ScheduleKind::Linear,
            ..s
        };
        assert!((lin.lr(3) - 2e-3).abs() < 1e-9);
        assert!((lin.lr(20)).abs() < 1e-12);
        let c = Schedule {
            kind: ScheduleKind::Constant,
            ..s
        };
        assert_eq!(c.lr(19), 2e-3);
    }
}
