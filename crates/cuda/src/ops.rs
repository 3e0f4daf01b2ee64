//! The ops: Rust launchers for the kernels in `kernels/`, one method of [`CudaDev`] each.
//!
//! Every method checks its shapes against the buffers it is given (sizes are explicit, so
//! buffers may be larger than one call needs, e.g. preallocated for the longest prompt),
//! enqueues its kernels on the device's stream and returns without waiting. Positions are a
//! device i32 (`pos0`), read by the kernels at run time.

use std::ffi::c_void;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use cudarc::driver::DeviceRepr;

use super::backend::Raw;
use super::weight::{
    mt_kernel, mv_kernel, DeviceWeight, MvFns, WeightArgs, EMBED_KERNEL, GEMM_KERNEL,
};
use super::{cuda_err, CudaDev, Program};
use hf2q_tensor::op::{AttentionParams, RopeParams, RopeStyle};
use hf2q_tensor::{Error, Result};

/// Shared memory of the prefill attention kernel at Dh = 256: Q (16 x Dh), K (32 x (Dh + 1)) and
/// V (32 x Dh) tiles in f32.
pub(crate) const PREFILL_MAX_SMEM: usize = prefill_smem(256);

/// The same at Dh = 512 (160 KB), for the kernels of 16 dims per lane (`attn_prefill_*_16`),
/// whose limit alone is raised that far (the others keep theirs).
pub(crate) const PREFILL_WIDE_SMEM: usize = prefill_smem(MAX_HEAD_DIM);

/// Widest head the kernels of 8 dims per lane take (wider ones take 16 per lane).
const NARROW_HEAD_DIM: usize = 256;

/// Completion counters of the kernels whose last block finishes the work (one-token attention:
/// one per kv head and head chunk; argmax: one per row), allocated zeroed with the device; every kernel leaves them
/// at zero (kernels never overlap: each waits for its predecessor).
pub(crate) const COUNTERS: usize = 4096;

/// Blocks per row of the argmax kernel (`ARGMAX_BLOCKS` in elementwise.cu) and rows per launch
/// (the partials buffer holds `ARGMAX_ROWS * ARGMAX_BLOCKS` keys).
pub(crate) const ARGMAX_BLOCKS: usize = 128;
pub(crate) const ARGMAX_ROWS: usize = 64;

const fn prefill_smem(dh: usize) -> usize {
    (16 * dh + 32 * (dh + 1) + 32 * dh) * 4
}

/// The kernels' flag bit asking for the weights' L2 prefetch (`MV_PREFETCH` in matvec.cuh).
const MV_PREFETCH: i32 = 1;

/// Most rows one launch of the tensor-core small-batch kernels takes (`linear_tc.cuh`: 8 x NT, NT
/// up to 8).
const TC_MAX_ROWS: usize = 64;

/// When the 8-bit one-token products apply ([`CudaDev::set_matvec_int8`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MvMode {
    Off = 0,
    /// Where it measured faster (the default).
    Auto = 1,
    /// For every product that can use it (tests, experiments).
    All = 2,
}

impl MvMode {
    fn from_u8(v: u8) -> MvMode {
        match v {
            0 => MvMode::Off,
            2 => MvMode::All,
            _ => MvMode::Auto,
        }
    }
    /// Whether the setting applies where its automatic rule says `auto`.
    fn allows(self, auto: bool) -> bool {
        match self {
            MvMode::Off => false,
            MvMode::Auto => auto,
            MvMode::All => true,
        }
    }
}

/// Rows per row group of a format's plain `mvf` and gated `mvg` kernels (`RPW` and `GNR` in
/// matvec.cuh, chosen by measurement).
pub(super) fn mvf_rows_per_group(kind: &str) -> (usize, usize) {
    match kind {
        "q8_0s" => (4, 2),
        "q4_k" => (4, 2),
        "q6_kp" => (2, 1),
        _ => (2, 2),
    }
}

/// Whether a one-token launch of format `kind` (`weights` in all, `rows` rows of its first
/// matrix, folding its input's norm when `normed`) takes the persistent kernels by default, where
/// they measured faster (cuda/NOTES.md):
/// * Q4_0 and re-laid Q4_K launches of at least 24M weights (an 8B's gate/up, down, and q/k/v
///   together: Q4_0 14336 x 4096 22.1 -> 13.1 us, 6144 x 4096 11.8 -> 8.7); smaller ones
///   (4096 x 4096, every 1B product) are faster on the f32 kernels, stored Q4_K lost;
/// * Q8_0 launches that large which fold their input's norm (an 8B's q/k/v and gate/up: the norm
///   kernel goes), and output layers (128256 x 4096: 151.6 -> 132.2 us): 8B Q8_0 307 -> 339
///   tokens/s, 1B 1096-1114 -> 1120-1126; its down projection stays on the f32 kernel (19.3 vs
///   22.0 us);
/// * re-laid Q6_K (only output layers are, by default: 128256 x 2048 89.2 -> 57.5 us).
fn p8_by_default(kind: &str, weights: usize, rows: usize, normed: bool) -> bool {
    match kind {
        "q4_0s" | "q4_ks" => weights >= P8_MIN_WEIGHTS,
        "q8_0s" => (normed && weights >= P8_MIN_WEIGHTS) || rows >= P8_MIN_ROWS,
        "q6_ks" => weights >= P8_MIN_WEIGHTS || rows >= P8_MIN_ROWS,
        _ => false,
    }
}

/// [`CudaDev::mv_split`] on a GPU of `sms` multiprocessors (four warps per block).
fn mv_split_for(rows: usize, cols: usize, rows_per_group: usize, sms: usize) -> usize {
    let want = 4 * sms;
    let nb = cols / 32;
    let mut ks = 1usize;
    while ks < 4 && rows.div_ceil(rows_per_group * (4 / ks)) < want && nb >= 64 * ks {
        ks *= 2;
    }
    ks
}

/// Fewest weights of a launch that takes the persistent kernels by default (and of a Q4_K matrix
/// re-laid for them at upload, weight.rs).
pub(crate) const P8_MIN_WEIGHTS: usize = 24 << 20;

/// Fewest rows of a Q8_0 or re-laid Q6_K launch that takes the persistent kernels whatever its
/// size, and of a Q6_K matrix re-laid for them: an output layer's (its 128256 rows amortize the
/// staging of the input in every block).
const P8_MIN_ROWS: usize = 65536;

/// Warps per block of the persistent kernels (`MP_WARPS` in `kernels/matvec_p8.cuh`) and rows
/// per row group of their gated form (`GNR` of its formats: the same for all).
const MP_WARPS: usize = 8;
const MP_GATED_ROWS: usize = 2;

/// Dynamic shared memory of a persistent kernel for `cols` columns (`mp_stage`): four planes of
/// 16 bytes per 32 columns, each padded by 16, then four sums and two scales per 32 columns.
fn mp_smem(cols: usize) -> usize {
    let nb = cols / 32;
    4 * (16 * nb + 16) + 24 * nb
}

/// The one-token kernels chosen for a weight ([`CudaDev::mv_kernels`]).
struct MvKernels<'w> {
    fns: &'w MvFns,
    flags: i32,
    smem: usize,
    persistent: bool,
}

impl MvKernels<'_> {
    /// The chosen family's gated or plain kernel, with the norm folded in when `norm`; an error
    /// naming `w` where the family has no folded form ([`CudaDev::folds_norm`] says which do).
    fn pick(
        &self,
        gated: bool,
        norm: bool,
        w: &DeviceWeight,
    ) -> Result<&cudarc::driver::CudaFunction> {
        self.fns.pick(gated, norm).ok_or_else(|| {
            shape(format!(
                "matvec: '{}': these one-token kernels do not fold an RMSNorm in",
                w.name
            ))
        })
    }
}

/// One matrix of a fused one-token launch; mirrors `struct MvJob` in `kernels/matvec.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct MvJob {
    w: WeightArgs,
    bias: u64,
    out: u64,
    rows: i32,
    cta0: i32,
    ks: i32,
    pad: i32,
}

/// The RMSNorm folded into a one-token product; mirrors `struct MvNorm` in
/// `kernels/matvec.cuh` (`w` 0: none).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MvNormArgs {
    w: u64,
    eps: f32,
    offset: f32,
}

/// Mirrors `struct MvJobs` in `kernels/matvec.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct MvJobs {
    j: [MvJob; 3],
    n: i32,
    accumulate: i32,
    flags: i32,
    pad: i32,
    norm: MvNormArgs,
}

