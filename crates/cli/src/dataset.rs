//! `hf2q dataset build` and `hf2q dataset stats` (and the `generate` subcommand, in
//! [`crate::dataset_generate`]): the dataset builder of `hf2q_train::dataset`
//! from the command line. `build` writes `OUT/train.jsonl`, `OUT/valid.jsonl` and
//! `OUT/report.json` (each through a temporary name); `stats` reports the token lengths of a
//! file with a model's chat template. `--json` prints the report as one JSON line on stdout (the
//! Lab's `dataset` job reads it), else a summary.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use hf2q_train::dataset::{self, stats, BuildConfig, Dedup, Format, Input, OnError, Report};

use crate::args;

#[derive(clap::Subcommand, Debug)]
pub enum DatasetCmd {
    /// Import CSV, JSON, JSONL or Parquet files into SFT or DPO records: map columns, convert, remove
    /// duplicates, shuffle and split into train and validation sets.
    #[command(
        long_about = "Import CSV (a header row names the columns), JSON (one array of objects), \
JSONL or Parquet files, or a Hub dataset ORG/NAME[:SPLIT][@REV] (the split's JSON, JSONL, CSV and \
Parquet files, `train` by default, or the Hub's Parquet conversion of a dataset that has only a \
loading script, pulled into the shared Hugging Face cache; HF_ENDPOINT, HF_TOKEN and \
HF_HUB_OFFLINE apply), into training records. --map FIELD=COLUMN renames columns to the fields of a record \
shape: OpenAI `messages`, ShareGPT `conversations`, Alpaca `instruction`/`input`/`output`/`system`, \
`prompt`/`completion`, `text`, or DPO `prompt`/`chosen`/`rejected`. Records are written in --to's \
format (default: the first record's), exact (and with --dedup near, near) duplicates removed, \
shuffled with --seed and split into OUT/train.jsonl and OUT/valid.jsonl; OUT/report.json says \
what was read, skipped (with file and line) and removed, and with --model the token lengths."
    )]
    Build(BuildArgs),
    /// Token lengths of a data file with a model's chat template: percentiles, a histogram, how
    /// many records exceed --max-len.
    Stats(StatsArgs),
    /// Generate SFT or DPO records with a served model (the /v1 API of `hf2q serve` or any
    /// OpenAI-compatible server): self-instruct, qa, rephrase, classify, chats, dpo-pairs.
    #[command(
        long_about = "Generate training records with a served chat model through its \
OpenAI-compatible /v1/chat/completions API (--api URL; the key, if the server needs one, is \
$HF2Q_API_KEY). Templates: self-instruct (--seeds FILE: new tasks in the seeds' style, each then \
answered), qa (--source FILE|DIR of .txt/.md: a question about each passage, then its answer \
given the passage), rephrase (--inputs FILE of texts or records, --style TEXT: each answer \
rewritten in the style), classify (--labels A,B,.. [--about TEXT]: examples per label, answered \
with the label), chats (--topics FILE, --turns N: the model plays the user and the assistant in \
turn), dpo-pairs (--prompts FILE: the chosen reply from --chosen-model/--chosen-temperature, the \
rejected one from --rejected-model/--rejected-temperature). A reply that is empty or cannot be \
used skips its record and is counted. The records then go through the same duplicate removal, \
seeded split and report as `dataset build`: OUT/train.jsonl, OUT/valid.jsonl, OUT/report.json \
(with the template and the generated and skipped counts). Ctrl-C or SIGTERM stops at once and \
writes nothing."
    )]
    Generate(Box<crate::dataset_generate::GenerateArgs>),
}

