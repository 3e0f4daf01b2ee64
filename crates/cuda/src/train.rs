//! Launchers of the training kernels (`kernels/train.cu`, `kernels/train_attn.cu`) and the
//! training products: dense f32 ([`Gemm`] through cuBLAS sgemm, or our own kernels inside a
//! captured graph and where cuBLAS is missing) and bf16 on tensor cores (cuBLAS GemmEx, f32
//! sums), with the frozen weights dequantized to bf16 rows (`deqt_KIND`).
//!
//! Not here: tensors and their shapes. The callers (`backend_train.rs`) check shapes; every pointer
//! here is a device address whose extent the caller checked, as in `blas.rs`.

use std::ffi::c_void;

use cudarc::cublas::{result as bres, sys as bsys};
use cudarc::driver::{sys, CudaSlice, DevicePtr, DeviceRepr};

use super::ops::{blocks, launch, shape, to_i32};
use super::weight::DEQT_KERNEL;
use super::{cuda_err, CudaDev, DeviceWeight, PrefillGemm, Program};
use hf2q_tensor::{Error, Result};

/// Dynamic shared memory the training attention kernels may ask for (`ta_*`: double-buffered
/// bf16 tiles, 104 KB at Dh = 128).
pub(crate) const TRAIN_ATTN_MAX_SMEM: usize = 110 * 1024;

/// Outputs with at most this many elements take one warp per element in our own f32 product
/// (`mm_dot`: a LoRA adapter's products at decode), larger ones 64 x 64 tiles (`mm_tiled`).
const DOT_MAX_OUTPUTS: usize = 32768;

/// Blocks of the sum-of-squares reduction (fixed, so the partials add up in one order).
const SUMSQ_BLOCKS: usize = 264;

/// A row-major product `c (m, n) = alpha · op(a) · op(b)`, added to `c` when `accumulate`:
/// `op(a)` is `(m, k)`, stored `(k, m)` when `ta`; `op(b)` is `(k, n)`, stored `(n, k)` when
/// `tb`; `lda` / `ldb` values per stored row (a column block of a wider matrix when larger than
/// the natural width); `c` has `n` values per row.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gemm {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ta: bool,
    pub tb: bool,
    pub lda: usize,
    pub ldb: usize,
    pub alpha: f32,
    pub accumulate: bool,
}

impl Gemm {
    /// Operands at their natural widths.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dense(
        (a, b, c): (u64, u64, u64),
        (m, k, n): (usize, usize, usize),
        ta: bool,
        tb: bool,
        alpha: f32,
        accumulate: bool,
    ) -> Gemm {
        Gemm {
            a,
            b,
            c,
            m,
            n,
            k,
            ta,
            tb,
            lda: if ta { m } else { k },
            ldb: if tb { k } else { n },
            alpha,
            accumulate,
        }
    }
}

/// The arguments of the training attention kernels: `q (N, H*Dh)`, `k, v (N, Hkv*Dh)` f32 device
/// rows, `seq (N)` pairs (start, end) of each row's sequence.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnArgs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub seq: u64,
    pub n: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// 0: no window.
    pub window: i32,
    /// 0: no soft cap.
    pub cap: f32,
}

/// Mirrors `struct AdamArgs` in `kernels/train.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamArgs {
    pub decay: f32,
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub step_size: f32,
    pub bias2_sqrt: f32,
    pub eps: f32,
}

// SAFETY: a plain #[repr(C)] struct of floats with the layout of the device struct.
unsafe impl DeviceRepr for AdamArgs {}

fn blas_err(what: &str) -> impl FnOnce(bres::CublasError) -> Error + '_ {
    move |e| Error::Msg(format!("cublas: {what}: {e:?}"))
}

