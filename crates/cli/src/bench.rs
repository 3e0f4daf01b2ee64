//! `hf2q bench`: prompt-processing and generation speed, as llama-bench measures them.
//!
//! - `pp<P>`: P random tokens prefilled into an empty cache in one forward;
//! - `tg<N>`: N random tokens decoded one at a time, starting from an empty cache;
//! - either `@ d<D>` (`-d D`): after D random tokens already in the cache (prefilled untimed in
//!   chunks of [`DEPTH_CHUNK`] before each repetition), as llama-bench's `-d`.
//!
//! Each test runs once untimed (warm-up), then `-r` times; the rate of each repetition is
//! tokens / seconds, reported as mean ± sample standard deviation. Each thread count runs in its
//! own rayon pool of that many threads. Also reported: the process's peak resident memory, the
//! model's file size and the KV cache's bytes, so that "peak RSS <= file + KV cache + 64 MiB" can
//! be checked. Results go to stdout (a markdown table, or JSON lines with `--json`); progress to
//! stderr.
//!
//! The device is behind [`BenchBackend`] (prefill / decode / reset), so another device plugs in
//! without touching the measuring code.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use hf2q_cuda::DeviceCounters;
use hf2q_models::{Model, ModelInfo, Session};
use serde_json::json;

use crate::args::{DeviceChoice, MatmulChoice};
use crate::pull;

/// Slack allowed above file + KV cache in the peak-memory target.
const RSS_SLACK: u64 = 64 << 20;

/// Tokens per forward when filling the cache to a test's depth (llama-bench's default
/// micro-batch).
const DEPTH_CHUNK: usize = 512;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Models to measure, one after the other [default: smollm2-135m].
    #[arg(value_name = "MODEL")]
    pub models: Vec<String>,
    /// Prompt lengths for the pp tests (comma list or repeated; 0 = no pp test).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_name = "N,...",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub n_prompt: Vec<usize>,
    /// Token counts for the tg tests (comma list or repeated; 0 = no tg test).
    #[arg(
        short = 'n',
        long = "n-gen",
        value_name = "N,...",
        value_delimiter = ',',
        default_value = "128"
    )]
    pub n_gen: Vec<usize>,
    /// Context depths (comma list or repeated): every test also runs after N tokens already in
    /// the cache, prefilled untimed before each repetition (llama-bench's -d).
    #[arg(
        short = 'd',
        long = "n-depth",
        visible_alias = "depth",
        value_name = "N,...",
        value_delimiter = ',',
        default_value = "0"
    )]
    pub n_depth: Vec<usize>,
    /// Timed repetitions of each test (after one untimed warm-up).
    #[arg(
        short = 'r',
        long = "repetitions",
        value_name = "N",
        default_value_t = 5
    )]
    pub repetitions: usize,
    /// Thread counts (comma list or repeated): each test runs in a pool of that many threads
    /// [default: the number of CPUs available].
    #[arg(
        short = 't',
        long = "threads",
        value_name = "N,...",
        value_delimiter = ','
    )]
    pub threads: Vec<usize>,
    /// Print one JSON object per test per line instead of the table.
    #[arg(long)]
    pub json: bool,
    /// GPU: also report, per generated token, the kernels launched one by one, the graph
    /// replays, the nodes of the replayed graph and the host synchronisations (JSON fields
    /// `launches_per_token`, `graph_launches_per_token`, `graph_nodes`, `syncs_per_token`).
    #[arg(long)]
    pub stats: bool,
    /// Matmul kernels for quantized weights, as `hf2q run --matmul` [default: what `run` uses].
    #[arg(long, value_enum, value_name = "PATH", conflicts_with_all = ["fast", "reference"])]
    pub matmul: Option<MatmulChoice>,
    /// Short for --matmul fast (the SIMD kernels).
    #[arg(long, conflicts_with = "reference")]
    pub fast: bool,
    /// Short for --matmul reference (the scalar f32 reference path).
    #[arg(long)]
    pub reference: bool,
    /// Device to run on.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    #[command(flatten)]
    pub cuda: crate::args::CudaOptArgs,
    #[command(flatten)]
    pub kv: crate::args::KvArgs,
    /// Seed of the random token ids.
    #[arg(long, value_name = "N", default_value_t = 42)]
    pub seed: u64,
}

