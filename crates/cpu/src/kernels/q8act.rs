//! Activation quantization for the integer dot products: each activation row (C values, C a
//! multiple of 32) is cut into blocks of 32 and stored as `x ~= dx * q`, `q` in -127..=127,
//! `dx = max|x| / 127` (ggml's Q8_0 rule, with the scale kept in f32 instead of f16).
//!
//! Error bound (what the contract tests hold the kernels to): `q = round(x / dx)`, so
//! `|x - dx * q| <= dx / 2 = max|x_block| / 254` for every element, and a dot product with a
//! weight row `w` moves by at most `Σ |w_i| * max|x_block(i)| / 254`.
//!
//! Per 16 elements we also keep `dx` (repeated, so the engines read scales at one granularity)
//! and `dx * Σ q` (for the `c * Σ x` offset term of the weight form `a * u + c`). One scale per
//! 32 values, not llama.cpp's one per 256 for k-quants: it costs the same in these engines (they
//! scale every 16-element partial sum in f32 anyway) and rounds outlier channels less.
//!
//! Not here: weight decoding (`unpack.rs`), the dot products themselves.

/// Elements per activation block.
pub const QA: usize = 32;

/// Quantized activations for T rows of C values.
#[derive(Default, Debug)]
pub struct ActQ8 {
    /// T.
    pub t: usize,
    /// C (a multiple of 32).
    pub k: usize,
    /// (T, C) quantized values.
    pub qx: Vec<i8>,
    /// (T, C/16): the scale of the 32-block holding these 16 values.
    pub dx: Vec<f32>,
    /// (T, C/16): `dx * Σ q` over these 16 values.
    pub sx: Vec<f32>,
    /// (T, C/32): `dx * Σ q` over each 32-block (for the fused 32-block kernels).
    pub sx32: Vec<f32>,
    /// (T, C/32): the scale of each 32-block (`dx` without the repeat, for the T = 1 kernels,
    /// which read the scales of 16 blocks as one vector).
    pub dx32: Vec<f32>,
    /// Two-part rows only ([`quantize_rows_split`]), for the T/2 pairs (row t and its remainder,
    /// row T/2 + t): `sx` and `sx32` of both parts added, (T/2, C/16) and (T/2, C/32).
    pub sxp: Vec<f32>,
    pub sxp32: Vec<f32>,
    /// The input these rows were quantized from, and how (see [`ActQ8::holds`]).
    src: Vec<f32>,
    src_for: Option<(super::Isa, ActBits, usize)>,
}

/// Largest input (values) [`ActQ8::remember`] keeps a copy of: the copy and the comparison must
/// stay cheap next to the quantization they save.
const REMEMBER_MAX: usize = 1 << 15;

impl ActQ8 {
    /// Resizes for `t` rows of `k` (grows the buffers, never shrinks them, so a reused `ActQ8`
    /// stops allocating once it has seen the largest call).
    pub fn reshape(&mut self, t: usize, k: usize) {
        debug_assert!(k.is_multiple_of(QA));
        self.t = t;
        self.k = k;
        let n = t * k;
        if self.qx.len() < n {
            self.qx.resize(n, 0);
        }
        if self.dx.len() < n / 16 {
            self.dx.resize(n / 16, 0.0);
            self.sx.resize(n / 16, 0.0);
            self.sx32.resize(n / 32, 0.0);
            self.dx32.resize(n / 32, 0.0);
            self.sxp.resize(n / 32, 0.0);
            self.sxp32.resize(n / 64, 0.0);
        }
    }

    /// Whether this already holds `x` (T rows) quantized on `isa` with `bits`: the same input,
    /// bit for bit, as the last [`ActQ8::remember`]. Several matmuls read one input (the q, k
    /// and v projections; gate and up), and each would quantize it again.
    pub fn holds(&self, isa: super::Isa, bits: ActBits, x: &[f32], t: usize) -> bool {
        self.src_for == Some((isa, bits, t))
            && self.src.len() == x.len()
            && self
                .src
                .iter()
                .zip(x)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    }

