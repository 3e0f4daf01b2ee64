//! `hf2q convert IN OUT --to gguf|hf|mlx [--type T]`: between GGUF, Hugging Face safetensors and
//! MLX affine folders. Without --type, GGUF output keeps every tensor's type and HF output keeps
//! the source's float dtype (F16 for quantized sources); MLX output defaults to mlx4 (group 64).
//!
//! An adapter as IN (a PEFT folder, a llama.cpp LoRA GGUF, an mlx-lm adapter folder) converts
//! between those three: `--to gguf-lora`, `--to mlx`, `--to peft`, with `--base MODEL` for the
//! base's architecture, layer and head counts (`hf2q_models::adapter`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use hf2q_models::adapter;
use hf2q_models::convert::hf_out::{HfOptions, DEFAULT_SHARD_BYTES};
use hf2q_models::convert::mlx_out::MlxOptions;
use hf2q_models::convert::{convert, ConvertTarget};
use hf2q_models::quantize::presets::QuantTarget;
use hf2q_tensor::io::safetensors::StDtype;
use hf2q_tensor::quant::mlx::AffineParams;

use crate::quantize::{open_source, Bar};

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum To {
    Gguf,
    Hf,
    /// An MLX model folder, or for an adapter input mlx-lm's adapter folder.
    Mlx,
    /// llama.cpp's LoRA GGUF (adapter input only).
    GgufLora,
    /// A PEFT adapter folder (adapter input only).
    Peft,
}

impl To {
    /// The name `--to` takes.
    pub fn name(self) -> String {
        use clap::ValueEnum;
        self.to_possible_value()
            .map_or_else(|| format!("{self:?}"), |v| v.get_name().to_string())
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
}

#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// Input model: a .gguf file, a Hugging Face or MLX folder, or a built-in name; or an
    /// adapter: a PEFT folder, a llama.cpp LoRA .gguf, an mlx-lm adapter folder.
    pub input: String,
    /// Output: a .gguf file (--to gguf, --to gguf-lora) or a new folder (--to hf, mlx, peft).
    pub output: PathBuf,
    /// The base model of an adapter input (needed for --to gguf-lora and --to mlx, and to read
    /// a Llama GGUF LoRA, whose q/k factors are stored in llama.cpp's permuted row order).
    #[arg(long, value_name = "MODEL")]
    pub base: Option<String>,
    /// Output format.
    #[arg(long, value_enum)]
    pub to: To,
    /// Quantize while converting: any `hf2q quantize --type` value (GGUF presets for gguf,
    /// mlxB / mlxBgG for mlx).
    #[arg(short = 't', long = "type", value_name = "T")]
    pub ty: Option<String>,
    /// Float dtype of HF weights, or of MLX scales, biases and unquantized tensors.
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
    /// Largest safetensors shard of an HF output, in MB.
    #[arg(long, value_name = "MB")]
    pub shard_size: Option<usize>,
    /// MLX group size when --type does not name one.
    #[arg(long, value_name = "G")]
    pub group_size: Option<usize>,
    /// NDJSON on stdout: progress events, then one `{"event": "result", ...}` line.
    #[arg(long)]
    pub json: bool,
}

fn st(d: Option<Dtype>) -> Option<StDtype> {
    d.map(|d| match d {
        Dtype::F32 => StDtype::F32,
        Dtype::F16 => StDtype::F16,
        Dtype::Bf16 => StDtype::BF16,
    })
}

