//! `hf2q dataset generate TEMPLATE`: the generation templates of
//! `hf2q_train::dataset::generate` against a served model's `/v1/chat/completions` (any
//! OpenAI-compatible server; ours is `hf2q serve`). This file is flags -> [`GenConfig`], the
//! HTTP transport (blocking `ureq`, one non-streaming request at a time, each on a helper
//! thread so that a signal ends the wait at once), the NDJSON events of `--json`, and the
//! output folder (written at a temporary name beside it, then renamed; a stopped run writes
//! nothing). The API key is `$HF2Q_API_KEY`, read here and passed down in [`ApiConfig`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use hf2q_train::dataset::generate::{
    self, parse, sources, CallError, Complete, GenConfig, Observer, Reply, Request, Setting,
    Template,
};
use hf2q_train::dataset::{self, BuildConfig, Format, OnError};
use serde_json::{json, Value};

use crate::progress::{Progress, Unit};

/// Set by the first Ctrl-C or SIGTERM: the run stops at once and writes nothing.
static STOP: AtomicBool = AtomicBool::new(false);

/// How often a waiting request looks at [`STOP`].
const STOP_POLL: Duration = Duration::from_millis(100);

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// The template.
    #[arg(value_name = "TEMPLATE", value_parser = generate::TEMPLATES.to_vec())]
    pub template: String,
    /// Output folder (new, or empty): train.jsonl, valid.jsonl, report.json.
    #[arg(short, long, value_name = "DIR")]
    pub output: PathBuf,
    /// The OpenAI-compatible API to generate with, e.g. http://127.0.0.1:8080/v1 (an address
    /// without a path gets /v1). The key, when the server needs one, is $HF2Q_API_KEY.
    #[arg(long, value_name = "URL")]
    pub api: String,
    /// The served model to ask (`BASE:ADAPTER` for an adapter of `hf2q serve`) [default: the
    /// server's own].
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// self-instruct: seed tasks, one a line (or JSONL / a JSON array of strings or objects).
    #[arg(long, value_name = "FILE")]
    pub seeds: Option<PathBuf>,
    /// qa: a document (.txt, .md) or a folder of them.
    #[arg(long, value_name = "FILE|DIR")]
    pub source: Option<PathBuf>,
    /// qa: the longest passage a question is asked about, in characters [default: 1500].
    #[arg(long, value_name = "N")]
    pub chunk_chars: Option<usize>,
    /// rephrase: texts (one a line) or records (.csv, .json, .jsonl) whose answers are rewritten.
    #[arg(long, value_name = "FILE")]
    pub inputs: Option<PathBuf>,
    /// rephrase: the style to rewrite in, e.g. "answer in uppercase".
    #[arg(long, value_name = "TEXT")]
    pub style: Option<String>,
    /// classify: the labels, comma-separated (at least two).
    #[arg(long, value_name = "A,B,..", value_delimiter = ',')]
    pub labels: Vec<String>,
    /// classify: what the examples are, e.g. "customer support emails" [default: texts].
    #[arg(long, value_name = "TEXT")]
    pub about: Option<String>,
    /// chats: topics, one a line (or JSONL / a JSON array).
    #[arg(long, value_name = "FILE")]
    pub topics: Option<PathBuf>,
    /// chats: user turns per conversation, each answered by the assistant [default: 2].
    #[arg(long, value_name = "N")]
    pub turns: Option<usize>,
    /// dpo-pairs: prompts, one a line (or JSONL / a JSON array).
    #[arg(long, value_name = "FILE")]
    pub prompts: Option<PathBuf>,
    /// dpo-pairs: the model of the chosen replies [default: --model].
    #[arg(long, value_name = "NAME")]
    pub chosen_model: Option<String>,
    /// dpo-pairs: the model of the rejected replies [default: --model].
    #[arg(long, value_name = "NAME")]
    pub rejected_model: Option<String>,
    /// dpo-pairs: the temperature of the chosen replies [default: --temperature].
    #[arg(long, value_name = "T")]
    pub chosen_temperature: Option<f64>,
    /// dpo-pairs: the temperature of the rejected replies [default: --temperature].
    #[arg(long, value_name = "T")]
    pub rejected_temperature: Option<f64>,
    /// Records to attempt (a reply that cannot be used skips its record) [default: one per
    /// passage, text, topic or prompt; 10 for self-instruct; 5 per label for classify].
    #[arg(long, value_name = "N")]
    pub count: Option<usize>,
    /// Sampling temperature of every call.
    #[arg(long, value_name = "T", default_value_t = 0.7)]
    pub temperature: f64,
    /// Most tokens of each reply.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_tokens: usize,
    /// Seed of the calls (a server that honours seeds repeats its replies), of the seed tasks
    /// shown and of the shuffle before the split.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
    /// Fraction held out for validation.
    #[arg(long, value_name = "F", default_value_t = 0.1)]
    pub valid_split: f64,
    /// Duplicate removal: none, exact, near (also texts this similar: --near-threshold).
    #[arg(long, value_name = "HOW", default_value = "exact", value_parser = ["none", "exact", "near"])]
    pub dedup: String,
    /// Jaccard similarity of word 3-grams from which two records are near duplicates.
    #[arg(long, value_name = "J", default_value_t = 0.8)]
    pub near_threshold: f64,
    /// Output format: messages, sharegpt, alpaca, prompt_completion, text or dpo [default: the
    /// template's].
    #[arg(long, value_name = "FORMAT")]
    pub to: Option<String>,
    /// Seconds one request may take.
    #[arg(long, value_name = "SECS", default_value_t = 600.0)]
    pub timeout: f64,
    /// NDJSON events on stdout: start, progress, finish, one `record` per generated record,
    /// and the report as the last line (`"event": "result"`).
    #[arg(long)]
    pub json: bool,
}