    /// Records that this now holds `x` quantized as given (small inputs only; otherwise it
    /// forgets, so a later [`ActQ8::holds`] is false).
    pub fn remember(&mut self, isa: super::Isa, bits: ActBits, x: &[f32], t: usize) {
        self.src.clear();
        if x.len() <= REMEMBER_MAX {
            self.src.extend_from_slice(x);
            self.src_for = Some((isa, bits, t));
        } else {
            self.src_for = None;
        }
    }

    /// Quantized row `ti`: (q, dx per 16, dx * Σq per 16).
    pub fn row(&self, ti: usize) -> (&[i8], &[f32], &[f32]) {
        let (k, g) = (self.k, self.k / 16);
        (
            &self.qx[ti * k..(ti + 1) * k],
            &self.dx[ti * g..(ti + 1) * g],
            &self.sx[ti * g..(ti + 1) * g],
        )
    }
}

/// Quantizes one row: `x` (C), `qx` (C), `dx` and `sx` (C/16 each); C a multiple of 32.
/// Written as plain loops that the compiler vectorises for the ISA of the caller it is inlined into.
#[inline(always)]
pub fn quantize_row(x: &[f32], qx: &mut [i8], dx: &mut [f32], sx: &mut [f32]) {
    let blocks = x
        .chunks_exact(QA)
        .zip(qx.chunks_exact_mut(QA))
        .zip(dx.chunks_exact_mut(2))
        .zip(sx.chunks_exact_mut(2));
    for (((xb, qb), db), sb) in blocks {
        let xb: &[f32; QA] = xb.try_into().expect("exact chunk");
        let qb: &mut [i8; QA] = qb.try_into().expect("exact chunk");
        let mut amax = 0f32;
        for v in xb {
            amax = amax.max(v.abs());
        }
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut s = [0i32; 2];
        for (h, sh) in s.iter_mut().enumerate() {
            let mut acc = 0i32;
            for j in 16 * h..16 * h + 16 {
                // |x * id| <= 127 up to one rounding; the clamp keeps it in i8 whatever happens.
                let q = ((xb[j] * id).round_ties_even() as i32).clamp(-127, 127);
                qb[j] = q as i8;
                acc += q;
            }
            *sh = acc;
        }
        db[0] = d;
        db[1] = d;
        sb[0] = d * s[0] as f32;
        sb[1] = d * s[1] as f32;
    }
}

/// Quantizes one row in two 8-bit parts (see [`ActBits::Split16`]): `x ~= dx * (q + l / 256)`.
/// The first part is [`quantize_row`]'s; the second, `l = round(256 * (x / dx - q))`, carries the
/// rounding remainder at 1/256 of the step, so the total error is at most
/// `max|x_block| / (254 * 256)` (plus f32 rounding): a 16-bit activation with an 8-bit engine.
/// `dl`/`sl` are `dx / 256` and `dx / 256 * Σ l`, so the second part is an ordinary quantized row
/// that every engine multiplies like the first.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn quantize_row_split(
    x: &[f32],
    qx: &mut [i8],
    dx: &mut [f32],
    sx: &mut [f32],
    ql: &mut [i8],
    dl: &mut [f32],
    sl: &mut [f32],
) {
    quantize_row(x, qx, dx, sx);
    let blocks = x
        .chunks_exact(QA)
        .zip(qx.chunks_exact(QA))
        .zip(ql.chunks_exact_mut(QA))
        .zip(dx.chunks_exact(2))
        .zip(dl.chunks_exact_mut(2).zip(sl.chunks_exact_mut(2)));
    for ((((xb, qb), lb), db), (dlb, slb)) in blocks {
        let xb: &[f32; QA] = xb.try_into().expect("exact chunk");
        let qb: &[i8; QA] = qb.try_into().expect("exact chunk");
        let lb: &mut [i8; QA] = lb.try_into().expect("exact chunk");
        let d = db[0];
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut s = [0i32; 2];
        for (h, sh) in s.iter_mut().enumerate() {
            let mut acc = 0i32;
            for j in 16 * h..16 * h + 16 {
                // x * id - q is in [-0.5, 0.5] up to rounding; 256 times that can reach 128,
                // which the clamp turns into 127 (an error of 1/256 of a step at most).
                let r = (xb[j] * id - qb[j] as f32) * 256.0;
                let l = (r.round_ties_even() as i32).clamp(-127, 127);
                lb[j] = l as i8;
                acc += l;
            }
            *sh = acc;
        }
        let d2 = d * (1.0 / 256.0);
        dlb[0] = d2;
        dlb[1] = d2;
        slb[0] = d2 * s[0] as f32;
        slb[1] = d2 * s[1] as f32;
    }
}

