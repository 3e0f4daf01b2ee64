//! Weight decoding for the integer engines: one row of any quantized weight becomes unsigned
//! 8-bit codes `u` (C of them) and, per 16 elements, a scale `a` and an offset `c` with
//! `weight = a * u + c`. The values are the reference dequantizer's (`quant/legacy.rs`,
//! `quant/kquants.rs`, `quant/mlx.rs`) up to f32 rounding of `a * u + c` against ggml's
//! `d * q - m` order (one rounding, ~6e-8 relative; MXFP4's are exact, `mxfp4.rs`).
//!
//! | format | u | a | c |
//! |---|---|---|---|
//! | Q4_0 / Q5_0 | 4 / 5-bit q | d | -8d / -16d |
//! | Q4_1 / Q5_1 | 4 / 5-bit q | d | m |
//! | Q8_0, Q8_K | q + 128 (wide) | d | -128d |
//! | Q2_K | 2-bit q | d * sc | -dmin * m |
//! | Q3_K | low 2 bits + 4 * high bit | d * (sc - 32) | -4a |
//! | Q4_K / Q5_K | 4 / 5-bit q | d * sc | -dmin * m |
//! | Q6_K | 6-bit q | d * sc | -32a |
//! | MXFP4 | table(E2M1 code) = kvalue + 12 | 2^(e - 128) | -12a |
//! | MLX affine | q | scale | bias |
//!
//! "Wide" codes use all 8 bits; the AVX2 and NEON engines, whose 8-bit multiplies need one side
//! below 128 (or signed), handle them as `u - 128` (see `dot_x86.rs`).
//!
//! The functions are plain Rust marked `#[inline(always)]`: each ISA wrapper inlines them into a
//! `#[target_feature]` function so the compiler vectorises them for that ISA.

use hf2q_tensor::quant::mlx::AffineParams;
use hf2q_tensor::{GgmlType, QTensor, WeightData};

/// IEEE half bits to f32, exact (normals, subnormals, inf, NaN); branch-light so it vectorises.
#[inline(always)]
pub fn h2f(lo: u8, hi: u8) -> f32 {
    let h = u16::from_le_bytes([lo, hi]) as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7fff;
    // Shifting exponent+mantissa into f32 position and multiplying by 2^112 rebiases the
    // exponent (15 -> 127) and handles subnormals exactly; inf/NaN keep an all-ones exponent.
    let v = if em >= 0x7c00 {
        f32::from_bits((em << 13) | 0x7f80_0000)
    } else {
        f32::from_bits(em << 13) * f32::from_bits(0x7780_0000)
    };
    f32::from_bits(v.to_bits() | sign)
}

/// A quantized weight as the engines read it. Built once per call.
#[derive(Clone, Copy, Debug)]
pub enum WView<'a> {
    Ggml {
        ty: GgmlType,
        data: &'a [u8],
        row_bytes: usize,
    },
    Affine {
        p: AffineParams,
        packed: &'a [u8],
        row_bytes: usize,
        scales: &'a [f32],
        biases: &'a [f32],
        groups: usize,
    },
    /// A weight re-laid out by [`super::pack`] (Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q5_K / Q6_K in
    /// 16-row groups, `packed.rs`): read only by the AVX-512 VNNI one-token kernel and GEMM
    /// panels, never decoded row by row.
    Packed {
        data: &'a [u8],
        /// Blocks per row.
        nb: usize,
        /// The packed format (`packed.rs`: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K).
        fmt: u8,
    },
}

