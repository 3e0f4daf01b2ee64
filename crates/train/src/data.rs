//! Training records from JSON or JSONL files, in the shapes people keep SFT data in:
//!
//! | shape | fields | becomes |
//! |---|---|---|
//! | OpenAI chat | `messages: [{role, content}]` | a conversation |
//! | ShareGPT | `conversations: [{from, value}]` (`human`/`user`, `gpt`/`assistant`, `system`) | a conversation |
//! | Alpaca | `instruction`, `input` (optional), `output`, `system` (optional) | user `instruction\ninput`, assistant `output` |
//! | prompt / completion | `prompt`, `completion`: strings (plain text) or message lists (a conversation) | plain text, loss on the completion |
//! | text | `text` | plain text, loss on every token |
//!
//! Preference pairs (DPO, [`Dataset::load_pairs`]), in TRL's and LLaMA-Factory's shapes:
//!
//! | shape | fields | becomes |
//! |---|---|---|
//! | text pairs | `prompt`, `chosen`, `rejected`: strings | two plain texts, loss on each completion |
//! | message pairs | `prompt`: messages; `chosen`, `rejected`: assistant message lists | two conversations, only the reply learned |
//! | implicit-prompt pairs | `chosen`, `rejected`: whole conversations (the shared first turns are the prompt) | the same |
//! | ShareGPT pairs (LLaMA-Factory) | `conversations: [{from, value}]`, `chosen`, `rejected`: one `{from, value}` each | the same |
//!
//! A pair becomes two consecutive records, chosen then rejected.
//!
//! A file is JSONL (one record a line, blank lines skipped) or one JSON array; every record of a
//! file must have the same shape. A malformed record is an error naming its file and line (JSONL)
//! or index (array), and what is wrong.
//!
//! Not here: turning records into tokens (`render`), batching (`batch`).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::{Error, Result};

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Turn {
    pub role: String,
    pub content: String,
}

/// One training example.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// Rendered with the model's chat template; the assistant turns are what is learned.
    Chat(Vec<Turn>),
    /// Plain text (no template): `prompt` (not learned, may be empty) then `completion`.
    Text { prompt: String, completion: String },
    /// A conversation of which only the assistant turns from `turns[reply_from]` on are
    /// learned (a preference pair's reply after its prompt).
    Reply { turns: Vec<Turn>, reply_from: usize },
}

/// The shapes of [`Record`] files (see the module header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    Messages,
    ShareGpt,
    Alpaca,
    PromptCompletion,
    Text,
    PairText,
    PairMessages,
    PairImplicit,
    PairShareGpt,
}

impl Shape {
    pub fn name(self) -> &'static str {
        match self {
            Shape::Messages => "messages",
            Shape::ShareGpt => "sharegpt",
            Shape::Alpaca => "alpaca",
            Shape::PromptCompletion => "prompt/completion",
            Shape::Text => "text",
            Shape::PairText => "prompt/chosen/rejected text",
            Shape::PairMessages => "prompt/chosen/rejected messages",
            Shape::PairImplicit => "chosen/rejected conversations",
            Shape::PairShareGpt => "conversations/chosen/rejected",
        }
    }
    fn of_pair(obj: &Map<String, Value>) -> Option<Shape> {
        if !(obj.contains_key("chosen") && obj.contains_key("rejected")) {
            None
        } else if obj.contains_key("conversations") {
            Some(Shape::PairShareGpt)
        } else if let Some(p) = obj.get("prompt") {
            Some(if p.is_array() {
                Shape::PairMessages
            } else {
                Shape::PairText
            })
        } else {
            Some(Shape::PairImplicit)
        }
    }
    pub(crate) fn of(obj: &Map<String, Value>) -> Option<Shape> {
        if obj.contains_key("messages") {
            Some(Shape::Messages)
        } else if obj.contains_key("conversations") {
            Some(Shape::ShareGpt)
        } else if obj.contains_key("instruction") && obj.contains_key("output") {
            Some(Shape::Alpaca)
        } else if obj.contains_key("prompt") && obj.contains_key("completion") {
            Some(Shape::PromptCompletion)
        } else if obj.contains_key("text") {
            Some(Shape::Text)
        } else {
            None
        }
    }
}

/// The records of a file, with where each came from (1-based line for JSONL, 0-based index for
/// an array).
#[derive(Clone, Debug)]
pub struct Dataset {
    pub path: PathBuf,
    pub shape: Shape,
    pub records: Vec<Record>,
    /// Where record i came from: its line (JSONL) or index (array).
    pub origins: Vec<usize>,
    /// Whether origins are lines (JSONL) or array indexes.
    pub jsonl: bool,
}

