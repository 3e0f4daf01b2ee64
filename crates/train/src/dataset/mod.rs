//! The dataset builder: CSV, JSON, JSONL and Parquet files to training records in one format, without
//! duplicates, shuffled and split into train and validation sets, with a report of what was
//! read, skipped and removed (and, given a model, of token lengths).
//!
//! Steps of [`build`]: [`read`] the rows of each input (file and line kept), map columns and
//! read each row as a record, write it in the target format ([`map`]), drop exact and near
//! duplicates ([`dedup`]), then a seeded shuffle and the split. A row that cannot be read or
//! converted is a [`Problem`] naming its file and line: with [`OnError::Reject`] any problem
//! fails the build, with [`OnError::Skip`] the row is left out and reported.
//!
//! [`generate`] makes records with a served model and puts them through [`build`].
//!
//! Not here: token lengths ([`stats`], which needs a model), flags and files (the CLI), jobs
//! (the Lab).

pub mod dedup;
pub mod generate;
pub mod map;
pub mod parquet;
pub mod read;
pub mod stats;

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

pub use map::{Format, Item};
pub use read::FileKind;

use crate::batch::SplitMix;
use crate::{Error, Result};

/// A row that could not be used.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Problem {
    pub file: String,
    pub line: usize,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.file, self.line, self.message)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnError {
    /// Any problem fails the build (the default: nothing is silently lost).
    Reject,
    /// Rows with problems are left out and listed in the report.
    Skip,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dedup {
    None,
    /// The same output record twice.
    Exact,
    /// Exact, then texts at least `near_threshold` similar.
    Near,
}

#[derive(Clone, Debug)]
pub struct BuildConfig {
    /// `(record field, input column)` renames.
    pub mapping: Vec<(String, String)>,
    /// The output format; `None`: the first record's own.
    pub to: Option<Format>,
    pub on_error: OnError,
    pub dedup: Dedup,
    /// Jaccard similarity of word 3-grams at which two records are near duplicates.
    pub near_threshold: f64,
    /// Fraction of the records held out for validation.
    pub valid_split: f64,
    pub seed: u64,
}

impl Default for BuildConfig {
    fn default() -> Self {
        BuildConfig {
            mapping: Vec::new(),
            to: None,
            on_error: OnError::Reject,
            dedup: Dedup::Exact,
            near_threshold: 0.8,
            valid_split: 0.1,
            seed: 0,
        }
    }
}

/// An input: its name (in messages and the report), how to read it, its bytes.
pub struct Input {
    pub name: String,
    pub kind: FileKind,
    pub bytes: Vec<u8>,
}

impl Input {
    pub fn load(path: &Path, name: &str) -> Result<Input> {
        Ok(Input {
            name: name.to_string(),
            kind: FileKind::of(path)?,
            bytes: std::fs::read(path).map_err(|e| Error::io(path, e))?,
        })
    }
}

/// A record that made it into the output.
#[derive(Clone, Debug)]
pub struct Kept {
    pub item: Item,
    /// The record in the output format.
    pub value: Value,
    pub file: String,
    pub line: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct InputReport {
    pub file: String,
    pub format: &'static str,
    pub rows: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct Duplicate {
    pub file: String,
    pub line: usize,
    /// The kept record it repeats.
    pub of_file: String,
    pub of_line: usize,
    /// "exact" or "near".
    pub kind: &'static str,
}

/// How many examples of skipped rows and duplicates the report lists.
pub const REPORT_EXAMPLES: usize = 50;

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub inputs: Vec<InputReport>,
    pub format: &'static str,
    /// Rows read (including those with problems).
    pub rows: usize,
    pub skipped: usize,
    /// The first [`REPORT_EXAMPLES`] problems.
    pub problems: Vec<Problem>,
    pub exact_duplicates: usize,
    pub near_duplicates: usize,
    /// The first [`REPORT_EXAMPLES`] duplicates removed.
    pub duplicates: Vec<Duplicate>,
    pub train: usize,
    pub valid: usize,
    pub seed: u64,
    pub valid_split: f64,
    /// Token lengths with a model's template (filled in by the caller that has the model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<stats::TokenReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// A generated dataset's template and counts (`template`, `generated`, `attempts`,
    /// `requests`, `truncated`; its skipped attempts are in `skipped` and `problems`).
    #[serde(flatten)]
    pub generation: Option<generate::GenReport>,
}

#[derive(Debug)]
pub struct Built {
    pub train: Vec<Kept>,
    pub valid: Vec<Kept>,
    pub report: Report,
}

fn reject(problems: &[Problem]) -> Error {
    let list: Vec<String> = problems.iter().take(10).map(|p| p.to_string()).collect();
    let more = problems.len().saturating_sub(10);
    Error::Msg(format!(
        "{} row(s) cannot be used (--on-error skip leaves them out):\n  {}{}",
        problems.len(),
        list.join("\n  "),
        if more > 0 {
            format!("\n  ... and {more} more")
        } else {
            String::new()
        }
    ))
}

/// Reads, converts, de-duplicates, shuffles and splits `inputs`.
pub fn build(inputs: &[Input], cfg: &BuildConfig) -> Result<Built> {
    if !(0.0..1.0).contains(&cfg.valid_split) {
        return Err(Error::Config(format!(
            "the validation split must be in [0, 1), not {}",
            cfg.valid_split
        )));
    }
    if !(cfg.near_threshold > 0.0 && cfg.near_threshold <= 1.0) {
        return Err(Error::Config(format!(
            "the near-duplicate threshold must be in (0, 1], not {}",
            cfg.near_threshold
        )));
    }
    let mut problems = Vec::new();
    let mut input_reports = Vec::new();
    let mut rows = 0usize;
    let mut to = cfg.to;
    let mut kept: Vec<Kept> = Vec::new();
    let mut used = vec![false; cfg.mapping.len()];
    for input in inputs {
        let (rs, ps) = read::read(&input.name, input.kind, &input.bytes)?;
        input_reports.push(InputReport {
            file: input.name.clone(),
            format: input.kind.name(),
            rows: rs.len() + ps.len(),
        });
        rows += rs.len() + ps.len();
        problems.extend(ps);
        for r in rs {
            let obj = map::apply_mapping(&r.fields, &cfg.mapping, r.from_csv, &mut used);
            let res = map::item(&obj).and_then(|(item, shape)| {
                let f = *to.get_or_insert(Format::of_shape(shape));
                map::write(&item, f).map(|value| (item, value))
            });
            match res {
                Ok((item, value)) => kept.push(Kept {
                    item,
                    value,
                    file: r.file,
                    line: r.line,
                }),
                Err(message) => problems.push(Problem {
                    file: r.file,
                    line: r.line,
                    message,
                }),
            }
        }
    }
    if let Some(i) = used.iter().position(|u| !u) {
        let (t, s) = &cfg.mapping[i];
        return Err(Error::Config(format!(
            "--map {t}={s}: no row of the input has a column '{s}'"
        )));
    }
    problems.sort_by(|a, b| (&a.file, a.line).cmp(&(&b.file, b.line)));
    if !problems.is_empty() && cfg.on_error == OnError::Reject {
        return Err(reject(&problems));
    }
    let format = to.unwrap_or(Format::Messages);
    if kept.is_empty() {
        return Err(Error::Msg(
            "no usable records (every row had a problem)".into(),
        ));
    }

    let (mut exact, mut near, mut duplicates) = (0usize, 0usize, Vec::new());
    if cfg.dedup != Dedup::None {
        let mut first: HashMap<String, usize> = HashMap::new();
        let mut dup_of: Vec<Option<(usize, &'static str)>> = vec![None; kept.len()];
        for (i, k) in kept.iter().enumerate() {
            let key = serde_json::to_string(&k.value).unwrap_or_default();
            match first.get(&key) {
                Some(&j) => dup_of[i] = Some((j, "exact")),
                None => {
                    first.insert(key, i);
                }
            }
        }
        if cfg.dedup == Dedup::Near {
            let live: Vec<usize> = (0..kept.len()).filter(|&i| dup_of[i].is_none()).collect();
            let texts: Vec<String> = live.iter().map(|&i| map::text_of(&kept[i].item)).collect();
            for (a, d) in dedup::near_duplicates(&texts, cfg.near_threshold)
                .into_iter()
                .enumerate()
            {
                if let Some(b) = d {
                    dup_of[live[a]] = Some((live[b], "near"));
                }
            }
        }
        let mut out = Vec::with_capacity(kept.len());
        for (i, k) in kept.iter().enumerate() {
            match dup_of[i] {
                Some((j, kind)) => {
                    if kind == "exact" {
                        exact += 1;
                    } else {
                        near += 1;
                    }
                    if duplicates.len() < REPORT_EXAMPLES {
                        duplicates.push(Duplicate {
                            file: k.file.clone(),
                            line: k.line,
                            of_file: kept[j].file.clone(),
                            of_line: kept[j].line,
                            kind,
                        });
                    }
                }
                None => out.push(k.clone()),
            }
        }
        kept = out;
    }

    let (train, valid) = split(kept, cfg.valid_split, cfg.seed);
    let skipped = problems.len();
    problems.truncate(REPORT_EXAMPLES);
    Ok(Built {
        report: Report {
            inputs: input_reports,
            format: format.name(),
            rows,
            skipped,
            problems,
            exact_duplicates: exact,
            near_duplicates: near,
            duplicates,
            train: train.len(),
            valid: valid.len(),
            seed: cfg.seed,
            valid_split: cfg.valid_split,
            tokens: None,
            model: None,
            generation: None,
        },
        train,
        valid,
    })
}

/// A seeded shuffle, then the first `round(n * fraction)` records are the validation set
/// (train keeps at least one record).
pub fn split<T>(mut v: Vec<T>, fraction: f64, seed: u64) -> (Vec<T>, Vec<T>) {
    SplitMix(seed).shuffle(&mut v);
    let n = v.len();
    let k = ((n as f64 * fraction).round() as usize).min(n.saturating_sub(1));
    let train = v.split_off(k);
    (train, v)
}

/// Writes records one a line to `path` through a temporary name in its folder.
pub fn write_jsonl(path: &Path, records: &[Kept]) -> Result<()> {
    let mut text = String::new();
    for k in records {
        text.push_str(&serde_json::to_string(&k.value).unwrap_or_default());
        text.push('\n');
    }
    write_atomic(path, text.as_bytes())
}

/// `bytes` to `path` through a temporary name and a rename (the adapter writer's, which also
/// clears what killed runs left).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    Ok(hf2q_models::adapter::write_file_atomically(path, bytes)?)
}