/// What one benchmark test measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Prompt(usize),
    Gen(usize),
}

/// One benchmark test: a kind at a context depth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Test {
    kind: Kind,
    /// Tokens in the cache before the timed part.
    depth: usize,
}

impl Test {
    /// `pp512`, `tg128 @ d8192` (llama-bench's names).
    fn name(self) -> String {
        let base = match self.kind {
            Kind::Prompt(n) => format!("pp{n}"),
            Kind::Gen(n) => format!("tg{n}"),
        };
        match self.depth {
            0 => base,
            d => format!("{base} @ d{d}"),
        }
    }
    /// Tokens of the timed part.
    fn tokens(self) -> usize {
        match self.kind {
            Kind::Prompt(n) | Kind::Gen(n) => n,
        }
    }
    fn is_gen(self) -> bool {
        matches!(self.kind, Kind::Gen(_))
    }
}

/// What a benchmark drives: one sequence on one device. A device backend implements this (and is
/// chosen in [`open_backend`]); the timing, statistics and reporting stay the same.
pub trait BenchBackend: Send {
    /// Feeds `ids` after the tokens already in the cache, in one forward.
    fn prefill(&mut self, ids: &[u32]) -> Result<()>;
    /// Feeds one token.
    fn decode(&mut self, id: u32) -> Result<()>;
    /// Empties the sequence (allocations may be kept).
    fn reset(&mut self);
    /// Bytes the KV cache holds now.
    fn kv_cache_bytes(&self) -> u64;
    /// "cpu", "cuda", ...
    fn device(&self) -> &'static str;
    /// GPU: the device's running totals of launches and synchronisations.
    fn counters(&self) -> Option<DeviceCounters>;
    /// GPU: nodes of the captured decode graph (after a decoded token).
    fn graph_nodes(&self) -> Option<usize>;
    /// GPU, after decoded tokens: how they ran, `graph` (one replayed CUDA graph per token)
    /// or `eager` (kernels launched one by one).
    fn decode_path(&self) -> Option<&'static str>;
}

/// A [`Session`] of the model, on whatever device the model runs on.
struct SessionBackend<'m> {
    session: Session<'m>,
    device: &'static str,
}

impl BenchBackend for SessionBackend<'_> {
    fn prefill(&mut self, ids: &[u32]) -> Result<()> {
        self.session.prefill(ids)?;
        Ok(())
    }
    fn decode(&mut self, id: u32) -> Result<()> {
        // As generation decodes greedily: on a GPU the argmax runs on the device and only the
        // token id comes back.
        self.session.decode_greedy(id)?;
        Ok(())
    }
    fn reset(&mut self) {
        self.session.reset();
    }
    fn kv_cache_bytes(&self) -> u64 {
        self.session.cache_bytes() as u64
    }
    fn device(&self) -> &'static str {
        self.device
    }
    fn counters(&self) -> Option<DeviceCounters> {
        self.session.model().cuda().map(|c| c.device().counters())
    }
    fn graph_nodes(&self) -> Option<usize> {
        self.session.graph_nodes()
    }
    fn decode_path(&self) -> Option<&'static str> {
        self.session.model().cuda()?;
        Some(if self.session.graph_nodes().is_some() {
            "graph"
        } else {
            "eager"
        })
    }
}

/// A backend for one sequence of at most `ctx` tokens of `model` (on the model's device).
fn open_backend<'m>(model: &'m Model, ctx: usize) -> Result<Box<dyn BenchBackend + 'm>> {
    Ok(Box::new(SessionBackend {
        session: model.session(ctx),
        device: if model.cuda().is_some() {
            "cuda"
        } else {
            "cpu"
        },
    }))
}

