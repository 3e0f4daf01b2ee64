//! `CudaBackend`: the [`Backend`] op set on one GPU, over the kernels of [`crate`]. The
//! model code is the same as on the CPU; only where tensors live changes.
//!
//! - Activations are device [`Tensor`]s: each op allocates its output on the device's stream
//!   (stream-ordered allocation) and the tensor keeps the buffer alive ([`DeviceSpan::owner`]).
//!   A clone of a device tensor shares its buffer.
//! - Weights stay `QTensor`s in the model; the first op that uses one uploads its stored bytes
//!   once ([`crate::DeviceWeight`]) and keeps them, keyed by the address of the stored
//!   bytes (which the cache keeps alive, so the key stays unique across models). Norm weights,
//!   biases (checked against their values on each hit) and RoPE tables likewise.
//! - KV caches start as empty host stores ([`KvStore::new`]); the first `kv_write` replaces one
//!   with a device cache of the full session limit (f16 by default).
//! - Positions: the kernels read `pos0` from a device word, which this backend writes before
//!   each op that needs it (eager mode). Token ids are uploaded per call.
//!
//! - Decode as one CUDA graph ([`CudaBackend::capture`]): token ids and `pos0` are read from
//!   device words that the host writes before each replay; while capturing, ops write neither
//!   (the kernels read them at replay time) and every temporary is a stream-ordered allocation
//!   made and freed inside the graph, so one launch replays the whole step. The output is copied
//!   into a buffer that outlives the graph.
//!
//! - Token picking on the device: the captured graph can end in an argmax or a top-k sampling
//!   draw ([`StepOutput`]), so a replay returns one token id per row
//!   ([`CudaBackend::replay_pick`]).
//! - While capturing, activations come from one arena (`Arena`): the graph holds kernels only.
//! - Host constants inside a captured step (a small tensor the model code uploads each step,
//!   such as Gemma 4's `[[1]]` for its layer scalars): a graph cannot copy from host memory, so
//!   small uploads of eager steps are kept by value (`ConstCache`) and a capture that uploads
//!   the same values copies them from the device; other uploads refuse the capture
//!   ([`Error::NotCapturable`]: the model then decodes eagerly), as does an embedding of ids
//!   other than the step's tokens (a replay reads the tokens' device word).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};

use crate::backend_moe::{MoeOut, RouteIn};
use crate::{
    CudaDev, DeviceKvCache, DevicePtrMutF32, DeviceWeight, KvDtype, RopeTable, RowNorm, SampleArgs,
};
use hf2q_tensor::kv::{check_fits, DeviceKv, KvStore, KvType};
use hf2q_tensor::moe::{check_moe, moe_ffn_composed, Experts, MoeSpec};
use hf2q_tensor::op::{
    check_rows, linear_add_composed, linear_gated_composed, linear_many_composed,
    rope_store_composed, same_shape, AttentionParams, Backend, GateAct, MatmulSpec, PreNorm,
    RopeParams,
};
use hf2q_tensor::paged::{PagedLayout, PagedStep, PagedStore};
use hf2q_tensor::tensor::DeviceSpan;
use hf2q_tensor::{Error, QTensor, Result, Tensor};

/// Uploaded f32 vectors (norm weights, biases) by host address and length, with the values they
/// had (a hit is checked against them: a freed vector's address may come back with new values).
type VectorCache = HashMap<(usize, usize), (Vec<f32>, Arc<CudaSlice<f32>>)>;

/// Uploaded weights by the address and length of their stored bytes, each with a handle on
/// those bytes: while the entry lives the host memory cannot be freed, so its address cannot be
/// reused by another weight (a model loaded after another one was dropped).
type WeightCache = HashMap<(usize, usize), (hf2q_tensor::Bytes, Arc<DeviceWeight>)>;

/// Device copies of the small host tensors eager steps uploaded, by shape and value bits (see
/// the module header): at most [`CONST_MAX_ENTRIES`] of at most [`CONST_MAX_LEN`] values.
type ConstCache = HashMap<(Vec<usize>, Vec<u32>), Arc<CudaSlice<f32>>>;
const CONST_MAX_LEN: usize = 16;
const CONST_MAX_ENTRIES: usize = 256;

/// The GPU backend (see the module header).
pub struct CudaBackend {
    dev: Arc<CudaDev>,
    kv_dtype: KvDtype,
    weights: Mutex<WeightCache>,
    pub(crate) stacks: Mutex<crate::backend_moe::StackCache>,
    vectors: Mutex<VectorCache>,
    consts: Mutex<ConstCache>,
    ropes: Mutex<HashMap<Vec<u32>, Arc<RopeTable>>>,
    /// The `pos0` word the kernels read.
    pos: Mutex<PosWord>,
    /// Token ids of the step (grows outside captures).
    ids: Mutex<CudaSlice<u32>>,
    /// While a graph is being captured: inputs are not written by the ops.
    capturing: std::sync::atomic::AtomicBool,
    /// The token ids of the step being captured: its embeddings read them from the device word
    /// at replay, so an embedding of other ids (Gemma 4's per-layer rows) refuses the capture.
    step_ids: Mutex<Vec<u32>>,
    /// Where the activations of a captured step live (see [`Arena`]).
    arena: Mutex<Arena>,
    /// Tests: the training ops fill each new output with NaN before writing it, so that an
    /// element a kernel leaves unwritten shows ([`CudaBackend::set_poison_outputs`]).
    pub(crate) poison: std::sync::atomic::AtomicBool,
    /// Depth alignment of `linear_low_rank`'s appended products ([`CudaBackend::set_low_rank_align`]).
    pub(crate) low_rank_align: std::sync::atomic::AtomicUsize,
    /// Models prepared for the decode megakernel (`crate::mega`), kept while the backend lives.
    pub(crate) mega: Mutex<Vec<crate::mega::MegaState>>,
}

/// One buffer shared by every captured step: while capturing, each op's output is the next
/// piece of it, so a replay reads and writes the same addresses every step and the graph holds
/// only kernels (no allocation, zero-fill or free nodes). Steps never overlap (one stream), and
/// nothing outlives a step but the KV caches and the graph's own output buffer, which are not
/// in the arena, so all graphs can share it. Sized by the capture itself: one that does not fit
/// takes stream-ordered allocations for the rest, records how much it needed, and is captured
/// again after the arena grows.
struct Arena {
    buf: Option<Arc<CudaSlice<u8>>>,
    base: u64,
    size: usize,
    used: usize,
    /// Bytes the current capture asked for in all.
    wanted: usize,
}