// SAFETY: plain #[repr(C)] structs of integers and floats with the layout of the device structs.
unsafe impl DeviceRepr for MvJob {}
unsafe impl DeviceRepr for MvJobs {}
unsafe impl DeviceRepr for MvNormArgs {}

/// An RMSNorm of a one-token product's input, folded into the product: the input `x` is
/// replaced by `x / rms(x) * (w + offset)` (the `rms_norm` op's formula).
pub struct RowNorm<'a> {
    /// `cols` weights.
    pub w: &'a CudaSlice<f32>,
    pub eps: f32,
    pub offset: f32,
}

/// Settings of one draw of the device sampler (`sample_topk` in elementwise.cu, the CPU
/// sampler's top-k, top-p, min-p, temperature and draw): mirrors `struct SampleArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SampleArgs {
    /// Uniform in `[0, 1)`: the draw.
    pub u: f64,
    pub top_p: f32,
    pub min_p: f32,
    /// > 0.
    pub temperature: f32,
    /// `1..=SAMPLE_MAX_K`.
    pub top_k: i32,
}

// SAFETY: a plain #[repr(C)] struct of numbers with the layout of the device struct.
unsafe impl DeviceRepr for SampleArgs {}
unsafe impl cudarc::driver::ValidAsZeroBits for SampleArgs {}

/// Most candidates the device sampler keeps (`SAMPLE_MAX_K`): larger top-k (or none) samples on
/// the host.
pub const SAMPLE_MAX_K: usize = 1024;

/// An f32 output buffer of a multi-output launch, as a trait object (the outputs of one
/// [`CudaDev::linear_many`] call may be different buffer types).
pub trait DevicePtrMutF32 {
    fn len_f32(&self) -> usize;
    fn ptr_f32(&mut self, dev: &CudaDev) -> u64;
}

impl<T: DevicePtrMut<f32>> DevicePtrMutF32 for T {
    fn len_f32(&self) -> usize {
        self.len()
    }
    fn ptr_f32(&mut self, dev: &CudaDev) -> u64 {
        self.device_ptr_mut(dev.stream()).0
    }
}

/// Largest head width the attention kernels take (Gemma 4's global layers): multiples of 8 up
/// to 256, of 16 above.
pub const MAX_HEAD_DIM: usize = 512;

/// Enqueues `func` with the given arguments, each a local of exactly the kernel parameter's C
/// type (u64 for pointers, i32, i64, f32, or `WeightArgs`).
macro_rules! launch {
    ($dev:expr, $func:expr, $grid:expr, $block:expr, $smem:expr; $($arg:ident),* $(,)?) => {{
        let mut params: Vec<*mut c_void> = vec![$(&$arg as *const _ as *mut c_void),*];
        $dev.count_launch();
        // SAFETY: the argument list matches the kernel's parameter list (types and order are
        // kept in step with the .cu source), every pointer is a live device allocation whose size
        // the caller checked, and `params` outlives the call.
        unsafe {
            $dev.launch_raw($func.cu_function(), $grid, $block, $smem as u32, &mut params)
        }
        .map_err(cuda_err(format_args!("launching {}", stringify!($func))))
    }};
}
pub(crate) use launch;

pub(crate) fn shape(msg: String) -> Error {
    Error::Shape(format!("cuda: {msg}"))
}

pub(crate) fn need(what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        return Err(shape(format!(
            "{what} holds {have} elements, {want} needed"
        )));
    }
    Ok(())
}

/// A product's input and output hold at least `w`'s columns and rows.
fn need_linear(w: &DeviceWeight, input: usize, output: usize) -> Result<()> {
    need(&format!("linear '{}' input", w.name), input, w.cols)?;
    need(&format!("linear '{}' output", w.name), output, w.rows)
}

pub(crate) fn to_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| shape(format!("{what} = {v} does not fit 32 bits")))
}

pub(crate) fn blocks(n: usize, per: usize) -> Result<u32> {
    u32::try_from(n.div_ceil(per)).map_err(|_| shape(format!("{n} elements is too many")))
}

/// Head dims each lane of the attention kernels holds for heads of width `dh` (the `DPL` of
/// their names); an error for a width no kernel takes.
pub(crate) fn dims_per_lane(dh: usize) -> Result<usize> {
    let step = if dh > NARROW_HEAD_DIM { 16 } else { 8 };
    if dh == 0 || !dh.is_multiple_of(step) || dh > MAX_HEAD_DIM {
        return Err(shape(format!(
            "attention: head width {dh} (a multiple of 8 up to {NARROW_HEAD_DIM}, of 16 up to \
             {MAX_HEAD_DIM})"
        )));
    }
    Ok(if dh <= 64 {
        2
    } else if dh <= 128 {
        4
    } else if dh <= NARROW_HEAD_DIM {
        8
    } else {
        16
    })
}

/// Query heads one decode attention block takes (`AD_HEADS` in attention.cu).
pub(crate) fn heads_per_block(dh: usize) -> Result<usize> {
    Ok(if dims_per_lane(dh)? >= 16 { 4 } else { 8 })
}

/// Element type of a KV cache on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvDtype {
    /// Half precision: half the memory and bandwidth; values rounded once on write.
    #[default]
    F16,
    F32,
}

/// The device cache type for a host [`hf2q_tensor::kv::KvType`]; the block types (Q8_0 ...) and
/// mlx-lm's affine layouts have no device kernels yet and are refused, naming the type.
impl TryFrom<hf2q_tensor::kv::KvType> for KvDtype {
    type Error = Error;
    fn try_from(t: hf2q_tensor::kv::KvType) -> Result<Self> {
        use hf2q_tensor::kv::KvType;
        match t {
            KvType::F16 => Ok(KvDtype::F16),
            KvType::F32 => Ok(KvDtype::F32),
            KvType::Q8_0
            | KvType::Q4_0
            | KvType::Q4_1
            | KvType::Q5_0
            | KvType::Q5_1
            | KvType::Affine(_) => Err(Error::Msg(format!(
                "the CUDA backend has no {} KV cache yet (f16 or f32 on the GPU; a {} cache \
                     runs on the CPU, --device cpu)",
                t.name(),
                t.name()
            ))),
        }
    }
}

/// The device cache type for keys and values of host types `t`: one type the GPU has, else
/// refused (the device cache stores keys and values in one type).
impl TryFrom<hf2q_tensor::kv::KvTypes> for KvDtype {
    type Error = Error;
    fn try_from(t: hf2q_tensor::kv::KvTypes) -> Result<Self> {
        let (k, v) = (KvDtype::try_from(t.k)?, KvDtype::try_from(t.v)?);
        if k != v {
            return Err(Error::Msg(format!(
                "the CUDA backend stores keys and values in one type, not {} (--device cpu)",
                t.name()
            )));
        }
        Ok(k)
    }
}

impl KvDtype {
    pub(crate) fn size(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
    /// A device array of this type's values as f32 on the host (waits for the stream).
    pub(crate) fn download_f32(self, dev: &CudaDev, b: &CudaSlice<u8>) -> Result<Vec<f32>> {
        let raw = dev.download(b)?;
        Ok(match self {
            KvDtype::F16 => raw
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            KvDtype::F32 => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        })
    }
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }
}

/// The key and value cache of one layer: two `(Hkv, S_cap, Dh)` arrays, a head's positions
/// contiguous (the CPU layout, [`hf2q_tensor::op::LayerCache`]).
pub struct DeviceKvCache {
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    dtype: KvDtype,
    n_kv_heads: usize,
    head_dim: usize,
    capacity: usize,
}

impl DeviceKvCache {
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// S_cap: positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The device addresses of the key and the value arrays.
    pub(crate) fn raw_ptrs(&self, dev: &CudaDev) -> (u64, u64) {
        (
            self.k.device_ptr(dev.stream()).0,
            self.v.device_ptr(dev.stream()).0,
        )
    }

    /// Both arrays as f32 on the host (waits for the stream), for tests and inspection.
    pub fn to_host(&self, dev: &CudaDev) -> Result<(Vec<f32>, Vec<f32>)> {
        Ok((
            self.dtype.download_f32(dev, &self.k)?,
            self.dtype.download_f32(dev, &self.v)?,
        ))
    }
}

/// RoPE settings with the inverse frequencies resident on the device (computed once on the host
/// by [`RopeParams::inv_freqs`]).
pub struct RopeTable {
    inv_freq: CudaSlice<f32>,
    style: RopeStyle,
    dims: usize,
    linear_scale: f32,
}

