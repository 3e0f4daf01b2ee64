//! Tests of the host KV cache: writes (f16 rounding, the reference block quantizers byte for
//! byte, keys and values of two types), prefix copies, bytes per position.

use super::*;

fn rows(t: usize, w: usize, base: f32) -> Tensor {
    let d: Vec<f32> = (0..t * w).map(|i| base + i as f32).collect();
    Tensor::new(&[t, w], d).unwrap()
}

/// Key and value bits of `kv` (f16 or f32) at (head, position).
fn bits_at(kv: &HostKv, hi: usize, pos: usize) -> (Vec<u32>, Vec<u32>) {
    let (cap, d) = (kv.capacity(), kv.head_dim());
    let at = hi * cap * d + pos * d;
    let bits = |p: PlaneView| -> Vec<u32> {
        match p {
            PlaneView::F16(x) => x[at..at + d].iter().map(|x| x.to_bits() as u32).collect(),
            PlaneView::F32(x) => x[at..at + d].iter().map(|x| x.to_bits()).collect(),
            _ => unreachable!("block caches: block_bytes_at"),
        }
    };
    let v = kv.view();
    (bits(v.k), bits(v.v))
}

#[test]
fn prefix_copies_the_first_positions() {
    let split = KvTypes {
        k: KvType::F16,
        v: KvType::F32,
    };
    for ty in [KvType::F16.into(), KvType::F32.into(), split] {
        let (h, d) = (2, 3);
        let mut kv = HostKv::new(h, d, ty);
        // Fractions that f16 rounds, so that a copy that converted again would show.
        let frac = |t: Tensor| {
            let d: Vec<f32> = t.data().iter().map(|x| x * 1.0001 + 0.3).collect();
            Tensor::new(t.shape(), d).unwrap()
        };
        kv.write(
            &frac(rows(5, h * d, 0.0)),
            &frac(rows(5, h * d, 100.0)),
            0,
            1000,
        )
        .unwrap();
        assert_eq!(kv.capacity(), 256);
        assert_eq!(kv.bytes(), h * 256 * ty.row_bytes(d));
        // A compact copy of 3 positions, then one grown for a larger limit.
        for (limit, cap) in [(3, 3), (1000, 256)] {
            let p = kv.prefix(3, limit).unwrap();
            assert_eq!((p.capacity(), p.kv_types()), (cap, ty));
            assert_eq!(p.bytes(), h * cap * ty.row_bytes(d));
            for hi in 0..h {
                for pos in 0..3 {
                    assert_eq!(bits_at(&kv, hi, pos), bits_at(&p, hi, pos), "{ty:?}");
                }
            }
        }
        // Writing after the prefix continues the sequence.
        let mut p = kv.prefix(3, 8).unwrap();
        p.write(&rows(2, h * d, 7.0), &rows(2, h * d, 9.0), 3, 8)
            .unwrap();
        assert_eq!(p.capacity(), 8);
        assert_eq!(bits_at(&p, 1, 2), bits_at(&kv, 1, 2));
        assert!(kv.prefix(300, 1000).is_err());
        assert!(kv.prefix(4, 3).is_err());
        assert_eq!(kv.prefix(0, 10).unwrap().bytes(), 0);
    }
}

