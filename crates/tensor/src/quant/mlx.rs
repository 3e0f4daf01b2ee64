//! MLX affine quantization: the layout of `mx.quantize(w, group_size, bits)` (mode "affine"), as
//! stored in mlx-lm checkpoints (`weight` uint32, `scales`, `biases`).
//!
//! Each row of `C` elements is cut into groups of `group_size`; element `x` of a group is stored
//! as an unsigned `bits`-bit integer `q` with `x ~= scale * q + bias`.
//!
//! Packing, checked against the real library: the packed words, read as little-endian bytes, are
//! one little-endian bit stream: element `i` of a row occupies bits `i*bits .. (i+1)*bits`,
//! counting from bit 0 of byte 0. For 2, 4 and 8 bits that is "element k of a uint32 in bits
//! k*bits"; for 3 and 5 bits MLX writes 8 elements into 3 or 5 bytes and for 6 bits 4 elements
//! into 3 bytes, which is the same stream, so values straddle uint32 word boundaries.
//!
//! Quantization follows the CPU kernel of `mx.quantize` (mlx/backend/cpu/quantized.cpp): scale
//! from the group's range, then nudged so that the larger-magnitude edge of the range is exactly
//! on the grid (`bias = edge`), with `rint` (ties to even) rounding. Scales and biases are f32
//! here; an mlx-lm checkpoint stores them in the model's dtype (usually bf16), and the caller
//! converts.
//!
//! Not here: MLX's other modes (mxfp4, nvfp4, mxfp8).

use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AffineParams {
    /// 2, 3, 4, 5, 6 or 8.
    pub bits: u32,
    /// 32, 64 or 128.
    pub group_size: usize,
}

impl AffineParams {
    /// Checks the pair is one MLX supports.
    pub fn validate(self) -> Result<()> {
        if !matches!(self.bits, 2 | 3 | 4 | 5 | 6 | 8) {
            return Err(Error::Msg(format!(
                "MLX affine: {} bits is not one of 2, 3, 4, 5, 6, 8",
                self.bits
            )));
        }
        if !matches!(self.group_size, 32 | 64 | 128) {
            return Err(Error::Msg(format!(
                "MLX affine: group size {} is not one of 32, 64, 128",
                self.group_size
            )));
        }
        Ok(())
    }

    /// Packed bytes for a row of `n` elements (`n * bits / 8`).
    pub fn packed_bytes(self, n: usize) -> Option<usize> {
        n.checked_mul(self.bits as usize).map(|b| b / 8)
    }
}

/// Checks every length of one row of `n` elements; returns the number of groups.
fn check_row(
    p: AffineParams,
    n: usize,
    packed: usize,
    scales: usize,
    biases: usize,
) -> Result<usize> {
    p.validate()?;
    if n % p.group_size != 0 {
        return Err(Error::Shape(format!(
            "MLX affine: row of {n} is not a whole number of groups of {}",
            p.group_size
        )));
    }
    let groups = n / p.group_size;
    // n is a multiple of 32, so n * bits / 8 is a whole number of uint32 words.
    let need = p
        .packed_bytes(n)
        .ok_or_else(|| Error::Shape(format!("MLX affine: row of {n} overflows")))?;
    if packed != need {
        return Err(Error::Shape(format!(
            "MLX affine: {packed} packed bytes given, {need} needed for {n} elements at {} bits",
            p.bits
        )));
    }
    if scales != groups || biases != groups {
        return Err(Error::Shape(format!(
            "MLX affine: {scales} scales and {biases} biases given, {groups} groups of {} in a row of {n}",
            p.group_size
        )));
    }
    Ok(groups)
}

/// Reads `bits` bits starting at bit `off` of the little-endian stream `b`. `bits <= 8`, so the
/// value spans at most two bytes; the second is only read when the value reaches into it.
#[inline]
fn get_bits(b: &[u8], off: usize, bits: u32) -> u8 {
    let (byte, shift) = (off / 8, (off % 8) as u32);
    let mut v = (b[byte] as u32) >> shift;
    if shift + bits > 8 {
        v |= (b[byte + 1] as u32) << (8 - shift);
    }
    (v & ((1u32 << bits) - 1)) as u8
}

/// ORs `q` (< 2^bits) into the stream `b` at bit `off`; `b` starts zeroed.
#[inline]
fn put_bits(b: &mut [u8], off: usize, bits: u32, q: u8) {
    let (byte, shift) = (off / 8, (off % 8) as u32);
    let v = (q as u32) << shift;
    b[byte] |= v as u8;
    if shift + bits > 8 {
        b[byte + 1] |= (v >> 8) as u8;
    }
}