impl RopeTable {
    /// (device address of the inverse frequencies, rotated pairs, NEOX style, linear scale).
    pub(crate) fn parts(&self, dev: &CudaDev) -> (u64, usize, bool, f32) {
        (
            self.inv_freq.device_ptr(dev.stream()).0,
            self.dims / 2,
            self.style == RopeStyle::Neox,
            self.linear_scale,
        )
    }
}

impl CudaDev {
    pub(super) fn ptr<T>(&self, b: &impl DevicePtr<T>) -> u64 {
        b.device_ptr(self.stream()).0
    }
    pub(super) fn ptr_mut<T>(&self, b: &mut impl DevicePtrMut<T>) -> u64 {
        b.device_ptr_mut(self.stream()).0
    }

    /// Rows `ids[0..t]` of `table` (dequantized) times `scale` -> `out (t, C)`. An id outside the
    /// table yields a row of NaN (ids live on the device; the host cannot check them).
    pub fn embedding(
        &self,
        table: &DeviceWeight,
        ids: &impl DevicePtr<u32>,
        t: usize,
        scale: f32,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        need("embedding ids", ids.len(), t)?;
        need("embedding output", out.len(), t * table.cols)?;
        if t == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = &table.kernels[EMBED_KERNEL];
        let w = table.args(self);
        let (idp, op) = (self.ptr(ids), self.ptr_mut(out));
        let (ti, vocab) = (to_i32("tokens", t)?, to_i32("vocabulary", table.rows)?);
        let grid = blocks(t * table.cols.div_ceil(8), 256)?;
        launch!(self, f, (grid, 1, 1), (256, 1, 1), 0; w, idp, op, ti, vocab, scale)
    }

    /// `out (t, R) = x (t, C) · Wᵀ (+ bias)`. t <= 8 runs the matrix-vector kernels (weights read
    /// once for all t tokens), 9..=`batch-tc` the tensor-core small-batch kernels (the same,
    /// on f16 pairs, `linear_tc.cuh`), larger t cuBLAS on f16 pairs or on f16 operands (`blas.rs`), or
    /// the 8-bit integer kernel (`mmq.rs`), or the tiled tensor-core kernel (f16 operands, f32
    /// sums): see [`PrefillGemm`].
    pub fn linear(
        &self,
        x: &impl DevicePtr<f32>,
        t: usize,
        w: &DeviceWeight,
        bias: Option<&CudaSlice<f32>>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        need(&format!("linear '{}' input", w.name), x.len(), t * w.cols)?;
        need(
            &format!("linear '{}' output", w.name),
            out.len(),
            t * w.rows,
        )?;
        if let Some(b) = bias {
            need(&format!("linear '{}' bias", w.name), b.len(), w.rows)?;
        }
        if t == 0 {
            return Ok(());
        }
        self.bind()?;
        let (xp, bp, op) = (
            self.ptr(x),
            bias.map_or(0, |b| self.ptr(b)),
            self.ptr_mut(out),
        );
        if t == 1 && w.fast.is_some() && xp % 16 == 0 {
            let out_p = self.ptr_mut(out);
            return self.launch_mvf(&[(w, bias, out_p)], xp, false, None);
        }
        if t > TC_MAX_ROWS
            && t <= 2 * TC_MAX_ROWS
            && xp % 16 == 0
            && w.cols.is_multiple_of(32)
            && self.tc_rows(TC_MAX_ROWS, w)?
            && self.capturing()?
        {
            // A captured step of 65..=128 rows: two halves on the small-batch kernels, each
            // reading the weight once (see `tc_rows`).
            let first = t.div_ceil(2);
            return self.linear_parts(xp, op, [(0, first), (first, t - first)], w, bias);
        }
        if t > 8 && xp % 16 == 0 && self.tc_rows(t, w)? {
            // A batched decode step on the tensor-core small-batch kernel (linear_tc.cuh).
            let nt = t.div_ceil(8).next_power_of_two().max(2);
            let f = &w.kernels[mt_kernel(nt)];
            // 32 rows per block; warps per block sharing them (the partial sums' shared buffer
            // bounds them: TC_RED_FLOATS / (32 lanes x 2 x nt x 4)), fewer when the row is short.
            let chunks = w.cols / 32;
            let warps = (8192 / (32 * 8 * nt)).min(16).min(chunks.max(1));
            let grid = blocks(w.rows, 32)?;
            let wa = w.args(self);
            let (rows, ti) = (to_i32("rows", w.rows)?, to_i32("tokens", t)?);
            let threads = 32 * warps as u32;
            return launch!(self, f, (grid, 1, 1), (threads, 1, 1), 0; wa, xp, bp, op, rows, ti);
        }
        if t > 8 && t <= self.batch_mv.load(std::sync::atomic::Ordering::Relaxed) {
            // A batched decode step: chunks of 8 rows on the small-batch kernels, each chunk
            // reading the weight once (`batch-mv`).
            let parts = (0..t).step_by(8).map(|t0| (t0, (t - t0).min(8)));
            return self.linear_parts(xp, op, parts, w, bias);
        }
        let wa = w.args(self);
        let (rows, ti) = (to_i32("rows", w.rows)?, to_i32("tokens", t)?);
        if t <= 8 {
            let nt = t.next_power_of_two();
            let f = &w.kernels[mv_kernel(nt)];
            // Four warps per block, each on 1, 2 or 4 rows (`MvShape` in linear.cuh), with ks
            // warps sharing a row when there are too few rows to fill the GPU: the smallest ks
            // giving about eight blocks per multiprocessor, while each lane keeps at least one
            // full unrolled iteration (64 groups of eight per lane-row) of work.
            let rows_per_warp = match nt {
                1 => 1,
                2 | 4 => 2,
                _ => 4,
            };
            let groups = w.cols.div_ceil(8);
            let want = 8 * self.info().multiprocessors as usize;
            let mut ks = 1usize;
            while ks < 4
                && w.rows.div_ceil(4 * rows_per_warp / ks) < want
                && groups >= 2 * ks * 32 * (8 / rows_per_warp)
            {
                ks *= 2;
            }
            let grid = blocks(w.rows, 4 * rows_per_warp / ks)?;
            let ksi = ks as i32;
            launch!(self, f, (grid, 1, 1), (128, 1, 1), 0; wa, xp, bp, op, rows, ti, ksi)
        } else {
            if self.mmq_linear(xp, t, w, bp, op)? || self.blas_linear(xp, t, w, bp, op)? {
                return Ok(());
            }
            let f = &w.kernels[GEMM_KERNEL];
            // 64 tokens x 128 rows per block of eight warps (linear.cuh).
            let (gx, gy) = (blocks(w.rows, 128)?, blocks(t, 64)?);
            if gy > 65535 {
                return Err(shape(format!("linear: {t} tokens in one call is too many")));
            }
            launch!(self, f, (gx, gy, 1), (256, 1, 1), 0; wa, xp, bp, op, rows, ti)
        }
    }

    /// [`CudaDev::linear`] of the input rows `t0..t0 + n` of `x` (at device address `xp`) into
    /// the same rows of `out` (at `op`), for each `(t0, n)` of `parts`: a product cut into
    /// launches that each read the weight once.
    fn linear_parts(
        &self,
        xp: u64,
        op: u64,
        parts: impl IntoIterator<Item = (usize, usize)>,
        w: &DeviceWeight,
        bias: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        for (t0, n) in parts {
            let xs = Raw {
                ptr: xp + 4 * (t0 * w.cols) as u64,
                len: n * w.cols,
                stream: self.stream(),
            };
            let mut os = Raw {
                ptr: op + 4 * (t0 * w.rows) as u64,
                len: n * w.rows,
                stream: self.stream(),
            };
            self.linear(&xs, n, w, bias, &mut os)?;
        }
        Ok(())
    }

    /// Most rows of a product that run as chunks of the small-batch matrix-vector kernels (the
    /// `batch-mv` option).
    pub fn set_batch_mv(&self, rows: usize) {
        self.batch_mv
            .store(rows, std::sync::atomic::Ordering::Relaxed);
    }