impl Dataset {
    /// Reads and checks every record of `path`.
    pub fn load(path: &Path) -> Result<Dataset> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(path, &text)
    }

    /// Reads and checks every preference pair of `path`: records `2i` and `2i + 1` are pair
    /// i's chosen and rejected replies.
    pub fn load_pairs(path: &Path) -> Result<Dataset> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse_pairs(path, &text)
    }

    /// [`Dataset::load`] of text already read (`path` names it in errors).
    pub fn parse(path: &Path, text: &str) -> Result<Dataset> {
        Self::parse_as(path, text, false)
    }

    /// [`Dataset::load_pairs`] of text already read.
    pub fn parse_pairs(path: &Path, text: &str) -> Result<Dataset> {
        Self::parse_as(path, text, true)
    }

    fn parse_as(path: &Path, text: &str, pairs: bool) -> Result<Dataset> {
        let err = |line: usize, msg: String| Error::Data {
            path: path.to_path_buf(),
            line,
            msg,
        };
        let trimmed = text.trim_start();
        let (values, jsonl): (Vec<(usize, Value)>, bool) = if trimmed.starts_with('[') {
            let v: Value = serde_json::from_str(text)
                .map_err(|e| err(e.line(), format!("not a JSON array: {e}")))?;
            let items = v.as_array().cloned().unwrap_or_default();
            (items.into_iter().enumerate().collect(), false)
        } else {
            let mut out = Vec::new();
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let v: Value = serde_json::from_str(line)
                    .map_err(|e| err(i + 1, format!("not a JSON object: {e}")))?;
                out.push((i + 1, v));
            }
            (out, true)
        };
        if values.is_empty() {
            return Err(Error::Data {
                path: path.to_path_buf(),
                line: 0,
                msg: "no records".into(),
            });
        }
        let mut shape = None;
        let mut records = Vec::with_capacity(values.len());
        let mut origins = Vec::with_capacity(values.len());
        for (origin, v) in values {
            let fail = |m: String| {
                err(
                    origin,
                    if jsonl {
                        m
                    } else {
                        format!("record {origin}: {m}")
                    },
                )
            };
            let obj = v
                .as_object()
                .ok_or_else(|| fail("a record must be a JSON object".into()))?;
            let fields = || obj.keys().cloned().collect::<Vec<_>>().join(", ");
            let s = if pairs {
                Shape::of_pair(obj).ok_or_else(|| {
                    fail(format!(
                        "not a preference pair (fields: {}); expected prompt/chosen/rejected, chosen/rejected or conversations/chosen/rejected",
                        fields()
                    ))
                })?
            } else {
                Shape::of(obj).ok_or_else(|| {
                    fail(format!(
                        "unknown record shape (fields: {}); expected messages, conversations, instruction/output, prompt/completion or text",
                        fields()
                    ))
                })?
            };
            match shape {
                None => shape = Some(s),
                Some(first) if first != s => {
                    return Err(fail(format!(
                        "a {} record in a file of {} records",
                        s.name(),
                        first.name()
                    )))
                }
                _ => {}
            }
            if pairs {
                let (c, r) = pair(obj, s).map_err(fail)?;
                records.extend([c, r]);
                origins.extend([origin, origin]);
            } else {
                records.push(record(obj, s).map_err(fail)?);
                origins.push(origin);
            }
        }
        Ok(Dataset {
            path: path.to_path_buf(),
            shape: shape.expect("at least one record"),
            records,
            origins,
            jsonl,
        })
    }

    /// "file:line" (or "file[index]") of record i, for messages.
    pub fn origin(&self, i: usize) -> String {
        if self.jsonl {
            format!("{}:{}", self.path.display(), self.origins[i])
        } else {
            format!("{}[{}]", self.path.display(), self.origins[i])
        }
    }

    /// The error of record i, named by where it came from.
    pub fn error(&self, i: usize, msg: impl Into<String>) -> Error {
        let msg = msg.into();
        Error::Data {
            path: self.path.clone(),
            line: self.origins[i],
            msg: if self.jsonl {
                msg
            } else {
                format!("record {}: {msg}", self.origins[i])
            },
        }
    }
}

