//! The training loop, SFT or DPO ([`Objective`]): data rendered and checked before the first step, seeded epochs of
//! micro-batches, gradient accumulation with the loss normalised over the whole step's learned
//! tokens (as transformers' `num_items_in_batch`), global-norm clipping, AdamW under a
//! warm-up + decay schedule, evaluation, checkpoints and resume, and a stop flag (a signal)
//! that ends the run with a checkpoint after the step in progress.
//!
//! DPO's differences are confined to the step and the evaluation (`crate::dpo`): samples go
//! in pairs (chosen, rejected) that stay together in the order, the split and every
//! micro-batch, and the reference policy's log-probabilities come from a forward-only pass
//! per micro-batch.
//!
//! Deterministic on the CPU: the same data, settings and seed give the same adapter, and a run
//! resumed from a checkpoint ends where an unbroken run ends.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use hf2q_models::adapter::{read_peft_config, LoraConfig, CONFIG_FILE};
use hf2q_models::layers::lora::LoraGrads;
use hf2q_models::train_pass::{PassOptions, TrainBatch};
use hf2q_models::Model;

use crate::batch::{epoch_batches, make_batch, SplitMix};
use crate::checkpoint::{self, LoraSettings, ModelIdentity, TrainState};
use crate::data::Dataset;
use crate::dpo::{self, PairStats, Reference};
use crate::optim::{clip_grad_norm, AdamW, AdamWConfig, Schedule, ScheduleKind};
use crate::render::{RenderConfig, Renderer, Sample};
use crate::report::{EvalReport, Event, LengthReport, Observer, Plan, StepReport};
use crate::{Error, Result};

/// Which blocks recompute their forward in their backward instead of storing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checkpointing {
    /// Every block on a GPU, none on the CPU.
    Auto,
    /// Every block.
    On,
    /// None.
    Off,
    /// The first N blocks (the others keep their activations: a middle ground between the
    /// memory of `On` and the speed of `Off`).
    Blocks(usize),
}

/// What the run optimises.
#[derive(Clone, Debug, PartialEq)]
pub enum Objective {
    /// Mean cross-entropy of the learned tokens.
    Sft,
    /// DPO's sigmoid loss over preference pairs (records `2i`, `2i + 1`: chosen, rejected),
    /// against the base without adapters or the adapter in `ref_adapter`.
    Dpo {
        beta: f32,
        ref_adapter: Option<PathBuf>,
    },
}

impl Objective {
    /// Samples that stay together (a pair for DPO).
    pub fn group(&self) -> usize {
        match self {
            Objective::Sft => 1,
            Objective::Dpo { .. } => 2,
        }
    }
}

/// How long to train: whole epochs, or a number of optimizer steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Length {
    Epochs(u64),
    Steps(u64),
}

#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub lora: LoraConfig,
    pub lr: f32,
    pub schedule: ScheduleKind,
    /// Warm-up steps (`warmup_ratio` of the total when `None`).
    pub warmup_steps: Option<u64>,
    pub warmup_ratio: f32,
    pub length: Length,
    /// Samples per micro-batch (bins of samples with packing).
    pub batch: usize,
    pub grad_accum: usize,
    pub max_seq_len: usize,
    pub packing: bool,
    pub train_on_prompt: bool,
    pub seed: u64,
    pub adam: AdamWConfig,
    pub max_grad_norm: Option<f32>,
    pub checkpointing: Checkpointing,
    /// Evaluate every N steps (and at the end) when there is validation data.
    pub eval_every: Option<u64>,
    /// Write a checkpoint every N steps.
    pub save_every: Option<u64>,
    /// Fraction of the training records (pairs) held out for validation when no file is given.
    pub valid_split: f32,
    pub objective: Objective,
    /// Start from this PEFT adapter (its settings replace `lora`) instead of a fresh one.
    pub init_adapter: Option<PathBuf>,
}

