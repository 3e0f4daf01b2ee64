//! OpenAI wire format: request parsing with validation, and the JSON of responses and stream
//! chunks for `/v1/chat/completions` and `/v1/completions`.
//!
//! Reference: OpenAI's API reference (Chat Completions, Completions) and the shapes its official
//! Python client parses. Requests are read field by field from the JSON object (not through a
//! derived `Deserialize`) so that every error names its parameter, numbers are range-checked
//! before use, and unknown or unsupported fields are refused with a 400 that says so instead
//! of being ignored. Response bodies are built with `serde_json` maps whose key order follows
//! OpenAI's.
//!
//! Sampling defaults are the model's recommended sampling ([`Limits::sampling`]), else OpenAI's
//! (temperature 1, top_p 1, no top-k / min-p); `top_k`, `min_p`,
//! `repetition_penalty` and `ignore_eos` are the common extensions of OpenAI-compatible servers.
//! Presence / frequency / repetition penalties look at the last 64 tokens (prompt included), as
//! the CLI's sampler does.

use hf2q_models::constraint::GrammarSpec;
use hf2q_models::generation::GenerationDefaults;
use hf2q_models::sampler::SamplerConfig;
use serde_json::{json, Map, Value};

use crate::chat_tools::{self, ToolsRequest};
use crate::engine::TokenLogprob;
use crate::error::{ApiError, ApiResult};

/// Most choices one request may ask for (`n` times the number of prompts).
pub const MAX_CHOICES: usize = 16;
/// Most stop strings (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// Most `top_logprobs` (OpenAI's limit); legacy completions allow 5.
pub const MAX_TOP_LOGPROBS: usize = 20;
pub const MAX_COMPLETION_LOGPROBS: usize = 5;

/// What the parser needs to know about the served model.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub ctx_size: usize,
    pub vocab: usize,
    /// The model's recommended sampling: the defaults of the fields a request leaves out.
    pub sampling: GenerationDefaults,
}

/// Fields shared by both endpoints.
#[derive(Clone, Debug)]
pub struct Common {
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: Option<usize>,
    pub n: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
}

#[derive(Clone, Debug)]
pub struct ChatRequest {
    pub common: Common,
    /// The messages as chat templates take them: `role` (system, user, assistant, tool),
    /// `content` (a string), and `tool_calls` / `tool_call_id` / `name` where given.
    pub messages: Vec<Value>,
    /// `tools`, `tool_choice`, `parallel_tool_calls` (none when no tools are given).
    pub tools: Option<ToolsRequest>,
    /// `response_format` other than text.
    pub response_format: Option<GrammarSpec>,
    /// `Some(k)` when `logprobs: true` (k = `top_logprobs`, default 0).
    pub logprobs: Option<usize>,
    /// `reasoning_effort` (`low`, `medium` or `high`): a template variable, for the templates
    /// that take it (GPT-OSS's); the route refuses it for the others.
    pub reasoning_effort: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct CompletionRequest {
    pub common: Common,
    pub prompts: Vec<Prompt>,
    pub echo: bool,
    pub logprobs: Option<usize>,
}

const SAMPLING_FIELDS: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "logit_bias",
    "logprobs",
    "user",
    "ignore_eos",
];
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "store",
    "metadata",
    "service_tier",
    "parallel_tool_calls",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
];
const COMPLETION_FIELDS: &[&str] = &["prompt", "best_of", "echo", "suffix"];

fn present<'a>(m: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    m.get(k).filter(|v| !v.is_null())
}

fn check_known(m: &Map<String, Value>, extra: &[&str]) -> ApiResult<()> {
    for k in m.keys() {
        if !SAMPLING_FIELDS.contains(&k.as_str()) && !extra.contains(&k.as_str()) {
            return Err(ApiError::invalid(
                k,
                format!("Unrecognized request argument supplied: {k}"),
            )
            .with_code("unknown_parameter"));
        }
    }
    Ok(())
}

fn boolean(m: &Map<String, Value>, k: &str) -> ApiResult<Option<bool>> {
    match present(m, k) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::wrong_type(k, "a boolean")),
    }
}

