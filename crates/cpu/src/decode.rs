//! Attention of one new token (decode, `T = 1`) on the CPU's fast path, by kv head: the query
//! rows of a kv head's group (`G = n_heads / n_kv_heads` heads) are computed together, so that
//! a cache type with a grouped kernel reads and widens each key and value row once for all `G`
//! rows instead of once per query head.
//!
//! For one kv head and a range of its visible keys (a "part"):
//! - scores `s (G, n) = q (G, Dh) · Kᵀ` ([`KvRead::scores`]), scaled;
//! - per row a max `m_r` and `e^(s - m_r)` with their sum `l_r`;
//! - `acc (G, Dh) = Σ_j e^(s_rj - m_r) · v_j` ([`KvRead::accumulate_rows`]), unnormalised.
//!
//! A long context is split into several parts per kv head when there are threads to share it
//! (flash-decoding): each part is an independent work item, and [`combine`] merges the parts of
//! a row, `o = Σ_c e^(m_c - M) acc_c / (Σ_c e^(m_c - M) l_c + e^(sink - M))` with `M` the largest
//! `m_c` (and the head's sink logit, if any). One thread (or a short context) runs one part per
//! kv head, in order.
//!
//! Centred keys (`KeyCentre`: a quantized key plane whose first positions are f16 rows of their
//! own and whose later rows hold `k - c(j)`): a kv head's sink positions are one part of their
//! own over the f16 rows, and every other part adds each row's `q · c` to its scores before the
//! scale (a centre that follows RoPE on a few pairs: each row's and key's `q · c(j)`, its angles
//! stepped from key to key), so the parts merge as any others.
//!
//! The grouped kernels for 8-bit blocks (ggml's Q8_0, mlx-lm's 8-bit affine groups) are in
//! [`x512`] (AVX-512: each key's integers widened once, the `G` rows' 16-lane sums kept apart
//! and reduced sixteen keys at a time by a transposing tree instead of one horizontal sum per
//! key) and [`x256`] (AVX2: the same on 8-lane vectors, eight keys reduced at a time), both
//! reading blocks through [`int8`]. Every other type and vector unit reads row by row through
//! [`KvRead::dot`] and [`KvRead::accumulate`]. This is not the prefill path (`attention.rs`'s tiles) nor the
//! reference (`CpuBackend::attention` on the reference path), which the tests hold it to.

use rayon::prelude::*;

use super::attention::{exp_fast, sum16, KvRead, PORTABLE};
#[cfg(target_arch = "x86_64")]
use super::attention::{AVX2, AVX512};
use super::kernels::Isa;
use hf2q_tensor::op::{AttentionParams, LayerCache};
use hf2q_tensor::weight::dot;
use hf2q_tensor::{Result, Tensor};

/// Fewest keys in a part when a kv head's keys are split over threads.
const MIN_PART: usize = 256;

