//! The decode megakernel's host side (`kernels/mega.cu`): a batch-1 decode step of a dense
//! Llama-family model whose layer products are all Q4_0, run as one persistent launch over
//! every layer and the final norm (`--cuda-opt decode=mega`).
//!
//! - [`CudaBackend::mega_prepare`] (outside a capture) checks that the model and its caches are
//!   ones the kernel runs, and uploads what the launch reads besides the weights: the table of
//!   layers (weight, norm and cache addresses) and per-layer scratch, kept for the backend's
//!   life (a captured graph refers to them).
//! - [`CudaBackend::mega_step`] enqueues the step (inside a capture: one
//!   kernel node) from the embedded token `x (1, D)` to the final-normed hidden state `(1, D)`.
//!   `Ok(None)` means "not this model or not prepared": the caller runs the per-op step.
//!
//! Not here: the embedding, the output product and the token pick (ordinary ops of the step),
//! other formats, mixtures of experts, batches, sinks, windows, biases, q/k norms.

use cudarc::driver::{CudaSlice, DeviceRepr};

use crate::backend::{lock, CudaBackend, Kv};
use crate::ops::{dims_per_lane, launch};
use crate::weight::WeightArgs;
use crate::{cuda_err, Program};
use hf2q_tensor::kv::KvStore;
use hf2q_tensor::op::{AttentionParams, RopeParams};
use hf2q_tensor::{Error, QTensor, Result, Tensor};

// The launch macro's argument list is of `*mut c_void`.
use std::ffi::c_void;

/// Threads of a block (`MG_THREADS`).
const THREADS: u32 = 128;
/// Most resident blocks per multiprocessor the grid takes (more only lengthen the barriers).
const BLOCKS_PER_SM: u32 = 4;
/// The dynamic shared memory a launch may ask for (the staged input vector, `4 max(D, H Dh, F)`
/// bytes): the kernel's limit is raised to it when it is loaded.
pub(crate) const MEGA_MAX_SMEM: usize = 160 * 1024;

/// One layer of a dense Llama-family block as the megakernel reads it.
pub struct MegaLayerRef<'a> {
    /// (D) each.
    pub attn_norm: &'a [f32],
    pub mlp_norm: &'a [f32],
    /// (H Dh, D), (Hkv Dh, D), (Hkv Dh, D), (D, H Dh).
    pub q: &'a QTensor,
    pub k: &'a QTensor,
    pub v: &'a QTensor,
    pub o: &'a QTensor,
    /// (F, D), (F, D), (D, F).
    pub gate: &'a QTensor,
    pub up: &'a QTensor,
    pub down: &'a QTensor,
    /// The layer's cache (on the device, f16, after the first step).
    pub kv: &'a KvStore,
}

/// A whole model's decode step as the megakernel reads it: x = rmsnorm(x) -> blocks -> final
/// norm, every block `x += o(attn(rope(qkv(norm(x))))); x += down(silu(gate) * up)(norm(x))`.
pub struct MegaModel<'a> {
    pub layers: Vec<MegaLayerRef<'a>>,
    /// (D)
    pub final_norm: &'a [f32],
    pub eps: f32,
    /// RMSNorm weight offset (`x / rms * (w + offset)`).
    pub offset: f32,
    pub rope: &'a RopeParams,
    pub attn: &'a AttentionParams,
}

/// One layer of the launch; mirrors `struct MegaLayer` in `kernels/mega.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct LayerArgs {
    w: [WeightArgs; 7],
    attn_norm: u64,
    mlp_norm: u64,
    kc: u64,
    vc: u64,
}
// SAFETY: a plain #[repr(C)] struct of integers with the layout of the device struct.
unsafe impl DeviceRepr for LayerArgs {}

/// The launch's arguments; mirrors `struct MegaArgs` in `kernels/mega.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct MegaArgs {
    layers: u64,
    x: u64,
    out: u64,
    final_norm: u64,
    inv_freq: u64,
    pos0p: u64,
    scratch: u64,
    sync: u64,
    n_layers: i32,
    d: i32,
    f: i32,
    h: i32,
    hkv: i32,
    dh: i32,
    cap: i32,
    nsplit: i32,
    rot_half: i32,
    neox: i32,
    off_qr: i32,
    off_att: i32,
    off_act: i32,
    off_part: i32,
    layer_stride: i32,
    max_phases: i32,
    eps: f32,
    offset: f32,
    scale: f32,
    linear_scale: f32,
}

/// What one prepared model keeps on the device.
pub(crate) struct MegaState {
    /// The launch's layer table and shapes as words: a step is run by the state whose key it
    /// has.
    key: Vec<u64>,
    /// The buffers `args` points at (kept alive, never read on the host).
    _table: CudaSlice<LayerArgs>,
    _scratch: CudaSlice<f32>,
    _sync: CudaSlice<u32>,
    args: MegaArgs,
    kernel: String,
    grid: u32,
    smem: usize,
}

/// A step's launch before its device buffers exist.
struct Plan {
    layers: Vec<LayerArgs>,
    args: MegaArgs,
    kernel: String,
    grid: u32,
    smem: usize,
    scratch_len: usize,
    sync_len: usize,
}

