//! How far replacing some of a model's weights moves its logits: the mean KL(base || variant)
//! per token over a calibration sequence (teacher-forced), measured in memory on one loaded
//! model. Each variant swaps its weights in ([`Model::replace_weight`]), runs the forward from
//! the first block it changes, measures, and swaps the base weights back. Shared work is done
//! once: the base logits, and the base residual stream entering each block (the network before
//! a variant's first changed block is the base's), kept for the next variant as long as
//! variants come in block order. Not here: which variants to measure (`mixed`).

use hf2q_tensor::{QTensor, Tensor};
use rayon::prelude::*;

use crate::{Error, Model, Result};

/// Where a variant's first change is: the embedding table (everything after the token lookup
/// changes) or block `l` and later (`l = n_layers`: only the output layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Start {
    Embedding,
    Block(usize),
}

/// The start of a variant that replaces the weight `name` (the model's names, see
/// [`Model::replace_weight`]).
fn start_of(name: &str, n_layers: usize) -> Start {
    match name
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(i, _)| i.parse::<usize>().ok())
    {
        Some(l) => Start::Block(l),
        None if name == "lm_head.weight" => Start::Block(n_layers),
        // The embedding table, or a name `replace_weight` will refuse.
        None => Start::Embedding,
    }
}

/// Log-probabilities and probabilities of a `(T, V)` logit matrix, row by row (f64).
fn log_softmax(logits: &[f32], v: usize) -> (Vec<f64>, Vec<f64>) {
    let mut lp = vec![0f64; logits.len()];
    lp.par_chunks_mut(v)
        .zip(logits.par_chunks(v))
        .for_each(|(o, r)| {
            let z = logsumexp(r);
            o.iter_mut().zip(r).for_each(|(o, &x)| *o = x as f64 - z);
        });
    let p = lp.par_iter().map(|x| x.exp()).collect();
    (lp, p)
}

fn logsumexp(r: &[f32]) -> f64 {
    let m = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    r.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m
}

/// Mean over rows of KL(p || q) for base log-probabilities `lp` (with `p = exp(lp)`) and the
/// logits `q (T, V)` of a variant; a row's KL is clamped at 0 (rounding can make an
/// essentially equal row come out a hair below).
pub fn mean_kl(lp: &[f64], p: &[f64], q: &[f32], v: usize) -> f64 {
    let n = q.len() / v;
    let s: f64 = lp
        .par_chunks(v)
        .zip(p.par_chunks(v))
        .zip(q.par_chunks(v))
        .map(|((lp, p), q)| {
            let z = logsumexp(q);
            lp.iter()
                .zip(p)
                .zip(q)
                .map(|((a, pa), &b)| pa * (a - (b as f64 - z)))
                .sum::<f64>()
                .max(0.0)
        })
        .sum();
    s / n as f64
}

/// A loaded model and calibration tokens, ready to measure variants of its weights.
pub struct Sensitivity {
    model: Model,
    calib: Vec<u32>,
    vocab: usize,
    /// Base log-probabilities and probabilities `(T, V)`.
    base_lp: Vec<f64>,
    base_p: Vec<f64>,
    /// The base residual stream `(T, D)` entering block `.0`.
    prefix: Option<(usize, Tensor)>,
}

impl Sensitivity {
    /// Runs the base forward once over `calib` on `model` (on whatever backend and matmul
    /// path it is set to).
    pub fn new(model: Model, calib: Vec<u32>) -> Result<Sensitivity> {
        if calib.len() < 2 {
            return Err(Error::Msg(
                "a sensitivity measurement needs at least 2 calibration tokens".into(),
            ));
        }
        let l = model.session(calib.len()).forward_all(&calib)?;
        let vocab = l.dims2().1;
        let (base_lp, base_p) = log_softmax(l.data(), vocab);
        Ok(Sensitivity {
            model,
            calib,
            vocab,
            base_lp,
            base_p,
            prefix: None,
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Mean KL(base || variant) per calibration token of the variant with `weights` (by name)
    /// in place of the model's; the model holds its own weights again afterwards, also when
    /// this fails.
    pub fn kl(&mut self, weights: Vec<(String, QTensor)>) -> Result<f64> {
        let n = self.model.config.n_layers;
        let start = weights
            .iter()
            .map(|(name, _)| start_of(name, n))
            .min()
            .ok_or_else(|| Error::Msg("a variant that replaces no weight".into()))?;
        let prefix = match start {
            Start::Block(l) => Some(self.prefix(l)?),
            Start::Embedding => None,
        };
        let mut taken = Vec::with_capacity(weights.len());
        let mut result = Ok(());
        for (name, w) in weights {
            match self.model.replace_weight(&name, w) {
                Ok(old) => taken.push((name, old)),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        let logits = result.and_then(|()| {
            let mut s = self.model.session(self.calib.len());
            match (start, &prefix) {
                (Start::Block(l), Some(x)) => s.forward_from(&self.calib, l, x),
                _ => s.forward_all(&self.calib),
            }
        });
        // Put the base back (in reverse: a name given twice ends at the base weight).
        for (name, old) in taken.into_iter().rev() {
            self.model.replace_weight(&name, old)?;
        }
        let q = logits?;
        Ok(mean_kl(&self.base_lp, &self.base_p, q.data(), self.vocab))
    }

    /// The base residual stream entering block `l`, from the kept one when it is not past `l`.
    fn prefix(&mut self, l: usize) -> Result<Tensor> {
        let ids = &self.calib;
        let mut s = self.model.session(ids.len());
        let (from, x) = match self.prefix.take() {
            Some((k, x)) if k <= l => (k, x),
            _ => (0, s.embed(ids)?),
        };
        let x = if from < l {
            s.run_blocks(ids, from..l, &x)?
        } else {
            x
        };
        self.prefix = Some((l, x.clone()));
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts() {
        assert_eq!(
            start_of("model.layers.7.mlp.down_proj.weight", 30),
            Start::Block(7)
        );
        assert_eq!(start_of("lm_head.weight", 30), Start::Block(30));
        assert_eq!(start_of("model.embed_tokens.weight", 30), Start::Embedding);
        assert!(Start::Embedding < Start::Block(0));
    }

    #[test]
    fn kl_is_zero_for_equal_logits_and_positive_otherwise() {
        let p = [1.0f32, 2.0, 3.0, 0.5, 0.5, 0.5];
        let (lp, pp) = log_softmax(&p, 3);
        assert!(mean_kl(&lp, &pp, &p, 3).abs() < 1e-12);
        let q = [3.0f32, 2.0, 1.0, 0.5, 0.5, 0.5];
        assert!(mean_kl(&lp, &pp, &q, 3) > 0.1);
    }
}