/// How finely activations are quantized for the integer engines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActBits {
    /// Two 8-bit parts per value (`x ~= dx * (q + l / 256)`): each call multiplies 2T rows and
    /// adds the halves. Error about 1/256 of 8-bit's: meets the end-to-end gate (mean KL
    /// <= 1e-3 against the f32 reference). The default.
    #[default]
    Split16,
    /// One 8-bit part per value (ggml's Q8_0 rule with blocks of 32): the fastest, as accurate
    /// as llama.cpp's CPU path (mean KL about 3e-3 on SmolLM2 against f32 activations).
    Q8,
}

/// A row quantizer: (x, q, dx per 16, sx per 16), compiled for one ISA.
pub type QuantRowFn = unsafe fn(&[f32], &mut [i8], &mut [f32], &mut [f32]);

/// Quantizes `t` rows of `x` (T, C) into `a`, rows split over rayon when there are many.
///
/// # Safety
/// `row_fn` must be runnable on this CPU (its ISA available).
pub unsafe fn quantize_rows(x: &[f32], a: &mut ActQ8, row_fn: QuantRowFn) {
    quantize_rows_into(x, a, row_fn);
    finish_sx32(a);
}

/// [`quantize_rows`] in two 8-bit parts: `a` holds 2T rows, the T first parts then the T
/// remainders (see [`quantize_row_split`]).
///
/// # Safety
/// `row_fn` must be runnable on this CPU (its ISA available).
pub unsafe fn quantize_rows_split(x: &[f32], a: &mut ActQ8, row_fn: SplitRowFn) {
    use rayon::prelude::*;
    let (k, t) = (a.k, a.t / 2);
    let g = k / 16;
    let (qh, ql) = a.qx[..2 * t * k].split_at_mut(t * k);
    let (dh, dl) = a.dx[..2 * t * g].split_at_mut(t * g);
    let (sh, sl) = a.sx[..2 * t * g].split_at_mut(t * g);
    if t >= 16 {
        let rows = x
            .par_chunks(k)
            .zip(qh.par_chunks_mut(k).zip(ql.par_chunks_mut(k)))
            .zip(dh.par_chunks_mut(g).zip(dl.par_chunks_mut(g)))
            .zip(sh.par_chunks_mut(g).zip(sl.par_chunks_mut(g)));
        rows.with_min_len(4)
            .for_each(|(((xr, (q, l)), (d, dr)), (s, sr))| row_fn(xr, q, d, s, l, dr, sr));
    } else {
        let rows = x
            .chunks(k)
            .zip(qh.chunks_mut(k).zip(ql.chunks_mut(k)))
            .zip(dh.chunks_mut(g).zip(dl.chunks_mut(g)))
            .zip(sh.chunks_mut(g).zip(sl.chunks_mut(g)));
        for (((xr, (q, l)), (d, dr)), (s, sr)) in rows {
            row_fn(xr, q, d, s, l, dr, sr);
        }
    }
    finish_sx32(a);
    let (g, g2) = (k / 16, k / 32);
    let (h, l) = a.sx[..2 * t * g].split_at(t * g);
    for ((p, h), l) in a.sxp[..t * g].iter_mut().zip(h).zip(l) {
        *p = h + l;
    }
    let (h, l) = a.sx32[..2 * t * g2].split_at(t * g2);
    for ((p, h), l) in a.sxp32[..t * g2].iter_mut().zip(h).zip(l) {
        *p = h + l;
    }
}

