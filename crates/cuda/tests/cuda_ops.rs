//! The CUDA ops against the CPU reference (`CpuBackend::REFERENCE`, `QTensor::matmul`).
//!
//! Every test draws fresh random inputs (the seed is printed, and `HF2Q_TEST_SEED` replays
//! one), poisons each output with NaN before the op, and checks that every element was written.
//! Without a GPU each device test prints "skipped: no CUDA device" and passes; the NVRTC tests
//! (kernels compile, errors name file and line) need only the NVRTC library.
//!
//! `HF2Q_CUDA_BENCH=1` also runs `bench_ops`, which prints timings and bandwidths (`=matvec`:
//! the one-token products only, `=gemm`: the prefill products and attention only).

use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use hf2q_cpu::CpuBackend;
use hf2q_cuda::{CudaDev, CudaSlice, DeviceKvCache, KvDtype};
use hf2q_tensor::op::{AttentionParams, Backend, LayerCache, RopeParams, RopeStyle};
use hf2q_tensor::quant::{self, mlx::AffineParams};
use hf2q_tensor::{Bytes, GgmlType, QTensor, Tensor};

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

/// The options the binary would open the device with in this environment (the kernel cache,
/// `$HF2Q_CUDA_OPT`).
fn options() -> hf2q_cuda::CudaOptions {
    hf2q_cuda::CudaOptions::from_environment(|k| std::env::var_os(k)).unwrap()
}

fn device() -> Option<Arc<CudaDev>> {
    static DEV: OnceLock<Option<Arc<CudaDev>>> = OnceLock::new();
    let d = DEV
        .get_or_init(|| match CudaDev::open(0, &options()) {
            Ok(d) => {
                if let Some(d) = &d {
                    // Q4_K and Q6_K re-laid whatever their size (in a model only large
                    // matrices are); the tests that cover them also run them as stored
                    // (`with_layouts`).
                    set_layouts(d, hf2q_cuda::MvMode::All);
                    let i = d.info();
                    println!(
                        "device: {} (sm_{}{}, {} SMs, {:.1} GiB, driver {})",
                        i.name,
                        i.compute_capability.0,
                        i.compute_capability.1,
                        i.multiprocessors,
                        i.total_memory as f64 / (1u64 << 30) as f64,
                        i.driver_version
                    );
                }
                d
            }
            Err(e) => panic!("a CUDA device is present but could not be opened: {e}"),
        })
        .clone();
    if d.is_none() {
        println!("skipped: no CUDA device");
    }
    d
}

/// Which Q4_K and Q6_K matrices later uploads re-lay (`All` every one, `Off` none).
fn set_layouts(dev: &CudaDev, m: hf2q_cuda::MvMode) {
    dev.set_q4k_relayout(m);
    dev.set_q6k_relayout(m);
}

/// Each format with the layouts to run it in: re-laid (the tests' default) and, for Q4_K and
/// Q6_K, as stored. The caller sets the layout ([`set_layouts`]) before uploading.
fn with_layouts(fmts: &[Fmt]) -> Vec<(Fmt, hf2q_cuda::MvMode)> {
    let mut v = Vec::new();
    for &f in fmts {
        v.push((f, hf2q_cuda::MvMode::All));
        if matches!(f, Fmt::Ggml(GgmlType::Q4_K | GgmlType::Q6_K)) {
            v.push((f, hf2q_cuda::MvMode::Off));
        }
    }
    v
}

/// SplitMix64: small, seedable, good enough for test data.
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
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A device buffer of `n` NaNs (the poison every output starts as).
fn poisoned(dev: &CudaDev, n: usize) -> CudaSlice<f32> {
    dev.upload(&vec![f32::NAN; n]).unwrap()
}

/// Checks `got` against `want` element-wise with a per-element bound; every element must have
/// been written (no NaN left) and be within `tol(i)`. Returns the max abs error and the relative
/// L2 error.
fn check(what: &str, got: &[f32], want: &[f32], tol: impl Fn(usize) -> f32) -> (f32, f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (mut max_err, mut num, mut den) = (0f32, 0f64, 0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            !g.is_nan(),
            "{what}: element {i} not written (NaN), want {w}"
        );
        let e = (g - w).abs();
        assert!(
            e <= tol(i),
            "{what}: element {i}: got {g}, want {w}, error {e} > tolerance {}",
            tol(i)
        );
        max_err = max_err.max(e);
        num += (e as f64).powi(2);
        den += (w as f64).powi(2);
    }
    let rel = if den > 0.0 {
        (num / den).sqrt() as f32
    } else {
        0.0
    };
    println!("  {what}: max abs err {max_err:.3e}, rel L2 err {rel:.3e}");
    (max_err, rel)
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

// ---------------------------------------------------------------------------------------------
// Weights of every format
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Fmt {
    Ggml(GgmlType),
    Mlx(u32, usize),
}

const GGML_TYPES: [GgmlType; 14] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

fn all_formats() -> Vec<Fmt> {
    let mut v: Vec<Fmt> = GGML_TYPES.iter().map(|&t| Fmt::Ggml(t)).collect();
    for bits in [2, 3, 4, 5, 6, 8] {
        v.push(Fmt::Mlx(bits, 64));
    }
    for g in [32, 128] {
        v.push(Fmt::Mlx(4, g));
        v.push(Fmt::Mlx(8, g));
    }
    v
}

/// Awkward column counts the format allows: not a multiple of 256 where blocks are 32, not a
/// multiple of 8 for dense types (the unaligned kernel path), a multiple of 256 for k-quants.
fn cols_for(f: Fmt) -> Vec<usize> {
    match f {
        Fmt::Ggml(t) if t.block_size() == 256 => vec![256, 768],
        Fmt::Ggml(t) if t.block_size() == 32 => vec![96, 544],
        Fmt::Ggml(_) => vec![100, 264],
        Fmt::Mlx(_, g) => vec![g * 3, 512],
    }
}

fn make_weight(rng: &mut Rng, f: Fmt, rows: usize, cols: usize) -> QTensor {
    // Rows of different magnitudes, so scales differ between blocks.
    let mut w = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let mag = [0.02f32, 0.1, 0.5, 1.5][r % 4];
        w.extend(rng.vec(cols, mag));
    }
    match f {
        Fmt::Ggml(ty) => {
            let rb = ty.row_bytes(cols).unwrap();
            let mut bytes = vec![0u8; rows * rb];
            for (src, dst) in w.chunks(cols).zip(bytes.chunks_mut(rb)) {
                quant::quantize(ty, src, dst).unwrap();
            }
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

// ---------------------------------------------------------------------------------------------
// Ops
// ---------------------------------------------------------------------------------------------

#[test]
fn embedding_every_format() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("embedding");
    for (f, layout) in with_layouts(&all_formats()) {
        set_layouts(&dev, layout);
        let cols = cols_for(f)[0];
        let vocab = 37;
        let w = make_weight(&mut rng, f, vocab, cols);
        let dw = dev.upload_weight(&w).unwrap();
        let t = 6;
        let mut ids: Vec<u32> = (0..t).map(|_| rng.below(vocab) as u32).collect();
        ids[1] = ids[0]; // a repeated id
        ids[t - 1] = vocab as u32 - 1; // the last row
        let scale = if matches!(f, Fmt::Mlx(..)) { 1.0 } else { 0.37 };
        let ids_d = dev.upload(&ids).unwrap();
        let mut out = poisoned(&dev, t * cols);
        dev.embedding(&dw, &ids_d, t, scale, &mut out).unwrap();
        let got = dev.download(&out).unwrap();
        let want = CpuBackend::REFERENCE.embedding(&w, &ids, scale).unwrap();
        // The device dequantizers do the reference's float operations in the same order without
        // fused multiply-adds, so values agree to the last bit.
        check(
            &format!("embedding {f:?} ({layout:?}) {vocab}x{cols}"),
            &got,
            want.data(),
            |_| 0.0,
        );
    }
}

/// Reference `x · Wᵀ + b` and, per output, Σ_k |w x| (the scale of the rounding error).
fn reference_linear(
    w: &QTensor,
    x: &[f32],
    t: usize,
    bias: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![0f32; t * w.rows];
    w.matmul(x, t, &mut out).unwrap();
    let wf = w.to_f32().unwrap();
    let mut mag = vec![0f32; t * w.rows];
    for ti in 0..t {
        for r in 0..w.rows {
            let xr = &x[ti * w.cols..(ti + 1) * w.cols];
            let wr = &wf[r * w.cols..(r + 1) * w.cols];
            mag[ti * w.rows + r] = xr.iter().zip(wr).map(|(a, b)| (a * b).abs()).sum();
            if let Some(b) = bias {
                out[ti * w.rows + r] += b[r];
            }
        }
    }
    (out, mag)
}

/// Per output row, the most that quantizing `x` in two 8-bit terms per 32 elements
/// (`matvec_q8.cuh`: each element moves by at most max|x_block| / 64516) can move `x · Wᵀ`:
/// the sum over blocks of that times sum |w| in the block, with 5 % for the rounding of the
/// scales and of the remainder.
fn act8_bound(w: &QTensor, x: &[f32]) -> Vec<f32> {
    act_rounding_bound(&w.to_f32().unwrap(), w.cols, x, 64516.0)
}

/// For each of the `x.len() / cols` rows of `x` and each row of the dequantized weight `wf`
/// (rows x cols), the sum over 32-element blocks of max|x_block| / `per` times sum |w| in the
/// block, plus 5 % (for the rounding of the scales and of the remainder), token-major.
fn act_rounding_bound(wf: &[f32], cols: usize, x: &[f32], per: f32) -> Vec<f32> {
    let amax: Vec<f32> = x
        .chunks(32)
        .map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs())))
        .collect();
    let wsum: Vec<f32> = wf
        .chunks(32)
        .map(|b| b.iter().map(|v| v.abs()).sum())
        .collect();
    let nb = cols / 32;
    let mut out = Vec::new();
    for xa in amax.chunks(nb) {
        for ws in wsum.chunks(nb) {
            let s: f32 = xa.iter().zip(ws).map(|(a, w)| a / per * w).sum();
            out.push(1.05 * s);
        }
    }
    out
}

