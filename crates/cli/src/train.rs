//! `hf2q train sft` and `hf2q train dpo`: LoRA fine-tuning from the command line, over
//! `hf2q-train` (one flag set; DPO adds --beta, --adapter, --ref-adapter).
//! Flags, the progress bar, NDJSON events (`--json`, one object per line on stdout; also
//! appended to `OUT/train_log.jsonl`), and the stop signal: Ctrl-C or SIGTERM saves a checkpoint
//! after the step in progress and exits cleanly; a second one exits at once.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use hf2q_models::adapter::LoraConfig;
use hf2q_train::data::Dataset;
use hf2q_train::optim::{AdamWConfig, ScheduleKind};
use hf2q_train::report::{Event, Observer};
use hf2q_train::trainer::{
    prepare, Checkpointing, Length, Objective, Outcome, TrainConfig, Trainer,
};

use crate::args::{self, DeviceChoice, KvTypeChoice, MatmulChoice};
use crate::progress::{Progress, Unit};

#[derive(clap::Subcommand, Debug)]
pub enum TrainCmd {
    /// Supervised fine-tuning with LoRA: learn the assistant turns of chat data.
    #[command(
        long_about = "Supervised fine-tuning with LoRA adapters. Reads JSON or JSONL records in \
OpenAI `messages`, ShareGPT `conversations`, Alpaca (`instruction`/`input`/`output`), \
`prompt`/`completion` or `text` form, renders chats with the model's chat template and learns only \
the assistant turns (--train-on-prompt for everything). The base model stays frozen in its stored \
form (a quantized GGUF stays quantized); the adapter written to -o is a PEFT adapter that `peft`, \
`hf2q run --adapter` and `hf2q chat --adapter` load. Checkpoints (adapter, optimizer state, data \
position) go to OUT/checkpoint-N every --save-every steps and when the run is stopped with Ctrl-C \
or SIGTERM; --resume OUT continues from the latest one and ends where an unbroken run ends.",
        after_help = crate::MODEL_FORMS,
        args_override_self = true
    )]
    Sft(SftArgs),
    /// Direct Preference Optimization with LoRA: prefer the chosen reply of each pair.
    #[command(
        long_about = "Direct Preference Optimization (TRL's sigmoid loss) with LoRA adapters. Reads preference pairs: `prompt`/`chosen`/`rejected` as strings or as message lists (TRL's shapes; `chosen`/`rejected` alone as whole conversations sharing their first turns), or LLaMA-Factory's `conversations` with `chosen`/`rejected` `{from, value}` objects. Each reply's log-probability is summed over its own tokens only; the reference policy is the same base with the adapter switched off (no second copy of the weights), or --ref-adapter DIR. --adapter DIR starts from a trained adapter (usually an SFT one; pass it as --ref-adapter too to keep it as the reference). The step's metrics use TRL's names (rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected). Checkpoints, --resume, validation and the output are as for `hf2q train sft`; a pair counts as one sample of --batch.",
        after_help = crate::MODEL_FORMS,
        args_override_self = true
    )]
    Dpo(DpoArgs),
}