impl Plan {
    fn key(&self) -> Vec<u64> {
        let a = &self.args;
        let mut k: Vec<u64> = vec![
            a.final_norm,
            a.inv_freq,
            a.pos0p,
            a.n_layers as u64,
            a.d as u64,
            a.f as u64,
            a.h as u64,
            a.hkv as u64,
            a.dh as u64,
            a.cap as u64,
            a.rot_half as u64 | ((a.neox as u64) << 32),
            a.eps.to_bits() as u64 | ((a.offset.to_bits() as u64) << 32),
            a.scale.to_bits() as u64 | ((a.linear_scale.to_bits() as u64) << 32),
        ];
        for l in &self.layers {
            for w in &l.w {
                k.extend([w.data, w.scales, w.row_bytes as u64, w.cols as u64]);
            }
            k.extend([l.attn_norm, l.mlp_norm, l.kc, l.vc]);
        }
        k
    }
}

/// Floats rounded up to a multiple of 64 (256 bytes), for scratch offsets.
fn round64(n: usize) -> usize {
    n.next_multiple_of(64)
}

fn to_i32(v: usize) -> Option<i32> {
    i32::try_from(v).ok()
}

impl CudaBackend {
    /// Whether decode steps should try the megakernel (`decode=mega`).
    pub fn mega_enabled(&self) -> bool {
        self.device().options().decode_mega
    }

