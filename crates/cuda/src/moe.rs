//! Launchers of the mixture-of-experts kernels (`kernels/moe_route.cuh`,
//! `kernels/matvec_id.cuh`): routing on the device, the gated and down expert products of each
//! (token, slot) pair read from stacked expert matrices, and the sum of a token's pairs. All
//! stay on the device, so a decode step with routed layers is still one graph.
//!
//! Not here: the choice between this path and the composed one (`backend_moe.rs`), the router
//! product where it is not folded into the routing (an ordinary linear).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::ops::{blocks, launch, mvf_rows_per_group, need, shape, to_i32};
use super::weight::DeviceWeight;
use super::{cuda_err, CudaDev, Program};
use hf2q_tensor::Result;
use std::ffi::c_void;

/// Most experts per token of the routing kernel (`MOE_MAX_K` in moe_route.cuh).
pub const MOE_MAX_K: usize = 32;

/// Most experts of one layer the routing kernel takes (its shared memory: E floats).
pub const MOE_MAX_EXPERTS: usize = 8192;

/// The activation and biases of the expert products (`kernels/matvec_id.cuh`): SiLU or GELU
/// (tanh), or GPT-OSS's clamped SwiGLU at `(alpha, limit)`; the device addresses of the gate,
/// up `(E·F)` and down `(E·D)` biases, 0 for none.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExpertOps {
    pub act: ExpertAct,
    pub gate_bias: u64,
    pub up_bias: u64,
    pub down_bias: u64,
}

/// The gated activation of [`ExpertOps`] (codes 0, 1, 2 of the kernels' `act`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum ExpertAct {
    #[default]
    Silu,
    GeluTanh,
    ClampedSwiglu {
        alpha: f32,
        limit: f32,
    },
}

impl ExpertAct {
    /// The kernels' (act, alpha, limit).
    fn args(self) -> (i32, f32, f32) {
        match self {
            ExpertAct::Silu => (0, 0.0, 0.0),
            ExpertAct::GeluTanh => (1, 0.0, 0.0),
            ExpertAct::ClampedSwiglu { alpha, limit } => (2, alpha, limit),
        }
    }
}

impl CudaDev {
    /// Whether a decode step's routed MLP takes its fused form: the f32 router product inside
    /// the routing kernel and the down products summed into the residual stream by one kernel
    /// (three kernels per layer instead of six). Off by default: on the H200 it measured slower
    /// (Qwen3-30B-A3B Q4_K_M tg128 158.8 tokens/s against 319.6; the routing kernel reads the
    /// whole router on one multiprocessor per token, and the summing kernel runs a token's k
    /// products one after another in 256 blocks; cuda/NOTES.md). The `moe-fused` option turns it
    /// on at open (measurements); tests run both.
    pub fn set_moe_fused(&self, on: bool) {
        self.moe_fused
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn moe_fused(&self) -> bool {
        self.moe_fused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Routes `t` tokens: router logits `(t, E)` -> `ids (t, k)` (expert indices as exact floats)
    /// and `wts (t, k)`, as `hf2q_tensor::moe::route` does (`scale`: per-expert multipliers, E).
    /// The logits are `logits`, or with `router` (an f32 `(E, D)` weight) computed in the same
    /// kernel from `x (t, D)` (which `logits` is then).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route(
        &self,
        logits: &impl DevicePtr<f32>,
        router: Option<&DeviceWeight>,
        t: usize,
        n_experts: usize,
        k: usize,
        renormalize: bool,
        scale: Option<&CudaSlice<f32>>,
        ids: &mut impl DevicePtrMut<f32>,
        wts: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        if k == 0 || k > n_experts || k > MOE_MAX_K || n_experts > MOE_MAX_EXPERTS {
            return Err(shape(format!(
                "moe routing: top {k} of {n_experts} experts (at most {MOE_MAX_K} of \
                 {MOE_MAX_EXPERTS})"
            )));
        }
        let d = match router {
            Some(r) => {
                if r.kind != "f32" || r.rows != n_experts || !r.cols.is_multiple_of(4) {
                    return Err(shape(format!(
                        "moe routing: router '{}' is {} {}x{} ({n_experts} f32 rows, a \
                         multiple of 4 wide, expected)",
                        r.name, r.kind, r.rows, r.cols
                    )));
                }
                need("moe routing input", logits.len(), t * r.cols)?;
                r.cols
            }
            None => {
                need("moe routing logits", logits.len(), t * n_experts)?;
                0
            }
        };
        need("moe routing ids", ids.len(), t * k)?;
        need("moe routing weights", wts.len(), t * k)?;
        if let Some(s) = scale {
            need("moe expert scales", s.len(), n_experts)?;
        }
        if t == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Elementwise, "moe_route")?;
        let (ip, wp) = (self.ptr_mut(ids), self.ptr_mut(wts));
        let sp = scale.map_or(0u64, |s| self.ptr(s));
        let input = self.ptr(logits);
        if router.is_some() && !input.is_multiple_of(16) {
            return Err(shape(
                "moe routing: the input is not 16-byte aligned".into(),
            ));
        }
        let (lp, xp, rp) = match router {
            Some(r) => (0u64, input, r.args(self).data),
            None => (input, 0u64, 0u64),
        };
        let (di, ei, ki, ri) = (
            to_i32("hidden", d)?,
            n_experts as i32,
            k as i32,
            i32::from(renormalize),
        );
        let grid = u32::try_from(t).map_err(|_| shape(format!("moe routing: {t} tokens")))?;
        let threads = if router.is_some() { 256 } else { 32 };
        launch!(self, f, (grid, 1, 1), (threads, 1, 1), 4 * n_experts;
            lp, xp, rp, di, ip, wp, sp, ei, ki, ri)
    }

