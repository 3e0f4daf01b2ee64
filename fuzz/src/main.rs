//! `hf2q-fuzz`: the fuzz targets without AFL. `run` mutates a target's corpus in process for a
//! time budget (what CI does), `replay` runs given inputs once (to check a crash is fixed), `seeds`
//! rewrites the seed corpora from the fixtures. The AFL++ binary is `hf2q-fuzz-afl`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use hf2q_fuzz::mutate::{self, RunOptions};
use hf2q_fuzz::Target;

#[derive(Parser)]
#[command(
    name = "hf2q-fuzz",
    about = "Fuzz targets for hf2q's parsers, without AFL"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Mutate TARGET's corpus in process for SECONDS; panicking inputs are written to --findings.
    Run {
        /// One of: gguf, safetensors, tokenizer_json, gguf_tokenizer, chat_template, mlx,
        /// imatrix, openai_request, sse_json.
        target: String,
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Corpus folder (default: fuzz/corpus/TARGET).
        #[arg(long)]
        corpus: Option<PathBuf>,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value = "fuzz-findings")]
        findings: PathBuf,
        /// Seconds one input may run before it counts as a hang.
        #[arg(long, default_value_t = 20)]
        hang_seconds: u64,
    },
    /// Run each FILE through TARGET once (a panic is the crash reproduced).
    Replay { target: String, files: Vec<PathBuf> },
    /// Rewrite the seed corpora under OUT (default: fuzz/corpus).
    Seeds { out: Option<PathBuf> },
}

fn target(name: &str) -> Target {
    Target::from_name(name).unwrap_or_else(|| {
        eprintln!(
            "hf2q-fuzz: unknown target '{name}' (targets: {})",
            Target::names().join(", ")
        );
        std::process::exit(2)
    })
}

fn main() {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run {
            target: name,
            seconds,
            corpus,
            seed,
            findings,
            hang_seconds,
        } => {
            let t = target(&name);
            let dir = corpus.unwrap_or_else(|| hf2q_fuzz::corpus_dir(t));
            let inputs: Vec<Vec<u8>> = mutate::read_corpus(&dir)
                .into_iter()
                .map(|(_, b)| b)
                .collect();
            let opts = RunOptions {
                budget: Duration::from_secs(seconds),
                seed,
                findings_dir: findings,
                hang_limit: Duration::from_secs(hang_seconds),
                stop_at_first: false,
            };
            std::panic::set_hook(Box::new(|_| {}));
            let s = mutate::run(t, &inputs, &opts);
            let _ = std::panic::take_hook();
            println!(
                "{name}: {} executions in {:.1} s ({:.0}/s) from {} seeds; slowest input {:.1} ms; {} findings",
                s.executions,
                s.elapsed.as_secs_f64(),
                s.executions as f64 / s.elapsed.as_secs_f64().max(1e-9),
                inputs.len(),
                s.slowest.as_secs_f64() * 1e3,
                s.findings.len()
            );
            for f in &s.findings {
                println!("  finding: {}", f.display());
            }
            if !s.findings.is_empty() {
                std::process::exit(1);
            }
        }
        Cmd::Replay {
            target: name,
            files,
        } => {
            let t = target(&name);
            for f in files {
                let b = std::fs::read(&f).unwrap_or_else(|e| {
                    eprintln!("hf2q-fuzz: {}: {e}", f.display());
                    std::process::exit(2)
                });
                t.run(&b);
                println!("{}: ok", f.display());
            }
        }
        Cmd::Seeds { out } => {
            let out = out.unwrap_or_else(|| hf2q_fuzz::fuzz_dir().join("corpus"));
            match hf2q_fuzz::seeds::write_all(&out) {
                Ok(report) => {
                    for (t, n, bytes) in report {
                        println!("{:<16} {n:>2} seeds, {bytes:>7} bytes", t.name());
                    }
                }
                Err(e) => {
                    eprintln!("hf2q-fuzz seeds: {e}");
                    std::process::exit(1)
                }
            }
        }
    }
}