/// An f16 cache stores what `half::f16::from_f32` gives (round to nearest, ties to even;
/// overflow to infinity; subnormals), also checked against the crate's software rounding so
/// that hardware conversion cannot drift from it; an f32 cache stores the bits given.
#[test]
fn f16_write_rounds_as_half() {
    let (h, d) = (3, 7);
    let specials = [
        0.0,
        -0.0,
        1.0,
        -2.5,
        1.0 + 1.0 / 2048.0,        // a tie: rounds down to even
        1.0 + 3.0 / 2048.0,        // a tie: rounds up to even
        1.0 + 1.0 / 2048.0 + 1e-7, // just past the tie
        65504.0,                   // the largest f16
        65519.0,                   // rounds down to it
        65520.0,                   // rounds up to infinity
        -1e9,
        f32::INFINITY,
        f32::NEG_INFINITY,
        6.0e-8, // the smallest subnormal, about
        1.0e-6, // a subnormal
        6.1e-5, // near the smallest normal
        2.0e-8, // underflows to zero
        std::f32::consts::PI,
    ];
    let n = 9;
    let vals: Vec<f32> = (0..n * h * d)
        .map(|i| {
            if i < specials.len() {
                specials[i]
            } else {
                ((i * 7919 % 10007) as f32 / 10007.0 - 0.5) * 2f32.powi((i % 40) as i32 - 20)
            }
        })
        .collect();
    let kt = Tensor::new(&[n, h * d], vals.clone()).unwrap();
    let vt = Tensor::new(&[n, h * d], vals.iter().map(|x| -x).collect()).unwrap();
    let mut c16 = HostKv::new(h, d, KvType::F16);
    let mut c32 = HostKv::new(h, d, KvType::F32);
    // Two writes (positions 0..4 then 4..9): the second grows nothing but must land after.
    for kv in [&mut c16, &mut c32] {
        let (k0, v0) = (rows_of(&kt, 0..4), rows_of(&vt, 0..4));
        let (k1, v1) = (rows_of(&kt, 4..n), rows_of(&vt, 4..n));
        kv.write(&k0, &v0, 0, 64).unwrap();
        kv.write(&k1, &v1, 4, 64).unwrap();
    }
    assert_eq!(c16.bytes() * 2, c32.bytes());
    for ti in 0..n {
        for hi in 0..h {
            let (k16, v16) = bits_at(&c16, hi, ti);
            let (k32, v32) = bits_at(&c32, hi, ti);
            for di in 0..d {
                let x = vals[ti * h * d + hi * d + di];
                let want = f16::from_f32(x).to_bits() as u32;
                assert_eq!(want, f16::from_f32_const(x).to_bits() as u32, "{x}");
                assert_eq!(k16[di], want, "key {x}");
                assert_eq!(v16[di], f16::from_f32(-x).to_bits() as u32, "value {}", -x);
                assert_eq!(k32[di], x.to_bits());
                assert_eq!(v32[di], (-x).to_bits());
            }
        }
    }
}

/// ggml's bytes of the key and value rows of `kv` (a block cache) at (head, position).
fn block_bytes_at(kv: &HostKv, hi: usize, pos: usize) -> (Vec<u8>, Vec<u8>) {
    fn of<B: KvBlock>(x: &[B], at: usize, r: usize) -> Vec<u8> {
        x[at..at + r]
            .iter()
            .flat_map(|b| b.bytes().to_vec())
            .collect()
    }
    let (cap, r) = (kv.capacity(), kv.head_dim() / Q8_0_VALUES);
    let at = hi * cap * r + pos * r;
    let bytes = |p: PlaneView| match p {
        PlaneView::Q8_0(x) => of(x, at, r),
        PlaneView::Q4_0(x) => of(x, at, r),
        PlaneView::Q4_1(x) => of(x, at, r),
        PlaneView::Q5_0(x) => of(x, at, r),
        PlaneView::Q5_1(x) => of(x, at, r),
        _ => panic!("not a block cache"),
    };
    let v = kv.view();
    (bytes(v.k), bytes(v.v))
}

/// Awkward values for block quantizers: blocks of very different magnitudes, exact zeros,
/// an all-zero block, ties of the rounding (x / d at k + 0.5), both signs.
fn awkward(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = ((s >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
            let block = i / 32;
            match block % 5 {
                0 => u * 8.0,
                1 => u * 1e-3,
                2 if i % 32 == 0 => 127.0,
                2 => ((i % 32) as f32 - 16.0) + 0.5, // ties at d = 1
                3 => 0.0,
                _ if i % 7 == 0 => 0.0,
                _ => u * 300.0,
            }
        })
        .collect()
}

/// Every block cache type stores, for every head's row, exactly the bytes of ggml's
/// reference quantizer of its type (`quant::quantize`), whether the positions came in one
/// prefill or one by one (and across a growth of the capacity); prefix copies keep the
/// blocks as they are. Keys and values of different types (every pair) each get their own
/// type's bytes. Keys are centred ([`KeyCentering::DEFAULT`]): the first `sinks` positions'
/// rows are kept as f16, and every later key row is the quantizer's bytes of `k - c`, `c` the
/// mean of those f16 rows of its head (summed in position order).
#[test]
fn block_write_equals_the_reference_quantizer() {
    for ty in KvType::BLOCKS {
        block_write_case(ty.into());
    }
    for k in KvType::BLOCKS {
        for v in KvType::BLOCKS {
            if k != v {
                block_write_case(KvTypes { k, v });
            }
        }
    }
}

