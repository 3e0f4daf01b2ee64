//! What a chat request needs before generation: the messages and `tools` variable its chat
//! template takes, and the constraint that shapes the reply (a JSON schema, or the model's own
//! tool-call format).
//!
//! Templates that render tools themselves get the messages as OpenAI sends them (assistant
//! `tool_calls` with their arguments as JSON objects, `tool` messages); GPT-OSS's (harmony) also
//! gets a call's `reasoning_content` as its `thinking`. For the others
//! ([`ToolFormat::Generic`]) the tools are described in the system message and calls and
//! results become plain turns: an assistant turn of JSON call lines, a user turn
//! "Tool result ...", consecutive results merged (Gemma's template requires alternating
//! roles).

use hf2q_models::constraint::{Constraint, ConstraintEnv, GrammarSpec};
use hf2q_models::tokenizer::Tokenizer;
use hf2q_models::tool_calls::grammar::{self, GrammarTool};
use hf2q_models::tool_calls::{generic_tool_prompt, ToolFormat, HARMONY_MARKERS};
use hf2q_models::Error as ModelError;
use serde_json::{json, Value};

use super::{ToolChoice, ToolsRequest};
use crate::error::{ApiError, ApiResult};

/// The messages and `tools` variable to render.
pub fn template_inputs(
    messages: &[Value],
    tools: Option<&ToolsRequest>,
    format: ToolFormat,
    renders_tools: bool,
) -> (Vec<Value>, Option<Value>) {
    let active = tools.filter(|t| t.active());
    if format == ToolFormat::Harmony {
        return (harmony_messages(messages), active.map(|t| t.json.clone()));
    }
    if renders_tools && format != ToolFormat::Generic {
        return (messages.to_vec(), active.map(|t| t.json.clone()));
    }
    let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    for m in messages {
        let role = m["role"].as_str().unwrap_or_default();
        let content = m["content"].as_str().unwrap_or_default();
        match role {
            "assistant" if m.get("tool_calls").is_some() => {
                let mut lines: Vec<String> = Vec::new();
                if !content.is_empty() {
                    lines.push(content.to_string());
                }
                for c in m["tool_calls"].as_array().into_iter().flatten() {
                    let f = &c["function"];
                    lines.push(json!({"name": f["name"], "arguments": f["arguments"]}).to_string());
                }
                out.push(json!({"role": "assistant", "content": lines.join("\n")}));
            }
            "tool" => {
                let who = m
                    .get("name")
                    .or_else(|| m.get("tool_call_id"))
                    .and_then(Value::as_str)
                    .unwrap_or("tool");
                let text = format!("Tool result ({who}): {content}");
                match out.last_mut() {
                    Some(prev) if prev["role"] == "user" && prev["tool_result"] == true => {
                        let joined =
                            format!("{}\n{text}", prev["content"].as_str().unwrap_or_default());
                        prev["content"] = joined.into();
                    }
                    _ => out.push(json!({"role": "user", "content": text, "tool_result": true})),
                }
            }
            _ => out.push(m.clone()),
        }
    }
    for m in &mut out {
        if let Some(o) = m.as_object_mut() {
            o.remove("tool_result");
        }
    }
    if let Some(t) = active {
        let prompt = generic_tool_prompt(&t.tools);
        match out.first_mut() {
            Some(first) if first["role"] == "system" => {
                let c = format!(
                    "{}\n\n{prompt}",
                    first["content"].as_str().unwrap_or_default()
                );
                first["content"] = c.into();
            }
            _ => out.insert(0, json!({"role": "system", "content": prompt})),
        }
    }
    (out, None)
}

/// GPT-OSS's template renders an assistant call's reasoning from `thinking`, and only for a call
/// not yet followed by a final answer (earlier reasoning is dropped, as the model was trained).
/// It refuses `thinking` beside non-empty content on a call message, so the reasoning goes there
/// only when the content is empty.
fn harmony_messages(messages: &[Value]) -> Vec<Value> {
    messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            let call = m.get("tool_calls").is_some();
            let empty = m["content"].as_str().is_none_or(str::is_empty);
            if let (true, true, Some(r)) = (call, empty, m.get("reasoning_content").cloned()) {
                m["thinking"] = r;
            }
            m
        })
        .collect()
}