impl<'a> WView<'a> {
    /// The integer-engine view of `w`, or `None` for float weights (F32/F16/BF16) and types the
    /// engines do not decode.
    pub fn new(w: &'a QTensor) -> Option<WView<'a>> {
        match &w.data {
            WeightData::Ggml { ty, data } => {
                use GgmlType::*;
                if !matches!(
                    ty,
                    Q4_0 | Q4_1
                        | Q5_0
                        | Q5_1
                        | Q8_0
                        | Q2_K
                        | Q3_K
                        | Q4_K
                        | Q5_K
                        | Q6_K
                        | Q8_K
                        | MXFP4
                ) {
                    return None;
                }
                let row_bytes = ty.row_bytes(w.cols)?;
                Some(WView::Ggml {
                    ty: *ty,
                    data: data.as_slice(),
                    row_bytes,
                })
            }
            WeightData::Affine {
                params,
                packed,
                scales,
                biases,
            } => Some(WView::Affine {
                p: *params,
                packed: packed.as_slice(),
                row_bytes: w.cols * params.bits as usize / 8,
                scales,
                biases,
                groups: w.cols / params.group_size,
            }),
        }
    }

    /// Whether the codes use all 8 bits (see the module header).
    pub fn wide(&self) -> bool {
        match self {
            WView::Ggml { ty, .. } => matches!(ty, GgmlType::Q8_0 | GgmlType::Q8_K),
            WView::Affine { p, .. } => p.bits == 8,
            WView::Packed { fmt, .. } => *fmt == super::packed::Q8_0,
        }
    }

    /// Decodes row `r` into `codes` (C), `a` and `c` (C/16 each).
    #[inline(always)]
    pub fn unpack_row(&self, r: usize, codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
        match *self {
            WView::Ggml {
                ty,
                data,
                row_bytes,
            } => {
                let src = &data[r * row_bytes..(r + 1) * row_bytes];
                match ty {
                    GgmlType::Q4_0 => q4_0(src, codes, a, c),
                    GgmlType::Q4_1 => q4_1(src, codes, a, c),
                    GgmlType::Q5_0 => q5_0(src, codes, a, c),
                    GgmlType::Q5_1 => q5_1(src, codes, a, c),
                    GgmlType::Q8_0 => q8_0(src, codes, a, c),
                    GgmlType::Q2_K => q2_k(src, codes, a, c),
                    GgmlType::Q3_K => q3_k(src, codes, a, c),
                    GgmlType::Q4_K => q4_k(src, codes, a, c),
                    GgmlType::Q5_K => q5_k(src, codes, a, c),
                    GgmlType::Q6_K => q6_k(src, codes, a, c),
                    GgmlType::Q8_K => q8_k(src, codes, a, c),
                    GgmlType::MXFP4 => super::mxfp4::unpack_row(src, codes, a, c),
                    _ => unreachable!("WView::new admits only the types above"),
                }
            }
            WView::Affine {
                p,
                packed,
                row_bytes,
                scales,
                biases,
                groups,
            } => {
                let src = &packed[r * row_bytes..(r + 1) * row_bytes];
                let (s, b) = (
                    &scales[r * groups..(r + 1) * groups],
                    &biases[r * groups..(r + 1) * groups],
                );
                affine(p, src, s, b, codes, a, c)
            }
            WView::Packed { .. } => {
                unreachable!("packed weights are given only to the kernels that read them")
            }
        }
    }
}

/// Iterates whole blocks: (src block, 32*n codes, 2*n scales, 2*n offsets).
macro_rules! blocks {
    ($src:ident, $codes:ident, $a:ident, $c:ident, $bytes:expr, $n:expr) => {
        $src.chunks_exact($bytes)
            .zip($codes.chunks_exact_mut($n))
            .zip($a.chunks_exact_mut($n / 16))
            .zip($c.chunks_exact_mut($n / 16))
            .map(|(((b, u), a), c)| {
                let b: &[u8; $bytes] = b.try_into().expect("exact chunk");
                let u: &mut [u8; $n] = u.try_into().expect("exact chunk");
                (b, u, a, c)
            })
    };
}

#[inline(always)]
fn nibbles(qs: &[u8], u: &mut [u8; 32]) {
    for j in 0..16 {
        u[j] = qs[j] & 0x0f;
        u[j + 16] = qs[j] >> 4;
    }
}

/// The fifth bit of element j (bit j of `qh`) as 0 or 16.
#[inline(always)]
fn fifth_bits(qh: u32, u: &mut [u8; 32]) {
    for (j, v) in u.iter_mut().enumerate() {
        *v |= (((qh >> j) & 1) << 4) as u8;
    }
}

#[inline(always)]
fn q4_0(src: &[u8], codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
    for (b, u, a, c) in blocks!(src, codes, a, c, 18, 32) {
        let d = h2f(b[0], b[1]);
        nibbles(&b[2..18], u);
        a.fill(d);
        c.fill(-8.0 * d);
    }
}

#[inline(always)]
fn q4_1(src: &[u8], codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
    for (b, u, a, c) in blocks!(src, codes, a, c, 20, 32) {
        let (d, m) = (h2f(b[0], b[1]), h2f(b[2], b[3]));
        nibbles(&b[4..20], u);
        a.fill(d);
        c.fill(m);
    }
}

#[inline(always)]
fn q5_0(src: &[u8], codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
    for (b, u, a, c) in blocks!(src, codes, a, c, 22, 32) {
        let d = h2f(b[0], b[1]);
        nibbles(&b[6..22], u);
        fifth_bits(u32::from_le_bytes([b[2], b[3], b[4], b[5]]), u);
        a.fill(d);
        c.fill(-16.0 * d);
    }
}

#[inline(always)]
fn q5_1(src: &[u8], codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
    for (b, u, a, c) in blocks!(src, codes, a, c, 24, 32) {
        let (d, m) = (h2f(b[0], b[1]), h2f(b[2], b[3]));
        nibbles(&b[8..24], u);
        fifth_bits(u32::from_le_bytes([b[4], b[5], b[6], b[7]]), u);
        a.fill(d);
        c.fill(m);
    }
}

#[inline(always)]
fn q8_0(src: &[u8], codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
    for (b, u, a, c) in blocks!(src, codes, a, c, 34, 32) {
        let d = h2f(b[0], b[1]);
        for j in 0..32 {
            u[j] = b[2 + j] ^ 0x80; // i8 q -> q + 128
        }
        a.fill(d);
        c.fill(-128.0 * d);
    }
}

#[inline(always)]
fn q8_k(src: &[u8], codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
    for (b, u, a, c) in blocks!(src, codes, a, c, 292, 256) {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for j in 0..256 {
            u[j] = b[4 + j] ^ 0x80;
        }
        a.fill(d);
        c.fill(-128.0 * d);
    }
}

#[inline(always)]
fn q2_k(src: &[u8], codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
    for (b, u, a, c) in blocks!(src, codes, a, c, 84, 256) {
        let (d, dmin) = (h2f(b[80], b[81]), h2f(b[82], b[83]));
        // Output order: for n in 0..2, shift in 0,2,4,6, half in 0..2: 16 elements from
        // qs[32n + 16half ..] >> shift; sub-block index = output index / 16.
        for n in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    u[128 * n + 32 * s + l] = (b[16 + 32 * n + l] >> (2 * s)) & 3;
                }
            }
        }
        for i in 0..16 {
            let sc = b[i];
            a[i] = d * (sc & 0x0f) as f32;
            c[i] = -(dmin * (sc >> 4) as f32);
        }
    }
}

