//! `hf2q perplexity MODEL --file TEXT`: perplexity as llama-perplexity computes it
//! (non-overlapping chunks of --ctx tokens, the second half of each scored), and with
//! --kl-base BASE the mean KL divergence from the base model and the same-top-token rate.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use hf2q_models::perplexity::{perplexity, PerplexityOptions};

use crate::args;

#[derive(clap::Args, Debug)]
pub struct PerplexityArgs {
    /// Model: built-in name or path.
    pub model: String,
    /// Text file to score.
    #[arg(short = 'f', long, value_name = "TEXT")]
    pub file: PathBuf,
    /// Tokens per chunk (llama-perplexity's -c).
    #[arg(short = 'c', long, value_name = "N", default_value_t = 512)]
    pub ctx: usize,
    /// Score at most N chunks (default: all that fit in the text).
    #[arg(long, value_name = "N")]
    pub chunks: Option<usize>,
    /// Also compute KL divergence and top-token agreement against this base model.
    #[arg(long, value_name = "MODEL")]
    pub kl_base: Option<String>,
    /// NDJSON on stdout: progress lines, then the result as the last line.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub kv: args::KvArgs,
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    crate::progress::set_json(a.json);
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let (_, mut model) = args::load_model(Some(&a.model))?;
    a.kv.apply(&mut model)?;
    let base = match &a.kl_base {
        Some(b) => {
            let mut m = args::load_model(Some(b))?.1;
            a.kv.apply(&mut m)?;
            Some(m)
        }
        None => None,
    };
    let t0 = Instant::now();
    let opts = PerplexityOptions {
        ctx: a.ctx,
        max_chunks: a.chunks,
    };
    let bar =
        crate::progress::Progress::new("perplexity", 0, crate::progress::Unit::Items("chunks"));
    let r = perplexity(&model, base.as_ref(), &text, &opts, &mut |i, n, p| {
        bar.set_total(n as u64);
        bar.set(i as u64, format!("PPL {p:.4}"));
    })?;
    bar.finish(format!("PPL {:.4}", r.ppl));
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        let mut v = serde_json::to_value(&r)?;
        v["seconds"] = serde_json::json!(secs);
        v["event"] = serde_json::json!("result");
        println!("{}", serde_json::to_string(&v)?);
        return Ok(());
    }
    println!("Final estimate: PPL = {:.4} +/- {:.5}", r.ppl, r.ppl_err);
    println!(
        "{} chunks of {} tokens ({} tokens scored of {}) in {:.1} s",
        r.n_chunks, r.ctx, r.n_scored, r.n_tokens, secs
    );
    if let Some(k) = &r.kl {
        println!("base PPL          {:.4}", k.base_ppl);
        println!(
            "Mean KLD          {:.6} +/- {:.6}",
            k.mean_kl, k.mean_kl_err
        );
        println!("Maximum KLD       {:.6}", k.max_kl);
        println!("Same top p        {:.3} %", k.same_top_pct);
    }
    Ok(())
}