/// Where the API is and how to call it.
#[derive(Clone, Debug)]
pub struct ApiConfig {
    /// The chat completions endpoint, `.../v1/chat/completions`.
    pub endpoint: String,
    /// Sent as `Authorization: Bearer KEY`.
    pub key: Option<String>,
    pub timeout: Duration,
}

/// `--api URL` -> its chat completions endpoint (http only: loopback needs no TLS).
pub fn endpoint(api: &str) -> Result<String> {
    let u = api.trim().trim_end_matches('/');
    let Some(rest) = u.strip_prefix("http://") else {
        if u.starts_with("https://") {
            bail!("--api {api}: https is not supported (this build has no TLS); give the server's http address, e.g. http://127.0.0.1:8080/v1");
        }
        bail!("--api {api}: expected an http:// URL, e.g. http://127.0.0.1:8080/v1");
    };
    if rest.is_empty() || rest.starts_with('/') {
        bail!("--api {api}: the URL has no host");
    }
    let base = if rest.contains('/') {
        u.to_string()
    } else {
        format!("{u}/v1")
    };
    Ok(format!("{base}/chat/completions"))
}

/// The transport: blocking requests on a helper thread, the caller waiting with an eye on
/// [`STOP`].
struct Http {
    agent: ureq::Agent,
    api: ApiConfig,
}

impl Http {
    fn new(api: ApiConfig) -> Http {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(api.timeout))
            // Loopback: the environment's proxy settings do not apply.
            .proxy(None)
            .build()
            .into();
        Http { agent, api }
    }
}

