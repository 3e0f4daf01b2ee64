//! Tests of the host KV cache's affine layouts (mlx-lm's `QuantizedKVCache`): what a write
//! stores against mlx's quantizer written out here, the error of the stored values, bytes per
//! position, and the refusals (head widths off the group, affine keys with other values).
//! Keys are stored as written here (`KeyCentering::OFF`): what centred keys store is tested
//! with the block types (`hf2q_tensor::kv`'s tests) and end to end (`kv_quant.rs`).

use half::f16;
use hf2q_tensor::kv::{AffineKv, BlockAffine, HostKv, KeyCentering, KvType, KvTypes, PlaneView};
use hf2q_tensor::op::KvElem;
use hf2q_tensor::Tensor;

/// mlx's `quantize` (mlx/backend/cpu/quantized.cpp, f32 input) of one group, written out as
/// plainly as there: `(q, scale, bias)` with scale and bias in f32, before the cache stores them
/// as f16.
fn mlx_group(x: &[f32], bits: u32) -> (Vec<u8>, f32, f32) {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let eps = 1e-7f32;
    let mut w_min = f32::INFINITY;
    let mut w_max = -w_min;
    for &v in x {
        w_max = w_max.max(v);
        w_min = w_min.min(v);
    }
    // The edge of larger magnitude goes exactly on the grid; the scale's sign points from it
    // into the range.
    let mask = w_min.abs() > w_max.abs();
    let mut scale = ((w_max - w_min) / n_bins).max(eps);
    scale = if mask { scale } else { -scale };
    let edge = if mask { w_min } else { w_max };
    let q0 = (edge / scale).round_ties_even(); // std::rint: ties to even
    let mut bias = 0.0;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    let q = x
        .iter()
        .map(|&v| {
            let w = ((v - bias) / scale).round_ties_even();
            w.clamp(0.0, n_bins) as u8
        })
        .collect();
    (q, scale, bias)
}

/// The integers of an affine group's packed bytes: 8 bits one per byte, 4 bits two per byte,
/// the even value in the low nibble (mlx's little-endian packing).
fn unpacked(qs: &[u8], bits: u32) -> Vec<u8> {
    if bits == 8 {
        qs.to_vec()
    } else {
        qs.iter().flat_map(|b| [b & 0x0f, b >> 4]).collect()
    }
}

/// (scale, bias, integers) of each group of the key and value rows of `kv` at (head,
/// position).
type Groups = Vec<(f16, f16, Vec<u8>)>;
fn groups_at(kv: &HostKv, hi: usize, pos: usize) -> (Groups, Groups) {
    fn of<const BITS: usize, const N: usize>(
        x: &[BlockAffine<BITS, N>],
        (cap, d): (usize, usize),
        (hi, pos): (usize, usize),
    ) -> Groups {
        let r = d / BlockAffine::<BITS, N>::GROUP;
        let at = hi * cap * r + pos * r;
        x[at..at + r]
            .iter()
            .map(|b| (b.scale, b.bias, unpacked(&b.qs, BITS as u32)))
            .collect()
    }
    let cd = (kv.capacity(), kv.head_dim());
    let groups = |p: PlaneView| match p {
        PlaneView::A8G32(x) => of(x, cd, (hi, pos)),
        PlaneView::A8G64(x) => of(x, cd, (hi, pos)),
        PlaneView::A8G128(x) => of(x, cd, (hi, pos)),
        PlaneView::A4G32(x) => of(x, cd, (hi, pos)),
        PlaneView::A4G64(x) => of(x, cd, (hi, pos)),
        PlaneView::A4G128(x) => of(x, cd, (hi, pos)),
        _ => panic!("not an affine cache"),
    };
    let v = kv.view();
    (groups(v.k), groups(v.v))
}

/// Values for the quantizer: groups of very different ranges (one-sided, two-sided with either
/// edge the larger, a lone outlier, constant and all-zero groups, tiny values), from a seed.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = ((s >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
            match i / 32 % 7 {
                0 => u * 8.0,
                1 => u * 1e-3,
                2 if i % 32 == 0 => 37.0,
                2 => u,
                3 => 0.0,
                4 => 1.5,
                5 => u.abs() * 3.0 + 2.0,
                _ => u - 0.4,
            }
        })
        .collect()
}

