//! hf2q-cuda: the CUDA backend. [`backend::CudaBackend`] implements `hf2q_tensor`'s `Backend`
//! (and, in `backend_train.rs`, `TrainBackend`; in `backend_moe.rs`, the expert products) over
//! the device layer this module is: one GPU, one stream, and a kernel for every op of
//! [`hf2q_tensor::op`]. An op's CUDA launcher (`ops.rs`, `train.rs`, `moe.rs`) and its `.cu`
//! (`kernels/`) share the stem of its CPU file in `hf2q-cpu` where one exists.
//!
//! Everything runs on the CUDA driver API and NVRTC, both loaded at run time (`dlopen`), so the
//! crate builds and its CPU path runs on machines with no CUDA toolkit or driver; there
//! [`CudaDev::open`] answers `Ok(None)`.
//!
//! # Model
//!
//! - [`CudaDev`] owns a context, one non-default stream (so that it can be captured into a graph)
//!   and the compiled kernels. Every op is a method that *enqueues* work on that stream and
//!   returns at once; results are visible to the host after [`CudaDev::synchronize`] (or a
//!   download, which synchronizes).
//! - Activations are plain device buffers (`cudarc`'s [`CudaSlice`] / [`CudaView`], anything
//!   implementing [`DevicePtr`] / [`DevicePtrMut`]) of f32, row-major, with the shapes of
//!   [`hf2q_tensor::op`]; token ids are u32; positions are a one-element i32 buffer read *by the
//!   kernels*, so a captured graph replays at whatever position that word holds.
//! - Weights are [`DeviceWeight`]s: a [`QTensor`](hf2q_tensor::QTensor)'s stored bytes copied unchanged
//!   (ggml blocks, dense f32/f16/bf16, or MLX packed words plus f32 scales and biases). Kernels
//!   dequantize on the fly (`kernels/quant.cuh`).
//! - The KV cache of a layer is a [`DeviceKvCache`], `(Hkv, S_cap, Dh)` as on the CPU, stored as
//!   f16 by default ([`KvDtype`]). A batch of sequences can instead keep its keys and values in a
//!   [`DevicePagedLayer`] per layer: blocks of one pool read through block tables by one
//!   attention launch over every row of the batch (`paged.rs`).
//!
//! # Kernels
//!
//! The `.cu` sources in `kernels/` are embedded in the binary, compiled by NVRTC for the GPU's own
//! architecture (`sm_XY`) when the device is opened, and the cubins cached on disk (in
//! [`CudaOptions::kernel_cache`]), keyed by a hash of the sources, options, driver/NVRTC versions and
//! architecture; a cache entry that fails its checksum or does not load is recompiled.
//!
//! # Graphs
//!
//! [`CudaDev::begin_capture`] / [`CudaDev::end_capture`] record the ops enqueued in between into
//! a [`DeviceGraph`] that [`DeviceGraph::launch`] replays. While capturing: do not allocate,
//! free (drop) or copy from the host on this device, and keep every buffer the graph uses alive
//! as long as the graph; update position words *before* launching the graph.

pub mod backend;
mod backend_moe;
mod backend_paged;
mod backend_train;
mod blas;
mod compile;
pub mod mega;
mod mmq;
pub(crate) mod moe;
mod ops;
mod options;
mod paged;
pub(crate) mod train;
mod weight;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, DriverError};
pub use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice,
    ValidAsZeroBits,
};

pub use backend_paged::{PagedInputs, RowPick, RowPicked};
pub use blas::PrefillGemm;
pub use compile::{
    compile_all_for, compile_for, compile_program_for, fill_cache_for, nvrtc_available,
};
pub(crate) use mmq::quantized_bytes;
pub use ops::{
    DeviceKvCache, DevicePtrMutF32, KvDtype, MvMode, RopeTable, RowNorm, SampleArgs, MAX_HEAD_DIM,
    SAMPLE_MAX_K,
};
pub use options::{CudaOptions, OptionKey};
pub use paged::{
    prefill_tiles, DevicePagedLayer, DevicePagedRows, PrefillTileRows, PREFILL_MIN_RUN,
    PREFILL_TILE_ROWS,
};
pub use weight::DeviceWeight;

