//! Perplexity and KL divergence over a text, computed the way llama.cpp's `llama-perplexity`
//! computes them (`tools/perplexity/perplexity.cpp`), so numbers are comparable side by side.
//!
//! - The whole text is tokenized once (BOS added when the model's tokenizer adds one; special
//!   tokens in the text are not parsed).
//! - It is cut into `n = tokens / ctx` non-overlapping chunks of `ctx` tokens; each chunk is run
//!   from an empty cache with its first token replaced by BOS (when the tokenizer adds BOS).
//! - Only the second half is scored: for positions `j` in `ctx/2 .. ctx-1`, the negative
//!   log-likelihood of token `j + 1` under the logits at `j` (log-softmax with the max subtracted
//!   and the exponential sum in f64, as llama.cpp does).
//! - PPL = exp(mean NLL), with llama.cpp's error estimate `sqrt(var(NLL) / (N - 1)) * PPL`.
//! - With a base model: the mean of KL(base || model) over the same scored positions, and the
//!   share of positions whose top token is the same in both (llama.cpp's `--kl-divergence`,
//!   which stores the base's log-probabilities quantized to 16 bits; here both are exact).
//!
//! The forward is `Model::session(ctx).forward_all(tokens)`: the reference CPU path.

use serde::Serialize;

use crate::{Error, Model, Result};

#[derive(Clone, Copy, Debug)]
pub struct PerplexityOptions {
    /// Tokens per chunk (llama-perplexity's `-c`).
    pub ctx: usize,
    /// At most this many chunks (llama-perplexity's `--chunks`); `None`: all.
    pub max_chunks: Option<usize>,
}

impl Default for PerplexityOptions {
    fn default() -> Self {
        PerplexityOptions {
            ctx: 512,
            max_chunks: None,
        }
    }
}

