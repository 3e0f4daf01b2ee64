//! What a training run reports: the data before it starts (token lengths, cuts) and one event
//! per step, evaluation, checkpoint and end, as serde values (the CLI prints them as a progress
//! bar or as NDJSON lines, the Lab reads the NDJSON).

use serde::Serialize;

use crate::dpo::DpoMetrics;
use crate::render::Sample;

/// Token lengths of a set of samples.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LengthReport {
    pub samples: usize,
    pub tokens: usize,
    /// Tokens that are targets.
    pub learned_tokens: usize,
    pub min: usize,
    pub median: usize,
    pub max: usize,
    /// Samples cut to the maximum length.
    pub truncated: usize,
    /// `(upper bound, count)`: samples of `prev bound < len <= bound` tokens, bounds 16, 32,
    /// 64, ... up to the first at or above the longest sample (before cutting).
    pub histogram: Vec<(usize, usize)>,
}

impl LengthReport {
    pub fn of(samples: &[Sample]) -> LengthReport {
        let mut lens: Vec<usize> = samples.iter().map(|s| s.full_len).collect();
        lens.sort_unstable();
        let max = lens.last().copied().unwrap_or(0);
        let mut histogram = Vec::new();
        let mut bound = 16usize;
        let mut i = 0;
        loop {
            let start = i;
            while i < lens.len() && lens[i] <= bound {
                i += 1;
            }
            histogram.push((bound, i - start));
            if bound >= max {
                break;
            }
            bound *= 2;
        }
        LengthReport {
            samples: samples.len(),
            tokens: samples.iter().map(|s| s.ids.len()).sum(),
            learned_tokens: samples.iter().map(Sample::learned).sum(),
            min: lens.first().copied().unwrap_or(0),
            median: lens.get(lens.len() / 2).copied().unwrap_or(0),
            max,
            truncated: samples.iter().filter(|s| s.truncated()).count(),
            histogram,
        }
    }

    /// The histogram as text lines (bars of `#`, 40 wide at most).
    pub fn histogram_lines(&self) -> Vec<String> {
        let top = self.histogram.iter().map(|h| h.1).max().unwrap_or(0).max(1);
        let mut lo = 1;
        self.histogram
            .iter()
            .map(|&(hi, n)| {
                let bar = "#".repeat((n * 40).div_ceil(top));
                let line = format!("{:>6}-{:<6} {:>7} {bar}", lo, hi, n);
                lo = hi + 1;
                line
            })
            .collect()
    }
}

/// The plan of a run, reported before its first step.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub train: LengthReport,
    pub valid: Option<LengthReport>,
    /// Optimizer steps in all, and already done (a resumed run).
    pub total_steps: u64,
    pub start_step: u64,
    pub micro_batches_per_epoch: usize,
    pub trainable_parameters: usize,
    pub adapters: usize,
    pub device: String,
    /// Blocks that recompute their forward in the backward (gradient checkpointing).
    pub recomputed_blocks: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    /// Optimizer steps done, counting this one.
    pub step: u64,
    pub total_steps: u64,
    /// Fractional epoch at the end of this step.
    pub epoch: f64,
    /// Mean loss over the step's learned tokens.
    pub loss: f64,
    /// Learning rate this step used.
    pub lr: f32,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learned tokens' top-1 accuracy.
    pub accuracy: f64,
    /// Tokens (all rows) this step and per second of its wall time.
    pub tokens: usize,
    pub tokens_per_s: f64,
    pub elapsed_s: f64,
    /// On a GPU: device memory in use after the step (the driver's total minus free: the
    /// context and the allocator's pool included), GiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_memory_gib: Option<f64>,
    /// DPO: the step's means over pairs (`loss` is then the mean DPO loss, `accuracy` that of
    /// both replies' learned tokens).
    #[serde(flatten)]
    pub dpo: Option<DpoMetrics>,
}

#[derive(Clone, Debug, Serialize)]
pub struct EvalReport {
    pub step: u64,
    pub loss: f64,
    pub accuracy: f64,
    pub tokens: usize,
    /// DPO: the validation pairs' means.
    #[serde(flatten)]
    pub dpo: Option<DpoMetrics>,
}

/// One event of a run.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Plan(Plan),
    Step(StepReport),
    Eval(EvalReport),
    Checkpoint {
        step: u64,
        path: String,
    },
    /// Stopped before the end (a signal): a checkpoint to resume from was written.
    Stopped {
        step: u64,
        checkpoint: String,
    },
    Done {
        step: u64,
        adapter: String,
        loss: Option<f64>,
        elapsed_s: f64,
    },
}

/// Who hears a run's events.
pub trait Observer {
    fn event(&mut self, e: &Event);
}

/// An observer that drops everything.
pub struct Quiet;
impl Observer for Quiet {
    fn event(&mut self, _: &Event) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets() {
        let s: Vec<Sample> = [3, 16, 17, 40, 100]
            .into_iter()
            .map(|n| Sample {
                ids: vec![0; n.min(64)],
                learn: vec![true; n.min(64)],
                full_len: n,
            })
            .collect();
        let r = LengthReport::of(&s);
        assert_eq!(r.histogram, vec![(16, 2), (32, 1), (64, 1), (128, 1)]);
        assert_eq!(r.truncated, 1);
        assert_eq!((r.min, r.median, r.max), (3, 17, 100));
        assert_eq!(r.histogram_lines().len(), 4);
    }
}