/// Device-to-device copy bandwidth measured on the H200 (read + write), the decode ceiling.
const H200_COPY_BYTES_PER_S: f64 = 4.24e12;

/// Timings of one test.
struct Measured {
    /// Tokens per second of each repetition.
    samples: Vec<f64>,
    samples_ns: Vec<u128>,
    kv_cache_bytes: u64,
    /// GPU: launches and synchronisations over the timed repetitions.
    counters: Option<DeviceCounters>,
    graph_nodes: Option<usize>,
    decode_path: Option<&'static str>,
}

/// Runs `test` on `b`: `context` fills the cache to the test's depth (untimed), `ids` are the
/// timed tokens. One warm-up, then `reps` timed repetitions.
fn run_test(
    b: &mut dyn BenchBackend,
    test: Test,
    context: &[u32],
    ids: &[u32],
    reps: usize,
) -> Result<Measured> {
    // One run: its time and the device's launches of its timed part.
    let once = |b: &mut dyn BenchBackend| -> Result<(std::time::Duration, Option<DeviceCounters>)> {
        b.reset();
        for chunk in context.chunks(DEPTH_CHUNK) {
            b.prefill(chunk)?;
        }
        let before = b.counters();
        let t0 = Instant::now();
        match test.kind {
            Kind::Prompt(_) => b.prefill(ids)?,
            Kind::Gen(_) => {
                for &id in ids {
                    b.decode(id)?;
                }
            }
        }
        let dt = t0.elapsed();
        Ok((dt, b.counters().zip(before).map(|(a, z)| a - z)))
    };
    once(b).context("warm-up run")?;
    let mut samples = Vec::with_capacity(reps);
    let mut samples_ns = Vec::with_capacity(reps);
    let mut counters: Option<DeviceCounters> = None;
    for _ in 0..reps {
        let (dt, c) = once(b)?;
        samples_ns.push(dt.as_nanos());
        samples.push(ids.len() as f64 / dt.as_secs_f64().max(1e-12));
        if let Some(c) = c {
            *counters.get_or_insert_with(DeviceCounters::default) += c;
        }
    }
    Ok(Measured {
        samples,
        samples_ns,
        kv_cache_bytes: b.kv_cache_bytes(),
        counters,
        graph_nodes: b.graph_nodes(),
        decode_path: b.decode_path(),
    })
}

/// Mean and sample standard deviation (0 for one sample).
fn mean_sd(x: &[f64]) -> (f64, f64) {
    let n = x.len();
    if n == 0 {
        return (0.0, 0.0);
    }
    let mean = x.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return (mean, 0.0);
    }
    let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, var.sqrt())
}

/// `n` token ids below `vocab`, from a seeded generator (splitmix64).
fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (((z >> 32) * vocab as u64) >> 32) as u32
        })
        .collect()
}

/// Starts a new peak-RSS measurement: Linux resets VmHWM to the current RSS when "5" is written
/// to /proc/self/clear_refs (since 4.0), so each model's peak is its own. Best effort.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Peak resident set size of this process (Linux: VmHWM), if the platform says.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
}

fn human_size(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        mib(b)
    }
}

fn human_params(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2} B", n as f64 / 1e9)
    } else {
        format!("{:.2} M", n as f64 / 1e6)
    }
}

/// "llama 134.52M Q4_1": architecture, parameters and the type holding most weights.
fn model_label(i: &ModelInfo) -> String {
    let ty = i
        .tensor_types
        .iter()
        .max_by_key(|(_, (_, elems))| *elems)
        .map(|(t, _)| t.as_str())
        .unwrap_or("?");
    format!(
        "{} {} {ty}",
        i.architecture,
        human_params(i.parameters).replace(' ', "")
    )
}

