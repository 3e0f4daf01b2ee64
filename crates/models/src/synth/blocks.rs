//! Random quantized blocks written directly (no floats quantized): random quants with scales
//! chosen so that every format decodes to mean 0 and standard deviation [`WEIGHT_STD`]. Byte
//! layouts are ggml's `block_*` structs (see `hf2q_tensor::quant`); the statistics are checked by
//! decoding with the reference dequantizers.

use hf2q_tensor::quant::float::{f32_to_bf16_bits, f32_to_f16_bits};
use hf2q_tensor::GgmlType;
use rayon::prelude::*;

use crate::{Error, Result};

/// Standard deviation of the decoded random weights (the usual initializer range).
pub const WEIGHT_STD: f32 = 0.02;

/// splitmix64's finaliser: a well-mixed 64-bit hash.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub(super) fn tensor_seed(seed: u64, index: usize) -> u64 {
    mix(mix(seed) ^ (index as u64).wrapping_mul(0xd1b5_4a32_d192_ed03))
}

/// wyrand: a small, fast generator (statistical quality is plenty for random weights).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(mix(seed))
    }
    #[inline]
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = (self.0 as u128).wrapping_mul((self.0 ^ 0xe703_7ed1_a0b4_28db) as u128);
        ((t >> 64) ^ t) as u64
    }
    fn fill(&mut self, b: &mut [u8]) {
        let mut chunks = b.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let x = self.next_u64().to_le_bytes();
            rest.copy_from_slice(&x[..rest.len()]);
        }
    }
    /// Uniform in `lo..=hi`.
    #[inline]
    fn range(&mut self, lo: u32, hi: u32) -> u32 {
        let n = (hi - lo + 1) as u64;
        lo + (((self.next_u64() >> 32) * n) >> 32) as u32
    }
    /// Uniform in [-1, 1).
    #[inline]
    fn signed_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (2.0 / (1u64 << 24) as f32) - 1.0
    }
}

fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f32_to_f16_bits(v).to_le_bytes());
}

/// Root mean square of `q - c` for `q` uniform in `0..n` (c the centre used).
fn rms_uniform(n: u32, c: f32) -> f32 {
    let n = n as f32;
    ((n * n - 1.0) / 12.0 + ((n - 1.0) / 2.0 - c).powi(2)).sqrt()
}

/// Root mean square of an integer uniform in `lo..=hi`.
fn rms_range(lo: u32, hi: u32) -> f32 {
    let (lo, hi) = (lo as f32, hi as f32);
    let n = hi - lo + 1.0;
    let mean = (lo + hi) / 2.0;
    ((n * n - 1.0) / 12.0 + mean * mean).sqrt()
}

/// Range of the k-quant 6-bit sub-block scales we draw (Q4_K, Q5_K) and of Q6_K's |scale|.
const KSC: (u32, u32) = (24, 40);
const Q6SC: (u32, u32) = (8, 16);

/// ggml's `get_scale_min_k4` inverse: 8 six-bit scales and mins into 12 bytes.
fn pack_k4_scales(sc: &[u8; 8], mn: &[u8; 8], q: &mut [u8]) {
    for j in 0..4 {
        q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xf) | ((mn[j + 4] & 0xf) << 4);
    }
}