#[derive(clap::Args, Debug)]
pub struct MapArgs {
    /// Record field from an input column: FIELD=COLUMN (repeatable), e.g. instruction=question.
    #[arg(long = "map", value_name = "FIELD=COLUMN")]
    pub map: Vec<String>,
    /// What to do with a row that cannot be read or converted: fail the whole build (reject) or
    /// leave it out and list it in the report (skip).
    #[arg(long, value_name = "HOW", default_value = "reject", value_parser = ["reject", "skip"])]
    pub on_error: String,
    /// Print the report as one JSON line on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct BuildArgs {
    /// Input files (.csv, .json, .jsonl, .parquet), or Hub datasets ORG/NAME[:SPLIT][@REV] (their
    /// split's data files, `train` by default, pulled into the shared cache).
    #[arg(required = true, value_name = "FILE|ORG/NAME[:SPLIT]")]
    pub inputs: Vec<PathBuf>,
    /// Output folder (new, or empty).
    #[arg(short, long, value_name = "DIR")]
    pub output: PathBuf,
    /// Output format: messages, sharegpt, alpaca, prompt_completion, text or dpo [default: the
    /// first record's].
    #[arg(long, value_name = "FORMAT")]
    pub to: Option<String>,
    #[command(flatten)]
    pub common: MapArgs,
    /// Fraction held out for validation.
    #[arg(long, value_name = "F", default_value_t = 0.1)]
    pub valid_split: f64,
    /// Seed of the shuffle before the split.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
    /// Duplicate removal: none, exact (the same record), near (also texts this similar:
    /// --near-threshold).
    #[arg(long, value_name = "HOW", default_value = "exact", value_parser = ["none", "exact", "near"])]
    pub dedup: String,
    /// Jaccard similarity of word 3-grams from which two records are near duplicates.
    #[arg(long, value_name = "J", default_value_t = 0.8)]
    pub near_threshold: f64,
    /// Also report token lengths with this model's chat template.
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,
    /// The length the token report counts records above.
    #[arg(long, value_name = "N", default_value_t = 2048)]
    pub max_len: usize,
}

#[derive(clap::Args, Debug)]
pub struct StatsArgs {
    /// A data file (.csv, .json, .jsonl).
    #[arg(value_name = "FILE")]
    pub input: PathBuf,
    /// The model whose tokenizer and chat template count the tokens.
    #[arg(long, value_name = "MODEL")]
    pub model: String,
    /// The length to count records above.
    #[arg(long, value_name = "N", default_value_t = 2048)]
    pub max_len: usize,
    #[command(flatten)]
    pub common: MapArgs,
}

pub fn run(c: DatasetCmd) -> Result<()> {
    match c {
        DatasetCmd::Build(a) => build(a),
        DatasetCmd::Stats(a) => stats_cmd(a),
        DatasetCmd::Generate(a) => crate::dataset_generate::run(*a),
    }
}

fn mapping(m: &MapArgs) -> Result<Vec<(String, String)>> {
    m.map
        .iter()
        .map(|s| match s.split_once('=') {
            Some((f, c)) if !f.trim().is_empty() && !c.trim().is_empty() => {
                Ok((f.trim().to_string(), c.trim().to_string()))
            }
            _ => bail!("--map '{s}': expected FIELD=COLUMN, e.g. instruction=question"),
        })
        .collect()
}

/// `--dedup none|exact|near` (clap has checked the value).
pub(crate) fn dedup_choice(s: &str) -> Dedup {
    match s {
        "none" => Dedup::None,
        "near" => Dedup::Near,
        _ => Dedup::Exact,
    }
}

fn on_error(m: &MapArgs) -> OnError {
    if m.on_error == "skip" {
        OnError::Skip
    } else {
        OnError::Reject
    }
}

fn inputs(paths: &[PathBuf]) -> Result<Vec<Input>> {
    let mut out = Vec::new();
    for p in paths {
        if !p.exists() {
            if let Some(files) = hub_dataset(p)? {
                out.extend(files);
                continue;
            }
        }
        let name = p.file_name().map_or_else(
            || p.display().to_string(),
            |n| n.to_string_lossy().to_string(),
        );
        out.push(Input::load(p, &name)?);
    }
    Ok(out)
}

/// An input that names a Hub dataset (`ORG/NAME[:SPLIT][@REV]`, not a local path): the split's
/// data files (or its Parquet conversion's, [`hf2q_hub::pull_dataset`]), pulled into the shared cache (`datasets--ORG--NAME`) or found there; `None` when
/// `arg` is no repository name.
fn hub_dataset(arg: &Path) -> Result<Option<Vec<Input>>> {
    let Some(s) = arg.to_str().filter(|s| s.contains('/')) else {
        return Ok(None);
    };
    let Ok(r) = hf2q_hub::RepoRef::parse(s) else {
        return Ok(None);
    };
    let mut repo = r;
    repo.id = repo.id.of_kind(hf2q_hub::RepoKind::Dataset);
    let cfg = crate::pull::hub_config(None, false)?;
    let req = hf2q_hub::PullRequest::new(repo);
    eprintln!("reading dataset {} from {}", req.repo, cfg.endpoint);
    let pulled = hf2q_hub::pull_dataset(&cfg, &req).with_context(|| format!("dataset {s}"))?;
    let mut out = Vec::new();
    for f in &pulled.files {
        let path = pulled.snapshot.join(f);
        out.push(Input::load(&path, &format!("{}/{f}", req.repo.id))?);
    }
    Ok(Some(out))
}

