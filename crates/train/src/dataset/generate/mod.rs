//! Dataset generation with a served model: templates that ask a chat model (through any
//! [`Complete`], in practice an OpenAI-compatible `/v1/chat/completions`) for training records,
//! then put them through the dataset builder ([`into_dataset`]: duplicates, seeded split,
//! report) so that the result is a dataset exactly as `dataset build` writes one.
//!
//! Templates ([`Template`]), each record one attempt (`count` attempts in all; a reply that is
//! empty or unusable skips its attempt, which is counted and listed, never fatal):
//!
//! | template | from | calls per record | record |
//! |---|---|---|---|
//! | self-instruct | seed tasks | a new task in their style, then its answer | messages |
//! | qa | passages of documents | a question the passage answers, then the answer given the passage | messages |
//! | rephrase | texts or records, a style | each answer (or the text) rewritten in the style | the input's format (texts: prompt/completion) |
//! | classify | labels, what the texts are about | an example of one label | messages: instruction + text, the label |
//! | chats | topics, turns | the user side (the model playing a user) and the assistant side, alternating | messages |
//! | dpo-pairs | prompts, two settings | the reply of the chosen (stronger) and of the rejected (weaker) setting | dpo (conversational) |
//!
//! Every prompt is in [`prompts`], every reply is read by [`parse`] (plain text, trimmed).
//! Each call carries a seed derived from the run's seed, the attempt and the call, so that a
//! server that honours seeds gives the same dataset for the same seed.
//!
//! Not here: HTTP (the caller's [`Complete`], with its key and address), flags, signals and
//! files (the CLI).

pub mod parse;
pub mod prompts;
pub mod sources;
mod templates;

use serde::Serialize;
use serde_json::Value;

use super::{BuildConfig, Built, FileKind, Input, Problem, REPORT_EXAMPLES};
use crate::data::Turn;
use crate::{Error, Result};
pub use sources::{Line, Rephrasable, ToRephrase};

/// The template names, as the command line spells them.
pub const TEMPLATES: &[&str] = &[
    "self-instruct",
    "qa",
    "rephrase",
    "classify",
    "chats",
    "dpo-pairs",
];

/// Attempts when `count` is not given: self-instruct's.
pub const DEFAULT_SELF_INSTRUCT: usize = 10;
/// Attempts per label when `count` is not given: classify's.
pub const DEFAULT_PER_LABEL: usize = 5;

/// Which model answers and how: the served model's name (`None`: the server's own) and the
/// sampling temperature.
#[derive(Clone, Debug, PartialEq)]
pub struct Setting {
    pub model: Option<String>,
    pub temperature: f64,
}

/// A template and what it generates from.
#[derive(Clone, Debug)]
pub enum Template {
    SelfInstruct {
        seeds: Vec<Line>,
    },
    Qa {
        passages: Vec<Line>,
    },
    Rephrase {
        inputs: Vec<ToRephrase>,
        /// Rows of the inputs that cannot be rewritten (reported as skipped).
        problems: Vec<Problem>,
        style: String,
    },
    Classify {
        labels: Vec<String>,
        /// What the examples are ("customer emails"); the prompt says "texts" when empty.
        about: String,
    },
    Chats {
        topics: Vec<Line>,
        /// User turns per conversation (each answered by the assistant).
        turns: usize,
    },
    DpoPairs {
        prompts: Vec<Line>,
        chosen: Setting,
        rejected: Setting,
    },
}