    /// `h (t·k, F) = act(x_t · G_eᵀ + bg_e, x_t · U_eᵀ + bu_e)` for each pair `p = t·k + j`
    /// with `e = ids[p]`: `gate`, `up` hold `n_experts` stacked experts of `F` rows each;
    /// `x (t, D)`; the activation and biases of `ops` (its down bias is not read here).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gated(
        &self,
        x: &impl DevicePtr<f32>,
        t: usize,
        k: usize,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        n_experts: usize,
        ops: &ExpertOps,
        ids: &impl DevicePtr<f32>,
        perm: Option<u64>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let f = expert_rows(gate, n_experts)?;
        if up.kind != gate.kind || up.rows != gate.rows || up.cols != gate.cols {
            return Err(shape(format!(
                "moe experts '{}' and '{}' differ in format or shape",
                gate.name, up.name
            )));
        }
        let pairs = t * k;
        need("moe input", x.len(), t * gate.cols)?;
        need("moe ids", ids.len(), pairs)?;
        need("moe gated output", out.len(), pairs * f)?;
        let func = &id_kernels(gate)?[0];
        if pairs == 0 {
            return Ok(());
        }
        self.bind()?;
        let (gw, uw) = (gate.args(self), up.args(self));
        let (xp, op, ip, pp) = (
            self.ptr(x),
            self.ptr_mut(out),
            self.ptr(ids),
            perm.unwrap_or(0),
        );
        aligned(xp, gate.cols)?;
        let nr = mvf_rows_per_group(gate.kind).1;
        let ks = self.mv_split(f * pairs, gate.cols, nr);
        let grid = (blocks(f, nr * 4 / ks)?, pair_grid(pairs)?, 1);
        let (rows, ksi, ki) = (to_i32("rows", f)?, ks as i32, k as i32);
        let (act, alpha, limit) = ops.act.args();
        let (bg, bu) = (ops.gate_bias, ops.up_bias);
        launch!(self, func, grid, (128, 1, 1), 0;
            gw, uw, xp, op, ip, pp, rows, act, ksi, ki, bg, bu, alpha, limit)
    }

    /// `y (P, D) = wts[p] · (h_p · Down_eᵀ + bd_e)` for each pair `p` with `e = ids[p]`: `down`
    /// holds `n_experts` stacked experts of `D` rows each; `h (P, F)`; `down_bias` the device
    /// address of the `(E·D)` biases, 0 for none.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down(
        &self,
        h: &impl DevicePtr<f32>,
        pairs: usize,
        down: &DeviceWeight,
        n_experts: usize,
        ids: &impl DevicePtr<f32>,
        wts: &impl DevicePtr<f32>,
        perm: Option<u64>,
        down_bias: u64,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let d = expert_rows(down, n_experts)?;
        need("moe down input", h.len(), pairs * down.cols)?;
        need("moe ids", ids.len(), pairs)?;
        need("moe weights", wts.len(), pairs)?;
        need("moe down output", y.len(), pairs * d)?;
        let func = &id_kernels(down)?[1];
        if pairs == 0 {
            return Ok(());
        }
        self.bind()?;
        let w = down.args(self);
        let (hp, yp, ip, wp) = (self.ptr(h), self.ptr_mut(y), self.ptr(ids), self.ptr(wts));
        let pp = perm.unwrap_or(0);
        aligned(hp, down.cols)?;
        let rpw = mvf_rows_per_group(down.kind).0;
        let ks = self.mv_split(d * pairs, down.cols, rpw);
        let grid = (blocks(d, rpw * 4 / ks)?, pair_grid(pairs)?, 1);
        let (rows, ksi) = (to_i32("rows", d)?, ks as i32);
        launch!(self, func, grid, (128, 1, 1), 0; w, hp, yp, ip, wp, pp, rows, ksi, down_bias)
    }

    /// `out (t, D) (+)= Σ_j wts[t·k + j] · (h_{t·k + j} · Down_eᵀ + bd_e)`, j ascending (`accumulate`:
    /// added to `out`, a residual stream): [`CudaDev::moe_down`], [`CudaDev::moe_combine`] and the
    /// residual add in one kernel, for decode.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_sum(
        &self,
        h: &impl DevicePtr<f32>,
        t: usize,
        k: usize,
        down: &DeviceWeight,
        n_experts: usize,
        ids: &impl DevicePtr<f32>,
        wts: &impl DevicePtr<f32>,
        accumulate: bool,
        down_bias: u64,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let d = expert_rows(down, n_experts)?;
        need("moe down input", h.len(), t * k * down.cols)?;
        need("moe ids", ids.len(), t * k)?;
        need("moe weights", wts.len(), t * k)?;
        need("moe output", out.len(), t * d)?;
        let func = &id_kernels(down)?[2];
        if t == 0 {
            return Ok(());
        }
        self.bind()?;
        let w = down.args(self);
        let (hp, op, ip, wp) = (self.ptr(h), self.ptr_mut(out), self.ptr(ids), self.ptr(wts));
        aligned(hp, down.cols)?;
        let rpw = mvf_rows_per_group(down.kind).0;
        let ks = self.mv_split(d * t, down.cols, rpw);
        let grid = (blocks(d, rpw * 4 / ks)?, pair_grid(t)?, 1);
        let (rows, ksi, ki, acc) = (
            to_i32("rows", d)?,
            ks as i32,
            k as i32,
            i32::from(accumulate),
        );
        launch!(self, func, grid, (128, 1, 1), 0; w, hp, op, ip, wp, rows, ksi, ki, acc, down_bias)
    }

    /// `perm (P)` = the pairs `0..P` ordered by their expert `ids[p]` (i32 values written into
    /// a 4-byte-element buffer at `perm`, which holds at least `pairs`), for
    /// [`CudaDev::moe_gated`] and [`CudaDev::moe_down`] to take pairs of one expert together;
    /// with `offs` (a buffer of E + 1 such values), where each expert's pairs start, then P.
    pub fn moe_sort(
        &self,
        ids: &impl DevicePtr<f32>,
        pairs: usize,
        n_experts: usize,
        perm: u64,
        offs: Option<u64>,
    ) -> Result<()> {
        need("moe ids", ids.len(), pairs)?;
        if n_experts > MOE_MAX_EXPERTS {
            return Err(shape(format!("moe sort: {n_experts} experts")));
        }
        if pairs == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Elementwise, "moe_sort")?;
        let ip = self.ptr(ids);
        let (pi, ei, op) = (to_i32("pairs", pairs)?, n_experts as i32, offs.unwrap_or(0));
        launch!(self, f, (1, 1, 1), (1024, 1, 1), 0; ip, pi, ei, perm, op)
    }

    /// `out (t, D) = Σ_j y (t·k + j)`, j ascending.
    pub fn moe_combine(
        &self,
        y: &impl DevicePtr<f32>,
        t: usize,
        k: usize,
        d: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        need("moe combine input", y.len(), t * k * d)?;
        need("moe combine output", out.len(), t * d)?;
        if t * d == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(Program::Elementwise, "moe_combine")?;
        let (yp, op) = (self.ptr(y), self.ptr_mut(out));
        let (di, ki, n) = (to_i32("hidden", d)?, k as i32, (t * d) as i64);
        launch!(self, f, (blocks(t * d, 256)?, 1, 1), (256, 1, 1), 0; yp, op, di, ki, n)
    }
}

