//! Token lengths of records as training would see them: rendered with the chosen model's chat
//! template and tokenized by its tokenizer ([`crate::render`], every token counted, nothing
//! cut), summarised as percentiles, a histogram with power-of-two bucket bounds, and how many
//! records exceed a maximum length. A preference record counts its longer reply (prompt +
//! chosen or prompt + rejected), the one that decides whether it fits.

use hf2q_models::Model;
use serde::Serialize;

use super::map::{samples, Item};
use crate::render::{RenderConfig, Renderer};

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Bucket {
    /// Lengths in (previous bucket's `up_to`, `up_to`].
    pub up_to: usize,
    pub count: usize,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TokenReport {
    pub records: usize,
    pub min: usize,
    pub mean: f64,
    pub p50: usize,
    pub p90: usize,
    pub p99: usize,
    pub max: usize,
    pub max_len: usize,
    /// Records longer than `max_len` (training cuts them).
    pub over_max_len: usize,
    pub histogram: Vec<Bucket>,
    pub total_tokens: usize,
}

/// Each record's token count (the longer of a preference's two), or why it cannot be rendered.
pub fn lengths(model: &Model, items: &[&Item]) -> crate::Result<Vec<Result<usize, String>>> {
    let r = Renderer::new(
        model,
        RenderConfig {
            train_on_prompt: true,
            max_len: usize::MAX,
        },
    )?;
    Ok(items
        .iter()
        .map(|it| {
            samples(it)
                .iter()
                .map(|rec| r.sample(rec).map(|s| s.full_len))
                .try_fold(0, |m, l| l.map(|l| m.max(l)))
        })
        .collect())
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[usize], p: f64) -> usize {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The summary of token counts (none: all zero, no buckets).
pub fn summarize(lengths: &[usize], max_len: usize) -> TokenReport {
    let mut s = lengths.to_vec();
    s.sort_unstable();
    let total: usize = s.iter().sum();
    let mut histogram = Vec::new();
    if let Some(&max) = s.last() {
        let mut up_to = 16usize;
        let mut lo = 0usize;
        loop {
            let count = s.iter().filter(|&&l| l > lo && l <= up_to).count()
                + if lo == 0 {
                    s.iter().filter(|&&l| l == 0).count()
                } else {
                    0
                };
            histogram.push(Bucket { up_to, count });
            if up_to >= max {
                break;
            }
            lo = up_to;
            up_to *= 2;
        }
    }
    let pct = |p| if s.is_empty() { 0 } else { percentile(&s, p) };
    TokenReport {
        records: s.len(),
        min: s.first().copied().unwrap_or(0),
        mean: if s.is_empty() {
            0.0
        } else {
            total as f64 / s.len() as f64
        },
        p50: pct(50.0),
        p90: pct(90.0),
        p99: pct(99.0),
        max: s.last().copied().unwrap_or(0),
        max_len,
        over_max_len: s.iter().filter(|&&l| l > max_len).count(),
        histogram,
        total_tokens: total,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_of_known_lengths() {
        let r = summarize(&[3, 10, 17, 40, 100, 16, 33], 32);
        assert_eq!((r.records, r.min, r.max, r.total_tokens), (7, 3, 100, 219));
        assert_eq!(r.over_max_len, 3);
        assert_eq!(r.p50, 17);
        let counts: Vec<(usize, usize)> = r.histogram.iter().map(|b| (b.up_to, b.count)).collect();
        assert_eq!(counts, [(16, 3), (32, 1), (64, 2), (128, 1)]);
        assert!(summarize(&[], 8).histogram.is_empty());
    }
}