/// KL divergence of a model against a base model.
#[derive(Clone, Debug, Serialize)]
pub struct KlReport {
    /// Mean KL(base || model), nats per token.
    pub mean_kl: f64,
    /// Standard error of the mean.
    pub mean_kl_err: f64,
    pub max_kl: f64,
    /// Share of scored positions where both models' top token agrees, in percent.
    pub same_top_pct: f64,
    /// The base model's perplexity on the same positions.
    pub base_ppl: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PerplexityReport {
    pub ppl: f64,
    /// llama.cpp's `+/-` (standard error propagated through exp).
    pub ppl_err: f64,
    /// Mean negative log-likelihood per scored token.
    pub mean_nll: f64,
    pub ctx: usize,
    pub n_chunks: usize,
    /// Tokens in the whole text.
    pub n_tokens: usize,
    /// Positions scored.
    pub n_scored: usize,
    /// Running perplexity after each chunk (llama-perplexity's `[i]x` list).
    pub running_ppl: Vec<f64>,
    pub kl: Option<KlReport>,
}

/// log-softmax of `logits` at `tok`, as llama.cpp's `log_softmax`.
fn log_softmax_at(logits: &[f32], tok: usize) -> f64 {
    let max = logits.iter().fold(logits[0], |m, &v| m.max(v));
    let mut sum = 0f64;
    for &v in logits {
        sum += ((v - max).exp()) as f64;
    }
    (logits[tok] - max) as f64 - sum.ln()
}

/// log-probabilities in f64 (for KL): `logits - max - ln Σ exp`.
fn log_probs(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(logits[0], |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&v| v as f64 - lse).collect()
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// Tokens of `text` as llama-perplexity makes them.
pub fn tokenize_text(model: &Model, text: &str) -> Result<Vec<u32>> {
    model.tokenizer().encode(text, true, false)
}

/// Perplexity of `model` on `text` (and KL against `base` when given). `on_chunk(i, n, ppl)` is
/// called after each chunk with the running perplexity.
pub fn perplexity(
    model: &Model,
    base: Option<&Model>,
    text: &str,
    opts: &PerplexityOptions,
    on_chunk: &mut dyn FnMut(usize, usize, f64),
) -> Result<PerplexityReport> {
    let ctx = opts.ctx;
    if ctx < 4 {
        return Err(Error::Msg(format!(
            "context {ctx} is too small (at least 4 tokens)"
        )));
    }
    let tokens = tokenize_text(model, text)?;
    if let Some(b) = base {
        let bt = tokenize_text(b, text)?;
        if bt != tokens {
            return Err(Error::Msg(
                "the base model tokenizes the text differently: KL needs the same vocabulary"
                    .into(),
            ));
        }
        if b.vocab_size() != model.vocab_size() {
            return Err(Error::Msg(format!(
                "vocabulary sizes differ: {} vs {} (base)",
                model.vocab_size(),
                b.vocab_size()
            )));
        }
    }
    if tokens.len() < 2 * ctx {
        return Err(Error::Msg(format!(
            "the text tokenizes to {} tokens; at least {} (2 x ctx) are needed for a context of {ctx}",
            tokens.len(),
            2 * ctx
        )));
    }
    let n_chunk_max = tokens.len() / ctx;
    let n_chunk = opts
        .max_chunks
        .map_or(n_chunk_max, |m| m.min(n_chunk_max))
        .max(1);
    let add_bos = model.tokenizer().add_bos();
    let bos = model.tokenizer().bos_id();
    let first = ctx / 2;
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let (mut kl_sum, mut kl2_sum, mut kl_max, mut same_top, mut base_nll) =
        (0f64, 0f64, 0f64, 0usize, 0f64);
    let mut running = Vec::with_capacity(n_chunk);
    for i in 0..n_chunk {
        let mut chunk = tokens[i * ctx..(i + 1) * ctx].to_vec();
        if add_bos {
            if let Some(b) = bos {
                chunk[0] = b;
            }
        }
        let logits = model.session(ctx).forward_all(&chunk)?;
        let base_logits = match base {
            Some(b) => Some(b.session(ctx).forward_all(&chunk)?),
            None => None,
        };
        for j in first..ctx - 1 {
            let row = logits.row(j);
            let next = chunk[j + 1] as usize;
            if next >= row.len() {
                return Err(Error::Msg(format!(
                    "token id {next} is outside the model's {} logits",
                    row.len()
                )));
            }
            let v = -log_softmax_at(row, next);
            nll += v;
            nll2 += v * v;
            count += 1;
            if let Some(bl) = &base_logits {
                let brow = bl.row(j);
                let (lp, lq) = (log_probs(brow), log_probs(row));
                let kl: f64 = lp.iter().zip(&lq).map(|(&p, &q)| p.exp() * (p - q)).sum();
                let kl = kl.max(0.0);
                kl_sum += kl;
                kl2_sum += kl * kl;
                kl_max = kl_max.max(kl);
                same_top += usize::from(argmax(brow) == argmax(row));
                base_nll -= lp[next];
            }
        }
        let p = (nll / count as f64).exp();
        running.push(p);
        on_chunk(i + 1, n_chunk, p);
    }
    let mean = nll / count as f64;
    let ppl = mean.exp();
    let var = nll2 / count as f64 - mean * mean;
    let ppl_err = if var > 0.0 && count > 1 {
        (var / (count - 1) as f64).sqrt() * ppl
    } else {
        0.0
    };
    let kl = base.map(|_| {
        let m = kl_sum / count as f64;
        let v = kl2_sum / count as f64 - m * m;
        KlReport {
            mean_kl: m,
            mean_kl_err: if v > 0.0 && count > 1 {
                (v / (count - 1) as f64).sqrt()
            } else {
                0.0
            },
            max_kl: kl_max,
            same_top_pct: 100.0 * same_top as f64 / count as f64,
            base_ppl: (base_nll / count as f64).exp(),
        }
    });
    Ok(PerplexityReport {
        ppl,
        ppl_err,
        mean_nll: mean,
        ctx,
        n_chunks: n_chunk,
        n_tokens: tokens.len(),
        n_scored: count,
        running_ppl: running,
        kl,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_matches_the_definition() {
        let l = [1.0f32, 2.0, 3.0, -1.0];
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        for t in 0..4 {
            let want = (l[t] as f64) - z.ln();
            assert!((log_softmax_at(&l, t) - want).abs() < 1e-6);
        }
        let lp = log_probs(&l);
        assert!((lp.iter().map(|p| p.exp()).sum::<f64>() - 1.0).abs() < 1e-12);
        assert_eq!(argmax(&l), 2);
    }
}
