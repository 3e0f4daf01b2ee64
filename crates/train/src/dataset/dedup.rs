//! Duplicate records: exact (the same output record, byte for byte) and near (texts whose word
//! 3-gram sets have a Jaccard similarity of at least a threshold, after lower-casing and
//! dropping punctuation).
//!
//! Near duplicates are found with MinHash (64 hashes) in 16 bands of 4 rows (locality-sensitive
//! hashing), and every candidate pair is checked with the exact Jaccard similarity, so a pair is
//! only removed when it truly is that similar; banding only limits which pairs are compared.
//! At a similarity of 0.8 a pair shares a band with probability 1 - (1 - 0.8^4)^16 > 0.9998.
//! The first record of a group is kept.

use std::collections::{HashMap, HashSet};

use crate::batch::SplitMix;

const HASHES: usize = 64;
const BANDS: usize = 16;
const ROWS: usize = HASHES / BANDS;

/// FNV-1a: a stable hash (the same on every run and build, unlike the standard library's).
fn fnv(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Lower-cased words of letters and digits.
fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// The hashed word 3-grams of a text (its words, when fewer than three).
pub fn shingles(text: &str) -> HashSet<u64> {
    let w = words(text);
    if w.len() < 3 {
        return [fnv(w.join(" ").as_bytes())].into_iter().collect();
    }
    w.windows(3).map(|g| fnv(g.join(" ").as_bytes())).collect()
}

pub fn jaccard(a: &HashSet<u64>, b: &HashSet<u64>) -> f64 {
    let inter = a.intersection(b).count();
    let union = a.len() + b.len() - inter;
    if union == 0 {
        1.0
    } else {
        inter as f64 / union as f64
    }
}

fn signature(s: &HashSet<u64>, seeds: &[u64; HASHES]) -> [u64; HASHES] {
    let mut sig = [u64::MAX; HASHES];
    for &x in s {
        for (m, &seed) in sig.iter_mut().zip(seeds) {
            let h = SplitMix(x ^ seed).next_u64();
            *m = (*m).min(h);
        }
    }
    sig
}

/// For each text, `Some(j)` when it duplicates an earlier kept text `j` (similarity at least
/// `threshold`), else `None`.
pub fn near_duplicates(texts: &[String], threshold: f64) -> Vec<Option<usize>> {
    let mut seeds = [0u64; HASHES];
    let mut r = SplitMix(0x5eed);
    seeds.iter_mut().for_each(|s| *s = r.next_u64());
    let sets: Vec<HashSet<u64>> = texts.iter().map(|t| shingles(t)).collect();
    let mut buckets: Vec<HashMap<u64, Vec<usize>>> = vec![HashMap::new(); BANDS];
    let mut out = vec![None; texts.len()];
    for (i, set) in sets.iter().enumerate() {
        let sig = signature(set, &seeds);
        let keys: Vec<u64> = sig
            .chunks(ROWS)
            .map(|band| {
                let bytes: Vec<u8> = band.iter().flat_map(|x| x.to_le_bytes()).collect();
                fnv(&bytes)
            })
            .collect();
        let mut seen = HashSet::new();
        let dup = keys.iter().enumerate().find_map(|(b, k)| {
            buckets[b].get(k).and_then(|cands| {
                cands
                    .iter()
                    .copied()
                    .filter(|&j| seen.insert(j))
                    .find(|&j| jaccard(set, &sets[j]) >= threshold)
            })
        });
        match dup {
            Some(j) => out[i] = Some(j),
            None => {
                for (b, k) in keys.into_iter().enumerate() {
                    buckets[b].entry(k).or_default().push(i);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_duplicates_are_found_and_different_texts_kept() {
        let base = "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun all afternoon long";
        let texts: Vec<String> = vec![
            base.into(),
            // Case and punctuation only: the same shingles.
            base.to_uppercase().replace(' ', ", "),
            // One word of 20 changed: 3 of 18 shingles differ -> J = 15/21 = 0.71.
            base.replace("cat", "dog"),
            "an entirely different sentence about cooking pasta with garlic and olive oil tonight"
                .into(),
        ];
        let d = near_duplicates(&texts, 0.8);
        assert_eq!(d, [None, Some(0), None, None]);
        let d = near_duplicates(&texts, 0.7);
        assert_eq!(d, [None, Some(0), Some(0), None]);
        let j = jaccard(&shingles(&texts[0]), &shingles(&texts[2]));
        assert!((j - 15.0 / 21.0).abs() < 1e-9, "{j}");
    }
}
