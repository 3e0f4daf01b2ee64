//! Centred keys that follow the layer's RoPE (`KeyCentering::rotated`, `HostKv::with_key_rope`):
//! what a write stores against ggml's reference quantizer of `k - centre(p)` with the centre
//! computed here from its definition, for both pair layouts, in one prefill, one position at a
//! time, in chunks and resumed from a prefix copy; and that a steady pair before the rotation
//! leaves (almost) nothing to quantize after it, where a fixed centre leaves its rotation.
//!
//! The fixed centre (no rotation) is tested with the cache (`hf2q_tensor::kv`'s tests); the
//! attention over these centres with the CPU kernels (`attention_q8_0.rs`) and end to end
//! (`kv_quant.rs`).

use half::f16;
use hf2q_tensor::kv::{
    HostKv, KeyCentering, KeyRope, KvBlock, KvType, KvTypes, PlaneView, Q8_0_VALUES,
};
use hf2q_tensor::op::{RopeParams, RopeStyle};
use hf2q_tensor::{GgmlType, Tensor};

/// Keys `(n, h*d)` of values in about [-1, 1] plus, per head, a pair steady before the rotation
/// (`big` on pair `1 + hi`) rotated as the model's rope would, and smaller steady parts on two
/// more pairs; values `(n, h*d)`.
fn keys(n: usize, (h, d): (usize, usize), rope: &KeyRope, big: f32, seed: u64) -> Vec<f32> {
    let mut s = seed;
    let mut u = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 40) as f32) / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let mut out = vec![0f32; n * h * d];
    for p in 0..n {
        for hi in 0..h {
            let row = &mut out[(p * h + hi) * d..(p * h + hi + 1) * d];
            row.iter_mut().for_each(|x| *x = u());
            for (i, m) in [(1 + hi, big), (5, big / 4.0), (rope.pairs() - 1, big / 8.0)] {
                let (a, b) = rope.pair(i);
                let (cos, sin) = rope.cos_sin(i, p);
                let (x, y) = (m + row[a] * 0.1, -0.5 * m + row[b] * 0.1);
                row[a] = x * cos - y * sin;
                row[b] = x * sin + y * cos;
            }
        }
    }
    out
}

fn rope(style: RopeStyle, d: usize, theta: f32) -> KeyRope {
    KeyRope::of(&RopeParams {
        style,
        theta,
        dims: d,
        freq_factors: None,
        linear_scale: 1.0,
    })
    .unwrap()
}

fn rows_of(t: &Tensor, r: std::ops::Range<usize>) -> Tensor {
    let w = t.dims2().1;
    Tensor::new(&[r.len(), w], t.data()[r.start * w..r.end * w].to_vec()).unwrap()
}

/// The key row's blocks' bytes of `kv` (a q8_0 or q4_0 key plane) at (head, position).
fn key_bytes_at(kv: &HostKv, hi: usize, pos: usize) -> Vec<u8> {
    fn of<B: KvBlock>(x: &[B], at: usize, r: usize) -> Vec<u8> {
        x[at..at + r]
            .iter()
            .flat_map(|b| b.bytes().to_vec())
            .collect()
    }
    let (cap, r) = (kv.capacity(), kv.head_dim() / Q8_0_VALUES);
    let at = hi * cap * r + pos * r;
    match kv.view().k {
        PlaneView::Q8_0(x) => of(x, at, r),
        PlaneView::Q4_0(x) => of(x, at, r),
        _ => panic!("a q8_0 or q4_0 key plane"),
    }
}

