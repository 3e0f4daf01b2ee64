//! Attention over block KV caches (ggml's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and mlx-lm's affine
//! groups, quantized when written; keys and values of one type or of two) against the reference attention over the blocks'
//! dequantized values in f32: decode (T = 1) and prefill shapes, GQA ratios, head widths,
//! sliding windows, spare capacity, centred keys fixed or following a rotation. The cache is
//! filled through `HostKv::write`, as a model fills it.

use hf2q_cpu::kv_view::{self, KvVisit};
use hf2q_cpu::{CpuBackend, KvRead, MatmulPath};
use hf2q_tensor::kv::{BlockQ8_0, HostKv, KeyRope, KvType, KvTypes, PlaneView};
use hf2q_tensor::op::{AttentionParams, KvElem, LayerCache, RopeParams, RopeStyle};
use hf2q_tensor::Tensor;

struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
    }
}

/// The reference path (scalar attention) and the fast path (tiled and decode kernels).
fn reference() -> CpuBackend {
    CpuBackend::default()
}
fn fast() -> CpuBackend {
    CpuBackend {
        matmul: MatmulPath::Fast,
        ..CpuBackend::default()
    }
}

fn max_err(a: &Tensor, b: &Tensor) -> f32 {
    a.data()
        .iter()
        .zip(b.data())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// The f32 values of a block plane, row by row (ggml's `dequantize_row_q8_0` / `_q4_0`).
fn dequantized<T: KvElem>(blocks: &[T]) -> Vec<f32> {
    let mut out = vec![0f32; blocks.len() * T::VALUES];
    T::dequantize_row(blocks, &mut out);
    out
}

/// [`check_blocks`] as a visitor of a cache of any types.
struct Check<'a> {
    q: &'a Tensor,
    pos0: usize,
    p: &'a AttentionParams,
    what: &'a str,
}

impl KvVisit for Check<'_> {
    type Out = ();
    fn visit<K: KvRead, V: KvRead>(self, c: &LayerCache<'_, K, V>) {
        check_blocks(c, self.q, self.pos0, self.p, self.what)
    }
}

/// Attention over block cache `c` against the reference over its dequantized values.
fn check_blocks<K: KvRead, V: KvRead>(
    c: &LayerCache<'_, K, V>,
    q: &Tensor,
    pos0: usize,
    p: &AttentionParams,
    what: &str,
) {
    let (kd, vd) = (c.keys_f32(p.n_kv_heads, p.head_dim), dequantized(c.v));
    let c32 = LayerCache {
        k: &kd,
        v: &vd,
        capacity: c.capacity,
        centre: None,
    };
    let want = reference().attention(q, &c32, pos0, p).unwrap();
    // The reference over the blocks dequantizes each row as it reads it: the same f32 values
    // in the same order, so the same bits. With centred keys (every block key type past its
    // sink positions) it adds `q · c` to `q · dq(row)` where `want` reads `q · (dq(row) + c)`:
    // the same score up to f32 rounding (scores of |q| |k| up to ~300 here, relative 1e-7 per
    // term), so the outputs agree to the fast path's tolerance below.
    let refq = reference().attention(q, c, pos0, p).unwrap();
    let e = max_err(&want, &refq);
    match c.centre {
        None => assert_eq!(e, 0.0, "reference {what}"),
        Some(_) => assert!(e < 2e-5, "reference {what}: centred keys {e}"),
    }
    // The fast kernels read the blocks (decode: scale per block, integers widened in
    // registers). Outputs are convex combinations of values in about [-1, 1]: f32 sums in
    // another order and the polynomial exp, as for f32 caches.
    let got = fast().attention(q, c, pos0, p).unwrap();
    let e = max_err(&want, &got);
    assert!(
        e < 2e-5,
        "{what}: fast over blocks vs reference over f32 {e}"
    );
    // And the fast kernels over the dequantized f32 cache agree as closely.
    let got32 = fast().attention(q, &c32, pos0, p).unwrap();
    let e = max_err(&got32, &got);
    assert!(e < 2e-5, "{what}: blocks vs their f32 values, fast {e}");
}