/// One POST; transport failures and statuses that say the server cannot be used are fatal,
/// a request refused on its own (400, 413, 422) or a response that is no completion skips.
fn post(agent: &ureq::Agent, api: &ApiConfig, body: &str) -> Result<Reply, CallError> {
    let url = &api.endpoint;
    let mut req = agent.post(url).header("Content-Type", "application/json");
    if let Some(k) = &api.key {
        req = req.header("Authorization", &format!("Bearer {k}"));
    }
    let mut resp = req
        .send(body)
        .map_err(|e| CallError::Fatal(format!("cannot reach the API at {url}: {e}")))?;
    let status = resp.status().as_u16();
    let text = resp
        .body_mut()
        .read_to_string()
        .map_err(|e| CallError::Unusable(format!("reading the response: {e}")))?;
    match status {
        200..=299 => {
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| CallError::Unusable(format!("the response is not JSON ({e})")))?;
            parse::reply(&v).map_err(CallError::Unusable)
        }
        400 | 413 | 422 => Err(CallError::Unusable(format!(
            "HTTP {status}: {}",
            parse::error_message(&text)
        ))),
        401 | 403 => Err(CallError::Fatal(format!(
            "{url}: HTTP {status}: {} (the key is $HF2Q_API_KEY)",
            parse::error_message(&text)
        ))),
        _ => Err(CallError::Fatal(format!(
            "{url}: HTTP {status}: {}",
            parse::error_message(&text)
        ))),
    }
}

impl Complete for Http {
    fn complete(&self, r: &Request) -> Result<Reply, CallError> {
        if STOP.load(Ordering::SeqCst) {
            return Err(CallError::Stopped);
        }
        let body = parse::body(r).to_string();
        let (tx, rx) = mpsc::channel();
        let (agent, api) = (self.agent.clone(), self.api.clone());
        std::thread::spawn(move || {
            let _ = tx.send(post(&agent, &api, &body));
        });
        loop {
            match rx.recv_timeout(STOP_POLL) {
                Ok(r) => return r,
                Err(mpsc::RecvTimeoutError::Timeout) if STOP.load(Ordering::SeqCst) => {
                    return Err(CallError::Stopped)
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(CallError::Fatal(
                        "the request thread ended without an answer".into(),
                    ))
                }
            }
        }
    }
}

/// One NDJSON line on stdout, flushed (the Lab reads them as they come).
fn event(v: &Value) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

struct Events<'a> {
    bar: &'a Progress,
    json: bool,
}

impl Observer for Events<'_> {
    fn record(&mut self, index: usize, record: &Value) {
        if self.json {
            event(&json!({"event": "record", "index": index, "record": record}));
        }
    }
    fn progress(&mut self, done: usize, _total: usize, generated: usize, skipped: usize) {
        self.bar.set(
            done as u64,
            format!("{generated} records, {skipped} skipped"),
        );
    }
}

/// Which template reads each template-specific flag.
fn check_flags(a: &GenerateArgs) -> Result<()> {
    let given: &[(&str, bool, &str)] = &[
        ("--seeds", a.seeds.is_some(), "self-instruct"),
        ("--source", a.source.is_some(), "qa"),
        ("--chunk-chars", a.chunk_chars.is_some(), "qa"),
        ("--inputs", a.inputs.is_some(), "rephrase"),
        ("--style", a.style.is_some(), "rephrase"),
        ("--labels", !a.labels.is_empty(), "classify"),
        ("--about", a.about.is_some(), "classify"),
        ("--topics", a.topics.is_some(), "chats"),
        ("--turns", a.turns.is_some(), "chats"),
        ("--prompts", a.prompts.is_some(), "dpo-pairs"),
        ("--chosen-model", a.chosen_model.is_some(), "dpo-pairs"),
        ("--rejected-model", a.rejected_model.is_some(), "dpo-pairs"),
        (
            "--chosen-temperature",
            a.chosen_temperature.is_some(),
            "dpo-pairs",
        ),
        (
            "--rejected-temperature",
            a.rejected_temperature.is_some(),
            "dpo-pairs",
        ),
    ];
    for (flag, on, user) in given {
        if *on && *user != a.template {
            bail!("{flag} is for the {user} template, not {}", a.template);
        }
    }
    Ok(())
}

