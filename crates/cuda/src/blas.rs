//! Prefill products through cuBLAS, loaded at run time like the driver (`dlopen`; absent
//! library: our tiled kernel does the work, nothing fails).
//!
//! `out (T, R) = x (T, C) · Wᵀ` for prefill-sized T: the weight is dequantized to f16 rows (dense
//! f16 weights are used as they are) in chunks of at most [`WBUF_ELEMS`] elements, and cuBLAS
//! multiplies with f32 accumulation into the f32 output. By default ([`PrefillGemm::Pairs`]) each
//! activation and each dequantized weight is a pair of f16, hi + lo, whose sum carries about 22
//! bits of the value, and the products Wh·hi + Wl·hi + Wh·lo take two cuBLAS calls: near-f32
//! products (the synthesized 8B Q4_K_M's prefill against the f32 reference: 99/100 argmax, mean
//! KL 3.7e-6, against 96/100 and 3.7e-5 with one f16 pass) at half the speed of one pass ([`PrefillGemm::F16`], whose operands carry the same f16
//! rounding as the tiled kernel's shared-memory tiles).
//!
//! Not used while a graph is being captured (the scratch may have to grow) nor for small T,
//! where dequantizing the whole weight costs more than the tiled kernel's on-the-fly reads.

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use cudarc::cublas::{result as bres, sys as bsys, CudaBlas};
use cudarc::driver::{sys, CudaSlice, DevicePtr, DeviceRepr, ValidAsZeroBits};

use super::ops::launch;
use super::weight::DEQH_KERNEL;
use super::{cuda_err, CudaDev, DeviceWeight, Program};
use hf2q_tensor::{Error, Result};

/// Largest dequantized weight chunk, in f16 elements (256 MiB): an 8B model's biggest matrices
/// (14336 x 4096) fit whole even as pairs (twice the elements); a vocabulary-sized output matrix
/// takes several chunks of equal size. Chunks of a thousand or two rows left cuBLAS too few
/// output tiles for the H200's 132 multiprocessors at 512 tokens: with 32 Mi elements the 8B
/// Q4_K_M's pp512 was 7.4k tokens/s on pairs and 16.8k on one pass, with 128 Mi 10.3k and 21.1k.
const WBUF_ELEMS: usize = 128 << 20;

/// cuBLAS's scratch (its guide asks 32 MiB on Hopper); given up front so it never allocates.
const WORKSPACE_BYTES: usize = 32 << 20;

/// Which kernel multiplies prefill-sized batches (more than 8 tokens).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillGemm {
    /// cuBLAS on f16 pairs: each activation and each dequantized weight as hi + lo, two f16
    /// whose sum carries about 22 bits of the value, and the products Wh·hi + Wl·hi + Wh·lo
    /// (the dropped Wl·lo is about 2^-22 of the sum) with f32 sums: near-f32 products at about
    /// twice the cost of one pass (three times the tensor-core work of one pass, twice its weight
    /// writes; an f16 or bf16 weight, exact in f16 already, twice the work). Our tiled kernel
    /// where cuBLAS is absent or the shape does not allow it. The default.
    #[default]
    Pairs,
    /// cuBLAS on f16 operands, one pass (each product off by up to ~2^-10 relative): the
    /// fastest, the least close to the f32 reference. Our tiled kernel where cuBLAS is absent.
    F16,
    /// The 8-bit integer kernel (`kernels/mmq.cuh`: the activations rounded as the CPU fast
    /// path rounds them, exact integer products with the weights' codes) for the formats that
    /// have it, else as `Pairs`: about as close as pairs, several times slower (cuda/NOTES.md).
    Int8,
    /// Always our tiled kernel (`kernels/linear.cuh`, f16 operands).
    Tiled,
}