/// Every affine layout stores, for every group of every head's row, exactly what mlx's
/// quantizer ([`mlx_group`]) gives: the same integers, and its scale and bias rounded to f16,
/// whether the positions came in one prefill or one by one (across a growth of the
/// capacity); prefix copies keep the groups as they are.
#[test]
fn affine_write_equals_mlxs_quantizer() {
    for ty in KvType::AFFINE {
        let KvType::Affine(a) = ty else {
            unreachable!()
        };
        let (bits, g) = (a.bits(), a.group());
        for &(h, d) in &[(1, 128), (3, 256), (2, 384)] {
            let n = 260; // past the first capacity of 256: one growth on the way
            let kv_vals = values(n * h * d, 0x1234 + d as u64);
            let vv_vals = values(n * h * d, 0x9876 + h as u64);
            let kt = Tensor::new(&[n, h * d], kv_vals.clone()).unwrap();
            let vt = Tensor::new(&[n, h * d], vv_vals.clone()).unwrap();
            let mut whole = HostKv::with_centering(h, d, ty, KeyCentering::OFF);
            whole.write(&kt, &vt, 0, 4096).unwrap();
            let mut steps = HostKv::with_centering(h, d, ty, KeyCentering::OFF);
            for ti in 0..n {
                let row = |t: &Tensor| {
                    let w = h * d;
                    Tensor::new(&[1, w], t.data()[ti * w..(ti + 1) * w].to_vec()).unwrap()
                };
                steps.write(&row(&kt), &row(&vt), ti, 4096).unwrap();
            }
            assert_eq!(whole.bytes(), 2 * h * 512 * (d / g) * a.group_bytes());
            let copy = whole.prefix(n, n).unwrap();
            for ti in 0..n {
                for hi in 0..h {
                    let at = ti * h * d + hi * d;
                    let want = |vals: &[f32]| -> Groups {
                        vals[at..at + d]
                            .chunks_exact(g)
                            .map(|x| {
                                let (q, s, b) = mlx_group(x, bits);
                                (f16::from_f32(s), f16::from_f32(b), q)
                            })
                            .collect()
                    };
                    let want = (want(&kv_vals), want(&vv_vals));
                    let what = format!("{} h {h} d {d} pos {ti} head {hi}", ty.name());
                    assert_eq!(groups_at(&whole, hi, ti), want, "{what}");
                    assert_eq!(groups_at(&steps, hi, ti), want, "{what}");
                    assert_eq!(groups_at(&copy, hi, ti), want, "{what}");
                }
            }
        }
    }
}

/// The stored values' error, per group. On mlx's own grid (its f32 scale and bias) a value is
/// within half a step (`|scale| / 2`, and f32's rounding of `(x - bias) / scale`) of where it
/// was, except the end of the range opposite the edge mlx puts on the grid: the scale is
/// nudged to `edge / q0`, so that end can fall past the last grid point and is clamped, up to
/// one step (`|scale|`) off. The cache then stores scale and bias as f16, which moves a value
/// by at most `n_bins * |scale - f16(scale)| + |bias - f16(bias)|` more; the dequantized values
/// ([`KvElem::dequantize_row`], what the attention reads) are held to the sum.
#[test]
fn affine_error_is_half_a_step() {
    for ty in KvType::AFFINE {
        let KvType::Affine(a) = ty else {
            unreachable!()
        };
        let (bits, g, d, n) = (a.bits(), a.group(), 128, 64);
        let n_bins = ((1u32 << bits) - 1) as f64;
        let x = values(n * d, 0xabc ^ g as u64);
        let t = Tensor::new(&[n, d], x.clone()).unwrap();
        let mut kv = HostKv::with_centering(1, d, ty, KeyCentering::OFF);
        kv.write(&t, &t, 0, n).unwrap();
        let mut back = vec![0f32; n * d];
        dequantized_keys(&kv, n, &mut back);
        let (mut clamped, mut worst) = (0, 0f64);
        for (gi, (xg, yg)) in x.chunks_exact(g).zip(back.chunks_exact(g)).enumerate() {
            let (q, s, b) = mlx_group(xg, bits);
            let (s, b) = (s as f64, b as f64);
            let (s16, b16) = (
                f16::from_f32(s as f32).to_f64(),
                f16::from_f32(b as f32).to_f64(),
            );
            let slack = 1e-6 * xg.iter().fold(0f64, |m, v| m.max(v.abs() as f64)) + 1e-12;
            for ((&v, &y), &qi) in xg.iter().zip(yg).zip(&q) {
                let (v, y) = (v as f64, y as f64);
                let on_grid = qi as f64 * s + b;
                let raw = (v - b) / s;
                let step = if raw > n_bins + 0.5 {
                    clamped += 1;
                    s.abs()
                } else {
                    s.abs() / 2.0
                };
                let e = (v - on_grid).abs();
                assert!(
                    e <= step + slack,
                    "{} group {gi}: {v} -> {on_grid}",
                    ty.name()
                );
                worst = worst.max(e / s.abs().max(1e-30));
                let f16_moves = n_bins * (s - s16).abs() + (b - b16).abs();
                let e = (v - y).abs();
                assert!(
                    e <= step + f16_moves + slack,
                    "{} group {gi}: {v} -> {y} (stored)",
                    ty.name()
                );
            }
        }
        eprintln!(
            "{}: worst error {worst:.3} steps on mlx's grid, {clamped} values clamped past it",
            ty.name()
        );
    }
}

