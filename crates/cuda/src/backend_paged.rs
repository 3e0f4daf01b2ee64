//! The paged KV cache path of [`CudaBackend`]: a layer's blocks as a [`DevicePagedLayer`]
//! inside a [`PagedStore`], one step's rows copied to the device once ([`DeviceStep`]), and the
//! device forms of `paged_rope_store` / `paged_attend` over the launchers of `paged.rs`.
//! `CudaBackend`'s `Backend` methods call these.
//!
//! Not here: the kernels and their launchers (`paged.rs`), the pool and tables
//! (`hf2q_tensor::paged`).

use cudarc::driver::{CudaSlice, DevicePtr};

use crate::backend::{CudaBackend, Raw};
use crate::paged::prefill_tiles;
use crate::{DevicePagedLayer, DevicePagedRows, KvDtype, SampleArgs};
use hf2q_tensor::kv::{DeviceKv, KvType};
use hf2q_tensor::op::{AttentionParams, RopeParams};
use hf2q_tensor::paged::{PagedLayout, PagedStep, PagedStore};
use hf2q_tensor::{Error, Result, Tensor};

/// The device layer as a [`PagedStore`] payload.
struct PagedKv(DevicePagedLayer);

impl DeviceKv for PagedKv {
    fn bytes(&self) -> usize {
        self.0.bytes()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// A step's row arrays on the device.
struct RowBufs {
    seq: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    tables: CudaSlice<i32>,
}

/// Device row arrays at fixed addresses, for paged steps captured as graphs: each step's rows
/// are written into them ([`CudaBackend::paged_prepare_fixed`]) and every graph captured over
/// them reads them at replay. Sized for `rows` rows and `rows` block tables of `max_blocks`.
pub struct PagedInputs {
    bufs: std::sync::Arc<RowBufs>,
    rows: usize,
    max_blocks: usize,
}

/// A step's prefill chunks as tensor-core tiles ([`CudaDev::paged_prefill_tc`]), and the rows
/// left to the row kernel: their positions with every tiled row's set to -1 (padding to it).
struct PrefillTiles {
    /// `(n_tiles, 4)`: first row, rows (<= 64), sequence, position of the first row.
    tiles: CudaSlice<i32>,
    n_tiles: usize,
    rest_pos: CudaSlice<i32>,
    /// Bounds every remaining row's position + 1; `None` when every row is in a tile.
    rest_max_len: Option<usize>,
}

/// A step's rows on the device (`PagedStep::device`).
struct DeviceStep {
    bufs: std::sync::Arc<RowBufs>,
    /// Bounds every row's position + 1: sets the attention's key splits.
    max_len: usize,
    /// The prefill runs as tensor-core tiles (eager steps only: a captured step's rows are
    /// decode rows, and its arrays are written at replay).
    prefill: Option<PrefillTiles>,
    /// The pool shape `(n_blocks, B)` the rows were checked against: every layer of a model's
    /// paged cache shares it, so the host checks the rows once a step, not once a layer.
    checked: std::sync::OnceLock<(usize, usize)>,
}

/// Checks the step's rows and slots against `layout`'s pool (the kernels cannot), once per
/// pool shape.
fn check_rows(step: &PagedStep, ds: &DeviceStep, layout: &PagedLayout) -> Result<()> {
    let shape = (layout.n_blocks, layout.block_tokens);
    if ds.checked.get() == Some(&shape) {
        return Ok(());
    }
    step.rows().check(layout)?;
    let slots = layout.n_blocks * layout.block_tokens;
    if let Some((r, &s)) = step
        .slots
        .iter()
        .enumerate()
        .find(|(_, &s)| s >= 0 && s as usize >= slots)
    {
        return Err(Error::Shape(format!(
            "paged step: row {r}'s slot {s} is past the pool's {} blocks",
            layout.n_blocks
        )));
    }
    // A second pool shape in one step (not something a model makes) is checked every time.
    let _ = ds.checked.set(shape);
    Ok(())
}

/// One sequence and one slot per row.
fn check_lengths(step: &PagedStep) -> Result<()> {
    let r = step.len();
    if step.seq.len() != r || step.slots.len() != r {
        return Err(Error::Shape(format!(
            "paged step: {r} positions, {} sequences, {} slots",
            step.seq.len(),
            step.slots.len()
        )));
    }
    Ok(())
}

fn layer<'a>(kv: &'a PagedStore, what: &str) -> Result<&'a DevicePagedLayer> {
    match kv {
        PagedStore::Device(d) => d
            .as_any()
            .downcast_ref::<PagedKv>()
            .map(|l| &l.0)
            .ok_or_else(|| Error::Msg(format!("cuda {what}: another device's paged cache"))),
        PagedStore::Host(_) => Err(Error::Msg(format!(
            "cuda {what}: the paged cache is on the host (make it with this backend)"
        ))),
    }
}