impl PrefillGemm {
    /// From its name (the `gemm` option): `pairs`, `f16`, `int8` or `tiled`.
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "pairs" => Self::Pairs,
            "f16" => Self::F16,
            "int8" => Self::Int8,
            "tiled" => Self::Tiled,
            _ => return None,
        })
    }

    /// Its name, as [`PrefillGemm::from_name`] takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Pairs => "pairs",
            Self::F16 => "f16",
            Self::Int8 => "int8",
            Self::Tiled => "tiled",
        }
    }
}

/// The cuBLAS state of a device, made on first use.
pub(crate) enum BlasSlot {
    Untried,
    /// The library is not there (or would not start): the tiled kernel does the work.
    Missing,
    Ready(Box<BlasState>),
}

pub(crate) struct BlasState {
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
    wbuf: Option<CudaSlice<u16>>,
    xbuf: Option<CudaSlice<u16>>,
}

/// Fewest tokens for which the cuBLAS path is used: every batch past the matrix-vector kernels'
/// range (T <= 8). Dequantizing the whole weight costs a write and a read of 2 bytes per weight,
/// yet from T = 16 on that is several times faster than our tiled kernel on the H200 (bench_ops
/// `gemm` rows, cuda/NOTES.md).
pub(crate) const MIN_TOKENS: usize = 9;

fn blas_err(what: &str) -> impl FnOnce(bres::CublasError) -> Error + '_ {
    move |e| Error::Msg(format!("cublas: {what}: {e:?}"))
}

/// The device address of scratch `buf`, first replaced by one of `n` elements if it holds fewer
/// (the prefill products' scratch: here and in `mmq.rs`).
pub(crate) fn grow<T: DeviceRepr + ValidAsZeroBits>(
    dev: &CudaDev,
    buf: &mut Option<CudaSlice<T>>,
    n: usize,
) -> Result<u64> {
    if buf.as_ref().is_none_or(|b| b.len() < n) {
        *buf = None; // free the old one first
        *buf = Some(dev.alloc::<T>(n)?);
    }
    let b = buf.as_ref().expect("just allocated");
    Ok(b.device_ptr(dev.stream()).0)
}

impl CudaDev {
    /// Picks the prefill product kernel (the default is [`PrefillGemm::Pairs`], or what the
    /// `gemm` option sets at open).
    pub fn set_prefill_gemm(&self, g: PrefillGemm) {
        self.gemm.store(g as u8, Ordering::Relaxed);
    }

    /// Caps the dequantized weight chunk at `elems` f16 elements (0: the default), so that
    /// tests can run the chunked path on small matrices.
    #[doc(hidden)]
    pub fn set_blas_chunk(&self, elems: usize) {
        self.blas_chunk.store(elems, Ordering::Relaxed);
    }

    pub fn prefill_gemm(&self) -> PrefillGemm {
        match self.gemm.load(Ordering::Relaxed) {
            x if x == PrefillGemm::Tiled as u8 => PrefillGemm::Tiled,
            x if x == PrefillGemm::Int8 as u8 => PrefillGemm::Int8,
            x if x == PrefillGemm::F16 as u8 => PrefillGemm::F16,
            _ => PrefillGemm::Pairs,
        }
    }

    /// Whether cuBLAS is loaded and working on this device (tries to start it).
    pub fn blas_available(&self) -> bool {
        let Ok(mut slot) = self.blas.lock() else {
            return false;
        };
        self.start_blas(&mut slot);
        matches!(*slot, BlasSlot::Ready(_))
    }