/// Token lengths of the kept records with `model`'s template into the report.
fn token_report(
    report: &mut Report,
    items: &[&dataset::Item],
    model: &str,
    max_len: usize,
) -> Result<()> {
    let (path, model) = args::load_model(Some(model))?;
    let mut lens = Vec::with_capacity(items.len());
    let mut failed = 0usize;
    for l in stats::lengths(&model, items)? {
        match l {
            Ok(n) => lens.push(n),
            Err(_) => failed += 1,
        }
    }
    if failed > 0 {
        eprintln!("warning: {failed} record(s) could not be rendered with the model's template and are not counted");
    }
    report.tokens = Some(stats::summarize(&lens, max_len));
    report.model = Some(path.display().to_string());
    Ok(())
}

fn print(report: &Report, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
        return Ok(());
    }
    eprintln!(
        "{} rows read, {} skipped, {} exact and {} near duplicates removed: {} train, {} validation ({} records)",
        report.rows, report.skipped, report.exact_duplicates, report.near_duplicates, report.train, report.valid, report.format
    );
    for p in &report.problems {
        eprintln!("  skipped {p}");
    }
    if let Some(t) = &report.tokens {
        eprintln!(
            "tokens: min {} / p50 {} / p90 {} / p99 {} / max {} (mean {:.1}); {} of {} over {}",
            t.min, t.p50, t.p90, t.p99, t.max, t.mean, t.over_max_len, t.records, t.max_len
        );
        for b in &t.histogram {
            eprintln!("  <= {:>6}  {}", b.up_to, b.count);
        }
    }
    Ok(())
}

fn build(a: BuildArgs) -> Result<()> {
    let to = match &a.to {
        None => None,
        Some(s) => Some(Format::parse(s).with_context(|| {
            let names: Vec<_> = dataset::map::FORMATS.iter().map(|(n, _)| *n).collect();
            format!("--to '{s}': unknown format (known: {})", names.join(", "))
        })?),
    };
    let cfg = BuildConfig {
        mapping: mapping(&a.common)?,
        to,
        on_error: on_error(&a.common),
        dedup: dedup_choice(&a.dedup),
        near_threshold: a.near_threshold,
        valid_split: a.valid_split,
        seed: a.seed,
    };
    if a.output.exists()
        && std::fs::read_dir(&a.output)
            .with_context(|| format!("reading {}", a.output.display()))?
            .next()
            .is_some()
    {
        bail!(
            "{} exists and is not empty: outputs are never overwritten",
            a.output.display()
        );
    }
    let mut built = dataset::build(&inputs(&a.inputs)?, &cfg)?;
    if let Some(m) = &a.model {
        let items: Vec<&dataset::Item> = built
            .train
            .iter()
            .chain(&built.valid)
            .map(|k| &k.item)
            .collect();
        token_report(&mut built.report, &items, m, a.max_len)?;
    }
    std::fs::create_dir_all(&a.output)
        .with_context(|| format!("creating {}", a.output.display()))?;
    dataset::write_jsonl(&a.output.join("train.jsonl"), &built.train)?;
    dataset::write_jsonl(&a.output.join("valid.jsonl"), &built.valid)?;
    let report = serde_json::to_vec_pretty(&built.report)?;
    dataset::write_atomic(&a.output.join("report.json"), &report)?;
    print(&built.report, a.common.json)?;
    if !a.common.json {
        println!("{}", a.output.display());
    }
    Ok(())
}

fn stats_cmd(a: StatsArgs) -> Result<()> {
    let cfg = BuildConfig {
        mapping: mapping(&a.common)?,
        on_error: on_error(&a.common),
        dedup: Dedup::None,
        valid_split: 0.0,
        ..Default::default()
    };
    let mut built = dataset::build(&inputs(std::slice::from_ref(&a.input))?, &cfg)?;
    let items: Vec<&dataset::Item> = built.train.iter().map(|k| &k.item).collect();
    token_report(&mut built.report, &items, &a.model, a.max_len)?;
    print(&built.report, a.common.json)
}