fn layer_mut<'a>(kv: &'a mut PagedStore, what: &str) -> Result<&'a mut DevicePagedLayer> {
    match kv {
        PagedStore::Device(d) => d
            .as_any_mut()
            .downcast_mut::<PagedKv>()
            .map(|l| &mut l.0)
            .ok_or_else(|| Error::Msg(format!("cuda {what}: another device's paged cache"))),
        PagedStore::Host(_) => Err(Error::Msg(format!(
            "cuda {what}: the paged cache is on the host (make it with this backend)"
        ))),
    }
}

fn device_step<'a>(step: &'a PagedStep, what: &str) -> Result<&'a DeviceStep> {
    step.device
        .as_ref()
        .and_then(|d| d.downcast_ref::<DeviceStep>())
        .ok_or_else(|| {
            Error::Msg(format!(
                "cuda {what}: the step's rows are not on the device"
            ))
        })
}

impl CudaBackend {
    pub(crate) fn paged_alloc_device(&self, layout: PagedLayout, ty: KvType) -> Result<PagedStore> {
        let dtype = KvDtype::try_from(ty)?;
        let l = self.device().alloc_paged_layer(layout, dtype)?;
        Ok(PagedStore::Device(Box::new(PagedKv(l))))
    }

    pub(crate) fn paged_prepare_device(&self, step: &mut PagedStep) -> Result<()> {
        check_lengths(step)?;
        let dev = self.device();
        // A device buffer is never empty.
        let up = |v: &[i32]| {
            if v.is_empty() {
                dev.upload(&[0i32])
            } else {
                dev.upload(v)
            }
        };
        let d = DeviceStep {
            bufs: std::sync::Arc::new(RowBufs {
                seq: up(&step.seq)?,
                pos: up(&step.pos)?,
                slots: up(&step.slots)?,
                tables: up(&step.tables)?,
            }),
            max_len: step
                .pos
                .iter()
                .map(|&p| p.max(0) as usize + 1)
                .max()
                .unwrap_or(1),
            prefill: match prefill_tiles(&step.rows()).filter(|_| dev.options().paged_prefill_tc) {
                Some(t) => Some(PrefillTiles {
                    n_tiles: t.tiles.len() / 4,
                    tiles: dev.upload(&t.tiles)?,
                    rest_pos: up(&t.rest_pos)?,
                    rest_max_len: t.rest_max_len,
                }),
                None => None,
            },
            checked: std::sync::OnceLock::new(),
        };
        step.device = Some(Box::new(d));
        Ok(())
    }

    /// Row arrays at fixed device addresses for steps of up to `rows` rows (and sequences)
    /// with tables of `max_blocks` entries ([`PagedInputs`]).
    pub fn paged_inputs(&self, rows: usize, max_blocks: usize) -> Result<PagedInputs> {
        let dev = self.device();
        let (n, t) = (rows.max(1), (rows * max_blocks).max(1));
        Ok(PagedInputs {
            bufs: std::sync::Arc::new(RowBufs {
                seq: dev.alloc::<i32>(n)?,
                pos: dev.alloc::<i32>(n)?,
                slots: dev.alloc::<i32>(n)?,
                tables: dev.alloc::<i32>(t)?,
            }),
            rows,
            max_blocks,
        })
    }