/// Dequantizes one row: `packed` is the row's packed uint32 words as little-endian bytes
/// (`dst.len() * bits / 8` bytes), `scales`/`biases` one value per group (`dst.len() / group_size`).
/// Element = scale * q + bias, a multiply then an add in f32 as `mx.dequantize` does on the CPU
/// for f32 scales (bit-identical to it).
pub fn dequantize_affine(
    p: AffineParams,
    packed: &[u8],
    scales: &[f32],
    biases: &[f32],
    dst: &mut [f32],
) -> Result<()> {
    check_row(p, dst.len(), packed.len(), scales.len(), biases.len())?;
    let bits = p.bits;
    for (g, yg) in dst.chunks_exact_mut(p.group_size).enumerate() {
        let (s, b) = (scales[g], biases[g]);
        let base = g * p.group_size;
        for (k, y) in yg.iter_mut().enumerate() {
            let q = get_bits(packed, (base + k) * bits as usize, bits);
            *y = q as f32 * s + b;
        }
    }
    Ok(())
}

/// Quantizes one row as `mx.quantize(w, group_size, bits)` does on the CPU for f32 input:
/// `packed_out` gets `src.len() * bits / 8` bytes (the uint32 words, little-endian), and
/// `scales_out`/`biases_out` one value per group. The contract test holds the bytes, scales and
/// biases to mlx's output bit for bit.
///
/// Per group: `n_bins = 2^bits - 1`; `scale = max((max - min) / n_bins, 1e-7)`, negated unless
/// |min| > |max|; `edge` is min or max accordingly; `q0 = rint(edge / scale)`; if `q0 != 0`,
/// `scale = edge / q0` and `bias = edge`, else `bias = 0`; then `q = clamp(rint((x - bias) /
/// scale), 0, n_bins)`. Because the scale is nudged to put the edge on the grid, the far end of
/// the range can fall up to one step past the last grid point and is clamped: the round-trip error
/// is at most one step (|scale|), not half.
pub fn quantize_affine(
    p: AffineParams,
    src: &[f32],
    packed_out: &mut [u8],
    scales_out: &mut [f32],
    biases_out: &mut [f32],
) -> Result<()> {
    check_row(
        p,
        src.len(),
        packed_out.len(),
        scales_out.len(),
        biases_out.len(),
    )?;
    let bits = p.bits;
    let n_bins = ((1u32 << bits) - 1) as f32;
    let eps = 1e-7f32;
    packed_out.fill(0);
    for (g, x) in src.chunks_exact(p.group_size).enumerate() {
        // std::max / std::min starting from -inf / +inf (NaN input is skipped, as there).
        let (mut w_min, mut w_max) = (f32::INFINITY, f32::NEG_INFINITY);
        for &v in x {
            w_max = w_max.max(v);
            w_min = w_min.min(v);
        }
        let mask = w_min.abs() > w_max.abs();
        let mut scale = ((w_max - w_min) / n_bins).max(eps);
        if !mask {
            scale = -scale;
        }
        let edge = if mask { w_min } else { w_max };
        let q0 = (edge / scale).round_ties_even();
        let mut bias = 0.0f32;
        if q0 != 0.0 {
            scale = edge / q0;
            bias = edge;
        }
        let base = g * p.group_size;
        for (k, &v) in x.iter().enumerate() {
            let q = ((v - bias) / scale).round_ties_even().clamp(0.0, n_bins);
            put_bits(packed_out, (base + k) * bits as usize, bits, q as u8);
        }
        scales_out[g] = scale;
        biases_out[g] = bias;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((s >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
                u * [1.0f32, 1e-3, 30.0, 0.07][(i / 32) % 4]
                    + [0.0f32, 0.0, 5.0, -0.2][(i / 64) % 4]
            })
            .collect()
    }

    #[test]
    fn bit_stream_round_trips_every_value_at_every_width() {
        for bits in ALL_BITS {
            let n = 64;
            let mut b = vec![0u8; n * bits as usize / 8];
            let qs: Vec<u8> = (0..n)
                .map(|i| ((i * 37 + 11) % (1 << bits)) as u8)
                .collect();
            for (i, &q) in qs.iter().enumerate() {
                put_bits(&mut b, i * bits as usize, bits, q);
            }
            for (i, &q) in qs.iter().enumerate() {
                assert_eq!(
                    get_bits(&b, i * bits as usize, bits),
                    q,
                    "bits {bits} element {i}"
                );
            }
        }
    }

    #[test]
    fn three_bit_layout_matches_mlx_extract_bits() {
        // mlx's extract_bits<3>: w[2] = ((b0 & 0xc0) >> 6) + ((b1 & 1) << 2), w[5] = ((b1 & 0x80)
        // >> 7) + ((b2 & 3) << 1), w[7] = (b2 & 0xe0) >> 5.
        let b = [0b1100_0000u8, 0b1000_0001, 0b1110_0011];
        assert_eq!(get_bits(&b, 2 * 3, 3), 0b111);
        assert_eq!(get_bits(&b, 5 * 3, 3), 0b111);
        assert_eq!(get_bits(&b, 7 * 3, 3), 0b111);
        assert_eq!(get_bits(&b, 0, 3), 0);
    }

    #[test]
    fn round_trip_error_is_at_most_one_step() {
        for bits in ALL_BITS {
            for gs in [32usize, 64, 128] {
                let p = AffineParams {
                    bits,
                    group_size: gs,
                };
                let x = data(512, bits as u64 * 1000 + gs as u64);
                let g = x.len() / gs;
                let mut packed = vec![0u8; p.packed_bytes(x.len()).unwrap()];
                let (mut s, mut b) = (vec![0f32; g], vec![0f32; g]);
                quantize_affine(p, &x, &mut packed, &mut s, &mut b).unwrap();
                let mut y = vec![0f32; x.len()];
                dequantize_affine(p, &packed, &s, &b, &mut y).unwrap();
                for (i, (a, r)) in x.iter().zip(&y).enumerate() {
                    // One step (see quantize_affine), plus f32 rounding of q*scale + bias relative
                    // to the group's magnitude (a few ulps of |bias| + n_bins*|scale|).
                    let gi = i / gs;
                    let mag = b[gi].abs() + s[gi].abs() * ((1u32 << bits) as f32);
                    let tol = s[gi].abs() * 1.0001 + mag * 4.0 * f32::EPSILON;
                    assert!(
                        (a - r).abs() <= tol,
                        "bits {bits} gs {gs} [{i}]: {a} -> {r}, scale {}",
                        s[gi]
                    );
                }
            }
        }
    }

    #[test]
    fn zero_and_constant_groups_are_exact() {
        for bits in ALL_BITS {
            let p = AffineParams {
                bits,
                group_size: 32,
            };
            let mut x = vec![0f32; 32];
            x.extend(std::iter::repeat_n(-2.75f32, 32));
            x.extend(std::iter::repeat_n(1e-9f32, 32));
            let mut packed = vec![0u8; p.packed_bytes(96).unwrap()];
            let (mut s, mut b) = ([0f32; 3], [0f32; 3]);
            quantize_affine(p, &x, &mut packed, &mut s, &mut b).unwrap();
            let mut y = vec![0f32; 96];
            dequantize_affine(p, &packed, &s, &b, &mut y).unwrap();
            assert_eq!(&y[..64], &x[..64], "bits {bits}");
            // A tiny constant is below the 1e-7 minimum scale: it stays on the grid's zero.
            assert!(y[64..].iter().all(|v| (v - 1e-9).abs() <= 1e-9));
        }
    }

    #[test]
    fn every_length_is_checked() {
        let p = AffineParams {
            bits: 4,
            group_size: 32,
        };
        let mut dst = vec![0f32; 64];
        let (s, b) = ([1f32; 2], [0f32; 2]);
        assert!(dequantize_affine(p, &[0u8; 32], &s, &b, &mut dst).is_ok());
        assert!(dequantize_affine(p, &[0u8; 31], &s, &b, &mut dst).is_err());
        assert!(dequantize_affine(p, &[0u8; 33], &s, &b, &mut dst).is_err());
        assert!(dequantize_affine(p, &[0u8; 32], &s[..1], &b, &mut dst).is_err());
        assert!(dequantize_affine(p, &[0u8; 32], &s, &b[..1], &mut dst).is_err());
        assert!(dequantize_affine(p, &[0u8; 16], &s[..1], &b[..1], &mut dst[..33]).is_err());
        assert!(dequantize_affine(
            AffineParams {
                bits: 7,
                group_size: 32
            },
            &[0u8; 56],
            &s,
            &b,
            &mut dst
        )
        .is_err());
        assert!(dequantize_affine(
            AffineParams {
                bits: 4,
                group_size: 16
            },
            &[0u8; 32],
            &[1.0; 4],
            &[0.0; 4],
            &mut dst
        )
        .is_err());
        let (mut s2, mut b2) = ([0f32; 2], [0f32; 1]);
        assert!(quantize_affine(p, &dst, &mut [0u8; 32], &mut s2, &mut b2).is_err());
    }
}