fn string_field(obj: &Map<String, Value>, key: &str) -> std::result::Result<String, String> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Null) | None => Err(format!("missing '{key}'")),
        Some(other) => Err(format!("'{key}' must be a string, not {}", kind(other))),
    }
}

pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Turns of a message list; `from`/`value` (ShareGPT) or `role`/`content` (OpenAI).
pub(crate) fn turns(
    v: &Value,
    sharegpt: bool,
    key: &str,
) -> std::result::Result<Vec<Turn>, String> {
    let list = v
        .as_array()
        .ok_or_else(|| format!("'{key}' must be a list of messages, not {}", kind(v)))?;
    if list.is_empty() {
        return Err(format!("'{key}' is empty"));
    }
    let (rk, ck) = if sharegpt {
        ("from", "value")
    } else {
        ("role", "content")
    };
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let o = m
                .as_object()
                .ok_or_else(|| format!("{key}[{i}] must be an object"))?;
            let role = string_field(o, rk).map_err(|e| format!("{key}[{i}]: {e}"))?;
            let content = match o.get(ck) {
                Some(Value::String(s)) => s.clone(),
                // OpenAI content parts: the text parts joined.
                Some(Value::Array(parts)) if !sharegpt => parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join(""),
                _ => return Err(format!("{key}[{i}]: '{ck}' must be a string")),
            };
            let role = if sharegpt {
                match role.as_str() {
                    "human" | "user" => "user".to_string(),
                    "gpt" | "assistant" | "chatgpt" | "bing" | "bard" => "assistant".to_string(),
                    "system" => "system".to_string(),
                    other => return Err(format!("{key}[{i}]: unknown speaker '{other}'")),
                }
            } else {
                role
            };
            Ok(Turn { role, content })
        })
        .collect()
}

/// The chosen and rejected records of a preference pair.
fn pair(obj: &Map<String, Value>, shape: Shape) -> std::result::Result<(Record, Record), String> {
    let reply =
        |prompt: &[Turn], side: &str, reply: Vec<Turn>| -> std::result::Result<Record, String> {
            if !reply.iter().any(|t| t.role == "assistant") {
                return Err(format!("'{side}' has no assistant message"));
            }
            let mut turns = prompt.to_vec();
            let reply_from = turns.len();
            turns.extend(reply);
            Ok(Record::Reply { turns, reply_from })
        };
    match shape {
        Shape::PairText => {
            let prompt = string_field(obj, "prompt")?;
            let side = |k: &str| -> std::result::Result<Record, String> {
                let completion = string_field(obj, k)?;
                if completion.is_empty() {
                    return Err(format!("'{k}' is empty"));
                }
                Ok(Record::Text {
                    prompt: prompt.clone(),
                    completion,
                })
            };
            Ok((side("chosen")?, side("rejected")?))
        }
        Shape::PairMessages => {
            let prompt = turns(&obj["prompt"], false, "prompt")?;
            let c = reply(&prompt, "chosen", turns(&obj["chosen"], false, "chosen")?)?;
            let r = reply(
                &prompt,
                "rejected",
                turns(&obj["rejected"], false, "rejected")?,
            )?;
            Ok((c, r))
        }
        Shape::PairImplicit => {
            let c = turns(&obj["chosen"], false, "chosen")?;
            let r = turns(&obj["rejected"], false, "rejected")?;
            let shared = c.iter().zip(&r).take_while(|(a, b)| a == b).count();
            if shared == 0 {
                return Err("'chosen' and 'rejected' share no prompt (their first messages differ); give 'prompt' explicitly".into());
            }
            Ok((
                reply(&c[..shared], "chosen", c[shared..].to_vec())?,
                reply(&r[..shared], "rejected", r[shared..].to_vec())?,
            ))
        }
        Shape::PairShareGpt => {
            let mut prompt = Vec::new();
            if let Ok(s) = string_field(obj, "system") {
                if !s.is_empty() {
                    prompt.push(Turn {
                        role: "system".into(),
                        content: s,
                    });
                }
            }
            prompt.extend(turns(&obj["conversations"], true, "conversations")?);
            let one = |k: &str| -> std::result::Result<Vec<Turn>, String> {
                match &obj[k] {
                    v @ Value::Object(_) => turns(&Value::Array(vec![v.clone()]), true, k),
                    v => Err(format!(
                        "'{k}' must be a {{from, value}} object, not {}",
                        kind(v)
                    )),
                }
            };
            let c = reply(&prompt, "chosen", one("chosen")?)?;
            let r = reply(&prompt, "rejected", one("rejected")?)?;
            Ok((c, r))
        }
        other => Err(format!(
            "a {} record is not a preference pair",
            other.name()
        )),
    }
}

