//! `hf2q fuse MODEL ADAPTER OUT [--to gguf|hf|mlx] [--type T] [--eval TEXT]`: the base with the
//! adapter merged into its weights (`hf2q_models::adapter::fuse`), written by the converters.
//! Without --to, the base's own format; without --type, the base's own types (GGUF tensors keep
//! their ggml type, re-quantized after the sum; HF keeps its float dtype; MLX its affine recipe).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use hf2q_models::adapter::fuse::fuse_into;
use hf2q_models::adapter::read_adapter;
use hf2q_models::convert::hf_out::{HfOptions, DEFAULT_SHARD_BYTES};
use hf2q_models::convert::mlx_out::MlxOptions;
use hf2q_models::convert::source::Stored;
use hf2q_models::convert::{convert, ConvertTarget};
use hf2q_models::quantize::presets::QuantTarget;
use hf2q_models::quantize::QuantizeReport;
use hf2q_models::source::Format;
use hf2q_tensor::io::safetensors::StDtype;
use hf2q_tensor::quant::mlx::AffineParams;

use crate::convert::To;
use crate::quantize::{json_result, open_source, print_summary, report_card, Bar};

#[derive(clap::Args, Debug)]
pub struct FuseArgs {
    /// The base model: a .gguf file, a Hugging Face or MLX folder, or a built-in name.
    pub model: String,
    /// The adapter: a PEFT folder, a llama.cpp LoRA .gguf or an mlx-lm adapter folder.
    pub adapter: PathBuf,
    /// Output: a .gguf file (--to gguf) or a new folder (--to hf, --to mlx).
    pub output: PathBuf,
    /// Output format [default: the base's].
    #[arg(long, value_enum)]
    pub to: Option<To>,
    /// Output type: for gguf any `hf2q quantize --type` value (F32, F16, BF16, Q8_0, Q4_K_M, ...;
    /// default: each tensor's own type); for hf F32, F16 or BF16 (default: the base's float
    /// dtype, F16 for a quantized base); for mlx mlxB / mlxBgG (default: the base's recipe, mlx4
    /// for a non-MLX base).
    #[arg(short = 't', long = "type", value_name = "T")]
    pub ty: Option<String>,
    /// After writing, measure perplexity and KL of the fused model against the unfused base +
    /// adapter on this text and print the quantizer's report card.
    #[arg(long, value_name = "TEXT")]
    pub eval: Option<PathBuf>,
    /// Tokens per evaluation chunk.
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub eval_ctx: usize,
    /// Evaluate at most N chunks.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub eval_chunks: usize,
    /// NDJSON on stdout: progress events, then one `{"event": "result", ...}` line (with the
    /// report card under `card` when --eval is given).
    #[arg(long)]
    pub json: bool,
}

fn float_dtype(t: &str) -> Result<StDtype> {
    Ok(match t.to_ascii_uppercase().as_str() {
        "F32" => StDtype::F32,
        "F16" => StDtype::F16,
        "BF16" => StDtype::BF16,
        _ => bail!("--to hf writes float weights: --type must be F32, F16 or BF16, not {t}"),
    })
}

pub fn run(a: FuseArgs) -> Result<()> {
    crate::progress::set_json(a.json);
    let mut src = open_source(&a.model)?;
    // The output is settled first, so that a bad --to or --type is refused before any work.
    let to = a.to.unwrap_or(match src.format() {
        Format::Gguf => To::Gguf,
        Format::Mlx => To::Mlx,
        Format::Safetensors => To::Hf,
    });
    let base_affine = src.tensors.iter().find_map(|t| match t.stored {
        Stored::Affine(p) => Some(p),
        _ => None,
    });
    let target = match (to, &a.ty) {
        (To::Gguf, None) => ConvertTarget::Gguf(None),
        (To::Gguf, Some(t)) => match QuantTarget::parse(t, None)? {
            QuantTarget::Gguf(r) => ConvertTarget::Gguf(Some(r)),
            _ => bail!("--type {t} is not a GGUF type"),
        },
        (To::Hf, t) => ConvertTarget::Hf(HfOptions {
            dtype: t.as_deref().map(float_dtype).transpose()?,
            shard_bytes: DEFAULT_SHARD_BYTES,
        }),
        (To::Mlx, t) => {
            let params = match t {
                Some(t) => match QuantTarget::parse(t, None)? {
                    QuantTarget::Mlx(r) => r.params,
                    _ => bail!("--type {t} is not an MLX recipe (mlxB or mlxBgG)"),
                },
                None => base_affine.unwrap_or(AffineParams {
                    bits: 4,
                    group_size: 64,
                }),
            };
            ConvertTarget::Mlx(MlxOptions {
                params,
                overrides: Default::default(),
                dtype: None,
            })
        }
        (to, _) => bail!(
            "fuse writes a model: --to gguf, hf or mlx, not {}",
            to.name()
        ),
    };
    let f = read_adapter(&a.adapter, Some(&src.config))
        .with_context(|| format!("reading the adapter {}", a.adapter.display()))?;
    let n = fuse_into(&mut src, &f, &a.adapter)
        .with_context(|| format!("fusing {}", a.adapter.display()))?;
    eprintln!(
        "fusing {} ({n} modules, rank {}) into {}",
        a.adapter.display(),
        f.config.r,
        src.path.display()
    );
    let bar = Bar::new("fuse");
    let t0 = Instant::now();
    let written = convert(&src, &a.output, &target, &bar)
        .with_context(|| format!("writing {}", a.output.display()))?;
    let q = QuantizeReport {
        written,
        ..Default::default()
    };
    let secs = t0.elapsed().as_secs_f64();
    print_summary(&q, &a.output, secs);
    let card = match &a.eval {
        Some(text) => Some(report_card(
            &src.path,
            Some(&a.adapter),
            &a.output,
            text,
            a.eval_ctx,
            a.eval_chunks,
            &q,
        )?),
        None => None,
    };
    json_result(&q, &a.output, secs, card.as_ref(), serde_json::json!({}));
    Ok(())
}