/// The device `pos0` word and the value last written to it: the ops of one step all ask for the
/// same position (RoPE, cache write, attention in every layer), so only a change is copied.
struct PosWord {
    buf: CudaSlice<i32>,
    last: Option<i32>,
}

/// What a captured step ends in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOutput {
    /// The output rows (logits) come back to the host.
    Logits,
    /// The argmax of each row is taken on the device; only token ids come back.
    Argmax,
    /// Each row is sampled on the device (settings written before each replay); only token ids
    /// come back.
    Sample,
}

/// A captured decode step: replay with [`CudaBackend::replay`] (logits) or
/// [`CudaBackend::replay_pick`] (token ids).
pub struct StepGraph {
    graph: crate::DeviceGraph,
    /// The token ids the graph's embedding reads: its own buffer, written before each replay
    /// (the backend's shared ids buffer grows with eager steps, which would leave a graph
    /// reading a freed one).
    input_ids: CudaSlice<u32>,
    out: CudaSlice<f32>,
    kind: StepOutput,
    /// Argmax / Sample graphs: the token picked from each output row inside the graph.
    ids: Option<CudaSlice<u32>>,
    /// Sample graphs: the settings the sampling kernel reads.
    sample_args: Option<CudaSlice<SampleArgs>>,
    /// Masked pick graphs: the allowed-token bits (`ceil(V / 32)` words) applied to the logits
    /// before the pick, written before each replay (constrained decoding).
    mask: Option<CudaSlice<u32>>,
    /// Masked pick graphs: the mask and the pick as a second, small graph over `out`, launched
    /// after `graph` (the forward) so the host can compute the mask while the forward runs
    /// ([`CudaBackend::replay_pick_overlapped`]).
    tail: Option<crate::DeviceGraph>,
    /// The arena the graph's activations live in (kept alive while the graph is).
    _arena: Option<Arc<CudaSlice<u8>>>,
    shape: Vec<usize>,
    tokens: usize,
}

impl StepGraph {
    /// What this graph ends in.
    pub fn output(&self) -> StepOutput {
        self.kind
    }
    /// Whether the pick applies a token mask first ([`CudaBackend::capture_masked`]).
    pub fn is_masked(&self) -> bool {
        self.mask.is_some()
    }
    /// Nodes of the captured graph (kernels, copies, allocations): the work of one replay.
    pub fn node_count(&self) -> usize {
        self.graph.node_count()
    }
    /// The buffer the graph copies its output into, and that output's shape.
    pub(crate) fn output_buffer(&self) -> (&CudaSlice<f32>, &[usize]) {
        (&self.out, &self.shape)
    }
}

// SAFETY: a graph is only launched through `&mut StepGraph` (one thread at a time), which is
// what the driver requires; the buffers it refers to are owned by the backend or the caches the
// graph was captured with.
unsafe impl Send for StepGraph {}
unsafe impl Sync for StepGraph {}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StepGraph({} tokens -> {:?})", self.tokens, self.shape)
    }
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", self.dev.info())
            .field("kv_dtype", &self.kv_dtype)
            .finish()
    }
}

/// A device buffer seen through its raw address, so that ops can read and write tensors that
/// share a buffer. Sound because one stream orders every access (event tracking is off).
pub(crate) struct Raw<'s> {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) len: usize,
    pub(crate) stream: &'s Arc<CudaStream>,
}