fn string<'a>(m: &'a Map<String, Value>, k: &str) -> ApiResult<Option<&'a str>> {
    match present(m, k) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::wrong_type(k, "a string")),
    }
}

/// A number in `lo..=hi`.
fn float(m: &Map<String, Value>, k: &str, lo: f64, hi: f64) -> ApiResult<Option<f32>> {
    let Some(v) = present(m, k) else {
        return Ok(None);
    };
    let x = v
        .as_f64()
        .ok_or_else(|| ApiError::wrong_type(k, "a number"))?;
    if !(lo..=hi).contains(&x) {
        return Err(ApiError::invalid(
            k,
            format!("'{k}' is {x}; it must be between {lo} and {hi}"),
        ));
    }
    Ok(Some(x as f32))
}

/// An integer in `lo..=hi`.
fn int(m: &Map<String, Value>, k: &str, lo: i64, hi: i64) -> ApiResult<Option<i64>> {
    let Some(v) = present(m, k) else {
        return Ok(None);
    };
    let Value::Number(n) = v else {
        return Err(ApiError::wrong_type(k, "an integer"));
    };
    let x = match (n.as_i64(), n.as_u64()) {
        (Some(x), _) => x,
        (None, Some(_)) => i64::MAX,
        _ => return Err(ApiError::wrong_type(k, "an integer")),
    };
    if !(lo..=hi).contains(&x) {
        return Err(ApiError::invalid(
            k,
            format!("'{k}' is {n}; it must be between {lo} and {hi}"),
        ));
    }
    Ok(Some(x))
}

/// `null`, absent, or a value for which `ok` holds; anything else is a feature we lack.
fn refuse_unless(
    m: &Map<String, Value>,
    k: &str,
    ok: impl Fn(&Value) -> bool,
    what: &str,
) -> ApiResult<()> {
    match present(m, k) {
        Some(v) if !ok(v) => Err(ApiError::unsupported(
            k,
            format!("'{k}' is not supported by this server yet: {what}"),
        )),
        _ => Ok(()),
    }
}

