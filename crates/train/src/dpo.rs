//! Direct Preference Optimization: TRL's sigmoid loss over (chosen, rejected) pairs,
//! `loss = −log σ(β · ((π_c − ref_c) − (π_r − ref_r)))`, where `π` and `ref` are a reply's
//! log-probability summed over its learned (completion) tokens under the policy (the adapters
//! being trained) and the reference (the same base with the adapters off, or another adapter
//! swapped in: [`Reference`]). Rewards are `β (π − ref)`; the metrics carry TRL's names.
//!
//! A micro-batch holds whole pairs, chosen then rejected (sequences `2i`, `2i + 1`). Per
//! micro-batch: one forward-only pass of the reference, then one training pass of the policy
//! whose loss weights come from its own log-probabilities (`Model::train_pass_with`): every
//! learned row of a reply gets `∂loss/∂π` of that reply, divided by the step's pairs (the loss
//! is the mean over the optimizer step's pairs).
//!
//! Not here: the loop, schedules and checkpoints (`trainer`), reading pairs (`data`).

use std::path::Path;

use hf2q_models::layers::lora::{Lora, LoraGrads};
use hf2q_models::train_pass::{PassOptions, TrainBatch};
use hf2q_models::Model;
use serde::Serialize;

use crate::{Error, Result};

/// The reference policy's adapters, kept off the model and swapped in for its passes (empty:
/// the bare base). No weight is copied: the base is the policy's own.
#[derive(Default)]
pub struct Reference {
    slots: Vec<Option<Lora>>,
}

impl Reference {
    /// The base with every adapter off.
    pub fn base() -> Reference {
        Reference::default()
    }

    /// The PEFT adapter in `dir` as the reference. Call before the policy's adapters are
    /// attached (the model is left with no adapter) and after the model's backend is set (its
    /// factors are placed where the backend keeps tensors; `Model::set_cuda` does not move
    /// adapters that are swapped out).
    pub fn load(model: &mut Model, dir: &Path) -> Result<Reference> {
        model.load_adapter(dir)?;
        let mut r = Reference::default();
        model.swap_adapters(&mut r.slots);
        Ok(r)
    }

    /// Every sequence's summed log-probability of its targets under the reference, `(S)`.
    pub fn logps(&mut self, model: &mut Model, batch: &TrainBatch) -> Result<Vec<f64>> {
        model.swap_adapters(&mut self.slots);
        let out = model.eval_pass(batch);
        model.swap_adapters(&mut self.slots);
        Ok(sequence_logps(batch, &out?.logp))
    }
}

/// `Σ log p(target)` over each sequence's labelled rows, `(S)`, summed in f64.
pub fn sequence_logps(batch: &TrainBatch, logp: &[f32]) -> Vec<f64> {
    let mut s = vec![0f64; batch.layout.sequences()];
    for (row, &q) in batch.layout.seq_of().iter().enumerate() {
        if batch.targets[row] >= 0 {
            s[q as usize] += logp[row] as f64;
        }
    }
    s
}

/// `−log σ(z)`, computed as `softplus(−z)` without overflow.
pub fn neg_log_sigmoid(z: f64) -> f64 {
    (-z).max(0.0) + (-z.abs()).exp().ln_1p()
}

/// Sums over pairs of the loss and its metrics (divide by `pairs` for the means).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PairStats {
    pub pairs: usize,
    pub loss: f64,
    pub reward_chosen: f64,
    pub reward_rejected: f64,
    /// Pairs whose chosen reward is above the rejected one (strictly, as TRL counts).
    pub correct: usize,
    pub logp_chosen: f64,
    pub logp_rejected: f64,
    /// Learned tokens of both replies, and how many were the argmax.
    pub tokens: usize,
    pub hits: usize,
}

impl PairStats {
    pub fn add(&mut self, o: &PairStats) {
        self.pairs += o.pairs;
        self.loss += o.loss;
        self.reward_chosen += o.reward_chosen;
        self.reward_rejected += o.reward_rejected;
        self.correct += o.correct;
        self.logp_chosen += o.logp_chosen;
        self.logp_rejected += o.logp_rejected;
        self.tokens += o.tokens;
        self.hits += o.hits;
    }

    /// The mean loss over pairs.
    pub fn mean_loss(&self) -> f64 {
        self.loss / self.pairs.max(1) as f64
    }

    /// Top-1 accuracy of the learned tokens.
    pub fn token_accuracy(&self) -> f64 {
        self.hits as f64 / self.tokens.max(1) as f64
    }

    /// The means, under TRL's names.
    pub fn metrics(&self) -> DpoMetrics {
        let n = self.pairs.max(1) as f64;
        DpoMetrics {
            rewards_chosen: self.reward_chosen / n,
            rewards_rejected: self.reward_rejected / n,
            rewards_margins: (self.reward_chosen - self.reward_rejected) / n,
            rewards_accuracies: self.correct as f64 / n,
            logps_chosen: self.logp_chosen / n,
            logps_rejected: self.logp_rejected / n,
        }
    }
}

/// Per-step (or evaluation) means over pairs, named as TRL logs them.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DpoMetrics {
    #[serde(rename = "rewards/chosen")]
    pub rewards_chosen: f64,
    #[serde(rename = "rewards/rejected")]
    pub rewards_rejected: f64,
    #[serde(rename = "rewards/margins")]
    pub rewards_margins: f64,
    #[serde(rename = "rewards/accuracies")]
    pub rewards_accuracies: f64,
    #[serde(rename = "logps/chosen")]
    pub logps_chosen: f64,
    #[serde(rename = "logps/rejected")]
    pub logps_rejected: f64,
}

