//! The reply side of tool calling: calls taken out of the generated text and shaped as OpenAI
//! shapes them, whole (`message.tool_calls`) or streamed (`delta.tool_calls`: keyed by `index`,
//! `id`, `type` and `name` once on a call's first delta, then `arguments` in raw fragments).
//! Reasoning the format keeps apart (harmony's analysis channel) goes to `reasoning_content`, as
//! vLLM and llama.cpp's server return it.
//!
//! Every call gets a fresh id (`call_` and 24 letters or digits; 9 letters or digits for the
//! Mistral format, whose templates require exactly that when the id comes back in a `tool`
//! message).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use hf2q_models::tool_calls::{ToolCallParser, ToolEvent, ToolFormat};
use serde_json::{json, Value};

use super::ToolsRequest;

const ALNUM: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";

/// A new tool-call id (unique per process, not guessable from the previous one; not a secret).
pub fn call_id(format: ToolFormat) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let len = if matches!(format, ToolFormat::Mistral { .. }) {
        9
    } else {
        24
    };
    let mut out = String::with_capacity(len + 5);
    if len == 24 {
        out.push_str("call_");
    }
    let mut h = RandomState::new().build_hasher();
    h.write_u64(n);
    let mut x = h.finish();
    for i in 0..len {
        if i % 10 == 9 {
            let mut h = RandomState::new().build_hasher();
            h.write_u64(x ^ n);
            x = h.finish();
        }
        out.push(ALNUM[(x % ALNUM.len() as u64) as usize] as char);
        x /= ALNUM.len() as u64;
    }
    out
}

fn call_json(id: &str, name: &str, arguments: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// A finished reply taken apart.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MessageParts {
    pub content: String,
    /// Empty when the format keeps no reasoning apart.
    pub reasoning: String,
    /// Empty when it made no call.
    pub tool_calls: Vec<Value>,
}

/// A finished reply: its content, reasoning and `tool_calls`.
pub fn message_calls(format: ToolFormat, tools: &ToolsRequest, text: &str) -> MessageParts {
    let r = hf2q_models::tool_calls::parse_tool_calls(format, &tools.names(), tools.parallel, text);
    let tool_calls = r
        .calls
        .iter()
        .map(|c| call_json(&call_id(format), &c.name, &c.arguments))
        .collect();
    MessageParts {
        content: r.content,
        reasoning: r.reasoning,
        tool_calls,
    }
}

/// One streamed choice's tool-call state.
pub struct StreamCalls {
    parser: ToolCallParser,
    format: ToolFormat,
}

impl StreamCalls {
    pub fn new(format: ToolFormat, tools: &ToolsRequest) -> StreamCalls {
        StreamCalls {
            parser: ToolCallParser::new(format, tools.names(), tools.parallel),
            format,
        }
    }

    /// Whether a call was streamed (the finish reason is then `tool_calls`).
    pub fn has_calls(&self) -> bool {
        self.parser.has_calls()
    }

    /// The `delta` objects for the next piece of generated text.
    pub fn push(&mut self, text: &str) -> Vec<Value> {
        let ev = self.parser.push(text);
        self.deltas(ev)
    }

    /// The deltas that the end of the reply releases (held-back text).
    pub fn finish(&mut self) -> Vec<Value> {
        let ev = self.parser.finish();
        self.deltas(ev)
    }

    fn deltas(&self, events: Vec<ToolEvent>) -> Vec<Value> {
        let mut out = Vec::new();
        for e in events {
            match e {
                ToolEvent::Content(t) => out.push(json!({"content": t})),
                ToolEvent::Reasoning(t) => out.push(json!({"reasoning_content": t})),
                ToolEvent::Start { index, name, .. } => {
                    let id = call_id(self.format);
                    let mut c = call_json(&id, &name, "");
                    c["index"] = index.into();
                    out.push(json!({"tool_calls": [c]}));
                }
                ToolEvent::Args { index, text } => out.push(
                    json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]}),
                ),
                // A call cut off by the token limit: its fragments were sent; the finish
                // reason (`length`) tells the client.
                ToolEvent::End { .. } => {}
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat_tools::ToolChoice;
    use hf2q_models::tool_calls::ToolSpec;

