//! The paged KV cache on the device: one layer's keys and values in blocks of a shared pool,
//! written at slots and read through block tables by one attention launch over a whole batch
//! of query rows (decode rows and prefill chunk rows of many sequences alike).
//!
//! The bookkeeping (which blocks a sequence holds, its table, admission) is backend-neutral in
//! `hf2q_tensor::paged`; the host twin of these ops, and the reference of their tests, is
//! `hf2q_cpu::paged`. Not here yet: RoPE and norms over the batch's rows, graph capture per
//! batch size (the launches take their row arrays from device memory, so a graph can replay
//! them with new rows written in place).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use hf2q_tensor::op::AttentionParams;
use hf2q_tensor::paged::PagedLayout;
use hf2q_tensor::Result;

use super::ops::{
    blocks, dims_per_lane, heads_per_block, launch, need, shape, to_i32, KvDtype, RopeTable,
};
use super::{cuda_err, CudaDev, Program};
use std::ffi::c_void;

/// One layer's keys and values: two `(n_blocks, Hkv, B, Dh)` arrays of `dtype`.
pub struct DevicePagedLayer {
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    dtype: KvDtype,
    layout: PagedLayout,
}

/// The rows of one paged attention call, in device memory (`hf2q_tensor::paged::PagedRows`'s
/// arrays): `seq (R)`, `pos (R)` (negative: padding), `tables (n_seqs, max_blocks)`.
/// `max_len` bounds every row's position + 1; it sets the key splits (keep it fixed across
/// replays of a captured graph).
pub struct DevicePagedRows<'a> {
    pub seq: &'a CudaSlice<i32>,
    pub pos: &'a CudaSlice<i32>,
    pub tables: &'a CudaSlice<i32>,
    pub rows: usize,
    pub max_blocks: usize,
    pub max_len: usize,
}

impl DevicePagedLayer {
    pub fn layout(&self) -> &PagedLayout {
        &self.layout
    }
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }
    /// Bytes of keys and values together.
    pub fn bytes(&self) -> usize {
        2 * self.layout.elements() * self.dtype.size()
    }

    /// Both arrays as f32 on the host (waits for the stream), for tests and inspection.
    pub fn to_host(&self, dev: &CudaDev) -> Result<(Vec<f32>, Vec<f32>)> {
        Ok((
            self.dtype.download_f32(dev, &self.k)?,
            self.dtype.download_f32(dev, &self.v)?,
        ))
    }
}

/// `log2(B)`: the kernels address blocks by shifts, so `B` is a power of two.
fn block_shift(layout: &PagedLayout) -> Result<i32> {
    let b = layout.block_tokens;
    if !b.is_power_of_two() {
        return Err(shape(format!(
            "paged cache: blocks of {b} positions (a power of two)"
        )));
    }
    Ok(b.trailing_zeros() as i32)
}

impl CudaDev {
    /// A zeroed paged layer.
    pub fn alloc_paged_layer(
        &self,
        layout: PagedLayout,
        dtype: KvDtype,
    ) -> Result<DevicePagedLayer> {
        block_shift(&layout)?;
        let n = layout
            .n_blocks
            .checked_mul(layout.n_kv_heads)
            .and_then(|v| v.checked_mul(layout.block_tokens))
            .and_then(|v| v.checked_mul(layout.head_dim))
            .and_then(|v| v.checked_mul(dtype.size()))
            .filter(|&n| n > 0)
            .ok_or_else(|| shape(format!("paged cache {layout:?}")))?;
        // Offsets inside the kernels are 64-bit; block ids and slots are i32.
        to_i32("paged cache slots", layout.n_blocks * layout.block_tokens)?;
        self.bind()?;
        Ok(DevicePagedLayer {
            k: self.alloc(n)?,
            v: self.alloc(n)?,
            dtype,
            layout,
        })
    }