    /// The launch of `m`, or `None` where the kernel does not run this model or cache (other
    /// formats or shapes, a window, sinks, an f32 cache, ...). Uploads weights, norms and the
    /// RoPE table on first use (call outside a capture first).
    fn mega_plan(&self, m: &MegaModel<'_>) -> Result<Option<Plan>> {
        if !self.mega_enabled() || m.layers.is_empty() {
            return Ok(None);
        }
        let p = m.attn;
        let (h, hkv, dh, d) = (p.n_heads, p.n_kv_heads, p.head_dim, m.final_norm.len());
        if p.sinks.is_some() || p.window.is_some() || hkv == 0 || !h.is_multiple_of(hkv) {
            return Ok(None);
        }
        let dpl = match dims_per_lane(dh) {
            Ok(x @ (2 | 4)) => x,
            _ => return Ok(None),
        };
        let rope = m.rope;
        if rope.dims > dh || !rope.dims.is_multiple_of(2) {
            return Ok(None);
        }
        let f = m.layers[0].gate.rows;
        let (nq, nk) = (h * dh, hkv * dh);
        if !d.is_multiple_of(32) || !nq.is_multiple_of(32) || !f.is_multiple_of(32) {
            return Ok(None);
        }
        let mut layers = Vec::with_capacity(m.layers.len());
        let mut cap = None;
        for l in &m.layers {
            let shapes = [
                (l.q, nq, d),
                (l.k, nk, d),
                (l.v, nk, d),
                (l.o, d, nq),
                (l.gate, f, d),
                (l.up, f, d),
                (l.down, d, f),
            ];
            if shapes.iter().any(|(w, r, c)| (w.rows, w.cols) != (*r, *c))
                || l.attn_norm.len() != d
                || l.mlp_norm.len() != d
            {
                return Ok(None);
            }
            let mut w = [None; 7];
            for (i, (q, _, _)) in shapes.iter().enumerate() {
                let dw = self.weight(q)?;
                if dw.kind() != "q4_0s" {
                    return Ok(None);
                }
                w[i] = Some(dw.args(self.device()));
            }
            let KvStore::Device(dkv) = l.kv else {
                return Ok(None);
            };
            let Some(Kv(c)) = dkv.as_any().downcast_ref::<Kv>() else {
                return Ok(None);
            };
            if c.dtype() != crate::KvDtype::F16
                || c.n_kv_heads() != hkv
                || c.head_dim() != dh
                || cap.is_some_and(|x| x != c.capacity())
            {
                return Ok(None);
            }
            cap = Some(c.capacity());
            let (kc, vc) = c.raw_ptrs(self.device());
            let an = self.vector(l.attn_norm)?;
            let mn = self.vector(l.mlp_norm)?;
            let dev = self.device();
            layers.push(LayerArgs {
                w: w.map(|x| x.expect("every product checked above")),
                attn_norm: dev.ptr(&*an),
                mlp_norm: dev.ptr(&*mn),
                kc,
                vc,
            });
        }
        let cap = cap.unwrap_or(0);
        let dev = self.device();
        let kernel = format!("mega_decode_{dpl}");
        let func = dev.function(Program::Mega, &kernel)?;
        let smem = 4 * d.max(nq).max(f);
        if smem > MEGA_MAX_SMEM {
            return Ok(None);
        }
        // Every block must be resident at once (the grid barrier waits for all of them).
        let per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None)
            .map_err(cuda_err("the megakernel's occupancy"))?;
        if per_sm == 0 {
            return Ok(None);
        }
        let grid = dev.info().multiprocessors as u32 * per_sm.min(BLOCKS_PER_SM);
        let maxg = if dpl >= 16 { 4 } else { 8 };
        let groups = hkv * (h / hkv).div_ceil(maxg);
        let nsplit = (grid as usize / groups).min(cap.div_ceil(16)).clamp(1, 256);
        let off_qr = round64(nq + 2 * nk);
        let off_att = off_qr + round64(nq);
        let off_act = off_att + round64(nq);
        let off_part = off_act + round64(f);
        let stride = off_part + round64(h * nsplit * (dh + 2));
        let table = self.rope_table(rope)?;
        let (inv_freq, half, neox, linear_scale) = table.parts(dev);
        let fnorm = self.vector(m.final_norm)?;
        let n_layers = layers.len();
        let i = |v: usize| to_i32(v).ok_or_else(|| Error::Shape(format!("mega: {v} too large")));
        let args = MegaArgs {
            layers: 0,
            x: 0,
            out: 0,
            final_norm: dev.ptr(&*fnorm),
            inv_freq,
            pos0p: self.pos_ptr(),
            scratch: 0,
            sync: 0,
            n_layers: i(n_layers)?,
            d: i(d)?,
            f: i(f)?,
            h: i(h)?,
            hkv: i(hkv)?,
            dh: i(dh)?,
            cap: i(cap)?,
            nsplit: i(nsplit)?,
            rot_half: i(half)?,
            neox: i32::from(neox),
            off_qr: i(off_qr)?,
            off_att: i(off_att)?,
            off_act: i(off_act)?,
            off_part: i(off_part)?,
            layer_stride: i(stride)?,
            max_phases: -1,
            eps: m.eps,
            offset: m.offset,
            scale: p.scale,
            linear_scale,
        };
        i(n_layers * stride)?;
        Ok(Some(Plan {
            layers,
            args,
            kernel,
            grid,
            smem,
            scratch_len: n_layers * stride,
            sync_len: 2 + n_layers * groups,
        }))
    }

    /// Readies the megakernel for `m` (outside a capture: uploads its layer table and scratch
    /// once). `Ok(false)`: the kernel does not run this model; its steps take the per-op path.
    pub fn mega_prepare(&self, m: &MegaModel<'_>) -> Result<bool> {
        let Some(plan) = self.mega_plan(m)? else {
            return Ok(false);
        };
        let key = plan.key();
        let mut states = lock(&self.mega);
        if states.iter().any(|s| s.key == key) {
            return Ok(true);
        }
        let dev = self.device();
        let table = dev.upload(&plan.layers)?;
        let scratch = dev.alloc::<f32>(plan.scratch_len.max(1))?;
        let sync = dev.alloc::<u32>(plan.sync_len)?;
        let mut args = plan.args;
        args.layers = dev.ptr(&table);
        args.scratch = dev.ptr(&scratch);
        args.sync = dev.ptr(&sync);
        states.push(MegaState {
            key,
            _table: table,
            _scratch: scratch,
            _sync: sync,
            args,
            kernel: plan.kernel,
            grid: plan.grid,
            smem: plan.smem,
        });
        Ok(true)
    }

    /// One decode step of `m` at `pos0` from the embedded token `x (1, D)` (overwritten: the
    /// residual stream) to the final-normed hidden state `(1, D)`, or `None` where the kernel
    /// does not run `m` or it was not prepared ([`CudaBackend::mega_prepare`]).
    pub fn mega_step(&self, x: &Tensor, m: &MegaModel<'_>, pos0: usize) -> Result<Option<Tensor>> {
        self.mega_step_phases(x, m, pos0, -1)
    }

    /// [`CudaBackend::mega_step`] that stops after `phases` phases (six a layer; negative: all),
    /// then writes the final norm of the residual stream as it is (tests: where a step goes
    /// wrong).
    #[doc(hidden)]
    pub fn mega_step_phases(
        &self,
        x: &Tensor,
        m: &MegaModel<'_>,
        pos0: usize,
        phases: i32,
    ) -> Result<Option<Tensor>> {
        let Some(plan) = self.mega_plan(m)? else {
            return Ok(None);
        };
        if !self.capturing() {
            self.mega_prepare(m)?;
        }
        let key = plan.key();
        let d = plan.args.d as usize;
        if x.dims2() != (1, d) || pos0 >= plan.args.cap as usize {
            return Ok(None);
        }
        let xi = self.raw(x, "mega")?;
        if !xi.ptr.is_multiple_of(16) {
            return Ok(None);
        }
        let out = self.alloc(&[1, d])?;
        let op = self.raw(&out, "mega")?.ptr;
        self.set_pos_word(pos0)?;
        let states = lock(&self.mega);
        let Some(st) = states.iter().find(|s| s.key == key) else {
            return Ok(None);
        };
        let dev = self.device();
        dev.bind()?;
        let mut a = st.args;
        a.x = xi.ptr;
        a.out = op;
        a.max_phases = phases;
        let f = dev.function(Program::Mega, &st.kernel)?;
        let (grid, smem) = (st.grid, st.smem);
        launch!(dev, f, (grid, 1, 1), (THREADS, 1, 1), smem; a)?;
        Ok(Some(out))
    }
}
