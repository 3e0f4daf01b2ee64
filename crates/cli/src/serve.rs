//! `hf2q serve`: loads a model and serves the OpenAI-compatible API and the web chat
//! (`hf2q-server`). This file is flags -> `ServerConfig`; everything else is in the server crate.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use hf2q_server::{EngineConfig, ServerConfig};

use crate::args;

/// Per-sequence context when the model allows more (as `run` and `chat`).
const DEFAULT_CTX: usize = 4096;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Model: built-in name or path [default: smollm2-135m].
    pub model: Option<String>,
    /// Address to listen on. The default accepts connections from this machine only; use
    /// 0.0.0.0 to expose the server (then set --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on the API (not on /health or the web chat page).
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Allow browser pages from ORIGIN (e.g. http://localhost:3000) to call the API; `*` allows
    /// any. Repeat for several. Default: no cross-origin access.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origins: Vec<String>,
    /// Name of the model in /v1/models and in responses [default: the model argument's name].
    #[arg(long, value_name = "NAME")]
    pub model_name: Option<String>,
    /// Most tokens (prompt + reply) per request [default: the model's, at most 4096].
    #[arg(short = 'c', long, value_name = "N")]
    pub ctx_size: Option<usize>,
    /// Memory for the KV caches of all running requests (e.g. 512M, 4G). A request reserves
    /// its prompt + max_tokens when it starts; requests wait in the queue while it is full.
    #[arg(long, value_name = "SIZE", default_value = "4G")]
    pub kv_mem: String,
    /// Most requests generated together in one batch (vLLM's --max-num-seqs). Requests are
    /// admitted first come, first served; a request's `priority` field is ignored.
    #[arg(
        long,
        visible_alias = "max-num-seqs",
        value_name = "N",
        default_value_t = 32
    )]
    pub max_seqs: usize,
    /// Most requests waiting for a slot; more get HTTP 429.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_queue: usize,
    /// Most tokens per forward step: running streams get one each, long prompts are fed in
    /// chunks of what is left, so they do not stall the streams for long (on the CPU a step of
    /// 256 tokens takes about as long as 256 / the prefill rate). vLLM's
    /// --max-num-batched-tokens.
    #[arg(
        long,
        visible_alias = "max-num-batched-tokens",
        value_name = "N",
        default_value_t = 256
    )]
    pub max_batch_tokens: usize,
    /// Largest request body (e.g. 4M).
    #[arg(long, value_name = "SIZE", default_value = "4M")]
    pub max_body: String,
    /// Seconds a request may take, queue included (0 = no limit). Queued requests then fail
    /// with 503; running ones end with finish_reason "length".
    #[arg(long, value_name = "SECS", default_value_t = 600.0)]
    pub request_timeout: f64,
    /// On SIGTERM or Ctrl-C, seconds to let running requests finish before aborting them.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub drain_timeout: f64,
    /// /health answers 503 when the engine has work but has not finished a step for SECS.
    #[arg(long, value_name = "SECS", default_value_t = 60.0)]
    pub stuck_after: f64,
    /// Do not keep finished requests' KV caches for reuse. By default a request whose prompt
    /// starts with tokens already computed (a chat's earlier turns, a shared system prompt)
    /// copies their keys and values instead of prefilling them; kept caches use --kv-mem that no
    /// request needs and are evicted when one does. Without --kv-paged, CPU only (a GPU keeps
    /// nothing); with --kv-paged, on every device: full blocks of 16 positions stay cached after
    /// their request and are shared by the requests that start with the same tokens.
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Keep every running request's keys and values in one paged KV cache (blocks of 16
    /// positions from the --kv-mem budget) and run each step's attention once over all
    /// requests instead of once per request: several times the throughput with many clients on
    /// a GPU. A request takes blocks as it grows (its prompt's at admission); when the pool runs
    /// out the latest admitted one is preempted and recomputed later, its stream unbroken. Off
    /// by default for now.
    #[arg(long)]
    pub kv_paged: bool,
    /// Matmul kernels for quantized weights (CPU).
    #[arg(long, value_enum, value_name = "PATH", default_value_t = args::MatmulChoice::Fast)]
    pub matmul: args::MatmulChoice,
    /// Where to run: `auto` uses the first NVIDIA GPU when there is one, else the CPU.
    #[arg(long, value_enum, value_name = "DEVICE", default_value_t = args::DeviceChoice::Auto)]
    pub device: args::DeviceChoice,
    #[command(flatten)]
    pub cuda: args::CudaOptArgs,
    #[command(flatten)]
    pub kv: args::KvArgs,
    /// Serve a LoRA adapter (a PEFT folder) beside the base as NAME: requests pick it with
    /// `"model": "BASE:NAME"` (or `NAME`), and sequences of different adapters share one batch.
    /// Repeat for several. CPU and GPU (`--device cuda`: the adapters' terms are device
    /// products over their rows; such steps are never replayed as graphs).
    #[arg(long = "adapter", value_name = "NAME=DIR")]
    pub adapters: Vec<String>,
    /// Allow `POST /v1/adapters` to load adapter folders under DIR while the server runs
    /// (`DELETE /v1/adapters/NAME` unloads). Repeat for several. Default: run-time loading off.
    #[arg(long = "adapter-root", value_name = "DIR")]
    pub adapter_roots: Vec<std::path::PathBuf>,
    #[command(flatten)]
    pub agent: args::AgentArgs,
    #[command(flatten)]
    pub lab: LabArgs,
}