/// The keys of a one-head cache's first `n` positions, dequantized.
fn dequantized_keys(kv: &HostKv, n: usize, out: &mut [f32]) {
    let r = kv.head_dim();
    fn deq<T: KvElem>(x: &[T], len: usize, out: &mut [f32]) {
        T::dequantize_row(&x[..len / T::VALUES], out)
    }
    match kv.view().k {
        PlaneView::A8G32(x) => deq(x, n * r, out),
        PlaneView::A8G64(x) => deq(x, n * r, out),
        PlaneView::A8G128(x) => deq(x, n * r, out),
        PlaneView::A4G32(x) => deq(x, n * r, out),
        PlaneView::A4G64(x) => deq(x, n * r, out),
        PlaneView::A4G128(x) => deq(x, n * r, out),
        _ => panic!("not an affine cache"),
    }
}

/// KV bytes per position: 8 bits in groups of 64 are 68 bytes per 64 values (17/32 = 53.1 % of
/// f16), 4 bits 36 (9/32 = 28.1 %); groups of 32 and 128 carry their scale and bias over fewer
/// or more values.
#[test]
fn affine_bytes_per_position() {
    let a = |b, g| KvType::Affine(AffineKv::new(b, g).unwrap());
    for d in [64, 128, 256] {
        let f16b = KvType::F16.row_bytes(d);
        assert_eq!(a(8, 64).row_bytes(d) * 64, 68 * d);
        assert_eq!(a(4, 64).row_bytes(d) * 64, 36 * d);
        assert_eq!(a(8, 64).row_bytes(d) * 32, 17 * f16b);
        assert_eq!(a(4, 64).row_bytes(d) * 32, 9 * f16b);
        assert_eq!(a(8, 32).row_bytes(d) * 32, 36 * d);
        if d % 128 == 0 {
            assert_eq!(a(4, 128).row_bytes(d) * 128, 68 * d);
        }
        let (h, n) = (3, 40);
        let t = Tensor::new(&[n, h * d], values(n * h * d, 5)).unwrap();
        let mut kv = HostKv::with_centering(h, d, a(4, 64), KeyCentering::OFF);
        kv.write(&t, &t, 0, n).unwrap();
        assert_eq!(kv.bytes(), 2 * h * n * a(4, 64).row_bytes(d));
    }
    for ty in KvType::AFFINE {
        assert_eq!(KvType::from_name(ty.name()), Some(ty));
    }
    assert_eq!(KvTypes::from(a(8, 64)).name(), "affine8g64");
}

/// A head width that is not a whole number of groups is refused naming both numbers, and an
/// affine plane with a plane of another type is refused (mlx-lm's cache has one layout).
#[test]
fn affine_refusals() {
    let ty = KvType::Affine(AffineKv::B8G128);
    let mut kv = HostKv::with_centering(2, 64, ty, KeyCentering::OFF);
    let t = Tensor::new(&[1, 128], vec![0.5; 128]).unwrap();
    let e = kv.write(&t, &t, 0, 16).unwrap_err().to_string();
    assert!(
        e.contains("head width 64") && e.contains("group size 128"),
        "{e}"
    );
    assert!(ty.check_head_dim(256).is_ok());
    let mixed = KvTypes {
        k: ty,
        v: KvType::Q8_0,
    };
    let e = mixed.check_head_dim(128).unwrap_err().to_string();
    assert!(e.contains("one layout") && e.contains("affine8g128"), "{e}");
    let two = KvTypes {
        k: ty,
        v: KvType::Affine(AffineKv::B4G128),
    };
    assert!(two.check_head_dim(128).is_err());
}