/// Fills whole blocks of `ty` with random quants. Every format decodes to mean ~0, std ~`std`.
fn fill_blocks(ty: GgmlType, dst: &mut [u8], rng: &mut Rng, std: f32) -> Result<()> {
    use GgmlType as G;
    let bs = ty.type_size();
    match ty {
        // x = d * (q - 8) or d * (q - 16): quants are not centred (mean -0.5), so the scale's
        // sign alternates from block to block.
        G::Q4_0 | G::Q5_0 | G::Q8_0 => {
            let (off, rms) = match ty {
                G::Q4_0 => (2, rms_uniform(16, 8.0)),
                G::Q5_0 => (2, rms_uniform(32, 16.0)),
                _ => (2, rms_uniform(256, 128.0)),
            };
            let d = std / rms;
            for (i, b) in dst.chunks_exact_mut(bs).enumerate() {
                put_f16(b, 0, if i % 2 == 0 { d } else { -d });
                rng.fill(&mut b[off..]);
            }
        }
        // x = d * q + m with m = -d * centre: centred.
        G::Q4_1 | G::Q5_1 => {
            let (n, off) = if ty == G::Q4_1 { (16, 4) } else { (32, 4) };
            let c = (n - 1) as f32 / 2.0;
            let d = std / rms_uniform(n, c);
            for b in dst.chunks_exact_mut(bs) {
                put_f16(b, 0, d);
                put_f16(b, 2, -d * c);
                rng.fill(&mut b[off..]);
            }
        }
        // x = d * sc * q - dmin * m with m = sc and dmin = d * centre: centred per sub-block.
        G::Q4_K | G::Q5_K => {
            let n = if ty == G::Q4_K { 16 } else { 32 };
            let c = (n - 1) as f32 / 2.0;
            let d = std / (rms_uniform(n, c) * rms_range(KSC.0, KSC.1));
            for b in dst.chunks_exact_mut(bs) {
                put_f16(b, 0, d);
                put_f16(b, 2, d * c);
                let mut sc = [0u8; 8];
                for s in &mut sc {
                    *s = rng.range(KSC.0, KSC.1) as u8;
                }
                pack_k4_scales(&sc, &sc, &mut b[4..16]);
                rng.fill(&mut b[16..]);
            }
        }
        // x = d * sc * (q - 32), 16 sub-blocks with signed scales: alternate their signs.
        G::Q6_K => {
            let d = std / (rms_uniform(64, 32.0) * rms_range(Q6SC.0, Q6SC.1));
            for b in dst.chunks_exact_mut(bs) {
                rng.fill(&mut b[..192]);
                for (j, s) in b[192..208].iter_mut().enumerate() {
                    let m = rng.range(Q6SC.0, Q6SC.1) as i8;
                    *s = (if j % 2 == 0 { m } else { -m }) as u8;
                }
                put_f16(b, 208, d);
            }
        }
        G::F32 | G::F16 | G::BF16 => {
            // Uniform in [-a, a] has std a / sqrt(3).
            let a = std * 3f32.sqrt();
            match ty {
                G::F32 => {
                    for c in dst.chunks_exact_mut(4) {
                        c.copy_from_slice(&(a * rng.signed_unit()).to_le_bytes());
                    }
                }
                G::F16 => {
                    for c in dst.chunks_exact_mut(2) {
                        c.copy_from_slice(&f32_to_f16_bits(a * rng.signed_unit()).to_le_bytes());
                    }
                }
                _ => {
                    for c in dst.chunks_exact_mut(2) {
                        c.copy_from_slice(&f32_to_bf16_bits(a * rng.signed_unit()).to_le_bytes());
                    }
                }
            }
        }
        // The rarer formats (Q2_K, Q3_K, MXFP4): quantize random floats.
        other if hf2q_tensor::quant::can_quantize(other) => {
            let n = dst.len() / bs * other.block_size();
            let a = std * 3f32.sqrt();
            let x: Vec<f32> = (0..n).map(|_| a * rng.signed_unit()).collect();
            hf2q_tensor::quant::quantize(other, &x, dst)?;
        }
        other => return Err(Error::Msg(format!("cannot make random {other} blocks"))),
    }
    Ok(())
}

/// `n` random elements of `ty` (whole blocks), generated on all cores: chunks of about 1 MiB,
/// each with its own generator seeded from `seed` and the chunk index, so the bytes do not depend
/// on the thread count.
pub(super) fn random_tensor(ty: GgmlType, n: usize, seed: u64) -> Result<Vec<u8>> {
    let bytes = ty.row_bytes(n).ok_or_else(|| {
        Error::Msg(format!(
            "{n} elements are not whole {ty} blocks of {}",
            ty.block_size()
        ))
    })?;
    let mut out = vec![0u8; bytes];
    // Whole blocks, an even count (alternating signs pair up).
    let bs = ty.type_size();
    let per = ((1usize << 20) / bs).max(2) & !1;
    out.par_chunks_mut(per * bs)
        .enumerate()
        .try_for_each(|(i, c)| {
            let mut rng = Rng::new(seed ^ mix(i as u64));
            fill_blocks(ty, c, &mut rng, WEIGHT_STD)
        })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(ty: GgmlType, blocks: usize) -> (f64, f64) {
        let mut b = vec![0u8; blocks * ty.type_size()];
        fill_blocks(ty, &mut b, &mut Rng::new(7), WEIGHT_STD).unwrap();
        let mut x = vec![0f32; blocks * ty.block_size()];
        hf2q_tensor::quant::dequantize(ty, &b, &mut x).unwrap();
        let n = x.len() as f64;
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt())
    }

    #[test]
    fn random_blocks_decode_to_the_target_std_and_zero_mean() {
        use GgmlType as G;
        for ty in [
            G::Q4_0,
            G::Q4_1,
            G::Q5_0,
            G::Q5_1,
            G::Q8_0,
            G::Q2_K,
            G::Q3_K,
            G::Q4_K,
            G::Q5_K,
            G::Q6_K,
            G::F16,
            G::BF16,
            G::F32,
        ] {
            let blocks = 65536 / ty.block_size();
            let (mean, std) = stats(ty, blocks);
            // 65536 samples: the sample std is within a few percent; Q2_K/Q3_K round random
            // floats coarsely, hence the wider band.
            assert!(
                (std - WEIGHT_STD as f64).abs() < 0.1 * WEIGHT_STD as f64,
                "{ty}: std {std}"
            );
            assert!(mean.abs() < 0.02 * WEIGHT_STD as f64, "{ty}: mean {mean}");
        }
    }

    #[test]
    fn k4_scales_round_trip() {
        let sc = [1, 63, 17, 32, 40, 5, 60, 33];
        let mn = [2, 3, 62, 0, 63, 12, 31, 48];
        let mut q = [0u8; 12];
        pack_k4_scales(&sc, &mn, &mut q);
        for j in 0..8 {
            let (d, m) = if j < 4 {
                (q[j] & 63, q[j + 4] & 63)
            } else {
                (
                    (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
                    (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
                )
            };
            assert_eq!((d, m), (sc[j], mn[j]), "sub-block {j}");
        }
    }
}