thread_local! {
    /// Scores of one part (grows to the longest seen, then is reused).
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One part's result for its kv head's `G` rows: `(m_r, l_r)` and `acc (G, Dh)` (module header).
struct Part {
    ml: Vec<(f32, f32)>,
    acc: Vec<f32>,
}

/// Attention of one token: `q (1, H * Dh)` over the cache's positions `lo..=pos0` (`lo` from the
/// window) -> `(1, H * Dh)`. Already checked by the caller: `q` is one row, the cache holds
/// `pos0 + 1` positions, `isa` is available.
pub(crate) fn decode<K: KvRead, V: KvRead>(
    isa: Isa,
    q: &Tensor,
    cache: &LayerCache<'_, K, V>,
    pos0: usize,
    p: &AttentionParams,
) -> Result<Tensor> {
    let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
    let (rk, rv) = (dh / K::VALUES, dh / V::VALUES);
    let group = h / hkv;
    let lo = match p.window {
        Some(w) => (pos0 + 1).saturating_sub(w),
        None => 0,
    };
    let n = pos0 + 1 - lo;
    // A head is about 4 * n * Dh flops: hand work to other threads only when that outweighs
    // waking them; then give every thread about two items (kv heads split into parts).
    let threads = rayon::current_num_threads();
    let parallel = threads > 1 && h * n * dh >= 1 << 16;
    let parts = if parallel {
        (2 * threads).div_ceil(hkv).min(n / MIN_PART).max(1)
    } else {
        1
    };
    let len = n.div_ceil(parts).max(1);
    // Centred keys (`KeyCentre`): a kv head's sink positions are one part of their own (f16
    // keys), the rest parts of the plane's rows whose scores get `q · c` added.
    let sinks = cache.centre.map_or(0, |c| c.sinks);
    // Items `(kv head, first position, end)`, a head's in order; `heads[g]..heads[g + 1]` are
    // head g's.
    let mut items: Vec<(usize, usize, usize)> = Vec::new();
    let mut heads = vec![0usize];
    for g in 0..hkv {
        let mut a = lo;
        if sinks > lo {
            let b = sinks.min(pos0 + 1);
            items.push((g, a, b));
            a = b;
        }
        while a <= pos0 {
            let b = (a + len).min(pos0 + 1);
            items.push((g, a, b));
            a = b;
        }
        heads.push(items.len());
    }
    let run = |&(g, a, b): &(usize, usize, usize), s: &mut Vec<f32>| {
        let vb = g * cache.capacity * rv;
        let vals = &cache.v[vb + a * rv..vb + b * rv];
        let qg = &q.data()[g * group * dh..(g + 1) * group * dh];
        let mut part = Part {
            ml: vec![(0.0, 0.0); group],
            acc: vec![0f32; group * dh],
        };
        let (acc, ml) = (&mut part.acc[..], &mut part.ml[..]);
        match &cache.centre {
            Some(c) if a < sinks => {
                let keys = &c.sink[(g * sinks + a) * dh..(g * sinks + b) * dh];
                part_on(isa, qg, keys, vals, (p.scale, None), s, acc, ml);
            }
            centre => {
                let kb = g * cache.capacity * rk;
                let keys = &cache.k[kb + a * rk..kb + b * rk];
                // `q · c` per row, or with rotating pairs `q · c(j)` per row and key.
                let qc: Option<Vec<f32>> = centre.map(|c| match c.rotates() {
                    false => {
                        let cg = c.centre(g, dh);
                        qg.chunks_exact(dh).map(|qr| dot(qr, cg)).collect()
                    }
                    true => {
                        let qcs: Vec<_> = qg.chunks_exact(dh).map(|qr| c.q_centre(g, qr)).collect();
                        let mut add = vec![0f32; group * (b - a)];
                        c.add_scores(g, &qcs, a, &mut add);
                        add
                    }
                });
                part_on(isa, qg, keys, vals, (p.scale, qc.as_deref()), s, acc, ml);
            }
        }
        part
    };
    let done: Vec<Part> = if parallel && items.len() > 1 {
        items
            .par_iter()
            .map_init(Vec::new, |s, it| run(it, s))
            .collect()
    } else {
        SCORES.with(|c| match c.try_borrow_mut() {
            Ok(mut s) => items.iter().map(|it| run(it, &mut s)).collect(),
            Err(_) => items.iter().map(|it| run(it, &mut Vec::new())).collect(),
        })
    };
    let mut out = vec![0f32; h * dh];
    for (hi, o) in out.chunks_exact_mut(dh).enumerate() {
        let (g, r) = (hi / group, hi % group);
        let mine = done[heads[g]..heads[g + 1]]
            .iter()
            .map(|pt| (pt.ml[r], &pt.acc[r * dh..(r + 1) * dh]));
        combine(mine, p.sink(hi), o);
    }
    Tensor::new(&[1, h * dh], out)
}

/// `o = Σ_c e^(m_c - M) acc_c / (Σ_c e^(m_c - M) l_c + e^(sink - M))` over a row's parts
/// `((m_c, l_c), acc_c)`, `M = max(sink, m_c...)`; zeros when there is nothing to weigh (no
/// visible key and no sink: the reference's empty sum).
fn combine<'a>(
    parts: impl Iterator<Item = ((f32, f32), &'a [f32])> + Clone,
    sink: f32,
    o: &mut [f32],
) {
    let big = parts.clone().fold(sink, |a, ((m, _), _)| a.max(m));
    o.fill(0.0);
    let mut l = if sink == f32::NEG_INFINITY {
        0.0
    } else {
        (sink - big).exp()
    };
    for ((m, lc), acc) in parts {
        let w = (m - big).exp();
        l += w * lc;
        for (x, a) in o.iter_mut().zip(acc) {
            *x = w.mul_add(*a, *x);
        }
    }
    if l > 0.0 {
        let inv = 1.0 / l;
        for x in o.iter_mut() {
            *x *= inv;
        }
    }
}

/// One query head `q (Dh)` over key and value rows `k`, `v` (n, Dh) -> `o (Dh)` with the kernels
/// of `isa` (available): one part and [`combine`]. `sm`: the score scale and the head's sink
/// logit (`-inf`: none). `s` is scratch. The kernel tests' entry to one head.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn decode_head_on<K: KvRead, V: KvRead>(
    isa: Isa,
    q: &[f32],
    k: &[K],
    v: &[V],
    sm: (f32, f32),
    s: &mut Vec<f32>,
    o: &mut [f32],
) {
    let mut ml = [(f32::NEG_INFINITY, 0.0)];
    let mut acc = vec![0f32; o.len()];
    if !k.is_empty() {
        part_on(isa, q, k, v, (sm.0, None), s, &mut acc, &mut ml);
    }
    let parts = (!k.is_empty()).then_some((ml[0], &acc[..]));
    combine(parts.into_iter(), sm.1, o);
}

