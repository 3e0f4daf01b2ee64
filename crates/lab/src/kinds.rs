//! Job kinds and their parameters: one table per kind maps a JSON param to the `hf2q` flag it
//! stands for (the CLI's long flag names, `-` or `_` alike), with its type; [`plan`] checks the
//! params against the table (unknown, missing, mistyped and out-of-home values are errors that
//! name the param) and builds the child's argv with outputs at temporary names.
//!
//! Paths: inputs (`file`, `data`, ...) are names relative to `$HF2Q_HOME`; a `model` is a
//! built-in name or such a name; outputs are names under the kind's folder
//! (`models/` for quantize and convert, `imatrix/`, `adapters/` for training, `datasets/` for
//! the dataset builder and the generation templates). Hub names (`repo` of a push, `hub` of a
//! dataset build) are checked by [`repo_name`]. A `dataset_generate` job reaches the
//! server the Lab runs in: its `/v1` address is [`Context::api`] (`--api URL` in the argv; the
//! key goes through the child's environment, never the argv).
//! Not here: running the argv ([`crate::runner`]).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::paths::{partial, Home};
use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Quantize,
    Convert,
    Imatrix,
    Perplexity,
    TrainSft,
    TrainDpo,
    Pull,
    Dataset,
    Fuse,
    ExportAdapter,
    DatasetGenerate,
    Push,
}

pub const KINDS: &[(&str, Kind)] = &[
    ("quantize", Kind::Quantize),
    ("convert", Kind::Convert),
    ("imatrix", Kind::Imatrix),
    ("perplexity", Kind::Perplexity),
    ("train_sft", Kind::TrainSft),
    ("train_dpo", Kind::TrainDpo),
    ("pull", Kind::Pull),
    ("dataset", Kind::Dataset),
    ("fuse", Kind::Fuse),
    ("export_adapter", Kind::ExportAdapter),
    ("dataset_generate", Kind::DatasetGenerate),
    ("push", Kind::Push),
];

impl Kind {
    pub fn parse(s: &str) -> Result<Kind> {
        KINDS
            .iter()
            .find(|(n, _)| *n == s)
            .map(|(_, k)| *k)
            .ok_or_else(|| {
                let names: Vec<_> = KINDS.iter().map(|(n, _)| *n).collect();
                Error::param(
                    "kind",
                    format!("unknown job kind '{s}' (known: {})", names.join(", ")),
                )
            })
    }
    pub fn name(self) -> &'static str {
        KINDS
            .iter()
            .find(|(_, k)| *k == self)
            .map(|(n, _)| *n)
            .unwrap_or("?")
    }
    pub fn is_train(self) -> bool {
        matches!(self, Kind::TrainSft | Kind::TrainDpo)
    }
}

/// Which lease a job holds while it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lease {
    Gpu,
    Cpu,
}

#[derive(Clone, Copy, Debug)]
enum Ty {
    Str,
    Int,
    Float,
    Bool,
    Choice(&'static [&'static str]),
    /// A built-in model name or a model path under the home.
    Model,
    /// An existing file or folder under the home.
    Input,
    /// A new path under this folder of the home.
    Output(&'static str),
    /// A non-empty list of [`Ty::Input`] names (positional).
    Inputs,
    /// An object `{FIELD: COLUMN}`: one `FLAG FIELD=COLUMN` each.
    Pairs,
    /// A Hub repository `ORG/NAME` ([`repo_name`]).
    Repo,
    /// A list of Hub datasets `ORG/NAME[:SPLIT][@REV]` (positional).
    HubDatasets,
}

#[derive(Clone, Copy, Debug)]
struct Param {
    name: &'static str,
    /// `--flag`, `-o`, or "" for a positional argument (in table order).
    flag: &'static str,
    ty: Ty,
    required: bool,
}

const fn p(name: &'static str, flag: &'static str, ty: Ty) -> Param {
    Param {
        name,
        flag,
        ty,
        required: false,
    }
}
const fn req(name: &'static str, flag: &'static str, ty: Ty) -> Param {
    Param {
        name,
        flag,
        ty,
        required: true,
    }
}

const DEVICES: &[&str] = &["auto", "cpu", "cuda"];
const MATMUL: &[&str] = &["fast", "reference"];