fn run_linear(
    dev: &CudaDev,
    rng: &mut Rng,
    f: Fmt,
    rows: usize,
    cols: usize,
    t: usize,
    with_bias: bool,
) {
    let w = make_weight(rng, f, rows, cols);
    let dw = dev.upload_weight(&w).unwrap();
    let x = rng.vec(t * cols, 2.0);
    let bias = with_bias.then(|| rng.vec(rows, 1.0));
    let xd = dev.upload(&x).unwrap();
    let bd = bias.as_ref().map(|b| dev.upload(b).unwrap());
    let (want, mag) = reference_linear(&w, &x, t, bias.as_deref());
    // t <= 8: f32 products and sums in another order than the reference (and fused on the
    // device): well under 1e-5 of Σ|w x| for these lengths. t > 8: tensor cores on f16-rounded
    // operands (each product off by at most ~2 * 2^-11 relative) with f32 sums, in our tiled
    // kernel or in cuBLAS (same operand rounding): 1e-3 of Σ|w x| bounds it.
    // The integer prefill kernel (`mmq.cuh`, for the formats that have it): exact integer
    // products of the weights' codes with the activations rounded to two 8-bit parts per 32
    // (each element off by at most max|x_block| / 65024, or / 32512 where the second part's
    // code is clamped at 127), f32 sums in another order (1e-5 as for the one-token kernels).
    // cuBLAS on f16 pairs: each operand as hi + lo, off by at most 2^-22 relative, or 2^-25
    // absolute where lo falls among the f16 subnormals (under 2^-14), the dropped lo·lo term
    // 2^-22 relative, f32 sums: 1e-5 of Σ|w x| plus 2^-25 Σ|x| for the weights' subnormal
    // remainders (the activations', 2^-25 Σ|w|, is far inside 1e-5 Σ|w x| at |x| ~ 1), and
    // 1e-5 absolute, bounds it.
    let rel = if t <= 8 { 1e-5 } else { 1.2e-3 };
    let xsum: Vec<f32> = x
        .chunks(cols)
        .map(|r| r.iter().map(|v| v.abs()).sum())
        .collect();
    let gemms: &[hf2q_cuda::PrefillGemm] = if t <= 8 {
        &[hf2q_cuda::PrefillGemm::Pairs]
    } else {
        &[
            hf2q_cuda::PrefillGemm::Tiled,
            hf2q_cuda::PrefillGemm::F16,
            hf2q_cuda::PrefillGemm::Int8,
            hf2q_cuda::PrefillGemm::Pairs,
        ]
    };
    let blas = dev.blas_available() && cols.is_multiple_of(8);
    for &g in gemms {
        dev.set_prefill_gemm(g);
        let int8 = t > 8 && dev.int8_prefill(&dw);
        // Every upload of these formats (whole matrices, widths a multiple of 32) has the
        // integer kernel, in either layout.
        let has_int8 = matches!(
            f,
            Fmt::Ggml(GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q6_K)
        );
        if t > 8 && g == hf2q_cuda::PrefillGemm::Int8 {
            assert_eq!(
                int8, has_int8,
                "{f:?} {rows}x{cols}: integer prefill kernel"
            );
        }
        // Pairs, and the integer setting's fallback for formats without the integer kernel.
        let pairs = t > 8
            && blas
            && (g == hf2q_cuda::PrefillGemm::Pairs || (g == hf2q_cuda::PrefillGemm::Int8 && !int8));
        let act = if int8 {
            act_rounding_bound(&w.to_f32().unwrap(), cols, &x, 32512.0)
        } else {
            Vec::new()
        };
        let mut out = poisoned(dev, t * rows);
        dev.linear(&xd, t, &dw, bd.as_ref(), &mut out).unwrap();
        let got = dev.download(&out).unwrap();
        let path = match g {
            _ if t <= 8 => "matvec",
            hf2q_cuda::PrefillGemm::Tiled => "tiled",
            hf2q_cuda::PrefillGemm::F16 => "f16",
            hf2q_cuda::PrefillGemm::Int8 if int8 => "int8",
            // Without cuBLAS (or with C % 8 != 0) pairs and f16 run the tiled kernel, and are
            // checked as such.
            hf2q_cuda::PrefillGemm::Int8 | hf2q_cuda::PrefillGemm::Pairs if pairs => "pairs",
            hf2q_cuda::PrefillGemm::Int8 => "no integer kernel, no cuBLAS",
            hf2q_cuda::PrefillGemm::Pairs => "pairs, no cuBLAS",
        };
        check(
            &format!("linear {f:?} {rows}x{cols} T={t} bias={with_bias} ({path})"),
            &got,
            &want,
            |i| {
                if int8 {
                    1e-5 * mag[i] + 1e-5 + act[i]
                } else if pairs {
                    1e-5 * mag[i] + 1e-5 + xsum[i / rows] / (1u32 << 25) as f32
                } else {
                    rel * mag[i] + if t <= 8 { 1e-5 } else { 1e-4 }
                }
            },
        );
    }
    dev.set_prefill_gemm(hf2q_cuda::PrefillGemm::default());
}

#[test]
fn linear_every_format_decode_and_prefill() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("linear");
    // Every prefill path at T = 9 too (the small-batch kernels have their own test below).
    dev.set_batch_tc(0);
    for (f, layout) in with_layouts(&all_formats()) {
        set_layouts(&dev, layout);
        if layout == hf2q_cuda::MvMode::Off {
            println!("{f:?} as stored");
        }
        for (ci, &cols) in cols_for(f).iter().enumerate() {
            for t in [1, 3, 8, 9, 77] {
                let rows = if ci == 0 { 131 } else { 67 };
                run_linear(&dev, &mut rng, f, rows, cols, t, t % 2 == 1);
            }
        }
    }
    // Several tiles in every direction, a long prefill.
    run_linear(
        &dev,
        &mut rng,
        Fmt::Ggml(GgmlType::Q4_K),
        1000,
        2048,
        300,
        true,
    );
    run_linear(&dev, &mut rng, Fmt::Mlx(4, 64), 333, 1024, 130, false);
    // The cuBLAS path in several weight chunks (the last one short), with a bias.
    println!("cuBLAS present: {}", dev.blas_available());
    dev.set_blas_chunk(64 * 1024);
    run_linear(
        &dev,
        &mut rng,
        Fmt::Ggml(GgmlType::Q8_0),
        700,
        256,
        70,
        true,
    );
    dev.set_blas_chunk(0);
    dev.set_batch_tc(hf2q_cuda::CudaOptions::default().batch_tc);
}

/// The tensor-core small-batch kernels (`linear_tc.cuh`, `batch-tc`): every format and layout,
/// widths that are whole 32-element chunks (from 3 chunks, fewer than a block's warps, to 64),
/// row counts that end inside a 32-row tile, every token-tile width (9..=64 rows, partial last
/// tiles), with and without a bias. Against the f32 reference with the budget of the prefill
/// path on f16 pairs, whose numerics the kernel shares (`run_linear` derives it): 1e-5 of
/// Σ|w x| plus 2^-25 Σ|x| plus 1e-5 absolute.
#[test]
fn linear_small_batch_tensor_cores() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("linear-tc");
    dev.set_batch_tc(64);
    for (f, layout) in with_layouts(&all_formats()) {
        set_layouts(&dev, layout);
        let mut widths: Vec<usize> = cols_for(f)
            .into_iter()
            .filter(|c| c.is_multiple_of(32))
            .collect();
        widths.push(2048);
        for (ci, &cols) in widths.iter().enumerate() {
            for (ti, t) in [9usize, 16, 17, 32, 33, 64].into_iter().enumerate() {
                let rows = [131, 67, 32][(ci + ti) % 3];
                let w = make_weight(&mut rng, f, rows, cols);
                let dw = dev.upload_weight(&w).unwrap();
                let x = rng.vec(t * cols, 2.0);
                let bias = (t % 2 == 1).then(|| rng.vec(rows, 1.0));
                let xd = dev.upload(&x).unwrap();
                let bd = bias.as_ref().map(|b| dev.upload(b).unwrap());
                let (want, mag) = reference_linear(&w, &x, t, bias.as_deref());
                let xsum: Vec<f32> = x
                    .chunks(cols)
                    .map(|r| r.iter().map(|v| v.abs()).sum())
                    .collect();
                let mut out = poisoned(&dev, t * rows);
                dev.linear(&xd, t, &dw, bd.as_ref(), &mut out).unwrap();
                let got = dev.download(&out).unwrap();
                check(
                    &format!(
                        "linear {f:?} ({layout:?}) {rows}x{cols} T={t} (tensor-core small batch)"
                    ),
                    &got,
                    &want,
                    |i| 1e-5 * mag[i] + 1e-5 + xsum[i / rows] / (1u32 << 25) as f32,
                );
            }
        }
    }
    set_layouts(&dev, hf2q_cuda::MvMode::All);
    dev.set_batch_tc(hf2q_cuda::CudaOptions::default().batch_tc);
}

