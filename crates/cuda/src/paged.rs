//! The paged KV cache on the device: one layer's keys and values in blocks of a shared pool,
//! written at slots (with RoPE, `paged_rope_store`) and read through block tables by attention
//! over a whole batch of query rows: one launch of the row kernel for decode rows (split over
//! keys, then merged), and one tensor-core launch for the prefill chunks' runs of rows
//! ([`prefill_tiles`], [`CudaDev::paged_prefill_tc`]). Every launch takes its row arrays from
//! device memory, so a captured graph replays them with new rows written in place.
//!
//! The bookkeeping (which blocks a sequence holds, its table, admission) is backend-neutral in
//! `hf2q_tensor::paged`; the host twin of these ops, and the reference of their tests, is
//! `hf2q_cpu::paged`. Not here: choosing between the kernels per step (`backend_paged.rs`).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use hf2q_tensor::op::AttentionParams;
use hf2q_tensor::paged::{PagedLayout, PagedRows};
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

/// Rows of one query tile of the tensor-core prefill (`FA_BQ` in attention.cu).
pub const PREFILL_TILE_ROWS: usize = 64;

/// Runs of at least this many rows go through the tensor-core prefill; shorter ones (decode
/// rows) through the row kernel, as the contiguous cache runs one token through its decode
/// kernel and more through its prefill.
pub const PREFILL_MIN_RUN: usize = 2;

/// A batch's prefill runs cut into tensor-core tiles ([`CudaDev::paged_prefill_tc`]), and what
/// is left to the row kernel ([`CudaDev::paged_attention`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefillTileRows {
    /// `(n_tiles, 4)`: first row, rows (<= [`PREFILL_TILE_ROWS`]), sequence, position of the
    /// first row.
    pub tiles: Vec<i32>,
    /// The rows' positions with every tiled row's set to -1 (padding to the row kernel).
    pub rest_pos: Vec<i32>,
    /// Bounds every remaining row's position + 1 (the row kernel's `max_len`); `None` when every
    /// row is in a tile (the row kernel need not run).
    pub rest_max_len: Option<usize>,
}