    /// [`hf2q_tensor::op::Backend::paged_prepare`] through `inputs`: the step's rows are
    /// written into its fixed arrays (not while capturing: then a replay's step writes them
    /// before the launch) and the attention splits its keys for rows of up to `max_len`
    /// positions whatever the rows' own (so a graph captured over them fits every step of its
    /// size). The previous step over `inputs` must be dropped first.
    pub fn paged_prepare_fixed(
        &self,
        step: &mut PagedStep,
        inputs: &mut PagedInputs,
        max_len: usize,
    ) -> Result<()> {
        check_lengths(step)?;
        let (r, n_seqs) = (step.len(), step.tables.len() / step.max_blocks.max(1));
        if r > inputs.rows || n_seqs > inputs.rows || step.max_blocks != inputs.max_blocks {
            return Err(Error::Shape(format!(
                "paged step: {r} rows of {n_seqs} tables of {} blocks for fixed arrays of {} \
                 rows and tables of {}",
                step.max_blocks, inputs.rows, inputs.max_blocks
            )));
        }
        if !self.capturing() {
            let bufs = std::sync::Arc::get_mut(&mut inputs.bufs).ok_or_else(|| {
                Error::Msg("paged step: the previous step over these arrays is still alive".into())
            })?;
            let dev = self.device();
            for (buf, v) in [
                (&mut bufs.seq, &step.seq),
                (&mut bufs.pos, &step.pos),
                (&mut bufs.slots, &step.slots),
                (&mut bufs.tables, &step.tables),
            ] {
                if !v.is_empty() {
                    dev.write(buf, v)?;
                }
            }
        }
        step.device = Some(Box::new(DeviceStep {
            bufs: inputs.bufs.clone(),
            max_len: max_len.max(1),
            prefill: None,
            checked: std::sync::OnceLock::new(),
        }));
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn paged_rope_store_device(
        &self,
        q: &mut Tensor,
        k: &Tensor,
        v: &Tensor,
        n_heads: usize,
        kv: &mut PagedStore,
        step: &PagedStep,
        p: &RopeParams,
    ) -> Result<()> {
        let ds = device_step(step, "paged rope_store")?;
        let l = layer_mut(kv, "paged rope_store")?;
        check_rows(step, ds, l.layout())?;
        let table = self.rope_table(p)?;
        let mut qi = self.raw(q, "paged rope_store")?;
        let (ki, vi) = (
            self.raw(k, "paged rope_store")?,
            self.raw(v, "paged rope_store")?,
        );
        self.device().paged_rope_store(
            &mut qi,
            &ki,
            &vi,
            step.len(),
            n_heads,
            l,
            &ds.bufs.pos,
            &ds.bufs.slots,
            &table,
        )
    }

    pub(crate) fn paged_attend_device(
        &self,
        q: &Tensor,
        kv: &PagedStore,
        step: &PagedStep,
        p: &AttentionParams,
    ) -> Result<Tensor> {
        let ds = device_step(step, "paged attention")?;
        let l = layer(kv, "paged attention")?;
        check_rows(step, ds, l.layout())?;
        let r = step.len();
        let dev = self.device();
        // Prefill runs on tensor cores (tiles exist only under `paged-prefill=tc`), the other
        // rows through the row kernel.
        let tiled = ds
            .prefill
            .as_ref()
            .filter(|_| dev.paged_prefill_tc_fits(l, p));
        let (pos, max_len) = match tiled {
            Some(t) => (&t.rest_pos, t.rest_max_len),
            None => (&ds.bufs.pos, Some(ds.max_len)),
        };
        let sinks = p.sinks.as_ref().map(|s| self.vector(s)).transpose()?;
        let out = self.alloc(&[r, p.n_heads * p.head_dim])?;
        let qi = self.raw(q, "paged attention")?;
        let mut o = self.raw(&out, "paged attention")?;
        if let Some(max_len) = max_len {
            let rows = DevicePagedRows {
                seq: &ds.bufs.seq,
                pos,
                tables: &ds.bufs.tables,
                rows: r,
                max_blocks: step.max_blocks,
                max_len,
            };
            let n = dev.paged_attention_scratch_len(p, r, max_len)?;
            let scratch = self.alloc(&[n.max(1)])?;
            let mut s = self.raw(&scratch, "paged attention")?;
            dev.paged_attention(&qi, l, &rows, p, &mut s, &mut o, sinks.as_deref())?;
        }
        if let Some(t) = tiled {
            let tables = &ds.bufs.tables;
            dev.paged_prefill_tc(
                &qi,
                l,
                &t.tiles,
                t.n_tiles,
                tables,
                step.max_blocks,
                p,
                &mut o,
                sinks.as_deref(),
            )?;
        }
        Ok(out)
    }
}

/// How the token of one row of a step's logits is chosen ([`CudaBackend::pick_rows`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowPick {
    /// The most likely token (the host sampler's greedy rule), on the device.
    Argmax,
    /// One draw with these settings (`sample_topk`: the host sampler's top-k, top-p, min-p,
    /// temperature and draw with its uniform number), on the device.
    Sample(SampleArgs),
    /// The row itself, to the host (for what the device does not do: penalties, a logit bias,
    /// grammar masks, log-probabilities).
    Logits,
}

/// What [`CudaBackend::pick_rows`] gives back for one row.
#[derive(Clone, Debug, PartialEq)]
pub enum RowPicked {
    Token(u32),
    Logits(Vec<f32>),
}

