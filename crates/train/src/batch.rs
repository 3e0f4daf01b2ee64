//! Samples into micro-batches, and the order of an epoch.
//!
//! A micro-batch is a packed batch ([`TrainBatch`]): its sequences one after another, no
//! padding, attention confined to each sequence. Without packing a micro-batch is `batch`
//! samples (a ragged batch); with packing, samples are first grouped greedily into bins of at
//! most `max_len` tokens and a micro-batch is `batch` bins. Either way every sample stays its
//! own sequence (positions from 0, no attention across samples), so packing changes only how
//! many samples a step sees, never what one sample computes.
//!
//! The order of epoch `e` is a seeded shuffle (`seed`, `e`): the same on every run and every
//! backend, so a resumed run sees the same batches as an unbroken one.

use hf2q_models::train_pass::TrainBatch;
use hf2q_tensor::train_op::SeqLayout;

use crate::render::Sample;
use crate::Result;

/// SplitMix64: the trainer's seeded stream (shuffles, splits, dropout seeds).
#[derive(Clone, Debug)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Fisher-Yates.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

/// The sample indices of each micro-batch of epoch `epoch`, in order. Samples go in groups
/// of `group` consecutive samples that stay together and in order (1 for SFT; 2 for DPO's
/// chosen and rejected of a pair); `batch` counts groups (or bins of groups with packing).
pub fn epoch_batches(
    samples: &[Sample],
    seed: u64,
    epoch: u64,
    batch: usize,
    packing: Option<usize>,
    group: usize,
) -> Vec<Vec<usize>> {
    let group = group.max(1);
    let mut order: Vec<usize> = (0..samples.len() / group).collect();
    SplitMix(seed ^ (epoch + 1).wrapping_mul(0xA24B_AED4_963E_E407)).shuffle(&mut order);
    let members = |u: usize| (u * group..(u + 1) * group).collect::<Vec<usize>>();
    let units: Vec<Vec<usize>> = match packing {
        None => order.into_iter().map(members).collect(),
        Some(cap) => {
            let mut bins: Vec<Vec<usize>> = Vec::new();
            let mut fill = 0usize;
            for u in order {
                let len: usize = members(u).iter().map(|&i| samples[i].ids.len()).sum();
                match bins.last_mut() {
                    Some(b) if fill + len <= cap => {
                        b.extend(members(u));
                        fill += len;
                    }
                    _ => {
                        bins.push(members(u));
                        fill = len;
                    }
                }
            }
            bins
        }
    };
    units
        .chunks(batch.max(1))
        .map(|c| c.iter().flatten().copied().collect())
        .collect()
}

/// The packed batch of these samples: next-token targets on learned tokens, none elsewhere
/// (and none on a sequence's last token).
pub fn make_batch(samples: &[Sample], picks: &[usize]) -> Result<TrainBatch> {
    let mut ids = Vec::new();
    let mut targets = Vec::new();
    let mut lengths = Vec::with_capacity(picks.len());
    for &i in picks {
        let s = &samples[i];
        ids.extend_from_slice(&s.ids);
        for k in 0..s.ids.len() {
            targets.push(match s.learn.get(k + 1) {
                Some(true) => s.ids[k + 1] as i32,
                _ => -100,
            });
        }
        lengths.push(s.ids.len());
    }
    Ok(TrainBatch {
        ids,
        targets,
        layout: SeqLayout::from_lengths(&lengths)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize) -> Sample {
        Sample {
            ids: (0..len as u32).collect(),
            learn: (0..len).map(|i| i >= len / 2).collect(),
            full_len: len,
        }
    }

    #[test]
    fn epochs_are_seeded_permutations() {
        let s: Vec<Sample> = (1..=10).map(sample).collect();
        let a = epoch_batches(&s, 7, 0, 3, None, 1);
        assert_eq!(a, epoch_batches(&s, 7, 0, 3, None, 1));
        assert_ne!(a, epoch_batches(&s, 7, 1, 3, None, 1));
        let mut all: Vec<usize> = a.iter().flatten().copied().collect();
        all.sort();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        assert_eq!(a.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3, 3, 1]);
    }

    #[test]
    fn groups_stay_together() {
        let s: Vec<Sample> = (1..=8).map(sample).collect();
        let b = epoch_batches(&s, 3, 0, 2, None, 2);
        assert_eq!(b.len(), 2);
        for picks in &b {
            assert_eq!(picks.len(), 4);
            for pair in picks.chunks(2) {
                assert!(pair[0] % 2 == 0 && pair[1] == pair[0] + 1, "{picks:?}");
            }
        }
    }

    #[test]
    fn packing_fills_bins_up_to_the_cap() {
        let s: Vec<Sample> = [4, 4, 4, 9, 2].into_iter().map(sample).collect();
        let b = epoch_batches(&s, 1, 0, 1, Some(10), 1);
        for picks in &b {
            let tokens: usize = picks.iter().map(|&i| s[i].ids.len()).sum();
            assert!(tokens <= 10, "{picks:?}");
        }
        assert!(b.len() < 5, "some samples share a bin");
    }

    #[test]
    fn targets_are_the_next_learned_token() {
        let s = vec![sample(4), sample(3)];
        let b = make_batch(&s, &[0, 1]).unwrap();
        // sample(4): learn = [f, f, t, t] -> rows 1, 2 predict ids 2, 3; sample(3): learn
        // = [f, t, t] -> rows 0, 1 predict 1, 2.
        assert_eq!(b.targets, [-100, 2, 3, -100, 1, 2, -100]);
        assert_eq!(b.layout.lengths().collect::<Vec<_>>(), [4, 3]);
    }
}
