//! Prefill products on the 8-bit integer tensor cores (`kernels/mmq.cuh`), under
//! [`PrefillGemm::Int8`].
//!
//! `out (T, R) = x (T, C) · Wᵀ` for prefill-sized T and the formats whose kernels have `codes8`
//! (split Q4_0 and Q8_0, Q4_K stored and re-laid, Q6_K padded and re-laid): the activations are
//! quantized once per product into two 8-bit parts per value as the CPU fast path rounds them
//! (`quantize_split16`), then one kernel multiplies them with the weights' own integer codes.
//! Against the default cuBLAS path on f16 pairs (`blas.rs`) it is as close to the f32 reference
//! (the synthesized 8B Q4_K_M's prefill: 99/100 argmax positions, mean KL 4.2e-6, against 3.7e-6
//! on pairs; one f16 pass 96/100, 3.7e-5) at under half its speed (pp512 4.0k against 10.4k
//! tokens/s), so it is opt-in (cuda/NOTES.md).
//!
//! Not used while a graph is being captured (the scratch may have to grow) nor for T <= 8 (the
//! matrix-vector kernels).
//!
//! Also here: the expert-indexed form (`mmq_experts`, kernels `mmqi_*`), which multiplies a
//! routed layer's stacked experts with the pairs `moe_sort` ordered by expert in one launch;
//! the default for prefill batches of routed layers (`backend_moe.rs`), since their alternative
//! dequantizes an expert's rows once per pair.

use std::ffi::c_void;

use super::blas::{grow, MIN_TOKENS};
use super::ops::launch;
use super::{cuda_err, CudaDev, DeviceWeight, PrefillGemm, Program};
use hf2q_tensor::{Error, Result};

/// Weight rows and tokens per block (`MQ_BM`, `MQ_BN` in mmq.cuh: eight warps of 32 x 32, four
/// along the rows and two along the tokens).
const BLOCK_ROWS: usize = 128;
const BLOCK_TOKENS: usize = 64;

impl CudaDev {
    /// Whether prefill products with `w` run the integer kernel (under the current setting).
    pub fn int8_prefill(&self, w: &DeviceWeight) -> bool {
        w.mmq.is_some() && self.prefill_gemm() == PrefillGemm::Int8
    }

    /// `out (t, R) = x (t, C) · Wᵀ (+ bias)` through the integer kernel; `Ok(false)` (nothing
    /// enqueued) when this path does not apply. Pointers are device addresses whose sizes the
    /// caller checked.
    pub(crate) fn mmq_linear(
        &self,
        xp: u64,
        t: usize,
        w: &DeviceWeight,
        bias: u64,
        op: u64,
    ) -> Result<bool> {
        let Some([f, _]) = w.mmq.as_ref() else {
            return Ok(false);
        };
        if self.prefill_gemm() != PrefillGemm::Int8 || t < MIN_TOKENS || self.capturing()? {
            return Ok(false);
        }
        let too_many = || Error::Shape(format!("cuda: {t} tokens in one product is too many"));
        let n = t.checked_mul(w.cols).ok_or_else(too_many)?;
        let bytes = quantized_bytes(n);
        let mut slot = self
            .mmq_buf
            .lock()
            .map_err(|_| Error::Msg("cuda: integer prefill scratch lock poisoned".into()))?;
        let q = grow(self, &mut slot, bytes)?;
        let s = self.quantize_split(xp, n, q)?;
        let gx = u32::try_from(w.rows.div_ceil(BLOCK_ROWS)).map_err(|_| too_many())?;
        let gy = u32::try_from(t.div_ceil(BLOCK_TOKENS))
            .ok()
            .filter(|&g| g <= 65535)
            .ok_or_else(too_many)?;
        let wa = w.args(self);
        let (rows, ti) = (w.rows as i32, t as i32);
        launch!(self, f, (gx, gy, 1), (256, 1, 1), 0; wa, q, s, bias, op, rows, ti)?;
        Ok(true)
    }

    /// Quantizes `n` f32 values at `xp` (whole rows of a multiple of 32) into the two 8-bit
    /// parts and the per-32 pairs the integer kernels read, at `q` (`quantized_bytes(n)`
    /// bytes); returns where the pairs start.
    pub(crate) fn quantize_split(&self, xp: u64, n: usize, q: u64) -> Result<u64> {
        let s = q + 2 * n as u64;
        let quantize = self.function(Program::Elementwise, "quantize_split16")?;
        let grid = u32::try_from(n.div_ceil(256))
            .map_err(|_| Error::Shape(format!("cuda: {n} values to quantize is too many")))?;
        let ni = n as i64;
        launch!(self, quantize, (grid, 1, 1), (256, 1, 1), 0; xp, q, s, ni)?;
        Ok(s)
    }

    /// `out (P, R) = wts[p] · (a_{p / div} · W_eᵀ)` for the expert-ordered pairs of
    /// [`CudaDev::moe_sort`] (`perm`, `offs`: E + 1 starts), `W` holding E stacked experts of
    /// R rows: one launch of the integer kernel over every expert's pairs, in tiles of 64.
    /// `xq`: `t_in` activation rows quantized by [`CudaDev::quantize_split`] (s: its pairs);
    /// `max_pairs`: the most pairs one expert can have (the tokens: an expert is chosen at most
    /// once per token). Pointers are device addresses whose sizes the caller checked.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mmq_experts(
        &self,
        (xq, xs, t_in): (u64, u64, usize),
        w: &DeviceWeight,
        n_experts: usize,
        (perm, offs, div): (u64, u64, usize),
        max_pairs: usize,
        wts: u64,
        out: u64,
    ) -> Result<()> {
        let Some([_, f]) = w.mmq.as_ref() else {
            return Err(Error::Shape(format!(
                "cuda: experts '{}' ({}) have no integer kernel",
                w.name, w.kind
            )));
        };
        let rows = super::moe::expert_rows(w, n_experts)?;
        let too_many = || Error::Shape(format!("cuda: {max_pairs} pairs per expert is too many"));
        let gx = u32::try_from(rows.div_ceil(BLOCK_ROWS)).map_err(|_| too_many())?;
        let gy = u32::try_from(n_experts)
            .ok()
            .filter(|&g| g <= 65535)
            .ok_or_else(too_many)?;
        let gz = u32::try_from(max_pairs.div_ceil(BLOCK_TOKENS))
            .ok()
            .filter(|&g| g <= 65535)
            .ok_or_else(too_many)?;
        let wa = w.args(self);
        let (ri, ti, di) = (rows as i32, t_in as i32, div as i32);
        launch!(self, f, (gx, gy, gz.max(1)), (256, 1, 1), 0;
            wa, xq, xs, perm, offs, wts, out, ri, ti, di)
    }

    /// Whether a routed MLP of `t` tokens with these stacked experts takes the integer expert
    /// products ([`CudaDev::mmq_experts`]): prefill-sized batches (the one-token expert kernels
    /// below) of formats that have them. Unlike dense products (`PrefillGemm`), the default:
    /// the alternative reads each pair's expert rows once per pair.
    pub(crate) fn int8_experts(&self, t: usize, ws: &[&DeviceWeight]) -> bool {
        t >= MIN_TOKENS && ws.iter().all(|w| w.mmq.is_some())
    }
}

/// Bytes [`CudaDev::quantize_split`] writes for `n` values: two parts of n bytes, then a pair of
/// f32 per 32 values (8-byte aligned: 2n is a multiple of 64).
pub(crate) fn quantized_bytes(n: usize) -> usize {
    2 * n + n / 32 * 8
}