fn parse_common(m: &Map<String, Value>, lim: Limits, max_tokens_key: &str) -> ApiResult<Common> {
    let stream = boolean(m, "stream")?.unwrap_or(false);
    let mut include_usage = false;
    if let Some(so) = present(m, "stream_options") {
        if !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "'stream_options' is only allowed when 'stream' is true",
            ));
        }
        let so = so
            .as_object()
            .ok_or_else(|| ApiError::wrong_type("stream_options", "an object"))?;
        for k in so.keys() {
            if k != "include_usage" {
                return Err(ApiError::invalid(
                    "stream_options",
                    format!("unknown stream option '{k}'"),
                ));
            }
        }
        include_usage = boolean(so, "include_usage")?.unwrap_or(false);
    }
    let ctx = lim.ctx_size as i64;
    let mut max_tokens = int(m, max_tokens_key, 1, ctx)?;
    if max_tokens_key != "max_tokens" {
        let legacy = int(m, "max_tokens", 1, ctx)?;
        max_tokens = max_tokens.or(legacy);
    }
    let n = int(m, "n", 1, MAX_CHOICES as i64)?.unwrap_or(1) as usize;
    let mut sampler = SamplerConfig {
        temperature: float(m, "temperature", 0.0, 2.0)?
            .or(lim.sampling.temperature)
            .unwrap_or(1.0),
        top_p: float(m, "top_p", 0.0, 1.0)?
            .or(lim.sampling.top_p)
            .unwrap_or(1.0),
        top_k: match int(m, "top_k", -1, i64::MAX)? {
            Some(k) => k.max(0) as usize,
            None => lim.sampling.top_k.unwrap_or(0),
        },
        min_p: float(m, "min_p", 0.0, 1.0)?
            .or(lim.sampling.min_p)
            .unwrap_or(0.0),
        presence_penalty: float(m, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        frequency_penalty: float(m, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        repetition_penalty: float(m, "repetition_penalty", 0.0, 10.0)?
            .or(lim.sampling.repetition_penalty)
            .unwrap_or(1.0),
        penalty_last_n: 64,
        seed: None,
        logit_bias: Vec::new(),
    };
    if sampler.top_p <= 0.0 {
        return Err(ApiError::invalid(
            "top_p",
            "'top_p' must be greater than 0 (use temperature 0 for greedy decoding)",
        ));
    }
    if sampler.repetition_penalty <= 0.0 {
        return Err(ApiError::invalid(
            "repetition_penalty",
            "'repetition_penalty' must be greater than 0",
        ));
    }
    if let Some(v) = present(m, "seed") {
        let Value::Number(n) = v else {
            return Err(ApiError::wrong_type("seed", "an integer"));
        };
        let s = n
            .as_u64()
            .or_else(|| n.as_i64().map(|x| x as u64))
            .ok_or_else(|| ApiError::wrong_type("seed", "an integer"))?;
        sampler.seed = Some(s);
    }
    if let Some(v) = present(m, "logit_bias") {
        let o = v.as_object().ok_or_else(|| {
            ApiError::wrong_type("logit_bias", "an object mapping token ids to numbers")
        })?;
        for (k, b) in o {
            let id: u32 = k
                .parse()
                .ok()
                .filter(|&id: &u32| (id as usize) < lim.vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "logit_bias",
                        format!("logit_bias key '{k}' is not a token id below {}", lim.vocab),
                    )
                })?;
            let b = b.as_f64().ok_or_else(|| {
                ApiError::wrong_type("logit_bias", "an object mapping token ids to numbers")
            })?;
            if !(-100.0..=100.0).contains(&b) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias value {b} for token {k} must be between -100 and 100"),
                ));
            }
            sampler.logit_bias.push((id, b as f32));
        }
    }
    let stop = match present(m, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let v = a
                .iter()
                .map(|x| x.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>();
            v.ok_or_else(|| ApiError::wrong_type("stop", "a string or a list of strings"))?
        }
        Some(_) => {
            return Err(ApiError::wrong_type(
                "stop",
                "a string or a list of strings",
            ))
        }
    };
    if stop.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {MAX_STOP} stop sequences are allowed"),
        ));
    }
    string(m, "user")?;
    let model = string(m, "model")?.map(str::to_string);
    let ignore_eos = boolean(m, "ignore_eos")?.unwrap_or(false);
    let max_tokens = max_tokens.map(|m| m as usize);
    Ok(Common {
        model,
        stream,
        include_usage,
        max_tokens,
        n,
        sampler,
        stop,
        ignore_eos,
    })
}

/// Parses a `/v1/chat/completions` body.
pub fn parse_chat(v: &Value, lim: Limits) -> ApiResult<ChatRequest> {
    let m = v
        .as_object()
        .ok_or_else(|| ApiError::wrong_type("body", "a JSON object"))?;
    check_known(m, CHAT_FIELDS)?;
    let tools = chat_tools::parse_tools(m)?;
    let response_format = chat_tools::parse_response_format(m)?;
    if response_format.is_some() && tools.as_ref().is_some_and(ToolsRequest::active) {
        return Err(ApiError::unsupported(
            "response_format",
            "'response_format' together with active 'tools' is not supported: use tool_choice 'none', or a tool whose parameters are the schema",
        ));
    }
    refuse_unless(
        m,
        "modalities",
        |v| v.as_array().is_some_and(|a| a.iter().all(|x| x == "text")),
        "only text output",
    )?;
    refuse_unless(m, "audio", |_| false, "audio output")?;
    refuse_unless(m, "prediction", |_| false, "predicted outputs")?;
    let reasoning_effort = match present(m, "reasoning_effort") {
        None => None,
        Some(Value::String(s)) if ["low", "medium", "high"].contains(&s.as_str()) => {
            Some(s.clone())
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "reasoning_effort",
                "'reasoning_effort' must be 'low', 'medium' or 'high'",
            ))
        }
    };
    refuse_unless(m, "web_search_options", |_| false, "web search")?;
    boolean(m, "store")?;
    let common = parse_common(m, lim, "max_completion_tokens")?;
    let logprobs = match boolean(m, "logprobs")? {
        Some(true) => {
            Some(int(m, "top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?.unwrap_or(0) as usize)
        }
        _ => {
            if present(m, "top_logprobs").is_some() {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "'top_logprobs' requires 'logprobs' to be true",
                ));
            }
            None
        }
    };
    let msgs = present(m, "messages").ok_or_else(|| ApiError::missing("messages"))?;
    let msgs = msgs
        .as_array()
        .ok_or_else(|| ApiError::wrong_type("messages", "a list of messages"))?;
    if msgs.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must contain at least one message",
        ));
    }
    let messages = msgs
        .iter()
        .enumerate()
        .map(|(i, x)| parse_message(i, x))
        .collect::<ApiResult<Vec<_>>>()?;
    Ok(ChatRequest {
        common,
        messages,
        tools,
        response_format,
        logprobs,
        reasoning_effort,
    })
}