fn finish_sx32(a: &mut ActQ8) {
    let (k, t) = (a.k, a.t);
    let g = k / 16;
    for (s32, s16) in a.sx32[..t * k / 32]
        .iter_mut()
        .zip(a.sx[..t * g].chunks_exact(2))
    {
        *s32 = s16[0] + s16[1];
    }
    for (d32, d16) in a.dx32[..t * k / 32]
        .iter_mut()
        .zip(a.dx[..t * g].chunks_exact(2))
    {
        *d32 = d16[0];
    }
}

/// A split row quantizer (see [`quantize_row_split`]), compiled for one ISA.
pub type SplitRowFn =
    unsafe fn(&[f32], &mut [i8], &mut [f32], &mut [f32], &mut [i8], &mut [f32], &mut [f32]);

unsafe fn quantize_rows_into(x: &[f32], a: &mut ActQ8, row_fn: QuantRowFn) {
    use rayon::prelude::*;
    let (k, t) = (a.k, a.t);
    let g = k / 16;
    let qx = &mut a.qx[..t * k];
    let dx = &mut a.dx[..t * g];
    let sx = &mut a.sx[..t * g];
    if t >= 16 {
        let rows = x
            .par_chunks(k)
            .zip(qx.par_chunks_mut(k))
            .zip(dx.par_chunks_mut(g))
            .zip(sx.par_chunks_mut(g));
        rows.with_min_len(4)
            .for_each(|(((xr, q), d), s)| row_fn(xr, q, d, s));
    } else {
        for (((xr, q), d), s) in x
            .chunks(k)
            .zip(qx.chunks_mut(k))
            .zip(dx.chunks_mut(g))
            .zip(sx.chunks_mut(g))
        {
            row_fn(xr, q, d, s);
        }
    }
}

/// The portable row quantizer (baseline ISA).
pub fn quantize_row_scalar(x: &[f32], qx: &mut [i8], dx: &mut [f32], sx: &mut [f32]) {
    quantize_row(x, qx, dx, sx)
}

