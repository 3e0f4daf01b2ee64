//! Helpers shared by the end-to-end parity tests.
#![allow(dead_code)] // each test file uses a part of them

/// KL(softmax(p) || softmax(q)) in f64.
pub fn kl(p: &[f32], q: &[f32]) -> f64 {
    let lse = |v: &[f32]| {
        let m = v.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
    };
    let (lp, lq) = (lse(p), lse(q));
    p.iter()
        .zip(q)
        .map(|(&a, &b)| {
            let la = a as f64 - lp;
            la.exp() * (la - (b as f64 - lq))
        })
        .sum()
}

/// Index of the largest value (first on ties): the sampler's greedy rule.
pub fn argmax(row: &[f32]) -> usize {
    hf2q_models::sampler::argmax(row) as usize
}
