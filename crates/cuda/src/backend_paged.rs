//! The paged KV cache path of [`CudaBackend`]: a layer's blocks as a [`DevicePagedLayer`]
//! inside a [`PagedStore`], one step's rows copied to the device once ([`DeviceStep`]), and the
//! device forms of `paged_rope_store` / `paged_attend` over the launchers of `paged.rs`.
//! `CudaBackend`'s `Backend` methods call these.
//!
//! Not here: the kernels and their launchers (`paged.rs`), the pool and tables
//! (`hf2q_tensor::paged`).

use cudarc::driver::CudaSlice;

use crate::backend::{CudaBackend, Raw};
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

/// A step's rows on the device (`PagedStep::device`).
struct DeviceStep {
    seq: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    /// Largest row position + 1: sets the attention's key splits.
    max_len: usize,
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
        let r = step.len();
        if step.seq.len() != r || step.slots.len() != r {
            return Err(Error::Shape(format!(
                "paged step: {r} positions, {} sequences, {} slots",
                step.seq.len(),
                step.slots.len()
            )));
        }
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
            seq: up(&step.seq)?,
            pos: up(&step.pos)?,
            slots: up(&step.slots)?,
            tables: up(&step.tables)?,
            max_len: step
                .pos
                .iter()
                .map(|&p| p.max(0) as usize + 1)
                .max()
                .unwrap_or(1),
            checked: std::sync::OnceLock::new(),
        };
        step.device = Some(Box::new(d));
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
            &ds.pos,
            &ds.slots,
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
        let rows = DevicePagedRows {
            seq: &ds.seq,
            pos: &ds.pos,
            tables: &ds.tables,
            rows: r,
            max_blocks: step.max_blocks,
            max_len: ds.max_len,
        };
        let dev = self.device();
        let n = dev.paged_attention_scratch_len(p, r, ds.max_len)?;
        let scratch = self.alloc(&[n.max(1)])?;
        let out = self.alloc(&[r, p.n_heads * p.head_dim])?;
        let qi = self.raw(q, "paged attention")?;
        let mut s = self.raw(&scratch, "paged attention")?;
        let mut o = self.raw(&out, "paged attention")?;
        dev.paged_attention(&qi, l, &rows, p, &mut s, &mut o)?;
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
        let dev = self.device();
        let l = self.raw(logits, "pick_rows")?;
        let any = |f: fn(&RowPick) -> bool| picks.iter().any(f);
        let greedy = if any(|p| matches!(p, RowPick::Argmax)) {
            let mut ids = dev.alloc::<u32>(r.max(1))?;
            dev.argmax(&l, r, v, &mut ids)?;
            Some(ids)
        } else {
            None
        };
        let sampled = if any(|p| matches!(p, RowPick::Sample(_))) {
            // Rows that are not drawn get settings that cost least (top-k 1).
            let args: Vec<SampleArgs> = picks
                .iter()
                .map(|p| match p {
                    RowPick::Sample(a) => *a,
                    _ => SampleArgs {
                        u: 0.0,
                        top_p: 1.0,
                        min_p: 0.0,
                        temperature: 1.0,
                        top_k: 1,
                    },
                })
                .collect();
            let a = dev.upload(&args)?;
            let mut ids = dev.alloc::<u32>(r.max(1))?;
            dev.sample_rows(&l, r, v, &a, &mut ids)?;
            Some(ids)
        } else {
            None
        };
        let greedy = greedy.map(|g| dev.download(&g)).transpose()?;
        let sampled = sampled.map(|s| dev.download(&s)).transpose()?;
        picks
            .iter()
            .enumerate()
            .map(|(i, p)| {
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