#[derive(clap::Args, Debug)]
pub struct DpoArgs {
    #[command(flatten)]
    pub common: SftArgs,
    /// DPO's beta: how far the policy may move from the reference (higher: closer).
    #[arg(long, value_name = "B", default_value_t = 0.1)]
    pub beta: f32,
    /// Start from this PEFT adapter (its rank, alpha and targets replace the --lora-* flags).
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// The reference policy: the base with this adapter [default: the base alone].
    #[arg(long, value_name = "DIR")]
    pub ref_adapter: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct SftArgs {
    /// The base model [default: smollm2-135m].
    pub model: Option<String>,
    /// Training data: a .jsonl or .json file.
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// Validation data (evaluated every --eval-every steps and at the end).
    #[arg(long, value_name = "FILE", conflicts_with = "valid_split")]
    pub valid: Option<PathBuf>,
    /// Hold out this fraction of --data for validation instead (seeded).
    #[arg(long, value_name = "F", default_value_t = 0.0)]
    pub valid_split: f32,
    /// Output folder of the adapter (and its checkpoints).
    #[arg(short, long, value_name = "DIR")]
    pub output: PathBuf,
    /// LoRA rank.
    #[arg(long, value_name = "R", default_value_t = 16)]
    pub lora_r: usize,
    /// LoRA alpha (the update is scaled by alpha / r, or alpha / sqrt(r) with --rslora).
    #[arg(long, value_name = "A", default_value_t = 32.0)]
    pub lora_alpha: f32,
    /// Dropout on the adapters' input while training.
    #[arg(long, value_name = "P", default_value_t = 0.0)]
    pub lora_dropout: f32,
    /// Rank-stabilised LoRA: scale alpha / sqrt(r).
    #[arg(long)]
    pub rslora: bool,
    /// Products to adapt: `all` or a comma list of q_proj, k_proj, v_proj, o_proj, gate_proj,
    /// up_proj, down_proj.
    #[arg(long, value_name = "LIST", default_value = "all")]
    pub targets: String,
    /// Peak learning rate.
    #[arg(long, value_name = "LR", default_value_t = 2e-4)]
    pub lr: f32,
    /// Learning-rate decay after the warm-up.
    #[arg(long, value_name = "KIND", default_value = "cosine", value_parser = ["cosine", "linear", "constant"])]
    pub schedule: String,
    /// Warm-up steps [default: 3 % of the steps].
    #[arg(long, value_name = "N")]
    pub warmup_steps: Option<u64>,
    /// Epochs over the data.
    #[arg(long, value_name = "N", default_value_t = 1, conflicts_with = "steps")]
    pub epochs: u64,
    /// Optimizer steps instead of epochs.
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// Samples per micro-batch (bins of samples with --packing).
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub batch: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub grad_accum: usize,
    /// Tokens kept per sample (longer ones are cut; the report counts them).
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub max_seq_len: usize,
    /// Pack samples into bins of --max-seq-len tokens (no attention across samples).
    #[arg(long)]
    pub packing: bool,
    /// Learn the prompt tokens too, not only the assistant turns / completions.
    #[arg(long)]
    pub train_on_prompt: bool,
    /// Seed of the adapters' initialisation, the data order, the split and dropout.
    #[arg(long, value_name = "N", default_value_t = 42)]
    pub seed: u64,
    /// AdamW's decoupled weight decay.
    #[arg(long, value_name = "W", default_value_t = 0.0)]
    pub weight_decay: f32,
    /// Clip the gradients' global norm to this (0 = off).
    #[arg(long, value_name = "N", default_value_t = 1.0)]
    pub max_grad_norm: f32,
    /// Recompute blocks' forward in their backward (less memory, one more forward): on, off,
    /// a number N (the first N blocks; the others keep their activations), or auto (on on a
    /// GPU, off on the CPU).
    #[arg(long, value_name = "WHEN", default_value = "auto")]
    pub grad_checkpoint: String,
    /// Evaluate on the validation data every N steps.
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// Write a checkpoint every N steps.
    #[arg(long, value_name = "N")]
    pub save_every: Option<u64>,
    /// Continue from a checkpoint folder, or the latest checkpoint in an output folder.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Replace an adapter already in the output folder.
    #[arg(long)]
    pub overwrite: bool,
    /// Print one JSON object per event (plan, step, eval, checkpoint, done) on stdout.
    #[arg(long)]
    pub json: bool,
    #[arg(long, value_enum, value_name = "DEVICE", default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    #[command(flatten)]
    pub cuda: args::CudaOptArgs,
    /// CPU products of the frozen weights in the forward (the backward is f32 either way).
    #[arg(long, value_enum, value_name = "PATH", default_value_t = MatmulChoice::Fast)]
    pub matmul: MatmulChoice,
}

static STOP: AtomicBool = AtomicBool::new(false);

pub fn run(cmd: TrainCmd) -> Result<()> {
    match cmd {
        TrainCmd::Sft(a) => {
            let cfg = config(&a)?;
            train(&a, cfg)
        }
        TrainCmd::Dpo(a) => {
            if a.common.train_on_prompt {
                anyhow::bail!("--train-on-prompt does not apply to DPO (a reply's log-probability covers the reply only)");
            }
            let mut cfg = config(&a.common)?;
            cfg.objective = Objective::Dpo {
                beta: a.beta,
                ref_adapter: a.ref_adapter.clone(),
            };
            cfg.init_adapter = a.adapter.clone();
            cfg.validate()?;
            train(&a.common, cfg)
        }
    }
}

fn config(a: &SftArgs) -> Result<TrainConfig> {
    let lora = LoraConfig {
        r: a.lora_r,
        alpha: a.lora_alpha,
        rslora: a.rslora,
        dropout: a.lora_dropout,
        targets: LoraConfig::parse_targets(&a.targets)?,
        layers: None,
    };
    let cfg = TrainConfig {
        lora,
        lr: a.lr,
        schedule: ScheduleKind::from_name(&a.schedule).expect("clap checked"),
        warmup_steps: a.warmup_steps,
        warmup_ratio: 0.03,
        length: match a.steps {
            Some(n) => Length::Steps(n),
            None => Length::Epochs(a.epochs),
        },
        batch: a.batch,
        grad_accum: a.grad_accum,
        max_seq_len: a.max_seq_len,
        packing: a.packing,
        train_on_prompt: a.train_on_prompt,
        seed: a.seed,
        adam: AdamWConfig {
            weight_decay: a.weight_decay,
            ..AdamWConfig::default()
        },
        max_grad_norm: (a.max_grad_norm > 0.0).then_some(a.max_grad_norm),
        checkpointing: match a.grad_checkpoint.as_str() {
            "on" => Checkpointing::On,
            "off" => Checkpointing::Off,
            "auto" => Checkpointing::Auto,
            n => Checkpointing::Blocks(n.parse().map_err(|_| {
                anyhow::anyhow!(
                    "--grad-checkpoint takes on, off, auto or a number of blocks, not '{n}'"
                )
            })?),
        },
        eval_every: a.eval_every,
        save_every: a.save_every,
        valid_split: a.valid_split,
        ..TrainConfig::default()
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Runs SFT or DPO (`cfg.objective`) with the shared flags of `a`.
fn train(a: &SftArgs, cfg: TrainConfig) -> Result<()> {
    let load = match cfg.objective {
        Objective::Sft => Dataset::load,
        Objective::Dpo { .. } => Dataset::load_pairs,
    };
    let train = load(&a.data)?;
    let valid = a.valid.as_deref().map(load).transpose()?;
    let (_, mut model) = args::load_model(a.model.as_deref())?;
    model.set_matmul_path(a.matmul.path());
    model.set_cuda(args::open_device(a.device, &a.cuda, KvTypeChoice::F16)?)?;
    let data = prepare(&model, &train, valid.as_ref(), &cfg)?;
    let per = cfg.objective.group();
    eprintln!(
        "data: {} training {} ({}){}",
        train.records.len() / per,
        if per == 2 { "pairs" } else { "records" },
        train.shape.name(),
        valid
            .as_ref()
            .map(|v| format!(
                ", {} validation {}",
                v.records.len() / per,
                if per == 2 { "pairs" } else { "records" }
            ))
            .unwrap_or_default()
    );
    let mut trainer = Trainer::new(
        &mut model,
        cfg,
        data,
        &a.output,
        a.resume.as_deref(),
        a.overwrite,
    )?;
    ctrlc::set_handler(|| {
        if STOP.swap(true, Ordering::SeqCst) {
            eprintln!("\nstopping now");
            std::process::exit(130);
        }
        eprintln!("\nstopping after this step (a checkpoint will be saved); again to quit at once");
    })
    .context("installing the Ctrl-C handler")?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(a.output.join("train_log.jsonl"))
        .with_context(|| format!("opening {}", a.output.join("train_log.jsonl").display()))?;
    let mut obs = CliObserver {
        json: a.json,
        bar: None,
        log,
    };
    let outcome = trainer.run(&mut obs, &STOP);
    if let Some(b) = &obs.bar {
        if outcome.is_err() {
            b.abandon();
        }
    }
    match outcome? {
        Outcome::Done(dir) => {
            if !a.json {
                println!("{}", dir.display());
            }
            Ok(())
        }
        Outcome::Stopped { step, checkpoint } => {
            eprintln!(
                "stopped after step {step}; resume with --resume {}",
                checkpoint.display()
            );
            if !a.json {
                println!("{}", checkpoint.display());
            }
            Ok(())
        }
    }
}

/// Progress bar on stderr, NDJSON on stdout (`--json`) and in the output folder's log.
struct CliObserver {
    json: bool,
    bar: Option<Progress>,
    log: std::fs::File,
}

impl Observer for CliObserver {
    fn event(&mut self, e: &Event) {
        if let Ok(line) = serde_json::to_string(e) {
            if self.json {
                println!("{line}");
                let _ = std::io::stdout().flush();
            }
            let _ = writeln!(self.log, "{line}");
        }
        match e {
            Event::Plan(p) => {
                let t = &p.train;
                eprintln!(
                    "train: {} samples, {} tokens ({} learned), lengths {}..{} (median {}), {} cut to the maximum length",
                    t.samples, t.tokens, t.learned_tokens, t.min, t.max, t.median, t.truncated
                );
                for l in t.histogram_lines() {
                    eprintln!("  {l}");
                }
                if let Some(v) = &p.valid {
                    eprintln!("valid: {} samples, {} tokens", v.samples, v.tokens);
                }
                eprintln!(
                    "{} adapters, {} trainable parameters; {} steps on {}{}",
                    p.adapters,
                    p.trainable_parameters,
                    p.total_steps,
                    p.device,
                    match p.recomputed_blocks {
                        0 => String::new(),
                        n => format!(", gradient checkpointing of {n} blocks"),
                    }
                );
                let bar = Progress::new("train", p.total_steps, Unit::Items("steps"));
                bar.set(p.start_step, "");
                self.bar = Some(bar);
            }
            Event::Step(s) => {
                if let Some(b) = &self.bar {
                    let dpo = s
                        .dpo
                        .as_ref()
                        .map(|d| {
                            format!(
                                " margin {:.3} acc {:.2}",
                                d.rewards_margins, d.rewards_accuracies
                            )
                        })
                        .unwrap_or_default();
                    b.set(
                        s.step,
                        format!(
                            "loss {:.4}{dpo} lr {:.2e} {:.0} tok/s",
                            s.loss, s.lr, s.tokens_per_s
                        ),
                    );
                }
            }
            Event::Eval(v) => {
                let mut text = format!(
                    "eval at step {}: loss {:.4}, accuracy {:.3}",
                    v.step, v.loss, v.accuracy
                );
                if let Some(d) = &v.dpo {
                    text += &format!(
                        ", rewards/margins {:.4}, rewards/accuracies {:.3}, logps chosen {:.2} rejected {:.2}",
                        d.rewards_margins, d.rewards_accuracies, d.logps_chosen, d.logps_rejected
                    );
                }
                match &self.bar {
                    Some(b) => b.println(text),
                    None => eprintln!("{text}"),
                }
            }
            Event::Checkpoint { step, path } => {
                if let Some(b) = &self.bar {
                    b.println(format!("checkpoint at step {step}: {path}"));
                }
            }
            Event::Stopped { .. } => {
                if let Some(b) = &self.bar {
                    b.abandon();
                }
            }
            Event::Done {
                step,
                loss,
                adapter,
                ..
            } => {
                if let Some(b) = &self.bar {
                    b.finish(format!(
                        "{step} steps, last loss {}; adapter in {adapter}",
                        loss.map(|l| format!("{l:.4}"))
                            .unwrap_or_else(|| "-".into())
                    ));
                }
            }
        }
    }
}