use hf2q_tensor::{Error, Result};

/// A CUDA failure as a crate error, naming what was being done.
pub(crate) fn cuda_err(what: impl std::fmt::Display) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Msg(format!("cuda: {what}: {e}"))
}

/// What the device is.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_memory: usize,
    pub multiprocessors: u32,
    /// The driver's CUDA version, e.g. 13000 for 13.0.
    pub driver_version: i32,
}

/// The kernel sources, one NVRTC program each (compiled in parallel on first open).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Program {
    Elementwise,
    Attention,
    LinearLegacy,
    LinearKquant,
    LinearMlx,
    /// The training op set's element-wise, row and dense-product kernels (`train.cu`).
    Train,
    /// Attention of a training forward and its backward (`train_attn.cu`).
    TrainAttn,
    /// The decode megakernel (`mega.cu`); loaded only with `decode=mega`.
    Mega,
}

impl Program {
    const ALL: [Program; 8] = [
        Program::Elementwise,
        Program::Attention,
        Program::LinearLegacy,
        Program::LinearKquant,
        Program::LinearMlx,
        Program::Train,
        Program::TrainAttn,
        Program::Mega,
    ];
}

/// One GPU: context, stream, kernels. Cheap to share (`Arc`); ops may be called from any thread
/// (the context is bound on each call), but the stream orders them, so one thread at a time
/// should drive it.
pub struct CudaDev {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    modules: HashMap<Program, Arc<CudaModule>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    counters: Counters,
    /// cuBLAS for prefill products, started on first use (`blas.rs`).
    blas: Mutex<blas::BlasSlot>,
    /// A [`PrefillGemm`] as its discriminant.
    gemm: std::sync::atomic::AtomicU8,
    /// The quantized activations of the integer prefill product (`mmq.rs`), grown on demand.
    mmq_buf: Mutex<Option<CudaSlice<u8>>>,
    /// Kernels launched with programmatic dependent launch (Hopper and later; off with the
    /// `pdl` option).
    pdl: bool,
    /// Fewest keys per split of the one-token attention ([`CudaOptions::attn_chunk`]).
    attn_chunk: usize,
    /// Most rows of a product run as chunks of the small-batch kernels
    /// ([`CudaOptions::batch_mv`]).
    batch_mv: std::sync::atomic::AtomicUsize,
    /// Most rows of a product run on the tensor-core small-batch kernels
    /// ([`CudaOptions::batch_tc`]; [`CudaDev::set_batch_tc`]).
    batch_tc: std::sync::atomic::AtomicUsize,
    /// Prefill attention may take the tensor-core kernel ([`CudaOptions::attn_tensor_cores`]).
    attn_tensor_cores: bool,
    /// Rows per row group of the persistent kernels, as compiled
    /// ([`CudaOptions::persistent_rows`]).
    mp_rows: usize,
    /// The options the device was opened with.
    options: CudaOptions,
    /// Zeroed completion counters of the kernels whose last block finishes the work
    /// (`ops::COUNTERS`).
    done_counters: CudaSlice<u32>,
    /// The argmax kernel's per-block keys (`ops::ARGMAX_ROWS * ops::ARGMAX_BLOCKS`).
    argmax_part: CudaSlice<u64>,
    /// Test override of the cuBLAS weight chunk (0: the default).
    blas_chunk: std::sync::atomic::AtomicUsize,
    /// One-token product options: the weights' L2 prefetch before waiting for the previous
    /// kernel, and 8-bit activations (an [`MvMode`] as its discriminant).
    mv_prefetch: std::sync::atomic::AtomicBool,
    /// Mixture-of-experts decode in its fused form (`CudaDev::set_moe_fused`).
    moe_fused: std::sync::atomic::AtomicBool,
    /// Where pre-norm products fold their RMSNorm in ([`CudaDev::set_matvec_norm`]).
    mv_norm: std::sync::atomic::AtomicBool,
    mv_act8: std::sync::atomic::AtomicU8,
    mv_p8: std::sync::atomic::AtomicU8,
    /// Blocks per multiprocessor of the persistent one-token kernels.
    mv_p8_blocks: std::sync::atomic::AtomicUsize,
    /// Which Q4_K matrices are re-laid at upload ([`CudaDev::set_q4k_relayout`]).
    q4k_relay: std::sync::atomic::AtomicU8,
    /// Which Q6_K matrices are re-laid at upload ([`CudaDev::set_q6k_relayout`]).
    q6k_relay: std::sync::atomic::AtomicU8,
}

