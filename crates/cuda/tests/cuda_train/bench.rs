//! `bench_train` (`HF2Q_CUDA_BENCH=1`): every training op at the shapes of one LoRA training step
//! of Llama-3.2-1B and Llama-3.1-8B (batch 8 x 1024 tokens), timed with CUDA events around
//! back-to-back eager calls (warmed up; median of five batches), with the achieved TFLOP/s (products,
//! attention: useful flops only) or GB/s (element-wise ops: bytes each must read and write).
//! `HF2Q_CUDA_BENCH=1b` or `=8b` runs one model. Also here, ignored: the kernels' register
//! report and warming a kernel cache for another machine (NVRTC only).

use rayon::prelude::*;

use super::*;

/// Device time per call of `f` in milliseconds (see the module header).
fn time_ms(be: &CudaBackend, reps: usize, mut f: impl FnMut()) -> f64 {
    use cudarc::driver::sys::CUevent_flags;
    let dev = be.device();
    f();
    f();
    dev.synchronize().unwrap();
    let ctx = dev.stream().context().clone();
    let mut times = Vec::new();
    for _ in 0..5 {
        let a = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap();
        let b = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap();
        a.record(dev.stream()).unwrap();
        for _ in 0..reps {
            f();
        }
        b.record(dev.stream()).unwrap();
        b.synchronize().unwrap();
        times.push(a.elapsed_ms(&b).unwrap() as f64 / reps as f64);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    times[2]
}

/// Random values in [-s, s), made in parallel (bench data only).
fn fast_vec(n: usize, s: f32, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    v.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        let mut r = Rng(seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        c.iter_mut().for_each(|x| *x = r.f() * s);
    });
    v
}

fn fast_tensor(be: &CudaBackend, shape: &[usize], s: f32, seed: u64) -> Tensor {
    let n = shape.iter().product();
    be.upload(&Tensor::new(shape, fast_vec(n, s, seed)).unwrap())
        .unwrap()
}

