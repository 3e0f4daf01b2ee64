//! Lark grammars (llguidance's dialect) that make a model write well-formed tool calls in its own
//! format: for `tool_choice` `required` or a named tool the whole reply is constrained
//! ([`required`]); for `auto` the model writes freely until it starts a call, and the grammar
//! takes over from the trigger ([`lazy`], as llama.cpp's lazy grammars).
//!
//! Markup that is one token of the vocabulary (`<tool_call>`, `[TOOL_CALLS]`) is written as
//! that token (`<[id]>`), so the model writes it the way it was trained to; otherwise as text.
//! Each tool's arguments are a `%json` sub-grammar of its parameters schema; the caller decides
//! which schema (a tool's own, or any object where the tool's cannot be compiled and is not
//! strict).
//!
//! FunctionGemma's bodies are not JSON: only the function name is constrained there.
//! Harmony (GPT-OSS) writes one call per reply (`<|call|>` ends generation), so its `required`
//! grammar is one call message and there is no lazy grammar: every harmony message starts with
//! `<|channel|>`, and a call differs from reasoning only in its recipient text.

use serde_json::{json, Value};

use super::ToolFormat;
use crate::constraint::{adapt_schema, JSON_WHITESPACE};

/// A tool as the grammar sees it: its name and the schema its arguments must follow.
#[derive(Clone, Debug)]
pub struct GrammarTool {
    pub name: String,
    pub arguments: Value,
}

/// Where a lazy grammar starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// When this token is sampled; the grammar constrains what follows it.
    Token(u32),
    /// When the reply's first non-whitespace character is `{` (possibly after a ```` ```json ````
    /// fence line); the grammar constrains the reply from its start (the tokens so far are fed
    /// to it).
    JsonStart,
}

/// A grammar and the trigger that switches it on.
#[derive(Clone, Debug)]
pub struct LazyGrammar {
    pub trigger: Trigger,
    pub lark: String,
}

fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// `text` as one token where the vocabulary has it, else as a literal.
fn mark(text: &str, token: &dyn Fn(&str) -> Option<u32>) -> String {
    match token(text) {
        Some(id) => format!("<[{id}]>"),
        None => lit(text),
    }
}

/// A `%json` sub-grammar, adapted and with bounded whitespace as [`crate::constraint`] does
/// for a whole reply.
fn json_rule(schema: &Value) -> String {
    let mut s = schema.clone();
    adapt_schema(&mut s);
    if let Some(o) = s.as_object_mut() {
        o.insert(
            "x-guidance".into(),
            json!({"whitespace_pattern": JSON_WHITESPACE}),
        );
    }
    format!("%json {s}")
}

/// `{"name": N, KEY: args}` for each tool, as alternatives `call: c0 | c1 | ...`.
fn call_rules(tools: &[GrammarTool], args_key: &str) -> String {
    let mut out = String::new();
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("c{i}")).collect();
    out.push_str(&format!("call: {}\n", alts.join(" | ")));
    for (i, t) in tools.iter().enumerate() {
        let schema = json!({
            "type": "object",
            "properties": {"name": {"const": t.name}, args_key: t.arguments},
            "required": ["name", args_key],
            "additionalProperties": false,
        });
        out.push_str(&format!("c{i}: {}\n", json_rule(&schema)));
    }
    out
}

/// `name MARK {args}` for each tool (Mistral's `name[ARGS]{...}`, harmony's
/// `name <|constrain|>json<|message|>{...}`), as alternatives.
fn named_args_rules(tools: &[GrammarTool], mark: &str) -> String {
    let mut out = String::new();
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("c{i}")).collect();
    out.push_str(&format!("call: {}\n", alts.join(" | ")));
    for (i, t) in tools.iter().enumerate() {
        out.push_str(&format!("c{i}: {} {mark} a{i}\n", lit(&t.name)));
        out.push_str(&format!("a{i}: {}\n", json_rule(&t.arguments)));
    }
    out
}