/// The one-token kernels of matvec.cuh (split Q4_0 / Q8_0, Q4_K, padded Q6_K, and dense rows
/// whose width is a multiple of 32) and the fusions built on them, through the backend: q/k/v in
/// one launch (with a bias), a product added to a residual, gate and up with the activation, and
/// q/k/v and gate/up of an RMSNorm of the input (the norm folded into the persistent kernels,
/// a norm kernel then the product elsewhere). Widths from one block per row (most lanes idle)
/// to 4096 (four warps per row group), rows from 1 to 600 (edge row groups).
#[test]
fn fast_matvec_and_fusions() {
    use hf2q_cuda::backend::CudaBackend;
    use hf2q_tensor::op::{GateAct, PreNorm};
    let Some(dev) = device() else { return };
    let cpu = &CpuBackend::REFERENCE;
    let mut rng = Rng::new("fast_matvec");
    let fmts = [
        Fmt::Ggml(GgmlType::Q4_0),
        Fmt::Ggml(GgmlType::Q8_0),
        Fmt::Ggml(GgmlType::Q4_K),
        Fmt::Ggml(GgmlType::Q6_K),
        Fmt::Ggml(GgmlType::F16),
        Fmt::Ggml(GgmlType::BF16),
        Fmt::Ggml(GgmlType::F32),
    ];
    // f32 sums in another order than the reference (two chains per block, the block scale
    // applied to the block's sum, fused multiply-adds): well under 1e-5 of sum |w x|; with
    // 8-bit activations, plus the activations' rounding (`act8_bound`).
    let tol = |mag: &[f32], q8: &[f32]| {
        let (m, q) = (mag.to_vec(), q8.to_vec());
        move |i: usize| 1e-5 * m[i] + 1e-5 + q[i]
    };
    // Every kind of one-token kernel: 8-bit activations staged per block (`matvec_q8.cuh`),
    // f32 ones (`matvec.cuh`), and the persistent 8-bit kernels (`matvec_p8.cuh`, one block
    // per multiprocessor so that the 9001-row cases give warps several row groups, across the
    // fused jobs' boundaries).
    for kind in ["q8", "f32", "p8"] {
        dev.set_matvec_int8(if kind == "q8" {
            hf2q_cuda::MvMode::All
        } else {
            hf2q_cuda::MvMode::Off
        });
        let p8 = if kind == "p8" {
            hf2q_cuda::MvMode::All
        } else {
            hf2q_cuda::MvMode::Off
        };
        dev.set_matvec_persistent(p8, 1);
        for (f, layout) in with_layouts(&fmts) {
            set_layouts(&dev, layout);
            if layout == hf2q_cuda::MvMode::Off {
                println!("{f:?} as stored");
            }
            // Whether the kind's kernels exist for the format in this layout (the 8-bit ones
            // for Q4_K and Q6_K as stored, the persistent ones for Q6_K re-laid), else the
            // launch takes the f32 kernels and is held to their bound.
            let stored = layout == hf2q_cuda::MvMode::Off;
            let q8fmt = match (kind, f) {
                ("q8", Fmt::Ggml(GgmlType::Q4_0 | GgmlType::Q8_0)) => true,
                ("q8", Fmt::Ggml(GgmlType::Q4_K | GgmlType::Q6_K)) => stored,
                ("p8", Fmt::Ggml(GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q4_K)) => true,
                ("p8", Fmt::Ggml(GgmlType::Q6_K)) => !stored,
                _ => false,
            };
            let bound8 = |w: &QTensor, x: &[f32]| {
                if q8fmt {
                    act8_bound(w, x)
                } else {
                    vec![0.0; w.rows]
                }
            };
            let shapes = match f {
                Fmt::Ggml(t) if t.block_size() == 256 => [
                    (256, 3),
                    (768, 131),
                    (2304, 600),
                    (4096, 67),
                    (4096, 1),
                    (256, 9001),
                ],
                _ => [
                    (32, 3),
                    (96, 131),
                    (2080, 600),
                    (4096, 67),
                    (4096, 1),
                    (64, 9001),
                ],
            };
            for (cols, rows) in shapes {
                // A backend per case: it keys uploaded weights and biases by host address, and a
                // dropped case's buffers may come back at the same address.
                let be = CudaBackend::new(dev.clone(), KvDtype::F16).unwrap();
                let x = rng.vec(cols, 2.0);
                let xt = Tensor::new(&[1, cols], x.clone()).unwrap();
                let xd = be.upload(&xt).unwrap();
                let ws: Vec<QTensor> = (0..3)
                    .map(|i| make_weight(&mut rng, f, rows + 7 * i, cols))
                    .collect();
                let bias = rng.vec(rows + 7, 1.0);
                // One launch per fused call: the fast kernels ran, not the composed fallback.
                let launches = || dev.counters().launches;
                // q, k, v: one launch, the second with a bias.
                let l0 = launches();
                let outs = be
                    .linear_many(
                        &xd,
                        &[(&ws[0], None), (&ws[1], Some(&bias)), (&ws[2], None)],
                    )
                    .unwrap();
                assert_eq!(launches() - l0, 1, "linear_many {f:?}: one launch");
                for (i, o) in outs.iter().enumerate() {
                    let b = (i == 1).then_some(&bias[..]);
                    let (want, mag) = reference_linear(&ws[i], &x, 1, b);
                    let got = be.to_host(o).unwrap();
                    check(
                        &format!("linear_many[{i}] {f:?} {}x{cols} {kind}", ws[i].rows),
                        got.data(),
                        &want,
                        tol(&mag, &bound8(&ws[i], &x)),
                    );
                }
                // residual += x W^T
                let res = rng.vec(rows, 3.0);
                let mut rd = be
                    .upload(&Tensor::new(&[1, rows], res.clone()).unwrap())
                    .unwrap();
                let l0 = launches();
                be.linear_add(&xd, &ws[0], &mut rd).unwrap();
                assert_eq!(launches() - l0, 1, "linear_add {f:?}: one launch");
                let (y, mag) = reference_linear(&ws[0], &x, 1, None);
                let want: Vec<f32> = res.iter().zip(&y).map(|(a, b)| a + b).collect();
                check(
                    &format!("linear_add {f:?} {rows}x{cols} {kind}"),
                    be.to_host(&rd).unwrap().data(),
                    &want,
                    tol(&mag, &bound8(&ws[0], &x)),
                );
                // act(x G^T) * (x U^T)
                let up = make_weight(&mut rng, f, rows, cols);
                // An error e_g in the gate moves act(g) * u by at most ~1.1 |u| e_g (both
                // activations' slopes stay under 1.13), an error e_u by |act(g)| e_u.
                let gated_bound = |x: &[f32]| -> Vec<f32> {
                    let (g, gm) = reference_linear(&ws[0], x, 1, None);
                    let (u, um) = reference_linear(&up, x, 1, None);
                    let (g8, u8b) = (bound8(&ws[0], x), bound8(&up, x));
                    (0..rows)
                        .map(|i| {
                            let (eg, eu) =
                                (1e-5 * gm[i] + 1e-5 + g8[i], 1e-5 * um[i] + 1e-5 + u8b[i]);
                            1.2 * u[i].abs() * eg + (g[i].abs() + 0.3) * eu + 1e-6
                        })
                        .collect()
                };
                for act in [GateAct::Silu, GateAct::GeluTanh] {
                    let l0 = launches();
                    let got = be.linear_gated(&xd, &ws[0], &up, act).unwrap();
                    assert_eq!(launches() - l0, 1, "linear_gated {f:?}: one launch");
                    let want = cpu.linear_gated(&xt, &ws[0], &up, act).unwrap();
                    let bound = gated_bound(&x);
                    check(
                        &format!("linear_gated {act:?} {f:?} {rows}x{cols} {kind}"),
                        be.to_host(&got).unwrap().data(),
                        want.data(),
                        |i| bound[i],
                    );
                }
                // The same two of the input's RMSNorm (a pre-norm block's q/k/v and gate/up),
                // against the CPU's RMSNorm then the product: one launch each where the
                // persistent kernels fold the norm in, a norm kernel and the product elsewhere.
                // The norm's own rounding (f32 sums, ~1e-7 relative) is far inside these bounds;
                // the 8-bit kernels quantize x * (w + offset), whose rounding scaled by
                // 1 / rms(x) is that of the normalized row (the bound computed from it).
                let norm_launches = if kind == "p8" && q8fmt { 1 } else { 2 };
                let nw = rng.vec(cols, 1.0);
                let offset = if rows % 2 == 1 { 1.0 } else { 0.0 };
                let norm = PreNorm {
                    w: &nw,
                    eps: 1e-6,
                    offset,
                };
                let ht = cpu.rms_norm(&xt, &nw, 1e-6, offset).unwrap();
                let h = ht.data().to_vec();
                let l0 = launches();
                let outs = be
                    .norm_linear_many(
                        &xd,
                        norm,
                        &[(&ws[0], None), (&ws[1], Some(&bias)), (&ws[2], None)],
                    )
                    .unwrap();
                assert_eq!(
                    launches() - l0,
                    norm_launches,
                    "norm_linear_many {f:?} {kind}"
                );
                for (i, o) in outs.iter().enumerate() {
                    let b = (i == 1).then_some(&bias[..]);
                    let (want, mag) = reference_linear(&ws[i], &h, 1, b);
                    check(
                        &format!("norm_linear_many[{i}] {f:?} {}x{cols} {kind}", ws[i].rows),
                        be.to_host(o).unwrap().data(),
                        &want,
                        tol(&mag, &bound8(&ws[i], &h)),
                    );
                }
                let l0 = launches();
                let got = be
                    .norm_linear_gated(&xd, norm, &ws[0], &up, GateAct::Silu)
                    .unwrap();
                assert_eq!(
                    launches() - l0,
                    norm_launches,
                    "norm_linear_gated {f:?} {kind}"
                );
                let want = cpu.linear_gated(&ht, &ws[0], &up, GateAct::Silu).unwrap();
                let bound = gated_bound(&h);
                check(
                    &format!("norm_linear_gated {f:?} {rows}x{cols} {kind}"),
                    be.to_host(&got).unwrap().data(),
                    want.data(),
                    |i| bound[i],
                );
            }
        }
    }
    dev.set_matvec_int8(hf2q_cuda::MvMode::Auto);
    dev.set_matvec_persistent(hf2q_cuda::MvMode::Auto, 2);
    set_layouts(&dev, hf2q_cuda::MvMode::All);
}

#[test]
fn rms_norm_matches() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("rms_norm");
    for (rows, cols, offset) in [
        (1, 64, 0.0f32),
        (5, 1000, 1.0),
        (7, 2048, 0.0),
        (3, 2049, 1.0),
        // One pass in registers up to 8192 columns (a multiple of 4), a loop past it.
        (1, 4096, 0.0),
        (2, 8192, 1.0),
        (1, 8196, 0.0),
        (2, 36, 0.0),
    ] {
        let x = rng.vec(rows * cols, 3.0);
        let w = rng.vec(cols, 1.0);
        let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        let mut out = poisoned(&dev, rows * cols);
        dev.rms_norm(&xd, &wd, rows, cols, 1e-6, offset, &mut out)
            .unwrap();
        let got = dev.download(&out).unwrap();
        let xt = Tensor::new(&[rows, cols], x).unwrap();
        let want = CpuBackend::REFERENCE
            .rms_norm(&xt, &w, 1e-6, offset)
            .unwrap();
        let m = max_abs(want.data());
        // The sum of squares is reduced in another order: a few f32 ulps of the result.
        check(
            &format!("rms_norm {rows}x{cols} offset {offset}"),
            &got,
            want.data(),
            |_| 4e-6 * m,
        );
    }
}