/// The centre of each head at position `p`, from its definition: the f16 sink rows' mean, and
/// on the `rotated` pairs of the largest mean before the rotation (`R(-j) k_j`), that mean
/// turned to `p`. `(h, d)` values.
fn centre_at(
    k: &[f32],
    (h, d): (usize, usize),
    (sinks, rotated): (usize, usize),
    rope: &KeyRope,
    p: usize,
) -> Vec<f32> {
    let f16_of = |x: f32| f16::from_f32(x).to_f32();
    let mut out = vec![0f32; h * d];
    for hi in 0..h {
        let row = |j: usize, x: usize| f16_of(k[(j * h + hi) * d + x]);
        let c = &mut out[hi * d..(hi + 1) * d];
        for (x, c) in c.iter_mut().enumerate() {
            *c = (0..sinks).fold(0f32, |a, j| a + row(j, x)) / sinks as f32;
        }
        let pre: Vec<(f32, f32)> = (0..rope.pairs())
            .map(|i| {
                let (a, b) = rope.pair(i);
                let (mut x, mut y) = (0f32, 0f32);
                for j in 0..sinks {
                    let (cos, sin) = rope.cos_sin(i, j);
                    x += row(j, a) * cos + row(j, b) * sin;
                    y += row(j, b) * cos - row(j, a) * sin;
                }
                (x / sinks as f32, y / sinks as f32)
            })
            .collect();
        let mut order: Vec<usize> = (0..rope.pairs()).collect();
        let norm = |i: usize| pre[i].0 * pre[i].0 + pre[i].1 * pre[i].1;
        order.sort_by(|&x, &y| norm(y).total_cmp(&norm(x)).then(x.cmp(&y)));
        for &i in &order[..rotated.min(rope.pairs())] {
            let (a, b) = rope.pair(i);
            let (cos, sin) = rope.cos_sin(i, p);
            let (x, y) = pre[i];
            c[a] = x * cos - y * sin;
            c[b] = x * sin + y * cos;
        }
    }
    out
}

/// Every key row past the sinks is ggml's reference quantizer's bytes of `k - centre(p)`, the
/// centre as [`centre_at`] defines it, for both pair layouts, q8_0 and q4_0 keys, 1 to 4
/// rotated pairs and all of them; the same bytes written in one prefill, one position at a
/// time, in chunks of 7 (one spans the last sink position) and resumed from a prefix copy of
/// 10 positions (fewer than the sinks: the centres are set again); the f16 sink rows as
/// written. Bytes held: the planes, the sink rows, the centres and the rotated pairs.
#[test]
fn rotated_centre_write_equals_the_reference_quantizer() {
    let n = 300; // past the first capacity of 256
    for (style, h, d) in [
        (RopeStyle::Neox, 1, 64),
        (RopeStyle::Interleaved, 2, 64),
        (RopeStyle::Neox, 3, 128),
    ] {
        let r = rope(style, d, 10_000.0);
        let kv_vals = keys(n, (h, d), &r, 20.0, 0x77 + d as u64);
        let kt = Tensor::new(&[n, h * d], kv_vals.clone()).unwrap();
        let vt = Tensor::new(&[n, h * d], vec![0.25; n * h * d]).unwrap();
        for (ty, g) in [
            (KvType::Q8_0, GgmlType::Q8_0),
            (KvType::Q4_0, GgmlType::Q4_0),
        ] {
            for rotated in [1, 4, d / 2] {
                let centering = KeyCentering { sinks: 16, rotated };
                let new = || {
                    HostKv::with_centering(h, d, KvTypes::from(ty), centering)
                        .with_key_rope(Some(r.clone()))
                };
                let mut whole = new();
                whole.write(&kt, &vt, 0, 4096).unwrap();
                let mut steps = new();
                for p in 0..n {
                    steps
                        .write(&rows_of(&kt, p..p + 1), &rows_of(&vt, p..p + 1), p, 4096)
                        .unwrap();
                }
                let mut chunks = new();
                for a in (0..n).step_by(7) {
                    let rr = a..(a + 7).min(n);
                    chunks
                        .write(&rows_of(&kt, rr.clone()), &rows_of(&vt, rr), a, 4096)
                        .unwrap();
                }
                let mut resumed = chunks.prefix(10, 4096).unwrap();
                resumed
                    .write(&rows_of(&kt, 10..n), &rows_of(&vt, 10..n), 10, 4096)
                    .unwrap();
                assert_eq!(whole.centering(), centering);
                assert_eq!(resumed.key_rope(), Some(&r));
                let held = h * 16 * d * 2 + h * d * 4 + h * rotated.min(d / 2) * 12;
                let planes = 2 * h * 512 * ty.row_bytes(d);
                assert_eq!(whole.bytes(), planes + held);
                let what = format!("{style:?} h {h} d {d} {} rotated {rotated}", ty.name());
                for p in 16..n {
                    let c = centre_at(&kv_vals, (h, d), (16, rotated), &r, p);
                    for hi in 0..h {
                        let at = (p * h + hi) * d;
                        let key: Vec<f32> =
                            (0..d).map(|x| kv_vals[at + x] - c[hi * d + x]).collect();
                        let mut want = vec![0u8; ty.row_bytes(d)];
                        hf2q_tensor::quant::quantize(g, &key, &mut want).unwrap();
                        for kv in [&whole, &steps, &chunks, &resumed] {
                            assert_eq!(key_bytes_at(kv, hi, p), want, "{what} pos {p}");
                        }
                    }
                }
                for kv in [&whole, &steps, &chunks, &resumed] {
                    let c = kv.view().centre.expect("centred keys");
                    for (j, hi) in (0..16).flat_map(|j| (0..h).map(move |hi| (j, hi))) {
                        let at = (j * h + hi) * d;
                        let want: Vec<f16> = kv_vals[at..at + d]
                            .iter()
                            .map(|&x| f16::from_f32(x))
                            .collect();
                        assert_eq!(c.sink_row(hi, j, d), &want[..], "{what} sink {j}");
                    }
                }
            }
        }
    }
}