/// Whether `w` has the expert kernels (a fast one-token format).
pub(crate) fn has_id_kernels(w: &DeviceWeight) -> bool {
    w.fast_id.is_some()
}

fn id_kernels(w: &DeviceWeight) -> Result<&[cudarc::driver::CudaFunction; 3]> {
    w.fast_id.as_ref().ok_or_else(|| {
        shape(format!(
            "moe experts '{}' ({}) have no expert kernels",
            w.name, w.kind
        ))
    })
}

/// Rows of one expert of the stacked `w`.
pub(crate) fn expert_rows(w: &DeviceWeight, n_experts: usize) -> Result<usize> {
    if n_experts == 0 || !w.rows.is_multiple_of(n_experts) {
        return Err(shape(format!(
            "moe experts '{}': {} rows do not split into {n_experts} experts",
            w.name, w.rows
        )));
    }
    Ok(w.rows / n_experts)
}

fn pair_grid(pairs: usize) -> Result<u32> {
    u32::try_from(pairs)
        .ok()
        .filter(|&p| p <= 65535)
        .ok_or_else(|| shape(format!("moe: {pairs} (token, expert) pairs in one launch")))
}

/// The kernels read rows of `cols` activations with 16-byte loads.
fn aligned(p: u64, cols: usize) -> Result<()> {
    if !p.is_multiple_of(16) || !cols.is_multiple_of(4) {
        return Err(shape("moe: the input is not 16-byte aligned".into()));
    }
    Ok(())
}