const HEADER: [(&str, usize, bool); 9] = [
    // (title, width, right-aligned)
    ("model", 30, false),
    ("size", 10, true),
    ("params", 10, true),
    ("backend", 7, false),
    ("path", 9, false),
    ("kv", 4, false),
    ("threads", 7, true),
    ("test", 14, true),
    ("t/s", 20, true),
];

fn table_row(cells: &[String]) -> String {
    let mut s = String::from("|");
    for (c, (_, w, right)) in cells.iter().zip(HEADER) {
        if right {
            s.push_str(&format!(" {c:>w$} |"));
        } else {
            s.push_str(&format!(" {c:<w$} |"));
        }
    }
    s
}

fn table_header() -> String {
    let titles: Vec<String> = HEADER.iter().map(|h| h.0.to_string()).collect();
    let mut s = table_row(&titles);
    s.push_str("\n|");
    for (_, w, right) in HEADER {
        if right {
            s.push_str(&format!(" {}: |", "-".repeat(w - 1)));
        } else {
            s.push_str(&format!(" {} |", "-".repeat(w)));
        }
    }
    s
}

pub fn run(a: BenchArgs) -> Result<()> {
    // Everything cheap is checked before a model is loaded.
    if a.repetitions == 0 {
        bail!("-r/--repetitions must be at least 1");
    }
    let threads = if a.threads.is_empty() {
        vec![std::thread::available_parallelism().map_or(1, |n| n.get())]
    } else {
        a.threads.clone()
    };
    if threads.contains(&0) {
        bail!("-t/--threads: every thread count must be at least 1");
    }
    let kinds: Vec<Kind> = a
        .n_prompt
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| Kind::Prompt(n))
        .chain(a.n_gen.iter().filter(|&&n| n > 0).map(|&n| Kind::Gen(n)))
        .collect();
    // Every kind at each depth, depth by depth (llama-bench's order).
    let tests: Vec<Test> = a
        .n_depth
        .iter()
        .flat_map(|&depth| kinds.iter().map(move |&kind| Test { kind, depth }))
        .collect();
    if tests.is_empty() {
        bail!("nothing to measure: every -p and -n value is 0");
    }
    // Without a choice, the path `run` uses by default.
    let path_choice = match (a.matmul, a.fast, a.reference) {
        (Some(m), _, _) => m,
        (None, true, _) => MatmulChoice::Fast,
        (None, _, true) => MatmulChoice::Reference,
        _ => MatmulChoice::default(),
    };
    let models: Vec<String> = if a.models.is_empty() {
        vec![pull::DEFAULT_MODEL.to_string()]
    } else {
        a.models.clone()
    };
    // Resolve every model argument first: a typo fails before minutes of measuring.
    let paths = models
        .iter()
        .map(|m| pull::resolve_model_arg(m))
        .collect::<Result<Vec<_>>>()?;

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if !a.json {
        writeln!(out, "{}", table_header())?;
        out.flush()?;
    }
    for path in &paths {
        bench_model(&a, path, path_choice, &threads, &tests, &mut out)?;
    }
    Ok(())
}