/// The tiles of `rows`' runs of [`PREFILL_MIN_RUN`] rows or more; `None` when there are none.
pub fn prefill_tiles(rows: &PagedRows<'_>) -> Option<PrefillTileRows> {
    let runs: Vec<_> = rows
        .runs()
        .into_iter()
        .filter(|r| r.n >= PREFILL_MIN_RUN)
        .collect();
    if runs.is_empty() {
        return None;
    }
    let (mut tiles, mut rest_pos) = (Vec::new(), rows.pos.to_vec());
    for run in runs {
        for t0 in (0..run.n).step_by(PREFILL_TILE_ROWS) {
            let n = PREFILL_TILE_ROWS.min(run.n - t0);
            tiles.extend([run.row + t0, n, run.seq, run.pos0 + t0].map(|x| x as i32));
        }
        rest_pos[run.row..run.row + run.n].fill(-1);
    }
    let longest = rest_pos
        .iter()
        .filter(|&&p| p >= 0)
        .map(|&p| p as usize + 1)
        .max();
    // Padding rows still need the row kernel's zeros.
    let padding = rows.pos.iter().any(|&p| p < 0);
    let rest_max_len = longest.or(if padding { Some(1) } else { None });
    Some(PrefillTileRows {
        tiles,
        rest_pos,
        rest_max_len,
    })
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
        sinks: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
        let skp = self.sinks_ptr(p, sinks)?;
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
        launch!(self, m, (grid, 1, 1), (64, 1, 1), 0; scp, pp, op, hi, dhi, ns, skp)
    }

    /// Whether [`CudaDev::paged_prefill_tc`] can run attention `p` over `layer`: an f16 pool,
    /// heads of 64 or 128; any window, sinks or none. Whether it should is
    /// the `paged-prefill` option's say ([`super::CudaOptions::paged_prefill_tc`]).
    pub fn paged_prefill_tc_fits(&self, layer: &DevicePagedLayer, p: &AttentionParams) -> bool {
        layer.dtype == KvDtype::F16
            && (p.head_dim == 64 || p.head_dim == 128)
            && p.head_dim == layer.layout.head_dim
    }

    /// Causal attention of the rows of `tiles` (`(n_tiles, 4)` = first row, rows <= 64,
    /// sequence, position of the first row: runs of one sequence at consecutive positions) of
    /// `q (R, H*Dh)` over `layer` -> those rows of `out (R, H*Dh)`, on tensor cores as the
    /// contiguous prefill (`attn_fa_impl`: q and p rounded to f16, sums in f32); other rows of
    /// `out` are not written. Needs [`CudaDev::paged_prefill_tc_fits`].
    #[allow(clippy::too_many_arguments)]
    pub fn paged_prefill_tc(
        &self,
        q: &impl DevicePtr<f32>,
        layer: &DevicePagedLayer,
        tiles: &CudaSlice<i32>,
        n_tiles: usize,
        tables: &CudaSlice<i32>,
        max_blocks: usize,
        p: &AttentionParams,
        out: &mut impl DevicePtrMut<f32>,
        sinks: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        let (h, hkv, dh) = (p.n_heads, p.n_kv_heads, p.head_dim);
        let skp = self.sinks_ptr(p, sinks)?;
        let l = layer.layout;
        if !self.paged_prefill_tc_fits(layer, p)
            || hkv == 0
            || !h.is_multiple_of(hkv)
            || hkv != l.n_kv_heads
        {
            return Err(shape(format!(
                "paged prefill (tensor cores): {h} heads over {hkv} kv heads of {dh} on a {:?} \
                 pool of {} kv heads of {}",
                layer.dtype, l.n_kv_heads, l.head_dim
            )));
        }
        need("paged prefill tiles", tiles.len(), 4 * n_tiles)?;
        need("paged prefill tables", tables.len(), max_blocks)?;
        if n_tiles == 0 {
            return Ok(());
        }
        if p.window == Some(0) {
            return Err(shape("paged prefill: a window of 0 sees no key".into()));
        }
        self.bind()?;
        let f = self.function(Program::Attention, &format!("paged_prefill_tc_{dh}"))?;
        let (qp, op) = (self.ptr(q), self.ptr_mut(out));
        if !qp.is_multiple_of(16) || !op.is_multiple_of(8) {
            return Err(shape("paged prefill: misaligned query or output".into()));
        }
        let (tp, tbp) = (self.ptr(tiles), self.ptr(tables));
        let (kcp, vcp) = (
            layer.k.device_ptr(self.stream()).0,
            layer.v.device_ptr(self.stream()).0,
        );
        let (mb, lb) = (to_i32("table width", max_blocks)?, block_shift(&l)?);
        let (hi, hkvi, scale) = (to_i32("heads", h)?, hkv as i32, p.scale);
        let window = match p.window {
            Some(w) => to_i32("window", w)?,
            None => 0,
        };
        let grid = u32::try_from(n_tiles).map_err(|_| shape(format!("{n_tiles} tiles")))?;
        let smem = 3 * 64 * (dh + 8) * 2;
        launch!(self, f, (grid, h as u32, 1), (128, 1, 1), smem;
            qp, kcp, vcp, tp, tbp, mb, lb, op, hi, hkvi, scale, window, skp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows<'a>(seq: &'a [i32], pos: &'a [i32], tables: &'a [i32]) -> PagedRows<'a> {
        PagedRows {
            seq,
            pos,
            tables,
            max_blocks: 1,
        }
    }

    #[test]
    fn decode_rows_alone_make_no_tiles() {
        let (seq, pos) = ([0, 1, 2], [5, 9, -1]);
        assert_eq!(prefill_tiles(&rows(&seq, &pos, &[0; 3])), None);
    }

    #[test]
    fn runs_become_tiles_of_64_rows_and_leave_the_rest() {
        // A decode row of sequence 1, 150 rows of sequence 0 from 850, a padding row, two rows
        // of sequence 2 from 0, and sequence 0 again at an unrelated position (its own run).
        let mut seq = vec![1];
        let mut pos = vec![69];
        seq.extend([0; 150]);
        pos.extend(850..1000);
        seq.extend([3, 2, 2, 0]);
        pos.extend([-1, 0, 1, 7]);
        let t = prefill_tiles(&rows(&seq, &pos, &[0; 4])).unwrap();
        assert_eq!(
            t.tiles,
            vec![1, 64, 0, 850, 65, 64, 0, 914, 129, 22, 0, 978, 152, 2, 2, 0]
        );
        let mut rest = vec![-1; pos.len()];
        rest[0] = 69;
        rest[154] = 7;
        assert_eq!(t.rest_pos, rest);
        assert_eq!(t.rest_max_len, Some(70));
    }

    #[test]
    fn every_row_tiled_leaves_no_row_kernel() {
        let (seq, pos) = ([0, 0, 0], [3, 4, 5]);
        let t = prefill_tiles(&rows(&seq, &pos, &[0])).unwrap();
        assert_eq!(t.tiles, vec![0, 3, 0, 3]);
        assert_eq!(t.rest_max_len, None);
        // A padding row keeps it (its zeros come from the row kernel's merge).
        let (seq, pos) = ([0, 0, 0], [3, 4, -1]);
        assert_eq!(
            prefill_tiles(&rows(&seq, &pos, &[0])).unwrap().rest_max_len,
            Some(1)
        );
    }
}
