//! Shared by the kernel contract tests and the kernel benchmarks: random weights of every type
//! hf2q computes with, and random activations. Not a test target itself.

#![allow(dead_code)]

use hf2q_tensor::quant::{self, float::f32_to_f16_bits, mlx::AffineParams};
use hf2q_tensor::{Bytes, GgmlType, QTensor};

/// A small deterministic generator (PCG-style LCG); tests must not depend on a crate's RNG.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d)
    }
    pub fn u64(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let x = self.0;
        (x ^ (x >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ (x >> 32)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Roughly normal (sum of four uniforms, unit variance).
    pub fn normal(&mut self) -> f32 {
        (self.uniform() + self.uniform() + self.uniform() + self.uniform()) * 0.866
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }
}

/// A weight type to test or measure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Ggml(GgmlType),
    Mlx { bits: u32, group: usize },
}

impl Kind {
    pub fn name(&self) -> String {
        match self {
            Kind::Ggml(t) => t.to_string(),
            Kind::Mlx { bits, group } => format!("mlx{bits}g{group}"),
        }
    }
    /// Columns must be a multiple of this.
    pub fn col_multiple(&self) -> usize {
        match self {
            Kind::Ggml(t) => t.block_size(),
            Kind::Mlx { group, .. } => *group,
        }
    }
    pub fn is_float(&self) -> bool {
        matches!(
            self,
            Kind::Ggml(GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
        )
    }
}

/// Every type the kernels cover, as the contract tests enumerate them.
pub fn all_kinds() -> Vec<Kind> {
    use GgmlType::*;
    let mut v: Vec<Kind> = [
        F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, MXFP4,
    ]
    .into_iter()
    .map(Kind::Ggml)
    .collect();
    for (bits, group) in [
        (4, 32),
        (4, 64),
        (4, 128),
        (8, 32),
        (8, 64),
        (8, 128),
        (2, 64),
        (3, 32),
        (5, 64),
        (6, 32),
    ] {
        v.push(Kind::Mlx { bits, group });
    }
    v
}

/// Weight values with per-32 magnitudes and offsets that vary (so mins and scales matter).
fn weight_values(rows: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    let mut w = vec![0f32; rows * cols];
    for blk in w.chunks_mut(32) {
        let scale = 0.02 * (1.0 + 4.0 * rng.uniform().abs());
        let shift = 0.02 * rng.uniform();
        for v in blk.iter_mut() {
            *v = rng.normal() * scale + shift;
        }
    }
    w
}

fn put_half(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f32_to_f16_bits(v).to_le_bytes());
}

/// Random k-quant blocks: random bytes (every code, scale and high bit pattern), with the f16
/// super-block scales set to small finite values.
fn kquant_bytes(ty: GgmlType, n_blocks: usize, rng: &mut Rng) -> Vec<u8> {
    let ts = ty.type_size();
    let mut b: Vec<u8> = (0..n_blocks * ts).map(|_| rng.u64() as u8).collect();
    for blk in b.chunks_mut(ts) {
        let d = 1e-3 * (1.0 + 9.0 * rng.uniform().abs());
        let dmin = 1e-3 * (1.0 + 9.0 * rng.uniform().abs());
        match ty {
            GgmlType::Q2_K => {
                put_half(blk, 80, d);
                put_half(blk, 82, dmin);
            }
            GgmlType::Q3_K => put_half(blk, 108, d),
            GgmlType::Q4_K | GgmlType::Q5_K => {
                put_half(blk, 0, d);
                put_half(blk, 2, dmin);
            }
            GgmlType::Q6_K => put_half(blk, 208, d),
            GgmlType::Q8_K => blk[0..4].copy_from_slice(&(d * 0.1).to_le_bytes()),
            _ => unreachable!(),
        }
    }
    b
}

/// A random `rows x cols` weight of `kind`.
pub fn make_weight(kind: Kind, rows: usize, cols: usize, rng: &mut Rng) -> QTensor {
    match kind {
        Kind::Ggml(ty) if quant::can_quantize(ty) => {
            let w = weight_values(rows, cols, rng);
            let mut b = vec![0u8; ty.row_bytes(cols).unwrap() * rows];
            quant::quantize(ty, &w, &mut b).unwrap();
            QTensor::ggml("w", ty, rows, cols, Bytes::from_vec(b)).unwrap()
        }
        Kind::Ggml(ty) => {
            let b = kquant_bytes(ty, rows * cols / ty.block_size(), rng);
            QTensor::ggml("w", ty, rows, cols, Bytes::from_vec(b)).unwrap()
        }
        Kind::Mlx { bits, group } => {
            let p = AffineParams {
                bits,
                group_size: group,
            };
            let w = weight_values(rows, cols, rng);
            let rb = p.packed_bytes(cols).unwrap();
            let g = cols / group;
            let mut packed = vec![0u8; rows * rb];
            let (mut s, mut bi) = (vec![0f32; rows * g], vec![0f32; rows * g]);
            for r in 0..rows {
                quant::mlx::quantize_affine(
                    p,
                    &w[r * cols..(r + 1) * cols],
                    &mut packed[r * rb..(r + 1) * rb],
                    &mut s[r * g..(r + 1) * g],
                    &mut bi[r * g..(r + 1) * g],
                )
                .unwrap();
            }
            QTensor::affine("w", p, rows, cols, Bytes::from_vec(packed), s, bi).unwrap()
        }
    }
}

/// Activations: unit-scale values with a few large outlier channels, as LLM hidden states have.
pub fn make_x(t: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    let outliers: Vec<usize> = (0..(cols / 97).max(1)).map(|_| rng.below(cols)).collect();
    let mut x: Vec<f32> = (0..t * cols).map(|_| rng.normal()).collect();
    for row in x.chunks_mut(cols) {
        for &o in &outliers {
            row[o] *= 20.0;
        }
    }
    x
}
