//! Tool calling and structured output on `/v1/chat/completions`: the request side (`tools`,
//! `tool_choice`, `parallel_tool_calls`, `response_format`, assistant `tool_calls` and `tool`
//! messages), the prompt and constraint a request needs ([`render`]), and the reply side
//! (tool calls out of the generated text, streamed as OpenAI streams them: [`output`]).
//!
//! Reference: the shapes of OpenAI's Python client (`ChatCompletionToolParam`,
//! `ChatCompletionNamedToolChoiceParam`, `ResponseFormatJSONSchema`, `ChoiceDeltaToolCall`).
//! Defaults are OpenAI's: `tool_choice` is `auto` when tools are given, parallel calls are on.
//! `tool_choice: none` leaves the tools out of the prompt (the model cannot call what it does
//! not see). Arguments of assistant tool calls are accepted as a JSON string or an object.
//!
//! What it is not: tool execution (the agent's, [`crate::agent`]), or the template rendering
//! itself (`hf2q_models::chat_template`).

pub mod output;
pub mod render;

use hf2q_models::constraint::GrammarSpec;
use hf2q_models::tool_calls::ToolSpec;
use serde_json::{json, Map, Value};

use crate::error::{ApiError, ApiResult};

/// OpenAI's limit on functions per request.
pub const MAX_TOOLS: usize = 128;

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// The tool part of a chat request.
#[derive(Clone, Debug)]
pub struct ToolsRequest {
    pub tools: Vec<ToolSpec>,
    pub choice: ToolChoice,
    pub parallel: bool,
    /// The `tools` list as the client sent it (what chat templates render).
    pub json: Value,
}

impl ToolsRequest {
    /// No tools: for replies that are parsed anyway ([`ToolFormat::reads_every_reply`]); every
    /// call in them is content.
    ///
    /// [`ToolFormat::reads_every_reply`]: hf2q_models::tool_calls::ToolFormat::reads_every_reply
    pub fn none() -> ToolsRequest {
        ToolsRequest {
            tools: Vec::new(),
            choice: ToolChoice::None,
            parallel: false,
            json: Value::Array(Vec::new()),
        }
    }

    /// Tools are offered to the model (not `none`).
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None && !self.tools.is_empty()
    }
    pub fn names(&self) -> Vec<String> {
        self.tools.iter().map(|t| t.name.clone()).collect()
    }
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// `tools`, `tool_choice`, `parallel_tool_calls` (and the legacy `functions` /
/// `function_call`, refused unless empty).
pub fn parse_tools(m: &Map<String, Value>) -> ApiResult<Option<ToolsRequest>> {
    let get = |k: &str| m.get(k).filter(|v| !v.is_null());
    if get("functions").is_some_and(|f| f.as_array().is_none_or(|a| !a.is_empty()))
        || get("function_call").is_some_and(|f| f != "none" && f != "auto")
    {
        return Err(ApiError::unsupported(
            "functions",
            "the legacy 'functions' / 'function_call' parameters are not supported; use 'tools' and 'tool_choice'",
        ));
    }
    let parallel = match get("parallel_tool_calls") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::wrong_type("parallel_tool_calls", "a boolean")),
    };
    let list = match get("tools") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(ApiError::wrong_type("tools", "a list of tools")),
    };
    if list.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            "tools",
            format!(
                "at most {MAX_TOOLS} tools are allowed, {} given",
                list.len()
            ),
        ));
    }
    let mut tools: Vec<ToolSpec> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        let ty = t.get("type").and_then(Value::as_str);
        if ty != Some("function") {
            return Err(ApiError::invalid(
                &format!("{p}.type"),
                "only tools of type 'function' are supported",
            ));
        }
        let f = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::missing(&format!("{p}.function")))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::missing(&format!("{p}.function.name")))?;
        if !valid_name(name) {
            return Err(ApiError::invalid(
                &format!("{p}.function.name"),
                format!(
                    "tool name '{name}' must be 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'"
                ),
            ));
        }
        if tools.iter().any(|x| x.name == name) {
            return Err(ApiError::invalid(
                &format!("{p}.function.name"),
                format!("two tools are named '{name}'"),
            ));
        }
        let parameters = match f.get("parameters").filter(|v| !v.is_null()) {
            None => json!({"type": "object", "properties": {}}),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) => {
                return Err(ApiError::wrong_type(
                    &format!("{p}.function.parameters"),
                    "a JSON Schema object",
                ))
            }
        };
        let description = match f.get("description").filter(|v| !v.is_null()) {
            None => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => {
                return Err(ApiError::wrong_type(
                    &format!("{p}.function.description"),
                    "a string",
                ))
            }
        };
        let strict = match f.get("strict").filter(|v| !v.is_null()) {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(ApiError::wrong_type(
                    &format!("{p}.function.strict"),
                    "a boolean",
                ))
            }
        };
        tools.push(ToolSpec {
            name: name.to_string(),
            description,
            parameters,
            strict,
        });
    }
    let choice = match get("tool_choice") {
        None if tools.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("unknown tool_choice '{other}' (expected none, auto, required or a named function)"),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice names '{name}', which is not in 'tools'"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
        Some(_) => {
            return Err(ApiError::wrong_type(
                "tool_choice",
                "'none', 'auto', 'required' or a named function",
            ))
        }
    };
    if choice != ToolChoice::None && tools.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice other than 'none' needs 'tools'",
        ));
    }
    if tools.is_empty() {
        return Ok(None);
    }
    Ok(Some(ToolsRequest {
        tools,
        choice,
        parallel,
        json: Value::Array(list),
    }))
}

