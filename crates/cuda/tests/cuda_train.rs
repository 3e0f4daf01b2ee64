//! The CUDA training op set and dense products against the CPU reference (`CpuBackend::REFERENCE`
//! as `TrainBackend`), on random inputs at awkward shapes and at real ones (a Llama-3.2-1B
//! layer: N = 1024, D = 2048, H = 32, Hkv = 8, Dh = 64, F = 8192, V = 128256).
//!
//! Every test draws fresh random inputs (the seed is printed; `HF2Q_TEST_SEED` replays one), and
//! the backend fills each output with NaN before an op writes it (`set_poison_outputs`), so an
//! element left unwritten fails. Without a GPU each test prints "skipped: no CUDA device" and
//! passes. Tolerances, with their reasons:
//! - f32 paths (RoPE, norms, activations, f32 products, the f32 attention kernels): relative L2
//!   error <= 2e-5, a few hundred f32 roundings in a different order than the CPU's.
//! - bit-exact (dropout, add_scaled, scale, AdamW): the kernels round each operation as the CPU
//!   does (no fused multiply-adds).
//! - bf16 operands with f32 sums (frozen-weight backward, tensor-core attention, the output
//!   layer): relative L2 error <= 1e-2; each operand rounds at 2^-9, and a product of two such
//!   sums is off by about 2^-8 / sqrt(terms that cancel) of its size, ~3e-3 measured budget.
//!
//! `HF2Q_CUDA_BENCH=1` also runs `bench_train`: every op at the 1B and 8B training shapes
//! (batch 8 x 1024 tokens), timed with CUDA events, with achieved TFLOP/s or GB/s.

use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use hf2q_cpu::CpuBackend;
use hf2q_cuda::backend::{CudaBackend, StepOutput};
use hf2q_cuda::{CudaDev, KvDtype, PrefillGemm};
use hf2q_tensor::op::{AttentionParams, Backend, GateAct, MatmulSpec, RopeParams, RopeStyle};
use hf2q_tensor::quant::{self, mlx::AffineParams};
use hf2q_tensor::train_op::{AdamStep, SeqLayout, TrainAttention, TrainBackend};
use hf2q_tensor::{Bytes, GgmlType, QTensor, Tensor};

const CPU: CpuBackend = CpuBackend::REFERENCE;
/// f32 paths: see the module header.
const TOL_F32: f64 = 2e-5;
/// bf16 operands: see the module header.
const TOL_BF16: f64 = 1e-2;

fn device() -> Option<Arc<CudaDev>> {
    static DEV: OnceLock<Option<Arc<CudaDev>>> = OnceLock::new();
    let d = DEV
        .get_or_init(|| {
            match CudaDev::open(
                0,
                &hf2q_cuda::CudaOptions::from_environment(|k| std::env::var_os(k)).unwrap(),
            ) {
                Ok(d) => d,
                Err(e) => panic!("a CUDA device is present but could not be opened: {e}"),
            }
        })
        .clone();
    if d.is_none() {
        println!("skipped: no CUDA device");
    }
    d
}