fn block_write_case(ty: KvTypes) {
    let (gk, gv) = (ty.k.ggml().unwrap(), ty.v.ggml().unwrap());
    let (bk, bv) = (ty.k.row_bytes(32), ty.v.row_bytes(32));
    for &(h, d) in &[(1, 32), (3, 64), (2, 96), (4, 128)] {
        let n = 300; // past the first capacity of 256: one growth on the way
        let kv_vals = awkward(n * h * d, 0x1234 + d as u64);
        let vv_vals: Vec<f32> = awkward(n * h * d, 0x9876 + h as u64);
        let kt = Tensor::new(&[n, h * d], kv_vals.clone()).unwrap();
        let vt = Tensor::new(&[n, h * d], vv_vals.clone()).unwrap();
        let mut whole = HostKv::new(h, d, ty);
        whole.write(&kt, &vt, 0, 4096).unwrap();
        let mut steps = HostKv::new(h, d, ty);
        steps
            .write(&rows_of(&kt, 0..5), &rows_of(&vt, 0..5), 0, 4096)
            .unwrap();
        for ti in 5..n {
            let (k1, v1) = (rows_of(&kt, ti..ti + 1), rows_of(&vt, ti..ti + 1));
            steps.write(&k1, &v1, ti, 4096).unwrap();
        }
        // Chunks of 7 (one spans the last sink position and the first centred one), and a
        // prefix copy of 10 positions (fewer than the sinks: the centres are set again by the
        // write of the last sink position) written on from there.
        let mut chunks = HostKv::new(h, d, ty);
        for a in (0..n).step_by(7) {
            let r = a..(a + 7).min(n);
            chunks
                .write(&rows_of(&kt, r.clone()), &rows_of(&vt, r), a, 4096)
                .unwrap();
        }
        let mut resumed = chunks.prefix(10, 4096).unwrap();
        resumed
            .write(&rows_of(&kt, 10..n), &rows_of(&vt, 10..n), 10, 4096)
            .unwrap();
        assert_eq!((whole.capacity(), whole.kv_types()), (512, ty));
        let ks = KeyCentering::DEFAULT.sinks;
        let centre_bytes = h * ks * d * 2 + h * d * 4;
        assert_eq!(whole.bytes(), h * 512 * (d / 32) * (bk + bv) + centre_bytes);
        let copy = whole.prefix(n, n).unwrap();
        let f16_of = |x: f32| f16::from_f32(x).to_f32();
        let centre: Vec<f32> = (0..h * d)
            .map(|i| {
                let (hi, x) = (i / d, i % d);
                let sum = (0..ks).fold(0f32, |a, j| a + f16_of(kv_vals[j * h * d + hi * d + x]));
                sum / ks as f32
            })
            .collect();
        for kv in [&whole, &steps, &copy, &chunks, &resumed] {
            let c = kv.view().centre.expect("centred keys");
            assert_eq!(c.c, &centre[..], "{}", ty.name());
            for (j, hi) in (0..ks).flat_map(|j| (0..h).map(move |hi| (j, hi))) {
                let want: Vec<f32> = kv_vals[j * h * d + hi * d..][..d]
                    .iter()
                    .map(|&x| f16_of(x))
                    .collect();
                let got: Vec<f32> = c.sink_row(hi, j, d).iter().map(|x| x.to_f32()).collect();
                assert_eq!(got, want, "{} sink {j}", ty.name());
            }
        }
        for ti in 0..n {
            for hi in 0..h {
                let at = ti * h * d + hi * d;
                let mut want_k = vec![0u8; d / 32 * bk];
                let mut want_v = vec![0u8; d / 32 * bv];
                let key: Vec<f32> = match ti < ks {
                    true => kv_vals[at..at + d].to_vec(),
                    false => (0..d)
                        .map(|x| kv_vals[at + x] - centre[hi * d + x])
                        .collect(),
                };
                crate::quant::quantize(gk, &key, &mut want_k).unwrap();
                crate::quant::quantize(gv, &vv_vals[at..at + d], &mut want_v).unwrap();
                let want = (want_k, want_v);
                let what = format!("{} h {h} d {d} pos {ti}", ty.name());
                assert_eq!(block_bytes_at(&whole, hi, ti), want, "{what}");
                assert_eq!(block_bytes_at(&steps, hi, ti), want, "{what}");
                assert_eq!(block_bytes_at(&copy, hi, ti), want, "{what}");
                assert_eq!(block_bytes_at(&chunks, hi, ti), want, "{what}");
                assert_eq!(block_bytes_at(&resumed, hi, ti), want, "{what}");
            }
        }
    }
}

/// A head width that is not a whole number of blocks is refused, naming it.
#[test]
fn q8_0_needs_whole_blocks() {
    let mut kv = HostKv::new(2, 48, KvType::Q8_0);
    let t = Tensor::new(&[1, 96], vec![0.5; 96]).unwrap();
    let e = kv.write(&t, &t, 0, 16).unwrap_err().to_string();
    assert!(e.contains("head width 48") && e.contains("q8_0"), "{e}");
    assert!(KvType::Q8_0.check_head_dim(64).is_ok());
    assert!(KvType::F16.check_head_dim(48).is_ok());
}