fn parse_message(i: usize, v: &Value) -> ApiResult<Value> {
    let p = |f: &str| format!("messages[{i}].{f}");
    let m = v
        .as_object()
        .ok_or_else(|| ApiError::wrong_type(&format!("messages[{i}]"), "an object"))?;
    let role = match present(m, "role") {
        Some(Value::String(r)) => r.as_str(),
        Some(_) => return Err(ApiError::wrong_type(&p("role"), "a string")),
        None => return Err(ApiError::missing(&p("role"))),
    };
    let role = match role {
        "system" | "developer" => "system",
        "user" | "assistant" | "tool" => role,
        "function" => {
            return Err(ApiError::unsupported(
                &p("role"),
                "messages with the legacy role 'function' are not supported; use role 'tool'",
            ))
        }
        other => {
            return Err(ApiError::invalid(
                &p("role"),
                format!(
                    "unknown role '{other}' (expected system, developer, user, assistant or tool)"
                ),
            ))
        }
    };
    if present(m, "function_call").is_some() {
        return Err(ApiError::unsupported(
            &p("function_call"),
            "the legacy 'function_call' is not supported; use 'tool_calls'",
        ));
    }
    let mut out = Map::new();
    out.insert("role".into(), role.into());
    match present(m, "tool_calls") {
        Some(t) if role == "assistant" => {
            let calls = chat_tools::parse_assistant_calls(t, &p("tool_calls"))?;
            if !calls.is_empty() {
                out.insert("tool_calls".into(), Value::Array(calls));
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                &p("tool_calls"),
                "only assistant messages carry 'tool_calls'",
            ))
        }
        None => {}
    }
    for k in ["tool_call_id", "name"] {
        match present(m, k) {
            Some(Value::String(s)) => {
                out.insert(k.into(), s.clone().into());
            }
            Some(_) => return Err(ApiError::wrong_type(&p(k), "a string")),
            None => {}
        }
    }
    if role == "tool" && !out.contains_key("tool_call_id") && !out.contains_key("name") {
        return Err(ApiError::missing(&p("tool_call_id")));
    }
    for k in m.keys() {
        if ![
            "role",
            "content",
            "name",
            "tool_calls",
            "tool_call_id",
            "function_call",
            "refusal",
            "reasoning_content",
        ]
        .contains(&k.as_str())
        {
            return Err(ApiError::invalid(
                &p(k),
                format!("unknown message field '{k}'"),
            ));
        }
    }
    let content = match present(m, "content") {
        None if role == "assistant" => String::new(),
        None => return Err(ApiError::missing(&p("content"))),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::new();
            for (j, part) in parts.iter().enumerate() {
                let pp = format!("messages[{i}].content[{j}]");
                let ty = part
                    .get("type")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::wrong_type(&pp, "a content part with a 'type'"))?;
                match ty {
                    "text" => {
                        let t = part.get("text").and_then(Value::as_str).ok_or_else(|| ApiError::wrong_type(&format!("{pp}.text"), "a string"))?;
                        texts.push(t.to_string());
                    }
                    other => {
                        return Err(ApiError::unsupported(&pp, format!("content parts of type '{other}' are not supported (this server is text-only)")))
                    }
                }
            }
            texts.join("\n")
        }
        Some(_) => {
            return Err(ApiError::wrong_type(
                &p("content"),
                "a string or a list of content parts",
            ))
        }
    };
    out.insert("content".into(), content.into());
    // The reasoning a reply came with (what this server returns as `reasoning_content`; clients
    // send the message back as they got it): kept for the templates that render it.
    match present(m, "reasoning_content") {
        Some(Value::String(s)) if role == "assistant" => {
            out.insert("reasoning_content".into(), s.clone().into());
        }
        Some(Value::String(_)) => {
            return Err(ApiError::invalid(
                &p("reasoning_content"),
                "only assistant messages carry 'reasoning_content'",
            ))
        }
        Some(_) => return Err(ApiError::wrong_type(&p("reasoning_content"), "a string")),
        None => {}
    }
    Ok(Value::Object(out))
}