fn op(t: bool) -> bsys::cublasOperation_t {
    if t {
        bsys::cublasOperation_t::CUBLAS_OP_T
    } else {
        bsys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// A kernel flag as the C int it is passed as.
fn flag(b: bool) -> i32 {
    i32::from(b)
}

impl CudaDev {
    /// An uninitialised device buffer of `n` elements (scratch that a kernel fills whole).
    pub(crate) fn scratch<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: the buffer is only read after a kernel or copy has written it (every caller
        // fills what it reads).
        unsafe { self.stream().alloc::<T>(n.max(1)) }
            .map_err(cuda_err(format_args!("allocating {n} elements of scratch")))
    }

    pub(crate) fn addr<T>(&self, b: &CudaSlice<T>) -> u64 {
        b.device_ptr(self.stream()).0
    }

    /// Sets `bytes` bytes at `ptr` to `value` (zeros, or 0xff: a NaN in every f32).
    pub(crate) fn memset(&self, ptr: u64, value: u8, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller owns `bytes` bytes at `ptr` on this device.
        unsafe { sys::cuMemsetD8Async(ptr, value, bytes, self.stream().cu_stream()) }
            .result()
            .map_err(cuda_err("setting device memory"))
    }

    /// cuBLAS for a training product, or `None` where our own kernels do it: while a graph is
    /// being captured (a LoRA adapter inside the decode graph), with `PrefillGemm::Tiled` (tests
    /// of those kernels), or without the library.
    pub(crate) fn train_blas(&self) -> Result<Option<bsys::cublasHandle_t>> {
        if self.capturing()? || self.prefill_gemm() == PrefillGemm::Tiled {
            return Ok(None);
        }
        self.blas_handle()
    }

    /// `g` on f32 operands: cuBLAS sgemm (f32 arithmetic, no TF32), else our own kernels.
    pub(crate) fn gemm_f32(&self, g: &Gemm) -> Result<()> {
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        if g.k == 0 {
            return if g.accumulate {
                Ok(())
            } else {
                self.memset(g.c, 0, g.m * g.n * 4)
            };
        }
        let (m, n, k) = (
            to_i32("rows", g.m)?,
            to_i32("columns", g.n)?,
            to_i32("depth", g.k)?,
        );
        let (lda, ldb) = (to_i32("lda", g.lda)?, to_i32("ldb", g.ldb)?);
        self.bind()?;
        if let Some(h) = self.train_blas()? {
            let beta = if g.accumulate { 1.0f32 } else { 0.0 };
            self.count_launch();
            // Row-major c (m, n) is column-major cᵀ (n, m) = op(b)ᵀ · op(a)ᵀ: b's buffer read
            // column-major is op(b)ᵀ as stored (n, k) when not transposed, so the operations
            // keep their transposes and swap places.
            // SAFETY: a live handle on this device's stream; the extents were checked by the
            // caller.
            unsafe {
                bres::sgemm(
                    h,
                    op(g.tb),
                    op(g.ta),
                    n,
                    m,
                    k,
                    &g.alpha,
                    g.b as *const f32,
                    ldb,
                    g.a as *const f32,
                    lda,
                    &beta,
                    g.c as *mut f32,
                    n,
                )
            }
            .map_err(blas_err("f32 product"))?;
            return Ok(());
        }
        let (a, b, c, alpha) = (g.a, g.b, g.c, g.alpha);
        let (ta, tb, acc) = (flag(g.ta), flag(g.tb), flag(g.accumulate));
        if g.m * g.n <= DOT_MAX_OUTPUTS {
            let f = self.function(Program::Train, "mm_dot")?;
            let grid = blocks(g.m * g.n * 32, 256)?;
            launch!(self, f, (grid, 1, 1), (256, 1, 1), 0; a, b, c, m, n, k, ta, tb, lda, ldb, alpha, acc)
        } else {
            let f = self.function(Program::Train, "mm_tiled")?;
            let (gx, gy) = (blocks(g.n, 64)?, blocks(g.m, 64)?);
            if gy > 65535 {
                return Err(shape(format!("matmul: {} rows in one product", g.m)));
            }
            launch!(self, f, (gx, gy, 1), (256, 1, 1), 0; a, b, c, m, n, k, ta, tb, lda, ldb, alpha, acc)
        }
    }

    /// `g` on bf16 operands with f32 sums into f32 `c`, on tensor cores through cuBLAS GemmEx;
    /// `Ok(false)` (nothing enqueued) where [`CudaDev::train_blas`] gives no handle.
    pub(crate) fn gemm_bf16(&self, g: &Gemm) -> Result<bool> {
        self.gemm_half(g, true)
    }

    /// [`CudaDev::gemm_bf16`] on f16 operands (`bf16` false): three more bits of each operand,
    /// for forward products (activations within f16's range).
    pub(crate) fn gemm_half(&self, g: &Gemm, bf16: bool) -> Result<bool> {
        let ty = if bf16 {
            bsys::cudaDataType_t::CUDA_R_16BF
        } else {
            bsys::cudaDataType_t::CUDA_R_16F
        };
        let Some(h) = self.train_blas()? else {
            return Ok(false);
        };
        if g.m == 0 || g.n == 0 || g.k == 0 {
            return Err(shape(format!(
                "bf16 product of ({}, {}, {})",
                g.m, g.k, g.n
            )));
        }
        let (m, n, k) = (
            to_i32("rows", g.m)?,
            to_i32("columns", g.n)?,
            to_i32("depth", g.k)?,
        );
        let (lda, ldb) = (to_i32("lda", g.lda)?, to_i32("ldb", g.ldb)?);
        let beta = if g.accumulate { 1.0f32 } else { 0.0 };
        self.bind()?;
        self.count_launch();
        // As in `gemm_f32`: the column-major view swaps the operands.
        // SAFETY: a live handle on this device's stream; the extents were checked by the caller.
        unsafe {
            bres::gemm_ex(
                h,
                op(g.tb),
                op(g.ta),
                n,
                m,
                k,
                &g.alpha as *const f32 as *const c_void,
                g.b as *const c_void,
                ty,
                ldb,
                g.a as *const c_void,
                ty,
                lda,
                &beta as *const f32 as *const c_void,
                g.c as *mut c_void,
                bsys::cudaDataType_t::CUDA_R_32F,
                n,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err("bf16 product"))?;
        Ok(true)
    }

    /// Rows `row0 .. row0 + n` of `w` as f16 into `out` (`ld` values per row, columns a multiple
    /// of 8): the dequantizer of the prefill products (`deqh_KIND`).
    pub(crate) fn dequantize_rows_f16(
        &self,
        w: &DeviceWeight,
        out: u64,
        ld: usize,
        (row0, n): (usize, usize),
    ) -> Result<()> {
        if row0 + n > w.rows || ld < w.cols || !w.cols.is_multiple_of(8) || !ld.is_multiple_of(8) {
            return Err(shape(format!(
                "dequantize '{}' to f16: rows {row0}..{} of {}, {ld} values per row for {}",
                w.name,
                row0 + n,
                w.rows,
                w.cols
            )));
        }
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = &w.kernels[super::weight::DEQH_KERNEL];
        let wa = w.args(self);
        let (lo, ldi, r0, ni) = (
            0u64,
            to_i32("ld", ld)?,
            to_i32("row", row0)?,
            to_i32("rows", n)?,
        );
        let grid = blocks(n * w.cols / 8, 256)?;
        launch!(self, f, (grid, 1, 1), (256, 1, 1), 0; wa, out, lo, ldi, r0, ni)
    }

    /// Columns `col0 .. col0 + w` of `dst` (`rows` rows of `ld` 16-bit values) = `src (rows, w)`
    /// times `scale`, as bf16 or f16, followed by `pad` zeros.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pack_cols(
        &self,
        (src, dst): (u64, u64),
        (rows, w, ld): (usize, usize, usize),
        col0: usize,
        pad: usize,
        scale: f32,
        bf16: bool,
    ) -> Result<()> {
        let (ri, wi, ldi, c0, padi, bi) = (
            to_i32("rows", rows)?,
            to_i32("width", w)?,
            to_i32("ld", ld)?,
            to_i32("column", col0)?,
            to_i32("pad", pad)?,
            flag(bf16),
        );
        let mut a: Vec<*mut c_void> = vec![
            &src as *const u64 as *mut c_void,
            &dst as *const u64 as *mut c_void,
            &ri as *const i32 as *mut c_void,
            &wi as *const i32 as *mut c_void,
            &ldi as *const i32 as *mut c_void,
            &c0 as *const i32 as *mut c_void,
            &padi as *const i32 as *mut c_void,
            &scale as *const f32 as *mut c_void,
            &bi as *const i32 as *mut c_void,
        ];
        self.elementwise("pack_cols", rows * (w + pad).div_ceil(4), &mut a)
    }

    /// `out (t, rows) += bias` for every row (the prefill products' bias kernel).
    pub(crate) fn add_bias_rows(&self, out: u64, bias: u64, t: usize, rows: usize) -> Result<()> {
        if t * rows == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Elementwise, "add_bias_rows")?;
        let (n, ri) = ((t * rows) as i64, to_i32("rows", rows)?);
        launch!(self, f, (blocks(t * rows, 256)?, 1, 1), (256, 1, 1), 0; out, bias, n, ri)
    }

    /// Rows `row0 .. row0 + n` of `w` dequantized into `out` (`ld` values per row), as bf16 or,
    /// with `f32out`, as f32.
    pub(crate) fn dequantize_rows(
        &self,
        w: &DeviceWeight,
        out: u64,
        ld: usize,
        (row0, n): (usize, usize),
        f32out: bool,
    ) -> Result<()> {
        if row0 + n > w.rows || ld < w.cols {
            return Err(shape(format!(
                "dequantize '{}': rows {row0}..{} of {}, {ld} values per row for {}",
                w.name,
                row0 + n,
                w.rows,
                w.cols
            )));
        }
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = &w.kernels[DEQT_KERNEL];
        let wa = w.args(self);
        let (ldi, r0, ni, f32i) = (
            to_i32("ld", ld)?,
            to_i32("row", row0)?,
            to_i32("rows", n)?,
            flag(f32out),
        );
        let grid = blocks(n * w.cols.div_ceil(8), 256)?;
        launch!(self, f, (grid, 1, 1), (256, 1, 1), 0; wa, out, ldi, r0, ni, f32i)
    }

    /// `out = bf16(x · s)`, `n` values.
    pub(crate) fn to_bf16(&self, x: u64, out: u64, n: usize, s: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Train, "to_bf16_scaled")?;
        let ni = n as i64;
        launch!(self, f, (blocks(n.div_ceil(4), 256)?, 1, 1), (256, 1, 1), 0; x, out, ni, s)
    }

    /// A one-thread-per-element kernel of train.cu over `n` elements with these arguments.
    fn elementwise(&self, name: &str, n: usize, params: &mut [*mut c_void]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Train, name)?;
        self.count_launch();
        // SAFETY: the caller's parameter list matches the kernel's (types and order), and every
        // pointer covers `n` elements.
        unsafe {
            self.launch_raw(
                f.cu_function(),
                (blocks(n, 256)?, 1, 1),
                (256, 1, 1),
                0,
                params,
            )
        }
        .map_err(cuda_err(format_args!("launching {name}")))
    }

    /// RoPE of `x (n, heads, dh)` in place at each row's position in its sequence (`seq`);
    /// `inverse` rotates back. `table`: the inverse frequencies ([`super::RopeTable`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rope_rows(
        &self,
        x: u64,
        (n, heads, dh): (usize, usize, usize),
        seq: u64,
        table: &super::RopeTable,
        inverse: bool,
    ) -> Result<()> {
        let (fp, half, neox, scale) = table.parts(self);
        let total = n * heads * half;
        let (ni, hi, dhi, halfi, neoxi) = (
            to_i32("rows", n)?,
            to_i32("heads", heads)?,
            to_i32("head width", dh)?,
            half as i32,
            flag(neox),
        );
        let sign = if inverse { -1.0f32 } else { 1.0 };
        let mut p: Vec<*mut c_void> = vec![
            &x as *const u64 as *mut c_void,
            &fp as *const u64 as *mut c_void,
            &seq as *const u64 as *mut c_void,
            &ni as *const i32 as *mut c_void,
            &hi as *const i32 as *mut c_void,
            &dhi as *const i32 as *mut c_void,
            &halfi as *const i32 as *mut c_void,
            &neoxi as *const i32 as *mut c_void,
            &scale as *const f32 as *mut c_void,
            &sign as *const f32 as *mut c_void,
        ];
        self.elementwise("rope_rows", total, &mut p)
    }

    /// `dx (rows, cols)` of RMSNorm's backward from `x`, `dy` and the weights `w (cols)`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rms_norm_backward(
        &self,
        (x, w, dy, dx): (u64, u64, u64, u64),
        rows: usize,
        cols: usize,
        eps: f32,
        offset: f32,
    ) -> Result<()> {
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Train, "rms_norm_bwd")?;
        let c = to_i32("columns", cols)?;
        let grid = u32::try_from(rows).map_err(|_| shape(format!("{rows} rows")))?;
        launch!(self, f, (grid, 1, 1), (256, 1, 1), 0; x, w, dy, dx, c, eps, offset)
    }

    /// `(dgate, dup)` of `act(gate) * up` from `dy`, `n` values each.
    pub(crate) fn gated_act_backward(
        &self,
        (gate, up, dy, dg, du): (u64, u64, u64, u64, u64),
        n: usize,
        gelu: bool,
    ) -> Result<()> {
        let (ni, gi) = (n as i64, flag(gelu));
        let mut p: Vec<*mut c_void> = vec![
            &gate as *const u64 as *mut c_void,
            &up as *const u64 as *mut c_void,
            &dy as *const u64 as *mut c_void,
            &dg as *const u64 as *mut c_void,
            &du as *const u64 as *mut c_void,
            &ni as *const i64 as *mut c_void,
            &gi as *const i32 as *mut c_void,
        ];
        self.elementwise("gated_act_bwd", n, &mut p)
    }

    /// `out = x` with the dropout mask of `(seed, p)` applied, `n` values.
    pub(crate) fn dropout(&self, x: u64, out: u64, n: usize, seed: u64, p: f32) -> Result<()> {
        let keep = 1.0 / (1.0 - p);
        let ni = n as i64;
        let mut a: Vec<*mut c_void> = vec![
            &x as *const u64 as *mut c_void,
            &out as *const u64 as *mut c_void,
            &ni as *const i64 as *mut c_void,
            &seed as *const u64 as *mut c_void,
            &p as *const f32 as *mut c_void,
            &keep as *const f32 as *mut c_void,
        ];
        self.elementwise("dropout_fwd", n, &mut a)
    }

    /// `x += alpha · y`, `n` values.
    pub(crate) fn add_scaled(&self, x: u64, y: u64, n: usize, alpha: f32) -> Result<()> {
        let ni = n as i64;
        let mut a: Vec<*mut c_void> = vec![
            &x as *const u64 as *mut c_void,
            &y as *const u64 as *mut c_void,
            &ni as *const i64 as *mut c_void,
            &alpha as *const f32 as *mut c_void,
        ];
        self.elementwise("add_scaled", n, &mut a)
    }

    /// `x *= s`, `n` values.
    pub(crate) fn scale(&self, x: u64, n: usize, s: f32) -> Result<()> {
        let ni = n as i64;
        let mut a: Vec<*mut c_void> = vec![
            &x as *const u64 as *mut c_void,
            &ni as *const i64 as *mut c_void,
            &s as *const f32 as *mut c_void,
        ];
        self.elementwise("scale_inplace", n, &mut a)
    }

    /// `Σ x²` over `n` values, in f64 (one synchronisation: the partials come to the host).
    pub(crate) fn sum_squares(&self, x: u64, n: usize) -> Result<f64> {
        if n == 0 {
            return Ok(0.0);
        }
        self.bind()?;
        let nb = SUMSQ_BLOCKS.min(n.div_ceil(256));
        let part = self.scratch::<f64>(nb)?;
        let pp = self.addr(&part);
        let f = self.function(Program::Train, "sum_squares_part")?;
        let ni = n as i64;
        launch!(self, f, (nb as u32, 1, 1), (256, 1, 1), 0; x, ni, pp)?;
        Ok(self.read(&part)?.iter().sum())
    }

    /// One AdamW step over `n` parameters.
    pub(crate) fn adamw(
        &self,
        (p, g, m, v): (u64, u64, u64, u64),
        n: usize,
        args: AdamArgs,
    ) -> Result<()> {
        let ni = n as i64;
        let mut a: Vec<*mut c_void> = vec![
            &p as *const u64 as *mut c_void,
            &g as *const u64 as *mut c_void,
            &m as *const u64 as *mut c_void,
            &v as *const u64 as *mut c_void,
            &ni as *const i64 as *mut c_void,
            &args as *const AdamArgs as *mut c_void,
        ];
        self.elementwise("adamw_step", n, &mut a)
    }

    /// `out (n, d)` = rows `rows[0..n]` of `h (.., d)`, as bf16 or f32.
    pub(crate) fn gather_rows(
        &self,
        (h, rows, out): (u64, u64, u64),
        n: usize,
        d: usize,
        bf16: bool,
    ) -> Result<()> {
        let (ni, di, bi) = (to_i32("rows", n)?, to_i32("width", d)?, flag(bf16));
        let mut a: Vec<*mut c_void> = vec![
            &h as *const u64 as *mut c_void,
            &rows as *const u64 as *mut c_void,
            &out as *const u64 as *mut c_void,
            &ni as *const i32 as *mut c_void,
            &di as *const i32 as *mut c_void,
            &bi as *const i32 as *mut c_void,
        ];
        self.elementwise("gather_rows", n * d, &mut a)
    }

    /// Row `rows[i]` of `dst (.., d)` = row `i` of `src (n, d)`.
    pub(crate) fn scatter_rows(
        &self,
        src: u64,
        rows: u64,
        dst: u64,
        n: usize,
        d: usize,
    ) -> Result<()> {
        let (ni, di) = (to_i32("rows", n)?, to_i32("width", d)?);
        let mut a: Vec<*mut c_void> = vec![
            &src as *const u64 as *mut c_void,
            &rows as *const u64 as *mut c_void,
            &dst as *const u64 as *mut c_void,
            &ni as *const i32 as *mut c_void,
            &di as *const i32 as *mut c_void,
        ];
        self.elementwise("scatter_rows", n * d, &mut a)
    }

    /// The output layer's row kernel over `rows` rows of `vocab` logits at `z`: log p of each
    /// row's target into `logp`, whether it is the argmax into `hit`, and with `g` (one weight
    /// per row) the gradient of `Σ g · logp` w.r.t. the logits into `dzb` (bf16) or `dzf` (f32).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn head_rows(
        &self,
        z: u64,
        (rows, vocab): (usize, usize),
        targets: u64,
        g: u64,
        cap: f32,
        (logp, hit): (u64, u64),
        (dzb, dzf): (u64, u64),
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Train, "head_rows")?;
        let v = to_i32("vocabulary", vocab)?;
        let grid = u32::try_from(rows).map_err(|_| shape(format!("{rows} rows")))?;
        launch!(self, f, (grid, 1, 1), (512, 1, 1), 0; z, v, targets, g, cap, logp, hit, dzb, dzf)
    }

    /// Whether the tensor-core attention kernels take this head width.
    pub(crate) fn attention_tc(dh: usize) -> bool {
        dh == 64 || dh == 128
    }

    /// The training attention forward: `out (N, H*Dh)` and `lse (N, H)`.
    pub(crate) fn attention_train(&self, a: &AttnArgs, out: u64, lse: u64) -> Result<()> {
        if a.n == 0 {
            return Ok(());
        }
        self.bind()?;
        let (ni, hi, hkvi) = (
            to_i32("rows", a.n)?,
            to_i32("heads", a.heads)?,
            to_i32("kv heads", a.kv_heads)?,
        );
        let (seq, window, cap, scale) = (a.seq, a.window, a.cap, a.scale);
        let dh = a.head_dim;
        if Self::attention_tc(dh) {
            let (qb, kb, vb) = self.attention_bf16(a)?;
            let (qp, kp, vp) = (self.addr(&qb), self.addr(&kb), self.addr(&vb));
            let f = self.function(Program::TrainAttn, &format!("ta_fwd_{dh}"))?;
            let smem = 5 * 64 * (dh + 8) * 2;
            launch!(self, f, (blocks(a.n, 64)?, a.heads as u32, 1), (128, 1, 1), smem;
                qp, kp, vp, seq, out, lse, ni, hi, hkvi, window, cap)
        } else {
            let f = self.function(Program::TrainAttn, "ta_fwd_simt")?;
            let (q, k, v, dhi) = (a.q, a.k, a.v, to_i32("head width", dh)?);
            launch!(self, f, (blocks(a.n * a.heads * 32, 128)?, 1, 1), (128, 1, 1), 0;
                q, k, v, seq, out, lse, ni, hi, hkvi, dhi, scale, window, cap)
        }
    }

    /// bf16 copies of q (times the score scale), k and v for the tensor-core kernels.
    fn attention_bf16(
        &self,
        a: &AttnArgs,
    ) -> Result<(CudaSlice<u16>, CudaSlice<u16>, CudaSlice<u16>)> {
        let (nq, nk) = (a.n * a.heads * a.head_dim, a.n * a.kv_heads * a.head_dim);
        let (qb, kb, vb) = (
            self.scratch::<u16>(nq)?,
            self.scratch::<u16>(nk)?,
            self.scratch::<u16>(nk)?,
        );
        self.to_bf16(a.q, self.addr(&qb), nq, a.scale)?;
        self.to_bf16(a.k, self.addr(&kb), nk, 1.0)?;
        self.to_bf16(a.v, self.addr(&vb), nk, 1.0)?;
        Ok((qb, kb, vb))
    }

    /// The training attention backward from `dout`, the forward's `out` and `lse`: `dq (N, H*Dh)`,
    /// `dk, dv (N, Hkv*Dh)`.
    pub(crate) fn attention_backward(
        &self,
        a: &AttnArgs,
        (out, lse, dout): (u64, u64, u64),
        (dq, dk, dv): (u64, u64, u64),
    ) -> Result<()> {
        if a.n == 0 {
            return Ok(());
        }
        self.bind()?;
        let dh = a.head_dim;
        let (ni, hi, hkvi, dhi) = (
            to_i32("rows", a.n)?,
            to_i32("heads", a.heads)?,
            to_i32("kv heads", a.kv_heads)?,
            to_i32("head width", dh)?,
        );
        let (seq, window, cap, scale) = (a.seq, a.window, a.cap, a.scale);
        let rows = a.n * a.heads;
        let dd = self.scratch::<f32>(rows)?;
        let ddp = self.addr(&dd);
        let tc = Self::attention_tc(dh);
        let dob = if tc {
            Some(self.scratch::<u16>(rows * dh)?)
        } else {
            None
        };
        let dobp = dob.as_ref().map_or(0, |b| self.addr(b));
        let prep = self.function(Program::TrainAttn, "ta_prep")?;
        let rows_i = rows as i64;
        launch!(self, prep, (blocks(rows * 32, 256)?, 1, 1), (256, 1, 1), 0; dout, out, ddp, dobp, rows_i, dhi)?;
        if tc {
            let (qb, kb, vb) = self.attention_bf16(a)?;
            let (qp, kp, vp) = (self.addr(&qb), self.addr(&kb), self.addr(&vb));
            let f = self.function(Program::TrainAttn, &format!("ta_dq_{dh}"))?;
            let smem = 6 * 64 * (dh + 8) * 2;
            launch!(self, f, (blocks(a.n, 64)?, a.heads as u32, 1), (128, 1, 1), smem;
                qp, kp, vp, dobp, lse, ddp, seq, dq, ni, hi, hkvi, scale, window, cap)?;
            let f = self.function(Program::TrainAttn, &format!("ta_dkdv_{dh}"))?;
            let smem = 6 * 64 * (dh + 8) * 2 + 2 * 64 * 12;
            launch!(self, f, (blocks(a.n, 64)?, a.kv_heads as u32, 1), (128, 1, 1), smem;
                qp, kp, vp, dobp, lse, ddp, seq, dk, dv, ni, hi, hkvi, window, cap)
        } else {
            let (q, k, v) = (a.q, a.k, a.v);
            let f = self.function(Program::TrainAttn, "ta_dq_simt")?;
            launch!(self, f, (blocks(rows * 32, 128)?, 1, 1), (128, 1, 1), 0;
                q, k, v, dout, lse, ddp, seq, dq, ni, hi, hkvi, dhi, scale, window, cap)?;
            let f = self.function(Program::TrainAttn, "ta_dkdv_simt")?;
            launch!(self, f, (blocks(a.n * a.kv_heads * 32, 128)?, 1, 1), (128, 1, 1), 0;
                q, k, v, dout, lse, ddp, seq, dk, dv, ni, hi, hkvi, dhi, scale, window, cap)
        }
    }
}