const QUANTIZE: &[Param] = &[
    req("model", "", Ty::Model),
    req("output", "", Ty::Output("models")),
    p("type", "--type", Ty::Str),
    p("target_bpw", "--target-bpw", Ty::Float),
    p("calib", "--calib", Ty::Input),
    p("calib_tokens", "--calib-tokens", Ty::Int),
    p("exhaustive", "--exhaustive", Ty::Bool),
    p("group_size", "--group-size", Ty::Int),
    p("imatrix", "--imatrix", Ty::Input),
    p("pure", "--pure", Ty::Bool),
    p("output_tensor_type", "--output-tensor-type", Ty::Str),
    p("token_embedding_type", "--token-embedding-type", Ty::Str),
    p("eval", "--eval", Ty::Input),
    p("eval_ctx", "--eval-ctx", Ty::Int),
    p("eval_chunks", "--eval-chunks", Ty::Int),
];

const CONVERT: &[Param] = &[
    req("model", "", Ty::Model),
    req("output", "", Ty::Output("models")),
    req("to", "--to", Ty::Choice(&["gguf", "hf", "mlx"])),
    p("type", "--type", Ty::Str),
    p("dtype", "--dtype", Ty::Choice(&["f32", "f16", "bf16"])),
    p("shard_size", "--shard-size", Ty::Int),
    p("group_size", "--group-size", Ty::Int),
];

const IMATRIX: &[Param] = &[
    req("model", "", Ty::Model),
    req("file", "--file", Ty::Input),
    req("output", "--output", Ty::Output("imatrix")),
    p("ctx", "--ctx", Ty::Int),
    p("chunks", "--chunks", Ty::Int),
    p("process_output", "--process-output", Ty::Bool),
    p("matmul", "--matmul", Ty::Choice(MATMUL)),
    p("kv_type", "--kv-type", Ty::Str),
];

const PERPLEXITY: &[Param] = &[
    req("model", "", Ty::Model),
    req("file", "--file", Ty::Input),
    p("ctx", "--ctx", Ty::Int),
    p("chunks", "--chunks", Ty::Int),
    p("kl_base", "--kl-base", Ty::Model),
    p("kv_type", "--kv-type", Ty::Str),
];

/// The flags `train sft` and `train dpo` share.
macro_rules! train_params {
    ($($extra:expr),*) => {
        &[
            p("model", "", Ty::Model),
            req("data", "--data", Ty::Input),
            p("valid", "--valid", Ty::Input),
            p("valid_split", "--valid-split", Ty::Float),
            req("output", "--output", Ty::Output("adapters")),
            p("lora_r", "--lora-r", Ty::Int),
            p("lora_alpha", "--lora-alpha", Ty::Float),
            p("lora_dropout", "--lora-dropout", Ty::Float),
            p("rslora", "--rslora", Ty::Bool),
            p("targets", "--targets", Ty::Str),
            p("lr", "--lr", Ty::Float),
            p("schedule", "--schedule", Ty::Choice(&["cosine", "linear", "constant"])),
            p("warmup_steps", "--warmup-steps", Ty::Int),
            p("epochs", "--epochs", Ty::Int),
            p("steps", "--steps", Ty::Int),
            p("batch", "--batch", Ty::Int),
            p("grad_accum", "--grad-accum", Ty::Int),
            p("max_seq_len", "--max-seq-len", Ty::Int),
            p("packing", "--packing", Ty::Bool),
            p("seed", "--seed", Ty::Int),
            p("weight_decay", "--weight-decay", Ty::Float),
            p("max_grad_norm", "--max-grad-norm", Ty::Float),
            p("grad_checkpoint", "--grad-checkpoint", Ty::Str),
            p("eval_every", "--eval-every", Ty::Int),
            p("save_every", "--save-every", Ty::Int),
            p("device", "--device", Ty::Choice(DEVICES)),
            p("matmul", "--matmul", Ty::Choice(MATMUL)),
            $($extra),*
        ]
    };
}

const TRAIN_SFT: &[Param] = train_params!(p("train_on_prompt", "--train-on-prompt", Ty::Bool));
const TRAIN_DPO: &[Param] = train_params!(
    p("beta", "--beta", Ty::Float),
    p("adapter", "--adapter", Ty::Input),
    p("ref_adapter", "--ref-adapter", Ty::Input)
);