/// Parses a `/v1/completions` body.
pub fn parse_completion(v: &Value, lim: Limits) -> ApiResult<CompletionRequest> {
    let m = v
        .as_object()
        .ok_or_else(|| ApiError::wrong_type("body", "a JSON object"))?;
    check_known(m, COMPLETION_FIELDS)?;
    refuse_unless(m, "suffix", |v| v == "", "insertion (suffix)")?;
    let common = parse_common(m, lim, "max_tokens")?;
    if let Some(b) = int(m, "best_of", 1, MAX_CHOICES as i64)? {
        if b as usize != common.n {
            return Err(ApiError::unsupported(
                "best_of",
                "'best_of' other than 'n' is not supported",
            ));
        }
    }
    let echo = boolean(m, "echo")?.unwrap_or(false);
    let logprobs = int(m, "logprobs", 0, MAX_COMPLETION_LOGPROBS as i64)?.map(|k| k as usize);
    if echo && logprobs.is_some() {
        return Err(ApiError::unsupported(
            "echo",
            "'echo' together with 'logprobs' (prompt log-probabilities) is not supported",
        ));
    }
    let p = present(m, "prompt").ok_or_else(|| ApiError::missing("prompt"))?;
    let bad = || {
        ApiError::wrong_type(
            "prompt",
            "a string, a list of strings, a list of token ids or a list of lists of token ids",
        )
    };
    let tokens = |a: &[Value]| -> ApiResult<Vec<u32>> {
        a.iter()
            .map(|x| {
                let id = x.as_u64().ok_or_else(bad)?;
                if id as usize >= lim.vocab {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!("token id {id} is outside the vocabulary of {}", lim.vocab),
                    ));
                }
                Ok(id as u32)
            })
            .collect()
    };
    let prompts = match p {
        Value::String(s) => vec![Prompt::Text(s.clone())],
        Value::Array(a) if a.is_empty() => {
            return Err(ApiError::invalid("prompt", "'prompt' must not be empty"))
        }
        Value::Array(a) if a.iter().all(Value::is_string) => a
            .iter()
            .map(|s| Prompt::Text(s.as_str().unwrap_or_default().to_string()))
            .collect(),
        Value::Array(a) if a.iter().all(Value::is_number) => vec![Prompt::Tokens(tokens(a)?)],
        Value::Array(a) if a.iter().all(Value::is_array) => a
            .iter()
            .map(|x| {
                Ok(Prompt::Tokens(tokens(
                    x.as_array().map(Vec::as_slice).unwrap_or_default(),
                )?))
            })
            .collect::<ApiResult<Vec<_>>>()?,
        _ => return Err(bad()),
    };
    if prompts.len() * common.n > MAX_CHOICES {
        return Err(ApiError::invalid(
            "n",
            format!("prompts x n must be at most {MAX_CHOICES}"),
        ));
    }
    Ok(CompletionRequest {
        common,
        prompts,
        echo,
        logprobs,
    })
}