#[test]
fn rope_both_styles() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("rope");
    for (style, dh, dims, nh, t, pos0, scale, factors) in [
        (RopeStyle::Neox, 64, 64, 3, 7, 0usize, 1.0f32, false),
        (RopeStyle::Interleaved, 64, 64, 5, 1, 1234, 1.0, false),
        (RopeStyle::Neox, 128, 128, 2, 33, 4000, 2.0, true),
        (RopeStyle::Interleaved, 128, 64, 4, 9, 77, 1.0, true),
        (RopeStyle::Neox, 256, 256, 1, 5, 30000, 8.0, false),
        // A layer without RoPE (SmolLM3's every fourth): nothing rotates.
        (RopeStyle::Neox, 64, 0, 2, 3, 9, 1.0, false),
    ] {
        let p = RopeParams {
            style,
            theta: if dh == 256 { 1_000_000.0 } else { 10000.0 },
            dims,
            freq_factors: factors.then(|| (0..dims / 2).map(|i| 1.0 + (i % 5) as f32).collect()),
            linear_scale: scale,
        };
        let x = rng.vec(t * nh * dh, 2.0);
        let table = dev.rope_table(&p).unwrap();
        let mut xd = dev.upload(&x).unwrap();
        let pos = dev.upload(&[pos0 as i32]).unwrap();
        dev.rope(&mut xd, t, nh, dh, &pos, &table).unwrap();
        let got = dev.download(&xd).unwrap();
        let mut want = Tensor::new(&[t, nh * dh], x).unwrap();
        CpuBackend::REFERENCE.rope(&mut want, nh, pos0, &p).unwrap();
        // Same f32 angle on both sides; sin/cos of it to within a couple of ulps, and the two
        // products may be fused on the device.
        let m = max_abs(want.data());
        check(
            &format!("rope {style:?} dh {dh} dims {dims} T={t} pos0 {pos0} scale {scale}"),
            &got,
            want.data(),
            |_| 2e-6 * m,
        );
    }
}

/// The fused RoPE + cache write gives what rope, rope and kv_write give one after the other
/// (the same arithmetic), for both styles, partial rotary, both cache types, and
/// positions past the capacity dropped.
#[test]
fn rope_store_equals_the_three_ops() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("rope_store");
    for (style, dh, dims, nh, hkv, t, pos0, cap, dtype) in [
        (
            RopeStyle::Neox,
            64,
            64,
            4,
            2,
            1,
            17usize,
            64usize,
            KvDtype::F16,
        ),
        // No RoPE on this layer: q unchanged, k and v only stored.
        (
            RopeStyle::Neox,
            64,
            0,
            4,
            2,
            3,
            5usize,
            64usize,
            KvDtype::F16,
        ),
        (
            RopeStyle::Interleaved,
            128,
            64,
            6,
            2,
            9,
            3,
            40,
            KvDtype::F32,
        ),
        (RopeStyle::Neox, 128, 96, 8, 8, 5, 60, 62, KvDtype::F16),
    ] {
        let p = RopeParams {
            style,
            theta: 10000.0,
            dims,
            freq_factors: None,
            linear_scale: 1.0,
        };
        let table = dev.rope_table(&p).unwrap();
        let pos = dev.upload(&[pos0 as i32]).unwrap();
        let (q, k, v) = (
            rng.vec(t * nh * dh, 2.0),
            rng.vec(t * hkv * dh, 2.0),
            rng.vec(t * hkv * dh, 2.0),
        );
        let (kd, vd) = (dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
        // Three ops.
        let mut q1 = dev.upload(&q).unwrap();
        let mut k1 = dev.upload(&k).unwrap();
        let mut c1 = dev.alloc_kv_cache(hkv, cap, dh, dtype).unwrap();
        dev.rope(&mut q1, t, nh, dh, &pos, &table).unwrap();
        dev.rope(&mut k1, t, hkv, dh, &pos, &table).unwrap();
        dev.kv_write(&mut c1, &k1, &vd, t, &pos).unwrap();
        // One.
        let mut q2 = dev.upload(&q).unwrap();
        let mut c2 = dev.alloc_kv_cache(hkv, cap, dh, dtype).unwrap();
        dev.rope_store(&mut q2, &kd, &vd, t, nh, &mut c2, &pos, &table)
            .unwrap();
        let what = format!("rope_store {style:?} dh {dh} dims {dims} T={t} pos0 {pos0} cap {cap}");
        // Same expressions as the separate kernels; allow for the compiler fusing a product
        // differently (an ulp of f32, then possibly an ulp of the f16 cache).
        let (g, w) = (dev.download(&q2).unwrap(), dev.download(&q1).unwrap());
        let m = max_abs(&w);
        check(&format!("{what}: q"), &g, &w, |_| 2e-6 * m);
        let ((gk, gv), (wk, wv)) = (c2.to_host(&dev).unwrap(), c1.to_host(&dev).unwrap());
        let tol = if dtype == KvDtype::F16 { 1e-3 } else { 2e-6 } * max_abs(&wk);
        check(&format!("{what}: cached k"), &gk, &wk, |_| tol);
        check(&format!("{what}: cached v"), &gv, &wv, |_| 0.0);
        assert_eq!(dev.download(&kd).unwrap(), k, "{what}: k is left as it was");
    }
}

#[test]
fn elementwise_ops() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("elementwise");
    for n in [1usize, 1000, 4097] {
        let g = rng.vec(n, 8.0);
        let u = rng.vec(n, 2.0);
        let (gd, ud) = (dev.upload(&g).unwrap(), dev.upload(&u).unwrap());
        let gt = Tensor::new(&[n], g.clone()).unwrap();
        let ut = Tensor::new(&[n], u.clone()).unwrap();
        // expf / tanhf against Rust's exp / tanh: a couple of f32 ulps of the result.
        let mut out = poisoned(&dev, n);
        dev.silu_mul(&gd, &ud, n, &mut out).unwrap();
        let want = CpuBackend::REFERENCE.silu_mul(&gt, &ut).unwrap();
        check(
            &format!("silu_mul n={n}"),
            &dev.download(&out).unwrap(),
            want.data(),
            |i| 1e-6 * want.data()[i].abs() + 1e-7,
        );
        let mut out = poisoned(&dev, n);
        dev.gelu_tanh_mul(&gd, &ud, n, &mut out).unwrap();
        let want = CpuBackend::REFERENCE.gelu_tanh_mul(&gt, &ut).unwrap();
        check(
            &format!("gelu_tanh_mul n={n}"),
            &dev.download(&out).unwrap(),
            want.data(),
            |i| 1e-6 * want.data()[i].abs() + 2e-6,
        );
        let mut xd = dev.upload(&g).unwrap();
        dev.add_assign(&mut xd, &ud, n).unwrap();
        let mut want = gt.clone();
        CpuBackend::REFERENCE.add_assign(&mut want, &ut).unwrap();
        // One f32 addition each: exact.
        check(
            &format!("add_assign n={n}"),
            &dev.download(&xd).unwrap(),
            want.data(),
            |_| 0.0,
        );
    }
}

#[test]
fn argmax_rows_follow_the_sampler_rule() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("argmax");
    let (rows, cols) = (6, 151_936);
    let mut x = rng.vec(rows * cols, 10.0);
    // Row 1: a tie between two maxima (the first wins). Row 2: NaNs everywhere but one value.
    // Row 3: all NaN (-> 0). Row 4: all -inf (-> 0). Row 5: the max is the last element.
    x[cols + 100] = 50.0;
    x[cols + 90_000] = 50.0;
    for v in &mut x[2 * cols..3 * cols] {
        *v = f32::NAN;
    }
    x[2 * cols + 7777] = -3.0;
    for v in &mut x[3 * cols..4 * cols] {
        *v = f32::NAN;
    }
    for v in &mut x[4 * cols..5 * cols] {
        *v = f32::NEG_INFINITY;
    }
    x[6 * cols - 1] = 99.0;
    let want: Vec<u32> = x.chunks(cols).map(argmax_ref).collect();
    let xd = dev.upload(&x).unwrap();
    let mut out = dev.upload(&vec![u32::MAX; rows]).unwrap();
    dev.argmax(&xd, rows, cols, &mut out).unwrap();
    let got = dev.download(&out).unwrap();
    assert_eq!(got, want);
    assert_eq!(&want[1..5], &[100, 7777, 0, 0]);
    println!("  argmax {rows}x{cols}: {got:?}");
    // Widths that are not a multiple of four (the element-wise path), one with a tie.
    for cols in [1001usize, 7] {
        let mut x = rng.vec(3 * cols, 10.0);
        x[cols + 2] = 11.0;
        x[cols + cols - 1] = 11.0;
        let want: Vec<u32> = x.chunks(cols).map(argmax_ref).collect();
        let xd = dev.upload(&x).unwrap();
        let mut out = dev.upload(&[u32::MAX; 3]).unwrap();
        dev.argmax(&xd, 3, cols, &mut out).unwrap();
        assert_eq!(dev.download(&out).unwrap(), want, "argmax 3x{cols}");
    }
    // More rows than one launch takes (partials for 64 rows), with -0 before +0 (a tie).
    let (rows, cols) = (70, 1000);
    let mut x = rng.vec(rows * cols, 10.0);
    x[5 * cols + 10] = 20.0;
    x[5 * cols + 20] = 20.0;
    for v in &mut x[69 * cols..] {
        *v = -1.0;
    }
    x[69 * cols + 3] = -0.0;
    x[69 * cols + 4] = 0.0;
    let want: Vec<u32> = x.chunks(cols).map(argmax_ref).collect();
    assert_eq!((want[5], want[69]), (10, 3));
    let xd = dev.upload(&x).unwrap();
    let mut out = dev.upload(&vec![u32::MAX; rows]).unwrap();
    dev.argmax(&xd, rows, cols, &mut out).unwrap();
    assert_eq!(dev.download(&out).unwrap(), want, "argmax {rows}x{cols}");
}