const FORMATS: &[&str] = &[
    "messages",
    "sharegpt",
    "alpaca",
    "prompt_completion",
    "text",
    "dpo",
];

/// Files under the home (`inputs`), Hub datasets (`hub`), or both; one at least.
const DATASET: &[Param] = &[
    p("inputs", "", Ty::Inputs),
    p("hub", "", Ty::HubDatasets),
    req("output", "--output", Ty::Output("datasets")),
    p("to", "--to", Ty::Choice(FORMATS)),
    p("map", "--map", Ty::Pairs),
    p("on_error", "--on-error", Ty::Choice(&["reject", "skip"])),
    p("valid_split", "--valid-split", Ty::Float),
    p("seed", "--seed", Ty::Int),
    p("dedup", "--dedup", Ty::Choice(&["none", "exact", "near"])),
    p("near_threshold", "--near-threshold", Ty::Float),
    p("model", "--model", Ty::Model),
    p("max_len", "--max-len", Ty::Int),
];

const FUSE: &[Param] = &[
    req("model", "", Ty::Model),
    req("adapter", "", Ty::Input),
    req("output", "", Ty::Output("models")),
    p("to", "--to", Ty::Choice(&["gguf", "hf", "mlx"])),
    p("type", "--type", Ty::Str),
    p("eval", "--eval", Ty::Input),
    p("eval_ctx", "--eval-ctx", Ty::Int),
    p("eval_chunks", "--eval-chunks", Ty::Int),
];

/// `hf2q convert ADAPTER OUT --to ... --base MODEL`: an adapter into another tool's format.
const EXPORT_ADAPTER: &[Param] = &[
    req("adapter", "", Ty::Input),
    req("output", "", Ty::Output("adapters")),
    req("to", "--to", Ty::Choice(&["gguf-lora", "mlx", "peft"])),
    p("base", "--base", Ty::Model),
];

/// `hf2q dataset generate`'s templates.
const TEMPLATES: &[&str] = &[
    "self-instruct",
    "qa",
    "rephrase",
    "classify",
    "chats",
    "dpo-pairs",
];

/// Models here are names the server serves (`BASE:ADAPTER`), not files: plain strings.
const DATASET_GENERATE: &[Param] = &[
    req("template", "", Ty::Choice(TEMPLATES)),
    req("output", "--output", Ty::Output("datasets")),
    p("model", "--model", Ty::Str),
    p("seeds", "--seeds", Ty::Input),
    p("source", "--source", Ty::Input),
    p("chunk_chars", "--chunk-chars", Ty::Int),
    p("inputs", "--inputs", Ty::Input),
    p("style", "--style", Ty::Str),
    p("labels", "--labels", Ty::Str),
    p("about", "--about", Ty::Str),
    p("topics", "--topics", Ty::Input),
    p("turns", "--turns", Ty::Int),
    p("prompts", "--prompts", Ty::Input),
    p("chosen_model", "--chosen-model", Ty::Str),
    p("rejected_model", "--rejected-model", Ty::Str),
    p("chosen_temperature", "--chosen-temperature", Ty::Float),
    p("rejected_temperature", "--rejected-temperature", Ty::Float),
    p("count", "--count", Ty::Int),
    p("temperature", "--temperature", Ty::Float),
    p("max_tokens", "--max-tokens", Ty::Int),
    p("seed", "--seed", Ty::Int),
    p("valid_split", "--valid-split", Ty::Float),
    p("dedup", "--dedup", Ty::Choice(&["none", "exact", "near"])),
    p("near_threshold", "--near-threshold", Ty::Float),
    p("to", "--to", Ty::Choice(FORMATS)),
    p("timeout", "--timeout", Ty::Float),
];

const PULL: &[Param] = &[req("name", "", Ty::Str), p("force", "--force", Ty::Bool)];

/// `hf2q push PATH ORG/NAME`: a model, GGUF file, adapter or dataset of the home to the Hub,
/// with the stored token ([`crate::hub_token`]).
const PUSH: &[Param] = &[
    req("path", "", Ty::Input),
    req("repo", "", Ty::Repo),
    p(
        "repo_type",
        "--repo-type",
        Ty::Choice(&["model", "dataset"]),
    ),
    p("private", "--private", Ty::Bool),
    p("revision", "--revision", Ty::Str),
    p("message", "--message", Ty::Str),
    p("no_card", "--no-card", Ty::Bool),
];

