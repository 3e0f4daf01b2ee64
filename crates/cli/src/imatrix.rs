//! `hf2q imatrix MODEL --file TEXT -o imatrix.gguf`: an importance matrix as llama.cpp's
//! `llama-imatrix` computes it (chunks of --ctx tokens, Σx² of every matmul's input columns),
//! in llama.cpp's GGUF imatrix format, for `hf2q quantize --imatrix` or `llama-quantize`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use hf2q_models::quantize::collect::{collect_imatrix, ImatrixOptions};

use crate::args;

#[derive(clap::Args, Debug)]
pub struct ImatrixArgs {
    /// Model: built-in name or path (GGUF file, Hugging Face or MLX folder).
    pub model: String,
    /// Calibration text (plain text; special tokens in it are not parsed).
    #[arg(short = 'f', long, value_name = "TEXT")]
    pub file: PathBuf,
    /// Output file (llama.cpp's GGUF imatrix format).
    #[arg(short = 'o', long, value_name = "FILE", default_value = "imatrix.gguf")]
    pub output: PathBuf,
    /// Tokens per chunk (llama-imatrix's -c); each chunk starts from an empty cache, with BOS
    /// as its first token when the model adds one. At least 16; the text needs 2 x ctx tokens.
    #[arg(short = 'c', long, value_name = "N", default_value_t = 512)]
    pub ctx: usize,
    /// Process at most N chunks (default: all that fit in the text).
    #[arg(long, value_name = "N")]
    pub chunks: Option<usize>,
    /// Also collect output.weight (the logits matmul), as llama-imatrix --process-output. Off by
    /// default, as there; a model with tied embeddings has no output.weight to collect.
    #[arg(long)]
    pub process_output: bool,
    /// Matmul kernels the activations flow through (CPU). The default is the f32 reference
    /// path; `fast` is several times faster and within 1e-6 mean KL of it.
    #[arg(long, value_enum, value_name = "PATH", default_value_t = args::MatmulChoice::Reference)]
    pub matmul: args::MatmulChoice,
    /// NDJSON on stdout: progress lines, then the summary as the last line.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub kv: args::KvArgs,
}

pub fn run(a: ImatrixArgs) -> Result<()> {
    crate::progress::set_json(a.json);
    if a.output.is_dir() {
        bail!(
            "{} is a folder; -o names the output file",
            a.output.display()
        );
    }
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let (_, mut model) = args::load_model(Some(&a.model))?;
    model.set_matmul_path(a.matmul.path());
    a.kv.apply(&mut model)?;
    let opts = ImatrixOptions {
        ctx: a.ctx,
        max_chunks: a.chunks,
        process_output: a.process_output,
        dataset: a.file.display().to_string(),
    };
    let t0 = Instant::now();
    let bar = crate::progress::Progress::new("imatrix", 0, crate::progress::Unit::Items("chunks"));
    let (m, run) = collect_imatrix(&mut model, &text, &opts, &mut |i, n, ppl| {
        bar.set_total(n as u64);
        bar.set(i as u64, format!("PPL {ppl:.4}"));
    })?;
    bar.finish(format!("{} chunks", m.chunk_count));
    let secs = t0.elapsed().as_secs_f64();
    m.save(&a.output)
        .with_context(|| format!("writing {}", a.output.display()))?;
    if a.json {
        let mut v = serde_json::to_value(&run)?;
        v["output"] = serde_json::json!(a.output.display().to_string());
        v["chunk_count"] = serde_json::json!(m.chunk_count);
        v["seconds"] = serde_json::json!(secs);
        v["event"] = serde_json::json!("result");
        println!("{}", serde_json::to_string(&v)?);
        return Ok(());
    }
    eprintln!(
        "Final estimate: PPL = {:.4} +/- {:.5}",
        run.ppl, run.ppl_err
    );
    eprintln!(
        "wrote {} ({} weights, {} chunks of {} tokens of {} in the text) in {:.1} s",
        a.output.display(),
        run.n_entries,
        m.chunk_count,
        run.ctx,
        run.n_tokens,
        secs
    );
    Ok(())
}