/// The Lab's jobs (`/api/jobs`, `/api/models`), kept in `$HF2Q_HOME/lab`.
#[derive(clap::Args, Debug)]
pub struct LabArgs {
    /// Serve no Lab API (`/api/jobs`, `/api/models`).
    #[arg(long)]
    pub no_lab: bool,
    /// Lab CPU jobs (quantize, convert, imatrix, perplexity, pull) running at once; more wait in
    /// the queue. GPU jobs (training) run one at a time.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub lab_jobs: usize,
    /// Seconds a cancelled job has between SIGTERM and SIGKILL (training saves a checkpoint).
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub lab_grace: f64,
}

impl LabArgs {
    /// Opens the Lab of `$HF2Q_HOME`; `None` when off, or (with a warning) when another server
    /// already runs it.
    fn open(&self) -> Result<Option<hf2q_lab::Lab>> {
        if self.no_lab {
            return Ok(None);
        }
        if self.lab_jobs == 0 {
            bail!("--lab-jobs must be at least 1");
        }
        let cfg = hf2q_lab::LabConfig {
            home: crate::pull::home()?,
            bin: std::env::current_exe().context("finding the hf2q binary for the Lab's jobs")?,
            cpu_jobs: self.lab_jobs,
            grace: secs("lab-grace", self.lab_grace)?,
            builtin_models: crate::pull::KNOWN
                .iter()
                .map(|k| k.name.to_string())
                .collect(),
        };
        match hf2q_lab::Lab::open(cfg) {
            Ok(l) => Ok(Some(l)),
            Err(e @ hf2q_lab::Error::Conflict(_)) => {
                eprintln!("warning: {e}; serving without the Lab API");
                Ok(None)
            }
            Err(e) => Err(e).context("opening the Lab"),
        }
    }
}

/// `NAME=DIR` -> (name, folder).
fn parse_adapter(s: &str) -> Result<(String, std::path::PathBuf)> {
    match s.split_once('=') {
        Some((name, dir)) if !name.is_empty() && !dir.is_empty() => Ok((name.into(), dir.into())),
        _ => bail!("--adapter '{s}': expected NAME=DIR (e.g. --adapter sql=./sql-lora)"),
    }
}

/// `512M`, `4G`, `1.5GiB`, `1000000` (bytes) -> bytes.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .with_context(|| format!("'{s}' is not a size (examples: 512M, 4G)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => bail!("'{s}': unknown size unit '{u}' (use K, M, G or T)"),
    };
    let bytes = n * mult as f64;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        bail!("'{s}' is not a usable size");
    }
    Ok(bytes as u64)
}

fn secs(name: &str, v: f64) -> Result<Duration> {
    if !(0.0..=1e7).contains(&v) {
        bail!("--{name} must be a number of seconds >= 0");
    }
    Ok(Duration::from_secs_f64(v))
}

/// The name a model argument is served under: a built-in name as is, a path by its file stem.
fn default_model_name(arg: &str) -> String {
    let p = Path::new(arg);
    if !p.exists() {
        return arg.to_string();
    }
    let stem = p
        .file_stem()
        .or_else(|| p.file_name())
        .map(|s| s.to_string_lossy().to_string());
    stem.filter(|s| !s.is_empty())
        .unwrap_or_else(|| "model".into())
}