/// Params every kind takes and the runner (not the child) reads: `lease` ("gpu" or "cpu")
/// overrides which lease the job holds (training holds the GPU lease unless `device` is
/// "cpu"; everything else a CPU slot).
const LEASE: &str = "lease";

fn table(kind: Kind) -> Result<&'static [Param]> {
    Ok(match kind {
        Kind::Quantize => QUANTIZE,
        Kind::Convert => CONVERT,
        Kind::Imatrix => IMATRIX,
        Kind::Perplexity => PERPLEXITY,
        Kind::TrainSft => TRAIN_SFT,
        Kind::TrainDpo => TRAIN_DPO,
        Kind::Pull => PULL,
        Kind::Dataset => DATASET,
        Kind::Fuse => FUSE,
        Kind::ExportAdapter => EXPORT_ADAPTER,
        Kind::DatasetGenerate => DATASET_GENERATE,
        Kind::Push => PUSH,
    })
}

/// What the runner needs to start a job.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Arguments after the `hf2q` binary.
    pub argv: Vec<OsString>,
    /// (final path, temporary path the child writes): renamed when the child succeeds.
    pub outputs: Vec<(PathBuf, PathBuf)>,
    pub lease: Lease,
}

/// Where the built-in names and the home are, for [`plan`].
pub struct Context<'a> {
    pub home: &'a Home,
    pub builtin_models: &'a [String],
    /// The `/v1` base URL of the server the Lab runs in (`None`: not known, e.g. no server
    /// listens yet); `dataset_generate` jobs need it.
    pub api: Option<&'a str>,
}

/// A Hub repository name as the Hub allows them: `ORG/NAME`, each part 1 to 96 of ASCII
/// letters, digits, `-`, `_`, `.`, not starting or ending with `-` or `.`, no `--` or `..`;
/// with `suffix`, a `:SPLIT` and an `@REV` may follow (letters, digits, `-`, `_`, `.`, and `/`
/// in the revision). The child checks the name again; this keeps odd strings out of the argv.
pub fn repo_name(param: &str, s: &str, suffix: bool) -> Result<String> {
    let bad = |why: &str| Error::param(param, format!("'{s}' is not a Hub repository name: {why}"));
    let (base, rev) = match s.split_once('@') {
        Some((b, r)) if suffix => (b, Some(r)),
        _ => (s, None),
    };
    let (id, split) = match base.split_once(':') {
        Some((i, sp)) if suffix => (i, Some(sp)),
        _ => (base, None),
    };
    let word = |w: &str, extra: &[u8]| {
        !w.is_empty()
            && w.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b) || extra.contains(&b))
    };
    let Some((org, name)) = id.split_once('/') else {
        return Err(bad("expected ORG/NAME"));
    };
    for part in [org, name] {
        let edge = |c: char| c == '-' || c == '.';
        if part.len() > 96
            || !word(part, b"")
            || part.starts_with(edge)
            || part.ends_with(edge)
            || part.contains("--")
            || part.contains("..")
        {
            return Err(bad(&format!(
                "'{part}' must be 1 to 96 letters, digits, '-', '_' or '.', without '--' or '..' and not starting or ending with '-' or '.'"
            )));
        }
    }
    if split.is_some_and(|sp| !word(sp, b"")) {
        return Err(bad(
            "the split after ':' must be letters, digits, '-', '_' or '.'",
        ));
    }
    if rev.is_some_and(|r| !word(r, b"/") || r.starts_with(['-', '/']) || r.contains("..")) {
        return Err(bad(
            "the revision after '@' must be letters, digits, '-', '_', '.' or '/'",
        ));
    }
    Ok(s.to_string())
}

fn normal(key: &str) -> String {
    key.replace('-', "_")
}