// ---- responses ---------------------------------------------------------------------------------

/// Identity of one response: id, creation time, model name.
#[derive(Clone, Debug)]
pub struct RespMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

pub const FINGERPRINT: &str = concat!("hf2q-", env!("CARGO_PKG_VERSION"));

/// One finished choice.
#[derive(Clone, Debug, Default)]
pub struct ChoiceOut {
    pub index: usize,
    pub text: String,
    pub finish: String,
    /// Chat: the message's `tool_calls` (OpenAI's shape); none for a text reply.
    pub tool_calls: Vec<Value>,
    /// Chat: reasoning kept apart from the content (`message.reasoning_content` when not empty).
    pub reasoning: String,
}

/// The `usage` object; `cached` is how many prompt tokens came from the prefix cache (OpenAI's
/// `prompt_tokens_details.cached_tokens`).
pub fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

/// Chat `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}`.
pub fn chat_logprobs(lps: &[TokenLogprob], text_of: &dyn Fn(u32) -> String) -> Value {
    let entry = |id: u32, lp: f32| {
        let t = text_of(id);
        let bytes: Vec<u8> = t.as_bytes().to_vec();
        (t, lp_json(lp), bytes)
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let (token, logprob, bytes) = entry(l.id, l.logprob);
            let top: Vec<Value> = l
                .top
                .iter()
                .map(|&(id, lp)| {
                    let (token, logprob, bytes) = entry(id, lp);
                    json!({"token": token, "logprob": logprob, "bytes": bytes})
                })
                .collect();
            json!({"token": token, "logprob": logprob, "bytes": bytes, "top_logprobs": top})
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// JSON has no -inf: clamp to OpenAI's floor for impossible tokens.
fn lp_json(lp: f32) -> f64 {
    if lp.is_finite() {
        f64::from(lp)
    } else {
        -9999.0
    }
}

/// Legacy completions `logprobs`: `{tokens, token_logprobs, top_logprobs, text_offset}`;
/// `offset0` is the text length before these tokens.
pub fn completion_logprobs(
    lps: &[TokenLogprob],
    text_of: &dyn Fn(u32) -> String,
    offset0: usize,
) -> Value {
    let mut tokens = Vec::new();
    let mut token_lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    let mut off = offset0;
    for l in lps {
        let t = text_of(l.id);
        offsets.push(off);
        off += t.len();
        tokens.push(t);
        token_lps.push(lp_json(l.logprob));
        let mut top = Map::new();
        for &(id, lp) in &l.top {
            top.insert(text_of(id), json!(lp_json(lp)));
        }
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets})
}

pub fn chat_response(meta: &RespMeta, choices: Vec<(ChoiceOut, Value)>, usage: Value) -> Value {
    let choices: Vec<Value> = choices
        .into_iter()
        .map(|(c, lp)| {
            let mut message = json!({"role": "assistant", "content": c.text, "refusal": null});
            if !c.reasoning.is_empty() {
                message["reasoning_content"] = c.reasoning.into();
            }
            if !c.tool_calls.is_empty() {
                if c.text.is_empty() {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = Value::Array(c.tool_calls);
            }
            json!({
                "index": c.index,
                "message": message,
                "logprobs": lp,
                "finish_reason": c.finish,
            })
        })
        .collect();
    json!({
        "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
        "system_fingerprint": FINGERPRINT, "choices": choices, "usage": usage,
    })
}

pub fn completion_response(
    meta: &RespMeta,
    choices: Vec<(ChoiceOut, Value)>,
    usage: Value,
) -> Value {
    let choices: Vec<Value> = choices
        .into_iter()
        .map(|(c, lp)| json!({"text": c.text, "index": c.index, "logprobs": lp, "finish_reason": c.finish}))
        .collect();
    json!({
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "system_fingerprint": FINGERPRINT, "choices": choices, "usage": usage,
    })
}

/// One `chat.completion.chunk`; `usage` is `Some(null)` on ordinary chunks when the client asked
/// for usage, and the usage object on the last chunk (which has no choices).
pub fn chat_chunk(meta: &RespMeta, choice: Option<Value>, usage: Option<Value>) -> Value {
    let mut v = json!({
        "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
        "system_fingerprint": FINGERPRINT,
        "choices": choice.map_or_else(Vec::new, |c| vec![c]),
    });
    if let Some(u) = usage {
        v["usage"] = u;
    }
    v
}

pub fn chat_chunk_choice(
    index: usize,
    delta: Value,
    logprobs: Value,
    finish: Option<&str>,
) -> Value {
    json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
}

pub fn completion_chunk(meta: &RespMeta, choice: Option<Value>, usage: Option<Value>) -> Value {
    let mut v = json!({
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "system_fingerprint": FINGERPRINT,
        "choices": choice.map_or_else(Vec::new, |c| vec![c]),
    });
    if let Some(u) = usage {
        v["usage"] = u;
    }
    v
}

pub fn completion_chunk_choice(
    index: usize,
    text: &str,
    logprobs: Value,
    finish: Option<&str>,
) -> Value {
    json!({"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish})
}

/// One SSE frame: `data: JSON\n\n`.
pub fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

pub const SSE_DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    const LIM: Limits = Limits {
        ctx_size: 100,
        vocab: 50,
        sampling: GenerationDefaults::NONE,
    };

    fn chat(v: Value) -> ApiResult<ChatRequest> {
        parse_chat(&v, LIM)
    }

    #[test]
    fn minimal_chat() {
        let r =
            chat(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})).unwrap();
        assert_eq!(r.messages, vec![json!({"role": "user", "content": "hi"})]);
        assert!(r.tools.is_none() && r.response_format.is_none());
        assert_eq!(r.common.n, 1);
        assert_eq!(r.common.sampler.temperature, 1.0);
        assert!(!r.common.stream);
    }

    #[test]
    fn reasoning_effort_is_one_of_three_levels() {
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let r = chat(json!({"messages": msgs, "reasoning_effort": "high"})).unwrap();
        assert_eq!(r.reasoning_effort.as_deref(), Some("high"));
        assert!(chat(json!({"messages": msgs}))
            .unwrap()
            .reasoning_effort
            .is_none());
        let e = chat(json!({"messages": msgs, "reasoning_effort": "extreme"})).unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.param.as_deref(), Some("reasoning_effort"));
        // A reply's reasoning sent back with it is kept; other roles carry none.
        let r = chat(json!({"messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
        ]}))
        .unwrap();
        assert_eq!(r.messages[1]["reasoning_content"], "r");
        let e =
            chat(json!({"messages": [{"role": "user", "content": "q", "reasoning_content": "r"}]}))
                .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].reasoning_content"));
        // The reply's reasoning is returned apart from its content.
        let choice = ChoiceOut {
            text: "4".into(),
            reasoning: "2+2".into(),
            finish: "stop".into(),
            ..Default::default()
        };
        let meta = RespMeta {
            id: "x".into(),
            created: 0,
            model: "m".into(),
        };
        let body = chat_response(&meta, vec![(choice, Value::Null)], usage(1, 1, 0));
        let m = &body["choices"][0]["message"];
        assert_eq!(
            (&m["content"], &m["reasoning_content"]),
            (&json!("4"), &json!("2+2"))
        );
    }

    #[test]
    fn content_parts_and_roles() {
        let r = chat(json!({"messages": [
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null},
        ]}))
        .unwrap();
        assert_eq!(r.messages[0]["role"], "system");
        assert_eq!(r.messages[1]["content"], "a\nb");
        assert_eq!(r.messages[2]["content"], "");
        let e = chat(json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("image_url"), "{e}");
    }

    #[test]
    fn errors_name_their_parameter() {
        let cases = [
            (json!({"messages": []}), 400, "messages"),
            (json!({}), 422, "messages"),
            (json!({"messages": "x"}), 422, "messages"),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}),
                400,
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 101}),
                400,
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e30}),
                422,
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}),
                422,
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n": 0}),
                400,
                "n",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n": 1000}),
                400,
                "n",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": 3}),
                400,
                "temperature",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_p": 0}),
                400,
                "top_p",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_k": -2}),
                400,
                "top_k",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"77": 1}}),
                400,
                "logit_bias",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"7": 101}}),
                400,
                "logit_bias",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}),
                400,
                "stop",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
                400,
                "top_logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}),
                400,
                "top_logprobs",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}),
                400,
                "stream_options",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
                422,
                "tools[0].function",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a b"}}]}),
                400,
                "tools[0].function.name",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
                400,
                "tool_choice",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
                400,
                "tool_choice",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}),
                422,
                "response_format.json_schema",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}),
                400,
                "response_format.type",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}),
                400,
                "frobnicate",
            ),
            (
                json!({"messages": [{"role": "tool", "content": "x"}]}),
                422,
                "messages[0].tool_call_id",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
                400,
                "messages[0].tool_calls",
            ),
            (
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
                400,
                "messages[0].role",
            ),
            (
                json!({"messages": [{"role": "user"}]}),
                422,
                "messages[0].content",
            ),
        ];
        for (body, status, param) in cases {
            let e = chat(body.clone()).expect_err(&body.to_string());
            assert_eq!(
                (e.status.as_u16(), e.param.as_deref()),
                (status, Some(param)),
                "{body}: {e}"
            );
        }
    }

    #[test]
    fn accepted_extras() {
        let r = chat(json!({
            "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7, "seed": -1,
            "stop": "END", "logit_bias": {"3": -100}, "logprobs": true, "top_logprobs": 2,
            "stream": true, "stream_options": {"include_usage": true}, "user": "u", "tools": [],
            "response_format": {"type": "text"}, "top_k": 40, "min_p": 0.1, "repetition_penalty": 1.1,
        }))
        .unwrap();
        assert_eq!(r.common.max_tokens, Some(7));
        assert_eq!(r.common.sampler.seed, Some(u64::MAX));
        assert_eq!(r.common.stop, vec!["END"]);
        assert_eq!(r.common.sampler.logit_bias, vec![(3, -100.0)]);
        assert_eq!(r.logprobs, Some(2));
        assert!(r.common.include_usage);
        assert_eq!(r.common.sampler.top_k, 40);
    }

    #[test]
    fn completion_prompts() {
        let p = |v: Value| parse_completion(&json!({"prompt": v}), LIM).map(|r| r.prompts);
        assert_eq!(p(json!("a")).unwrap(), vec![Prompt::Text("a".into())]);
        assert_eq!(p(json!(["a", "b"])).unwrap().len(), 2);
        assert_eq!(p(json!([1, 2])).unwrap(), vec![Prompt::Tokens(vec![1, 2])]);
        assert_eq!(p(json!([[1], [2, 3]])).unwrap().len(), 2);
        assert_eq!(p(json!([99])).unwrap_err().status, 400);
        assert_eq!(p(json!([])).unwrap_err().status, 400);
        assert_eq!(p(json!([1, "a"])).unwrap_err().status, 422);
        let e = parse_completion(&json!({"prompt": "a", "suffix": "b"}), LIM).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("suffix"));
        let e = parse_completion(&json!({"prompt": "a", "logprobs": 6}), LIM).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logprobs"));
    }

    #[test]
    fn chunk_shapes() {
        let meta = RespMeta {
            id: "chatcmpl-1".into(),
            created: 5,
            model: "m".into(),
        };
        let c = chat_chunk(
            &meta,
            Some(chat_chunk_choice(
                0,
                json!({"content": "x"}),
                Value::Null,
                None,
            )),
            None,
        );
        let want = format!(
            "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":5,\"model\":\"m\",\
             \"system_fingerprint\":\"{FINGERPRINT}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"x\"}},\
             \"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
        );
        assert_eq!(sse(&c), want);
        let u = chat_chunk(&meta, None, Some(usage(3, 4, 2)));
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["total_tokens"], 7);
        assert_eq!(u["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
    }
}