pub fn serve(a: ServeArgs) -> Result<()> {
    // Check the flags before loading (or pulling) the model.
    let kv_mem = parse_size(&a.kv_mem).context("--kv-mem")?;
    let max_body = parse_size(&a.max_body).context("--max-body")?;
    let request_timeout = secs("request-timeout", a.request_timeout)?;
    let drain_timeout = secs("drain-timeout", a.drain_timeout)?;
    let stuck_after = secs("stuck-after", a.stuck_after)?;
    if a.ctx_size == Some(0) {
        bail!("--ctx-size must be at least 1");
    }
    let arg = a
        .model
        .clone()
        .unwrap_or_else(|| crate::pull::DEFAULT_MODEL.to_string());
    let mut cfg = ServerConfig {
        host: a.host,
        port: a.port,
        model_id: a.model_name.unwrap_or_else(|| default_model_name(&arg)),
        api_key: a.api_key,
        cors_origins: a.cors_origins,
        max_body_bytes: usize::try_from(max_body).unwrap_or(usize::MAX),
        request_timeout,
        drain_timeout,
        stuck_after,
        engine: EngineConfig {
            ctx_size: DEFAULT_CTX,
            kv_mem_bytes: kv_mem,
            max_seqs: a.max_seqs,
            max_queue: a.max_queue,
            max_batch_tokens: a.max_batch_tokens,
            step_delay: Duration::ZERO,
            prefix_cache: !a.no_prefix_cache,
            paged_kv: a.kv_paged,
        },
        agent: a.agent.config()?,
        lab: None,
        adapters: a
            .adapters
            .iter()
            .map(|s| parse_adapter(s))
            .collect::<Result<_>>()?,
        adapter_roots: a
            .adapter_roots
            .iter()
            .map(|d| {
                d.canonicalize()
                    .with_context(|| format!("--adapter-root {}", d.display()))
            })
            .collect::<Result<_>>()?,
    };
    cfg.validate()?;
    let (path, mut model) = args::load_model(Some(&arg))?;
    model.set_matmul_path(a.matmul.path());
    let kv = a.kv.apply(&mut model)?;
    model.set_cuda(args::open_device(a.device, &a.cuda, kv)?)?;
    model.warm_up()?;
    let trained = model.context_length();
    cfg.engine.ctx_size = match a.ctx_size {
        Some(n) => {
            if trained > 0 && n > trained {
                eprintln!("warning: --ctx-size {n} is larger than the {trained} tokens the model was trained for");
            }
            n
        }
        None if trained == 0 => DEFAULT_CTX,
        None => trained.min(DEFAULT_CTX),
    };
    cfg.validate()?;
    if cfg.host != "127.0.0.1"
        && cfg.host != "localhost"
        && cfg.host != "::1"
        && cfg.api_key.is_none()
    {
        eprintln!(
            "warning: listening on {} without --api-key: anyone who can reach it can use it",
            cfg.host
        );
    }
    eprintln!(
        "serving {} as '{}': context {} tokens, KV memory {} MiB, up to {} sequences per batch, prefix cache {}{}",
        path.display(),
        cfg.model_id,
        cfg.engine.ctx_size,
        kv_mem >> 20,
        cfg.engine.max_seqs,
        if cfg.engine.prefix_cache { "on" } else { "off" },
        if cfg.engine.paged_kv { ", paged KV cache" } else { "" }
    );
    for (name, dir) in &cfg.adapters {
        eprintln!("adapter '{}:{name}': {}", cfg.model_id, dir.display());
    }
    if let Some(ag) = &cfg.agent {
        eprintln!(
            "agent mode on: workspace {} (changes and commands wait for approval in the web chat)",
            ag.workspace.root().display()
        );
    }
    cfg.lab = a.lab.open()?;
    if let Some(l) = &cfg.lab {
        eprintln!("Lab: jobs in {}", l.home().root().join("lab").display());
        // What the Lab trains can be tried in the chat: its adapters folder is a run-time
        // adapter root (after any --adapter-root, so relative paths keep meaning those).
        let dir = l.home().root().join("adapters");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let dir = dir.canonicalize()?;
        if !cfg.adapter_roots.contains(&dir) {
            cfg.adapter_roots.push(dir);
        }
    }
    if let Some(root) = cfg.adapter_roots.first() {
        eprintln!(
            "run-time adapters on: POST /v1/adapters loads folders under {}{}",
            root.display(),
            if cfg.adapter_roots.len() > 1 {
                " (and the other --adapter-root folders)"
            } else {
                ""
            }
        );
    }
    hf2q_server::run(model, cfg)?;
    eprintln!("stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("4G").unwrap(), 4 << 30);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert!(parse_size("").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("0").is_err());
    }

    #[test]
    fn model_names() {
        assert_eq!(default_model_name("smollm2-135m"), "smollm2-135m");
    }

    #[test]
    fn adapter_flags() {
        let (n, d) = parse_adapter("sql=./a=b").unwrap();
        assert_eq!((n.as_str(), d), ("sql", std::path::PathBuf::from("./a=b")));
        assert!(parse_adapter("sql").is_err());
        assert!(parse_adapter("=dir").is_err());
        assert!(parse_adapter("sql=").is_err());
    }
}