pub fn run(a: ConvertArgs) -> Result<()> {
    crate::progress::set_json(a.json);
    if adapter::is_adapter(Path::new(&a.input)) {
        return run_adapter(&a);
    }
    if matches!(a.to, To::GgufLora | To::Peft) {
        bail!("{}: --to {} converts an adapter, and this is not one (no adapter_config.json, not a GGUF with general.type = adapter)", a.input, a.to.name());
    }
    let parsed = match &a.ty {
        Some(t) => Some(QuantTarget::parse(t, a.group_size)?),
        None => None,
    };
    let target = match (a.to, parsed) {
        (To::Gguf, None) => ConvertTarget::Gguf(None),
        (To::Gguf, Some(QuantTarget::Gguf(r))) => ConvertTarget::Gguf(Some(r)),
        (To::Mlx, None) => ConvertTarget::Mlx(MlxOptions {
            params: AffineParams {
                bits: 4,
                group_size: a.group_size.unwrap_or(64),
            },
            overrides: Default::default(),
            dtype: st(a.dtype),
        }),
        (To::Mlx, Some(QuantTarget::Mlx(r))) => ConvertTarget::Mlx(MlxOptions {
            params: r.params,
            overrides: Default::default(),
            dtype: st(a.dtype),
        }),
        (To::Hf, None) => ConvertTarget::Hf(HfOptions {
            dtype: st(a.dtype),
            shard_bytes: a
                .shard_size
                .map_or(DEFAULT_SHARD_BYTES, |mb| mb.max(1) << 20),
        }),
        (To::Hf, Some(_)) => {
            bail!("--to hf writes float weights; --type does not apply (use --dtype)")
        }
        (to, Some(t)) => bail!("--type {t:?} does not fit --to {to:?}"),
        (to, None) => bail!("--to {to:?} converts an adapter"),
    };
    let src = open_source(&a.input)?;
    let bar = Bar::new(format!("convert to {:?}", a.to).to_lowercase());
    let t0 = Instant::now();
    let r = convert(&src, &a.output, &target, &bar)
        .with_context(|| format!("writing {}", a.output.display()))?;
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "wrote {} ({:.1} MB, {} tensors) in {:.1} s",
        a.output.display(),
        r.bytes_written as f64 / 1e6,
        r.tensors.len(),
        secs
    );
    crate::progress::json_line(serde_json::json!({
        "event": "result",
        "output": a.output.display().to_string(),
        "bytes": r.bytes_written,
        "tensors": r.tensors.len(),
        "bits_per_weight": r.bits_per_weight(),
        "seconds": secs,
    }));
    Ok(())
}

/// An adapter from one format to another.
fn run_adapter(a: &ConvertArgs) -> Result<()> {
    let input = Path::new(&a.input);
    if a.ty.is_some() || a.dtype.is_some() {
        bail!(
            "{}: an adapter is converted as it is (f32 factors): --type and --dtype do not apply",
            input.display()
        );
    }
    // The output is settled before any reading, so a bad --to is refused first.
    let to = match a.to {
        t @ (To::GgufLora | To::Mlx | To::Peft) => t,
        t => bail!(
            "{}: an adapter converts --to gguf-lora, mlx or peft, not {}",
            input.display(),
            t.name()
        ),
    };
    let base = match &a.base {
        Some(b) => Some(open_source(b)?),
        None => None,
    };
    let cfg = base.as_ref().map(|s| &s.config);
    let f = adapter::read_adapter(input, cfg)
        .with_context(|| format!("reading the adapter {}", input.display()))?;
    if let Some(c) = cfg {
        f.check_config(input, c)?;
    }
    let need_base = || {
        cfg.ok_or_else(|| {
            anyhow::anyhow!(
                "--to {} needs --base MODEL (the base's architecture, layer and head counts)",
                a.to.name()
            )
        })
    };
    match to {
        To::GgufLora => adapter::gguf_lora::write(&a.output, &f, need_base()?)?,
        To::Mlx => adapter::mlx::write(&a.output, &f, need_base()?)?,
        _ => {
            let name = f
                .base_model
                .clone()
                .or_else(|| a.base.clone())
                .unwrap_or_default();
            adapter::write_dir_atomically(&a.output, |tmp| {
                adapter::factors::write_peft_files(tmp, &f, &name)
            })?
        }
    }
    eprintln!(
        "wrote {} ({} modules, rank {}, from {:?})",
        a.output.display(),
        f.modules.len(),
        f.config.r,
        adapter::detect(input)
    );
    crate::progress::json_line(serde_json::json!({
        "event": "result",
        "output": a.output.display().to_string(),
        "to": a.to.name(),
        "modules": f.modules.len(),
        "r": f.config.r,
    }));
    Ok(())
}