/// Two of mlx-lm's affine layouts (8 and 4 bits) for head width `dh`: the groups of 32 at 32,
/// of 64 at 64, of 128 at 128, and 4 bits in groups of 64 with 8 in groups of 32 at 256, so
/// that every layout is read and two groups share a 64-value row at 256 too.
fn affine_pair(dh: usize) -> [KvType; 2] {
    use hf2q_tensor::kv::AffineKv::*;
    let (a, b) = match dh {
        32 => (B8G32, B4G32),
        64 => (B8G64, B4G64),
        128 => (B8G128, B4G128),
        _ => (B8G32, B4G64),
    };
    [KvType::Affine(a), KvType::Affine(b)]
}

/// A rotation for centred keys to follow (`HostKv::with_key_rope`) in case `i`: none for even
/// cases, else NeoX or interleaved pairs of a fast base (so that far positions turn far).
fn key_rope(dh: usize, i: usize) -> Option<KeyRope> {
    let style = match i % 4 {
        1 => RopeStyle::Neox,
        3 => RopeStyle::Interleaved,
        _ => return None,
    };
    KeyRope::of(&RopeParams {
        style,
        theta: 100.0,
        dims: dh,
        freq_factors: None,
        linear_scale: 1.0,
    })
}

#[test]
fn block_attention_equals_attention_over_dequantized_values() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut cases = 0;
    for &(h, hkv) in &[(1, 1), (9, 3), (8, 2), (16, 2)] {
        for &dh in &[32, 64, 128, 256] {
            for &(t, pos0) in &[
                (1, 0),
                (1, 5),
                (1, 300),
                (17, 0),
                (40, 23),
                (3, 70),
                (64, 200),
            ] {
                for &window in &[None, Some(7), Some(64)] {
                    let p = AttentionParams {
                        n_heads: h,
                        n_kv_heads: hkv,
                        head_dim: dh,
                        scale: 1.0 / (dh as f32).sqrt(),
                        window,
                        sinks: None,
                    };
                    let n = pos0 + t;
                    // Keys with a per-position magnitude (blocks of different scales) and
                    // large-ish scores, so that the online rescaling matters.
                    let k: Vec<f32> = (0..n * hkv * dh)
                        .map(|i| 3.0 * rng.f() * (1.0 + (i / 32 % 5) as f32))
                        .collect();
                    let v: Vec<f32> = (0..n * hkv * dh).map(|_| rng.f()).collect();
                    let (kt, vt) = (
                        Tensor::new(&[n, hkv * dh], k).unwrap(),
                        Tensor::new(&[n, hkv * dh], v).unwrap(),
                    );
                    let q = Tensor::new(
                        &[t, h * dh],
                        (0..t * h * dh).map(|_| 3.0 * rng.f()).collect(),
                    )
                    .unwrap();
                    // Every block type, and keys and values of different types (a block
                    // type with f16, two block types); an 8- and a 4-bit affine layout per
                    // head width, every layout over the widths (`affine_pair`).
                    let split = |k, v| KvTypes { k, v };
                    let affine = affine_pair(dh).map(KvTypes::from);
                    let types = KvType::BLOCKS
                        .map(KvTypes::from)
                        .into_iter()
                        .chain([
                            split(KvType::Q8_0, KvType::Q4_0),
                            split(KvType::F16, KvType::Q5_1),
                            split(KvType::Q4_1, KvType::F32),
                        ])
                        .chain(affine);
                    for ty in types {
                        // Centred keys that follow a rotation in every other case (both pair
                        // layouts), fixed ones in the rest.
                        let mut kv = HostKv::new(hkv, dh, ty).with_key_rope(key_rope(dh, cases));
                        kv.write(&kt, &vt, 0, 4096).unwrap();
                        let what = format!(
                            "{} h={h} hkv={hkv} dh={dh} t={t} pos0={pos0} {window:?}",
                            ty.name()
                        );
                        let check = Check {
                            q: &q,
                            pos0,
                            p: &p,
                            what: &what,
                        };
                        kv_view::visit(kv.view(), check).unwrap();
                    }
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 4 * 4 * 7 * 3);
}

/// Decode at a position a prefill wrote and at one written alone reads the same blocks: the
/// quantization happens on write, per row, whatever the call's length (centred keys fixed, and
/// following a rotation).
#[test]
fn prefill_and_decode_see_the_same_values() {
    for rope in [None, key_rope(64, 1)] {
        prefill_and_decode_case(rope);
    }
}

fn prefill_and_decode_case(rope: Option<KeyRope>) {
    let (h, hkv, dh, n) = (4, 2, 64, 50);
    let mut rng = Rng(0x0123_4567_89AB_CDEF);
    let k: Vec<f32> = (0..n * hkv * dh).map(|_| 2.0 * rng.f()).collect();
    let v: Vec<f32> = (0..n * hkv * dh).map(|_| rng.f()).collect();
    let kt = Tensor::new(&[n, hkv * dh], k).unwrap();
    let vt = Tensor::new(&[n, hkv * dh], v).unwrap();
    let row = |t: &Tensor, i: usize| {
        Tensor::new(
            &[1, hkv * dh],
            t.data()[i * hkv * dh..(i + 1) * hkv * dh].to_vec(),
        )
        .unwrap()
    };
    let mut whole = HostKv::new(hkv, dh, KvType::Q8_0).with_key_rope(rope.clone());
    whole.write(&kt, &vt, 0, n).unwrap();
    let mut steps = HostKv::new(hkv, dh, KvType::Q8_0).with_key_rope(rope);
    for i in 0..n {
        steps.write(&row(&kt, i), &row(&vt, i), i, n).unwrap();
    }
    let p = AttentionParams {
        n_heads: h,
        n_kv_heads: hkv,
        head_dim: dh,
        scale: 0.125,
        window: None,
        sinks: None,
    };
    let q = Tensor::new(&[1, h * dh], (0..h * dh).map(|_| rng.f()).collect()).unwrap();
    let fast = CpuBackend {
        matmul: MatmulPath::Fast,
        ..CpuBackend::default()
    };
    let (wv, sv) = (whole.view(), steps.view());
    let (PlaneView::Q8_0(ak), PlaneView::Q8_0(av), PlaneView::Q8_0(bk), PlaneView::Q8_0(bv)) =
        (wv.k, wv.v, sv.k, sv.v)
    else {
        panic!("q8_0 caches")
    };
    let a = LayerCache {
        k: ak,
        v: av,
        capacity: wv.capacity,
        centre: wv.centre,
    };
    let b = LayerCache {
        k: bk,
        v: bv,
        capacity: sv.capacity,
        centre: sv.centre,
    };
    let (x, y) = (
        fast.attention(&q, &a, n - 1, &p).unwrap(),
        fast.attention(&q, &b, n - 1, &p).unwrap(),
    );
    assert_eq!(x.data(), y.data());
    // Past the sink positions (`KeyCentering::DEFAULT`): both stored centred keys.
    assert!(n > wv.centre.unwrap().sinks);
}

/// A head width that is not a whole number of blocks is refused by the attention too.
#[test]
fn q8_0_attention_checks_shapes() {
    let blocks = vec![BlockQ8_0::default(); 8];
    let c = LayerCache {
        k: &blocks,
        v: &blocks,
        capacity: 4,
        centre: None,
    };
    let p = AttentionParams {
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 48,
        scale: 1.0,
        window: None,
        sinks: None,
    };
    let q = Tensor::new(&[1, 48], vec![0.1; 48]).unwrap();
    let e = reference()
        .attention(&q, &c, 0, &p)
        .unwrap_err()
        .to_string();
    assert!(e.contains("head width 48"), "{e}");
    let p = AttentionParams { head_dim: 64, ..p };
    let q = Tensor::new(&[1, 64], vec![0.1; 64]).unwrap();
    // 8 blocks hold 4 positions of 64 values in one head: position 4 is past them.
    assert!(fast().attention(&q, &c, 3, &p).is_ok());
    assert!(fast().attention(&q, &c, 4, &p).is_err());
}
