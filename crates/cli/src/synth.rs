//! `hf2q synth --shape S --type T --vocab-from TOK OUT.gguf`: a random-weight model at a real
//! model's shape (architecture metadata, tensor names, sizes and per-tensor types as the real
//! file would have them) with a real tokenizer, for speed and memory tests without the weights.
//! The generator is `hf2q_models::synth`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use hf2q_models::quantize::presets::{GgufRecipe, Preset};
use hf2q_models::synth::{self, SynthOptions, SynthShape};

use crate::quantize::Bar;

#[derive(clap::Args, Debug)]
pub struct SynthArgs {
    /// Model shape: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen3-8b, smollm2-135m, and the
    /// mixtures of experts qwen3-30b-a3b, mixtral-8x7b and gpt-oss-20b (the real models' dimensions,
    /// vocabulary size, RoPE settings and experts, stacked as llama.cpp stores them), or tiny /
    /// tiny-qwen3 / tiny-qwen3-moe / tiny-mixtral / tiny-gpt-oss (2-layer models of width 256 for tests, whose
    /// vocabulary is the tokenizer's).
    #[arg(long, value_name = "NAME")]
    pub shape: String,
    /// Tensor types: a llama.cpp preset (q4_0, q4_k_m, q8_0, bf16, f16, or any other that
    /// `hf2q quantize` knows), with llama.cpp's per-tensor rules as for the real model.
    #[arg(short = 't', long = "type", value_name = "T")]
    pub ty: String,
    /// Tokenizer to copy: a GGUF file (its tokenizer.* metadata) or a Hugging Face folder with
    /// tokenizer.json (+ tokenizer_config.json). Padded to the shape's vocabulary with unused
    /// `[PAD<i>]` tokens, as llama.cpp's converter pads.
    #[arg(long, value_name = "FILE|DIR")]
    pub vocab_from: PathBuf,
    /// Seed of the random weights: the same seed gives the same file.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
    /// Use N layers instead of the shape's (a smaller model of the same width).
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// Output GGUF file (written under a temporary name, renamed when complete).
    pub output: PathBuf,
}

pub fn run(a: SynthArgs) -> Result<()> {
    let mut shape = SynthShape::by_name(&a.shape).with_context(|| {
        format!(
            "unknown --shape '{}': expected one of {}",
            a.shape,
            SynthShape::names().join(", ")
        )
    })?;
    if let Some(n) = a.layers {
        if n == 0 {
            bail!("--layers must be at least 1");
        }
        shape.n_layers = n;
    }
    let preset = Preset::from_name(&a.ty).with_context(|| {
        format!(
            "unknown --type '{}': expected a llama.cpp preset ({})",
            a.ty,
            Preset::all()
                .map(Preset::name)
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    if a.output.is_dir() {
        bail!(
            "{}: is a folder; OUT must be a .gguf file path",
            a.output.display()
        );
    }
    if !a.vocab_from.exists() {
        bail!(
            "--vocab-from {}: no such file or folder",
            a.vocab_from.display()
        );
    }
    let (tokenizer, n_tokens) = synth::tokenizer_metadata(&a.vocab_from)
        .with_context(|| format!("reading the tokenizer of {}", a.vocab_from.display()))?;
    if let Some(v) = shape.vocab_size {
        if n_tokens > v {
            bail!(
                "{} has {n_tokens} tokens, more than the {v} of shape {}",
                a.vocab_from.display(),
                shape.name
            );
        }
    }
    eprintln!(
        "synth: {} ({} layers) {} with the tokenizer of {} ({n_tokens} tokens), seed {}",
        shape.name,
        shape.n_layers,
        preset.name(),
        a.vocab_from.display(),
        a.seed
    );
    let opts = SynthOptions {
        shape,
        recipe: GgufRecipe {
            preset,
            pure: false,
        },
        seed: a.seed,
        tokenizer,
    };
    let t0 = Instant::now();
    let bar = Bar::new("synth");
    let r = synth::synthesize(&opts, &a.output, &bar)
        .with_context(|| format!("writing {}", a.output.display()))?;
    for (name, want, got) in &r.fallbacks {
        eprintln!("note: {name}: rows not whole {want} blocks, {got} instead (as llama.cpp)");
    }
    let secs = t0.elapsed().as_secs_f64();
    let types: Vec<String> = r
        .types
        .iter()
        .map(|(t, n, _)| format!("{t} x{n}"))
        .collect();
    eprintln!(
        "wrote {}: {} tensors, {:.1}M parameters, vocabulary {} ({} from the tokenizer), \
         {}, {:.2} bits per weight, in {secs:.1} s ({:.2} GB/s); types: {}",
        a.output.display(),
        r.tensors,
        r.parameters as f64 / 1e6,
        r.vocab_size,
        r.tokenizer_tokens,
        human_bytes(r.bytes_written),
        r.bits_per_weight(),
        r.bytes_written as f64 / 1e9 / secs.max(1e-9),
        types.join(", ")
    );
    println!("{}", a.output.display());
    Ok(())
}

fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n => format!("{:.1} KiB", n as f64 / 1024.0),
    }
}