/// The CPU sampler's greedy rule (first on ties, NaN ignored, 0 when nothing found).
fn argmax_ref(row: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

// ---------------------------------------------------------------------------------------------
// KV cache and attention
// ---------------------------------------------------------------------------------------------

struct AttnCase {
    h: usize,
    hkv: usize,
    dh: usize,
    cap: usize,
    pos0: usize,
    t: usize,
    window: Option<usize>,
    dtype: KvDtype,
    /// Random per-head sink logits (GPT-OSS).
    sinks: bool,
}

fn run_attention(dev: &CudaDev, rng: &mut Rng, c: &AttnCase) {
    let width = c.hkv * c.dh;
    let total = c.pos0 + c.t;
    let k = rng.vec(total * width, 1.0);
    let v = rng.vec(total * width, 1.0);
    let mut cache: DeviceKvCache = dev.alloc_kv_cache(c.hkv, c.cap, c.dh, c.dtype).unwrap();
    // History first (as a prefill would), then this call's tokens at pos0.
    let (kd, vd) = (dev.upload(&k).unwrap(), dev.upload(&v).unwrap());
    let zero = dev.upload(&[0i32]).unwrap();
    let pos = dev.upload(&[c.pos0 as i32]).unwrap();
    if c.pos0 > 0 {
        dev.kv_write(&mut cache, &kd, &vd, c.pos0, &zero).unwrap();
    }
    let (kn, vn) = (
        dev.upload(&k[c.pos0 * width..]).unwrap(),
        dev.upload(&v[c.pos0 * width..]).unwrap(),
    );
    dev.kv_write(&mut cache, &kn, &vn, c.t, &pos).unwrap();
    let (kc, vc) = cache.to_host(dev).unwrap();
    // The cache holds exactly the inputs, rounded once to the cache type.
    let round = |x: f32| match c.dtype {
        KvDtype::F16 => half::f16::from_f32(x).to_f32(),
        KvDtype::F32 => x,
    };
    for p in 0..c.cap {
        for hh in 0..c.hkv {
            for d in 0..c.dh {
                let at = (hh * c.cap + p) * c.dh + d;
                let (wk, wv) = if p < total {
                    (
                        round(k[p * width + hh * c.dh + d]),
                        round(v[p * width + hh * c.dh + d]),
                    )
                } else {
                    (0.0, 0.0)
                };
                assert_eq!(
                    (kc[at], vc[at]),
                    (wk, wv),
                    "cache at head {hh} pos {p} dim {d}"
                );
            }
        }
    }
    // Sinks from -3 to 5: some below every score, some above most (the sink then takes most
    // of the row's weight and the output shrinks towards zero).
    let sinks: Option<Arc<[f32]>> = c
        .sinks
        .then(|| rng.vec(c.h, 4.0).iter().map(|s| s + 1.0).collect());
    let p = AttentionParams {
        n_heads: c.h,
        n_kv_heads: c.hkv,
        head_dim: c.dh,
        scale: 1.0 / (c.dh as f32).sqrt(),
        window: c.window,
        sinks: sinks.clone(),
    };
    let q = rng.vec(c.t * c.h * c.dh, 2.0);
    let qd = dev.upload(&q).unwrap();
    let sinks_d = sinks.map(|s| dev.upload(&s).unwrap());
    let mut scratch = poisoned(dev, dev.attention_scratch_len(&p, c.cap).max(1));
    let mut out = poisoned(dev, c.t * c.h * c.dh);
    dev.attention(
        &qd,
        c.t,
        &cache,
        &pos,
        &p,
        &mut scratch,
        &mut out,
        sinks_d.as_ref(),
    )
    .unwrap();
    let got = dev.download(&out).unwrap();
    // Reference over the device cache's own (rounded) values: the comparison measures the
    // attention arithmetic only; f16 rounding of the cache was checked exactly above.
    let lc = LayerCache {
        k: &kc,
        v: &vc,
        capacity: c.cap,
        centre: None,
    };
    let qt = Tensor::new(&[c.t, c.h * c.dh], q).unwrap();
    let want = CpuBackend::REFERENCE
        .attention(&qt, &lc, c.pos0, &p)
        .unwrap();
    // Outputs are convex combinations of |v| <= 1: f32 softmax and sums in another order (split
    // partials, online rescaling) stay within a few 1e-6; 2e-5 leaves room for long rows.
    // The tensor-core prefill (f16 cache, Dh 64 or 128) rounds q·scale and the probabilities to
    // f16 (2^-11 relative each): scores of |q·k|·scale up to ~3 here move by ~1e-3, and so do
    // the weights of the v rows; 4e-3 bounds the output.
    let tc = c.t > 1 && c.dtype == KvDtype::F16 && (c.dh == 64 || c.dh == 128);
    let path = if c.t == 1 {
        "decode"
    } else if tc {
        "prefill, tensor cores"
    } else {
        "prefill"
    };
    check(
        &format!(
            "attention {path} H={} Hkv={} Dh={} cap={} pos0={} T={} window={:?} {:?} sinks={}",
            c.h, c.hkv, c.dh, c.cap, c.pos0, c.t, c.window, c.dtype, c.sinks
        ),
        &got,
        want.data(),
        |_| if tc { 4e-3 } else { 2e-5 },
    );
}

#[test]
fn kv_write_and_attention() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("attention");
    let f16 = KvDtype::F16;
    let f32 = KvDtype::F32;
    let cases = [
        // GQA ratios 1, 3, 4, 8 (and 16: two head chunks in decode); head widths 64..256.
        (4, 4, 64, 256, 0, 1, None, f16),
        (6, 2, 64, 512, 37, 1, None, f16),
        (8, 2, 128, 1024, 700, 1, None, f32),
        (16, 2, 128, 4096, 3000, 1, Some(512), f16),
        (32, 2, 64, 300, 299, 1, None, f16),
        (4, 1, 256, 2048, 1500, 1, Some(1024), f16),
        (8, 8, 80, 128, 5, 1, Some(3), f32),
        (4, 4, 64, 256, 0, 13, None, f16),
        (6, 2, 64, 512, 40, 100, None, f32),
        (8, 1, 256, 1024, 0, 300, Some(64), f16),
        (16, 2, 128, 2048, 500, 257, None, f16),
        (4, 1, 96, 512, 3, 37, Some(20), f16),
        // Tensor-core prefill: several query and key tiles, a window cutting tiles, a chunk
        // after a history, a full 64-query tile.
        (8, 2, 64, 1024, 100, 200, Some(77), f16),
        (32, 8, 128, 600, 0, 512, None, f16),
        (8, 8, 64, 256, 0, 64, None, f16),
        (4, 2, 128, 300, 250, 50, Some(100), f16),
    ];
    for (h, hkv, dh, cap, pos0, t, window, dtype) in cases {
        run_attention(
            &dev,
            &mut rng,
            &AttnCase {
                h,
                hkv,
                dh,
                cap,
                pos0,
                t,
                window,
                dtype,
                sinks: false,
            },
        );
    }
}

/// Attention sinks (GPT-OSS) against the CPU reference on every contiguous-cache path: one-token
/// decode with one and many key splits (the sink joins the merge of the splits), the f32-tile
/// prefill, the tensor-core prefill; GPT-OSS's heads (64 query, 8 kv, 64 wide) with its
/// 128-key window and without, a window shorter than the history, two head chunks in decode.
#[test]
fn attention_sinks() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("attention-sinks");
    let f16 = KvDtype::F16;
    let f32 = KvDtype::F32;
    let cases = [
        // Decode: one split (short cache), many splits, a window inside the history.
        (8, 2, 64, 16, 3, 1, None, f16),
        (64, 8, 64, 2048, 1500, 1, None, f16),
        (64, 8, 64, 2048, 1500, 1, Some(128), f16),
        (16, 1, 128, 1024, 700, 1, Some(100), f32),
        (4, 4, 80, 128, 0, 1, None, f32),
        // Prefill, f32 tiles (f32 cache, or a head width without tensor-core kernels).
        (8, 2, 64, 512, 40, 100, Some(128), f32),
        (6, 2, 96, 256, 0, 37, None, f16),
        // Prefill on tensor cores: GPT-OSS's heads, a chunk after a history, windows.
        (64, 8, 64, 1024, 0, 512, Some(128), f16),
        (64, 8, 64, 1024, 300, 200, None, f16),
        (8, 2, 128, 600, 100, 130, Some(77), f16),
    ];
    for (h, hkv, dh, cap, pos0, t, window, dtype) in cases {
        run_attention(
            &dev,
            &mut rng,
            &AttnCase {
                h,
                hkv,
                dh,
                cap,
                pos0,
                t,
                window,
                dtype,
                sinks: true,
            },
        );
    }
}

/// Head widths over 256 (Gemma 4's global layers: 512), whose kernels take 16 dims per lane and
/// four query heads per decode block: decode and the f32-tile prefill, f16 and f32 caches, GQA
/// ratios that fill one, two and a part of a head chunk, windows, a history before the chunk.
#[test]
fn attention_head_width_512() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("attention512");
    let f16 = KvDtype::F16;
    let f32 = KvDtype::F32;
    let cases = [
        // Decode.
        (8, 1, 512, 256, 0, 1, None, f16),
        (16, 2, 512, 1024, 700, 1, None, f16),
        (8, 1, 512, 2048, 1500, 1, Some(1024), f32),
        (4, 4, 512, 300, 299, 1, Some(37), f16),
        (12, 2, 512, 512, 100, 1, None, f32),
        (8, 2, 384, 512, 20, 1, None, f16),
        (16, 2, 512, 1024, 900, 1, Some(100), f16),
        // Prefill (from two tokens).
        (8, 2, 512, 64, 10, 2, None, f16),
        (8, 1, 512, 256, 0, 40, None, f16),
        (16, 2, 512, 1024, 300, 100, None, f32),
        (8, 2, 512, 600, 0, 257, Some(64), f16),
        (4, 1, 512, 512, 50, 17, None, f32),
        (8, 2, 384, 512, 0, 33, None, f32),
    ];
    for (h, hkv, dh, cap, pos0, t, window, dtype) in cases {
        run_attention(
            &dev,
            &mut rng,
            &AttnCase {
                h,
                hkv,
                dh,
                cap,
                pos0,
                t,
                window,
                dtype,
                sinks: false,
            },
        );
    }
    // Above 256 the width must be a multiple of 16 (a lane's 16 dims), and at most 512.
    for dh in [264, 520] {
        let cache = dev.alloc_kv_cache(1, 16, dh, f16).unwrap();
        let p = AttentionParams {
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: dh,
            scale: 1.0,
            window: None,
            sinks: None,
        };
        let (q, pos) = (
            dev.upload(&vec![0f32; dh]).unwrap(),
            dev.upload(&[0i32]).unwrap(),
        );
        let mut scratch = poisoned(&dev, dev.attention_scratch_len(&p, 16).max(1));
        let mut out = poisoned(&dev, dh);
        let r = dev.attention(&q, 1, &cache, &pos, &p, &mut scratch, &mut out, None);
        assert!(r.is_err(), "head width {dh} was taken");
    }
}