pub(crate) fn record(
    obj: &Map<String, Value>,
    shape: Shape,
) -> std::result::Result<Record, String> {
    let rec = match shape {
        Shape::Messages => Record::Chat(turns(&obj["messages"], false, "messages")?),
        Shape::ShareGpt => Record::Chat(turns(&obj["conversations"], true, "conversations")?),
        Shape::Alpaca => {
            let instruction = string_field(obj, "instruction")?;
            let input = match obj.get("input") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(o) => return Err(format!("'input' must be a string, not {}", kind(o))),
            };
            let user = if input.is_empty() {
                instruction
            } else {
                format!("{instruction}\n{input}")
            };
            let mut t = Vec::new();
            if let Ok(s) = string_field(obj, "system") {
                if !s.is_empty() {
                    t.push(Turn {
                        role: "system".into(),
                        content: s,
                    });
                }
            }
            t.push(Turn {
                role: "user".into(),
                content: user,
            });
            t.push(Turn {
                role: "assistant".into(),
                content: string_field(obj, "output")?,
            });
            Record::Chat(t)
        }
        Shape::PromptCompletion => match (&obj["prompt"], &obj["completion"]) {
            (Value::String(p), Value::String(c)) => Record::Text {
                prompt: p.clone(),
                completion: c.clone(),
            },
            (p @ Value::Array(_), c @ Value::Array(_)) => {
                let mut t = turns(p, false, "prompt")?;
                t.extend(turns(c, false, "completion")?);
                Record::Chat(t)
            }
            (p, c) => {
                return Err(format!(
                    "'prompt' and 'completion' must both be strings or both message lists (got {} and {})",
                    kind(p),
                    kind(c)
                ))
            }
        },
        Shape::Text => Record::Text {
            prompt: String::new(),
            completion: string_field(obj, "text")?,
        },
        pair => return Err(format!("a {} record is a preference pair, not an SFT record", pair.name())),
    };
    if let Record::Chat(t) = &rec {
        if !t.iter().any(|x| x.role == "assistant") {
            return Err("the conversation has no assistant turn to learn".into());
        }
    }
    if let Record::Text { completion, .. } = &rec {
        if completion.is_empty() {
            return Err("the text to learn is empty".into());
        }
    }
    Ok(rec)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Dataset> {
        Dataset::parse(Path::new("d.jsonl"), text)
    }

    #[test]
    fn every_shape_is_read() {
        let d = parse(r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"HELLO"}]}"#).unwrap();
        assert_eq!(d.shape, Shape::Messages);
        let d = parse("\n{\"conversations\":[{\"from\":\"human\",\"value\":\"a\"},{\"from\":\"gpt\",\"value\":\"b\"}]}\n\n").unwrap();
        assert_eq!(
            d.records[0],
            Record::Chat(vec![
                Turn {
                    role: "user".into(),
                    content: "a".into()
                },
                Turn {
                    role: "assistant".into(),
                    content: "b".into()
                }
            ])
        );
        assert_eq!(d.origins, vec![2]);
        let d = Dataset::parse(
            Path::new("a.json"),
            r#"[{"instruction":"Add","input":"2 3","output":"5"},{"instruction":"Hi","input":"","output":"Hello"}]"#,
        )
        .unwrap();
        assert_eq!(d.shape, Shape::Alpaca);
        match &d.records[0] {
            Record::Chat(t) => assert_eq!(t[0].content, "Add\n2 3"),
            r => panic!("{r:?}"),
        }
        let d = parse(r#"{"prompt":"Q: 1+1? A:","completion":" 2"}"#).unwrap();
        assert_eq!(
            d.records[0],
            Record::Text {
                prompt: "Q: 1+1? A:".into(),
                completion: " 2".into()
            }
        );
        let d = parse(r#"{"prompt":[{"role":"user","content":"x"}],"completion":[{"role":"assistant","content":"y"}]}"#).unwrap();
        assert!(matches!(&d.records[0], Record::Chat(t) if t.len() == 2));
        let d = parse(r#"{"text":"plain"}"#).unwrap();
        assert_eq!(d.shape, Shape::Text);
    }

    #[test]
    fn pair_shapes_are_read() {
        let p = |t: &str| Dataset::parse_pairs(Path::new("p.jsonl"), t);
        let d = p(r#"{"prompt":"Q:","chosen":" yes","rejected":" no"}"#).unwrap();
        assert_eq!(d.shape, Shape::PairText);
        assert_eq!(d.records.len(), 2);
        assert_eq!(
            d.records[1],
            Record::Text {
                prompt: "Q:".into(),
                completion: " no".into()
            }
        );
        let d = p(r#"{"prompt":[{"role":"user","content":"hi"}],"chosen":[{"role":"assistant","content":"A"}],"rejected":[{"role":"assistant","content":"B"}]}"#).unwrap();
        assert_eq!(d.shape, Shape::PairMessages);
        assert!(
            matches!(&d.records[0], Record::Reply { turns, reply_from: 1 } if turns[1].content == "A")
        );
        let d = p(r#"{"chosen":[{"role":"user","content":"hi"},{"role":"assistant","content":"A"}],"rejected":[{"role":"user","content":"hi"},{"role":"assistant","content":"B"}]}"#).unwrap();
        assert_eq!(d.shape, Shape::PairImplicit);
        assert!(
            matches!(&d.records[1], Record::Reply { turns, reply_from: 1 } if turns[1].content == "B")
        );
        let d = Dataset::parse_pairs(
            Path::new("dpo.json"),
            r#"[{"conversations":[{"from":"human","value":"hi"}],"chosen":{"from":"gpt","value":"A"},"rejected":{"from":"gpt","value":"B"}}]"#,
        )
        .unwrap();
        assert_eq!(d.shape, Shape::PairShareGpt);
        assert_eq!(d.origins, vec![0, 0]);
        assert!(
            matches!(&d.records[0], Record::Reply { turns, reply_from: 1 } if turns[0].role == "user" && turns[1].role == "assistant")
        );
    }

    #[test]
    fn bad_pairs_name_their_line() {
        let p = |t: &str| {
            Dataset::parse_pairs(Path::new("p.jsonl"), t)
                .unwrap_err()
                .to_string()
        };
        let ok = r#"{"prompt":"Q","chosen":"a","rejected":"b"}"#;
        assert_eq!(
            p(&format!(
                "{ok}\n{}",
                r#"{"prompt":"Q","chosen":"a","rejected":3}"#
            )),
            "p.jsonl:2: 'rejected' must be a string, not a number"
        );
        assert!(p(&format!("{ok}\n\n{}", r#"{"text":"a"}"#))
            .starts_with("p.jsonl:3: not a preference pair (fields: text)"));
        assert!(p(&format!("{ok}\n{{bad")).starts_with("p.jsonl:2: not a JSON object"));
        assert_eq!(
            p(r#"{"prompt":"Q","chosen":"","rejected":"b"}"#),
            "p.jsonl:1: 'chosen' is empty"
        );
        let e = p(
            r#"{"prompt":[{"role":"user","content":"x"}],"chosen":[{"role":"user","content":"y"}],"rejected":[{"role":"assistant","content":"z"}]}"#,
        );
        assert_eq!(e, "p.jsonl:1: 'chosen' has no assistant message");
        let e = p(
            r#"{"conversations":[{"from":"human","value":"x"}],"chosen":"a","rejected":{"from":"gpt","value":"b"}}"#,
        );
        assert!(
            e.contains("'chosen' must be a {from, value} object, not a string"),
            "{e}"
        );
    }

    #[test]
    fn bad_records_name_their_line() {
        let e = parse("{\"text\":\"a\"}\n{\"text\": 3}\n")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "d.jsonl:2: 'text' must be a string, not a number");
        let e = parse("{\"text\":\"a\"}\n\n{oops\n")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("d.jsonl:3: not a JSON object"), "{e}");
        let e = parse("{\"text\":\"a\"}\n{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\",\"content\":\"y\"}]}").unwrap_err().to_string();
        assert_eq!(e, "d.jsonl:2: a messages record in a file of text records");
        let e = parse("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no assistant turn"), "{e}");
        let e = parse("{\"foo\":1}").unwrap_err().to_string();
        assert!(e.contains("unknown record shape (fields: foo)"), "{e}");
        let e = parse("").unwrap_err().to_string();
        assert!(e.contains("no records"), "{e}");
        let e = Dataset::parse(Path::new("a.json"), "[{\"text\":\"a\"}, 5]")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "a.json:1: record 1: a record must be a JSON object");
        let e = parse("{\"conversations\":[{\"from\":\"robot\",\"value\":\"x\"}]}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown speaker 'robot'"), "{e}");
    }
}