    /// Most rows of a product that run the tensor-core small-batch kernels (the `batch-tc`
    /// option; 0: none, at most 64).
    pub fn set_batch_tc(&self, rows: usize) {
        self.batch_tc
            .store(rows.min(64), std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a product of `t` rows (9..=64) with `w` runs the tensor-core small-batch kernels:
    /// `batch-tc` allows `t` (or, while a graph is being captured, any `t` up to 64 when
    /// `batch-tc` is on: cuBLAS cannot be captured, and the tiled prefill kernel it would leave
    /// gives a decode-sized matrix a few dozen 128-row blocks), the width is whole 32-element
    /// chunks and the input rows are 16-byte aligned (they are read as float4).
    fn tc_rows(&self, t: usize, w: &DeviceWeight) -> Result<bool> {
        let limit = self.batch_tc.load(std::sync::atomic::Ordering::Relaxed);
        if w.cols % 32 != 0 || w.cols == 0 || limit == 0 {
            return Ok(false);
        }
        Ok(t <= limit || (t <= TC_MAX_ROWS && self.capturing()?))
    }

    /// Whether one-token products with `w` run the kernels of `matvec.cuh` (and so can be fused:
    /// [`CudaDev::linear_many`], [`CudaDev::linear_gated`]).
    pub fn has_fast_matvec(&self, w: &DeviceWeight) -> bool {
        w.fast.is_some()
    }

    /// Whether one-token products of an RMSNorm of the input (a pre-norm block's q/k/v and
    /// gate/up) fold the norm into the product's kernel (`MvNorm` in matvec.cuh) instead of
    /// running it as a kernel of its own, where the product runs the persistent kernels: their
    /// blocks read the whole input row anyway to stage it (an 8B Q4_0's q/k/v and gate/up: 380
    /// -> 408 tokens/s). Folded into the other kernels, which read their activations per unit,
    /// the norm's weights doubled those loads and cost more than the norm's own kernel (1B Q4_0
    /// 1237 -> 1179), so those kernels have no folded form. Default on; the `norm-fold` option
    /// sets it at open.
    pub fn set_matvec_norm(&self, on: bool) {
        self.mv_norm.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a one-token launch of `w` (with `weights` weights in all: rows times columns of
    /// its matrices, of one of them when gated) folds an RMSNorm of its input in
    /// ([`CudaDev::set_matvec_norm`]; the launch must be one [`CudaDev::has_fast_matvec`] takes).
    pub fn folds_norm(&self, w: &DeviceWeight, weights: usize) -> bool {
        self.mv_norm.load(std::sync::atomic::Ordering::Relaxed)
            && self
                .mv_kernels(w, weights, true)
                .is_some_and(|k| k.fns.normed.is_some())
    }

    /// Whether one-token products may prefetch their weights to L2 before waiting for the
    /// previous kernel (`prefetch_l2` in matvec.cuh). Only the f32-activation Q4_K kernel has the
    /// code (the others measured slower with it). Default off since the kernels load their first
    /// weights before the wait themselves: with both, the 1B Q4_K_M decoded 1097-1113 tokens/s,
    /// without the prefetch 1133 (8B unchanged). The `prefetch` option sets it at open.
    pub fn set_matvec_prefetch(&self, on: bool) {
        self.mv_prefetch
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Which Q4_K matrices later uploads re-lay as "q4_ks" (`q4k_split` in weight.rs): `Auto`
    /// those of at least 24M weights, whose launches take the persistent kernels, where the
    /// layout pays (an 8B's gate/up/down: 8B Q4_K_M 287 -> 359 tokens/s); the smaller ones keep
    /// the stored layout, whose f32 kernel measured about 1 % faster than the re-laid one (1B
    /// Q4_K_M 1135 vs 1117-1127; cuda/NOTES.md). `Off`: none, `All`: every one (tests).
    /// The `q4k-relayout` option at open.
    pub fn set_q4k_relayout(&self, m: MvMode) {
        self.q4k_relay
            .store(m as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a Q4_K matrix of `weights` weights is re-laid at upload.
    pub(crate) fn q4k_relaid(&self, weights: usize) -> bool {
        MvMode::from_u8(self.q4k_relay.load(std::sync::atomic::Ordering::Relaxed))
            .allows(weights >= P8_MIN_WEIGHTS)
    }

    /// Which Q6_K matrices later uploads re-lay as "q6_ks" (`q6k_split` in weight.rs), whose
    /// one-token launches take the persistent kernels: `Auto` output layers (at least 65536
    /// rows); `Off`: none, `All`: every one (tests). The `q6k-relayout` option at open.
    pub fn set_q6k_relayout(&self, m: MvMode) {
        self.q6k_relay
            .store(m as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a Q6_K matrix of `rows` rows is re-laid at upload.
    pub(crate) fn q6k_relaid(&self, rows: usize) -> bool {
        MvMode::from_u8(self.q6k_relay.load(std::sync::atomic::Ordering::Relaxed))
            .allows(rows >= P8_MIN_ROWS)
    }

    /// When one-token products of Q4_0, Q8_0, Q4_K and Q6_K quantize their input to 8 bits per
    /// 32 elements (two terms) and use integer dot products (`matvec_q8.cuh`) instead of f32
    /// activations (`matvec.cuh`). `Auto`: Q8_0 and Q4_K matrices of at least 12288 rows and
    /// 3072-6144 columns (an 8B's gate and up, its output layer), where it measured faster:
    /// each block quantizes the whole input row first, which wider rows (an 8B's down
    /// projection) and latency-bound smaller products do not repay, and the second term costs
    /// Q4_0 what the integer dot saves (cuda/NOTES.md);
    /// the `act8` option at open.
    pub fn set_matvec_int8(&self, m: MvMode) {
        self.mv_act8
            .store(m as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// When one-token products of Q4_0, Q8_0 and Q4_K run the persistent 8-bit kernels
    /// (`matvec_p8.cuh`): `Auto` for Q4_0 and re-laid Q4_K launches of at least 24M weights,
    /// Q8_0 ones that large which fold their input's norm, and Q8_0 output layers;
    /// the `p8` option at open. `blocks_per_sm` (1 or 2; the `p8-blocks` option, default
    /// 2) bounds their grid: the kernels are compiled for two resident blocks of eight warps.
    pub fn set_matvec_persistent(&self, m: MvMode, blocks_per_sm: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        self.mv_p8.store(m as u8, Relaxed);
        self.mv_p8_blocks.store(blocks_per_sm.clamp(1, 2), Relaxed);
    }

    /// The one-token kernels for `w` (plain / fused, gated), the kernel flags, the dynamic
    /// shared memory they take and whether they are the persistent ones: the 8-bit ones stage
    /// the quantized input row there, within the 48 KB a launch gets without opting in.
    /// `weights`: the launch's size (rows times columns of its matrices; of one of them for a
    /// gated launch); `normed`: whether it folds its input's RMSNorm.
    fn mv_kernels<'w>(
        &self,
        w: &'w DeviceWeight,
        weights: usize,
        normed: bool,
    ) -> Option<MvKernels<'w>> {
        use std::sync::atomic::Ordering::Relaxed;
        let p8 = MvMode::from_u8(self.mv_p8.load(Relaxed));
        let psmem = mp_smem(w.cols);
        if let Some(fns) = w.fast_p8.as_ref().filter(|_| {
            psmem <= 48 * 1024 && p8.allows(p8_by_default(w.kind, weights, w.rows, normed))
        }) {
            return Some(MvKernels {
                fns,
                flags: 0,
                smem: psmem,
                persistent: true,
            });
        }
        let act8 = MvMode::from_u8(self.mv_act8.load(Relaxed));
        let smem = 2 * w.cols + w.cols / 32 * 16;
        let q8 = w.fast_q8.as_ref().filter(|_| {
            smem <= 48 * 1024
                && act8.allows(
                    matches!(w.kind, "q8_0s" | "q4_k")
                        && w.rows >= 12288
                        && (3072..=6144).contains(&w.cols),
                )
        });
        // Only the kernels that measured faster with it prefetch (`Prefetch` in matvec.cuh);
        // the others ignore the flag.
        let flags = i32::from(self.mv_prefetch.load(Relaxed)) * MV_PREFETCH;
        let (fns, smem) = match (q8, &w.fast) {
            (Some(fns), _) => (fns, smem),
            (None, Some(fns)) => (fns, 0),
            _ => return None,
        };
        Some(MvKernels {
            fns,
            flags,
            smem,
            persistent: false,
        })
    }

    /// Blocks of a persistent launch over `groups` row groups: enough for every warp to have a
    /// group, at most `mv_p8_blocks` per multiprocessor.
    fn mp_grid(&self, groups: usize) -> Result<u32> {
        let per_sm = self.mv_p8_blocks.load(std::sync::atomic::Ordering::Relaxed);
        let most = per_sm * self.info().multiprocessors as usize;
        blocks(groups.min(most * MP_WARPS), MP_WARPS)
    }

    /// Warps sharing one row group in the `matvec.cuh` kernels: more when the matrix has too
    /// few rows to give every multiprocessor about four blocks, while each lane keeps at least
    /// two blocks of 32 columns. (Capping the split at the blocks the GPU holds at once, so that
    /// none run as a second wave, measured slower: cuda/NOTES.md.)
    pub(super) fn mv_split(&self, rows: usize, cols: usize, rows_per_group: usize) -> usize {
        let sms = self.info().multiprocessors as usize;
        mv_split_for(rows, cols, rows_per_group, sms)
    }

    /// One launch of `mvf_KIND` over up to three matrices sharing the one-token input `x`
    /// (which must all have the same fast format); each output is stored, or added to when
    /// `accumulate`.
    fn launch_mvf(
        &self,
        jobs: &[(&DeviceWeight, Option<&CudaSlice<f32>>, u64)],
        xp: u64,
        accumulate: bool,
        norm: Option<&RowNorm<'_>>,
    ) -> Result<()> {
        let first = jobs
            .first()
            .ok_or_else(|| shape("matvec: no matrices".into()))?
            .0;
        if jobs.len() > 3 {
            return Err(shape(format!(
                "matvec: {} matrices in one launch",
                jobs.len()
            )));
        }
        let k = self
            .mv_kernels(
                first,
                jobs.iter().map(|(w, _, _)| w.rows * w.cols).sum(),
                norm.is_some(),
            )
            .ok_or_else(|| shape(format!("matvec: '{}' has no one-token kernel", first.name)))?;
        let nargs = self.norm_args(norm, first.cols)?;
        let f = k.pick(false, norm.is_some(), first)?;
        let (flags, smem) = (k.flags, k.smem);
        let empty = MvJob {
            w: first.args(self),
            bias: 0,
            out: 0,
            rows: 0,
            cta0: i32::MAX,
            ks: 1,
            pad: 0,
        };
        let mut mj = MvJobs {
            j: [empty; 3],
            n: jobs.len() as i32,
            accumulate: i32::from(accumulate),
            flags,
            pad: 0,
            norm: nargs,
        };
        let mut ctas = 0usize;
        for (i, (w, bias, out)) in jobs.iter().enumerate() {
            if w.kind != first.kind || w.cols != first.cols {
                return Err(shape(format!(
                    "matvec: '{}' and '{}' cannot share one launch",
                    first.name, w.name
                )));
            }
            let rpw = if k.persistent {
                self.mp_rows
            } else {
                mvf_rows_per_group(w.kind).0
            };
            let ks = if k.persistent {
                1
            } else {
                self.mv_split(w.rows, w.cols, rpw)
            };
            mj.j[i] = MvJob {
                w: w.args(self),
                bias: bias.map_or(0, |b| self.ptr(b)),
                out: *out,
                rows: to_i32("rows", w.rows)?,
                cta0: to_i32("blocks", ctas)?,
                ks: ks as i32,
                pad: 0,
            };
            // Persistent: `cta0` numbers the job's first row group instead.
            ctas += if k.persistent {
                w.rows.div_ceil(rpw)
            } else {
                w.rows.div_ceil(rpw * 4 / ks)
            };
        }
        if !xp.is_multiple_of(16) {
            return Err(shape("matvec: the input is not 16-byte aligned".into()));
        }
        if k.persistent {
            let grid = self.mp_grid(ctas)?;
            let threads = (MP_WARPS * 32) as u32;
            return launch!(self, f, (grid, 1, 1), (threads, 1, 1), smem; mj, xp);
        }
        let grid = u32::try_from(ctas).map_err(|_| shape(format!("{ctas} blocks")))?;
        launch!(self, f, (grid, 1, 1), (128, 1, 1), smem; mj, xp)
    }

    /// The kernel argument of an optional folded RMSNorm over `cols` columns.
    fn norm_args(&self, norm: Option<&RowNorm<'_>>, cols: usize) -> Result<MvNormArgs> {
        let Some(n) = norm else {
            return Ok(MvNormArgs::default());
        };
        need("rms_norm weight", n.w.len(), cols)?;
        Ok(MvNormArgs {
            w: self.ptr(n.w),
            eps: n.eps,
            offset: n.offset,
        })
    }

    /// `outs[i] (1, R_i) = x (1, C) · W_iᵀ (+ b_i)` for up to three matrices of one fast format
    /// (q, k and v) in one launch.
    pub fn linear_many(
        &self,
        x: &impl DevicePtr<f32>,
        jobs: &mut [(
            &DeviceWeight,
            Option<&CudaSlice<f32>>,
            &mut dyn DevicePtrMutF32,
        )],
    ) -> Result<()> {
        self.linear_many_normed(x, None, jobs)
    }

    /// [`CudaDev::linear_many`] of the input's RMSNorm (`norm`), with no kernel of its own:
    /// `outs[i] = rms_norm(x) · W_iᵀ (+ b_i)`.
    pub fn linear_many_normed(
        &self,
        x: &impl DevicePtr<f32>,
        norm: Option<&RowNorm<'_>>,
        jobs: &mut [(
            &DeviceWeight,
            Option<&CudaSlice<f32>>,
            &mut dyn DevicePtrMutF32,
        )],
    ) -> Result<()> {
        let mut launch = Vec::with_capacity(jobs.len());
        for (w, b, out) in jobs.iter_mut() {
            need_linear(w, x.len(), out.len_f32())?;
            if let Some(b) = b {
                need(&format!("linear '{}' bias", w.name), b.len(), w.rows)?;
            }
            launch.push((*w, *b, out.ptr_f32(self)));
        }
        self.bind()?;
        self.launch_mvf(&launch, self.ptr(x), false, norm)
    }

    /// `residual (1, R) += x (1, C) · Wᵀ` in one launch (fast formats).
    pub fn linear_add(
        &self,
        x: &impl DevicePtr<f32>,
        w: &DeviceWeight,
        residual: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        need_linear(w, x.len(), residual.len())?;
        self.bind()?;
        let (xp, op) = (self.ptr(x), self.ptr_mut(residual));
        self.launch_mvf(&[(w, None, op)], xp, true, None)
    }

    /// `out (1, R) = act(x · Gᵀ) * (x · Uᵀ)`, act SiLU (`gelu` false) or GELU-tanh, in one launch
    /// (gate and up of one fast format).
    pub fn linear_gated(
        &self,
        x: &impl DevicePtr<f32>,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        gelu: bool,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.linear_gated_normed(x, None, gate, up, gelu, out)
    }

    /// [`CudaDev::linear_gated`] of the input's RMSNorm (`norm`), with no kernel of its own.
    pub fn linear_gated_normed(
        &self,
        x: &impl DevicePtr<f32>,
        norm: Option<&RowNorm<'_>>,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        gelu: bool,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        if gate.kind != up.kind || gate.rows != up.rows || gate.cols != up.cols {
            return Err(shape(format!(
                "gated linear: '{}' and '{}' differ in format or shape",
                gate.name, up.name
            )));
        }
        need(&format!("linear '{}' input", gate.name), x.len(), gate.cols)?;
        need(
            &format!("linear '{}' output", gate.name),
            out.len(),
            gate.rows,
        )?;
        let k = self
            .mv_kernels(gate, gate.rows * gate.cols, norm.is_some())
            .ok_or_else(|| shape(format!("matvec: '{}' has no one-token kernel", gate.name)))?;
        let nargs = self.norm_args(norm, gate.cols)?;
        let f = k.pick(true, norm.is_some(), gate)?;
        let (flags, smem) = (k.flags, k.smem);
        self.bind()?;
        let (gw, uw) = (gate.args(self), up.args(self));
        let (xp, op) = (self.ptr(x), self.ptr_mut(out));
        if xp % 16 != 0 {
            return Err(shape("matvec: the input is not 16-byte aligned".into()));
        }
        let rows = to_i32("rows", gate.rows)?;
        let act = i32::from(gelu);
        if k.persistent {
            let grid = self.mp_grid(gate.rows.div_ceil(MP_GATED_ROWS))?;
            let (ksi, threads) = (1i32, (MP_WARPS * 32) as u32);
            return launch!(self, f, (grid, 1, 1), (threads, 1, 1), smem;
                gw, uw, xp, op, rows, act, ksi, flags, nargs);
        }
        let nr = mvf_rows_per_group(gate.kind).1;
        let ks = self.mv_split(gate.rows, gate.cols, nr);
        let ksi = ks as i32;
        let grid = blocks(gate.rows, nr * 4 / ks)?;
        launch!(self, f, (grid, 1, 1), (128, 1, 1), smem;
            gw, uw, xp, op, rows, act, ksi, flags, nargs)
    }

    /// RMSNorm of `rows` rows of `cols`: `out = x / rms(x) * (w + offset)`; `w` holds `cols`
    /// values.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        rows: usize,
        cols: usize,
        eps: f32,
        offset: f32,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        need("rms_norm input", x.len(), rows * cols)?;
        need("rms_norm weight", w.len(), cols)?;
        need("rms_norm output", out.len(), rows * cols)?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Elementwise, "rms_norm")?;
        let (xp, wp, op) = (self.ptr(x), self.ptr(w), self.ptr_mut(out));
        let c = to_i32("columns", cols)?;
        let grid = u32::try_from(rows).map_err(|_| shape(format!("{rows} rows")))?;
        launch!(self, f, (grid, 1, 1), (256, 1, 1), 0; xp, wp, op, c, eps, offset)
    }

    /// Uploads the inverse frequencies of `p` for [`CudaDev::rope`]. `p.dims == 0` (a layer
    /// without RoPE, as SmolLM3's every fourth) is a table that rotates nothing: `rope` returns at
    /// once and `rope_store` only stores.
    pub fn rope_table(&self, p: &RopeParams) -> Result<RopeTable> {
        if !p.dims.is_multiple_of(2) {
            return Err(shape(format!("rope: {} rotated dims", p.dims)));
        }
        if let Some(ff) = &p.freq_factors {
            need("rope frequency factors", ff.len(), p.dims / 2)?;
        }
        if p.linear_scale.is_nan() || p.linear_scale <= 0.0 {
            return Err(shape(format!("rope: linear scale {}", p.linear_scale)));
        }
        self.bind()?;
        // One unused word when nothing rotates: a device buffer is never empty.
        let mut inv_freq = p.inv_freqs();
        if inv_freq.is_empty() {
            inv_freq.push(0.0);
        }
        Ok(RopeTable {
            inv_freq: self.upload(&inv_freq)?,
            style: p.style,
            dims: p.dims,
            linear_scale: p.linear_scale,
        })
    }

    /// Rotates `x (t, n_heads, head_dim)` in place at positions `pos0[0] + i`.
    pub fn rope(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        t: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: &impl DevicePtr<i32>,
        table: &RopeTable,
    ) -> Result<()> {
        need("rope input", x.len(), t * n_heads * head_dim)?;
        need("rope position", pos0.len(), 1)?;
        if table.dims > head_dim {
            return Err(shape(format!(
                "rope: {} rotated dims for head width {head_dim}",
                table.dims
            )));
        }
        let half = table.dims / 2;
        if t == 0 || n_heads == 0 || half == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Elementwise, "rope")?;
        let (xp, fp, pp) = (self.ptr_mut(x), self.ptr(&table.inv_freq), self.ptr(pos0));
        let (ti, nh, dh, hi) = (
            to_i32("tokens", t)?,
            to_i32("heads", n_heads)?,
            to_i32("head width", head_dim)?,
            half as i32,
        );
        let neox = i32::from(table.style == RopeStyle::Neox);
        let scale = table.linear_scale;
        let grid = blocks(t * n_heads * half, 256)?;
        launch!(self, f, (grid, 1, 1), (256, 1, 1), 0; xp, fp, pp, ti, nh, dh, hi, neox, scale)
    }

    /// A zeroed KV cache for one layer.
    pub fn alloc_kv_cache(
        &self,
        n_kv_heads: usize,
        capacity: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> Result<DeviceKvCache> {
        let n = n_kv_heads
            .checked_mul(capacity)
            .and_then(|v| v.checked_mul(head_dim))
            .and_then(|v| v.checked_mul(dtype.size()))
            .filter(|&n| n > 0)
            .ok_or_else(|| shape(format!("kv cache {n_kv_heads}x{capacity}x{head_dim}")))?;
        self.bind()?;
        Ok(DeviceKvCache {
            k: self.alloc(n)?,
            v: self.alloc(n)?,
            dtype,
            n_kv_heads,
            head_dim,
            capacity,
        })
    }

    /// Writes `k, v (t, Hkv*Dh)` at positions `pos0[0] .. pos0[0] + t`. Positions at or beyond
    /// the capacity are dropped by the kernel (it never writes out of bounds); keeping within
    /// the capacity is the caller's job.
    /// RoPE on `q (t, n_heads * Dh)` in place, and the rotated `k` with `v` (t, Hkv * Dh) into
    /// the cache at `pos0..`, in one kernel (`rope`, `rope` and `kv_write` in a row; `k` is not
    /// changed).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_store(
        &self,
        q: &mut impl DevicePtrMut<f32>,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        t: usize,
        n_heads: usize,
        cache: &mut DeviceKvCache,
        pos0: &impl DevicePtr<i32>,
        table: &RopeTable,
    ) -> Result<()> {
        let dh = cache.head_dim;
        let width = cache.n_kv_heads * dh;
        need("rope_store queries", q.len(), t * n_heads * dh)?;
        need("rope_store keys", k.len(), t * width)?;
        need("rope_store values", v.len(), t * width)?;
        need("rope_store position", pos0.len(), 1)?;
        if table.dims > dh || !dh.is_multiple_of(2) {
            return Err(shape(format!(
                "rope: {} rotated dims for head width {dh}",
                table.dims
            )));
        }
        if t == 0 {
            return Ok(());
        }
        self.bind()?;
        let name = format!("rope_store_{}", cache.dtype.suffix());
        let f = self.function(Program::Elementwise, &name)?;
        let (qp, kp, vp) = (self.ptr_mut(q), self.ptr(k), self.ptr(v));
        let (kcp, vcp) = (
            cache.k.device_ptr_mut(self.stream()).0,
            cache.v.device_ptr_mut(self.stream()).0,
        );
        let (fp, pp) = (self.ptr(&table.inv_freq), self.ptr(pos0));
        let (ti, nh, hkv, dhi, half) = (
            to_i32("tokens", t)?,
            to_i32("heads", n_heads)?,
            cache.n_kv_heads as i32,
            dh as i32,
            (table.dims / 2) as i32,
        );
        let neox = i32::from(table.style == RopeStyle::Neox);
        let scale = table.linear_scale;
        let cap = to_i32("capacity", cache.capacity)?;
        let grid = blocks(t * (n_heads + cache.n_kv_heads) * (dh / 2), 256)?;
        launch!(self, f, (grid, 1, 1), (256, 1, 1), 0;
            qp, kp, vp, kcp, vcp, fp, pp, ti, nh, hkv, dhi, half, neox, scale, cap)
    }

    pub fn kv_write(
        &self,
        cache: &mut DeviceKvCache,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        t: usize,
        pos0: &impl DevicePtr<i32>,
    ) -> Result<()> {
        let width = cache.n_kv_heads * cache.head_dim;
        need("kv_write keys", k.len(), t * width)?;
        need("kv_write values", v.len(), t * width)?;
        need("kv_write position", pos0.len(), 1)?;
        if t == 0 {
            return Ok(());
        }
        self.bind()?;
        let name = format!("kv_write_{}", cache.dtype.suffix());
        let f = self.function(Program::Elementwise, &name)?;
        let (kp, vp, pp) = (self.ptr(k), self.ptr(v), self.ptr(pos0));
        let (kcp, vcp) = (
            cache.k.device_ptr_mut(self.stream()).0,
            cache.v.device_ptr_mut(self.stream()).0,
        );
        let (ti, hkv, dh, cap) = (
            to_i32("tokens", t)?,
            cache.n_kv_heads as i32,
            cache.head_dim as i32,
            to_i32("capacity", cache.capacity)?,
        );
        let grid = blocks(t * width, 256)?;
        launch!(self, f, (grid, 1, 1), (256, 1, 1), 0; kp, vp, kcp, vcp, pp, ti, hkv, dh, cap)
    }

    /// Number of key splits the decode kernel uses for a cache of `capacity` positions: about
    /// four blocks per multiprocessor (each block walks its keys one after another, so more
    /// blocks means more keys in flight), each split at least `attn-chunk` positions of the
    /// capacity ([`super::CudaOptions::attn_chunk`], 16: a 128-position cache was two splits of
    /// 64 keys, 16 blocks for 8 kv heads each walking its keys in dependent rounds; at 16 it is
    /// eight: tg128 1B F16 1013-1029 -> 1105-1111 tokens/s, 1B Q4_0 1290 -> 1445, 8B Q4_0
    /// 433 -> 466-470, 8B Q4_K_M 366 -> 390; 8 keys: no better. Large caches are bounded by
    /// the multiprocessors either way).
    /// Fixed by the capacity (not the current length) so captured graphs stay valid.
    fn decode_splits(&self, n_kv_heads: usize, capacity: usize) -> usize {
        let by_len = capacity.div_ceil(self.attn_chunk);
        let by_sm = (4 * self.info().multiprocessors as usize).div_ceil(n_kv_heads.max(1));
        by_len.min(by_sm).clamp(1, 256)
    }

    /// f32 elements of scratch [`CudaDev::attention`] needs for one-token decode over a cache of
    /// `capacity` positions (prefill needs none).
    pub fn attention_scratch_len(&self, p: &AttentionParams, capacity: usize) -> usize {
        p.n_heads * self.decode_splits(p.n_kv_heads, capacity) * (p.head_dim + 2)
    }

    /// Causal attention of `q (t, H*Dh)` at positions `pos0[0] ..` over the cache (positions
    /// `0 .. pos0[0] + t` must have been written) -> `out (t, H*Dh)`. One token: split-K decode
    /// (needs `scratch` of [`CudaDev::attention_scratch_len`]); more: tiled flash attention.
    /// `sinks`: the device copy of `p.sinks` (`(H)`), given exactly when `p` has sinks.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: &impl DevicePtr<f32>,
        t: usize,
        cache: &DeviceKvCache,
        pos0: &impl DevicePtr<i32>,
        p: &AttentionParams,
        scratch: &mut impl DevicePtrMut<f32>,
        out: &mut impl DevicePtrMut<f32>,
        sinks: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
        let skp = self.sinks_ptr(p, sinks)?;
        if hkv == 0 || !h.is_multiple_of(hkv) || hkv != cache.n_kv_heads || dh != cache.head_dim {
            return Err(shape(format!(
                "attention: {h} heads over {hkv} kv heads of {dh}, cache has {} of {}",
                cache.n_kv_heads, cache.head_dim
            )));
        }
        let dpl = dims_per_lane(dh)?;
        if p.window == Some(0) {
            return Err(shape("attention: a window of 0 sees no key".into()));
        }
        need("attention queries", q.len(), t * h * dh)?;
        need("attention output", out.len(), t * h * dh)?;
        need("attention position", pos0.len(), 1)?;
        if t == 0 {
            return Ok(());
        }
        self.bind()?;
        let kv = cache.dtype.suffix();
        let (qp, pp, op) = (self.ptr(q), self.ptr(pos0), self.ptr_mut(out));
        let (kcp, vcp) = (
            cache.k.device_ptr(self.stream()).0,
            cache.v.device_ptr(self.stream()).0,
        );
        let (hi, hkvi, dhi) = (to_i32("heads", h)?, hkv as i32, dh as i32);
        let cap = to_i32("capacity", cache.capacity)?;
        let scale = p.scale;
        let window = match p.window {
            Some(w) => to_i32("window", w)?,
            None => 0,
        };
        if t == 1 {
            let splits = self.decode_splits(hkv, cache.capacity);
            need("attention scratch", scratch.len(), h * splits * (dh + 2))?;
            let sp = self.ptr_mut(scratch);
            let ns = splits as i32;
            let f = self.function(Program::Attention, &format!("attn_decode_{kv}_{dpl}"))?;
            let chunks = (h / hkv).div_ceil(heads_per_block(dh)?) as u32;
            // The splits are merged by the last block of each (kv head, chunk) to finish, which
            // counts on the device's counters.
            if hkv * chunks as usize > COUNTERS {
                return Err(shape(format!(
                    "attention: {hkv} kv heads of {} query heads each is more than {COUNTERS} head groups",
                    h / hkv
                )));
            }
            let cp = self.done_counters.device_ptr(self.stream()).0;
            launch!(self, f, (hkv as u32, ns as u32, chunks), (128, 1, 1), 0;
                qp, kcp, vcp, pp, sp, hi, hkvi, dhi, cap, scale, window, ns, op, cp, skp)
        } else if cache.dtype == KvDtype::F16
            && (dh == 64 || dh == 128)
            && self.attn_tensor_cores
            && qp.is_multiple_of(16)
            && op.is_multiple_of(8)
        {
            // Tensor cores (attention.cu `attn_fa_impl`): 64 queries of one head per block.
            let f = self.function(Program::Attention, &format!("attn_prefill_tc_{dh}"))?;
            let ti = to_i32("tokens", t)?;
            let smem = 3 * 64 * (dh + 8) * 2;
            launch!(self, f, (blocks(t, 64)?, h as u32, 1), (128, 1, 1), smem;
                qp, kcp, vcp, pp, op, ti, hi, hkvi, cap, scale, window, skp)
        } else {
            let f = self.function(Program::Attention, &format!("attn_prefill_{kv}_{dpl}"))?;
            let ti = to_i32("tokens", t)?;
            let smem = prefill_smem(dh);
            launch!(self, f, (blocks(t, 16)?, h as u32, 1), (256, 1, 1), smem;
                qp, kcp, vcp, pp, op, ti, hi, hkvi, dhi, cap, scale, window, skp)
        }
    }

    /// The kernels' `sinks` argument: the device address of `p`'s sinks (0: none), checked
    /// against `p` (given exactly when it has sinks, one per query head).
    pub(crate) fn sinks_ptr(
        &self,
        p: &AttentionParams,
        sinks: Option<&CudaSlice<f32>>,
    ) -> Result<u64> {
        match (&p.sinks, sinks) {
            (None, None) => Ok(0),
            (Some(_), Some(d)) if d.len() == p.n_heads => Ok(d.device_ptr(self.stream()).0),
            (Some(_), Some(d)) => Err(shape(format!(
                "attention: {} sinks on the device for {} heads",
                d.len(),
                p.n_heads
            ))),
            (Some(_), None) => Err(shape(
                "attention: the sinks (GPT-OSS) have no device copy".into(),
            )),
            (None, Some(_)) => Err(shape(
                "attention: device sinks given for attention without sinks".into(),
            )),
        }
    }

    fn elementwise2(
        &self,
        name: &str,
        a: &impl DevicePtr<f32>,
        b: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        need(name, a.len(), n)?;
        need(name, b.len(), n)?;
        need(name, out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Elementwise, name)?;
        let (ap, bp, op) = (self.ptr(a), self.ptr(b), self.ptr_mut(out));
        let ni = n as i64;
        launch!(self, f, (blocks(n, 256)?, 1, 1), (256, 1, 1), 0; ap, bp, op, ni)
    }

    /// `out[i] = silu(gate[i]) * up[i]` for `n` elements.
    pub fn silu_mul(
        &self,
        gate: &impl DevicePtr<f32>,
        up: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.elementwise2("silu_mul", gate, up, n, out)
    }

    /// `out[i] = gelu_tanh(gate[i]) * up[i]` for `n` elements.
    pub fn gelu_tanh_mul(
        &self,
        gate: &impl DevicePtr<f32>,
        up: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.elementwise2("gelu_tanh_mul", gate, up, n, out)
    }

    /// GPT-OSS's clamped SwiGLU ([`hf2q_tensor::op::clamped_swiglu`]) of `n` elements.
    #[allow(clippy::too_many_arguments)]
    pub fn clamped_swiglu_mul(
        &self,
        gate: &impl DevicePtr<f32>,
        up: &impl DevicePtr<f32>,
        n: usize,
        alpha: f32,
        limit: f32,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let name = "clamped_swiglu_mul";
        need(name, gate.len(), n)?;
        need(name, up.len(), n)?;
        need(name, out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Elementwise, name)?;
        let (gp, upp, op) = (self.ptr(gate), self.ptr(up), self.ptr_mut(out));
        let ni = n as i64;
        launch!(self, f, (blocks(n, 256)?, 1, 1), (256, 1, 1), 0; gp, upp, op, ni, alpha, limit)
    }

    /// `x[i] += y[i]` for `n` elements.
    pub fn add_assign(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<()> {
        need("add_assign target", x.len(), n)?;
        need("add_assign operand", y.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Elementwise, "add_assign")?;
        let (xp, yp) = (self.ptr_mut(x), self.ptr(y));
        let ni = n as i64;
        launch!(self, f, (blocks(n, 256)?, 1, 1), (256, 1, 1), 0; xp, yp, ni)
    }

    /// `x[i] = tanh(x[i] / cap) * cap` for `n` elements, in place (the CPU reference's
    /// formula, whatever `cap` is).
    pub fn softcap(&self, x: &mut impl DevicePtrMut<f32>, n: usize, cap: f32) -> Result<()> {
        need("softcap values", x.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Elementwise, "softcap")?;
        let (xp, ni) = (self.ptr_mut(x), n as i64);
        launch!(self, f, (blocks(n, 256)?, 1, 1), (256, 1, 1), 0; xp, cap, ni)
    }

    /// Constrained decoding: sets `logits (rows, cols)` to -inf wherever the bit of its column in
    /// `mask` (`ceil(cols / 32)` words, shared by every row) is clear.
    pub fn apply_token_mask(
        &self,
        logits: &mut impl DevicePtrMut<f32>,
        rows: usize,
        cols: usize,
        mask: &impl DevicePtr<u32>,
    ) -> Result<()> {
        let n = rows * cols;
        need("token mask logits", logits.len(), n)?;
        need("token mask", mask.len(), cols.div_ceil(32))?;
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Elementwise, "apply_token_mask")?;
        let (xp, mp) = (self.ptr_mut(logits), self.ptr(mask));
        let (c, ni) = (to_i32("columns", cols)?, n as i64);
        launch!(self, f, (blocks(n, 256)?, 1, 1), (256, 1, 1), 0; xp, mp, c, ni)
    }

    /// The shared checks of the one-token-per-row kernels (argmax, sampling): sizes, at least one
    /// column; `None` for no rows. Returns the input and output pointers, the column count and
    /// the grid (one block per row).
    fn row_picks(
        &self,
        what: &str,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        cols: usize,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<Option<(u64, u64, i32, u32)>> {
        need(&format!("{what} input"), logits.len(), rows * cols)?;
        need(&format!("{what} output"), out.len(), rows)?;
        if rows == 0 {
            return Ok(None);
        }
        if cols == 0 {
            return Err(shape(format!("{what} over empty rows")));
        }
        self.bind()?;
        let c = to_i32("columns", cols)?;
        let grid = u32::try_from(rows).map_err(|_| shape(format!("{rows} rows")))?;
        Ok(Some((self.ptr(logits), self.ptr_mut(out), c, grid)))
    }

    /// Sampling: `out[r]` = the token drawn from row r of `logits (rows, cols)` with the
    /// settings in `args` (a device buffer, so a captured graph reads new settings and a new
    /// uniform number each replay).
    pub fn sample(
        &self,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        cols: usize,
        args: &CudaSlice<SampleArgs>,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        self.sample_with(logits, rows, cols, args, false, out)
    }

    /// [`CudaDev::sample`] with settings of its own for each row: `args` holds `rows` entries.
    pub fn sample_rows(
        &self,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        cols: usize,
        args: &CudaSlice<SampleArgs>,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        self.sample_with(logits, rows, cols, args, true, out)
    }

    /// One launch of `sample_topk`: every row with `args[0]`, or (`per_row`) row r with
    /// `args[r]`.
    fn sample_with(
        &self,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        cols: usize,
        args: &CudaSlice<SampleArgs>,
        per_row: bool,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        need(
            "sample settings",
            args.len(),
            if per_row { rows } else { 1 },
        )?;
        let Some((lp, op, c, grid)) = self.row_picks("sample", logits, rows, cols, out)? else {
            return Ok(());
        };
        let f = self.function(Program::Elementwise, "sample_topk")?;
        let (ap, per_row) = (self.ptr(args), i32::from(per_row));
        launch!(self, f, (grid, 1, 1), (1024, 1, 1), 0; lp, c, ap, per_row, op)
    }

    /// Greedy sampling: `out[r]` = index of the largest of `logits (rows, cols)` row r (first on
    /// ties, NaN ignored, 0 for a row of NaN — the CPU sampler's rule).
    pub fn argmax(
        &self,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        cols: usize,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        let Some((lp, op, c, grid)) = self.row_picks("argmax", logits, rows, cols, out)? else {
            return Ok(());
        };
        let f = self.function(Program::Elementwise, "argmax_rows")?;
        let (pp, cp) = (
            self.argmax_part.device_ptr(self.stream()).0,
            self.done_counters.device_ptr(self.stream()).0,
        );
        // ARGMAX_BLOCKS blocks per row, at most ARGMAX_ROWS rows per launch (the partials).
        for r0 in (0..grid).step_by(ARGMAX_ROWS) {
            let n = (grid - r0).min(ARGMAX_ROWS as u32);
            let (lr, or) = (lp + 4 * r0 as u64 * c as u64, op + 4 * r0 as u64);
            launch!(self, f, (ARGMAX_BLOCKS as u32, n, 1), (256, 1, 1), 0; lr, or, c, pp, cp)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{mv_split_for, p8_by_default, KvDtype};

    /// The host cache types the device stores, and the quantized ones it refuses by name.
    #[test]
    fn kv_types_the_device_takes() {
        use hf2q_tensor::kv::{KvType, KvTypes};
        assert_eq!(KvDtype::try_from(KvType::F16).unwrap(), KvDtype::F16);
        assert_eq!(KvDtype::try_from(KvType::F32).unwrap(), KvDtype::F32);
        for t in KvType::BLOCKS.into_iter().chain(KvType::AFFINE) {
            let e = KvDtype::try_from(t).unwrap_err().to_string();
            assert!(e.contains(t.name()) && e.contains("CUDA"), "{e}");
        }
        // Keys and values of two types: refused, even when the GPU has both.
        let split = KvTypes {
            k: KvType::F16,
            v: KvType::F32,
        };
        let e = KvDtype::try_from(split).unwrap_err().to_string();
        assert!(e.contains("k f16 / v f32"), "{e}");
        let same = KvTypes::from(KvType::F16);
        assert_eq!(KvDtype::try_from(same).unwrap(), KvDtype::F16);
    }

    /// The row split on an H200 (132 multiprocessors), with the blocks of each split in the
    /// comments (rows / (rows per group * 4 / split)).
    /// The default choice of the persistent kernels at an 8B's and a 1B's shapes.
    #[test]
    fn persistent_kernels_by_default() {
        let (qkv8, gate8, down8, o8) = (6144 * 4096, 14336 * 4096, 4096 * 14336, 4096 * 4096);
        // Q4_0 / re-laid Q4_K: by size alone.
        for kind in ["q4_0s", "q4_ks"] {
            assert!(p8_by_default(kind, qkv8, 6144, true));
            assert!(p8_by_default(kind, down8, 4096, false));
            assert!(!p8_by_default(kind, o8, 4096, false));
            assert!(!p8_by_default(kind, 8192 * 2048, 8192, true));
        }
        // Q8_0: the large launches that fold a norm, and output layers; not the down projection.
        assert!(p8_by_default("q8_0s", qkv8, 6144, true));
        assert!(p8_by_default("q8_0s", gate8, 14336, true));
        assert!(!p8_by_default("q8_0s", gate8, 14336, false));
        assert!(!p8_by_default("q8_0s", down8, 4096, false));
        assert!(p8_by_default("q8_0s", 128256 * 2048, 128256, false));
        assert!(!p8_by_default("q8_0s", 3072 * 2048, 3072, true));
        // Re-laid Q6_K: output layers and large matrices; the padded layout and the rest never.
        assert!(p8_by_default("q6_ks", 128256 * 2048, 128256, false));
        assert!(!p8_by_default("q6_ks", 512 * 2048, 512, false));
        for kind in ["q6_kp", "q4_k", "f16"] {
            assert!(!p8_by_default(kind, 128256 * 4096, 128256, true));
        }
    }

    #[test]
    fn row_split() {
        // An 8B's Q8_0 down projection (four rows per group): 256, 512, 1024 blocks; the split
        // stops at 4 (1024 >= 528 wanted).
        assert_eq!(mv_split_for(4096, 14336, 4, 132), 4);
        // A 1B's 8192 x 2048 Q8_0: 512 blocks unsplit is under the 528 wanted, so 2 (1024).
        assert_eq!(mv_split_for(8192, 2048, 4, 132), 2);
        // Enough rows already: no split. Too narrow to split: none either.
        assert_eq!(mv_split_for(14336, 4096, 2, 132), 1);
        assert_eq!(mv_split_for(64, 1024, 2, 132), 1);
        // 128 columns: four 32-column blocks, one lane's worth at most, whatever the rows.
        assert_eq!(mv_split_for(8, 128, 2, 132), 1);
    }
}