/// Soft capping on the device against the CPU reference: tanhf against Rust's tanh (a couple
/// of f32 ulps of the result), the division and the product rounded alike; infinities go to
/// the cap, NaN stays NaN.
#[test]
fn softcap_matches_the_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("softcap");
    for (n, cap) in [(1usize, 30.0f32), (1000, 30.0), (4097, 50.0), (259, 0.5)] {
        let mut x = rng.vec(n, 4.0 * cap);
        if n > 8 {
            x[..6].copy_from_slice(&[f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1e30, -1e-30]);
        }
        let mut want = Tensor::new(&[n], x.clone()).unwrap();
        CpuBackend::REFERENCE.softcap(&mut want, cap).unwrap();
        let mut xd = dev.upload(&x).unwrap();
        dev.softcap(&mut xd, n, cap).unwrap();
        check(
            &format!("softcap n={n} cap={cap}"),
            &dev.download(&xd).unwrap(),
            want.data(),
            |i| 1e-6 * want.data()[i].abs() + 1e-12,
        );
    }
    let mut xd = dev.upload(&[f32::NAN, 1.0]).unwrap();
    dev.softcap(&mut xd, 2, 30.0).unwrap();
    let got = dev.download(&xd).unwrap();
    assert!(got[0].is_nan() && (got[1] - (1.0f32 / 30.0).tanh() * 30.0).abs() < 1e-6);
}

/// A captured step may soft-cap (a kernel) and upload the same small host tensor an eager step
/// uploaded before (Gemma 4's `[[1]]` of its layer scalars: copied from the device inside the
/// graph); the replay equals the eager step. A host tensor no eager step uploaded refuses the
/// capture as not capturable.
#[test]
fn captured_steps_softcap_and_reuse_uploaded_constants() {
    use hf2q_cuda::backend::{CudaBackend, StepOutput};
    use hf2q_tensor::op::MatmulSpec;
    let Some(dev) = device() else { return };
    let be = CudaBackend::new(dev.clone(), KvDtype::F16).unwrap();
    let mut rng = Rng::new("capture_constants");
    let n = 1000;
    let x = rng.vec(n, 100.0);
    let xd = be
        .upload(&Tensor::new(&[n, 1], x.clone()).unwrap())
        .unwrap();
    let step = || -> Result<Tensor, hf2q_tensor::Error> {
        let one = Backend::upload(&be, &Tensor::new(&[1, 1], vec![1.0])?)?;
        let mut y = be.matmul(&xd, &one, MatmulSpec::NN.scaled(0.75))?;
        be.softcap(&mut y, 30.0)?;
        Ok(y)
    };
    let eager = be.to_host(&step().unwrap()).unwrap();
    let mut want = Tensor::new(&[n, 1], x.iter().map(|v| v * 0.75).collect()).unwrap();
    CpuBackend::REFERENCE.softcap(&mut want, 30.0).unwrap();
    check("eager step", eager.data(), want.data(), |i| {
        1e-6 * want.data()[i].abs() + 1e-12
    });
    let mut g = be.capture(&[0], 0, n, StepOutput::Logits, step).unwrap();
    for _ in 0..2 {
        let got = be.replay(&mut g, &[0], 0).unwrap();
        check("replayed step", got.data(), eager.data(), |i| {
            1e-6 * eager.data()[i].abs() + 1e-12
        });
    }
    let err = be
        .capture(&[0], 0, 2, StepOutput::Logits, || {
            Backend::upload(&be, &Tensor::new(&[2], vec![3.0, 4.0])?)
        })
        .unwrap_err();
    assert!(
        matches!(err, hf2q_tensor::Error::NotCapturable(_)),
        "expected a refusal, got {err}"
    );
    // The backend still works eagerly after the refused capture.
    let again = be.to_host(&step().unwrap()).unwrap();
    assert_eq!(again.data(), eager.data());
}

// ---------------------------------------------------------------------------------------------
// Graph capture
// ---------------------------------------------------------------------------------------------

/// The buffers of a one-layer, one-token decode step.
struct Step {
    emb: hf2q_cuda::DeviceWeight,
    wq: hf2q_cuda::DeviceWeight,
    wk: hf2q_cuda::DeviceWeight,
    wv: hf2q_cuda::DeviceWeight,
    wo: hf2q_cuda::DeviceWeight,
    head: hf2q_cuda::DeviceWeight,
    norm: CudaSlice<f32>,
    rope: hf2q_cuda::RopeTable,
    cache: DeviceKvCache,
    p: AttentionParams,
    ids: CudaSlice<u32>,
    pos: CudaSlice<i32>,
    x: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    att: CudaSlice<f32>,
    o: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    scratch: CudaSlice<f32>,
}

const D: usize = 256;
const VOCAB: usize = 1000;

impl Step {
    fn new(dev: &CudaDev, rng: &mut Rng) -> Step {
        let (h, hkv, dh, cap) = (4, 2, 64, 512);
        let up = |f: Fmt, r: usize, c: usize, rng: &mut Rng| {
            dev.upload_weight(&make_weight(rng, f, r, c)).unwrap()
        };
        let p = AttentionParams {
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: dh,
            scale: 0.125,
            window: None,
            sinks: None,
        };
        let scratch = poisoned(dev, dev.attention_scratch_len(&p, cap));
        Step {
            emb: up(Fmt::Ggml(GgmlType::Q8_0), VOCAB, D, rng),
            wq: up(Fmt::Ggml(GgmlType::Q4_0), h * dh, D, rng),
            wk: up(Fmt::Ggml(GgmlType::Q4_K), hkv * dh, D, rng),
            wv: up(Fmt::Mlx(4, 64), hkv * dh, D, rng),
            wo: up(Fmt::Ggml(GgmlType::F16), D, h * dh, rng),
            head: up(Fmt::Ggml(GgmlType::Q6_K), VOCAB, D, rng),
            norm: dev.upload(&rng.vec(D, 1.0)).unwrap(),
            rope: dev
                .rope_table(&RopeParams {
                    style: RopeStyle::Neox,
                    theta: 10000.0,
                    dims: dh,
                    freq_factors: None,
                    linear_scale: 1.0,
                })
                .unwrap(),
            cache: dev.alloc_kv_cache(hkv, cap, dh, KvDtype::F16).unwrap(),
            p,
            ids: dev.upload(&[3u32]).unwrap(),
            pos: dev.upload(&[0i32]).unwrap(),
            x: poisoned(dev, D),
            xn: poisoned(dev, D),
            q: poisoned(dev, h * dh),
            k: poisoned(dev, hkv * dh),
            v: poisoned(dev, hkv * dh),
            att: poisoned(dev, h * dh),
            o: poisoned(dev, D),
            logits: poisoned(dev, VOCAB),
            scratch,
        }
    }

    /// Enqueues the step; the next token id lands in `ids` (greedy), so steps chain on device.
    fn enqueue(&mut self, dev: &CudaDev) {
        let s = self;
        let (h, hkv, dh) = (s.p.n_heads, s.p.n_kv_heads, s.p.head_dim);
        dev.embedding(&s.emb, &s.ids, 1, 1.0, &mut s.x).unwrap();
        dev.rms_norm(&s.x, &s.norm, 1, D, 1e-6, 0.0, &mut s.xn)
            .unwrap();
        dev.linear(&s.xn, 1, &s.wq, None, &mut s.q).unwrap();
        dev.linear(&s.xn, 1, &s.wk, None, &mut s.k).unwrap();
        dev.linear(&s.xn, 1, &s.wv, None, &mut s.v).unwrap();
        dev.rope(&mut s.q, 1, h, dh, &s.pos, &s.rope).unwrap();
        dev.rope(&mut s.k, 1, hkv, dh, &s.pos, &s.rope).unwrap();
        dev.kv_write(&mut s.cache, &s.k, &s.v, 1, &s.pos).unwrap();
        dev.attention(
            &s.q,
            1,
            &s.cache,
            &s.pos,
            &s.p,
            &mut s.scratch,
            &mut s.att,
            None,
        )
        .unwrap();
        dev.linear(&s.att, 1, &s.wo, None, &mut s.o).unwrap();
        dev.add_assign(&mut s.x, &s.o, D).unwrap();
        dev.rms_norm(&s.x, &s.norm, 1, D, 1e-6, 0.0, &mut s.xn)
            .unwrap();
        dev.linear(&s.xn, 1, &s.head, None, &mut s.logits).unwrap();
        dev.argmax(&s.logits, 1, VOCAB, &mut s.ids).unwrap();
    }

    fn outputs(&self, dev: &CudaDev) -> (Vec<f32>, Vec<f32>, u32) {
        (
            dev.download(&self.att).unwrap(),
            dev.download(&self.logits).unwrap(),
            dev.download(&self.ids).unwrap()[0],
        )
    }
}

#[test]
fn graph_replays_at_new_positions() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("graph");
    let mut s = Step::new(&dev, &mut rng);
    // History: positions 0..40 filled by eager steps.
    for p in 0..40 {
        dev.write(&mut s.pos, &[p]).unwrap();
        s.enqueue(&dev);
    }
    dev.synchronize().unwrap();

    dev.begin_capture().unwrap();
    s.enqueue(&dev);
    let graph = dev.end_capture().unwrap();

    for pos in [40i32, 41, 17] {
        // Eager, then the graph, from the same token at the same position: identical kernels on
        // identical inputs, so identical bits (the graph rewrites the same cache row).
        let tok = dev.download(&s.ids).unwrap();
        dev.write(&mut s.pos, &[pos]).unwrap();
        s.enqueue(&dev);
        let eager = s.outputs(&dev);
        dev.write(&mut s.ids, &tok).unwrap();
        dev.write(&mut s.pos, &[pos]).unwrap();
        graph.launch().unwrap();
        let replay = s.outputs(&dev);
        assert!(eager.0.iter().chain(&eager.1).all(|v| v.is_finite()));
        assert_eq!(eager.0, replay.0, "attention output at position {pos}");
        assert_eq!(eager.1, replay.1, "logits at position {pos}");
        assert_eq!(eager.2, replay.2, "next token at position {pos}");
        println!("  graph replay at position {pos}: next token {}", replay.2);
    }
}

// ---------------------------------------------------------------------------------------------
// Compilation
// ---------------------------------------------------------------------------------------------

