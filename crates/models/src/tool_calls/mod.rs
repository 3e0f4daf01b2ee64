//! Tool calls in model output: which wire format a model writes its calls in (chosen from its
//! chat template, never from its name), and the parser that takes the calls out of the
//! generated text, incrementally ([`ToolCallParser`]) or at once ([`parse_tool_calls`]).
//!
//! Formats (the families hf2q runs, after the parsers of vLLM and llama.cpp):
//! - [`ToolFormat::Hermes`]: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
//!   repeated for parallel calls (Hermes 2/3, Qwen2.5, Qwen3); a reply that is only the call
//!   object, bare or in a ```` ```json ```` fence, counts too (Qwen2.5-Coder writes that);
//! - [`ToolFormat::Llama3Json`]: the whole reply is `{"name": ..., "parameters": {...}}`
//!   (Llama 3.1/3.2/3.3), optionally after `<|python_tag|>`, several separated by `;`;
//! - [`ToolFormat::Mistral`]: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the
//!   newer `[TOOL_CALLS]name[ARGS]{...}`;
//! - [`ToolFormat::FunctionGemma`]: `call:name{key:<escape>v<escape>}` between
//!   `<start_function_call>` and `<end_function_call>`;
//! - [`ToolFormat::Harmony`]: GPT-OSS's channels, `<|channel|>commentary to=functions.name
//!   <|constrain|>json<|message|>{...}<|call|>`, with the `analysis` channel's text as
//!   reasoning ([`ToolEvent::Reasoning`]) and the `final` channel's as content (see `harmony`);
//! - [`ToolFormat::Generic`]: templates that know no tools. The tools are described in the
//!   system prompt ([`generic_tool_prompt`]) and calls are JSON objects, one per line, as in
//!   Llama 3; Gemma 3's ```` ```tool_code ```` blocks (`name(key="v")`) are read too.
//!
//! Parsing rules: a call counts only when it is complete and names a declared tool; anything
//! else (malformed, truncated, an unknown name) is returned as content, never an error. While
//! streaming, text that may still turn into a call is held back, a call's `id`/`name` is
//! reported once and its arguments as raw text fragments (never re-serialised partial JSON).
//!
//! What it is not: tool execution, or the OpenAI wire shapes (the server's).

mod convert;
pub mod grammar;
mod harmony;
mod scan;
mod stream;

#[cfg(test)]
mod tests;

pub use harmony::MARKERS as HARMONY_MARKERS;
pub use stream::{ToolCallParser, ToolEvent};

/// The wire format a model writes tool calls in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    /// `v11`: the `name[ARGS]{...}` form of newer templates.
    Mistral {
        v11: bool,
    },
    FunctionGemma,
    /// GPT-OSS's harmony messages; its parser also separates reasoning from content, so it
    /// reads every reply of such a model, with tools or without.
    Harmony,
    Generic,
}

impl ToolFormat {
    /// The format a chat template's model writes, from the markup the template itself uses
    /// (how it renders assistant tool calls or describes them to the model).
    pub fn detect(template: &str) -> ToolFormat {
        if template.contains("<|channel|>") && template.contains("<|message|>") {
            ToolFormat::Harmony
        } else if template.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if template.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral {
                v11: template.contains("[ARGS]"),
            }
        } else if template.contains("<start_function_call>") {
            ToolFormat::FunctionGemma
        } else if template.contains("<|python_tag|>")
            || (template.contains("<|start_header_id|>")
                && template.contains("\"parameters\"")
                && template.contains("tools"))
        {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Generic
        }
    }

    /// Whether every reply is parsed, with tools or without: harmony replies carry channels (the
    /// reasoning apart from the answer) and markup that must not reach the content.
    pub fn reads_every_reply(self) -> bool {
        self == ToolFormat::Harmony
    }

    /// Whether the template renders `tools` itself; when not, the caller adds
    /// [`generic_tool_prompt`] to the system message.
    pub fn template_renders_tools(template: &str) -> bool {
        template.contains("tools")
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3Json => "llama3_json",
            ToolFormat::Mistral { v11: false } => "mistral",
            ToolFormat::Mistral { v11: true } => "mistral_v11",
            ToolFormat::FunctionGemma => "function_gemma",
            ToolFormat::Harmony => "harmony",
            ToolFormat::Generic => "generic",
        }
    }
}

/// One tool the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    /// JSON Schema of the arguments (`{"type": "object", "properties": {}}` when absent).
    pub parameters: serde_json::Value,
    /// Arguments must follow `parameters` exactly (OpenAI's `strict`).
    pub strict: bool,
}

/// One parsed call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
    /// An id the model wrote itself (Mistral), if any.
    pub id: Option<String>,
}

/// A whole reply split into text and calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedReply {
    /// The text outside the calls (whitespace-only text around calls is dropped).
    pub content: String,
    pub calls: Vec<ToolCall>,
    /// The model's reasoning, kept apart from the content (harmony's `analysis` channel).
    pub reasoning: String,
}

/// Splits a complete reply into content and tool calls (see the module docs for the rules).
pub fn parse_tool_calls(
    format: ToolFormat,
    tool_names: &[String],
    parallel: bool,
    text: &str,
) -> ParsedReply {
    let mut p = ToolCallParser::new(format, tool_names.to_vec(), parallel);
    let mut events = p.push(text);
    events.extend(p.finish());
    collect(events)
}

/// Folds parser events into a reply; incomplete calls go back into the content as their text.
pub fn collect(events: Vec<ToolEvent>) -> ParsedReply {
    let mut out = ParsedReply::default();
    // Calls by parser index; `None` once dropped as incomplete.
    let mut calls: Vec<Option<ToolCall>> = Vec::new();
    for ev in events {
        match ev {
            ToolEvent::Content(t) => out.content.push_str(&t),
            ToolEvent::Reasoning(t) => out.reasoning.push_str(&t),
            ToolEvent::Start { index, name, id } => {
                if calls.len() <= index {
                    calls.resize(index + 1, None);
                }
                calls[index] = Some(ToolCall {
                    name,
                    arguments: String::new(),
                    id,
                });
            }
            ToolEvent::Args { index, text } => {
                if let Some(Some(c)) = calls.get_mut(index) {
                    c.arguments.push_str(&text);
                }
            }
            ToolEvent::End {
                index,
                complete,
                raw,
            } => {
                if !complete {
                    if let Some(slot) = calls.get_mut(index) {
                        *slot = None;
                    }
                    out.content.push_str(&raw);
                }
            }
        }
    }
    out.calls = calls.into_iter().flatten().collect();
    if !out.calls.is_empty() && out.content.trim().is_empty() {
        out.content.clear();
    }
    out
}

/// The system-prompt text that describes `tools` to a model whose template does not render
/// them, asking for the [`ToolFormat::Generic`] call format.
pub fn generic_tool_prompt(tools: &[ToolSpec]) -> String {
    let mut s =
        String::from("You can call these tools (JSON Schema of each tool's arguments given):\n");
    for t in tools {
        let mut v = serde_json::json!({"name": t.name, "parameters": t.parameters});
        if let Some(d) = &t.description {
            v["description"] = d.clone().into();
        }
        s.push_str(&v.to_string());
        s.push('\n');
    }
    s.push_str(
        "To call a tool, reply with only a JSON object, one line per call: \
         {\"name\": \"<tool name>\", \"arguments\": {<arguments>}}. \
         Otherwise reply normally.",
    );
    s
}