impl Default for TrainConfig {
    fn default() -> TrainConfig {
        TrainConfig {
            lora: LoraConfig {
                r: 16,
                alpha: 32.0,
                ..LoraConfig::default()
            },
            lr: 2e-4,
            schedule: ScheduleKind::Cosine,
            warmup_steps: None,
            warmup_ratio: 0.03,
            length: Length::Epochs(1),
            batch: 4,
            grad_accum: 1,
            max_seq_len: 1024,
            packing: false,
            train_on_prompt: false,
            seed: 42,
            adam: AdamWConfig::default(),
            max_grad_norm: Some(1.0),
            checkpointing: Checkpointing::Auto,
            eval_every: None,
            save_every: None,
            valid_split: 0.0,
            objective: Objective::Sft,
            init_adapter: None,
        }
    }
}

impl TrainConfig {
    /// Checks the settings; names what is impossible.
    pub fn validate(&self) -> Result<()> {
        self.lora.validate()?;
        let bad = |m: String| Err(Error::Config(m));
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("learning rate {} must be positive", self.lr));
        }
        if self.batch == 0 || self.grad_accum == 0 {
            return bad("--batch and --grad-accum must be at least 1".into());
        }
        if matches!(self.length, Length::Epochs(0) | Length::Steps(0)) {
            return bad("train for at least one epoch or step".into());
        }
        if !(0.0..1.0).contains(&self.valid_split) {
            return bad(format!(
                "--valid-split {} must be in [0, 1)",
                self.valid_split
            ));
        }
        if !(0.0..1.0).contains(&self.warmup_ratio) {
            return bad(format!(
                "warm-up ratio {} must be in [0, 1)",
                self.warmup_ratio
            ));
        }
        if self.max_grad_norm.is_some_and(|n| !(n > 0.0)) {
            return bad("--max-grad-norm must be positive".into());
        }
        if let Objective::Dpo { beta, .. } = self.objective {
            if beta <= 0.0 || !beta.is_finite() {
                return bad(format!("--beta {beta} must be positive"));
            }
        }
        Ok(())
    }
}

/// Rendered data, ready to batch.
pub struct Prepared {
    pub train: Vec<Sample>,
    pub valid: Vec<Sample>,
}

/// Renders every record (an error names the first bad record's file and line) and holds out
/// the validation part: the `valid` file's records, or a seeded `valid_split` of `train`'s.
pub fn prepare(
    model: &Model,
    train: &Dataset,
    valid: Option<&Dataset>,
    cfg: &TrainConfig,
) -> Result<Prepared> {
    let r = Renderer::new(
        model,
        RenderConfig {
            train_on_prompt: cfg.train_on_prompt,
            max_len: cfg.max_seq_len,
        },
    )?;
    let render = |d: &Dataset| -> Result<Vec<Sample>> {
        d.records
            .iter()
            .enumerate()
            .map(|(i, rec)| r.sample(rec).map_err(|m| d.error(i, m)))
            .collect()
    };
    let mut all = render(train)?;
    // Records held out together: a DPO pair's two.
    let group = cfg.objective.group();
    let valid = match valid {
        Some(v) => render(v)?,
        None if cfg.valid_split > 0.0 => {
            let units = all.len() / group;
            if units < 2 {
                return Err(Error::Config(
                    "--valid-split needs at least two training records (pairs)".into(),
                ));
            }
            let n = ((units as f64 * cfg.valid_split as f64).round() as usize).clamp(1, units - 1);
            let mut idx: Vec<usize> = (0..units).collect();
            SplitMix(cfg.seed ^ 0x5EED_5A1D).shuffle(&mut idx);
            let held: std::collections::HashSet<usize> = idx[..n].iter().copied().collect();
            let mut keep = Vec::new();
            let mut out = Vec::new();
            for (i, s) in all.drain(..).enumerate() {
                if held.contains(&(i / group)) {
                    out.push(s);
                } else {
                    keep.push(s);
                }
            }
            all = keep;
            out
        }
        None => Vec::new(),
    };
    if all.is_empty() {
        return Err(Error::Config("no training samples left".into()));
    }
    Ok(Prepared { train: all, valid })
}

