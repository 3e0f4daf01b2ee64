//! Matmul kernels at real model shapes (R x C = output rows x input columns), per weight type:
//! SmolLM2-135M (576x576 q/o, 1536x576 gate/up, 576x1536 down, 49152x576 tied lm_head) and
//! Llama-3.2-1B (2048x2048 q/o, 8192x2048 gate/up, 2048x8192 down), for T = 1 (decode: the
//! group reports GB/s of stored weights) and T = 512 (prefill: the group reports elements/s =
//! FLOP/s, two per multiply-add). The reference `QTensor::matmul` is measured beside them at
//! T = 1, and at T = 512 on the smallest shape (it is minutes per call at the large ones);
//! for Q4_0 and Q8_0 also the packed layout (`packed`, see `cpu/kernels/packed.rs`). The
//! `stream` group runs a model's worth of small weights back to back (memory streaming).
//!
//! Thread count: `RAYON_NUM_THREADS=1 cargo bench -p hf2q-tensor --bench kernels [-- FILTER]`.
//! Filter by id, e.g. `-- 'T1/Q4_0'`. K-quant shapes with C not a multiple of 256 are skipped.

#[path = "../tests/kernels_util/mod.rs"]
mod kernels_util;

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hf2q_cpu::kernels;
use hf2q_tensor::{GgmlType, QTensor};
use kernels_util::{make_weight, make_x, Kind, Rng};

const SHAPES: [(usize, usize); 7] = [
    (576, 576),
    (1536, 576),
    (576, 1536),
    (49152, 576),
    (2048, 2048),
    (8192, 2048),
    (2048, 8192),
];

fn kinds() -> Vec<Kind> {
    use GgmlType::*;
    let mut v: Vec<Kind> = [
        Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, F16, BF16, F32,
    ]
    .into_iter()
    .map(Kind::Ggml)
    .collect();
    v.push(Kind::Mlx { bits: 4, group: 64 });
    v.push(Kind::Mlx { bits: 8, group: 64 });
    v
}

/// Builds the weight on first use only (criterion skips filtered-out benchmarks, and building
/// a 49152x576 weight with the reference quantizer takes a moment).
struct Lazy {
    kind: Kind,
    r: usize,
    k: usize,
    w: Option<QTensor>,
}

impl Lazy {
    fn get(&mut self) -> &QTensor {
        let (kind, r, k) = (self.kind, self.r, self.k);
        self.w
            .get_or_insert_with(|| make_weight(kind, r, k, &mut Rng::new((r * 31 + k) as u64)))
    }
}

fn bench_t(c: &mut Criterion, t: usize) {
    let mut group = c.benchmark_group(format!("T{t}"));
    for kind in kinds() {
        for (r, k) in SHAPES {
            if k % kind.col_multiple() != 0 {
                continue;
            }
            let x = make_x(t, k, &mut Rng::new(7));
            let mut out = vec![0f32; t * r];
            let mut lazy = Lazy {
                kind,
                r,
                k,
                w: None,
            };
            // Throughput from sizes alone (the weight is built lazily).
            let bytes = match kind {
                Kind::Ggml(ty) => ty.row_bytes(k).unwrap() * r,
                Kind::Mlx { bits, group } => r * k * bits as usize / 8 + 4 * r * k / group,
            };
            group.throughput(if t == 1 {
                Throughput::Bytes(bytes as u64)
            } else {
                Throughput::Elements((2 * r * k * t) as u64)
            });
            let id = format!("{}/{r}x{k}", kind.name());
            group.bench_function(BenchmarkId::new("fast", &id), |b| {
                let w = lazy.get().clone();
                b.iter(|| kernels::linear(&w, &x, t, &mut out, kernels::ActBits::Split16).unwrap())
            });
            if matches!(kind, Kind::Ggml(GgmlType::Q4_0 | GgmlType::Q8_0)) {
                // The same weight re-laid out for this CPU's kernels (where it has them).
                group.bench_function(BenchmarkId::new("packed", &id), |b| {
                    let w = lazy.get().clone();
                    match kernels::pack(&w) {
                        Some(p) => b.iter(|| {
                            kernels::linear_packed(
                                &w,
                                &p,
                                &x,
                                t,
                                &mut out,
                                kernels::ActBits::Split16,
                            )
                            .unwrap()
                        }),
                        None => b.iter(|| {
                            kernels::linear(&w, &x, t, &mut out, kernels::ActBits::Split16).unwrap()
                        }),
                    }
                });
            }
            if t == 1 || (r, k) == (576, 576) {
                group.bench_function(BenchmarkId::new("reference", &id), |b| {
                    let w = lazy.get().clone();
                    b.iter(|| w.matmul(&x, t, &mut out).unwrap())
                });
            }
        }
    }
    group.finish();
}

fn decode(c: &mut Criterion) {
    bench_t(c, 1);
}

fn prefill(c: &mut Criterion) {
    bench_t(c, 512);
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1)).sample_size(10);
    targets = decode, prefill
}
criterion_main!(benches, streams);

/// One-token products over a model's worth (60 MB) of 576x576 Q4_0 weights called one after
/// the other, as a decode step calls them (the output is only the weights' bytes per second):
/// row-major (`stream/fast`) and packed into one arena in call order (`stream/packed`; on
/// CPUs without the packed layout, row-major again). Unlike one matrix repeated, this shows
/// how a kernel streams from memory when each product is small. The weights are built only
/// when the filter selects the group: `-- stream`.
fn stream(c: &mut Criterion) {
    let mut group = c.benchmark_group("stream");
    let (r, k) = (576usize, 576usize);
    let n = (60 << 20) / (r * k / 32 * 18);
    group.throughput(Throughput::Bytes((n * r * k / 32 * 18) as u64));
    let mut ws: Option<Vec<QTensor>> = None;
    let mut weights = || -> Vec<QTensor> {
        ws.get_or_insert_with(|| {
            (0..n)
                .map(|i| {
                    make_weight(
                        Kind::Ggml(GgmlType::Q4_0),
                        r,
                        k,
                        &mut Rng::new(i as u64 + 1),
                    )
                })
                .collect()
        })
        .clone()
    };
    let x = make_x(1, k, &mut Rng::new(7));
    let mut out = vec![0f32; r];
    group.bench_function("fast", |b| {
        let ws = weights();
        b.iter(|| {
            for w in &ws {
                kernels::linear(w, &x, 1, &mut out, kernels::ActBits::Split16).unwrap()
            }
        })
    });
    group.bench_function("packed", |b| {
        let ws = weights();
        let mut arena = kernels::PackArena::new();
        let ps: Vec<_> = ws.iter().map(|w| kernels::pack_in(&mut arena, w)).collect();
        b.iter(|| {
            for (w, p) in ws.iter().zip(&ps) {
                match p {
                    Some(p) => {
                        kernels::linear_packed(w, p, &x, 1, &mut out, kernels::ActBits::Split16)
                    }
                    None => kernels::linear(w, &x, 1, &mut out, kernels::ActBits::Split16),
                }
                .unwrap()
            }
        })
    });
    group.finish();
}
criterion_group!(streams, stream);