/// A backend on the device with output poisoning on (see the module header).
fn backend() -> Option<CudaBackend> {
    let dev = device()?;
    let be = CudaBackend::new(dev, KvDtype::F16).unwrap();
    be.set_poison_outputs(true);
    Some(be)
}

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn new(test: &str) -> Rng {
        let seed = std::env::var("HF2Q_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
        println!("{test}: seed {seed}");
        Rng(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
    fn tensor(&mut self, shape: &[usize], scale: f32) -> Tensor {
        let n = shape.iter().product();
        Tensor::new(shape, self.vec(n, scale)).unwrap()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn host(be: &CudaBackend, x: &Tensor) -> Vec<f32> {
    be.to_host(x).unwrap().into_data()
}

/// ‖got − want‖ / ‖want‖, after checking that every element was written (no NaN).
fn rel_l2(what: &str, got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (mut num, mut den) = (0f64, 0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            !g.is_nan(),
            "{what}: element {i} not written (NaN), want {w}"
        );
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    (num / den.max(1e-300)).sqrt()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = rel_l2(what, got, want);
    println!("  {what}: rel L2 {e:.2e}");
    assert!(e <= tol, "{what}: relative L2 error {e:.3e} > {tol:.0e}");
}

fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {i}: {g} vs {w}");
    }
}

/// A layout of sequences of random lengths summing to `n` (at least one of length 1 when n
/// allows).
fn ragged(rng: &mut Rng, n: usize, seqs: usize) -> SeqLayout {
    let mut lens = vec![1usize; seqs.min(n)];
    for _ in lens.len()..n {
        let i = rng.below(lens.len());
        lens[i] += 1;
    }
    if lens.len() > 1 {
        let j = rng.below(lens.len() - 1) + 1;
        let extra = lens[j] - 1;
        lens[j] = 1;
        lens[0] += extra;
    }
    SeqLayout::from_lengths(&lens).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Dense products
// ---------------------------------------------------------------------------------------------

#[test]
fn matmul_every_transpose_cublas_and_own_kernels() {
    let Some(be) = backend() else { return };
    let mut rng = Rng::new("matmul");
    // (M, K, N): a LoRA adapter at decode (x·Aᵀ, then ·Bᵀ), odd sizes, and training's products.
    let shapes = [
        (1, 2048, 16),
        (1, 16, 2048),
        (3, 37, 5),
        (37, 53, 29),
        (200, 300, 100),
        (1024, 2048, 16),
        (16, 1024, 2048),
        (512, 16, 8192),
        (70, 0, 9),
    ];
    for gemm in [PrefillGemm::Pairs, PrefillGemm::Tiled] {
        be.device().set_prefill_gemm(gemm);
        for &(m, k, n) in &shapes {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a_shape = if ta { [k, m] } else { [m, k] };
                let b_shape = if tb { [n, k] } else { [k, n] };
                let a = rng.tensor(&a_shape, 1.0);
                let b = rng.tensor(&b_shape, 1.0);
                let spec = MatmulSpec {
                    ta,
                    tb,
                    alpha: 0.75,
                };
                let want = CPU.matmul(&a, &b, spec).unwrap();
                let (da, db) = (be.upload(&a).unwrap(), be.upload(&b).unwrap());
                let got = be.matmul(&da, &db, spec).unwrap();
                let what = format!("{gemm:?} matmul ({m}, {k}, {n}) ta {ta} tb {tb}");
                assert_close(&what, &host(&be, &got), want.data(), TOL_F32);
                let c0 = rng.tensor(&[m, n], 1.0);
                let mut want_acc = c0.clone();
                CPU.matmul_acc(&mut want_acc, &a, &b, spec).unwrap();
                let mut dc = be.upload(&c0).unwrap();
                be.matmul_acc(&mut dc, &da, &db, spec).unwrap();
                assert_close(
                    &format!("{what} acc"),
                    &host(&be, &dc),
                    want_acc.data(),
                    TOL_F32,
                );
            }
        }
    }
    be.device().set_prefill_gemm(PrefillGemm::Pairs);
    let a = be.upload(&rng.tensor(&[4, 5], 1.0)).unwrap();
    let b = be.upload(&rng.tensor(&[6, 7], 1.0)).unwrap();
    assert!(be.matmul(&a, &b, MatmulSpec::NN).is_err());
    let b = be.upload(&rng.tensor(&[5, 7], 1.0)).unwrap();
    let mut wrong = be.upload(&rng.tensor(&[4, 6], 1.0)).unwrap();
    assert!(be.matmul_acc(&mut wrong, &a, &b, MatmulSpec::NN).is_err());
}

/// A LoRA adapter's two products at decode, `y += s · (x · Aᵀ) · Bᵀ`, captured into a graph
/// (our own kernels: cuBLAS is not used while capturing) and replayed.
#[test]
fn matmul_inside_a_captured_graph() {
    let Some(be) = backend() else { return };
    let mut rng = Rng::new("matmul_graph");
    let (c, r, rows) = (2048, 16, 8192);
    let x = rng.tensor(&[1, c], 1.0);
    let a = rng.tensor(&[r, c], 0.05);
    let b = rng.tensor(&[rows, r], 0.05);
    let y0 = rng.tensor(&[1, rows], 1.0);
    let u = CPU.matmul(&x, &a, MatmulSpec::NT).unwrap();
    let mut want = y0.clone();
    CPU.matmul_acc(&mut want, &u, &b, MatmulSpec::NT.scaled(2.0))
        .unwrap();
    let (dx, da, db) = (
        be.upload(&x).unwrap(),
        be.upload(&a).unwrap(),
        be.upload(&b).unwrap(),
    );
    let mut y = be.upload(&y0).unwrap();
    let mut g = be
        .capture(
            &[0],
            0,
            rows,
            StepOutput::Logits,
            || -> hf2q_tensor::Result<Tensor> {
                let u = be.matmul(&dx, &da, MatmulSpec::NT)?;
                be.matmul_acc(&mut y, &u, &db, MatmulSpec::NT.scaled(2.0))?;
                Ok(y.clone())
            },
        )
        .unwrap();
    let got = be.replay(&mut g, &[0], 0).unwrap();
    assert_close("captured LoRA products", got.data(), want.data(), TOL_F32);
}

// ---------------------------------------------------------------------------------------------
// RoPE, norms, activations, dropout, optimizer
// ---------------------------------------------------------------------------------------------

#[test]
fn rope_rows_and_inverse() {
    let Some(be) = backend() else { return };
    let mut rng = Rng::new("rope_rows");
    for (n, heads, dh, dims, style, seqs) in [
        (37, 3, 16, 16, RopeStyle::Neox, 4),
        (50, 2, 64, 32, RopeStyle::Interleaved, 3),
        (1024, 32, 64, 64, RopeStyle::Neox, 2),
        (1024, 8, 128, 128, RopeStyle::Interleaved, 1),
    ] {
        let layout = ragged(&mut rng, n, seqs);
        let p = RopeParams {
            style,
            theta: 500000.0,
            dims,
            freq_factors: Some((0..dims / 2).map(|i| 1.0 + i as f32 * 0.1).collect()),
            linear_scale: 1.0,
        };
        for inverse in [false, true] {
            let x = rng.tensor(&[n, heads * dh], 1.0);
            let mut want = x.clone();
            CPU.rope_rows(&mut want, heads, &layout, &p, inverse)
                .unwrap();
            let mut dx = be.upload(&x).unwrap();
            be.rope_rows(&mut dx, heads, &layout, &p, inverse).unwrap();
            let what =
                format!("rope ({n}, {heads}x{dh}, dims {dims}, {style:?}, inverse {inverse})");
            assert_close(&what, &host(&be, &dx), want.data(), TOL_F32);
        }
    }
    let layout = SeqLayout::from_lengths(&[3]).unwrap();
    let p = RopeParams {
        style: RopeStyle::Neox,
        theta: 1e4,
        dims: 8,
        freq_factors: None,
        linear_scale: 1.0,
    };
    let mut x = be.upload(&rng.tensor(&[4, 16], 1.0)).unwrap();
    assert!(
        be.rope_rows(&mut x, 2, &layout, &p, false).is_err(),
        "rows != layout"
    );
    let mut x = be.upload(&rng.tensor(&[3, 15], 1.0)).unwrap();
    assert!(
        be.rope_rows(&mut x, 2, &layout, &p, false).is_err(),
        "heads"
    );
}

#[test]
fn norm_activation_dropout_and_vector_ops() {
    let Some(be) = backend() else { return };
    let mut rng = Rng::new("elementwise");
    for (rows, c, offset) in [(37, 100, 0.0), (5, 2048, 1.0), (1024, 2048, 0.0)] {
        let x = rng.tensor(&[rows, c], 2.0);
        let dy = rng.tensor(&[rows, c], 1.0);
        let w = rng.vec(c, 1.0);
        let want = CPU.rms_norm_backward(&x, &w, 1e-5, offset, &dy).unwrap();
        let got = be
            .rms_norm_backward(
                &be.upload(&x).unwrap(),
                &w,
                1e-5,
                offset,
                &be.upload(&dy).unwrap(),
            )
            .unwrap();
        assert_close(
            &format!("rms_norm_backward ({rows}, {c})"),
            &host(&be, &got),
            want.data(),
            TOL_F32,
        );
    }
    for act in [GateAct::Silu, GateAct::GeluTanh] {
        for shape in [[3, 77], [1024, 8192]] {
            let (g, u, dy) = (
                rng.tensor(&shape, 4.0),
                rng.tensor(&shape, 2.0),
                rng.tensor(&shape, 1.0),
            );
            let (wg, wu) = CPU.gated_act_backward(&g, &u, &dy, act).unwrap();
            let (gg, gu) = be
                .gated_act_backward(
                    &be.upload(&g).unwrap(),
                    &be.upload(&u).unwrap(),
                    &be.upload(&dy).unwrap(),
                    act,
                )
                .unwrap();
            assert_close(
                &format!("{act:?} dgate {shape:?}"),
                &host(&be, &gg),
                wg.data(),
                TOL_F32,
            );
            assert_close(
                &format!("{act:?} dup {shape:?}"),
                &host(&be, &gu),
                wu.data(),
                TOL_F32,
            );
        }
    }
    for (p, n) in [(0.0f32, 1000), (0.1, 100_003), (0.5, 4096)] {
        let x = rng.tensor(&[n], 1.0);
        let seed = rng.next();
        let want = CPU.dropout(&x, p, seed).unwrap();
        let got = be.dropout(&be.upload(&x).unwrap(), p, seed).unwrap();
        assert_bits(&format!("dropout p {p}"), &host(&be, &got), want.data());
    }
    assert!(be
        .dropout(&be.upload(&rng.tensor(&[4], 1.0)).unwrap(), 1.0, 1)
        .is_err());

    let n = 100_003;
    let (x, y) = (rng.tensor(&[n], 1.0), rng.tensor(&[n], 1.0));
    let (mut want, mut dx) = (x.clone(), be.upload(&x).unwrap());
    CPU.add_scaled(&mut want, &y, -0.37).unwrap();
    be.add_scaled(&mut dx, &be.upload(&y).unwrap(), -0.37)
        .unwrap();
    assert_bits("add_scaled", &host(&be, &dx), want.data());
    CPU.scale(&mut want, 1.7).unwrap();
    be.scale(&mut dx, 1.7).unwrap();
    assert_bits("scale", &host(&be, &dx), want.data());
    let (ws, gs) = (
        CPU.sum_squares(&want).unwrap(),
        be.sum_squares(&dx).unwrap(),
    );
    assert!(((ws - gs) / ws).abs() < 1e-12, "sum_squares {gs} vs {ws}");
    let z = be.zeros(&[3, 5]).unwrap();
    assert_eq!(host(&be, &z), vec![0.0; 15]);

    // AdamW over several steps, moments carried.
    let shape = [16, 2048];
    let mut p = rng.tensor(&shape, 0.1);
    let (mut m, mut v) = (Tensor::zeros(&shape), Tensor::zeros(&shape));
    let (mut dp, mut dm, mut dv) = (
        be.upload(&p).unwrap(),
        be.zeros(&shape).unwrap(),
        be.zeros(&shape).unwrap(),
    );
    for step in 1..=5 {
        let g = rng.tensor(&shape, 0.01);
        let s = AdamStep {
            lr: 2e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            step,
        };
        CPU.adamw(&mut p, &g, &mut m, &mut v, &s).unwrap();
        be.adamw(&mut dp, &be.upload(&g).unwrap(), &mut dm, &mut dv, &s)
            .unwrap();
    }
    assert_bits("adamw param", &host(&be, &dp), p.data());
    assert_bits("adamw m", &host(&be, &dm), m.data());
    assert_bits("adamw v", &host(&be, &dv), v.data());
}

// ---------------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------------

struct AttnCase {
    lens: Vec<usize>,
    heads: usize,
    kv_heads: usize,
    dh: usize,
    window: Option<usize>,
    softcap: Option<f32>,
}

fn run_attention(be: &CudaBackend, rng: &mut Rng, c: &AttnCase) {
    let layout = SeqLayout::from_lengths(&c.lens).unwrap();
    let n = layout.rows();
    let a = TrainAttention {
        p: AttentionParams {
            n_heads: c.heads,
            n_kv_heads: c.kv_heads,
            head_dim: c.dh,
            scale: 1.0 / (c.dh as f32).sqrt(),
            window: c.window,
            sinks: None,
        },
        softcap: c.softcap,
    };
    // Scores of a few units, so the softmax is neither flat nor one-hot.
    let q = rng.tensor(&[n, c.heads * c.dh], 2.0);
    let k = rng.tensor(&[n, c.kv_heads * c.dh], 2.0);
    let v = rng.tensor(&[n, c.kv_heads * c.dh], 1.0);
    let dout = rng.tensor(&[n, c.heads * c.dh], 1.0);
    let want = CPU.attention_train(&q, &k, &v, &layout, &a).unwrap();
    let wg = CPU
        .attention_backward(&q, &k, &v, &want, &dout, &layout, &a)
        .unwrap();
    let (dq, dk, dv) = (
        be.upload(&q).unwrap(),
        be.upload(&k).unwrap(),
        be.upload(&v).unwrap(),
    );
    let got = be.attention_train(&dq, &dk, &dv, &layout, &a).unwrap();
    let gg = be
        .attention_backward(&dq, &dk, &dv, &got, &be.upload(&dout).unwrap(), &layout, &a)
        .unwrap();
    let tc = c.dh == 64 || c.dh == 128;
    let tol = if tc { TOL_BF16 } else { TOL_F32 };
    let what = format!(
        "attention N {n} in {} seqs, {}/{} heads of {}, window {:?}, cap {:?} ({})",
        c.lens.len(),
        c.heads,
        c.kv_heads,
        c.dh,
        c.window,
        c.softcap,
        if tc { "bf16 tensor cores" } else { "f32" }
    );
    println!("{what}");
    assert_close("out", &host(be, &got.out), want.out.data(), tol);
    // The log-sum-exp is a few units; its error is the scores' rounding.
    assert_close("lse", &host(be, &got.lse), want.lse.data(), tol / 4.0);
    assert_close("dq", &host(be, &gg.dq), wg.dq.data(), tol);
    assert_close("dk", &host(be, &gg.dk), wg.dk.data(), tol);
    assert_close("dv", &host(be, &gg.dv), wg.dv.data(), tol);
}

#[test]
fn attention_forward_and_backward() {
    let Some(be) = backend() else { return };
    let mut rng = Rng::new("attention");
    let cases = [
        // Tensor cores: ragged sequences (one of a single token), GQA, blocks straddling
        // sequences, a window, a soft cap, N not a multiple of 64.
        AttnCase {
            lens: vec![1, 70, 5, 130],
            heads: 4,
            kv_heads: 2,
            dh: 64,
            window: None,
            softcap: None,
        },
        AttnCase {
            lens: vec![200, 3],
            heads: 2,
            kv_heads: 2,
            dh: 128,
            window: Some(37),
            softcap: None,
        },
        AttnCase {
            lens: vec![150],
            heads: 6,
            kv_heads: 1,
            dh: 64,
            window: None,
            softcap: Some(20.0),
        },
        AttnCase {
            lens: vec![63, 66, 1],
            heads: 4,
            kv_heads: 4,
            dh: 128,
            window: Some(100),
            softcap: Some(50.0),
        },
        // f32 kernels: other head widths.
        AttnCase {
            lens: vec![1, 40, 9],
            heads: 4,
            kv_heads: 2,
            dh: 16,
            window: None,
            softcap: None,
        },
        AttnCase {
            lens: vec![33, 20],
            heads: 3,
            kv_heads: 1,
            dh: 40,
            window: Some(7),
            softcap: Some(30.0),
        },
        AttnCase {
            lens: vec![45],
            heads: 2,
            kv_heads: 1,
            dh: 256,
            window: None,
            softcap: None,
        },
        // A Llama-3.2-1B layer: two sequences of a 1024-token batch.
        AttnCase {
            lens: vec![300, 724],
            heads: 32,
            kv_heads: 8,
            dh: 64,
            window: None,
            softcap: None,
        },
        // Llama-3.1-8B's head width.
        AttnCase {
            lens: vec![512],
            heads: 32,
            kv_heads: 8,
            dh: 128,
            window: None,
            softcap: None,
        },
    ];
    for c in &cases {
        run_attention(&be, &mut rng, c);
    }
    let layout = SeqLayout::from_lengths(&[5]).unwrap();
    let a = TrainAttention {
        p: AttentionParams {
            n_heads: 3,
            n_kv_heads: 2,
            head_dim: 8,
            scale: 1.0,
            window: None,
            sinks: None,
        },
        softcap: None,
    };
    let x = be.upload(&rng.tensor(&[5, 24], 1.0)).unwrap();
    let kv = be.upload(&rng.tensor(&[5, 16], 1.0)).unwrap();
    assert!(
        be.attention_train(&x, &kv, &kv, &layout, &a).is_err(),
        "3 heads in 2 groups"
    );
}

// ---------------------------------------------------------------------------------------------
// Products through frozen weights, and the output layer
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Fmt {
    Ggml(GgmlType),
    Mlx(u32, usize),
}

fn make_weight(rng: &mut Rng, f: Fmt, rows: usize, cols: usize, mag: f32) -> QTensor {
    use rayon::prelude::*;
    let w = rng.vec(rows * cols, mag);
    match f {
        Fmt::Ggml(ty) => {
            let rb = ty.row_bytes(cols).unwrap();
            let mut bytes = vec![0u8; rows * rb];
            bytes
                .par_chunks_mut(rb)
                .zip(w.par_chunks(cols))
                .for_each(|(d, s)| quant::quantize(ty, s, d).unwrap());
            QTensor::ggml("w", ty, rows, cols, Bytes::from_vec(bytes)).unwrap()
        }
        Fmt::Mlx(bits, group) => {
            let p = AffineParams {
                bits,
                group_size: group,
            };
            let rb = p.packed_bytes(cols).unwrap();
            let g = cols / group;
            let mut packed = vec![0u8; rows * rb];
            let (mut s, mut b) = (vec![0f32; rows * g], vec![0f32; rows * g]);
            for r in 0..rows {
                quant::mlx::quantize_affine(
                    p,
                    &w[r * cols..(r + 1) * cols],
                    &mut packed[r * rb..(r + 1) * rb],
                    &mut s[r * g..(r + 1) * g],
                    &mut b[r * g..(r + 1) * g],
                )
                .unwrap();
            }
            QTensor::affine("w", p, rows, cols, Bytes::from_vec(packed), s, b).unwrap()
        }
    }
}

#[test]
fn linear_backward_input_every_format() {
    let Some(be) = backend() else { return };
    let mut rng = Rng::new("linear_backward_input");
    use GgmlType::*;
    let fmts = [
        Fmt::Ggml(F32),
        Fmt::Ggml(F16),
        Fmt::Ggml(BF16),
        Fmt::Ggml(Q4_0),
        Fmt::Ggml(Q8_0),
        Fmt::Ggml(Q5_1),
        Fmt::Ggml(Q4_K),
        Fmt::Ggml(Q5_K),
        Fmt::Ggml(Q6_K),
        Fmt::Ggml(Q3_K),
        Fmt::Mlx(4, 64),
        Fmt::Mlx(3, 32),
    ];
    for gemm in [PrefillGemm::Pairs, PrefillGemm::Tiled] {
        be.device().set_prefill_gemm(gemm);
        let tol = if gemm == PrefillGemm::Tiled {
            TOL_F32
        } else {
            TOL_BF16
        };
        for &f in &fmts {
            let cols = match f {
                Fmt::Ggml(t) if t.block_size() == 256 => 512,
                Fmt::Ggml(t) if t.block_size() == 32 => 96,
                Fmt::Ggml(_) => 100,
                Fmt::Mlx(_, g) => 3 * g,
            };
            let (n, rows) = (37, 75);
            let w = make_weight(&mut rng, f, rows, cols, 0.5);
            let dy = rng.tensor(&[n, rows], 1.0);
            let want = CPU.linear_backward_input(&dy, &w).unwrap();
            let got = be
                .linear_backward_input(&be.upload(&dy).unwrap(), &w)
                .unwrap();
            assert_close(
                &format!("{gemm:?} {f:?} ({n}, {rows}) x ({rows}, {cols})"),
                &host(&be, &got),
                want.data(),
                tol,
            );
        }
    }
    be.device().set_prefill_gemm(PrefillGemm::Pairs);
    // Real shapes: a 1B layer's down projection (Q4_K) and gate (BF16), 1024 tokens.
    for (f, rows, cols) in [(Fmt::Ggml(Q4_K), 2048, 8192), (Fmt::Ggml(BF16), 8192, 2048)] {
        let w = make_weight(&mut rng, f, rows, cols, 0.05);
        let dy = rng.tensor(&[1024, rows], 1.0);
        let want = CPU.linear_backward_input(&dy, &w).unwrap();
        let got = be
            .linear_backward_input(&be.upload(&dy).unwrap(), &w)
            .unwrap();
        assert_close(
            &format!("{f:?} (1024, {rows}) x ({rows}, {cols})"),
            &host(&be, &got),
            want.data(),
            TOL_BF16,
        );
    }
    let w = make_weight(&mut rng, Fmt::Ggml(F32), 8, 16, 1.0);
    assert!(be
        .linear_backward_input(&be.upload(&rng.tensor(&[2, 9], 1.0)).unwrap(), &w)
        .is_err());
}

#[test]
fn linear_low_rank_forward_and_backward() {
    let Some(be) = backend() else { return };
    let mut rng = Rng::new("low_rank");
    use GgmlType::*;
    // Awkward shapes with a bias, a 1B layer's gate (Q4_K) and down (BF16) at 1024 tokens with
    // r = 16, and widths that take the composed path (C not a multiple of 8).
    let cases = [
        (Fmt::Ggml(Q8_0), 37, 75, 96, 5, true, 0.5),
        (Fmt::Ggml(Q4_K), 1024, 8192, 2048, 16, false, 0.05),
        (Fmt::Ggml(BF16), 1024, 2048, 8192, 16, false, 0.05),
        (Fmt::Ggml(F32), 9, 12, 100, 3, true, 0.5),
    ];
    for (f, n, rows, cols, r, bias, mag) in cases {
        let w = make_weight(&mut rng, f, rows, cols, mag);
        let (x, u, b) = (
            rng.tensor(&[n, cols], 1.0),
            rng.tensor(&[n, r], 1.0),
            rng.tensor(&[rows, r], 0.1),
        );
        let bv = rng.vec(rows, 0.5);
        let bias = bias.then_some(&bv[..]);
        let want = CPU.linear_low_rank(&x, &w, bias, &u, &b, 2.0).unwrap();
        let (dx, du, db) = (
            be.upload(&x).unwrap(),
            be.upload(&u).unwrap(),
            be.upload(&b).unwrap(),
        );
        let got = be.linear_low_rank(&dx, &w, bias, &du, &db, 2.0).unwrap();
        // f16 operands (2^-11 each): a tenth of the bf16 budget.
        let what = format!("linear_low_rank {f:?} ({n}, {cols}) -> {rows}, r {r}");
        assert_close(&what, &host(&be, &got), want.data(), TOL_BF16 / 5.0);
        let (dy, dug, a) = (
            rng.tensor(&[n, rows], 1.0),
            rng.tensor(&[n, r], 1.0),
            rng.tensor(&[r, cols], 0.1),
        );
        let want = CPU
            .linear_backward_input_low_rank(&dy, &w, &dug, &a, 2.0)
            .unwrap();
        let got = be
            .linear_backward_input_low_rank(
                &be.upload(&dy).unwrap(),
                &w,
                &be.upload(&dug).unwrap(),
                &be.upload(&a).unwrap(),
                2.0,
            )
            .unwrap();
        assert_close(
            &format!("{what}, input gradient"),
            &host(&be, &got),
            want.data(),
            TOL_BF16,
        );
    }
    let w = make_weight(&mut rng, Fmt::Ggml(F32), 8, 16, 1.0);
    let x = be.upload(&rng.tensor(&[2, 16], 1.0)).unwrap();
    let u = be.upload(&rng.tensor(&[2, 4], 1.0)).unwrap();
    let b = be.upload(&rng.tensor(&[7, 4], 1.0)).unwrap();
    assert!(
        be.linear_low_rank(&x, &w, None, &u, &b, 1.0).is_err(),
        "B rows != R"
    );
}

/// The output layer against the CPU at `(n, d, vocab)`, `draws` random rows given a target.
fn run_head(
    be: &CudaBackend,
    rng: &mut Rng,
    f: Fmt,
    (n, d, vocab): (usize, usize, usize),
    draws: usize,
    softcap: Option<f32>,
    tol: f64,
) {
    let w = make_weight(rng, f, vocab, d, 0.05);
    let h = rng.tensor(&[n, d], 1.0);
    let mut targets = vec![-1i32; n];
    for _ in 0..draws {
        targets[rng.below(n)] = rng.below(vocab) as i32;
    }
    let targeted = targets.iter().filter(|&&t| t >= 0).count();
    let g: Vec<f32> = (0..n).map(|_| rng.f() * 0.01).collect();
    let dh = be.upload(&h).unwrap();
    let what = format!("lm head {f:?} ({n}, {d}) x V {vocab}, {targeted} targets, cap {softcap:?}");
    println!("{what}");
    for grad in [None, Some(&g[..])] {
        let want = CPU
            .lm_head_logprobs(&h, &w, &targets, softcap, grad)
            .unwrap();
        let got = be
            .lm_head_logprobs(&dh, &w, &targets, softcap, grad)
            .unwrap();
        // log p is a few units: its error is the logits' (about 2^-8 of their size).
        let worst = got
            .logp
            .iter()
            .zip(&want.logp)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("  logp: max abs error {worst:.2e}");
        assert!(got.logp.iter().all(|v| v.is_finite()));
        assert!((worst as f64) <= 4.0 * tol, "{what}: logp off by {worst}");
        let flips = got
            .hit
            .iter()
            .zip(&want.hit)
            .filter(|(a, b)| a != b)
            .count();
        // A near tie at the top may flip under bf16 rounding (random targets are rarely the
        // argmax, so flips are rare): a few per thousand rows.
        assert!(flips <= 1 + n / 500, "{what}: {flips} argmax hits differ");
        match (got.dh, want.dh) {
            (Some(gd), Some(wd)) => assert_close("dh", &host(be, &gd), wd.data(), tol),
            (None, None) => {}
            _ => panic!("{what}: dh present on one side only"),
        }
    }
}

#[test]
fn lm_head_logprobs_chunked() {
    let Some(be) = backend() else { return };
    let mut rng = Rng::new("lm_head");
    use GgmlType::*;
    for gemm in [PrefillGemm::Pairs, PrefillGemm::Tiled] {
        be.device().set_prefill_gemm(gemm);
        run_head(
            &be,
            &mut rng,
            Fmt::Ggml(Q8_0),
            (50, 64, 1000),
            30,
            None,
            TOL_BF16,
        );
        run_head(
            &be,
            &mut rng,
            Fmt::Ggml(F16),
            (20, 96, 517),
            20,
            Some(30.0),
            TOL_BF16,
        );
    }
    be.device().set_prefill_gemm(PrefillGemm::Pairs);
    // The 1B's output layer (tied BF16 embeddings): about 600 rows with targets (900 draws),
    // two chunks of 523.
    run_head(
        &be,
        &mut rng,
        Fmt::Ggml(BF16),
        (1024, 2048, 128256),
        900,
        None,
        TOL_BF16,
    );
    let w = make_weight(&mut rng, Fmt::Ggml(F32), 10, 8, 1.0);
    let h = be.upload(&rng.tensor(&[2, 8], 1.0)).unwrap();
    assert!(
        be.lm_head_logprobs(&h, &w, &[1, 10], None, None).is_err(),
        "target outside V"
    );
    assert!(
        be.lm_head_logprobs(&h, &w, &[1], None, None).is_err(),
        "targets per row"
    );
}

#[path = "cuda_train/bench.rs"]
mod bench;