fn scalar(param: &str, v: &Value, ty: Ty) -> Result<String> {
    let bad = |what: &str| Error::param(param, format!("must be {what}, not {v}"));
    Ok(match ty {
        Ty::Int => match v.as_u64() {
            Some(n) => n.to_string(),
            None => return Err(bad("a whole number >= 0")),
        },
        Ty::Float => match v.as_f64() {
            Some(x) if x.is_finite() => x.to_string(),
            _ => return Err(bad("a number")),
        },
        Ty::Choice(options) => match v.as_str() {
            Some(s) if options.contains(&s) => s.to_string(),
            _ => return Err(bad(&format!("one of {}", options.join(", ")))),
        },
        _ => match v.as_str() {
            Some(s) if !s.is_empty() && !s.starts_with('-') => s.to_string(),
            Some(_) => return Err(bad("a non-empty string not starting with '-'")),
            None => return Err(bad("a string")),
        },
    })
}

/// Checks `params` for `kind` and builds the argv of job `id` (`resume`: a training job's
/// output folder exists and holds checkpoints to continue from).
pub fn plan(ctx: &Context, kind: Kind, params: &Value, id: i64) -> Result<Plan> {
    let table = table(kind)?;
    let obj: Map<String, Value> = match params {
        Value::Object(m) => m.iter().map(|(k, v)| (normal(k), v.clone())).collect(),
        Value::Null => Map::new(),
        _ => return Err(Error::param("params", "must be a JSON object")),
    };
    for k in obj.keys() {
        if k != LEASE && !table.iter().any(|p| p.name == k) {
            let names: Vec<_> = table.iter().map(|p| p.name).collect();
            return Err(Error::param(
                k,
                format!(
                    "unknown parameter for a {} job (known: {})",
                    kind.name(),
                    names.join(", ")
                ),
            ));
        }
    }
    let mut positional = Vec::new();
    let mut flags = Vec::new();
    let mut outputs = Vec::new();
    for prm in table {
        let Some(v) = obj.get(prm.name).filter(|v| !v.is_null()) else {
            if prm.required {
                return Err(Error::param(
                    prm.name,
                    format!("is required for a {} job", kind.name()),
                ));
            }
            continue;
        };
        let arg: Option<OsString> = match prm.ty {
            Ty::Bool => match v.as_bool() {
                Some(true) => {
                    flags.push(OsString::from(prm.flag));
                    None
                }
                Some(false) => None,
                None => {
                    return Err(Error::param(
                        prm.name,
                        format!("must be true or false, not {v}"),
                    ))
                }
            },
            Ty::Model => {
                let s = scalar(prm.name, v, Ty::Str)?;
                if ctx.builtin_models.contains(&s) {
                    Some(s.into())
                } else {
                    Some(ctx.home.existing(prm.name, "", &s)?.into_os_string())
                }
            }
            Ty::Input => {
                let s = scalar(prm.name, v, Ty::Str)?;
                Some(ctx.home.existing(prm.name, "", &s)?.into_os_string())
            }
            Ty::Output(base) => {
                let mut s = scalar(prm.name, v, Ty::Str)?;
                if gguf_output(kind, &obj) && !s.to_ascii_lowercase().ends_with(".gguf") {
                    s.push_str(".gguf");
                }
                let out = ctx.home.new_output(prm.name, base, &s)?;
                let tmp = partial(&out, id);
                outputs.push((out, tmp.clone()));
                Some(tmp.into_os_string())
            }
            Ty::Inputs => {
                let list = v.as_array().filter(|l| !l.is_empty()).ok_or_else(|| {
                    Error::param(
                        prm.name,
                        format!("must be a non-empty list of names, not {v}"),
                    )
                })?;
                for item in list {
                    let s = scalar(prm.name, item, Ty::Str)?;
                    positional.push(ctx.home.existing(prm.name, "", &s)?.into_os_string());
                }
                None
            }
            Ty::Pairs => {
                let m = v.as_object().ok_or_else(|| {
                    Error::param(
                        prm.name,
                        format!("must be an object {{FIELD: COLUMN}}, not {v}"),
                    )
                })?;
                for (field, col) in m {
                    let c = scalar(prm.name, col, Ty::Str)?;
                    if field.is_empty() || field.contains('=') {
                        return Err(Error::param(
                            prm.name,
                            format!("'{field}' is not a field name"),
                        ));
                    }
                    flags.push(prm.flag.into());
                    flags.push(format!("{field}={c}").into());
                }
                None
            }
            Ty::Repo => {
                let s = scalar(prm.name, v, Ty::Str)?;
                Some(repo_name(prm.name, &s, false)?.into())
            }
            Ty::HubDatasets => {
                let list = v.as_array().filter(|l| !l.is_empty()).ok_or_else(|| {
                    Error::param(
                        prm.name,
                        format!("must be a non-empty list of ORG/NAME[:SPLIT] names, not {v}"),
                    )
                })?;
                for item in list {
                    let s = scalar(prm.name, item, Ty::Str)?;
                    positional.push(repo_name(prm.name, &s, true)?.into());
                }
                None
            }
            ty => Some(scalar(prm.name, v, ty)?.into()),
        };
        if let Some(a) = arg {
            if prm.flag.is_empty() {
                positional.push(a);
            } else {
                flags.push(prm.flag.into());
                flags.push(a);
            }
        }
    }
    if kind == Kind::Dataset && positional.is_empty() {
        return Err(Error::param(
            "inputs",
            "a dataset job needs files (inputs) or Hub datasets (hub)",
        ));
    }
    if kind == Kind::Pull {
        let name = positional
            .first()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        if !ctx.builtin_models.contains(&name) {
            return Err(Error::param(
                "name",
                format!(
                    "'{name}' is not a built-in model (known: {})",
                    ctx.builtin_models.join(", ")
                ),
            ));
        }
    }
    let mut argv: Vec<OsString> = match kind {
        Kind::TrainSft => vec!["train".into(), "sft".into()],
        Kind::TrainDpo => vec!["train".into(), "dpo".into()],
        Kind::Dataset => vec!["dataset".into(), "build".into()],
        Kind::ExportAdapter => vec!["convert".into()],
        Kind::DatasetGenerate => vec!["dataset".into(), "generate".into()],
        k => vec![k.name().into()],
    };
    argv.extend(positional);
    argv.extend(flags);
    if kind == Kind::DatasetGenerate {
        let api = ctx.api.ok_or_else(|| {
            Error::param(
                "kind",
                "a dataset_generate job needs the address of the server the Lab runs in, and none is known yet",
            )
        })?;
        argv.push("--api".into());
        argv.push(api.into());
    }
    if kind != Kind::Pull {
        argv.push("--json".into());
    }
    let lease = match obj.get(LEASE) {
        None => match obj.get("device").and_then(Value::as_str) {
            _ if !kind.is_train() => Lease::Cpu,
            Some("cpu") => Lease::Cpu,
            _ => Lease::Gpu,
        },
        Some(v) => match v.as_str() {
            Some("gpu") => Lease::Gpu,
            Some("cpu") => Lease::Cpu,
            _ => {
                return Err(Error::param(
                    LEASE,
                    format!("must be \"gpu\" or \"cpu\", not {v}"),
                ))
            }
        },
    };
    Ok(Plan {
        argv,
        outputs,
        lease,
    })
}