/// Tool-call markup that is one special token of `tok`: its text must reach the parser, so the
/// engine keeps it in the decoded text (special tokens are otherwise skipped).
pub fn markup_tokens(format: ToolFormat, tok: &Tokenizer) -> Vec<u32> {
    let markup: &[&str] = match format {
        ToolFormat::Hermes => &["<tool_call>", "</tool_call>"],
        ToolFormat::Llama3Json => &["<|python_tag|>"],
        ToolFormat::Mistral { .. } => &["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
        ToolFormat::FunctionGemma => &["<start_function_call>", "<end_function_call>", "<escape>"],
        ToolFormat::Harmony => HARMONY_MARKERS,
        ToolFormat::Generic => &[],
    };
    markup
        .iter()
        .filter_map(|m| tok.token_to_id(m))
        .filter(|&id| tok.is_special(id))
        .collect()
}

fn schema_error(param: &str, e: ModelError) -> ApiError {
    let msg = match e {
        ModelError::Grammar(m) => m,
        other => other.to_string(),
    };
    ApiError::invalid(
        param,
        format!("this JSON Schema cannot be used for constrained decoding: {msg}"),
    )
    .with_code("unsupported_schema")
}

/// The constraint of a request: its `response_format`, or the tool-call grammar of its
/// `tool_choice` (whole reply for `required` / a named tool, lazy for `auto`). A tool schema
/// llguidance cannot compile is a 400 naming the feature for a `strict` tool, and any JSON
/// object for the others.
pub fn constraint(
    env: &ConstraintEnv,
    tok: &Tokenizer,
    format: ToolFormat,
    tools: Option<&ToolsRequest>,
    response_format: Option<&GrammarSpec>,
) -> ApiResult<Option<Constraint>> {
    if let Some(spec) = response_format {
        let param = match spec {
            GrammarSpec::JsonSchema(_) => "response_format.json_schema.schema",
            _ => "response_format",
        };
        let g = env.compile(spec).map_err(|e| schema_error(param, e))?;
        return Ok(Some(env.constraint(&g)));
    }
    let Some(t) = tools.filter(|t| t.active()) else {
        return Ok(None);
    };
    let mut gtools = Vec::with_capacity(t.tools.len());
    for (i, tool) in t.tools.iter().enumerate() {
        if let ToolChoice::Named(n) = &t.choice {
            if &tool.name != n {
                continue;
            }
        }
        let arguments = match env.compile(&GrammarSpec::JsonSchema(tool.parameters.clone())) {
            Ok(_) => tool.parameters.clone(),
            Err(e) if tool.strict => {
                return Err(schema_error(&format!("tools[{i}].function.parameters"), e))
            }
            Err(_) => json!({"type": "object"}),
        };
        gtools.push(GrammarTool {
            name: tool.name.clone(),
            arguments,
        });
    }
    let token = |s: &str| tok.token_to_id(s);
    let internal = |e: ModelError| {
        ApiError::internal(format!(
            "the tool-call grammar for this model failed to compile: {e}"
        ))
    };
    match &t.choice {
        ToolChoice::Required | ToolChoice::Named(_) => {
            let parallel = t.parallel && t.choice == ToolChoice::Required;
            let lark = grammar::required(format, &gtools, parallel, &token);
            let g = env.compile(&GrammarSpec::Lark(lark)).map_err(internal)?;
            Ok(Some(env.constraint(&g)))
        }
        ToolChoice::Auto => {
            let mut lazies = Vec::new();
            for l in grammar::lazy(format, &gtools, t.parallel, &token) {
                let g = env.compile(&GrammarSpec::Lark(l.lark)).map_err(internal)?;
                lazies.push((l.trigger, g));
            }
            Ok(Some(env.lazy(lazies)))
        }
        ToolChoice::None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn harmony_call_reasoning_becomes_thinking() {
        let call =
            json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]);
        let msgs = vec![
            json!({"role": "user", "content": "q"}),
            json!({"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": call}),
            json!({"role": "assistant", "content": "said", "reasoning_content": "r2", "tool_calls": call}),
            json!({"role": "assistant", "content": "final", "reasoning_content": "r3"}),
        ];
        let (out, tools) = template_inputs(&msgs, None, ToolFormat::Harmony, true);
        assert!(tools.is_none());
        assert_eq!(out[1]["thinking"], "r");
        assert!(out[2].get("thinking").is_none() && out[3].get("thinking").is_none());
        // Other formats get the messages as they came.
        let (out, _) = template_inputs(&msgs, None, ToolFormat::Hermes, true);
        assert!(out[1].get("thinking").is_none());
    }
}