#[inline(always)]
fn q3_k(src: &[u8], codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
    for (b, u, a, c) in blocks!(src, codes, a, c, 110, 256) {
        let d = h2f(b[108], b[109]);
        let sc = &b[96..108];
        for n in 0..2 {
            for s in 0..4 {
                let m = 1u8 << (4 * n + s);
                for l in 0..32 {
                    let low = (b[32 + 32 * n + l] >> (2 * s)) & 3;
                    let high = if b[l] & m != 0 { 4 } else { 0 };
                    u[128 * n + 32 * s + l] = low | high;
                }
            }
        }
        for i in 0..16 {
            let lo = if i < 8 { sc[i] & 0x0f } else { sc[i - 8] >> 4 };
            let hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
            a[i] = d * ((lo | (hi << 4)) as i32 - 32) as f32;
            c[i] = -4.0 * a[i];
        }
    }
}

/// `get_scale_min_k4` (see `quant/kquants.rs`).
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The low nibble / low two bits of every byte of a u64.
const LO4: u64 = 0x0f0f_0f0f_0f0f_0f0f;
const LO2: u64 = 0x0303_0303_0303_0303;

/// Eight bytes as a little-endian u64.
#[inline(always)]
fn le8(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("eight bytes"))
}

/// Stores a u64's eight bytes (little-endian).
#[inline(always)]
fn put8(dst: &mut [u8], v: u64) {
    dst[..8].copy_from_slice(&v.to_le_bytes());
}

#[inline(always)]
fn kscales(b: &[u8], d: f32, dmin: f32, a: &mut [f32], c: &mut [f32]) {
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &b[4..16]);
        let (aj, cj) = (d * sc as f32, -(dmin * m as f32));
        a[2 * j] = aj;
        a[2 * j + 1] = aj;
        c[2 * j] = cj;
        c[2 * j + 1] = cj;
    }
}

#[inline(always)]
fn q4_k(src: &[u8], codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
    for (b, u, a, c) in blocks!(src, codes, a, c, 144, 256) {
        let (d, dmin) = (h2f(b[0], b[1]), h2f(b[2], b[3]));
        // Eight bytes at a time (this loop does not vectorise as bytes).
        for ch in 0..4 {
            for w in 0..4 {
                let q = le8(&b[16 + 32 * ch + 8 * w..]);
                put8(&mut u[64 * ch + 8 * w..], q & LO4);
                put8(&mut u[64 * ch + 32 + 8 * w..], (q >> 4) & LO4);
            }
        }
        kscales(b, d, dmin, a, c);
    }
}

