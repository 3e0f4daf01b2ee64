//! Rows to records and records to the output format.
//!
//! A row's columns are first renamed by the column mapping (`target=source`: the record field
//! `target` takes the column `source`, in the rows that have it); a CSV cell of a list field (`messages`,
//! `conversations`, `prompt`, `completion`, `chosen`, `rejected`) that holds a JSON list is read
//! as that list. The record's shape then follows from its fields as in [`crate::data`], with
//! preference records (`prompt`, `chosen`, `rejected`) first.
//!
//! Conversions (a record that has no form in the target is a problem of its row):
//!
//! | from \ to | messages, sharegpt | alpaca | prompt_completion | text | dpo |
//! |---|---|---|---|---|---|
//! | conversation | as it is | one (system,) user, assistant exchange | turns before the last assistant turn / the last | no | no |
//! | prompt + completion text | user prompt, assistant completion (prompt not empty) | instruction, output | as it is | prompt + completion | no |
//! | preference | no | no | no | no | as it is |

use serde_json::{json, Map, Value};

pub(crate) use crate::data::kind;
use crate::data::{record, turns, Record, Shape, Turn};

/// A record of any shape the builder reads.
#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    Sft(Record),
    Dpo(Preference),
}

/// A preference pair (DPO): plain text, or conversations (TRL's conversational form, the
/// prompt's turns then the chosen or rejected turns).
#[derive(Clone, Debug, PartialEq)]
pub enum Preference {
    Text {
        prompt: String,
        chosen: String,
        rejected: String,
    },
    Chat {
        prompt: Vec<Turn>,
        chosen: Vec<Turn>,
        rejected: Vec<Turn>,
    },
}

/// The record formats the builder writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Messages,
    ShareGpt,
    Alpaca,
    PromptCompletion,
    Text,
    Dpo,
}

pub const FORMATS: &[(&str, Format)] = &[
    ("messages", Format::Messages),
    ("sharegpt", Format::ShareGpt),
    ("alpaca", Format::Alpaca),
    ("prompt_completion", Format::PromptCompletion),
    ("text", Format::Text),
    ("dpo", Format::Dpo),
];

impl Format {
    pub fn parse(s: &str) -> Option<Format> {
        FORMATS.iter().find(|(n, _)| *n == s).map(|(_, f)| *f)
    }
    pub fn name(self) -> &'static str {
        FORMATS
            .iter()
            .find(|(_, f)| *f == self)
            .map(|(n, _)| *n)
            .unwrap_or("?")
    }
    /// The format records of a shape are written in when no other is asked for.
    pub fn of_shape(s: Option<Shape>) -> Format {
        match s {
            None => Format::Dpo,
            Some(Shape::Messages) => Format::Messages,
            Some(Shape::ShareGpt) => Format::ShareGpt,
            Some(Shape::Alpaca) => Format::Alpaca,
            Some(Shape::PromptCompletion) => Format::PromptCompletion,
            Some(Shape::Text) => Format::Text,
            Some(
                Shape::PairText | Shape::PairMessages | Shape::PairImplicit | Shape::PairShareGpt,
            ) => Format::Dpo,
        }
    }
}

const LIST_FIELDS: &[&str] = &[
    "messages",
    "conversations",
    "prompt",
    "completion",
    "chosen",
    "rejected",
];

/// Renames columns (`(target, source)` pairs) where the row has the source column; `used[i]`
/// is set when pair i applied.
pub fn apply_mapping(
    fields: &Map<String, Value>,
    mapping: &[(String, String)],
    from_csv: bool,
    used: &mut [bool],
) -> Map<String, Value> {
    let mut out = fields.clone();
    for (_, source) in mapping {
        out.remove(source);
    }
    for (i, (target, source)) in mapping.iter().enumerate() {
        if let Some(v) = fields.get(source) {
            out.insert(target.clone(), v.clone());
            used[i] = true;
        }
    }
    if from_csv {
        for f in LIST_FIELDS {
            if let Some(Value::String(s)) = out.get(*f) {
                if s.trim_start().starts_with('[') {
                    if let Ok(v @ Value::Array(_)) = serde_json::from_str::<Value>(s) {
                        out.insert(f.to_string(), v);
                    }
                }
            }
        }
    }
    out
}

/// The record of mapped fields, and its shape (`None`: a preference record).
pub fn item(obj: &Map<String, Value>) -> Result<(Item, Option<Shape>), String> {
    if ["prompt", "chosen", "rejected"]
        .iter()
        .all(|k| obj.contains_key(*k))
    {
        return Ok((Item::Dpo(preference(obj)?), None));
    }
    let s = Shape::of(obj).ok_or_else(|| {
        format!(
            "unknown record shape (fields: {}); expected messages, conversations, instruction/output, prompt/completion, text or prompt/chosen/rejected (map columns with --map FIELD=COLUMN)",
            obj.keys().cloned().collect::<Vec<_>>().join(", ")
        )
    })?;
    Ok((Item::Sft(record(obj, s)?), Some(s)))
}

fn preference(obj: &Map<String, Value>) -> Result<Preference, String> {
    let (p, c, r) = (&obj["prompt"], &obj["chosen"], &obj["rejected"]);
    match (p, c, r) {
        (Value::String(p), Value::String(c), Value::String(r)) => {
            if c.is_empty() || r.is_empty() {
                return Err("'chosen' and 'rejected' may not be empty".into());
            }
            Ok(Preference::Text {
                prompt: p.clone(),
                chosen: c.clone(),
                rejected: r.clone(),
            })
        }
        (Value::Array(_), Value::Array(_), Value::Array(_)) => Ok(Preference::Chat {
            prompt: turns(p, false, "prompt")?,
            chosen: turns(c, false, "chosen")?,
            rejected: turns(r, false, "rejected")?,
        }),
        _ => Err(format!(
            "'prompt', 'chosen' and 'rejected' must all be strings or all message lists (got {}, {} and {})",
            kind(p),
            kind(c),
            kind(r)
        )),
    }
}