#[test]
fn compile_errors_name_the_file_and_line() {
    if !hf2q_cuda::nvrtc_available() {
        println!("skipped: no NVRTC library");
        return;
    }
    let src = "#include \"common.cuh\"\nextern \"C\" __global__ void k(float* x) {\n    x[0] = undefined_name;\n}\n";
    let err = hf2q_cuda::compile_for("broken_kernel.cu", src, (9, 0))
        .unwrap_err()
        .to_string();
    println!("  {err}");
    assert!(err.contains("broken_kernel.cu(3)"), "{err}");
    assert!(err.contains("undefined_name"), "{err}");
}

#[test]
fn every_kernel_file_compiles() {
    if !hf2q_cuda::nvrtc_available() {
        println!("skipped: no NVRTC library");
        return;
    }
    let all = hf2q_cuda::compile_all_for((9, 0), &[]).unwrap();
    for (name, cubin, _) in &all {
        assert!(!cubin.is_empty(), "{name}");
    }
    // The decode megakernel is compiled only when asked for at open, but always here.
    assert!(all.iter().any(|(name, _, _)| *name == "mega.cu"));
}

#[test]
fn corrupt_cache_entries_are_rebuilt() {
    let Some(_dev) = device() else { return };
    let Some(src) = options().kernel_cache.filter(|d| d.is_dir()) else {
        println!("skipped: no kernel cache folder");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut corrupted = 0;
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".cubin") {
            continue;
        }
        let mut data = std::fs::read(e.path()).unwrap();
        if name.starts_with("elementwise-") {
            // A flipped byte: the checksum catches it.
            let mid = data.len() / 2;
            data[mid] ^= 0x55;
            corrupted += 1;
        } else if name.starts_with("attention-") {
            // A well-formed entry whose body is not a cubin: the driver refuses it.
            let body = vec![0x42u8; 4096];
            let mut h = 0xcbf2_9ce4_8422_2325u64;
            for &x in &body {
                h ^= x as u64;
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
            h ^= 0xff;
            h = h.wrapping_mul(0x0100_0000_01b3);
            data = b"HF2QCUBN".to_vec();
            data.extend_from_slice(&(body.len() as u64).to_le_bytes());
            data.extend_from_slice(&h.to_le_bytes());
            data.extend_from_slice(&body);
            corrupted += 1;
        }
        std::fs::write(tmp.path().join(&name), data).unwrap();
    }
    let in_tmp = hf2q_cuda::CudaOptions {
        kernel_cache: Some(tmp.path().to_path_buf()),
        ..options()
    };
    let dev2 = CudaDev::open(0, &in_tmp).unwrap().unwrap();
    // The rebuilt kernels work.
    let x = dev2.upload(&[1.0f32, 2.0, 3.0]).unwrap();
    let mut y = dev2.upload(&[0.5f32, 0.5, 0.5]).unwrap();
    dev2.add_assign(&mut y, &x, 3).unwrap();
    assert_eq!(dev2.download(&y).unwrap(), vec![1.5, 2.5, 3.5]);
    println!("  {corrupted} corrupted cache entries rebuilt");
}

#[test]
fn open_without_a_device_is_none_or_a_device() {
    // On a machine without CUDA this is Ok(None); with one, a device. Never a panic or a hang.
    match CudaDev::open(0, &options()) {
        Ok(None) => println!("skipped: no CUDA device"),
        Ok(Some(d)) => println!("  opened {}", d.info().name),
        Err(e) => panic!("{e}"),
    }
    // An ordinal past the last device is None, not an error.
    assert!(CudaDev::open(1 << 20, &options()).unwrap().is_none());
}

// ---------------------------------------------------------------------------------------------
// Timings (HF2Q_CUDA_BENCH=1)
// ---------------------------------------------------------------------------------------------

/// Device time per run of `f(rep)` in milliseconds, launch overhead excluded: `reps` runs are
/// captured into one graph, and the median of five replays (each between two events) is
/// divided by `reps`.
fn time_ms(dev: &CudaDev, reps: usize, mut f: impl FnMut(usize)) -> f32 {
    for i in 0..3 {
        f(i); // warm-up (and the first use of each kernel, outside the capture)
    }
    dev.synchronize().unwrap();
    dev.begin_capture().unwrap();
    for i in 0..reps {
        f(i);
    }
    let graph = dev.end_capture().unwrap();
    graph.launch().unwrap();
    time_batches(dev, reps, || graph.launch().unwrap())
}

/// Like [`time_ms`] but launching eagerly, `reps` runs back to back between the events (host
/// launch cost included wherever it exceeds the device time).
fn time_eager_ms(dev: &CudaDev, reps: usize, mut f: impl FnMut(usize)) -> f32 {
    for i in 0..3 {
        f(i);
    }
    let mut i = 0;
    time_batches(dev, reps, || {
        for _ in 0..reps {
            f(i);
            i += 1;
        }
    })
}

fn time_batches(dev: &CudaDev, reps: usize, mut batch: impl FnMut()) -> f32 {
    use cudarc::driver::sys::CUevent_flags;
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
        batch();
        b.record(dev.stream()).unwrap();
        b.synchronize().unwrap();
        times.push(a.elapsed_ms(&b).unwrap() / reps as f32);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    times[2]
}

fn big_weight(f: Fmt, rows: usize, cols: usize) -> QTensor {
    use rayon::prelude::*;
    let mut rng = Rng(rows as u64 * 31 + cols as u64);
    let w = rng.vec(rows * cols, 0.5);
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
            packed
                .par_chunks_mut(rb)
                .zip(s.par_chunks_mut(g))
                .zip(b.par_chunks_mut(g))
                .zip(w.par_chunks(cols))
                .for_each(|(((pk, sc), bi), src)| {
                    quant::mlx::quantize_affine(p, src, pk, sc, bi).unwrap()
                });
            QTensor::affine("w", p, rows, cols, Bytes::from_vec(packed), s, b).unwrap()
        }
    }
}

/// A benchmark (`--ignored`): products of a batched decode step (16, 32, 64 rows) with the
/// matrices of a 1B and an 8B Llama, on the tensor-core small-batch kernels (`batch-tc`),
/// the chunks of the matrix-vector kernels (`batch-mv`) and the prefill path (cuBLAS on f16
/// pairs). Graph-timed where the path can be captured; the prefill path eagerly (it is not
/// used while capturing). Weights cycled over copies to defeat the L2.
#[test]
#[ignore = "a benchmark: --ignored on a GPU machine"]
fn bench_small_batch() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("bench-batch");
    let shapes = [
        (3072, 2048),
        (2048, 2048),
        (16384, 2048),
        (2048, 8192),
        (128256, 2048),
        (6144, 4096),
        (28672, 4096),
        (4096, 14336),
    ];
    for (rows, cols) in shapes {
        for f in [
            Fmt::Ggml(GgmlType::Q4_0),
            Fmt::Ggml(GgmlType::Q4_K),
            Fmt::Ggml(GgmlType::Q6_K),
            Fmt::Ggml(GgmlType::Q8_0),
        ] {
            set_layouts(&dev, hf2q_cuda::MvMode::Auto);
            let w = big_weight(f, rows, cols);
            let bytes = w.stored_bytes();
            let copies = (256usize << 20).div_ceil(bytes).max(2);
            let ws: Vec<_> = (0..copies)
                .map(|_| dev.upload_weight(&w).unwrap())
                .collect();
            for t in [16usize, 32, 64] {
                let x = dev.upload(&rng.vec(t * cols, 1.0)).unwrap();
                let mut out: CudaSlice<f32> = dev.alloc(t * rows).unwrap();
                let mut cells = Vec::new();
                for (name, tc, mv) in [("tc", 64, 0), ("mv", 0, 64), ("pairs", 0, 0)] {
                    dev.set_batch_tc(tc);
                    dev.set_batch_mv(mv);
                    let run =
                        |i: usize| dev.linear(&x, t, &ws[i % copies], None, &mut out).unwrap();
                    let ms = if name == "pairs" {
                        time_eager_ms(&dev, 20, run)
                    } else {
                        time_ms(&dev, 20, run)
                    };
                    let gbs = bytes as f64 / (ms as f64 * 1e6);
                    cells.push(format!("{name} {:8.1} us {gbs:5.0} GB/s", ms * 1000.0));
                }
                println!(
                    "batch {:>5} R={rows:>6} C={cols:>5} T={t:>2}: {}",
                    w.type_name(),
                    cells.join(" | ")
                );
            }
        }
    }
    let d = hf2q_cuda::CudaOptions::default();
    dev.set_batch_tc(d.batch_tc);
    dev.set_batch_mv(d.batch_mv);
    set_layouts(&dev, hf2q_cuda::MvMode::All);
}