    /// Writes rows `k, v (R, Hkv*Dh)` at `slots (R)` (`block * B + offset`; negative: skipped).
    /// The slots are device data the kernel cannot check: the caller derives them from tables
    /// of this pool (`PagedLayout::slot`).
    pub fn paged_kv_write(
        &self,
        layer: &mut DevicePagedLayer,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        rows: usize,
        slots: &impl DevicePtr<i32>,
    ) -> Result<()> {
        let l = layer.layout;
        let width = l.n_kv_heads * l.head_dim;
        need("paged_kv_write keys", k.len(), rows * width)?;
        need("paged_kv_write values", v.len(), rows * width)?;
        need("paged_kv_write slots", slots.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(
            Program::Elementwise,
            &format!("paged_kv_write_{}", layer.dtype.suffix()),
        )?;
        let (kp, vp, sp) = (self.ptr(k), self.ptr(v), self.ptr(slots));
        let (kcp, vcp) = (
            layer.k.device_ptr_mut(self.stream()).0,
            layer.v.device_ptr_mut(self.stream()).0,
        );
        let (ri, hkv, dh, lb) = (
            to_i32("rows", rows)?,
            l.n_kv_heads as i32,
            l.head_dim as i32,
            block_shift(&l)?,
        );
        let grid = blocks(rows * width, 256)?;
        launch!(self, f, (grid, 1, 1), (256, 1, 1), 0; kp, vp, kcp, vcp, sp, ri, hkv, dh, lb)
    }

    /// RoPE on `q (R, n_heads*Dh)` in place, and the rotated `k` with `v (R, Hkv*Dh)` into the
    /// pool at `slots (R)`, row `r` at position `pos[r]`, in one kernel (the contiguous cache's
    /// `rope_store` with a position and a slot per row; `k` is not changed). A row with a
    /// negative slot is not stored (padding).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_rope_store(
        &self,
        q: &mut impl DevicePtrMut<f32>,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        rows: usize,
        n_heads: usize,
        layer: &mut DevicePagedLayer,
        pos: &impl DevicePtr<i32>,
        slots: &impl DevicePtr<i32>,
        table: &RopeTable,
    ) -> Result<()> {
        let l = layer.layout;
        let (dh, width) = (l.head_dim, l.n_kv_heads * l.head_dim);
        need("paged_rope_store queries", q.len(), rows * n_heads * dh)?;
        need("paged_rope_store keys", k.len(), rows * width)?;
        need("paged_rope_store values", v.len(), rows * width)?;
        need("paged_rope_store positions", pos.len(), rows)?;
        need("paged_rope_store slots", slots.len(), rows)?;
        let (fp, half, neox, scale) = table.parts(self);
        if 2 * half > dh || !dh.is_multiple_of(2) {
            return Err(shape(format!(
                "rope: {} rotated dims for head width {dh}",
                2 * half
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        self.bind()?;
        let f = self.function(
            Program::Elementwise,
            &format!("paged_rope_store_{}", layer.dtype.suffix()),
        )?;
        let (qp, kp, vp) = (self.ptr_mut(q), self.ptr(k), self.ptr(v));
        let (kcp, vcp) = (
            layer.k.device_ptr_mut(self.stream()).0,
            layer.v.device_ptr_mut(self.stream()).0,
        );
        let (pp, sp) = (self.ptr(pos), self.ptr(slots));
        let (ri, nh, hkv, dhi, hf) = (
            to_i32("rows", rows)?,
            to_i32("heads", n_heads)?,
            l.n_kv_heads as i32,
            dh as i32,
            half as i32,
        );
        let (neox, lb) = (i32::from(neox), block_shift(&l)?);
        let grid = blocks(rows * (n_heads + l.n_kv_heads) * (dh / 2), 256)?;
        launch!(self, f, (grid, 1, 1), (256, 1, 1), 0;
            qp, kp, vp, kcp, vcp, fp, pp, sp, ri, nh, hkv, dhi, hf, neox, scale, lb)
    }

    /// Key splits per row: enough blocks to fill the device about four times over (as the
    /// one-token decode, [`CudaDev::attention`]), at least `attn-chunk` keys each.
    fn paged_splits(&self, p: &AttentionParams, rows: usize, max_len: usize) -> Result<usize> {
        let chunks = (p.n_heads / p.n_kv_heads).div_ceil(heads_per_block(p.head_dim)?);
        let without = (p.n_kv_heads * chunks * rows).max(1);
        let by_sm = (4 * self.info().multiprocessors as usize).div_ceil(without);
        let by_len = max_len.div_ceil(self.attn_chunk);
        Ok(by_len.min(by_sm).clamp(1, 256))
    }

    /// f32 elements of scratch [`CudaDev::paged_attention`] needs.
    pub fn paged_attention_scratch_len(
        &self,
        p: &AttentionParams,
        rows: usize,
        max_len: usize,
    ) -> Result<usize> {
        let splits = self.paged_splits(p, rows, max_len)?;
        Ok(rows * p.n_heads * splits * (p.head_dim + 2))
    }

    /// Causal attention of `q (R, H*Dh)` over `layer` for `rows` -> `out (R, H*Dh)`: row `r`
    /// sees its sequence's keys `0..=pos[r]` (within the window); padding rows give zeros.
    /// Two launches: the split-K pass and the merge of each (row, head)'s splits.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        q: &impl DevicePtr<f32>,
        layer: &DevicePagedLayer,
        rows: &DevicePagedRows<'_>,
        p: &AttentionParams,
        scratch: &mut impl DevicePtrMut<f32>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
        let l = layer.layout;
        if hkv == 0 || !h.is_multiple_of(hkv) || hkv != l.n_kv_heads || dh != l.head_dim {
            return Err(shape(format!(
                "paged attention: {h} heads over {hkv} kv heads of {dh}, the pool has {} of {}",
                l.n_kv_heads, l.head_dim
            )));
        }
        let dpl = dims_per_lane(dh)?;
        if p.window == Some(0) {
            return Err(shape("paged attention: a window of 0 sees no key".into()));
        }
        let r = rows.rows;
        need("paged attention queries", q.len(), r * h * dh)?;
        need("paged attention output", out.len(), r * h * dh)?;
        need("paged attention row sequences", rows.seq.len(), r)?;
        need("paged attention row positions", rows.pos.len(), r)?;
        need("paged attention tables", rows.tables.len(), rows.max_blocks)?;
        if r == 0 {
            return Ok(());
        }
        let splits = self.paged_splits(p, r, rows.max_len)?;
        need(
            "paged attention scratch",
            scratch.len(),
            r * h * splits * (dh + 2),
        )?;
        self.bind()?;
        let kv = layer.dtype.suffix();
        let f = self.function(Program::Attention, &format!("paged_attn_{kv}_{dpl}"))?;
        let (qp, sqp, pp, tp) = (
            self.ptr(q),
            self.ptr(rows.seq),
            self.ptr(rows.pos),
            self.ptr(rows.tables),
        );
        let (kcp, vcp) = (
            layer.k.device_ptr(self.stream()).0,
            layer.v.device_ptr(self.stream()).0,
        );
        let scp = self.ptr_mut(scratch);
        let (mb, lb) = (to_i32("table width", rows.max_blocks)?, block_shift(&l)?);
        let (hi, hkvi, dhi, ns) = (to_i32("heads", h)?, hkv as i32, dh as i32, splits as i32);
        let scale = p.scale;
        let window = match p.window {
            Some(w) => to_i32("window", w)?,
            None => 0,
        };
        let chunks = (h / hkv).div_ceil(heads_per_block(dh)?);
        let z = u32::try_from(r * chunks)
            .ok()
            .filter(|&z| z <= 65_535)
            .ok_or_else(|| shape(format!("paged attention: {r} rows of {chunks} head chunks")))?;
        launch!(self, f, (hkv as u32, splits as u32, z), (128, 1, 1), 0;
            qp, kcp, vcp, sqp, pp, tp, mb, lb, scp, hi, hkvi, dhi, scale, window, ns)?;
        let m = self.function(Program::Attention, "paged_attn_merge")?;
        let op = self.ptr_mut(out);
        let grid = u32::try_from(r * h).map_err(|_| shape(format!("{r} rows of {h} heads")))?;
        launch!(self, m, (grid, 1, 1), (64, 1, 1), 0; scp, pp, op, hi, dhi, ns)
    }
}