/// `response_format`: `text` (none), `json_object`, or `json_schema` with a schema.
pub fn parse_response_format(m: &Map<String, Value>) -> ApiResult<Option<GrammarSpec>> {
    let Some(rf) = m.get("response_format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let o = rf
        .as_object()
        .ok_or_else(|| ApiError::wrong_type("response_format", "an object"))?;
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            let js = o
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| ApiError::missing("response_format.json_schema"))?;
            let name = js.get("name").and_then(Value::as_str).unwrap_or_default();
            if !valid_name(name) {
                return Err(ApiError::invalid(
                    "response_format.json_schema.name",
                    "'name' is required: 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'",
                ));
            }
            match js.get("schema").filter(|v| !v.is_null()) {
                // OpenAI allows a missing schema: then any JSON object.
                None => Ok(Some(GrammarSpec::JsonObject)),
                Some(s @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(Some(GrammarSpec::JsonSchema(s.clone())))
                }
                Some(_) => Err(ApiError::wrong_type(
                    "response_format.json_schema.schema",
                    "a JSON Schema object",
                )),
            }
        }
        _ => Err(ApiError::invalid(
            "response_format.type",
            "response_format.type must be 'text', 'json_object' or 'json_schema'",
        )),
    }
}

/// An assistant message's `tool_calls`, normalised for chat templates: `function.arguments`
/// as a JSON value (templates render it with `tojson`), ids kept.
pub fn parse_assistant_calls(v: &Value, param: &str) -> ApiResult<Vec<Value>> {
    let a = v
        .as_array()
        .ok_or_else(|| ApiError::wrong_type(param, "a list of tool calls"))?;
    let mut out = Vec::with_capacity(a.len());
    for (j, c) in a.iter().enumerate() {
        let p = format!("{param}[{j}]");
        let f = c
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::missing(&format!("{p}.function")))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::missing(&format!("{p}.function.name")))?;
        let args = match f.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) if s.trim().is_empty() => json!({}),
            // Malformed arguments stay text: the template shows them as the model wrote them.
            Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| json!(s)),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) => {
                return Err(ApiError::wrong_type(
                    &format!("{p}.function.arguments"),
                    "a JSON string or an object",
                ))
            }
        };
        let id = match c.get("id") {
            None | Some(Value::Null) => format!("call_{j}"),
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(ApiError::wrong_type(&format!("{p}.id"), "a string")),
        };
        out.push(
            json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}),
        );
    }
    Ok(out)
}