/// The loss terms of a micro-batch's pairs: their stats and `∂(Σ pair losses)/∂π` of every
/// sequence `(S)`.
pub fn pair_terms(policy: &[f64], reference: &[f64], beta: f64) -> Result<(PairStats, Vec<f64>)> {
    if policy.len() != reference.len() || !policy.len().is_multiple_of(2) {
        return Err(Error::Msg(format!(
            "{} policy and {} reference log-probabilities: a DPO batch holds whole pairs",
            policy.len(),
            reference.len()
        )));
    }
    let mut st = PairStats::default();
    let mut d = vec![0f64; policy.len()];
    for i in 0..policy.len() / 2 {
        let (c, r) = (2 * i, 2 * i + 1);
        let rc = beta * (policy[c] - reference[c]);
        let rr = beta * (policy[r] - reference[r]);
        let z = rc - rr;
        st.loss += neg_log_sigmoid(z);
        // d(−log σ(z))/dz = −σ(−z); dz/dπ_c = β, dz/dπ_r = −β.
        let g = -1.0 / (1.0 + z.exp());
        d[c] = g * beta;
        d[r] = -g * beta;
        st.pairs += 1;
        st.reward_chosen += rc;
        st.reward_rejected += rr;
        st.correct += (rc > rr) as usize;
        st.logp_chosen += policy[c];
        st.logp_rejected += policy[r];
    }
    Ok((st, d))
}

/// One policy training pass over a micro-batch of pairs: the loss `Σ pair losses / step_pairs`
/// back-propagated into `grads`, and the batch's stats.
pub fn policy_pass(
    model: &Model,
    batch: &TrainBatch,
    reference: &[f64],
    beta: f64,
    step_pairs: usize,
    opts: &PassOptions,
    grads: &mut LoraGrads,
) -> Result<PairStats> {
    let mut stats = None;
    let norm = 1.0 / step_pairs.max(1) as f64;
    let mut weights = |out: &hf2q_models::train_pass::PassOut| -> hf2q_models::Result<Vec<f32>> {
        let pi = sequence_logps(batch, &out.logp);
        let (st, d) =
            pair_terms(&pi, reference, beta).map_err(|e| hf2q_models::Error::Msg(e.to_string()))?;
        let seq = batch.layout.seq_of();
        let w = (0..batch.targets.len())
            .map(|row| {
                if batch.targets[row] >= 0 {
                    (d[seq[row] as usize] * norm) as f32
                } else {
                    0.0
                }
            })
            .collect();
        stats = Some(st);
        Ok(w)
    };
    let out = model.train_pass_with(batch, &mut weights, opts, grads)?;
    let mut st = stats.ok_or_else(|| Error::Msg("the pass asked for no loss weights".into()))?;
    count_hits(batch, &out.hit, &mut st);
    Ok(st)
}

/// The stats of a micro-batch of pairs without training (evaluation: no dropout).
pub fn eval_pairs(
    model: &mut Model,
    reference: &mut Reference,
    batch: &TrainBatch,
    beta: f64,
) -> Result<PairStats> {
    let refs = reference.logps(model, batch)?;
    let out = model.eval_pass(batch)?;
    let (mut st, _) = pair_terms(&sequence_logps(batch, &out.logp), &refs, beta)?;
    count_hits(batch, &out.hit, &mut st);
    Ok(st)
}

fn count_hits(batch: &TrainBatch, hit: &[bool], st: &mut PairStats) {
    for (row, &t) in batch.targets.iter().enumerate() {
        if t >= 0 {
            st.tokens += 1;
            st.hits += hit[row] as usize;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_policy_and_reference_give_ln2_and_zero_rewards() {
        let (st, d) =
            pair_terms(&[-3.5, -7.25, -1.0, -2.0], &[-3.5, -7.25, -1.0, -2.0], 0.1).unwrap();
        assert_eq!(st.loss / 2.0, std::f64::consts::LN_2);
        let m = st.metrics();
        assert_eq!(
            (
                m.rewards_chosen,
                m.rewards_rejected,
                m.rewards_margins,
                m.rewards_accuracies
            ),
            (0.0, 0.0, 0.0, 0.0)
        );
        assert_eq!(d, [-0.05, 0.05, -0.05, 0.05]);
    }

    #[test]
    fn loss_and_gradient_match_finite_differences() {
        let refs = [-4.0, -5.0];
        let f = |c: f64, r: f64| pair_terms(&[c, r], &refs, 0.5).unwrap().0.loss;
        let (st, d) = pair_terms(&[-3.0, -6.5], &refs, 0.5).unwrap();
        // z = 0.5 (1 - (-1.5)) = 1.25
        assert!((st.loss - (1.0f64 + (-1.25f64).exp()).ln()).abs() < 1e-15);
        let h = 1e-6;
        let dc = (f(-3.0 + h, -6.5) - f(-3.0 - h, -6.5)) / (2.0 * h);
        let dr = (f(-3.0, -6.5 + h) - f(-3.0, -6.5 - h)) / (2.0 * h);
        // Central differences of a smooth function: error O(h²) plus rounding ~1e-10.
        assert!(
            (dc - d[0]).abs() < 1e-8 && (dr - d[1]).abs() < 1e-8,
            "{dc} {dr} {d:?}"
        );
        assert_eq!(st.correct, 1);
        assert!(neg_log_sigmoid(-800.0).is_finite() && neg_log_sigmoid(800.0) == 0.0);
        assert!(pair_terms(&[1.0], &[1.0], 0.1).is_err());
    }
}