fn need<'a>(a: &GenerateArgs, v: &'a Option<PathBuf>, flag: &str, what: &str) -> Result<&'a Path> {
    v.as_deref()
        .ok_or_else(|| anyhow!("the {} template needs {flag} ({what})", a.template))
}

/// The template and what it reads, from the flags.
fn template(a: &GenerateArgs) -> Result<Template> {
    check_flags(a)?;
    let list = |p: &Path| sources::read_list(p).with_context(|| format!("reading {}", p.display()));
    Ok(match a.template.as_str() {
        "self-instruct" => Template::SelfInstruct {
            seeds: list(need(a, &a.seeds, "--seeds FILE", "seed tasks, one a line")?)?,
        },
        "qa" => {
            let p = need(
                a,
                &a.source,
                "--source FILE|DIR",
                "a document or a folder of .txt/.md",
            )?;
            let max = a.chunk_chars.unwrap_or(1500);
            if max < 50 {
                bail!("--chunk-chars must be at least 50, not {max}");
            }
            Template::Qa {
                passages: sources::read_documents(p, max)
                    .with_context(|| format!("reading {}", p.display()))?,
            }
        }
        "rephrase" => {
            let p = need(a, &a.inputs, "--inputs FILE", "texts or records to rewrite")?;
            let Some(style) = a.style.clone() else {
                bail!("the rephrase template needs --style TEXT (e.g. \"answer in uppercase\")");
            };
            let (inputs, problems) =
                sources::read_rephrase(p).with_context(|| format!("reading {}", p.display()))?;
            Template::Rephrase {
                inputs,
                problems,
                style,
            }
        }
        "classify" => {
            if a.labels.is_empty() {
                bail!("the classify template needs --labels A,B,.. (at least two)");
            }
            Template::Classify {
                labels: a.labels.iter().map(|l| l.trim().to_string()).collect(),
                about: a.about.clone().unwrap_or_default(),
            }
        }
        "chats" => Template::Chats {
            topics: list(need(a, &a.topics, "--topics FILE", "topics, one a line")?)?,
            turns: a.turns.unwrap_or(2),
        },
        "dpo-pairs" => {
            let setting = |model: &Option<String>, t: Option<f64>| Setting {
                model: model.clone().or_else(|| a.model.clone()),
                temperature: t.unwrap_or(a.temperature),
            };
            Template::DpoPairs {
                prompts: list(need(
                    a,
                    &a.prompts,
                    "--prompts FILE",
                    "prompts, one a line",
                )?)?,
                chosen: setting(&a.chosen_model, a.chosen_temperature),
                rejected: setting(&a.rejected_model, a.rejected_temperature),
            }
        }
        t => bail!(
            "unknown template '{t}' (known: {})",
            generate::TEMPLATES.join(", ")
        ),
    })
}

fn build_config(a: &GenerateArgs) -> Result<BuildConfig> {
    let to = match &a.to {
        None => None,
        Some(s) => Some(Format::parse(s).with_context(|| {
            let names: Vec<_> = dataset::map::FORMATS.iter().map(|(n, _)| *n).collect();
            format!("--to '{s}': unknown format (known: {})", names.join(", "))
        })?),
    };
    Ok(BuildConfig {
        mapping: Vec::new(),
        to,
        on_error: OnError::Reject,
        dedup: crate::dataset::dedup_choice(&a.dedup),
        near_threshold: a.near_threshold,
        valid_split: a.valid_split,
        seed: a.seed,
    })
}

/// `out` may be written: it does not exist, or is an empty folder.
fn check_output(out: &Path) -> Result<()> {
    if out.exists()
        && std::fs::read_dir(out)
            .with_context(|| format!("reading {}", out.display()))?
            .next()
            .is_some()
    {
        bail!(
            "{} exists and is not empty: outputs are never overwritten",
            out.display()
        );
    }
    Ok(())
}