    fn tools() -> ToolsRequest {
        ToolsRequest {
            tools: vec![ToolSpec {
                name: "get_weather".into(),
                description: None,
                parameters: json!({"type": "object"}),
                strict: false,
            }],
            choice: ToolChoice::Auto,
            parallel: true,
            json: json!([]),
        }
    }

    #[test]
    fn harmony_reasoning_is_kept_apart_whole_and_streamed() {
        let text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Answer.";
        let parts = message_calls(ToolFormat::Harmony, &ToolsRequest::none(), text);
        let want = MessageParts {
            content: "Answer.".into(),
            reasoning: "Think.".into(),
            tool_calls: Vec::new(),
        };
        assert_eq!(parts, want);
        let mut s = StreamCalls::new(ToolFormat::Harmony, &ToolsRequest::none());
        let mut deltas = Vec::new();
        for piece in text.as_bytes().chunks(3) {
            deltas.extend(s.push(std::str::from_utf8(piece).unwrap()));
        }
        deltas.extend(s.finish());
        let field = |k: &str| -> String { deltas.iter().filter_map(|d| d[k].as_str()).collect() };
        assert_eq!(field("reasoning_content"), "Think.");
        assert_eq!(field("content"), "Answer.");
        assert!(!s.has_calls());
        // With tools, a call to a declared function is a call; without, its body is content.
        let call = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}";
        let parts = message_calls(ToolFormat::Harmony, &tools(), call);
        assert_eq!(parts.tool_calls.len(), 1);
        assert_eq!(
            parts.tool_calls[0]["function"]["arguments"],
            "{\"city\":\"Paris\"}"
        );
        let parts = message_calls(ToolFormat::Harmony, &ToolsRequest::none(), call);
        assert_eq!(parts.content, "{\"city\":\"Paris\"}");
    }

    #[test]
    fn ids_are_unique_and_shaped() {
        let a = call_id(ToolFormat::Hermes);
        let b = call_id(ToolFormat::Hermes);
        assert_ne!(a, b);
        assert!(a.starts_with("call_") && a.len() == 29, "{a}");
        let m = call_id(ToolFormat::Mistral { v11: false });
        assert!(
            m.len() == 9 && m.chars().all(|c| c.is_ascii_alphanumeric()),
            "{m}"
        );
    }

    #[test]
    fn stream_deltas_reassemble_to_the_whole_message() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";
        let parts = message_calls(ToolFormat::Hermes, &tools(), text);
        assert_eq!(parts.content, "");
        let whole = parts.tool_calls;
        assert_eq!(whole.len(), 2);
        let mut s = StreamCalls::new(ToolFormat::Hermes, &tools());
        let mut deltas = Vec::new();
        for piece in text.as_bytes().chunks(5) {
            deltas.extend(s.push(std::str::from_utf8(piece).unwrap()));
        }
        deltas.extend(s.finish());
        assert!(s.has_calls());
        // Reassemble as a client does: per index, id/name once, arguments concatenated.
        let mut calls: Vec<(String, String, String)> = Vec::new();
        for d in &deltas {
            assert!(
                d.get("content").is_none(),
                "markup leaked into content: {d}"
            );
            for c in d["tool_calls"].as_array().unwrap() {
                let i = c["index"].as_u64().unwrap() as usize;
                if let Some(id) = c["id"].as_str() {
                    assert_eq!(calls.len(), i, "indexes increase by one");
                    calls.push((
                        id.into(),
                        c["function"]["name"].as_str().unwrap().into(),
                        String::new(),
                    ));
                }
                calls[i]
                    .2
                    .push_str(c["function"]["arguments"].as_str().unwrap());
            }
        }
        assert_eq!(calls.len(), 2);
        assert_ne!(calls[0].0, calls[1].0);
        for (c, w) in calls.iter().zip(&whole) {
            assert_eq!(c.1, w["function"]["name"]);
            assert_eq!(c.2, w["function"]["arguments"]);
        }
    }
}