impl Template {
    pub fn name(&self) -> &'static str {
        match self {
            Template::SelfInstruct { .. } => "self-instruct",
            Template::Qa { .. } => "qa",
            Template::Rephrase { .. } => "rephrase",
            Template::Classify { .. } => "classify",
            Template::Chats { .. } => "chats",
            Template::DpoPairs { .. } => "dpo-pairs",
        }
    }

    /// Attempts when none are asked for: one per input item (passage, text, topic, prompt),
    /// [`DEFAULT_SELF_INSTRUCT`] new tasks, [`DEFAULT_PER_LABEL`] examples per label.
    pub fn default_count(&self) -> usize {
        match self {
            Template::SelfInstruct { .. } => DEFAULT_SELF_INSTRUCT,
            Template::Qa { passages } => passages.len(),
            Template::Rephrase { inputs, .. } => inputs.len(),
            Template::Classify { labels, .. } => DEFAULT_PER_LABEL * labels.len(),
            Template::Chats { topics, .. } => topics.len(),
            Template::DpoPairs { prompts, .. } => prompts.len(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct GenConfig {
    pub template: Template,
    /// Records to attempt; `None`: [`Template::default_count`]. Inputs are used in turn (and
    /// again from the first when there are fewer than attempts).
    pub count: Option<usize>,
    /// The setting of every call (dpo-pairs: of none; it has its two).
    pub setting: Setting,
    /// Most tokens of each reply.
    pub max_tokens: usize,
    /// Seeds the calls and the choice of seed tasks shown.
    pub seed: u64,
}

/// One chat completion call.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    pub messages: &'a [Turn],
    pub model: Option<&'a str>,
    pub temperature: f64,
    pub max_tokens: usize,
    pub seed: u64,
}

/// A model's reply.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    pub text: String,
    /// It stopped at `max_tokens`.
    pub truncated: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum CallError {
    /// The run was asked to stop (a signal): nothing more is generated.
    Stopped,
    /// The server cannot be used (unreachable, refused the key, unknown model, failing):
    /// the run fails with this message.
    Fatal(String),
    /// This request failed on its own (e.g. a prompt too long for the context, a response
    /// that is not a chat completion): its attempt is skipped with this message.
    Unusable(String),
}

/// What sends one chat completion request.
pub trait Complete {
    fn complete(&self, r: &Request) -> std::result::Result<Reply, CallError>;
}

/// What a run tells as it goes (a progress display, NDJSON events).
pub trait Observer {
    /// Record `index` (0-based, in generation order) was generated.
    fn record(&mut self, index: usize, record: &Value);
    /// `done` of `total` attempts are over.
    fn progress(&mut self, done: usize, total: usize, generated: usize, skipped: usize);
}

/// What a run generated.
#[derive(Clone, Debug)]
pub struct Generated {
    pub template: &'static str,
    pub records: Vec<Value>,
    /// Attempts skipped (and rephrase input rows that could not be used), with why.
    pub problems: Vec<Problem>,
    pub attempts: usize,
    pub requests: usize,
    /// Replies that stopped at `max_tokens` (kept as they are).
    pub truncated: usize,
    /// The run was stopped before its last attempt.
    pub stopped: bool,
}

/// The generation part of a generated dataset's report.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct GenReport {
    pub template: &'static str,
    /// Records generated (before duplicates are removed).
    pub generated: usize,
    pub attempts: usize,
    pub requests: usize,
    pub truncated: usize,
}

/// Checks the settings; the number of attempts a run makes.
pub fn validate(cfg: &GenConfig) -> Result<usize> {
    let bad = |m: String| Err(Error::Config(m));
    if cfg.max_tokens == 0 {
        return bad("--max-tokens must be at least 1".into());
    }
    let temps = match &cfg.template {
        Template::DpoPairs {
            chosen, rejected, ..
        } => vec![chosen.temperature, rejected.temperature],
        _ => vec![cfg.setting.temperature],
    };
    if let Some(t) = temps.iter().find(|t| !(t.is_finite() && **t >= 0.0)) {
        return bad(format!("a temperature must be a number >= 0, not {t}"));
    }
    match &cfg.template {
        Template::Rephrase { style, .. } if style.trim().is_empty() => {
            return bad("rephrase needs --style (e.g. \"answer in uppercase\")".into())
        }
        Template::Classify { labels, .. } => {
            if labels.len() < 2 {
                return bad(format!(
                    "classify needs at least two labels (--labels a,b), not {}",
                    labels.len()
                ));
            }
            if let Some(l) = labels.iter().find(|l| l.trim().is_empty()) {
                return bad(format!("--labels: an empty label ('{l}')"));
            }
        }
        Template::Chats { turns: 0, .. } => return bad("--turns must be at least 1".into()),
        Template::DpoPairs {
            chosen, rejected, ..
        } if chosen == rejected => {
            return bad("dpo-pairs needs two different settings: --chosen-model / --rejected-model (e.g. BASE:ADAPTER and BASE) and/or --chosen-temperature / --rejected-temperature".into())
        }
        _ => {}
    }
    let n = cfg.count.unwrap_or_else(|| cfg.template.default_count());
    if n == 0 {
        return bad("--count must be at least 1".into());
    }
    Ok(n)
}

/// Runs the template: `count` attempts, each a record or a skip, until done or stopped.
/// Fails only on a bad setting or a [`CallError::Fatal`].
pub fn generate(
    cfg: &GenConfig,
    client: &dyn Complete,
    obs: &mut dyn Observer,
) -> Result<Generated> {
    let total = validate(cfg)?;
    let mut caller = templates::Caller::new(client, cfg);
    let mut g = Generated {
        template: cfg.template.name(),
        records: Vec::new(),
        problems: match &cfg.template {
            Template::Rephrase { problems, .. } => problems.clone(),
            _ => Vec::new(),
        },
        attempts: 0,
        requests: 0,
        truncated: 0,
        stopped: false,
    };
    let skipped0 = g.problems.len();
    for i in 0..total {
        match caller.attempt(i) {
            Ok(record) => {
                obs.record(g.records.len(), &record);
                g.records.push(record);
            }
            Err(templates::Fail::Skip(file, line, message)) => g.problems.push(Problem {
                file,
                line,
                message,
            }),
            Err(templates::Fail::Halt(CallError::Fatal(m))) => return Err(Error::Msg(m)),
            Err(templates::Fail::Halt(_)) => {
                g.stopped = true;
                break;
            }
        }
        g.attempts = i + 1;
        obs.progress(i + 1, total, g.records.len(), g.problems.len() - skipped0);
    }
    g.requests = caller.requests;
    g.truncated = caller.truncated;
    Ok(g)
}

/// The generated records through the dataset builder (duplicates, the seeded split, the
/// report, with `cfg.to` a conversion); the report counts the skipped attempts with the
/// builder's skipped rows and lists their problems first.
pub fn into_dataset(g: &Generated, cfg: &BuildConfig) -> Result<Built> {
    if g.records.is_empty() {
        return Err(Error::Msg(match g.problems.first() {
            Some(p) => format!(
                "no usable records: all {} attempts were skipped (the first: {p})",
                g.attempts
            ),
            None => "no records were generated".into(),
        }));
    }
    let mut text = String::new();
    for r in &g.records {
        text.push_str(&r.to_string());
        text.push('\n');
    }
    let input = Input {
        name: g.template.to_string(),
        kind: FileKind::Jsonl,
        bytes: text.into_bytes(),
    };
    let cfg = BuildConfig {
        mapping: Vec::new(),
        ..cfg.clone()
    };
    let mut built = super::build(std::slice::from_ref(&input), &cfg)?;
    let r = &mut built.report;
    let mut problems = g.problems.clone();
    problems.append(&mut r.problems);
    problems.truncate(REPORT_EXAMPLES);
    r.problems = problems;
    r.skipped += g.problems.len();
    r.generation = Some(GenReport {
        template: g.template,
        generated: g.records.len(),
        attempts: g.attempts,
        requests: g.requests,
        truncated: g.truncated,
    });
    Ok(built)
}

#[cfg(test)]
mod tests;