/// The portable split row quantizer (baseline ISA).
#[allow(clippy::too_many_arguments)]
pub fn quantize_row_split_scalar(
    x: &[f32],
    qx: &mut [i8],
    dx: &mut [f32],
    sx: &mut [f32],
    ql: &mut [i8],
    dl: &mut [f32],
    sl: &mut [f32],
) {
    quantize_row_split(x, qx, dx, sx, ql, dl, sl)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::QA;

    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn quantize_row_split_avx2(
        x: &[f32],
        qx: &mut [i8],
        dx: &mut [f32],
        sx: &mut [f32],
        ql: &mut [i8],
        dl: &mut [f32],
        sl: &mut [f32],
    ) {
        super::quantize_row_split(x, qx, dx, sx, ql, dl, sl)
    }

    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    pub unsafe fn quantize_row_split_avx512(
        x: &[f32],
        qx: &mut [i8],
        dx: &mut [f32],
        sx: &mut [f32],
        ql: &mut [i8],
        dl: &mut [f32],
        sl: &mut [f32],
    ) {
        use std::arch::x86_64::*;
        // The same arithmetic as `quantize_row_split`, element for element (no fused
        // multiply-adds, ties to even), so every ISA quantizes to the same bytes; written out
        // because the generic loop does not vectorise (this runs once per row per matmul).
        let n = x.len() / QA;
        debug_assert!(qx.len() >= n * QA && ql.len() >= n * QA && dx.len() >= 2 * n);
        const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let (lo, hi) = (_mm512_set1_epi32(-127), _mm512_set1_epi32(127));
        let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
        for b in 0..n {
            let p = x.as_ptr().add(b * QA);
            let v = [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))];
            let a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v[0]), abs_mask));
            let a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v[1]), abs_mask));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
            let d = amax / 127.0;
            let id = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            let d2 = d * (1.0 / 256.0);
            for h in 0..2 {
                let xs = _mm512_mul_ps(v[h], id);
                let qf = _mm512_roundscale_ps::<RNE>(xs);
                let q = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(qf), lo), hi);
                let r = _mm512_mul_ps(
                    _mm512_sub_ps(xs, _mm512_cvtepi32_ps(q)),
                    _mm512_set1_ps(256.0),
                );
                let l = _mm512_min_epi32(
                    _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_roundscale_ps::<RNE>(r)), lo),
                    hi,
                );
                let at = b * QA + 16 * h;
                _mm_storeu_si128(
                    qx.as_mut_ptr().add(at) as *mut __m128i,
                    _mm512_cvtepi32_epi8(q),
                );
                _mm_storeu_si128(
                    ql.as_mut_ptr().add(at) as *mut __m128i,
                    _mm512_cvtepi32_epi8(l),
                );
                let g = 2 * b + h;
                dx[g] = d;
                sx[g] = d * _mm512_reduce_add_epi32(q) as f32;
                dl[g] = d2;
                sl[g] = d2 * _mm512_reduce_add_epi32(l) as f32;
            }
        }
    }

    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_row_avx2(x: &[f32], qx: &mut [i8], dx: &mut [f32], sx: &mut [f32]) {
        super::quantize_row(x, qx, dx, sx)
    }

    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn quantize_row_avx512(x: &[f32], qx: &mut [i8], dx: &mut [f32], sx: &mut [f32]) {
        super::quantize_row(x, qx, dx, sx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_error_is_at_most_half_a_step() {
        let x: Vec<f32> = (0..96)
            .map(|i| ((i * 7919) % 101) as f32 * 0.37 - 17.0 + if i == 40 { 300.0 } else { 0.0 })
            .collect();
        let (mut q, mut d, mut s) = (vec![0i8; 96], vec![0f32; 6], vec![0f32; 6]);
        quantize_row_scalar(&x, &mut q, &mut d, &mut s);
        for (b, xb) in x.chunks(32).enumerate() {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (j, v) in xb.iter().enumerate() {
                let y = d[2 * b] * q[32 * b + j] as f32;
                assert!((v - y).abs() <= amax / 254.0 * 1.0001, "{v} -> {y}");
            }
            for h in 0..2 {
                let sum: i32 = q[32 * b + 16 * h..32 * b + 16 * h + 16]
                    .iter()
                    .map(|&v| v as i32)
                    .sum();
                assert_eq!(s[2 * b + h], d[2 * b + h] * sum as f32);
            }
        }
        let (mut q, mut d, mut s) = (vec![1i8; 32], vec![1f32; 2], vec![1f32; 2]);
        quantize_row_scalar(&[0.0; 32], &mut q, &mut d, &mut s);
        assert!(q.iter().all(|&v| v == 0) && d == [0.0, 0.0] && s == [0.0, 0.0]);
    }

    /// The AVX-512 split quantizer writes the same bytes and scales as the portable one.
    #[allow(clippy::type_complexity)]
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn split_avx512_equals_scalar() {
        if !crate::kernels::Isa::Avx512Vnni.is_available() {
            eprintln!("skipped: no AVX-512");
            return;
        }
        let mut seed = 0x1234_5678u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        let k = 32 * 9;
        let mut x: Vec<f32> = (0..k).map(|_| (next() * 2.0 - 1.0) as f32).collect();
        x[5] = 300.0; // an outlier
        x[40..72].iter_mut().for_each(|v| *v = 0.0); // an all-zero block
        x[100] = -1e-30; // a tiny block max
        x[96..128].iter_mut().for_each(|v| *v *= 1e-30);
        let run =
            |f: &dyn Fn(&mut [i8], &mut [f32], &mut [f32], &mut [i8], &mut [f32], &mut [f32])| {
                let (mut q, mut d, mut s) = (vec![0i8; k], vec![0f32; k / 16], vec![0f32; k / 16]);
                let (mut l, mut dl, mut sl) =
                    (vec![0i8; k], vec![0f32; k / 16], vec![0f32; k / 16]);
                f(&mut q, &mut d, &mut s, &mut l, &mut dl, &mut sl);
                (q, d, s, l, dl, sl)
            };
        let want = run(&|q, d, s, l, dl, sl| quantize_row_split_scalar(&x, q, d, s, l, dl, sl));
        // SAFETY: AVX-512 checked above.
        let got = run(&|q, d, s, l, dl, sl| unsafe {
            x86::quantize_row_split_avx512(&x, q, d, s, l, dl, sl)
        });
        assert_eq!(want, got);
    }
}