impl CudaBackend {
    /// Picks each row's token of `logits (R, V)` as `picks[r]` says: greedy rows in one argmax
    /// launch, sampled rows in one sampling launch (each row its own settings), and only the
    /// ids and the [`RowPick::Logits`] rows cross to the host (one synchronisation).
    pub fn pick_rows(&self, logits: &Tensor, picks: &[RowPick]) -> Result<Vec<RowPicked>> {
        let (r, v) = logits.dims2();
        if picks.len() != r {
            return Err(Error::Shape(format!(
                "pick_rows: {} picks for {r} rows of logits",
                picks.len()
            )));
        }
        let l = self.raw(logits, "pick_rows")?;
        let at: Vec<(usize, RowPick)> = picks.iter().copied().enumerate().collect();
        self.pick_at(&l, r, v, &at)
    }

    /// [`CudaBackend::pick_rows`] of the rows `picks` names (`(row, how)`; rows not named are
    /// not read).
    pub fn pick_rows_at(
        &self,
        logits: &Tensor,
        picks: &[(usize, RowPick)],
    ) -> Result<Vec<RowPicked>> {
        let (r, v) = logits.dims2();
        let l = self.raw(logits, "pick_rows")?;
        self.pick_at(&l, r, v, picks)
    }

    /// [`CudaBackend::pick_rows`] over the logits `(R, V)` a captured step left in its output
    /// buffer ([`CudaBackend::replay_launch`]): `picks` pairs a row with how to pick it (rows
    /// not named are not read).
    pub fn pick_graph_rows(
        &self,
        g: &crate::backend::StepGraph,
        picks: &[(usize, RowPick)],
    ) -> Result<Vec<RowPicked>> {
        let (out, shape) = g.output_buffer();
        let &[r, v] = shape else {
            return Err(Error::Shape(format!(
                "pick_graph_rows: the graph's output {shape:?} is not rows of logits"
            )));
        };
        let l = Raw {
            ptr: out.device_ptr(self.device().stream()).0,
            len: r * v,
            stream: self.device().stream(),
        };
        self.pick_at(&l, r, v, picks)
    }

    /// Picks `(row, how)` of `l (R, V)`: the argmax and sampling launches cover all `R` rows.
    fn pick_at(
        &self,
        l: &Raw<'_>,
        r: usize,
        v: usize,
        picks: &[(usize, RowPick)],
    ) -> Result<Vec<RowPicked>> {
        if let Some((row, _)) = picks.iter().find(|(row, _)| *row >= r) {
            return Err(Error::Shape(format!(
                "pick: row {row} of {r} rows of logits"
            )));
        }
        let dev = self.device();
        let any = |f: fn(&RowPick) -> bool| picks.iter().any(|(_, p)| f(p));
        let greedy = if any(|p| matches!(p, RowPick::Argmax)) {
            let mut ids = dev.alloc::<u32>(r.max(1))?;
            dev.argmax(l, r, v, &mut ids)?;
            Some(ids)
        } else {
            None
        };
        let sampled = if any(|p| matches!(p, RowPick::Sample(_))) {
            // Rows that are not drawn get settings that cost least (top-k 1).
            let mut args = vec![
                SampleArgs {
                    u: 0.0,
                    top_p: 1.0,
                    min_p: 0.0,
                    temperature: 1.0,
                    top_k: 1,
                };
                r
            ];
            for (row, p) in picks {
                if let RowPick::Sample(a) = p {
                    args[*row] = *a;
                }
            }
            let a = dev.upload(&args)?;
            let mut ids = dev.alloc::<u32>(r.max(1))?;
            dev.sample_rows(l, r, v, &a, &mut ids)?;
            Some(ids)
        } else {
            None
        };
        let greedy = greedy.map(|g| dev.download(&g)).transpose()?;
        let sampled = sampled.map(|s| dev.download(&s)).transpose()?;
        picks
            .iter()
            .map(|&(i, p)| {
                Ok(match p {
                    RowPick::Argmax => RowPicked::Token(greedy.as_ref().map_or(0, |g| g[i])),
                    RowPick::Sample(_) => RowPicked::Token(sampled.as_ref().map_or(0, |s| s[i])),
                    RowPick::Logits => {
                        let row = Raw {
                            ptr: l.ptr + (4 * i * v) as u64,
                            len: v,
                            stream: l.stream,
                        };
                        RowPicked::Logits(dev.download(&row)?)
                    }
                })
            })
            .collect()
    }

    /// The most likely token of each row of `logits (R, V)`, picked on the device in one
    /// launch (the host sampler's rule); only the ids come back.
    pub fn argmax_rows(&self, logits: &Tensor) -> Result<Vec<u32>> {
        let (r, v) = logits.dims2();
        let dev = self.device();
        let mut ids = dev.alloc::<u32>(r.max(1))?;
        let l = self.raw(logits, "argmax")?;
        dev.argmax(&l, r, v, &mut ids)?;
        let mut out = dev.download(&ids)?;
        out.truncate(r);
        Ok(out)
    }
}
