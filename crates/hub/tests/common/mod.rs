//! What the Hub's mock tests share.
#![allow(dead_code)] // each test file uses a part of it

/// Deterministic bytes that differ at every offset (so a misplaced resume or part shows).
pub fn bytes(n: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}