    fn start_blas(&self, slot: &mut BlasSlot) {
        if !matches!(slot, BlasSlot::Untried) {
            return;
        }
        *slot = BlasSlot::Missing;
        // SAFETY: only probes for the library file.
        if !unsafe { bsys::is_culib_present() } {
            return;
        }
        let Ok(blas) = CudaBlas::new(self.stream.clone()) else {
            return;
        };
        let Ok(ws) = self.alloc::<u8>(WORKSPACE_BYTES) else {
            return;
        };
        let wp = ws.device_ptr(self.stream()).0;
        // SAFETY: a live handle and a live device buffer of that many bytes, kept as long as the
        // handle (both in `BlasState`).
        let st = unsafe {
            bsys::cublasSetWorkspace_v2(*blas.handle(), wp as *mut c_void, WORKSPACE_BYTES)
        };
        if st != bsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return;
        }
        *slot = BlasSlot::Ready(Box::new(BlasState {
            blas,
            _workspace: ws,
            wbuf: None,
            xbuf: None,
        }));
    }

    /// The cuBLAS handle on this device's stream (started on first use), or `None` where the
    /// library is missing. The handle lives as long as the device (the slot is never emptied
    /// once ready); one thread drives the stream, as for every op.
    pub(crate) fn blas_handle(&self) -> Result<Option<bsys::cublasHandle_t>> {
        let mut slot = self
            .blas
            .lock()
            .map_err(|_| Error::Msg("cuda: cuBLAS lock poisoned".into()))?;
        self.start_blas(&mut slot);
        Ok(match &*slot {
            BlasSlot::Ready(st) => Some(*st.blas.handle()),
            _ => None,
        })
    }

    pub(crate) fn capturing(&self) -> Result<bool> {
        let s = self
            .stream
            .capture_status()
            .map_err(cuda_err("reading the capture status"))?;
        Ok(s != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// `out (t, R) = x (t, C) · Wᵀ (+ bias)` through cuBLAS; `Ok(false)` (nothing enqueued) when
    /// this path does not apply and the caller should use its own kernel. Pointers are device
    /// addresses whose sizes the caller checked.
    pub(crate) fn blas_linear(
        &self,
        xp: u64,
        t: usize,
        w: &DeviceWeight,
        bias: u64,
        op: u64,
    ) -> Result<bool> {
        if self.prefill_gemm() == PrefillGemm::Tiled
            || t < MIN_TOKENS
            || !w.cols.is_multiple_of(8)
            || !xp.is_multiple_of(16)
            || self.capturing()?
        {
            return Ok(false);
        }
        let mut slot = self
            .blas
            .lock()
            .map_err(|_| Error::Msg("cuda: cuBLAS lock poisoned".into()))?;
        self.start_blas(&mut slot);
        let BlasSlot::Ready(st) = &mut *slot else {
            return Ok(false);
        };
        let (rows, cols) = (w.rows, w.cols);
        let (ri, ci, ti) = (
            rows as i32,
            cols as i32,
            i32::try_from(t).map_err(|_| {
                Error::Shape(format!("cuda: {t} tokens in one product is too many"))
            })?,
        );
        let pairs = self.prefill_gemm() != PrefillGemm::F16;
        let n = (t * cols) as i64;
        // Single pass: x as f16, t rows of C. Pairs: t rows of [hi | hi | lo] (`to_f16_pairs`).
        let xw = if pairs { 3 * cols } else { cols };
        let xh = grow(self, &mut st.xbuf, t * xw)?;
        let grid = u32::try_from((t * cols).div_ceil(4 * 256))
            .map_err(|_| Error::Shape("cuda: product input too large".into()))?;
        if pairs {
            let f = self.function(Program::Elementwise, "to_f16_pairs")?;
            launch!(self, f, (grid, 1, 1), (256, 1, 1), 0; xp, xh, ci, n)?;
        } else {
            let f = self.function(Program::Elementwise, "to_f16")?;
            launch!(self, f, (grid, 1, 1), (256, 1, 1), 0; xp, xh, n)?;
        }
        // A dense f16 weight is its own exact operand; any other is dequantized per chunk of
        // rows, as f16 (lda = C) or, for pairs, as [Wh | Wl] per row (lda = 2C). A bf16 weight
        // needs no lo: its 8 significand bits fit f16's 11, exactly from 2^-14 up, and below
        // that f16's subnormals keep it to 2^-25, as the pairs keep any remainder.
        let dense = w.kind == "f16";
        let split_w = pairs && !dense && w.kind != "bf16";
        let ww = if split_w { 2 * cols } else { cols };
        let chunk = if dense {
            rows
        } else {
            let cap = match self.blas_chunk.load(Ordering::Relaxed) {
                0 => WBUF_ELEMS,
                n => n,
            };
            // As many chunks as the cap needs, of equal rows (a multiple of eight, so each
            // chunk's output starts 32-byte aligned).
            let most = ((cap / ww) & !7).max(8);
            rows.div_ceil(rows.div_ceil(most))
                .next_multiple_of(8)
                .min(rows)
        };
        let wa = w.args(self);
        let wh = if dense {
            0
        } else {
            grow(self, &mut st.wbuf, chunk * ww)?
        };
        let deqh = &w.kernels[DEQH_KERNEL];
        let handle = *st.blas.handle();
        let (one, zero) = (1.0f32, 0.0f32);
        let wwi = ww as i32;
        let xwi = xw as i32;
        for r0 in (0..rows).step_by(chunk) {
            let nr = chunk.min(rows - r0);
            let a = if dense {
                wa.data + (r0 * cols * 2) as u64
            } else {
                let (r0i, nri) = (r0 as i32, nr as i32);
                let lo = if split_w { wh + (cols * 2) as u64 } else { 0 };
                let grid = u32::try_from((nr * cols / 8).div_ceil(256))
                    .map_err(|_| Error::Shape("cuda: weight chunk too large".into()))?;
                launch!(self, deqh, (grid, 1, 1), (256, 1, 1), 0; wa, wh, lo, wwi, r0i, nri)?;
                wh
            };
            let out = op + (r0 * 4) as u64;
            // (k, B's offset in elements, beta) of each product: one pass, or for pairs
            // [Wh | Wl]·[hi; hi] then Wh·lo added (an f16 or bf16 weight: W·hi, then W·lo).
            let passes: &[(i32, u64, &f32)] = match (pairs, split_w) {
                (false, _) => &[(ci, 0, &zero)],
                (true, true) => &[(2 * ci, 0, &zero), (ci, 2 * cols as u64, &one)],
                (true, false) => &[(ci, 0, &zero), (ci, 2 * cols as u64, &one)],
            };
            for &(k, boff, beta) in passes {
                self.count_launch();
                // Column-major view: out is (R, t) with leading dimension R, W is (k, R) read
                // transposed, x is (k, t); this chunk writes rows r0 .. r0 + nr of every token.
                // SAFETY: a live handle on this device's stream; a holds nr rows of lda
                // elements, the activation buffer t rows of xw (k + boff <= xw), out t x R
                // (checked by the caller and sized above).
                unsafe {
                    bres::gemm_ex(
                        handle,
                        bsys::cublasOperation_t::CUBLAS_OP_T,
                        bsys::cublasOperation_t::CUBLAS_OP_N,
                        nr as i32,
                        ti,
                        k,
                        &one as *const f32 as *const c_void,
                        a as *const c_void,
                        bsys::cudaDataType_t::CUDA_R_16F,
                        wwi,
                        (xh + 2 * boff) as *const c_void,
                        bsys::cudaDataType_t::CUDA_R_16F,
                        xwi,
                        beta as *const f32 as *const c_void,
                        out as *mut c_void,
                        bsys::cudaDataType_t::CUDA_R_32F,
                        ri,
                        bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(blas_err(&format!("product with '{}'", w.name)))?;
            }
        }
        if bias != 0 {
            let f = self.function(Program::Elementwise, "add_bias_rows")?;
            let n = (t * rows) as i64;
            let grid = u32::try_from((t * rows).div_ceil(256))
                .map_err(|_| Error::Shape("cuda: product output too large".into()))?;
            launch!(self, f, (grid, 1, 1), (256, 1, 1), 0; op, bias, n, ri)?;
        }
        Ok(true)
    }
}