fn bench_model(
    a: &BenchArgs,
    path: &Path,
    matmul: MatmulChoice,
    threads: &[usize],
    tests: &[Test],
    out: &mut impl Write,
) -> Result<()> {
    eprintln!("bench: loading {}", path.display());
    reset_peak_rss();
    let mut model = Model::load(path).with_context(|| format!("loading {}", path.display()))?;
    let load_rss = peak_rss_bytes();
    model.set_matmul_path(matmul.path());
    let kv = a.kv.apply(&mut model)?;
    model.set_cuda(crate::args::open_device(a.device, &a.cuda, kv)?)?;
    let info = model.info();
    // Keys and values of one position, all layers (what a context of N tokens holds N times).
    let kv_per_token = model.kv_bytes_per_token();
    // Plus what a sequence's cache holds whatever its length (centred keys' first positions).
    let kv_fixed = model.kv_fixed_bytes();
    {
        let f16_per_token = model.kv_bytes_per_token_as(hf2q_models::kv_cache::KvType::F16);
        let fixed = if kv_fixed > 0 {
            format!(", plus {kv_fixed} bytes per sequence for the centred keys")
        } else {
            String::new()
        };
        eprintln!(
            "bench: KV cache {}: {kv_per_token} bytes per token ({:.1} % of f16's \
             {f16_per_token}){fixed}",
            model.kv_type_name(),
            100.0 * kv_per_token as f64 / f16_per_token.max(1) as f64
        );
    }
    let path_name = matmul
        .to_possible_value()
        .map_or_else(|| format!("{matmul:?}"), |v| v.get_name().to_string());
    let label = model_label(&info);
    let vocab = model.vocab_size();
    let limit = model.context_length();
    if let Some(t) = tests
        .iter()
        .find(|t| limit > 0 && t.depth + t.tokens() > limit)
    {
        bail!(
            "{} needs {} positions; {} holds at most {limit}",
            t.name(),
            t.depth + t.tokens(),
            path.display()
        );
    }
    // GPU: the options the device runs with (those changed from the defaults) and its prefill
    // product.
    let cuda_options = model.cuda().map(|c| c.device().options().changed());
    let prefill_gemm = model.cuda().map(|c| c.device().options().gemm.name());
    let mut kv_max = 0u64;
    for &t in threads {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build()
            .with_context(|| format!("starting a pool of {t} threads"))?;
        for (ti, &test) in tests.iter().enumerate() {
            eprintln!(
                "bench: {} {} threads={t}: 1 warm-up + {} runs",
                label,
                test.name(),
                a.repetitions
            );
            let seed = a.seed ^ (ti as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let ids = random_tokens(test.tokens(), vocab, seed);
            let context = random_tokens(test.depth, vocab, !seed);
            let mut backend = open_backend(&model, test.depth + test.tokens())?;
            let device = backend.device();
            let m = pool
                .install(|| run_test(backend.as_mut(), test, &context, &ids, a.repetitions))
                .with_context(|| format!("{} with {t} threads", test.name()))?;
            drop(backend);
            kv_max = kv_max.max(m.kv_cache_bytes);
            let (mean, sd) = mean_sd(&m.samples);
            let rss = peak_rss_bytes();
            // Decode on a GPU: the share of the bandwidth floor (every weight byte read once per
            // token at the measured copy bandwidth) that was reached.
            let floor_pct = (device == "cuda" && test.is_gen()).then(|| {
                // Bytes read per token: every weight once, the embedding as one row, k/E of a
                // mixture's experts (the file size where the file cannot be measured so).
                let bytes = hf2q_models::convert::source::decode_bytes(Path::new(&info.path))
                    .map_or(info.file_bytes, |b| b.per_token);
                100.0 * mean / (H200_COPY_BYTES_PER_S / bytes as f64)
            });
            if let Some(p) = floor_pct {
                eprintln!("bench: {} = {p:.1}% of the bandwidth floor", test.name());
            }
            // Per token (tg) or per prompt (pp), over the timed repetitions.
            let per = (a.repetitions * if test.is_gen() { test.tokens() } else { 1 }) as f64;
            let stats = m.counters.filter(|_| a.stats).map(|c| {
                (
                    c.launches as f64 / per,
                    c.graph_launches as f64 / per,
                    c.syncs as f64 / per,
                )
            });
            if let Some((l, g, s)) = stats {
                let unit = if test.is_gen() { "token" } else { "prompt" };
                eprintln!(
                    "bench: {} per {unit}: {l:.1} kernel launches, {g:.1} graph replays{}, {s:.1} host synchronisations",
                    test.name(),
                    match (m.graph_nodes, test.is_gen()) {
                        (Some(n), true) => format!(" (graph of {n} nodes)"),
                        _ => String::new(),
                    }
                );
            }
            if a.json {
                let (n_prompt, n_gen) = match test.kind {
                    Kind::Prompt(n) => (n, 0),
                    Kind::Gen(n) => (0, n),
                };
                let mut v = json!({
                    "model": path.display().to_string(),
                    "model_type": label,
                    "model_size": info.file_bytes,
                    "n_params": info.parameters,
                    "backend": device,
                    "path": path_name,
                    "kv_type": model.kv_type_name(),
                    "kv_type_k": kv.k.name(),
                    "kv_type_v": kv.v.name(),
                    "threads": t,
                    "test": test.name(),
                    "n_prompt": n_prompt,
                    "n_gen": n_gen,
                    "n_depth": test.depth,
                    "repetitions": a.repetitions,
                    "tokens_per_second": mean,
                    "stddev": sd,
                    "samples": m.samples,
                    "samples_ns": m.samples_ns,
                    "peak_rss_bytes": rss,
                    "kv_cache_bytes": m.kv_cache_bytes,
                    "kv_bytes_per_token": kv_per_token,
                    "kv_fixed_bytes": kv_fixed,
                    "seed": a.seed,
                    "bandwidth_floor_pct": floor_pct,
                    "decode_path": m.decode_path.filter(|_| test.is_gen()),
                    "prefill_gemm": prefill_gemm.filter(|_| !test.is_gen()),
                    "cuda_options": cuda_options,
                });
                if let Some((l, g, s)) = stats {
                    v["launches_per_token"] = json!(l);
                    v["graph_launches_per_token"] = json!(g);
                    v["syncs_per_token"] = json!(s);
                    v["graph_nodes"] = json!(m.graph_nodes);
                }
                writeln!(out, "{}", serde_json::to_string(&v)?)?;
            } else {
                writeln!(
                    out,
                    "{}",
                    table_row(&[
                        label.clone(),
                        human_size(info.file_bytes),
                        human_params(info.parameters),
                        device.to_string(),
                        // GPU: how decode ran, or the prefill product; CPU: the matmul path.
                        match (m.decode_path, prefill_gemm, test.is_gen()) {
                            (Some(d), _, true) => d.to_string(),
                            (_, Some(g), false) => g.to_string(),
                            _ => path_name.to_string(),
                        },
                        model.kv_type_name(),
                        t.to_string(),
                        test.name(),
                        format!("{mean:.2} ± {sd:.2}"),
                    ])
                )?;
            }
            out.flush()?;
        }
    }
    let target = info.file_bytes + kv_max + RSS_SLACK;
    match peak_rss_bytes() {
        Some(rss) => eprintln!(
            "bench: peak RSS {} ({} after loading; model file {} + KV cache {} + 64 MiB = {}: {})",
            mib(rss),
            load_rss.map_or_else(|| "n/a".into(), mib),
            mib(info.file_bytes),
            mib(kv_max),
            mib(target),
            if rss <= target {
                "within the target".to_string()
            } else {
                format!("over the target by {}", mib(rss - target))
            }
        ),
        None => eprintln!(
            "bench: peak RSS n/a (model file {}, KV cache {})",
            mib(info.file_bytes),
            mib(kv_max)
        ),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_and_tokens() {
        let (m, sd) = mean_sd(&[1.0, 2.0, 3.0]);
        assert_eq!(m, 2.0);
        assert!((sd - 1.0).abs() < 1e-12);
        assert_eq!(mean_sd(&[5.0]), (5.0, 0.0));
        let t = random_tokens(1000, 7, 1);
        assert!(t.iter().all(|&x| x < 7));
        assert_eq!(t, random_tokens(1000, 7, 1));
        assert_ne!(t, random_tokens(1000, 7, 2));
    }

    #[test]
    fn table_lines_have_every_column() {
        assert_eq!(table_header().lines().count(), 2);
        for l in table_header().lines() {
            assert_eq!(l.matches('|').count(), HEADER.len() + 1, "{l}");
        }
    }
}