/// Running totals of what the host asked of the device (`--stats`).
#[derive(Debug, Default)]
struct Counters {
    launches: std::sync::atomic::AtomicU64,
    graph_launches: std::sync::atomic::AtomicU64,
    syncs: std::sync::atomic::AtomicU64,
}

/// A snapshot of [`CudaDev::counters`]: kernels launched one by one, graph replays, and host
/// waits for the device (stream synchronisations and copies to the host).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    pub launches: u64,
    pub graph_launches: u64,
    pub syncs: u64,
}

impl std::ops::AddAssign for DeviceCounters {
    fn add_assign(&mut self, o: DeviceCounters) {
        self.launches += o.launches;
        self.graph_launches += o.graph_launches;
        self.syncs += o.syncs;
    }
}

impl std::ops::Sub for DeviceCounters {
    type Output = DeviceCounters;
    fn sub(self, o: DeviceCounters) -> DeviceCounters {
        DeviceCounters {
            launches: self.launches - o.launches,
            graph_launches: self.graph_launches - o.graph_launches,
            syncs: self.syncs - o.syncs,
        }
    }
}

impl std::fmt::Debug for CudaDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDev").field("info", &self.info).finish()
    }
}

/// Whether the CUDA driver library can be loaded at all (no driver: no GPU to use).
pub fn driver_library_present() -> bool {
    // SAFETY: only tries to dlopen the library names; calls nothing in it.
    unsafe { sys::is_culib_present() }
}