/// A pair steady before the rotation (20x the other channels) leaves a fixed centre a
/// remainder that grows with the angle it has turned since the sinks, and a rotating one
/// almost nothing: the largest value left to quantize past position 200, per head, is within
/// 2x the other channels' (about 1 and a tenth of the pair's spread) with the rotation and
/// several times that without. The rotated pairs are the steady ones, largest first.
#[test]
fn rotated_centre_follows_a_steady_pair() {
    let (h, d, n) = (2, 64, 400);
    // θ 100: pair 1 turns 0.87 rad a position, pair 5 0.49: far from their first positions.
    let r = rope(RopeStyle::Neox, d, 100.0);
    let kv_vals = keys(n, (h, d), &r, 20.0, 0x5eed);
    let kt = Tensor::new(&[n, h * d], kv_vals.clone()).unwrap();
    let largest_left = |rotated: usize| -> f32 {
        let centering = KeyCentering { sinks: 16, rotated };
        let mut kv =
            HostKv::with_centering(h, d, KvType::Q8_0, centering).with_key_rope(Some(r.clone()));
        kv.write(&kt, &kt, 0, n).unwrap();
        let c = kv.view().centre.unwrap();
        let mut cp = vec![0f32; d];
        let mut big = 0f32;
        for p in 200..n {
            for hi in 0..h {
                c.centre_at(hi, p, &mut cp);
                let at = (p * h + hi) * d;
                for (x, cx) in kv_vals[at..at + d].iter().zip(&cp) {
                    big = big.max((x - cx).abs());
                }
            }
        }
        big
    };
    let (fixed, rotating) = (largest_left(0), largest_left(3));
    eprintln!("largest value left to quantize: fixed centre {fixed}, rotating {rotating}");
    assert!(rotating < 2.0, "rotating centre leaves {rotating}");
    assert!(
        fixed > 4.0 * rotating,
        "fixed {fixed} against rotating {rotating}"
    );
    let mut kv = HostKv::with_centering(
        h,
        d,
        KvType::Q8_0,
        KeyCentering {
            sinks: 16,
            rotated: 2,
        },
    )
    .with_key_rope(Some(r.clone()));
    kv.write(&kt, &kt, 0, n).unwrap();
    let rot = kv.view().centre.unwrap().rot.unwrap();
    assert_eq!(rot.pairs, &[1, 5, 2, 5][..]);
}

/// Without a rotation (a no-RoPE layer, or none given) the centre is the fixed one whatever
/// `rotated` says, and a rotation with more pairs than a head holds is refused at the write.
#[test]
fn rotation_needs_a_rope_that_fits() {
    let (h, d) = (1, 64);
    let none = RopeParams {
        style: RopeStyle::Neox,
        theta: 10_000.0,
        dims: 0,
        freq_factors: None,
        linear_scale: 1.0,
    };
    assert!(KeyRope::of(&none).is_none());
    let kt = Tensor::new(&[20, d], (0..20 * d).map(|i| (i % 7) as f32).collect()).unwrap();
    let mut kv = HostKv::new(h, d, KvType::Q8_0).with_key_rope(None);
    kv.write(&kt, &kt, 0, 64).unwrap();
    assert!(!kv.view().centre.unwrap().rotates());
    let wide = rope(RopeStyle::Neox, 2 * d, 10_000.0);
    let mut kv = HostKv::new(h, d, KvType::Q8_0).with_key_rope(Some(wide));
    let e = kv.write(&kt, &kt, 0, 64).unwrap_err().to_string();
    assert!(
        e.contains("rotary pairs") && e.contains("head of 64"),
        "{e}"
    );
}