/// How a run ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Every step done; the adapter is at this path.
    Done(PathBuf),
    /// Stopped by the flag after `step` steps; resume from this checkpoint.
    Stopped { step: u64, checkpoint: PathBuf },
}

pub struct Trainer<'m> {
    model: &'m mut Model,
    cfg: TrainConfig,
    data: Prepared,
    out: PathBuf,
    base_name: String,
    adam: AdamW,
    state: TrainState,
    schedule: Schedule,
    /// Blocks recomputed in the backward (see [`Checkpointing`]).
    recompute: usize,
    device: String,
    /// DPO's reference policy.
    reference: Option<Reference>,
}

/// Steps of one epoch of `micro` micro-batches.
fn steps_per_epoch(micro: usize, accum: usize) -> u64 {
    micro.div_ceil(accum) as u64
}

impl<'m> Trainer<'m> {
    /// Attaches fresh adapters (or, with `resume`, the checkpoint's), checks the output folder
    /// (an adapter already there is not overwritten unless `overwrite`), and plans the run.
    pub fn new(
        model: &'m mut Model,
        mut cfg: TrainConfig,
        data: Prepared,
        out: &Path,
        resume: Option<&Path>,
        overwrite: bool,
    ) -> Result<Trainer<'m>> {
        if let Some(dir) = &cfg.init_adapter {
            cfg.lora = read_peft_config(dir)?.config;
        }
        cfg.validate()?;
        if resume.is_none() && out.join(CONFIG_FILE).exists() && !overwrite {
            return Err(Error::Config(format!(
                "{} already holds an adapter; choose another output folder, --resume it, or pass --overwrite",
                out.display()
            )));
        }
        let resume_dir = resume.map(checkpoint::find).transpose()?;
        let resumed = match &resume_dir {
            Some(dir) => Some(checkpoint::read_state(dir, model, &cfg.lora)?),
            None => None,
        };
        // The reference adapter is loaded (and swapped off the model) before the policy's.
        let reference = match &cfg.objective {
            Objective::Sft => None,
            Objective::Dpo {
                ref_adapter: None, ..
            } => Some(Reference::base()),
            Objective::Dpo {
                ref_adapter: Some(dir),
                ..
            } => Some(Reference::load(model, dir)?),
        };
        match &resume_dir {
            Some(dir) => {
                let got = model.load_adapter(dir)?;
                if got.r != cfg.lora.r {
                    return Err(Error::Config(format!(
                        "{}: adapter rank {} is not {}",
                        dir.display(),
                        got.r,
                        cfg.lora.r
                    )));
                }
            }
            None => match &cfg.init_adapter {
                Some(dir) => {
                    model.load_adapter(dir)?;
                }
                None => {
                    model.attach_lora(&cfg.lora, cfg.seed)?;
                }
            },
        }
        let mut adam = AdamW::new(model, cfg.adam)?;
        let micro = epoch_batches(
            &data.train,
            cfg.seed,
            0,
            cfg.batch,
            cfg.packing.then_some(cfg.max_seq_len),
            cfg.objective.group(),
        )
        .len();
        let total = match cfg.length {
            Length::Steps(n) => n,
            Length::Epochs(e) => e * steps_per_epoch(micro, cfg.grad_accum),
        };
        let state = match (resumed, &resume_dir) {
            (Some(s), Some(dir)) => {
                adam.restore(
                    s.step,
                    checkpoint::read_moments(dir, model.adapters().len())?,
                )?;
                if s.total_steps != total {
                    return Err(Error::Config(format!(
                        "{}: the checkpoint belongs to a run of {} steps, these settings make {total}",
                        dir.display(),
                        s.total_steps
                    )));
                }
                s
            }
            _ => TrainState {
                step: 0,
                total_steps: total,
                epoch: 0,
                micro: 0,
                seed: cfg.seed,
                tokens_seen: 0,
                model: ModelIdentity::of(model),
                lora: LoraSettings::from(&cfg.lora),
            },
        };
        let warmup = cfg
            .warmup_steps
            .unwrap_or((cfg.warmup_ratio as f64 * total as f64).ceil() as u64);
        let schedule = Schedule {
            base: cfg.lr,
            warmup,
            total,
            kind: cfg.schedule,
        };
        let device = match model.cuda() {
            Some(c) => {
                // Training products run on one f16/bf16 pass: the inference default (f16
                // pairs, three products per weight) buys a precision the bf16 backward does
                // not keep, at three times the tensor-core work.
                c.device().set_prefill_gemm(hf2q_cuda::PrefillGemm::F16);
                c.device().info().name.clone()
            }
            None => "cpu".to_string(),
        };
        let blocks = model.config.n_layers;
        let recompute = match cfg.checkpointing {
            Checkpointing::On => blocks,
            Checkpointing::Off => 0,
            Checkpointing::Blocks(n) => n.min(blocks),
            Checkpointing::Auto if model.cuda().is_some() => blocks,
            Checkpointing::Auto => 0,
        };
        std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
        let base_name = model
            .name()
            .map(str::to_string)
            .unwrap_or_else(|| model.path().display().to_string());
        Ok(Trainer {
            model,
            cfg,
            data,
            out: out.to_path_buf(),
            base_name,
            adam,
            state,
            schedule,
            recompute,
            device,
            reference,
        })
    }

    pub fn state(&self) -> &TrainState {
        &self.state
    }

    fn plan(&self, micro: usize) -> Plan {
        Plan {
            train: LengthReport::of(&self.data.train),
            valid: (!self.data.valid.is_empty()).then(|| LengthReport::of(&self.data.valid)),
            total_steps: self.state.total_steps,
            start_step: self.state.step,
            micro_batches_per_epoch: micro,
            trainable_parameters: self
                .model
                .adapters()
                .iter()
                .map(|(_, l)| l.a.len() + l.b.len())
                .sum(),
            adapters: self.model.adapters().len(),
            device: self.device.clone(),
            recomputed_blocks: self.recompute,
        }
    }

    /// The mean loss and accuracy of the validation samples (no dropout); for DPO, of the
    /// validation pairs, with their metrics.
    pub fn evaluate(&mut self) -> Result<Option<EvalReport>> {
        if self.data.valid.is_empty() {
            return Ok(None);
        }
        if let (Objective::Dpo { beta, .. }, Some(reference)) =
            (&self.cfg.objective, &mut self.reference)
        {
            let mut st = PairStats::default();
            let mut tokens = 0;
            let pairs: Vec<usize> = (0..self.data.valid.len() / 2).collect();
            for chunk in pairs.chunks(self.cfg.batch) {
                let picks: Vec<usize> = chunk.iter().flat_map(|&p| [2 * p, 2 * p + 1]).collect();
                let b = make_batch(&self.data.valid, &picks)?;
                st.add(&dpo::eval_pairs(self.model, reference, &b, *beta as f64)?);
                tokens += b.ids.len();
            }
            return Ok(Some(EvalReport {
                step: self.state.step,
                loss: st.mean_loss(),
                accuracy: st.token_accuracy(),
                tokens,
                dpo: Some(st.metrics()),
            }));
        }
        let (mut sum, mut hits, mut n, mut tokens) = (0f64, 0usize, 0usize, 0usize);
        let idx: Vec<usize> = (0..self.data.valid.len()).collect();
        for picks in idx.chunks(self.cfg.batch) {
            let b = make_batch(&self.data.valid, picks)?;
            let out = self.model.eval_pass(&b)?;
            for (k, &t) in b.targets.iter().enumerate() {
                if t >= 0 {
                    sum -= out.logp[k] as f64;
                    hits += out.hit[k] as usize;
                    n += 1;
                }
            }
            tokens += b.ids.len();
        }
        Ok(Some(EvalReport {
            step: self.state.step,
            loss: sum / n.max(1) as f64,
            accuracy: hits as f64 / n.max(1) as f64,
            tokens,
            dpo: None,
        }))
    }

    fn save_checkpoint(&self) -> Result<PathBuf> {
        checkpoint::save(
            &self.out,
            self.model,
            &self.cfg.lora,
            &self.base_name,
            &self.adam,
            &self.state,
        )
    }

    /// The options of micro-batch `k` of this step's pass (its dropout stream).
    fn pass_options(&self, k: usize) -> PassOptions {
        PassOptions {
            recompute_blocks: self.recompute,
            dropout: true,
            seed: SplitMix(self.state.seed ^ (self.state.step << 16) ^ k as u64).next_u64(),
        }
    }

    /// Clipping and the optimizer's update: returns `(grad_norm, lr)`.
    fn update(&mut self, grads: &mut LoraGrads) -> Result<(f64, f32)> {
        let be = self.model.train_backend_handle();
        let norm = clip_grad_norm(&*be, grads, self.cfg.max_grad_norm)?;
        let lr = self.schedule.lr(self.state.step);
        self.adam.update(self.model, grads, lr)?;
        Ok((norm, lr))
    }

    /// One DPO step over micro-batches of whole pairs: the reference's pass, then the
    /// policy's, per micro-batch; the loss is the mean over the step's pairs.
    fn step_dpo(
        &mut self,
        batches: &[TrainBatch],
        grads: &mut LoraGrads,
        beta: f64,
    ) -> Result<(PairStats, usize)> {
        let pairs: usize = batches.iter().map(|b| b.layout.sequences() / 2).sum();
        let mut st = PairStats::default();
        let mut tokens = 0;
        grads.clear();
        let mut reference = self
            .reference
            .take()
            .ok_or_else(|| Error::Msg("DPO without a reference".into()))?;
        let mut run = || -> Result<()> {
            for (k, b) in batches.iter().enumerate() {
                let refs = reference.logps(self.model, b)?;
                let opts = self.pass_options(k);
                st.add(&dpo::policy_pass(
                    self.model, b, &refs, beta, pairs, &opts, grads,
                )?);
                tokens += b.ids.len();
            }
            Ok(())
        };
        let done = run();
        self.reference = Some(reference);
        done?;
        Ok((st, tokens))
    }

    /// One optimizer step over `batches` (the step's micro-batches): returns
    /// `(loss, accuracy, grad_norm, lr, tokens)`.
    fn step(
        &mut self,
        batches: &[TrainBatch],
        grads: &mut LoraGrads,
    ) -> Result<(f64, f64, f64, f32, usize)> {
        let n: usize = batches.iter().map(TrainBatch::labelled).sum();
        let (mut sum, mut hits, mut tokens) = (0f64, 0usize, 0usize);
        grads.clear();
        for (k, b) in batches.iter().enumerate() {
            let w: Vec<f32> = b
                .targets
                .iter()
                .map(|&t| if t >= 0 { -1.0 / n.max(1) as f32 } else { 0.0 })
                .collect();
            let opts = self.pass_options(k);
            let out = self.model.train_pass(b, &w, &opts, grads)?;
            for (i, &t) in b.targets.iter().enumerate() {
                if t >= 0 {
                    sum -= out.logp[i] as f64;
                    hits += out.hit[i] as usize;
                }
            }
            tokens += b.ids.len();
        }
        if n == 0 {
            // A step whose samples have nothing to learn (every target cut away): no update.
            return Ok((0.0, 0.0, 0.0, 0.0, tokens));
        }
        let (norm, lr) = self.update(grads)?;
        Ok((sum / n as f64, hits as f64 / n as f64, norm, lr, tokens))
    }

    /// Runs to the end, or until `stop` is set (then a checkpoint is written after the step in
    /// progress). Writes the adapter into the output folder at the end.
    pub fn run(&mut self, obs: &mut dyn Observer, stop: &AtomicBool) -> Result<Outcome> {
        let packing = self.cfg.packing.then_some(self.cfg.max_seq_len);
        let group = self.cfg.objective.group();
        let micro0 = epoch_batches(
            &self.data.train,
            self.cfg.seed,
            0,
            self.cfg.batch,
            packing,
            group,
        )
        .len();
        obs.event(&Event::Plan(self.plan(micro0)));
        let start = Instant::now();
        let mut grads = LoraGrads::new();
        let mut last_loss = None;
        let mut epoch_plan = epoch_batches(
            &self.data.train,
            self.cfg.seed,
            self.state.epoch,
            self.cfg.batch,
            packing,
            group,
        );
        while self.state.step < self.state.total_steps {
            if self.state.micro >= epoch_plan.len() {
                self.state.epoch += 1;
                self.state.micro = 0;
                epoch_plan = epoch_batches(
                    &self.data.train,
                    self.cfg.seed,
                    self.state.epoch,
                    self.cfg.batch,
                    packing,
                    group,
                );
            }
            let t0 = Instant::now();
            let end = (self.state.micro + self.cfg.grad_accum).min(epoch_plan.len());
            let batches = epoch_plan[self.state.micro..end]
                .iter()
                .map(|p| make_batch(&self.data.train, p))
                .collect::<Result<Vec<_>>>()?;
            let (loss, accuracy, grad_norm, lr, tokens, dpo_metrics) = match self.cfg.objective {
                Objective::Sft => {
                    let (l, a, g, lr, t) = self.step(&batches, &mut grads)?;
                    (l, a, g, lr, t, None)
                }
                Objective::Dpo { beta, .. } => {
                    let (st, t) = self.step_dpo(&batches, &mut grads, beta as f64)?;
                    let (g, lr) = self.update(&mut grads)?;
                    (
                        st.mean_loss(),
                        st.token_accuracy(),
                        g,
                        lr,
                        t,
                        Some(st.metrics()),
                    )
                }
            };
            self.state.micro = end;
            self.state.step += 1;
            self.state.tokens_seen += tokens as u64;
            last_loss = Some(loss);
            let dt = t0.elapsed().as_secs_f64();
            obs.event(&Event::Step(StepReport {
                step: self.state.step,
                total_steps: self.state.total_steps,
                epoch: self.state.epoch as f64
                    + self.state.micro as f64 / epoch_plan.len().max(1) as f64,
                loss,
                lr,
                grad_norm,
                accuracy,
                tokens,
                tokens_per_s: tokens as f64 / dt.max(1e-9),
                elapsed_s: start.elapsed().as_secs_f64(),
                device_memory_gib: self
                    .model
                    .cuda()
                    .and_then(|c| c.device().memory().ok())
                    .map(|(free, total)| (total - free) as f64 / (1u64 << 30) as f64),
                dpo: dpo_metrics,
            }));
            let at_end = self.state.step == self.state.total_steps;
            if let Some(every) = self.cfg.eval_every {
                if self.state.step % every == 0 && !at_end {
                    if let Some(e) = self.evaluate()? {
                        obs.event(&Event::Eval(e));
                    }
                }
            }
            if stop.load(Ordering::Relaxed) && !at_end {
                let dir = self.save_checkpoint()?;
                obs.event(&Event::Stopped {
                    step: self.state.step,
                    checkpoint: dir.display().to_string(),
                });
                return Ok(Outcome::Stopped {
                    step: self.state.step,
                    checkpoint: dir,
                });
            }
            if let Some(every) = self.cfg.save_every {
                if self.state.step % every == 0 && !at_end {
                    let dir = self.save_checkpoint()?;
                    obs.event(&Event::Checkpoint {
                        step: self.state.step,
                        path: dir.display().to_string(),
                    });
                }
            }
        }
        if let Some(e) = self.evaluate()? {
            obs.event(&Event::Eval(e));
        }
        self.model
            .write_adapter_files(&self.out, &self.cfg.lora, &self.base_name)?;
        obs.event(&Event::Done {
            step: self.state.step,
            adapter: self.out.display().to_string(),
            loss: last_loss,
            elapsed_s: start.elapsed().as_secs_f64(),
        });
        Ok(Outcome::Done(self.out.clone()))
    }
}