impl CudaDev {
    /// Opens GPU `ordinal` with `options` and compiles (or loads from `options.kernel_cache`)
    /// every kernel.
    ///
    /// `Ok(None)`: no CUDA driver library, no GPU, or fewer GPUs than `ordinal + 1`. `Err`: a GPU
    /// is there but could not be used (driver error, NVRTC missing with nothing cached, a kernel
    /// that does not compile). Never panics: a panic inside the bindings (for example a driver
    /// too old to have a symbol) is caught and returned as an error.
    pub fn open(ordinal: usize, options: &CudaOptions) -> Result<Option<Arc<CudaDev>>> {
        if !driver_library_present() {
            return Ok(None);
        }
        match std::panic::catch_unwind(|| Self::open_inner(ordinal, options)) {
            Ok(r) => r,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| p.downcast_ref::<&str>().copied())
                    .unwrap_or("unknown panic");
                Err(Error::Msg(format!("cuda: opening device {ordinal}: {msg}")))
            }
        }
    }

    fn open_inner(ordinal: usize, options: &CudaOptions) -> Result<Option<Arc<CudaDev>>> {
        use cudarc::driver::result;
        if let Err(e) = result::init() {
            // No device, or only the toolkit's stub library, or a driver with no usable device:
            // the CPU path is the answer.
            if matches!(
                e.0,
                sys::CUresult::CUDA_ERROR_NO_DEVICE
                    | sys::CUresult::CUDA_ERROR_STUB_LIBRARY
                    | sys::CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
                    | sys::CUresult::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE
                    | sys::CUresult::CUDA_ERROR_NOT_INITIALIZED
            ) {
                return Ok(None);
            }
            return Err(cuda_err("initialising the driver")(e));
        }
        let count = result::device::get_count().map_err(cuda_err("counting devices"))?;
        if ordinal >= count.max(0) as usize {
            return Ok(None);
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("creating a context"))?;
        // One stream does all the work, so cudarc's cross-stream event bookkeeping is not needed
        // (and its events would get in the way of graph capture).
        // SAFETY: every buffer this device uses is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        // Freed stream-ordered memory stays in the device's pool across synchronisations (by
        // default it is handed back at each one, so a training step would map its gigabytes of
        // activations again after every host wait). Best effort: without it, only slower.
        // SAFETY: writes one pool handle, then sets one u64 attribute of that pool.
        unsafe {
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                == sys::CUresult::CUDA_SUCCESS
            {
                let mut keep = u64::MAX;
                let _ = sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut keep as *mut u64 as *mut std::ffi::c_void,
                );
            }
        }
        let mut driver_version = 0i32;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(cuda_err("reading the driver version"))?;
        let attr = |a| {
            ctx.attribute(a)
                .map_err(cuda_err("reading a device attribute"))
        };
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(cuda_err("reading the device name"))?,
            compute_capability: (
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            total_memory: ctx
                .total_mem()
                .map_err(cuda_err("reading the memory size"))?,
            multiprocessors: attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )? as u32,
            driver_version,
        };
        let modules = compile::load_all(&ctx, &info, options)?;
        let done_counters = stream
            .alloc_zeros::<u32>(ops::COUNTERS)
            .map_err(cuda_err("allocating completion counters"))?;
        let argmax_part = stream
            .alloc_zeros::<u64>(ops::ARGMAX_ROWS * ops::ARGMAX_BLOCKS)
            .map_err(cuda_err("allocating argmax partials"))?;
        let pdl = info.compute_capability.0 >= 9 && options.pdl;
        use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize};
        Ok(Some(Arc::new(CudaDev {
            ctx,
            stream,
            info,
            modules,
            functions: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            blas: Mutex::new(blas::BlasSlot::Untried),
            pdl,
            attn_chunk: options.attn_chunk.max(8),
            batch_mv: std::sync::atomic::AtomicUsize::new(options.batch_mv),
            batch_tc: std::sync::atomic::AtomicUsize::new(options.batch_tc.min(64)),
            attn_tensor_cores: options.attn_tensor_cores,
            mp_rows: options.persistent_rows,
            options: options.clone(),
            done_counters,
            argmax_part,
            blas_chunk: AtomicUsize::new(0),
            mv_prefetch: AtomicBool::new(options.prefetch),
            moe_fused: AtomicBool::new(options.moe_fused),
            mv_norm: AtomicBool::new(options.norm_fold),
            mv_act8: AtomicU8::new(options.act8 as u8),
            mv_p8: AtomicU8::new(options.persistent as u8),
            q4k_relay: AtomicU8::new(options.q4k_relayout as u8),
            q6k_relay: AtomicU8::new(options.q6k_relayout as u8),
            mv_p8_blocks: AtomicUsize::new(options.persistent_blocks.clamp(1, 2)),
            gemm: AtomicU8::new(options.gemm as u8),
            mmq_buf: Mutex::new(None),
        })))
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The options the device was opened with (the switches since changed by setters are not
    /// reflected).
    pub fn options(&self) -> &CudaOptions {
        &self.options
    }

    /// The stream every op is enqueued on (for the caller's own copies and kernels).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(cuda_err("reading free memory"))
    }

    /// Waits for everything enqueued so far; reports an error raised by any of it.
    pub fn synchronize(&self) -> Result<()> {
        self.count_sync();
        self.stream.synchronize().map_err(cuda_err("synchronizing"))
    }

    /// Opens (`true`) or closes the span an attached profiler records when it was started with
    /// `--profile-from-start off` (Nsight Compute, Nsight Systems): benchmarks mark the work
    /// they time so a profile holds only it. Without a profiler it does nothing.
    pub fn profiler_span(&self, on: bool) -> Result<()> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(cuda_err("synchronizing"))?;
        // SAFETY: plain driver calls on the bound context; they take no pointers.
        let r = unsafe {
            if on {
                sys::cuProfilerStart()
            } else {
                sys::cuProfilerStop()
            }
        };
        r.result().map_err(cuda_err("marking the profiler's span"))
    }

    /// The totals so far (subtract two snapshots for a span of work).
    pub fn counters(&self) -> DeviceCounters {
        use std::sync::atomic::Ordering::Relaxed;
        DeviceCounters {
            launches: self.counters.launches.load(Relaxed),
            graph_launches: self.counters.graph_launches.load(Relaxed),
            syncs: self.counters.syncs.load(Relaxed),
        }
    }
    pub(crate) fn count_launch(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.counters.launches.fetch_add(1, Relaxed);
    }
    pub(crate) fn count_graph_launch(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.counters.graph_launches.fetch_add(1, Relaxed);
    }
    pub(crate) fn count_sync(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.counters.syncs.fetch_add(1, Relaxed);
    }

    /// Copies `src` to the host and waits for it: one synchronisation.
    pub fn read<T: DeviceRepr + Default + Clone>(&self, src: &impl DevicePtr<T>) -> Result<Vec<T>> {
        self.count_sync();
        let mut v = vec![T::default(); src.len()];
        self.stream
            .memcpy_dtoh(src, &mut v)
            .map_err(cuda_err("copying to the host"))?;
        self.stream
            .synchronize()
            .map_err(cuda_err("synchronizing"))?;
        Ok(v)
    }

    /// Compiles one CUDA source with NVRTC for this device (no cache) and returns the cubin.
    /// `name` is the file name NVRTC reports errors against (`name(line): error: ...`); the
    /// headers of `kernels/` (`common.cuh`, `quant.cuh`, `linear.cuh`) can be included, with
    /// the defines of this device's options.
    pub fn compile(&self, name: &str, source: &str) -> Result<Vec<u8>> {
        let defines = self.options.compile_defines();
        compile::compile(name, source, &compile::arch_option(&self.info), &defines)
    }

    /// A zero-filled device buffer of `n` elements.
    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros(n.max(1))
            .map_err(cuda_err(format_args!("allocating {n} elements")))
    }

    /// A device buffer holding `data`.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        if data.is_empty() {
            return Err(Error::Shape("cuda: cannot upload an empty buffer".into()));
        }
        self.stream
            .clone_htod(data)
            .map_err(cuda_err(format_args!("uploading {} elements", data.len())))
    }

    /// Copies `data` into the start of `dst` (asynchronously on the stream; `data` may be reused
    /// as soon as this returns).
    pub fn write<T: DeviceRepr>(&self, dst: &mut impl DevicePtrMut<T>, data: &[T]) -> Result<()> {
        if data.len() > dst.len() {
            return Err(Error::Shape(format!(
                "cuda: writing {} elements into a buffer of {}",
                data.len(),
                dst.len()
            )));
        }
        self.stream
            .memcpy_htod(data, dst)
            .map_err(cuda_err("copying to the device"))
    }

    /// Waits for the stream, then copies a whole device buffer to the host.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        src: &impl DevicePtr<T>,
    ) -> Result<Vec<T>> {
        self.synchronize()?;
        let v = self
            .stream
            .clone_dtoh(src)
            .map_err(cuda_err("copying to the host"))?;
        self.synchronize()?;
        Ok(v)
    }

    /// Starts recording the ops enqueued on this device's stream (by this thread) into a graph.
    pub fn begin_capture(&self) -> Result<()> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda_err("beginning stream capture"))
    }

    /// Ends the capture begun by [`CudaDev::begin_capture`] and instantiates the graph.
    pub fn end_capture(&self) -> Result<DeviceGraph> {
        let g = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(cuda_err("ending stream capture"))?
            .ok_or_else(|| Error::Msg("cuda: the captured graph is empty".into()))?;
        Ok(DeviceGraph { graph: g })
    }

    /// Enqueues one replay of `g`.
    pub fn launch_graph(&self, g: &DeviceGraph) -> Result<()> {
        self.count_graph_launch();
        g.launch()
    }

    /// The kernel `name` of `program`, looked up once and cached.
    pub(crate) fn function(&self, program: Program, name: &str) -> Result<CudaFunction> {
        let mut map = self
            .functions
            .lock()
            .map_err(|_| Error::Msg("cuda: kernel table lock poisoned".into()))?;
        if let Some(f) = map.get(name) {
            return Ok(f.clone());
        }
        let module = self
            .modules
            .get(&program)
            .ok_or_else(|| Error::Msg(format!("cuda: no module for {program:?}")))?;
        let f = module
            .load_function(name)
            .map_err(cuda_err(format_args!("loading kernel {name}")))?;
        // Q, K and V tiles of the prefill attention for Dh = 256 take about 82 KB of shared
        // memory (160 KB for Dh = 512, the kernels of 16 dims per lane: a GPU that cannot give
        // that much fails here, naming the kernel), the training attention's double-buffered
        // tiles up to 104 KB: above the 48 KB a kernel gets without asking.
        let smem = if name.starts_with("attn_prefill") && name.ends_with("_16") {
            Some(ops::PREFILL_WIDE_SMEM)
        } else if name.starts_with("attn_prefill") || name.starts_with("paged_prefill") {
            Some(ops::PREFILL_MAX_SMEM)
        } else if name.starts_with("ta_") {
            Some(train::TRAIN_ATTN_MAX_SMEM)
        } else if name.starts_with("mega_") {
            Some(mega::MEGA_MAX_SMEM)
        } else {
            None
        };
        if let Some(smem) = smem {
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(cuda_err(format_args!(
                "raising the shared memory of {name}"
            )))?;
        }
        map.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// Enqueues kernel `f` on the stream, with programmatic dependent launch when it is on
    /// (see `pdl_wait` in `kernels/common.cuh`: every kernel waits for its predecessor before
    /// touching memory, so the overlap is only launch latency).
    ///
    /// # Safety
    /// `params` must match the kernel's parameter list and point at live values; every device
    /// pointer among them must be valid for what the kernel accesses.
    pub(crate) unsafe fn launch_raw(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        params: &mut [*mut std::ffi::c_void],
    ) -> std::result::Result<(), DriverError> {
        // SAFETY: a plain C struct of integers and a union; all zero is a valid value.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.pdl),
        };
        // SAFETY: the caller's contract; `cfg` and `attr` outlive the call.
        unsafe { sys::cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
    }

    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))
    }
}

/// A captured, instantiated sequence of ops; [`DeviceGraph::launch`] replays it on the stream it
/// was captured from. Not thread-safe (the driver's rule for graphs): launch from one thread.
pub struct DeviceGraph {
    graph: cudarc::driver::CudaGraph,
}

impl DeviceGraph {
    /// Nodes in the graph (kernels, copies, allocations).
    pub fn node_count(&self) -> usize {
        let mut n: usize = 0;
        // SAFETY: the graph handle is alive while `self` is; a null node array asks for the count.
        let r =
            unsafe { sys::cuGraphGetNodes(self.graph.cu_graph(), std::ptr::null_mut(), &mut n) };
        if r == sys::CUresult::CUDA_SUCCESS {
            n
        } else {
            0
        }
    }

    /// Enqueues one replay.
    pub fn launch(&self) -> Result<()> {
        self.graph.launch().map_err(cuda_err("launching a graph"))
    }
}