fn messages(t: &[Turn]) -> Value {
    Value::Array(
        t.iter()
            .map(|t| json!({"role": t.role, "content": t.content}))
            .collect(),
    )
}

fn sharegpt(t: &[Turn]) -> Result<Value, String> {
    let list = t
        .iter()
        .map(|t| {
            let from = match t.role.as_str() {
                "user" => "human",
                "assistant" => "gpt",
                "system" => "system",
                r => return Err(format!("a '{r}' turn has no ShareGPT form")),
            };
            Ok(json!({"from": from, "value": t.content}))
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Value::Array(list))
}

/// `(system, user, assistant)` of a single exchange.
fn exchange(t: &[Turn]) -> Option<(Option<&str>, &str, &str)> {
    match t {
        [u, a] if u.role == "user" && a.role == "assistant" => Some((None, &u.content, &a.content)),
        [s, u, a] if s.role == "system" && u.role == "user" && a.role == "assistant" => {
            Some((Some(&s.content), &u.content, &a.content))
        }
        _ => None,
    }
}

/// One record in `to`'s form.
pub fn write(item: &Item, to: Format) -> Result<Value, String> {
    let no = |what: &str| Err(format!("{what} has no {} form", to.name()));
    match item {
        // A reply after its prompt is, written out, the whole conversation.
        Item::Sft(Record::Chat(t) | Record::Reply { turns: t, .. }) => match to {
            Format::Messages => Ok(json!({"messages": messages(t)})),
            Format::ShareGpt => Ok(json!({"conversations": sharegpt(t)?})),
            Format::Alpaca => match exchange(t) {
                Some((system, user, output)) => {
                    let mut v = json!({"instruction": user, "input": "", "output": output});
                    if let Some(s) = system {
                        v["system"] = json!(s);
                    }
                    Ok(v)
                }
                None => no(&format!(
                    "a conversation of {} turns (not one user and one assistant turn)",
                    t.len()
                )),
            },
            Format::PromptCompletion => match t.last() {
                Some(last) if last.role == "assistant" && t.len() > 1 => Ok(
                    json!({"prompt": messages(&t[..t.len() - 1]), "completion": messages(&t[t.len() - 1..])}),
                ),
                _ => no("a conversation that does not end with an assistant turn"),
            },
            Format::Text => no("a conversation (it needs a chat template to become text)"),
            Format::Dpo => no("a supervised record (it has no rejected reply)"),
        },
        Item::Sft(Record::Text { prompt, completion }) => match to {
            Format::Text => Ok(json!({"text": format!("{prompt}{completion}")})),
            Format::PromptCompletion => Ok(json!({"prompt": prompt, "completion": completion})),
            Format::Alpaca => Ok(json!({"instruction": prompt, "input": "", "output": completion})),
            Format::Messages | Format::ShareGpt if !prompt.is_empty() => {
                let t = [
                    Turn {
                        role: "user".into(),
                        content: prompt.clone(),
                    },
                    Turn {
                        role: "assistant".into(),
                        content: completion.clone(),
                    },
                ];
                write(&Item::Sft(Record::Chat(t.to_vec())), to)
            }
            Format::Messages | Format::ShareGpt => {
                no("plain text without a prompt (there is no user turn)")
            }
            Format::Dpo => no("a supervised record (it has no rejected reply)"),
        },
        Item::Dpo(p) => match (to, p) {
            (
                Format::Dpo,
                Preference::Text {
                    prompt,
                    chosen,
                    rejected,
                },
            ) => Ok(json!({"prompt": prompt, "chosen": chosen, "rejected": rejected})),
            (
                Format::Dpo,
                Preference::Chat {
                    prompt,
                    chosen,
                    rejected,
                },
            ) => Ok(
                json!({"prompt": messages(prompt), "chosen": messages(chosen), "rejected": messages(rejected)}),
            ),
            _ => no("a preference record"),
        },
    }
}

/// The records the token counts are taken of: one, or a preference's two replies.
pub fn samples(item: &Item) -> Vec<Record> {
    match item {
        Item::Sft(r) => vec![r.clone()],
        Item::Dpo(Preference::Text {
            prompt,
            chosen,
            rejected,
        }) => [chosen, rejected]
            .iter()
            .map(|c| Record::Text {
                prompt: prompt.clone(),
                completion: (*c).clone(),
            })
            .collect(),
        Item::Dpo(Preference::Chat {
            prompt,
            chosen,
            rejected,
        }) => [chosen, rejected]
            .iter()
            .map(|c| Record::Chat(prompt.iter().chain(c.iter()).cloned().collect()))
            .collect(),
    }
}

/// The text of a record (its contents one after another), for near-duplicate detection.
pub fn text_of(item: &Item) -> String {
    let join = |t: &[Turn]| {
        t.iter()
            .map(|t| t.content.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    };
    match item {
        Item::Sft(Record::Chat(t) | Record::Reply { turns: t, .. }) => join(t),
        Item::Sft(Record::Text { prompt, completion }) => format!("{prompt}\n{completion}"),
        Item::Dpo(Preference::Text {
            prompt,
            chosen,
            rejected,
        }) => format!("{prompt}\n{chosen}\n{rejected}"),
        Item::Dpo(Preference::Chat {
            prompt,
            chosen,
            rejected,
        }) => format!("{}\n{}\n{}", join(prompt), join(chosen), join(rejected)),
    }
}