/// A weight of random values at a real shape, made fast: BF16 from random floats, Q4_K as
/// random quants under a fixed small scale (timing only: the values do not matter, as long as
/// they are numbers).
fn big_weight(ty: GgmlType, rows: usize, cols: usize) -> QTensor {
    let bytes = match ty {
        GgmlType::BF16 => {
            let v = fast_vec(rows * cols, 0.05, (rows * 131 + cols) as u64);
            v.par_iter()
                .flat_map_iter(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect()
        }
        GgmlType::Q4_K => {
            let n = rows * cols / 256;
            let mut b = vec![0u8; n * 144];
            b.par_chunks_mut(144).enumerate().for_each(|(i, blk)| {
                let mut r = Rng(i as u64 * 7 + 1);
                for x in blk.iter_mut() {
                    *x = r.next() as u8;
                }
                blk[..4].copy_from_slice(&[0x00, 0x1c, 0x66, 0x1a]);
            });
            b
        }
        _ => unreachable!("bench formats"),
    };
    QTensor::ggml("w", ty, rows, cols, Bytes::from_vec(bytes)).unwrap()
}

struct Shape {
    name: &'static str,
    d: usize,
    f: usize,
    heads: usize,
    kv_heads: usize,
    dh: usize,
}

fn row(op: &str, shape: &str, ms: f64, flops: f64, bytes: f64) {
    let rate = if flops > 0.0 {
        format!("{:.0} TFLOP/s", flops / ms / 1e9)
    } else {
        format!("{:.0} GB/s", bytes / ms / 1e6)
    };
    println!("| {op} | {shape} | {ms:.3} | {rate} |");
}

#[test]
fn bench_train() {
    let Ok(which) = std::env::var("HF2Q_CUDA_BENCH") else {
        println!("skipped: set HF2Q_CUDA_BENCH=1 to time the training ops");
        return;
    };
    let Some(be) = backend() else { return };
    be.set_poison_outputs(false);
    let shapes = [
        Shape {
            name: "1B",
            d: 2048,
            f: 8192,
            heads: 32,
            kv_heads: 8,
            dh: 64,
        },
        Shape {
            name: "8B",
            d: 4096,
            f: 14336,
            heads: 32,
            kv_heads: 8,
            dh: 128,
        },
    ];
    let (n, vocab, r) = (8192usize, 128256usize, 16usize);
    let layout = SeqLayout::from_lengths(&[1024; 8]).unwrap();
    println!("| op | shape | ms | rate |\n| --- | --- | --- | --- |");
    for s in &shapes {
        if which.eq_ignore_ascii_case("1b") && s.name != "1B"
            || which.eq_ignore_ascii_case("8b") && s.name != "8B"
        {
            continue;
        }
        let (d, qd, kd) = (s.d, s.heads * s.dh, s.kv_heads * s.dh);
        // Products through the frozen weights: (R, C) of q, k (and v), o, gate (and up), down.
        let mats = [
            ("q", qd, d),
            ("k", kd, d),
            ("o", d, qd),
            ("gate", s.f, d),
            ("down", d, s.f),
        ];
        for ty in [GgmlType::BF16, GgmlType::Q4_K] {
            for &(m, rows, cols) in &mats {
                let w = big_weight(ty, rows, cols);
                let flops = 2.0 * (n * rows * cols) as f64;
                let shape = format!("{} {m} {ty:?} {n}x{rows}x{cols}", s.name);
                let dy = fast_tensor(&be, &[n, rows], 1.0, 1);
                let ms = time_ms(&be, 5, || drop(be.linear_backward_input(&dy, &w).unwrap()));
                row("linear_backward_input (bf16)", &shape, ms, flops, 0.0);
                let x = fast_tensor(&be, &[n, cols], 1.0, 2);
                be.device().set_prefill_gemm(PrefillGemm::F16);
                let ms = time_ms(&be, 5, || drop(be.linear(&x, &w, None).unwrap()));
                row("linear forward (f16, one pass)", &shape, ms, flops, 0.0);
                be.device().set_prefill_gemm(PrefillGemm::Pairs);
            }
        }
        // A product with the LoRA term appended along its depth, against the product and a
        // pass over its output (the gate and the down projection, Q4_K).
        for &(m, rows, cols) in &[mats[3], mats[4]] {
            let w = big_weight(GgmlType::Q4_K, rows, cols);
            let flops = 2.0 * (n * rows * (cols + r)) as f64;
            let shape = format!("{} {m} Q4_K {n}x{rows}x{cols} r {r}", s.name);
            let (x, u) = (
                fast_tensor(&be, &[n, cols], 1.0, 20),
                fast_tensor(&be, &[n, r], 1.0, 21),
            );
            let b = fast_tensor(&be, &[rows, r], 0.05, 22);
            for align in [8, 64, 128] {
                be.set_low_rank_align(align);
                let ms = time_ms(&be, 5, || {
                    drop(be.linear_low_rank(&x, &w, None, &u, &b, 2.0).unwrap())
                });
                row(
                    &format!("linear_low_rank (f16, one product, depth % {align})"),
                    &shape,
                    ms,
                    flops,
                    0.0,
                );
                let (dy, du) = (
                    fast_tensor(&be, &[n, rows], 1.0, 23),
                    fast_tensor(&be, &[n, r], 1.0, 24),
                );
                let a = fast_tensor(&be, &[r, cols], 0.05, 25);
                let ms = time_ms(&be, 5, || {
                    drop(
                        be.linear_backward_input_low_rank(&dy, &w, &du, &a, 2.0)
                            .unwrap(),
                    )
                });
                row(
                    &format!("linear_backward_input_low_rank (bf16, depth % {align})"),
                    &shape,
                    ms,
                    flops,
                    0.0,
                );
            }
            be.set_low_rank_align(64);
            be.device().set_prefill_gemm(PrefillGemm::F16);
            let ms = time_ms(&be, 5, || {
                let mut y = be.linear(&x, &w, None).unwrap();
                be.matmul_acc(&mut y, &u, &b, MatmulSpec::NT.scaled(2.0))
                    .unwrap();
            });
            be.device().set_prefill_gemm(PrefillGemm::Pairs);
            row("linear + matmul_acc (composed)", &shape, ms, flops, 0.0);
            let (dy, du) = (
                fast_tensor(&be, &[n, rows], 1.0, 23),
                fast_tensor(&be, &[n, r], 1.0, 24),
            );
            let a = fast_tensor(&be, &[r, cols], 0.05, 25);
            let ms = time_ms(&be, 5, || {
                let mut dx = be.linear_backward_input(&dy, &w).unwrap();
                be.matmul_acc(&mut dx, &du, &a, MatmulSpec::NN.scaled(2.0))
                    .unwrap();
            });
            row("linear_backward_input + matmul_acc", &shape, ms, flops, 0.0);
        }
        // Attention: useful flops 4 · visible keys · Dh per (row, head) forward (QKᵀ, PV),
        // 2.5 times that backward (S, dP, dV, dK, dQ; the kernels recompute S and dP twice).
        let visible: f64 = layout.lengths().map(|t| (t * (t + 1) / 2) as f64).sum();
        let fwd_flops = 4.0 * visible * (s.heads * s.dh) as f64;
        let a = TrainAttention {
            p: AttentionParams {
                n_heads: s.heads,
                n_kv_heads: s.kv_heads,
                head_dim: s.dh,
                scale: 1.0 / (s.dh as f32).sqrt(),
                window: None,
                sinks: None,
            },
            softcap: None,
        };
        let q = fast_tensor(&be, &[n, qd], 2.0, 3);
        let k = fast_tensor(&be, &[n, kd], 2.0, 4);
        let v = fast_tensor(&be, &[n, kd], 1.0, 5);
        let dout = fast_tensor(&be, &[n, qd], 1.0, 6);
        let shape = format!(
            "{} 8x1024, {}/{} heads of {}",
            s.name, s.heads, s.kv_heads, s.dh
        );
        let ms = time_ms(&be, 5, || {
            drop(be.attention_train(&q, &k, &v, &layout, &a).unwrap())
        });
        row("attention_train", &shape, ms, fwd_flops, 0.0);
        let fwd = be.attention_train(&q, &k, &v, &layout, &a).unwrap();
        let ms = time_ms(&be, 5, || {
            drop(
                be.attention_backward(&q, &k, &v, &fwd, &dout, &layout, &a)
                    .unwrap(),
            )
        });
        row("attention_backward", &shape, ms, 2.5 * fwd_flops, 0.0);
        // The output layer with its gradient, every row a target (BF16 weight).
        let w = big_weight(GgmlType::BF16, vocab, d);
        let h = fast_tensor(&be, &[n, d], 1.0, 7);
        let targets: Vec<i32> = (0..n).map(|i| (i * 7919 % vocab) as i32).collect();
        let g = vec![1.0 / n as f32; n];
        let shape = format!("{} {n}x{d} x V {vocab}", s.name);
        let ms = time_ms(&be, 2, || {
            drop(
                be.lm_head_logprobs(&h, &w, &targets, None, Some(&g))
                    .unwrap(),
            )
        });
        row(
            "lm_head_logprobs + grad",
            &shape,
            ms,
            4.0 * (n * vocab * d) as f64,
            0.0,
        );
        drop(w);
        // LoRA r = 16 on the gate (the widest): x·Aᵀ, y += u·Bᵀ, dA = duᵀ·x, dx += du·A.
        let x = fast_tensor(&be, &[n, d], 1.0, 8);
        let la = fast_tensor(&be, &[r, d], 0.05, 9);
        let lb = fast_tensor(&be, &[s.f, r], 0.05, 10);
        let u = be.matmul(&x, &la, MatmulSpec::NT).unwrap();
        let mut y = fast_tensor(&be, &[n, s.f], 1.0, 11);
        let ms = time_ms(&be, 10, || {
            drop(be.matmul(&x, &la, MatmulSpec::NT).unwrap())
        });
        row(
            "matmul x·Aᵀ (f32)",
            &format!("{} {n}x{d}x{r}", s.name),
            ms,
            0.0,
            4.0 * (n * d + n * r) as f64,
        );
        let ms = time_ms(&be, 10, || {
            be.matmul_acc(&mut y, &u, &lb, MatmulSpec::NT).unwrap()
        });
        row(
            "matmul_acc y += u·Bᵀ (f32)",
            &format!("{} {n}x{r}x{}", s.name, s.f),
            ms,
            0.0,
            8.0 * (n * s.f) as f64,
        );
        let ms = time_ms(&be, 10, || drop(be.matmul(&u, &x, MatmulSpec::TN).unwrap()));
        row(
            "matmul dA = uᵀ·x (f32)",
            &format!("{} {r}x{n}x{d}", s.name),
            ms,
            0.0,
            4.0 * (n * d + n * r) as f64,
        );
        // Element-wise and row ops: bytes each reads and writes once.
        let dy = fast_tensor(&be, &[n, d], 1.0, 12);
        let wn = fast_vec(d, 1.0, 13);
        let ms = time_ms(&be, 10, || {
            drop(be.rms_norm_backward(&x, &wn, 1e-5, 0.0, &dy).unwrap())
        });
        row(
            "rms_norm_backward",
            &format!("{} {n}x{d}", s.name),
            ms,
            0.0,
            12.0 * (n * d) as f64,
        );
        let gt = fast_tensor(&be, &[n, s.f], 3.0, 14);
        let ms = time_ms(&be, 10, || {
            drop(be.gated_act_backward(&gt, &y, &y, GateAct::Silu).unwrap())
        });
        row(
            "gated_act_backward (silu)",
            &format!("{} {n}x{}", s.name, s.f),
            ms,
            0.0,
            20.0 * (n * s.f) as f64,
        );
        let p = RopeParams {
            style: RopeStyle::Neox,
            theta: 500000.0,
            dims: s.dh,
            freq_factors: None,
            linear_scale: 1.0,
        };
        let mut qq = q.clone();
        let ms = time_ms(&be, 10, || {
            be.rope_rows(&mut qq, s.heads, &layout, &p, true).unwrap()
        });
        row(
            "rope_rows",
            &format!("{} {n}x{qd}", s.name),
            ms,
            0.0,
            8.0 * (n * qd) as f64,
        );
        let ms = time_ms(&be, 10, || drop(be.dropout(&x, 0.1, 42).unwrap()));
        row(
            "dropout",
            &format!("{} {n}x{d}", s.name),
            ms,
            0.0,
            8.0 * (n * d) as f64,
        );
        // AdamW over the adapter: r (C + R) per linear, seven linears a layer.
        let per_layer: usize = mats.iter().map(|&(_, rr, cc)| r * (rr + cc)).sum::<usize>()
            + r * (kd + d)
            + r * (s.f + d);
        let np = per_layer * if s.name == "1B" { 16 } else { 32 };
        let (mut pp, gg, mut mm, mut vv) = (
            fast_tensor(&be, &[np], 0.1, 15),
            fast_tensor(&be, &[np], 0.01, 16),
            be.zeros(&[np]).unwrap(),
            be.zeros(&[np]).unwrap(),
        );
        let st = AdamStep {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 3,
        };
        let ms = time_ms(&be, 10, || {
            be.adamw(&mut pp, &gg, &mut mm, &mut vv, &st).unwrap()
        });
        row(
            "adamw (all LoRA params)",
            &format!("{} {np}", s.name),
            ms,
            0.0,
            28.0 * np as f64,
        );
        let ms = time_ms(&be, 10, || {
            let _ = be.sum_squares(&gg).unwrap();
        });
        row(
            "sum_squares (incl. sync)",
            &format!("{} {np}", s.name),
            ms,
            0.0,
            4.0 * np as f64,
        );
    }
}

/// Registers and spills of the training kernels for sm_90 (NVRTC only):
/// `cargo test --test cuda_train train_kernel_resources -- --ignored --nocapture`.
#[test]
#[ignore]
fn train_kernel_resources() {
    for file in ["train.cu", "train_attn.cu"] {
        let (_, log) =
            hf2q_cuda::compile_program_for(file, (9, 0), &["--ptxas-options=-v"]).unwrap();
        let mut func = String::new();
        for line in log.lines() {
            if let Some(i) = line.find("entry function '") {
                func = line[i + 16..].split('\'').next().unwrap_or("").to_string();
            } else if line.contains("Used") || line.contains("spill") {
                println!("{file} {func}: {}", line.trim());
            }
        }
    }
}

/// Warms a kernel cache for another machine: `HF2Q_FILL_CACHE=folder` compiles every program
/// for sm_90 under a 13.0 driver into `folder/cuda-kernels` (NVRTC only, no GPU).
#[test]
#[ignore]
fn fill_kernel_cache() {
    let dir = std::path::PathBuf::from(std::env::var("HF2Q_FILL_CACHE").expect("HF2Q_FILL_CACHE"));
    hf2q_cuda::fill_cache_for(&dir.join("cuda-kernels"), (9, 0), 13000).unwrap();
}