#[inline(always)]
fn q5_k(src: &[u8], codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
    for (b, u, a, c) in blocks!(src, codes, a, c, 176, 256) {
        let (d, dmin) = (h2f(b[0], b[1]), h2f(b[2], b[3]));
        for ch in 0..4 {
            for l in 0..32 {
                let (q, h) = (b[48 + 32 * ch + l], b[16 + l]);
                u[64 * ch + l] = (q & 0x0f) | (((h >> (2 * ch)) & 1) << 4);
                u[64 * ch + 32 + l] = (q >> 4) | (((h >> (2 * ch + 1)) & 1) << 4);
            }
        }
        kscales(b, d, dmin, a, c);
    }
}

#[inline(always)]
fn q6_k(src: &[u8], codes: &mut [u8], a: &mut [f32], c: &mut [f32]) {
    for (b, u, a, c) in blocks!(src, codes, a, c, 210, 256) {
        let d = h2f(b[208], b[209]);
        for n in 0..2 {
            let (ql, qh) = (&b[64 * n..64 * n + 64], &b[128 + 32 * n..128 + 32 * n + 32]);
            let un = &mut u[128 * n..128 * n + 128];
            // Eight bytes at a time, as in `q4_k` (masks keep every shift inside its byte).
            for l in (0..32).step_by(8) {
                let (q0, q1, h) = (le8(&ql[l..]), le8(&ql[l + 32..]), le8(&qh[l..]));
                put8(&mut un[l..], (q0 & LO4) | ((h & LO2) << 4));
                put8(&mut un[l + 32..], (q1 & LO4) | (((h >> 2) & LO2) << 4));
                put8(
                    &mut un[l + 64..],
                    ((q0 >> 4) & LO4) | (((h >> 4) & LO2) << 4),
                );
                put8(
                    &mut un[l + 96..],
                    ((q1 >> 4) & LO4) | (((h >> 6) & LO2) << 4),
                );
            }
        }
        // Sub-block of 16 i uses scale byte 192 + i (element e of half n: 8n + (e % 128) / 16).
        for i in 0..16 {
            a[i] = d * (b[192 + i] as i8) as f32;
            c[i] = -32.0 * a[i];
        }
    }
}

#[inline(always)]
fn affine(
    p: AffineParams,
    src: &[u8],
    s: &[f32],
    bias: &[f32],
    codes: &mut [u8],
    a: &mut [f32],
    c: &mut [f32],
) {
    match p.bits {
        4 => {
            for (u, &byte) in codes.chunks_exact_mut(2).zip(src) {
                u[0] = byte & 0x0f;
                u[1] = byte >> 4;
            }
        }
        8 => codes.copy_from_slice(src),
        bits => {
            // Any other width: the little-endian bit stream of quant/mlx.rs, element by element.
            let bits = bits as usize;
            let mask = (1u32 << bits) - 1;
            for (i, u) in codes.iter_mut().enumerate() {
                let (byte, shift) = (i * bits / 8, (i * bits % 8) as u32);
                let mut v = (src[byte] as u32) >> shift;
                if shift as usize + bits > 8 {
                    v |= (src[byte + 1] as u32) << (8 - shift);
                }
                *u = (v & mask) as u8;
            }
        }
    }
    let per = p.group_size / 16;
    for (g, (ag, cg)) in a
        .chunks_exact_mut(per)
        .zip(c.chunks_exact_mut(per))
        .enumerate()
    {
        ag.fill(s[g]);
        cg.fill(bias[g]);
    }
}

/// Runs `unpack_row` for rows `r0..r0 + n` into row-major scratch (`codes` n*C, `a`/`c` n*C/16).
#[inline(always)]
pub fn unpack_rows(
    w: &WView<'_>,
    r0: usize,
    n: usize,
    k: usize,
    codes: &mut [u8],
    a: &mut [f32],
    c: &mut [f32],
) {
    let g = k / 16;
    for i in 0..n {
        w.unpack_row(
            r0 + i,
            &mut codes[i * k..(i + 1) * k],
            &mut a[i * g..(i + 1) * g],
            &mut c[i * g..(i + 1) * g],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h2f_matches_half_for_every_pattern() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = h2f(h as u8, (h >> 8) as u8);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{h:#06x}: {got} vs {want}"
            );
        }
    }
}