/// The dataset's three files into `.NAME.tmp-PID` beside `out`, then renamed to `out`.
fn write(out: &Path, built: &dataset::Built) -> Result<()> {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .ok_or_else(|| anyhow!("{}: not a folder name", out.display()))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).with_context(|| format!("creating {}", parent.display()))?;
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let res = (|| -> Result<()> {
        std::fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        dataset::write_jsonl(&tmp.join("train.jsonl"), &built.train)?;
        dataset::write_jsonl(&tmp.join("valid.jsonl"), &built.valid)?;
        let report = serde_json::to_vec_pretty(&built.report)?;
        dataset::write_atomic(&tmp.join("report.json"), &report)?;
        check_output(out)?;
        if out.exists() {
            std::fs::remove_dir(out).with_context(|| format!("replacing {}", out.display()))?;
        }
        std::fs::rename(&tmp, out)
            .with_context(|| format!("renaming {} to {}", tmp.display(), out.display()))
    })();
    if res.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    res
}

pub fn run(a: GenerateArgs) -> Result<()> {
    crate::progress::set_json(a.json);
    let api = ApiConfig {
        endpoint: endpoint(&a.api)?,
        key: std::env::var("HF2Q_API_KEY").ok().filter(|k| !k.is_empty()),
        timeout: Duration::try_from_secs_f64(a.timeout)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| anyhow!("--timeout must be a number of seconds > 0"))?,
    };
    let build = build_config(&a)?;
    check_output(&a.output)?;
    let cfg = GenConfig {
        template: template(&a)?,
        count: a.count,
        setting: Setting {
            model: a.model.clone(),
            temperature: a.temperature,
        },
        max_tokens: a.max_tokens,
        seed: a.seed,
    };
    let total = generate::validate(&cfg)?;
    ctrlc::set_handler(|| {
        if STOP.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("\nstopping: nothing will be written (again to quit at once)");
    })
    .context("installing the Ctrl-C handler")?;
    let bar = Progress::new(
        format!("generate {}", cfg.template.name()),
        total as u64,
        Unit::Items("records"),
    );
    let mut events = Events {
        bar: &bar,
        json: a.json,
    };
    let g = match generate::generate(&cfg, &Http::new(api), &mut events) {
        Ok(g) => g,
        Err(e) => {
            bar.abandon();
            return Err(e.into());
        }
    };
    if g.stopped || STOP.load(Ordering::SeqCst) {
        bar.abandon();
        bail!(
            "stopped after {} of {total} attempts: nothing was written",
            g.attempts
        );
    }
    bar.finish(format!(
        "{} records, {} skipped, {} requests",
        g.records.len(),
        g.problems.len(),
        g.requests
    ));
    let built = generate::into_dataset(&g, &build)?;
    write(&a.output, &built)?;
    let r = &built.report;
    if a.json {
        let mut v = serde_json::to_value(r)?;
        v["event"] = json!("result");
        v["output"] = json!(a.output.display().to_string());
        event(&v);
        return Ok(());
    }
    eprintln!(
        "{}: {} records generated in {} requests, {} skipped, {} exact and {} near duplicates removed: {} train, {} validation ({} records)",
        g.template, g.records.len(), g.requests, r.skipped, r.exact_duplicates, r.near_duplicates, r.train, r.valid, r.format
    );
    for p in &r.problems {
        eprintln!("  skipped {p}");
    }
    println!("{}", a.output.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_urls() {
        assert_eq!(
            endpoint("http://127.0.0.1:8080/v1").unwrap(),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(
            endpoint("http://127.0.0.1:8080/").unwrap(),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(
            endpoint("http://h:1/openai/v1/").unwrap(),
            "http://h:1/openai/v1/chat/completions"
        );
        assert!(endpoint("https://h/v1")
            .unwrap_err()
            .to_string()
            .contains("no TLS"));
        assert!(endpoint("127.0.0.1:8080").is_err());
        assert!(endpoint("http://").is_err());
    }
}