impl DeviceSlice<f32> for Raw<'_> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl DevicePtr<f32> for Raw<'_> {
    fn device_ptr<'a>(&'a self, _: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl DevicePtrMut<f32> for Raw<'_> {
    fn device_ptr_mut<'a>(&'a mut self, _: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// The device KV cache as a [`KvStore`] payload.
pub(crate) struct Kv(pub(crate) DeviceKvCache);

impl DeviceKv for Kv {
    fn bytes(&self) -> usize {
        let size = match self.0.dtype() {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        };
        2 * self.0.n_kv_heads() * self.0.capacity() * self.0.head_dim() * size
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CudaBackend {
    pub fn new(dev: Arc<CudaDev>, kv_dtype: KvDtype) -> Result<CudaBackend> {
        let pos = dev.alloc::<i32>(1)?;
        let ids = dev.alloc::<u32>(256)?;
        Ok(CudaBackend {
            dev,
            kv_dtype,
            weights: Mutex::new(HashMap::new()),
            stacks: Mutex::new(HashMap::new()),
            vectors: Mutex::new(HashMap::new()),
            consts: Mutex::new(HashMap::new()),
            ropes: Mutex::new(HashMap::new()),
            pos: Mutex::new(PosWord {
                buf: pos,
                last: None,
            }),
            ids: Mutex::new(ids),
            capturing: std::sync::atomic::AtomicBool::new(false),
            step_ids: Mutex::new(Vec::new()),
            arena: Mutex::new(Arena {
                buf: None,
                base: 0,
                size: 0,
                used: 0,
                wanted: 0,
            }),
            poison: std::sync::atomic::AtomicBool::new(false),
            low_rank_align: std::sync::atomic::AtomicUsize::new(
                crate::backend_train::LOW_RANK_ALIGN,
            ),
            mega: Mutex::new(Vec::new()),
        })
    }

    /// The multiple the depth of `linear_low_rank`'s products is padded to with zeros (benches;
    /// 8 at least).
    #[doc(hidden)]
    pub fn set_low_rank_align(&self, n: usize) {
        self.low_rank_align.store(
            n.max(8).next_multiple_of(8),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Whether the training ops fill their outputs with NaN first (tests; default off).
    #[doc(hidden)]
    pub fn set_poison_outputs(&self, on: bool) {
        self.poison.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// [`Backend::linear_many`] (of `rms_norm(x)` with `norm`) as one one-token launch, or
    /// `None` where that launch does not apply (more than one token, formats or widths the
    /// fused kernels do not take, a norm the launch would not fold: [`CudaDev::folds_norm`]).
    fn fused_many(
        &self,
        x: &Tensor,
        norm: Option<PreNorm<'_>>,
        ws: &[(&QTensor, Option<&[f32]>)],
    ) -> Result<Option<Vec<Tensor>>> {
        let (t, c) = x.dims2();
        let dws = ws
            .iter()
            .map(|(w, _)| self.weight(w))
            .collect::<Result<Vec<_>>>()?;
        let fused = t == 1
            && (1..=3).contains(&ws.len())
            && dws
                .iter()
                .all(|d| self.dev.has_fast_matvec(d) && d.cols == c && d.kind() == dws[0].kind())
            && norm.is_none_or(|n| {
                n.w.len() == c
                    && self
                        .dev
                        .folds_norm(&dws[0], dws.iter().map(|d| d.rows * d.cols).sum())
            })
            && self.raw(x, "linear")?.ptr % 16 == 0;
        if !fused {
            return Ok(None);
        }
        let nw = norm.map(|n| self.vector(n.w)).transpose()?;
        let rn = norm.zip(nw.as_deref()).map(|(n, w)| RowNorm {
            w,
            eps: n.eps,
            offset: n.offset,
        });
        let biases = ws
            .iter()
            .map(|(_, b)| b.map(|b| self.vector(b)).transpose())
            .collect::<Result<Vec<_>>>()?;
        let outs = dws
            .iter()
            .map(|d| self.alloc(&[1, d.rows]))
            .collect::<Result<Vec<_>>>()?;
        let mut raws = outs
            .iter()
            .map(|o| self.raw(o, "linear"))
            .collect::<Result<Vec<_>>>()?;
        let xi = self.raw(x, "linear")?;
        let mut jobs: Vec<(
            &DeviceWeight,
            Option<&CudaSlice<f32>>,
            &mut dyn DevicePtrMutF32,
        )> = dws
            .iter()
            .zip(&biases)
            .zip(raws.iter_mut())
            .map(|((d, b), r)| (&**d, b.as_deref(), r as &mut dyn DevicePtrMutF32))
            .collect();
        self.dev.linear_many_normed(&xi, rn.as_ref(), &mut jobs)?;
        Ok(Some(outs))
    }

    /// [`Backend::linear_gated`] (of `rms_norm(x)` with `norm`) as one one-token launch, or
    /// `None` where that launch does not apply (as [`CudaBackend::fused_many`]).
    fn fused_gated(
        &self,
        x: &Tensor,
        norm: Option<PreNorm<'_>>,
        gate: &QTensor,
        up: &QTensor,
        act: GateAct,
    ) -> Result<Option<Tensor>> {
        // The one-token gated kernels know SiLU and GELU; the clamped SwiGLU takes the two
        // products and `gated_act`.
        if matches!(act, GateAct::ClampedSwiglu { .. }) {
            return Ok(None);
        }
        let (t, c) = x.dims2();
        let (g, u) = (self.weight(gate)?, self.weight(up)?);
        if t != 1
            || c != gate.cols
            || !self.dev.has_fast_matvec(&g)
            || g.kind() != u.kind()
            || (g.rows, g.cols) != (u.rows, u.cols)
            || norm.is_some_and(|n| n.w.len() != c || !self.dev.folds_norm(&g, g.rows * g.cols))
            || self.raw(x, "linear")?.ptr % 16 != 0
        {
            return Ok(None);
        }
        let nw = norm.map(|n| self.vector(n.w)).transpose()?;
        let rn = norm.zip(nw.as_deref()).map(|(n, w)| RowNorm {
            w,
            eps: n.eps,
            offset: n.offset,
        });
        let out = self.alloc(&[1, g.rows])?;
        let xi = self.raw(x, "linear")?;
        let mut o = self.raw(&out, "linear")?;
        self.dev
            .linear_gated_normed(&xi, rn.as_ref(), &g, &u, act == GateAct::GeluTanh, &mut o)?;
        Ok(Some(out))
    }

    pub fn device(&self) -> &Arc<CudaDev> {
        &self.dev
    }

    /// A new device tensor of `shape`: zero-filled, or while capturing the next piece of the
    /// arena (uninitialised: every op writes all of its output).
    pub(crate) fn alloc(&self, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if self.capturing() {
            let mut a = lock(&self.arena);
            let bytes = (n.max(1) * 4).next_multiple_of(256);
            a.wanted += bytes;
            if a.used + bytes <= a.size {
                if let Some(buf) = a.buf.clone() {
                    let ptr = a.base + a.used as u64;
                    a.used += bytes;
                    return Tensor::on_device(
                        shape,
                        DeviceSpan {
                            ptr,
                            len: n,
                            owner: buf,
                        },
                    );
                }
            }
        }
        let buf: CudaSlice<f32> = self.dev.alloc(n)?;
        let (ptr, _) = buf.device_ptr(self.dev.stream());
        Tensor::on_device(
            shape,
            DeviceSpan {
                ptr,
                len: n,
                owner: Arc::new(buf),
            },
        )
    }

    /// `x` as a device buffer view; host tensors are an error (model code keeps activations
    /// where the backend put them).
    pub(crate) fn raw<'s>(&'s self, x: &Tensor, what: &str) -> Result<Raw<'s>> {
        let span = x.device_span().ok_or_else(|| {
            Error::Msg(format!(
                "cuda {what}: the input is a host tensor (expected a device tensor)"
            ))
        })?;
        Ok(Raw {
            ptr: span.ptr,
            len: span.len,
            stream: self.dev.stream(),
        })
    }

    pub(crate) fn weight(&self, w: &QTensor) -> Result<Arc<DeviceWeight>> {
        let (key, bytes) = weight_key(w);
        if let Some((_, d)) = lock(&self.weights).get(&key) {
            return Ok(d.clone());
        }
        let d = Arc::new(self.dev.upload_weight(w)?);
        lock(&self.weights).insert(key, (bytes.clone(), d.clone()));
        Ok(d)
    }

    /// Drops the device copy of `w` and the handle on its bytes, if it was uploaded (a weight
    /// taken out of a model); a later use of `w` uploads it again.
    pub fn forget_weight(&self, w: &QTensor) {
        lock(&self.weights).remove(&weight_key(w).0);
    }

    pub(crate) fn vector(&self, v: &[f32]) -> Result<Arc<CudaSlice<f32>>> {
        let key = (v.as_ptr() as usize, v.len());
        if let Some((host, d)) = lock(&self.vectors).get(&key) {
            if host.as_slice() == v {
                return Ok(d.clone());
            }
        }
        let d = Arc::new(self.dev.upload(v)?);
        lock(&self.vectors).insert(key, (v.to_vec(), d.clone()));
        Ok(d)
    }

    pub(crate) fn rope_table(&self, p: &RopeParams) -> Result<Arc<RopeTable>> {
        let mut key = vec![
            p.style as u32,
            p.theta.to_bits(),
            p.dims as u32,
            p.linear_scale.to_bits(),
        ];
        if let Some(ff) = &p.freq_factors {
            key.extend(ff.iter().map(|f| f.to_bits()));
        }
        if let Some(t) = lock(&self.ropes).get(&key) {
            return Ok(t.clone());
        }
        let t = Arc::new(self.dev.rope_table(p)?);
        lock(&self.ropes).insert(key, t.clone());
        Ok(t)
    }

    pub(crate) fn capturing(&self) -> bool {
        self.capturing.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Writes `pos0` into the device word the kernels read (not while capturing: then the host
    /// writes it before each replay), and returns the word.
    fn set_pos(&self, pos0: usize) -> Result<std::sync::MutexGuard<'_, PosWord>> {
        let mut g = lock(&self.pos);
        if !self.capturing() {
            self.write_pos(&mut g, pos0)?;
        }
        Ok(g)
    }

    /// [`CudaBackend::set_pos`] for kernels that take the word's address themselves.
    pub(crate) fn set_pos_word(&self, pos0: usize) -> Result<()> {
        self.set_pos(pos0).map(drop)
    }

    /// The device address of the `pos0` word.
    pub(crate) fn pos_ptr(&self) -> u64 {
        lock(&self.pos).buf.device_ptr(self.dev.stream()).0
    }

    fn write_pos(&self, w: &mut PosWord, pos0: usize) -> Result<()> {
        let v = i32::try_from(pos0)
            .map_err(|_| Error::Shape(format!("cuda: position {pos0} does not fit 32 bits")))?;
        if w.last != Some(v) {
            self.dev.write(&mut w.buf, &[v])?;
            w.last = Some(v);
        }
        Ok(())
    }

    /// Copies token ids into the device word the embedding reads (grown as needed).
    fn write_ids(&self, ids: &[u32]) -> Result<()> {
        let mut g = lock(&self.ids);
        if g.len() < ids.len() {
            *g = self.dev.alloc::<u32>(ids.len().next_power_of_two())?;
        }
        self.dev.write(&mut *g, ids)
    }

    /// Writes a replay's inputs: the token ids into the graph's own buffer, `pos0` into the
    /// device word.
    fn write_inputs(&self, g: &mut StepGraph, ids: &[u32], pos0: usize) -> Result<()> {
        if ids.len() != g.tokens {
            return Err(Error::Shape(format!(
                "cuda replay: the graph takes {} tokens, {} given",
                g.tokens,
                ids.len()
            )));
        }
        if !ids.is_empty() {
            self.dev.write(&mut g.input_ids, ids)?;
        }
        self.write_pos(&mut lock(&self.pos), pos0)
    }

    /// Captures one step as a graph: `step` enqueues the ops of a forward of `ids` at `pos0`
    /// (every weight, norm and cache it touches must already be on the device: run one eager
    /// step first) and returns its output, `out_len` values, which the graph copies into a
    /// buffer of its own. With [`StepOutput::Argmax`] or [`StepOutput::Sample`] the graph also
    /// picks a token from each output row (a logits row per token) on the device, so that a
    /// replay returns only token ids. Capturing runs nothing: replay the graph for this step's
    /// result.
    pub fn capture<E: From<Error>>(
        &self,
        ids: &[u32],
        pos0: usize,
        out_len: usize,
        kind: StepOutput,
        step: impl FnMut() -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<StepGraph, E> {
        self.capture_with(ids, pos0, out_len, kind, false, step)
    }

    /// [`CudaBackend::capture`] of a pick graph ([`StepOutput::Argmax`] or
    /// [`StepOutput::Sample`]) that first bans the tokens a mask does not allow: the mask is a
    /// device buffer the replay writes ([`CudaBackend::replay_pick`]'s `mask`), so the graph
    /// stays the same for every step of a constrained sequence.
    pub fn capture_masked<E: From<Error>>(
        &self,
        ids: &[u32],
        pos0: usize,
        out_len: usize,
        kind: StepOutput,
        step: impl FnMut() -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<StepGraph, E> {
        if kind == StepOutput::Logits {
            return Err(Error::Msg("cuda capture: a masked graph must pick tokens".into()).into());
        }
        self.capture_with(ids, pos0, out_len, kind, true, step)
    }

    fn capture_with<E: From<Error>>(
        &self,
        ids: &[u32],
        pos0: usize,
        out_len: usize,
        kind: StepOutput,
        masked: bool,
        mut step: impl FnMut() -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<StepGraph, E> {
        let g = self.capture_once(ids, pos0, out_len, kind, masked, &mut step)?;
        let (wanted, size) = {
            let a = lock(&self.arena);
            (a.wanted, a.size)
        };
        if wanted <= size {
            return Ok(g);
        }
        // The step did not fit the arena: grow it (nothing else uses it now) and capture again.
        drop(g);
        self.dev.synchronize()?;
        let buf = self.dev.alloc::<u8>(wanted)?;
        {
            let mut a = lock(&self.arena);
            a.base = buf.device_ptr(self.dev.stream()).0;
            a.buf = Some(Arc::new(buf));
            a.size = wanted;
        }
        self.capture_once(ids, pos0, out_len, kind, masked, &mut step)
    }

    fn capture_once<E: From<Error>>(
        &self,
        ids: &[u32],
        pos0: usize,
        out_len: usize,
        kind: StepOutput,
        masked: bool,
        step: &mut impl FnMut() -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<StepGraph, E> {
        use std::sync::atomic::Ordering::Relaxed;
        self.write_pos(&mut lock(&self.pos), pos0)?;
        let mut input_ids = self.dev.alloc::<u32>(ids.len().max(1))?;
        if !ids.is_empty() {
            self.dev.write(&mut input_ids, ids)?;
        }
        *lock(&self.step_ids) = ids.to_vec();
        {
            let mut a = lock(&self.arena);
            a.used = 0;
            a.wanted = 0;
        }
        let mut out = self.dev.alloc::<f32>(out_len)?;
        let mut picked = if kind == StepOutput::Logits {
            None
        } else {
            Some(self.dev.alloc::<u32>(ids.len().max(1))?)
        };
        let sample_args = if kind == StepOutput::Sample {
            Some(self.dev.alloc::<SampleArgs>(1)?)
        } else {
            None
        };
        // One row's width of bits (every row of a step shares the mask).
        let mask = if masked {
            Some(
                self.dev
                    .alloc::<u32>((out_len / ids.len().max(1)).div_ceil(32).max(1))?,
            )
        } else {
            None
        };
        self.dev.synchronize()?;
        // The graph's embedding reads its own ids buffer: it stands in for the shared one
        // while capturing (swapped back below, whatever happens).
        std::mem::swap(&mut *lock(&self.ids), &mut input_ids);
        if let Err(e) = self.dev.begin_capture() {
            std::mem::swap(&mut *lock(&self.ids), &mut input_ids);
            return Err(e.into());
        }
        self.capturing.store(true, Relaxed);
        let recorded = (|| -> std::result::Result<Vec<usize>, E> {
            let y = step()?;
            if y.len() != out_len {
                return Err(Error::Shape(format!(
                    "cuda capture: the step returned {} values, {out_len} expected",
                    y.len()
                ))
                .into());
            }
            let src = self.raw(&y, "capture")?;
            self.dev
                .stream()
                .memcpy_dtod(&src, &mut out)
                .map_err(|e| Error::Msg(format!("cuda: copying the step's output: {e}")))?;
            if let Some(p) = picked.as_mut() {
                let (rows, cols) = y.dims2();
                if rows != ids.len() {
                    return Err(Error::Shape(format!(
                        "cuda capture: {rows} output rows for {} tokens",
                        ids.len()
                    ))
                    .into());
                }
                // A masked pick goes into the tail graph, captured below.
                if mask.is_none() {
                    match &sample_args {
                        Some(a) => self.dev.sample(&src, rows, cols, a, p)?,
                        None => self.dev.argmax(&src, rows, cols, p)?,
                    }
                }
            }
            Ok(y.shape().to_vec())
        })();
        self.capturing.store(false, Relaxed);
        // End the capture whatever happened, so the stream is usable again.
        let graph = self.dev.end_capture();
        std::mem::swap(&mut *lock(&self.ids), &mut input_ids);
        let shape = recorded?;
        let graph = graph?;
        let tail = match (&mask, picked.as_mut()) {
            (Some(m), Some(p)) => {
                // (rows, cols) = (tokens, V): the mask bans in place in the graph's own copy
                // of the logits, then the pick reads it.
                let (rows, cols) = (ids.len(), out_len / ids.len().max(1));
                self.dev.begin_capture()?;
                let recorded = (|| -> Result<()> {
                    self.dev.apply_token_mask(&mut out, rows, cols, m)?;
                    match &sample_args {
                        Some(a) => self.dev.sample(&out, rows, cols, a, p),
                        None => self.dev.argmax(&out, rows, cols, p),
                    }
                })();
                let tail = self.dev.end_capture();
                recorded?;
                Some(tail?)
            }
            _ => None,
        };
        Ok(StepGraph {
            graph,
            input_ids,
            out,
            _arena: lock(&self.arena).buf.clone(),
            kind,
            ids: picked,
            sample_args,
            mask,
            tail,
            shape,
            tokens: ids.len(),
        })
    }

    /// Runs a captured step for `ids` at `pos0` and returns its output on the host.
    pub fn replay(&self, g: &mut StepGraph, ids: &[u32], pos0: usize) -> Result<Tensor> {
        self.replay_launch(g, ids, pos0)?;
        let data = self.dev.read(&g.out)?;
        Tensor::new(&g.shape, data)
    }

    /// Launches a captured step for `ids` at `pos0` and returns at once: its output stays in
    /// the graph's buffer for [`CudaBackend::pick_graph_rows`] (nothing crosses to the host).
    pub fn replay_launch(&self, g: &mut StepGraph, ids: &[u32], pos0: usize) -> Result<()> {
        self.write_inputs(g, ids, pos0)?;
        self.dev.launch_graph(&g.graph)
    }

    /// Runs a graph that picks tokens ([`StepOutput::Argmax`], or [`StepOutput::Sample`] with
    /// `sample` settings) for `ids` at `pos0` and returns the token picked from each row: the
    /// only data that crosses to the host. A masked graph ([`CudaBackend::capture_masked`])
    /// takes this step's allowed-token bits in `mask` (uploaded before the launch); others
    /// take `None`.
    pub fn replay_pick(
        &self,
        g: &mut StepGraph,
        ids: &[u32],
        pos0: usize,
        sample: Option<SampleArgs>,
        mask: Option<&[u32]>,
    ) -> Result<Vec<u32>> {
        match mask {
            None => self.replay_pick_unmasked(g, ids, pos0, sample),
            Some(m) => self.replay_pick_overlapped(g, ids, pos0, sample, || Ok(Some(m))),
        }
    }

    /// [`CudaBackend::replay_pick`] of a masked graph whose mask the host computes while the
    /// forward runs: the forward is launched, then `mask` is called (its `None`: every token
    /// allowed), then the mask is uploaded and the pick (the graph's small tail) launched behind
    /// it on the same stream. Constrained decoding hides the grammar's work this way.
    pub fn replay_pick_overlapped<'m, E: From<Error>>(
        &self,
        g: &mut StepGraph,
        ids: &[u32],
        pos0: usize,
        sample: Option<SampleArgs>,
        mask: impl FnOnce() -> std::result::Result<Option<&'m [u32]>, E>,
    ) -> std::result::Result<Vec<u32>, E> {
        if g.tail.is_none() || g.mask.is_none() {
            return Err(Error::Msg("cuda replay: this graph takes no token mask".into()).into());
        }
        self.check_pick(g, ids, sample)?;
        self.write_inputs(g, ids, pos0)?;
        self.dev.launch_graph(&g.graph)?;
        let bits = mask()?;
        let buf = g.mask.as_mut().expect("checked above");
        match bits {
            Some(m) if m.len() == buf.len() => self.dev.write(buf, m)?,
            Some(m) => {
                return Err(Error::Shape(format!(
                    "cuda replay: a token mask of {} words for a graph of {}",
                    m.len(),
                    buf.len()
                ))
                .into())
            }
            None => self.dev.write(buf, &vec![u32::MAX; buf.len()])?,
        }
        self.dev
            .launch_graph(g.tail.as_ref().expect("checked above"))?;
        Ok(self
            .dev
            .read(g.ids.as_ref().expect("a masked graph picks"))?)
    }

    fn replay_pick_unmasked(
        &self,
        g: &mut StepGraph,
        ids: &[u32],
        pos0: usize,
        sample: Option<SampleArgs>,
    ) -> Result<Vec<u32>> {
        if g.mask.is_some() {
            return Err(Error::Msg(
                "cuda replay: this graph needs a token mask".into(),
            ));
        }
        self.check_pick(g, ids, sample)?;
        self.write_inputs(g, ids, pos0)?;
        self.dev.launch_graph(&g.graph)?;
        self.dev
            .read(g.ids.as_ref().expect("checked: a pick graph"))
    }

    /// Checks a pick replay's inputs against its graph and writes the sampling settings.
    fn check_pick(&self, g: &mut StepGraph, ids: &[u32], sample: Option<SampleArgs>) -> Result<()> {
        if ids.len() != g.tokens {
            return Err(Error::Shape(format!(
                "cuda replay: the graph takes {} tokens, {} given",
                g.tokens,
                ids.len()
            )));
        }
        if g.ids.is_none() {
            return Err(Error::Msg("cuda replay: this graph returns logits".into()));
        }
        match (g.sample_args.as_mut(), sample) {
            (Some(buf), Some(a)) => {
                if !(a.temperature > 0.0)
                    || a.top_k < 1
                    || a.top_k as usize > crate::SAMPLE_MAX_K
                    || !(0.0..1.0).contains(&a.u)
                {
                    return Err(Error::Msg(format!(
                        "cuda sampling: settings out of range: {a:?}"
                    )));
                }
                self.dev.write(buf, &[a])?
            }
            (None, None) => {}
            _ => {
                return Err(Error::Msg(
                    "cuda replay: sampling settings do not match the graph".into(),
                ))
            }
        }
        Ok(())
    }

    /// A device copy of a host tensor (tests, and host inputs at the model's edge).
    pub fn upload(&self, x: &Tensor) -> Result<Tensor> {
        let out = self.alloc(x.shape())?;
        if x.is_empty() {
            return Ok(out);
        }
        let key = (x.len() <= CONST_MAX_LEN).then(|| {
            let bits = x.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            (x.shape().to_vec(), bits)
        });
        let mut o = self.raw(&out, "upload")?;
        if self.capturing() {
            // A graph cannot copy from host memory: the same values from an eager step's copy.
            let Some(src) = key.and_then(|k| lock(&self.consts).get(&k).cloned()) else {
                return Err(Error::NotCapturable(format!(
                    "a host tensor of shape {:?} is uploaded inside the step",
                    x.shape()
                )));
            };
            self.dev
                .stream()
                .memcpy_dtod(&*src, &mut o)
                .map_err(|e| Error::Msg(format!("cuda: copying a constant: {e}")))?;
            return Ok(out);
        }
        self.dev.write(&mut o, x.data())?;
        if let Some(k) = key {
            let mut c = lock(&self.consts);
            if c.len() < CONST_MAX_ENTRIES && !c.contains_key(&k) {
                c.insert(k, Arc::new(self.dev.upload(x.data())?));
            }
        }
        Ok(out)
    }
}

/// Weights are keyed by the address and length of their stored bytes (mapped file or owned
/// buffer), which the cache keeps alive — two live tensors never share both.
pub(crate) fn weight_key(w: &QTensor) -> ((usize, usize), &hf2q_tensor::Bytes) {
    let b = match &w.data {
        hf2q_tensor::WeightData::Ggml { data, .. } => data,
        hf2q_tensor::WeightData::Affine { packed, .. } => packed,
    };
    ((b.as_slice().as_ptr() as usize, b.len()), b)
}

impl Backend for CudaBackend {
    fn embedding(&self, table: &QTensor, ids: &[u32], scale: f32) -> Result<Tensor> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.rows) {
            return Err(Error::Shape(format!(
                "embedding: token id {bad} is outside the table of {} rows",
                table.rows
            )));
        }
        let w = self.weight(table)?;
        let out = self.alloc(&[ids.len(), table.cols])?;
        if ids.is_empty() {
            return Ok(out);
        }
        if !self.capturing() {
            self.write_ids(ids)?;
        } else if *lock(&self.step_ids) != ids {
            return Err(Error::NotCapturable(
                "an embedding of ids other than the step's tokens (a replay reads the tokens)"
                    .into(),
            ));
        }
        let dids = lock(&self.ids);
        let mut o = self.raw(&out, "embedding")?;
        self.dev.embedding(&w, &*dids, ids.len(), scale, &mut o)?;
        Ok(out)
    }

    fn rms_norm(&self, x: &Tensor, w: &[f32], eps: f32, offset: f32) -> Result<Tensor> {
        let (rows, cols) = x.dims2();
        if w.len() != cols {
            return Err(Error::Shape(format!(
                "rms_norm: weight of {} for rows of {cols}",
                w.len()
            )));
        }
        let wd = self.vector(w)?;
        let out = self.alloc(x.shape())?;
        let xi = self.raw(x, "rms_norm")?;
        let mut o = self.raw(&out, "rms_norm")?;
        self.dev
            .rms_norm(&xi, &*wd, rows, cols, eps, offset, &mut o)?;
        Ok(out)
    }

    fn linear(&self, x: &Tensor, w: &QTensor, bias: Option<&[f32]>) -> Result<Tensor> {
        let (t, c) = x.dims2();
        if c != w.cols {
            return Err(Error::Shape(format!(
                "linear '{}': input has {c} features, weight takes {}",
                w.name, w.cols
            )));
        }
        let wd = self.weight(w)?;
        let b = bias.map(|b| self.vector(b)).transpose()?;
        let out = self.alloc(&[t, w.rows])?;
        let xi = self.raw(x, "linear")?;
        let mut o = self.raw(&out, "linear")?;
        self.dev.linear(&xi, t, &wd, b.as_deref(), &mut o)?;
        Ok(out)
    }

    fn rope(&self, x: &mut Tensor, n_heads: usize, pos0: usize, p: &RopeParams) -> Result<()> {
        let (t, width) = x.dims2();
        if n_heads == 0 || width % n_heads != 0 {
            return Err(Error::Shape(format!(
                "rope: width {width} is not {n_heads} heads"
            )));
        }
        let table = self.rope_table(p)?;
        let pos = self.set_pos(pos0)?;
        let mut xi = self.raw(x, "rope")?;
        self.dev
            .rope(&mut xi, t, n_heads, width / n_heads, &pos.buf, &table)
    }

    fn kv_write(
        &self,
        kv: &mut KvStore,
        k: &Tensor,
        v: &Tensor,
        pos0: usize,
        limit: usize,
    ) -> Result<()> {
        let (t, _) = k.dims2();
        check_fits(pos0, t, limit)?;
        if let KvStore::Host(h) = kv {
            if h.capacity() > 0 {
                return Err(Error::Msg(
                    "cuda kv_write: this cache already holds positions on the host".into(),
                ));
            }
            // A quantized host type asked for has no device form yet: refuse rather than store
            // something else than was asked.
            KvDtype::try_from(h.kv_types())?;
            let cache =
                self.dev
                    .alloc_kv_cache(h.n_kv_heads(), limit, h.head_dim(), self.kv_dtype)?;
            *kv = KvStore::Device(Box::new(Kv(cache)));
        }
        let KvStore::Device(d) = kv else {
            unreachable!("replaced above")
        };
        let cache = &mut d
            .as_any_mut()
            .downcast_mut::<Kv>()
            .ok_or_else(|| Error::Msg("cuda kv_write: another device's cache".into()))?
            .0;
        let pos = self.set_pos(pos0)?;
        let (ki, vi) = (self.raw(k, "kv_write")?, self.raw(v, "kv_write")?);
        self.dev.kv_write(cache, &ki, &vi, t, &pos.buf)
    }

    fn attend(&self, q: &Tensor, kv: &KvStore, pos0: usize, p: &AttentionParams) -> Result<Tensor> {
        hf2q_tensor::op::check_sinks(p)?;
        let KvStore::Device(d) = kv else {
            return Err(Error::Msg(
                "cuda attention: the cache is not on the device (write it first)".into(),
            ));
        };
        let cache = &d
            .as_any()
            .downcast_ref::<Kv>()
            .ok_or_else(|| Error::Msg("cuda attention: another device's cache".into()))?
            .0;
        let (t, _) = q.dims2();
        if pos0 + t > cache.capacity() {
            return Err(Error::Shape(format!(
                "attention: {} positions exceed the cache capacity {}",
                pos0 + t,
                cache.capacity()
            )));
        }
        let sinks = p.sinks.as_ref().map(|s| self.vector(s)).transpose()?;
        let scratch = self.alloc(&[self.dev.attention_scratch_len(p, cache.capacity()).max(1)])?;
        let out = self.alloc(q.shape())?;
        let pos = self.set_pos(pos0)?;
        let qi = self.raw(q, "attention")?;
        let mut s = self.raw(&scratch, "attention")?;
        let mut o = self.raw(&out, "attention")?;
        self.dev
            .attention(&qi, t, cache, &pos.buf, p, &mut s, &mut o, sinks.as_deref())?;
        Ok(out)
    }

    fn paged_alloc(&self, layout: PagedLayout, ty: KvType) -> Result<PagedStore> {
        self.paged_alloc_device(layout, ty)
    }

    fn paged_prepare(&self, step: &mut PagedStep) -> Result<()> {
        self.paged_prepare_device(step)
    }

    fn paged_rope_store(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        n_heads: usize,
        kv: &mut PagedStore,
        step: &PagedStep,
        p: &RopeParams,
    ) -> Result<()> {
        self.paged_rope_store_device(q, k, v, n_heads, kv, step, p)
    }

    fn paged_attend(
        &self,
        q: &Tensor,
        kv: &PagedStore,
        step: &PagedStep,
        p: &AttentionParams,
    ) -> Result<Tensor> {
        hf2q_tensor::op::check_sinks(p)?;
        self.paged_attend_device(q, kv, step, p)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        same_shape(gate, up, "silu_mul")?;
        let out = self.alloc(gate.shape())?;
        let (g, u) = (self.raw(gate, "silu_mul")?, self.raw(up, "silu_mul")?);
        let mut o = self.raw(&out, "silu_mul")?;
        self.dev.silu_mul(&g, &u, gate.len(), &mut o)?;
        Ok(out)
    }

    fn gelu_tanh_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        same_shape(gate, up, "gelu_tanh_mul")?;
        let out = self.alloc(gate.shape())?;
        let (g, u) = (self.raw(gate, "gelu")?, self.raw(up, "gelu")?);
        let mut o = self.raw(&out, "gelu")?;
        self.dev.gelu_tanh_mul(&g, &u, gate.len(), &mut o)?;
        Ok(out)
    }

    fn gated_act(&self, gate: &Tensor, up: &Tensor, act: GateAct) -> Result<Tensor> {
        match act {
            GateAct::Silu => self.silu_mul(gate, up),
            GateAct::GeluTanh => self.gelu_tanh_mul(gate, up),
            GateAct::ClampedSwiglu { alpha, limit } => {
                same_shape(gate, up, "clamped_swiglu")?;
                let out = self.alloc(gate.shape())?;
                let (g, u) = (self.raw(gate, "swiglu")?, self.raw(up, "swiglu")?);
                let mut o = self.raw(&out, "swiglu")?;
                self.dev
                    .clamped_swiglu_mul(&g, &u, gate.len(), alpha, limit, &mut o)?;
                Ok(out)
            }
        }
    }

    fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        same_shape(x, y, "add")?;
        let n = x.len();
        let mut xi = self.raw(x, "add")?;
        let yi = self.raw(y, "add")?;
        self.dev.add_assign(&mut xi, &yi, n)
    }

    /// In place on the device (one kernel), so soft-capped logits stay inside a captured step.
    fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        let n = x.len();
        let mut xi = self.raw(x, "softcap")?;
        self.dev.softcap(&mut xi, n, cap)
    }

    fn rows(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let c = check_rows(x, start, len)?;
        let out = self.alloc(&[len, c])?;
        if len * c > 0 {
            let xi = self.raw(x, "rows")?;
            let src = Raw {
                ptr: xi.ptr + (start * c * 4) as u64,
                len: len * c,
                stream: self.dev.stream(),
            };
            let mut o = self.raw(&out, "rows")?;
            self.dev
                .stream()
                .memcpy_dtod(&src, &mut o)
                .map_err(|e| Error::Msg(format!("cuda: copying rows: {e}")))?;
        }
        Ok(out)
    }

    fn concat_rows(&self, parts: &[Tensor]) -> Result<Tensor> {
        let c = parts.first().map_or(0, |p| p.dims2().1);
        let total: usize = parts.iter().map(|p| p.dims2().0).sum();
        let out = self.alloc(&[total, c])?;
        let o = self.raw(&out, "concat_rows")?;
        let mut at = 0usize;
        for p in parts {
            let (r, pc) = p.dims2();
            if pc != c {
                return Err(Error::Shape(format!(
                    "concat_rows: rows of {pc} and {c} values"
                )));
            }
            if r * c > 0 {
                let src = self.raw(p, "concat_rows")?;
                let mut dst = Raw {
                    ptr: o.ptr + (at * c * 4) as u64,
                    len: r * c,
                    stream: self.dev.stream(),
                };
                self.dev
                    .stream()
                    .memcpy_dtod(&src, &mut dst)
                    .map_err(|e| Error::Msg(format!("cuda: copying rows: {e}")))?;
            }
            at += r;
        }
        Ok(out)
    }

    fn rope_store(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        n_heads: usize,
        n_kv_heads: usize,
        kv: &mut KvStore,
        pos0: usize,
        limit: usize,
        p: &RopeParams,
    ) -> Result<()> {
        let (t, qw) = q.dims2();
        let fused = match kv {
            KvStore::Device(d) => d.as_any().downcast_ref::<Kv>().is_some_and(|c| {
                c.0.n_kv_heads() == n_kv_heads
                    && n_heads > 0
                    && qw == n_heads * c.0.head_dim()
                    && k.dims2() == (t, n_kv_heads * c.0.head_dim())
            }),
            KvStore::Host(_) => false,
        };
        if !fused {
            // The first write (the cache moves to the device there) and odd shapes.
            let (heads, at) = ((n_heads, n_kv_heads), (pos0, limit));
            return rope_store_composed(self, q, k, v, heads, kv, at, p);
        }
        check_fits(pos0, t, limit)?;
        let KvStore::Device(d) = kv else {
            unreachable!("checked above")
        };
        let cache = &mut d
            .as_any_mut()
            .downcast_mut::<Kv>()
            .expect("checked above")
            .0;
        let table = self.rope_table(p)?;
        let pos = self.set_pos(pos0)?;
        let mut qi = self.raw(q, "rope")?;
        let (ki, vi) = (self.raw(k, "kv_write")?, self.raw(v, "kv_write")?);
        self.dev
            .rope_store(&mut qi, &ki, &vi, t, n_heads, cache, &pos.buf, &table)
    }

    fn linear_many(&self, x: &Tensor, ws: &[(&QTensor, Option<&[f32]>)]) -> Result<Vec<Tensor>> {
        match self.fused_many(x, None, ws)? {
            Some(outs) => Ok(outs),
            None => linear_many_composed(self, x, ws),
        }
    }

    fn linear_add(&self, x: &Tensor, w: &QTensor, residual: &mut Tensor) -> Result<()> {
        let (t, c) = x.dims2();
        let d = self.weight(w)?;
        if t != 1
            || c != w.cols
            || residual.len() != w.rows
            || !self.dev.has_fast_matvec(&d)
            || self.raw(x, "linear")?.ptr % 16 != 0
        {
            return linear_add_composed(self, x, w, residual);
        }
        let xi = self.raw(x, "linear")?;
        let mut r = self.raw(residual, "linear")?;
        self.dev.linear_add(&xi, &d, &mut r)
    }

    fn linear_gated(
        &self,
        x: &Tensor,
        gate: &QTensor,
        up: &QTensor,
        act: GateAct,
    ) -> Result<Tensor> {
        match self.fused_gated(x, None, gate, up, act)? {
            Some(out) => Ok(out),
            None => linear_gated_composed(self, x, gate, up, act),
        }
    }

    fn norm_linear_many(
        &self,
        x: &Tensor,
        norm: PreNorm<'_>,
        ws: &[(&QTensor, Option<&[f32]>)],
    ) -> Result<Vec<Tensor>> {
        if let Some(outs) = self.fused_many(x, Some(norm), ws)? {
            return Ok(outs);
        }
        let h = self.rms_norm(x, norm.w, norm.eps, norm.offset)?;
        self.linear_many(&h, ws)
    }

    fn norm_linear_gated(
        &self,
        x: &Tensor,
        norm: PreNorm<'_>,
        gate: &QTensor,
        up: &QTensor,
        act: GateAct,
    ) -> Result<Tensor> {
        if let Some(out) = self.fused_gated(x, Some(norm), gate, up, act)? {
            return Ok(out);
        }
        let h = self.rms_norm(x, norm.w, norm.eps, norm.offset)?;
        self.linear_gated(&h, gate, up, act)
    }

    fn to_host(&self, x: &Tensor) -> Result<Tensor> {
        if x.is_host() {
            return Ok(x.clone());
        }
        if x.is_empty() {
            return Tensor::new(x.shape(), Vec::new());
        }
        let xi = self.raw(x, "to_host")?;
        let data = self.dev.read(&xi)?;
        Tensor::new(x.shape(), data)
    }

    fn upload(&self, x: &Tensor) -> Result<Tensor> {
        if !x.is_host() {
            return Ok(x.clone());
        }
        CudaBackend::upload(self, x)
    }

    /// On the device where the experts have the one-token kernels (cuda/moe.rs), for any
    /// number of tokens; otherwise the composed form, whose routing reads the logits on the host
    /// and so cannot run inside a captured graph.
    fn moe_ffn(
        &self,
        x: &Tensor,
        logits: &Tensor,
        experts: &Experts,
        spec: &MoeSpec<'_>,
    ) -> Result<Tensor> {
        let t = check_moe(x, logits, experts)?;
        if t == 0 {
            return self.upload(&Tensor::zeros(&[0, experts.hidden()]));
        }
        if let Some(MoeOut::Out(out)) =
            self.moe_ffn_device(x, RouteIn::Logits(logits), experts, spec, t, None)?
        {
            return Ok(out);
        }
        if self.capturing() {
            return Err(Error::NotCapturable(format!(
                "the experts '{}' ({}) have no device expert kernels; their routing reads the \
                 logits on the host",
                experts.expert(0)[0].name,
                experts.expert(0)[0].type_name()
            )));
        }
        moe_ffn_composed(self, x, logits, experts, spec)
    }

    fn moe_ffn_add(
        &self,
        x: &Tensor,
        router: &QTensor,
        experts: &Experts,
        spec: &MoeSpec<'_>,
        residual: &mut Tensor,
    ) -> Result<()> {
        let (t, d) = x.dims2();
        if d != experts.hidden() || router.rows != experts.n_experts() || router.cols != d {
            return Err(Error::Shape(format!(
                "moe_ffn_add: x is {t}x{d}, router '{}' {}x{}, experts {}x{}",
                router.name,
                router.rows,
                router.cols,
                experts.n_experts(),
                experts.hidden()
            )));
        }
        if t == 0 {
            return Ok(());
        }
        let y = match self.moe_ffn_device(
            x,
            RouteIn::Router(router),
            experts,
            spec,
            t,
            Some(residual),
        )? {
            Some(MoeOut::Added) => return Ok(()),
            Some(MoeOut::Out(y)) => y,
            None => {
                let logits = self.linear(x, router, None)?;
                self.moe_ffn(x, &logits, experts, spec)?
            }
        };
        self.add_assign(residual, &y)
    }

    fn matmul(&self, a: &Tensor, b: &Tensor, spec: MatmulSpec) -> Result<Tensor> {
        crate::backend_train::matmul(self, a, b, spec)
    }

    fn matmul_acc(&self, out: &mut Tensor, a: &Tensor, b: &Tensor, spec: MatmulSpec) -> Result<()> {
        crate::backend_train::matmul_acc(self, out, a, b, spec)
    }
}

/// GPT-OSS's clamped SwiGLU has no device kernel yet: refused by name, never run as SiLU.
pub(crate) fn refuse_act(act: GateAct) -> Result<()> {
    if let GateAct::ClampedSwiglu { .. } = act {
        return Err(Error::Msg(
            "the clamped SwiGLU (GPT-OSS experts) is not supported on CUDA yet; run on the CPU"
                .into(),
        ));
    }
    Ok(())
}