#[test]
fn bench_ops() {
    if std::env::var("HF2Q_CUDA_BENCH").is_err() {
        println!("skipped: set HF2Q_CUDA_BENCH=1 to time the kernels");
        return;
    }
    let Some(dev) = device() else { return };
    let mut rng = Rng::new("bench");
    let mut table = Vec::new();

    // Copy bandwidth (bytes read + bytes written).
    let n = 256 << 20; // 1 GiB of f32
    let src: CudaSlice<f32> = dev.alloc(n).unwrap();
    let mut dst: CudaSlice<f32> = dev.alloc(n).unwrap();
    let ms = time_ms(&dev, 10, |_| {
        dev.stream().memcpy_dtod(&src, &mut dst).unwrap()
    });
    let copy_gbs = 2.0 * (n * 4) as f64 / (ms as f64 * 1e6);
    table.push(format!(
        "copy 1 GiB d2d: {ms:.3} ms, {copy_gbs:.0} GB/s (read + write)"
    ));
    drop((src, dst));

    // HF2Q_CUDA_BENCH=gemm: the prefill products and attention only.
    let gemm_only = std::env::var("HF2Q_CUDA_BENCH").is_ok_and(|v| v == "gemm");
    if !gemm_only {
        // Matrix-vector: weights cycled over enough copies to defeat the 60 MB L2. Shapes of the
        // 1B (2048 x 8192, 8192 x 2048) and the 8B (the rest).
        let fmts = [
            Fmt::Ggml(GgmlType::Q4_0),
            Fmt::Ggml(GgmlType::Q8_0),
            Fmt::Ggml(GgmlType::Q4_K),
            Fmt::Ggml(GgmlType::Q6_K),
            Fmt::Ggml(GgmlType::F16),
            Fmt::Mlx(4, 64),
        ];
        let mut shapes = vec![
            (2048, 8192),
            (8192, 2048),
            (4096, 4096),
            (6144, 4096),
            (4096, 14336),
            (14336, 4096),
        ];
        // HF2Q_CUDA_BENCH_SHAPES=RxC,... measures those shapes instead (the logits: 128256x2048),
        // HF2Q_CUDA_BENCH_FMTS=q6_k,f16,... only those formats.
        if let Ok(list) = std::env::var("HF2Q_CUDA_BENCH_SHAPES") {
            shapes = list
                .split(',')
                .map(|s| {
                    let (r, c) = s.split_once('x').expect("RxC");
                    (r.parse().expect("rows"), c.parse().expect("cols"))
                })
                .collect();
        }
        let only = std::env::var("HF2Q_CUDA_BENCH_FMTS").ok();
        let wanted = |f: &Fmt| {
            only.as_deref().is_none_or(|l| {
                let name = match f {
                    Fmt::Ggml(ty) => format!("{ty:?}").to_lowercase(),
                    Fmt::Mlx(b, g) => format!("mlx{b}g{g}"),
                };
                l.split(',').any(|x| x == name)
            })
        };
        for (rows, cols) in shapes {
            for f in fmts.into_iter().filter(wanted) {
                let w = big_weight(f, rows, cols);
                let bytes = w.stored_bytes();
                let copies = (256usize << 20).div_ceil(bytes).max(2);
                let ws: Vec<_> = (0..copies)
                    .map(|_| dev.upload_weight(&w).unwrap())
                    .collect();
                for t in [1usize, 4, 8] {
                    if t > 1 && rows != 8192 {
                        continue;
                    }
                    // One-token products: f32 activations (with or without the weights' L2
                    // prefetch before the wait; consecutive replays overlap through it), 8-bit ones
                    // staged per block, the persistent 8-bit kernels (two or one blocks per
                    // multiprocessor).
                    let quantized = matches!(f, Fmt::Ggml(ty) if ty != GgmlType::F16);
                    let variants: &[&str] = if t == 1 && quantized {
                        &["f32", "f32+pf", "i8", "p8", "p8x1"]
                    } else {
                        &[""]
                    };
                    for &v in variants {
                        dev.set_matvec_int8(if v == "i8" {
                            hf2q_cuda::MvMode::All
                        } else {
                            hf2q_cuda::MvMode::Off
                        });
                        let p8 = if v.starts_with("p8") {
                            hf2q_cuda::MvMode::All
                        } else {
                            hf2q_cuda::MvMode::Off
                        };
                        dev.set_matvec_persistent(p8, if v == "p8x1" { 1 } else { 2 });
                        dev.set_matvec_prefetch(v == "f32+pf");
                        let x = dev.upload(&rng.vec(t * cols, 1.0)).unwrap();
                        let mut out: CudaSlice<f32> = dev.alloc(t * rows).unwrap();
                        let ms = time_ms(&dev, 50, |i| {
                            dev.linear(&x, t, &ws[i % copies], None, &mut out).unwrap()
                        });
                        let gbs = bytes as f64 / (ms as f64 * 1e6);
                        let eager = time_eager_ms(&dev, 50, |i| {
                            dev.linear(&x, t, &ws[i % copies], None, &mut out).unwrap()
                        });
                        table.push(format!(
                            "matvec {:>10} R={rows:>5} C={cols:>5} T={t} {v}: {:7.1} us, {gbs:6.0} GB/s ({:.0}% of copy); eager launches {:.1} us",
                            w.type_name(),
                            ms * 1000.0,
                            100.0 * gbs / copy_gbs,
                            eager * 1000.0
                        ));
                    }
                    dev.set_matvec_persistent(hf2q_cuda::MvMode::Auto, 2);
                    dev.set_matvec_int8(hf2q_cuda::MvMode::Auto);
                    dev.set_matvec_prefetch(true);
                }
            }
        }
    }
    if std::env::var("HF2Q_CUDA_BENCH").is_ok_and(|v| v == "matvec") {
        println!("{}", table.join("\n"));
        return;
    }
    // Prefill products: our tiled kernel, cuBLAS on one f16 pass, the integer kernel and cuBLAS
    // on f16 pairs (the default) (`prefill_gemm`), by T.
    println!("cuBLAS present: {}", dev.blas_available());
    for f in [
        Fmt::Ggml(GgmlType::Q4_K),
        Fmt::Ggml(GgmlType::Q6_K),
        Fmt::Ggml(GgmlType::Q4_0),
        Fmt::Ggml(GgmlType::Q8_0),
        Fmt::Ggml(GgmlType::F16),
    ] {
        let (rows, cols) = (4096, 4096);
        let w = dev.upload_weight(&big_weight(f, rows, cols)).unwrap();
        for t in [16usize, 32, 64, 128, 512] {
            let x = dev.upload(&rng.vec(t * cols, 1.0)).unwrap();
            let mut out: CudaSlice<f32> = dev.alloc(t * rows).unwrap();
            let mut cells = Vec::new();
            for g in [
                hf2q_cuda::PrefillGemm::Tiled,
                hf2q_cuda::PrefillGemm::F16,
                hf2q_cuda::PrefillGemm::Int8,
                hf2q_cuda::PrefillGemm::Pairs,
            ] {
                dev.set_prefill_gemm(g);
                let ms =
                    time_eager_ms(&dev, 20, |_| dev.linear(&x, t, &w, None, &mut out).unwrap());
                let tflops = 2.0 * (rows * cols * t) as f64 / (ms as f64 * 1e9);
                cells.push(format!("{g:?} {:.3} ms {tflops:.1} TFLOP/s", ms));
            }
            dev.set_prefill_gemm(hf2q_cuda::PrefillGemm::default());
            table.push(format!(
                "gemm {:?} R={rows} C={cols} T={t}: {}",
                f,
                cells.join(", ")
            ));
        }
    }

    // Attention: decode over a long cache, and a prefill.
    let (h, hkv, dh, cap) = (32, 8, 128, 8192);
    let p = AttentionParams {
        n_heads: h,
        n_kv_heads: hkv,
        head_dim: dh,
        scale: 1.0 / (dh as f32).sqrt(),
        window: None,
        sinks: None,
    };
    let mut cache = dev.alloc_kv_cache(hkv, cap, dh, KvDtype::F16).unwrap();
    let kv = dev.upload(&rng.vec(cap * hkv * dh, 1.0)).unwrap();
    let zero = dev.upload(&[0i32]).unwrap();
    dev.kv_write(&mut cache, &kv, &kv, cap, &zero).unwrap();
    let mut scratch: CudaSlice<f32> = dev.alloc(dev.attention_scratch_len(&p, cap)).unwrap();
    for pos0 in [1000usize, 8000] {
        let pos = dev.upload(&[pos0 as i32]).unwrap();
        let q = dev.upload(&rng.vec(h * dh, 1.0)).unwrap();
        let mut out: CudaSlice<f32> = dev.alloc(h * dh).unwrap();
        let ms = time_ms(&dev, 50, |_| {
            dev.attention(&q, 1, &cache, &pos, &p, &mut scratch, &mut out, None)
                .unwrap()
        });
        let bytes = 2 * hkv * (pos0 + 1) * dh * 2;
        table.push(format!(
            "attention decode H={h} Hkv={hkv} Dh={dh} keys={}: {:.1} us, {:.0} GB/s of K/V",
            pos0 + 1,
            ms * 1000.0,
            bytes as f64 / (ms as f64 * 1e6)
        ));
    }
    let mut pre = vec![(p.clone(), cache, scratch)];
    {
        // The 1B shape: Dh = 64.
        let p1 = AttentionParams {
            head_dim: 64,
            scale: 0.125,
            ..p
        };
        let mut c1 = dev.alloc_kv_cache(hkv, cap, 64, KvDtype::F16).unwrap();
        let kv = dev.upload(&rng.vec(cap * hkv * 64, 1.0)).unwrap();
        dev.kv_write(&mut c1, &kv, &kv, cap, &zero).unwrap();
        let s1: CudaSlice<f32> = dev.alloc(1).unwrap();
        pre.push((p1, c1, s1));
    }
    for (p, cache, scratch) in pre.iter_mut() {
        let dh = p.head_dim;
        for t in [512usize, 2048] {
            let q = dev.upload(&rng.vec(t * h * dh, 1.0)).unwrap();
            let mut out: CudaSlice<f32> = dev.alloc(t * h * dh).unwrap();
            let ms = time_ms(&dev, 10, |_| {
                dev.attention(&q, t, cache, &zero, p, scratch, &mut out, None)
                    .unwrap()
            });
            let flops = 4.0 * (h * dh) as f64 * (t * (t + 1) / 2) as f64;
            table.push(format!(
                "attention prefill H={h} Hkv={hkv} Dh={dh} T={t}: {:.3} ms, {:.1} TFLOP/s",
                ms,
                flops / (ms as f64 * 1e9)
            ));
        }
    }

    // A small decode step: eager launches against one graph replay.
    let mut s = Step::new(&dev, &mut rng);
    let eager = time_eager_ms(&dev, 50, |_| s.enqueue(&dev));
    dev.begin_capture().unwrap();
    s.enqueue(&dev);
    let graph = dev.end_capture().unwrap();
    let replay = time_eager_ms(&dev, 50, |_| graph.launch().unwrap());
    table.push(format!(
        "one-layer decode step (14 ops): eager {:.1} us, graph {:.1} us",
        eager * 1000.0,
        replay * 1000.0
    ));

    println!("\n{}", table.join("\n"));
}

/// Prints ptxas's register / shared memory / spill report of every kernel (needs NVRTC only):
/// `cargo test --test cuda_ops kernel_resource_report -- --ignored --nocapture`.
#[test]
#[ignore]
fn kernel_resource_report() {
    // HF2Q_CUBIN_DIR=folder also writes the cubins there (for a disassembler).
    let dump = std::env::var_os("HF2Q_CUBIN_DIR").map(std::path::PathBuf::from);
    for (name, cubin, log) in hf2q_cuda::compile_all_for((9, 0), &["--ptxas-options=-v"]).unwrap() {
        println!("== {name}");
        if let Some(d) = &dump {
            std::fs::write(d.join(name.replace(".cu", ".cubin")), &cubin).unwrap();
        }
        let mut func = String::new();
        for line in log.lines() {
            if let Some(i) = line.find("entry function '") {
                func = line[i + 16..].split('\'').next().unwrap_or("").to_string();
            } else if line.contains("Used") || line.contains("spill") {
                println!("{func}: {}", line.trim());
            }
        }
    }
}