/// [`part`] compiled for `isa` (available).
#[allow(clippy::too_many_arguments)]
fn part_on<K: KvRead, V: KvRead>(
    isa: Isa,
    q: &[f32],
    k: &[K],
    v: &[V],
    scale: (f32, Option<&[f32]>),
    s: &mut Vec<f32>,
    acc: &mut [f32],
    ml: &mut [(f32, f32)],
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn avx512<K: KvRead, V: KvRead>(
            q: &[f32],
            k: &[K],
            v: &[V],
            scale: (f32, Option<&[f32]>),
            s: &mut Vec<f32>,
            acc: &mut [f32],
            ml: &mut [(f32, f32)],
        ) {
            part::<AVX512, K, V>(q, k, v, scale, s, acc, ml)
        }
        #[target_feature(enable = "avx2,fma,f16c")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn avx2<K: KvRead, V: KvRead>(
            q: &[f32],
            k: &[K],
            v: &[V],
            scale: (f32, Option<&[f32]>),
            s: &mut Vec<f32>,
            acc: &mut [f32],
            ml: &mut [(f32, f32)],
        ) {
            part::<AVX2, K, V>(q, k, v, scale, s, acc, ml)
        }
        if isa == Isa::Avx512Vnni {
            // SAFETY: the CPU has AVX-512 F/BW/VL, FMA and F16C (`isa` is available).
            return unsafe { avx512(q, k, v, scale, s, acc, ml) };
        }
        if isa == Isa::Avx2 {
            // SAFETY: the CPU has AVX2, FMA and F16C (`isa` is available).
            return unsafe { avx2(q, k, v, scale, s, acc, ml) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    part::<PORTABLE, K, V>(q, k, v, scale, s, acc, ml)
}

/// One part (module header): `q (G, Dh)` over `n >= 1` key and value rows `k`, `v` ->
/// `acc (G, Dh)` unnormalised and `ml[r] = (m_r, l_r)`. `scale`: the score scale, and for
/// centred keys each row's `q · c` (`G` values) or, for a centre that rotates, each row's and
/// key's (`(G, n)`), added to its scores before the scale. `L`: the vector unit the caller was
/// compiled for. Plain loops, no closures: a closure is compiled without the caller's target
/// features, and its `mul_add` would become a library call.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn part<const L: u8, K: KvRead, V: KvRead>(
    q: &[f32],
    k: &[K],
    v: &[V],
    scale: (f32, Option<&[f32]>),
    s: &mut Vec<f32>,
    acc: &mut [f32],
    ml: &mut [(f32, f32)],
) {
    let g = ml.len();
    let dh = q.len() / g;
    let n = k.len() / (dh / K::VALUES);
    s.clear();
    s.resize(g * n, 0.0);
    K::scores::<L>(q, dh, k, s);
    let (scale, add) = scale;
    for (r, (row, ml)) in s.chunks_exact_mut(n).zip(ml.iter_mut()).enumerate() {
        let mut m = f32::NEG_INFINITY;
        match add {
            // Centred keys: the row's `q · c` back onto each score, then the scale.
            Some(add) if add.len() == g => {
                for e in row.iter_mut() {
                    *e = (*e + add[r]) * scale;
                    m = m.max(*e);
                }
            }
            // A centre that rotates: each key's own `q · c(j)`.
            Some(add) => {
                for (e, a) in row.iter_mut().zip(&add[r * n..(r + 1) * n]) {
                    *e = (*e + a) * scale;
                    m = m.max(*e);
                }
            }
            None => {
                for e in row.iter_mut() {
                    *e *= scale;
                    m = m.max(*e);
                }
            }
        }
        let mut lanes = [0f32; 16];
        let mut chunks = row.chunks_exact_mut(16);
        for c in &mut chunks {
            for (u, e) in c.iter_mut().enumerate() {
                *e = exp_fast(*e - m);
                lanes[u] += *e;
            }
        }
        let mut l = sum16(&lanes);
        for e in chunks.into_remainder() {
            *e = exp_fast(*e - m);
            l += *e;
        }
        *ml = (m, l);
    }
    acc.fill(0.0);
    V::accumulate_rows::<L>(acc, dh, s, v);
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod int8;

#[cfg(target_arch = "x86_64")]
pub(crate) mod x512;

#[cfg(target_arch = "x86_64")]
pub(crate) mod x256;

#[cfg(test)]
mod tests {
    use super::decode;
    use crate::attention::KvRead;
    use crate::kernels::Isa;
    use hf2q_tensor::kv::{AffineKv, HostKv, KeyCentering, KvType, KvTypes};
    use hf2q_tensor::op::{AttentionParams, LayerCache};
    use hf2q_tensor::Tensor;

    /// Decode with each vector unit this CPU runs.
    struct EveryIsa<'a> {
        q: &'a Tensor,
        pos0: usize,
        p: &'a AttentionParams,
        what: &'a str,
    }

    impl crate::kv_view::KvVisit for EveryIsa<'_> {
        type Out = ();
        fn visit<K: KvRead, V: KvRead>(self, c: &LayerCache<'_, K, V>) {
            let max_err = |a: &Tensor, b: &Tensor| {
                a.data()
                    .iter()
                    .zip(b.data())
                    .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
            };
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let run = |isa| pool.install(|| decode(isa, self.q, c, self.pos0, self.p).unwrap());
                let portable = run(Isa::Scalar);
                for isa in [Isa::Avx2, Isa::Avx512Vnni] {
                    if isa.is_available() {
                        // Convex combinations of values in [-1, 1]: the same products summed
                        // in another order (16, 8 or the compiler's lanes) over ~2000 keys.
                        let e = max_err(&run(isa), &portable);
                        let what = self.what;
                        assert!(
                            e < 1e-5,
                            "{what} threads={threads}: {isa:?} vs portable {e}"
                        );
                    }
                }
            }
        }
    }

    /// The grouped 8-bit kernels of every vector unit (AVX-512, AVX2) at depth against the
    /// portable loops over the same blocks: Q8_0 and 8-bit affine groups of one, two and four
    /// parts, groups of 1 to 7 query heads per kv head (every row count of the four-row kernels,
    /// and a remainder), key counts off the 8- and 16-key reduction, one part per kv head (one
    /// thread) and split parts (three).
    #[test]
    fn grouped_kernels_of_every_isa_agree_at_depth() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut f = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        };
        for &(h, hkv, dh, affine) in &[
            (2, 2, 64, AffineKv::B8G64),
            (4, 2, 128, AffineKv::B8G128),
            (6, 2, 32, AffineKv::B8G32),
            (4, 1, 256, AffineKv::B8G64),
            (5, 1, 64, AffineKv::B8G32),
            (7, 1, 96, AffineKv::B8G32),
        ] {
            for pos0 in [2050, 1203] {
                let n = pos0 + 1;
                let p = AttentionParams {
                    n_heads: h,
                    n_kv_heads: hkv,
                    head_dim: dh,
                    scale: 1.0 / (dh as f32).sqrt(),
                    window: None,
                    sinks: None,
                };
                let k = (0..n * hkv * dh)
                    .map(|i| 3.0 * f() * (1.0 + (i / 32 % 5) as f32))
                    .collect();
                let v = (0..n * hkv * dh).map(|_| f()).collect();
                let (kt, vt) = (
                    Tensor::new(&[n, hkv * dh], k).unwrap(),
                    Tensor::new(&[n, hkv * dh], v).unwrap(),
                );
                let q = Tensor::new(&[1, h * dh], (0..h * dh).map(|_| f()).collect()).unwrap();
                for ty in [KvType::Q8_0, KvType::Affine(affine)] {
                    let mut kv = HostKv::new(hkv, dh, KvTypes::from(ty));
                    kv.write(&kt, &vt, 0, n + 3).unwrap();
                    let what = format!("{} h={h} hkv={hkv} dh={dh} pos0={pos0}", ty.name());
                    let every = EveryIsa {
                        q: &q,
                        pos0,
                        p: &p,
                        what: &what,
                    };
                    crate::kv_view::visit(kv.view(), every).unwrap();
                }
            }
        }
    }

    /// Decode at depth 4096 of one layer of SmolLM2-135M's shape (9 query heads, 3 kv heads of
    /// 64) over Q8_0, 8-bit affine (groups of 64) and f16 caches, one thread, with each vector
    /// unit this CPU runs: microseconds per call (median of 7 runs of 50 calls). A measurement,
    /// not a check: `cargo test --release -p hf2q-cpu --lib decode_timing -- --ignored
    /// --nocapture`. `hf2q bench` always takes the best unit, so this is how the AVX2 kernels
    /// are timed on an AVX-512 machine.
    #[test]
    #[ignore]
    fn decode_timing_at_depth() {
        let (h, hkv, dh, n) = (9, 3, 64, 4096);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut f = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        };
        let p = AttentionParams {
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: dh,
            scale: 0.125,
            window: None,
            sinks: None,
        };
        let kt = Tensor::new(
            &[n, hkv * dh],
            (0..n * hkv * dh).map(|_| 3.0 * f()).collect(),
        );
        let vt = Tensor::new(&[n, hkv * dh], (0..n * hkv * dh).map(|_| f()).collect());
        let (kt, vt) = (kt.unwrap(), vt.unwrap());
        let q = Tensor::new(&[1, h * dh], (0..h * dh).map(|_| f()).collect()).unwrap();
        // Quantized keys centred (the default) and as written (`KeyCentering::OFF`): what
        // the centring costs a decode step (one sink part per kv head, `q · c` per row).
        let cases = [
            (KvType::Q8_0, KeyCentering::DEFAULT),
            (KvType::Q8_0, KeyCentering::OFF),
            (KvType::Affine(AffineKv::B8G64), KeyCentering::DEFAULT),
            (KvType::Affine(AffineKv::B8G64), KeyCentering::OFF),
            (KvType::F16, KeyCentering::OFF),
        ];
        for (ty, centring) in cases {
            let mut kv = HostKv::with_centering(hkv, dh, KvTypes::from(ty), centring);
            kv.write(&kt, &vt, 0, n).unwrap();
            for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni] {
                if !isa.is_available() {
                    continue;
                }
                let timing = Timing {
                    isa,
                    q: &q,
                    pos0: n - 1,
                    p: &p,
                };
                let us = crate::kv_view::visit(kv.view(), timing).unwrap();
                let sinks = centring.sinks;
                println!("{} (sinks {sinks}) {isa:?}: {us:.1} us per call", ty.name());
            }
        }
    }

    /// [`decode_timing_at_depth`]'s timing of one cache with one unit.
    struct Timing<'a> {
        isa: Isa,
        q: &'a Tensor,
        pos0: usize,
        p: &'a AttentionParams,
    }

    impl crate::kv_view::KvVisit for Timing<'_> {
        type Out = f64;
        fn visit<K: KvRead, V: KvRead>(self, c: &LayerCache<'_, K, V>) -> f64 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let mut runs: Vec<f64> = (0..7)
                .map(|_| {
                    let t = std::time::Instant::now();
                    for _ in 0..50 {
                        let o = pool.install(|| decode(self.isa, self.q, c, self.pos0, self.p));
                        std::hint::black_box(o.unwrap());
                    }
                    t.elapsed().as_secs_f64() * 1e6 / 50.0
                })
                .collect();
            runs.sort_by(|a, b| a.partial_cmp(b).unwrap());
            runs[3]
        }
    }
}