/// KV bytes per position: Q8_0 is 34 bytes per 32 values against f16's 64, 17/32 =
/// 53.125 % (53 % to two figures; ggml's block layout allows no less).
#[test]
fn q8_0_bytes_per_position() {
    let bound = 0.53125;
    for d in [32, 64, 128, 256] {
        let (q8, f16b) = (KvType::Q8_0.row_bytes(d), KvType::F16.row_bytes(d));
        assert_eq!(q8 * 32, 34 * d);
        assert!(q8 as f64 <= bound * f16b as f64, "{q8} vs {f16b}");
        assert_eq!((100.0 * q8 as f64 / f16b as f64).round(), 53.0);
        // Q4_0: 18 bytes per 32 values, 9/32 = 28.1 % of f16.
        let q4 = KvType::Q4_0.row_bytes(d);
        assert_eq!(q4 * 32, 18 * d);
        assert_eq!((100.0 * q4 as f64 / f16b as f64).round(), 28.0);
        let (h, n) = (3, 40);
        let t = Tensor::new(&[n, h * d], awkward(n * h * d, 5)).unwrap();
        // Keys as written (centred keys add their sink rows and centres: `centring_*`).
        let (mut a, mut b) = (
            HostKv::with_centering(h, d, KvType::Q8_0, KeyCentering::OFF),
            HostKv::new(h, d, KvType::F16),
        );
        a.write(&t, &t, 0, n).unwrap();
        b.write(&t, &t, 0, n).unwrap();
        assert!(a.bytes() as f64 <= bound * b.bytes() as f64);
        assert_eq!(a.bytes(), 2 * h * n * q8);
        // Every block type: its ggml block bytes per 32 values; a split cache, each half.
        for (ty, per32) in [(KvType::Q4_1, 20), (KvType::Q5_0, 22), (KvType::Q5_1, 24)] {
            assert_eq!(ty.row_bytes(d) * 32, per32 * d, "{}", ty.name());
        }
        let split = KvTypes {
            k: KvType::Q8_0,
            v: KvType::Q4_0,
        };
        assert_eq!(split.row_bytes(d), q8 + q4);
        let mut c = HostKv::with_centering(h, d, split, KeyCentering::OFF);
        c.write(&t, &t, 0, n).unwrap();
        assert_eq!(c.bytes(), h * n * (q8 + q4));
    }
    for ty in KvType::ALL {
        assert_eq!(KvType::from_name(ty.name()), Some(ty));
    }
    assert_eq!(KvTypes::from(KvType::Q5_1).name(), "q5_1");
}

fn rows_of(t: &Tensor, r: std::ops::Range<usize>) -> Tensor {
    let w = t.dims2().1;
    Tensor::new(&[r.len(), w], t.data()[r.start * w..r.end * w].to_vec()).unwrap()
}

/// Key centring applies to quantized key planes only, and [`KeyCentering::OFF`] stores keys as
/// written: f16 and f32 key planes (with quantized values too) have no sink rows or centres;
/// an OFF block cache's key rows are the quantizer's bytes of the keys themselves, past the
/// sink positions too; a centring cache shorter than its sinks has no centres yet (zeros).
#[test]
fn centring_is_for_quantized_keys_only() {
    let (h, d, n) = (2, 64, 40);
    let kt = Tensor::new(&[n, h * d], awkward(n * h * d, 77)).unwrap();
    let f16_keys = KvTypes {
        k: KvType::F16,
        v: KvType::Q8_0,
    };
    for ty in [KvType::F16.into(), KvType::F32.into(), f16_keys] {
        let mut kv = HostKv::new(h, d, ty);
        kv.write(&kt, &kt, 0, n).unwrap();
        assert!(kv.view().centre.is_none(), "{}", ty.name());
        assert_eq!(kv.centering(), KeyCentering::OFF);
    }
    let mut off = HostKv::with_centering(h, d, KvType::Q8_0, KeyCentering::OFF);
    off.write(&kt, &kt, 0, n).unwrap();
    assert!(off.view().centre.is_none());
    for (ti, hi) in [(0, 0), (33, 1), (39, 0)] {
        let at = ti * h * d + hi * d;
        let mut want = vec![0u8; d / 32 * 34];
        crate::quant::quantize(crate::GgmlType::Q8_0, &kt.data()[at..at + d], &mut want).unwrap();
        assert_eq!(block_bytes_at(&off, hi, ti).0, want);
    }
    let mut short = HostKv::new(h, d, KvType::Q4_0);
    short
        .write(&rows_of(&kt, 0..9), &rows_of(&kt, 0..9), 0, n)
        .unwrap();
    let c = short.view().centre.expect("sink rows");
    assert!(c.c.iter().all(|&x| x == 0.0));
    assert_eq!(c.sinks, KeyCentering::DEFAULT.sinks);
}
