//! Decode (one token) at depth over block KV caches, the types with grouped kernels (Q8_0,
//! mlx-lm's 8-bit affine groups) and f16, in thread pools of 1, 2 and 4 threads (one part per kv
//! head, or each head's keys split into parts merged afterwards), against the reference
//! attention over the blocks' dequantized values in f32.

use hf2q_cpu::kv_view::{self, KvVisit};
use hf2q_cpu::{CpuBackend, KvRead, MatmulPath};
use hf2q_tensor::kv::{AffineKv, HostKv, KvType, KvTypes};
use hf2q_tensor::op::{AttentionParams, KvElem, LayerCache};
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

fn max_err(a: &Tensor, b: &Tensor) -> f32 {
    a.data()
        .iter()
        .zip(b.data())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn dequantized<T: KvElem>(blocks: &[T]) -> Vec<f32> {
    let mut out = vec![0f32; blocks.len() * T::VALUES];
    T::dequantize_row(blocks, &mut out);
    out
}

struct Check<'a> {
    q: &'a Tensor,
    pos0: usize,
    p: &'a AttentionParams,
    what: &'a str,
}

impl KvVisit for Check<'_> {
    type Out = ();
    fn visit<K: KvRead, V: KvRead>(self, c: &LayerCache<'_, K, V>) {
        let (hkv, dh) = (self.p.n_kv_heads, self.p.head_dim);
        let (kd, vd) = (c.keys_f32(hkv, dh), dequantized(c.v));
        let c32 = LayerCache {
            k: &kd,
            v: &vd,
            capacity: c.capacity,
            centre: None,
        };
        let want = CpuBackend::default()
            .attention(self.q, &c32, self.pos0, self.p)
            .unwrap();
        let fast = CpuBackend {
            matmul: MatmulPath::Fast,
            ..CpuBackend::default()
        };
        let mut first: Option<Tensor> = None;
        for threads in [1, 2, 4] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let got = pool.install(|| fast.attention(self.q, c, self.pos0, self.p).unwrap());
            // Convex combinations of values in [-1, 1]: f32 sums of thousands of terms in
            // another order, the polynomial exp, and (split) the parts' merge.
            let e = max_err(&want, &got);
            assert!(
                e < 2e-5,
                "{} threads={threads}: vs reference {e}",
                self.what
            );
            if let Some(f) = &first {
                let e = max_err(f, &got);
                assert!(
                    e < 1e-5,
                    "{} threads={threads}: vs one thread {e}",
                    self.what
                );
            }
            first.get_or_insert(got);
        }
    }
}

#[test]
fn decode_at_depth_over_any_threads_equals_the_reference() {
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    for &(h, hkv, dh) in &[(9, 3, 64), (8, 2, 128), (4, 1, 64), (7, 1, 32)] {
        for &(pos0, window, sinks) in &[
            (2100, None, false),
            (1500, Some(1100), false),
            (3000, None, true),
            (40, None, false),
        ] {
            let n = pos0 + 1;
            let p = AttentionParams {
                n_heads: h,
                n_kv_heads: hkv,
                head_dim: dh,
                scale: 1.0 / (dh as f32).sqrt(),
                window,
                sinks: sinks.then(|| (0..h).map(|i| i as f32 - 2.0).collect::<Vec<_>>().into()),
            };
            let k: Vec<f32> = (0..n * hkv * dh)
                .map(|i| 3.0 * rng.f() * (1.0 + (i / 32 % 5) as f32))
                .collect();
            let v: Vec<f32> = (0..n * hkv * dh).map(|_| rng.f()).collect();
            let (kt, vt) = (
                Tensor::new(&[n, hkv * dh], k).unwrap(),
                Tensor::new(&[n, hkv * dh], v).unwrap(),
            );
            let q =
                Tensor::new(&[1, h * dh], (0..h * dh).map(|_| 3.0 * rng.f()).collect()).unwrap();
            let affine = match dh {
                32 => AffineKv::B8G32,
                64 => AffineKv::B8G64,
                _ => AffineKv::B8G128,
            };
            for ty in [
                KvTypes::from(KvType::Q8_0),
                KvTypes::from(KvType::Affine(affine)),
                KvTypes::from(KvType::F16),
                KvTypes {
                    k: KvType::Q8_0,
                    v: KvType::F16,
                },
            ] {
                let mut kv = HostKv::new(hkv, dh, ty);
                kv.write(&kt, &vt, 0, n + 3).unwrap();
                let what = format!(
                    "{} h={h} hkv={hkv} dh={dh} pos0={pos0} {window:?} sinks={sinks}",
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
        }
    }
}