/// Quantize to a GGUF type, or convert `--to gguf`: the output is a `.gguf` file.
fn gguf_output(kind: Kind, obj: &Map<String, Value>) -> bool {
    match kind {
        Kind::Quantize => !obj
            .get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| t.to_ascii_lowercase().starts_with("mlx")),
        Kind::Convert => obj.get("to").and_then(Value::as_str) == Some("gguf"),
        Kind::ExportAdapter => obj.get("to").and_then(Value::as_str) == Some("gguf-lora"),
        // Fuse writes the base's own format unless `to` says otherwise: GGUF for a built-in
        // name (a plain name, no folder) or a `.gguf` model.
        Kind::Fuse => match obj.get("to").and_then(Value::as_str) {
            Some(t) => t == "gguf",
            None => obj
                .get("model")
                .and_then(Value::as_str)
                .is_some_and(|m| !m.contains('/') || m.to_ascii_lowercase().ends_with(".gguf")),
        },
        _ => false,
    }
}

/// A training job's resume: `--resume DIR` when its temporary output folder holds a
/// checkpoint (else it starts over there).
pub fn add_resume(plan: &mut Plan) {
    if let Some((_, tmp)) = plan.outputs.first() {
        if has_checkpoint(tmp) {
            plan.argv.push("--resume".into());
            plan.argv.push(tmp.clone().into_os_string());
        }
    }
}

fn has_checkpoint(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("checkpoint-"))
    })
}

#[cfg(test)]
#[path = "kinds_tests.rs"]
mod tests;