/// A grammar for a reply that must be tool calls (one, or several when `parallel`), in
/// `format`, of `tools` (already narrowed to the named tool by the caller). `token` finds
/// markup that is one token.
pub fn required(
    format: ToolFormat,
    tools: &[GrammarTool],
    parallel: bool,
    token: &dyn Fn(&str) -> Option<u32>,
) -> String {
    // A separator may also end the reply, so that the model can stop after any call (after
    // a newline, a forced next opener made models loop on calls).
    let more = |block: &str, sep: &str| {
        if parallel && sep != "\"\"" {
            format!("start: {block} ({sep} {block})* {sep}?\n")
        } else if parallel {
            format!("start: {block}+\n")
        } else {
            format!("start: {block}\n")
        }
    };
    match format {
        ToolFormat::Hermes => {
            let open = mark("<tool_call>", token);
            let close = mark("</tool_call>", token);
            format!(
                "{}block: {open} \"\\n\" call \"\\n\" {close}\n{}",
                more("block", "\"\\n\""),
                call_rules(tools, "arguments")
            )
        }
        ToolFormat::Llama3Json => {
            format!(
                "{}{}",
                more("call", "\"; \""),
                call_rules(tools, "parameters")
            )
        }
        ToolFormat::Generic => format!(
            "{}{}",
            more("call", "\"\\n\""),
            call_rules(tools, "arguments")
        ),
        ToolFormat::Mistral { v11: false } => {
            let open = mark("[TOOL_CALLS]", token);
            let list = if parallel {
                "call (\", \" call)*"
            } else {
                "call"
            };
            format!(
                "start: {open} \"[\" {list} \"]\"\n{}",
                call_rules(tools, "arguments")
            )
        }
        ToolFormat::Mistral { v11: true } => {
            let open = mark("[TOOL_CALLS]", token);
            format!(
                "{}block: {open} call\n{}",
                more("block", "\"\""),
                named_args_rules(tools, &mark("[ARGS]", token))
            )
        }
        ToolFormat::Harmony => {
            let head = format!(
                "{} \"commentary to=functions.\"",
                mark("<|channel|>", token)
            );
            let sep = format!(
                "\" \" {} \"json\" {}",
                mark("<|constrain|>", token),
                mark("<|message|>", token)
            );
            format!("start: {head} call\n{}", named_args_rules(tools, &sep))
        }
        ToolFormat::FunctionGemma => {
            let names: Vec<String> = tools.iter().map(|t| lit(&t.name)).collect();
            let esc = mark("<escape>", token);
            format!(
                "{}block: {} \"call:\" name \"{{\" body \"}}\" {}\nname: {}\nbody: (BODY | {esc})*\nBODY: /[^{{}}<]+/\n",
                more("block", "\"\""),
                mark("<start_function_call>", token),
                mark("<end_function_call>", token),
                names.join(" | ")
            )
        }
    }
}

/// A bare-calls grammar as a [`Trigger::JsonStart`] grammar: the reply from its start, with
/// leading whitespace and an optional Markdown fence around the calls.
fn json_start(calls: &str) -> String {
    calls
        .replacen("start: ", "start: WS? FENCE? ", 1)
        .replacen("\n", " FENCE_END?\n", 1)
        + "WS: /[ \\t\\n]+/\nFENCE: /```(json)?\\n/\nFENCE_END: /\\n?```/\n"
}

/// The lazy grammars for `tool_choice: auto`: each starts at its trigger. Empty when the
/// format's call opener is not a single token and calls cannot start at the reply's start.
pub fn lazy(
    format: ToolFormat,
    tools: &[GrammarTool],
    parallel: bool,
    token: &dyn Fn(&str) -> Option<u32>,
) -> Vec<LazyGrammar> {
    let full = required(format, tools, parallel, token);
    match format {
        ToolFormat::Hermes => {
            let (Some(open), Some(_)) = (token("<tool_call>"), token("</tool_call>")) else {
                return Vec::new();
            };
            // The reply after the first opener: the rest of that call, then more whole ones.
            let close = mark("</tool_call>", token);
            let rest = if parallel {
                "start: \"\\n\" call \"\\n\" CLOSE (\"\\n\" block)* \"\\n\"?\n"
            } else {
                "start: \"\\n\" call \"\\n\" CLOSE \"\\n\"?\n"
            };
            let lark = format!(
                "{}block: {} \"\\n\" call \"\\n\" CLOSE\n{}",
                rest,
                mark("<tool_call>", token),
                call_rules(tools, "arguments")
            )
            .replace("CLOSE", &close);
            // Hermes models also answer with the bare call object (see the parser).
            let bare = required(ToolFormat::Generic, tools, parallel, token);
            vec![
                LazyGrammar {
                    trigger: Trigger::Token(open),
                    lark,
                },
                LazyGrammar {
                    trigger: Trigger::JsonStart,
                    lark: json_start(&bare),
                },
            ]
        }
        ToolFormat::Llama3Json | ToolFormat::Generic => {
            let lark = json_start(&full);
            let mut v = vec![LazyGrammar {
                trigger: Trigger::JsonStart,
                lark,
            }];
            if let (ToolFormat::Llama3Json, Some(tag)) = (format, token("<|python_tag|>")) {
                v.push(LazyGrammar {
                    trigger: Trigger::Token(tag),
                    lark: full,
                });
            }
            v
        }
        ToolFormat::Harmony => Vec::new(),
        ToolFormat::Mistral { .. } | ToolFormat::FunctionGemma => {
            let opener = if format == ToolFormat::FunctionGemma {
                "<start_function_call>"
            } else {
                "[TOOL_CALLS]"
            };
            let Some(id) = token(opener) else {
                return Vec::new();
            };
            // The same grammar without its first opener.
            let mark = format!("<[{id}]>");
            let lark = match full.split_once('\n') {
                Some((start, rest)) if start.contains(&mark) => {
                    // Mistral lists: `start: OPEN "[" ...`; after the trigger, the list.
                    format!("{}\n{rest}", start.replacen(&mark, "", 1))
                }
                Some((_, rest)) => {
                    // Block grammars: the first block without its opener, then whole blocks.
                    let more = if parallel { " block*" } else { "" };
                    let first = rest
                        .lines()
                        .find(|l| l.starts_with("block:"))
                        .map(|l| l.replacen("block:", "", 1).replacen(&mark, "", 1))
                        .unwrap_or_default();
                    format!("start: {first}{more}\n{rest}")
                }
                None => return Vec::new(),
            };
            vec![LazyGrammar {
                trigger: Trigger::Token(id),
                lark,
            }]
        }
    }
}
