//! Chat templates: turning a conversation into the prompt text a model was trained on.
//!
//! Models ship a Jinja template (`chat_template` in tokenizer_config.json, or
//! `tokenizer.chat_template` in GGUF). It is rendered here with minijinja set up to behave like
//! `transformers`' `apply_chat_template`: `trim_blocks` + `lstrip_blocks`, loop controls, Python
//! string/dict methods (`.strip()`, `.startswith()`, `.items()`, ... via minijinja-contrib's
//! pycompat), HF's `tojson` (Python `json.dumps` output, no HTML escaping), `raise_exception(msg)`,
//! `strftime_now(fmt)`, and the variables `messages`, `add_generation_prompt`, `bos_token`,
//! `eos_token`, `tools` (none when absent) and `documents` (none).
//!
//! Rendering is bounded: no loader (templates cannot read files), a fuel limit on executed
//! instructions and a recursion limit, so a hostile or broken template fails with a clear
//! [`Error::Template`] instead of hanging.
//!
//! Injection protection ([`ChatTemplate::render_segments`], [`encode_chat`]): message contents
//! are rendered as sentinels and the output is split so the tokenizer can recognise special
//! tokens only in template text. Message content is tokenized with special tokens as plain
//! text, so a user typing `<|im_end|>` cannot close their own turn.
//!
//! What it is not: a full Jinja2 implementation (minijinja covers what chat templates use), nor a
//! parser of model output (tool calls, reasoning).

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

use minijinja::value::Value;
use minijinja::{AutoEscape, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

mod tojson;
use tojson::tojson_filter;

/// One chat turn, as in the OpenAI / Hugging Face `messages` list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A piece of rendered prompt: template text (special tokens allowed) or message content
/// (special tokens are plain text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub text: String,
    pub is_content: bool,
}

/// Optional inputs of a render beyond the messages.
#[derive(Clone, Copy, Debug, Default)]
pub struct RenderOptions<'a> {
    pub add_generation_prompt: bool,
    /// OpenAI-style tool definitions, passed as `tools`; `None` renders `tools` as none.
    pub tools: Option<&'a serde_json::Value>,
    /// Extra template variables (e.g. `enable_thinking`, `date_string`).
    pub extra: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

/// The template used when a model ships none: ChatML, which is also llama.cpp's default. Models
/// whose vocabulary lacks `<|im_start|>` will see it as plain text, which base models continue
/// well enough.
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// Instructions a render may execute. Real templates use a few dozen per message; this allows
/// conversations of many thousand turns while stopping runaway loops within about a second.
pub const DEFAULT_FUEL: u64 = 20_000_000;
/// Nesting depth for macros, includes and recursive loops; chat templates need a handful.
const RECURSION_LIMIT: usize = 64;
const TEMPLATE_NAME: &str = "chat_template";
/// Marks the detail of an error raised by the template's own `raise_exception`.
const RAISED: &str = "\u{1}raise_exception\u{1}";

/// A compiled chat template with its special-token strings.
#[derive(Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Special-token strings to neutralise in message content when the sentinel split is not
    /// possible (see [`ChatTemplate::render_segments`]).
    special_tokens: Vec<String>,
    now: Option<chrono::NaiveDateTime>,
    fuel: u64,
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("source_len", &self.source.len())
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is reported here, not at render time.
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        let source = strip_generation_tags(source);
        let env = build_env(&source, None, DEFAULT_FUEL)?;
        Ok(ChatTemplate {
            source,
            bos_token: bos_token.map(str::to_string),
            eos_token: eos_token.map(str::to_string),
            special_tokens: Vec::new(),
            now: None,
            fuel: DEFAULT_FUEL,
            env,
        })
    }

    /// The template for models that ship none: [`CHATML_TEMPLATE`].
    pub fn fallback(bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        Self::new(CHATML_TEMPLATE, bos_token, eos_token)
    }

    /// The tokenizer's own template (or the fallback), with its BOS/EOS and special tokens.
    pub fn for_tokenizer(tok: &Tokenizer) -> Result<Self> {
        let t = match tok.chat_template() {
            Some(src) => Self::new(src, tok.bos_token(), tok.eos_token())?,
            None => Self::fallback(tok.bos_token(), tok.eos_token())?,
        };
        Ok(t.with_special_tokens(tok.special_tokens().map(str::to_string).collect()))
    }

    /// Registers the special-token strings that [`ChatTemplate::render_segments`] neutralises in
    /// content when it has to fall back (see there). [`encode_chat`] takes them from the tokenizer.
    pub fn with_special_tokens(mut self, tokens: Vec<String>) -> Self {
        self.special_tokens = tokens;
        self
    }

    /// Fixes the clock that `strftime_now` reads (reproducible prompts, tests).
    pub fn with_now(mut self, now: chrono::NaiveDateTime) -> Result<Self> {
        self.now = Some(now);
        self.env = build_env(&self.source, self.now, self.fuel)?;
        Ok(self)
    }

    /// Changes the instruction budget of one render (default [`DEFAULT_FUEL`]).
    pub fn with_fuel(mut self, fuel: u64) -> Result<Self> {
        self.fuel = fuel;
        self.env = build_env(&self.source, self.now, self.fuel)?;
        Ok(self)
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the conversation to prompt text.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(
            messages,
            &RenderOptions {
                add_generation_prompt,
                ..Default::default()
            },
        )
    }

    /// Renders with tools and extra variables.
    pub fn render_with(&self, messages: &[ChatMessage], opts: &RenderOptions) -> Result<String> {
        self.render_json(&messages_json(messages), opts)
    }

    /// Renders messages given as JSON objects, for what [`ChatMessage`] cannot carry: content
    /// parts (`[{"type": "text", "text": ...}]`), `tool_calls`, `reasoning_content`.
    pub fn render_json(
        &self,
        messages: &[serde_json::Value],
        opts: &RenderOptions,
    ) -> Result<String> {
        let mut ctx = opts.extra.cloned().unwrap_or_default();
        ctx.insert(
            "messages".into(),
            serde_json::Value::Array(messages.to_vec()),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            opts.add_generation_prompt.into(),
        );
        ctx.insert(
            "tools".into(),
            opts.tools.cloned().unwrap_or(serde_json::Value::Null),
        );
        ctx.insert("documents".into(), serde_json::Value::Null);
        // As transformers: a token the tokenizer lacks is not defined at all (renders empty).
        if let Some(b) = &self.bos_token {
            ctx.insert("bos_token".into(), b.clone().into());
        }
        if let Some(e) = &self.eos_token {
            ctx.insert("eos_token".into(), e.clone().into());
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(template_error)?;
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(template_error)
    }

    /// Renders and returns segments so user content cannot inject special tokens: each message's
    /// content is replaced with a unique sentinel during rendering, then the output is split so
    /// template text (to be tokenized with parse_special = true) and message content (with
    /// parse_special = false) are kept apart.
    ///
    /// Templates that transform content (`.strip()`, `| trim`, `.split('</think>')`) break the
    /// substitution; this is detected by comparing with a plain render. Then the template is
    /// rendered with every special-token string inside content (the registered ones, see
    /// [`ChatTemplate::with_special_tokens`]) replaced by a sentinel; those strings become the
    /// content segments and everything else is template text, which then no longer contains any
    /// special string that came from a message.
    pub fn render_segments(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<Segment>> {
        let opts = RenderOptions {
            add_generation_prompt,
            ..Default::default()
        };
        self.render_segments_json(&messages_json(messages), &opts)
    }

    /// [`ChatTemplate::render_segments`] for messages given as JSON (content parts, tool calls,
    /// reasoning): every string in a message except the `role` and `type` fields counts as
    /// content.
    pub fn render_segments_json(
        &self,
        messages: &[serde_json::Value],
        opts: &RenderOptions,
    ) -> Result<Vec<Segment>> {
        let specials: Vec<&str> = self.special_tokens.iter().map(String::as_str).collect();
        self.render_segments_impl(messages, opts, &specials)
    }

    fn render_segments_impl(
        &self,
        messages: &[serde_json::Value],
        opts: &RenderOptions,
        specials: &[&str],
    ) -> Result<Vec<Segment>> {
        let plain = self.render_json(messages, opts)?;
        let tag = unique_tag(messages);
        let sentinel = |i: usize| format!("\u{E000}{tag}:{i}\u{E001}");

        // 1. Every content string as a sentinel. Empty strings stay empty: templates test them
        // for truthiness, and there is nothing to protect.
        let mut originals: Vec<String> = Vec::new();
        let masked: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| {
                map_content_strings(m, &mut |text: &str| {
                    if text.is_empty() {
                        return String::new();
                    }
                    originals.push(text.to_string());
                    sentinel(originals.len() - 1)
                })
            })
            .collect();
        if let Ok(out) = self.render_json(&masked, opts) {
            if let Some(segs) =
                split_sentinels(&out, &tag, |i| originals.get(i).map(String::as_str))
            {
                if concat(&segs) == plain {
                    return Ok(segs);
                }
            }
        }

        // 2. The template changes content: neutralise only the special strings inside it.
        let mut table: Vec<&str> = Vec::new();
        let neutralised: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| {
                map_content_strings(m, &mut |text: &str| {
                    replace_specials(text, specials, |sp| {
                        table.push(sp);
                        sentinel(table.len() - 1)
                    })
                })
            })
            .collect();
        if table.is_empty() {
            return Ok(normalize(vec![Segment {
                text: plain,
                is_content: false,
            }]));
        }
        let out = self.render_json(&neutralised, opts)?;
        split_sentinels(&out, &tag, |i| table.get(i).copied()).ok_or_else(|| {
            Error::Template("the template altered the placeholders that protect special tokens in message content".into())
        })
    }
}

/// Rebuilds a message with `f` applied to every string except `role` / `type` fields (and
/// object keys).
fn map_content_strings(
    v: &serde_json::Value,
    f: &mut dyn FnMut(&str) -> String,
) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        J::String(s) => J::String(f(s)),
        J::Array(items) => J::Array(items.iter().map(|x| map_content_strings(x, f)).collect()),
        J::Object(map) => J::Object(
            map.iter()
                .map(|(k, x)| {
                    let x = if k == "role" || k == "type" {
                        x.clone()
                    } else {
                        map_content_strings(x, f)
                    };
                    (k.clone(), x)
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

fn messages_json(messages: &[ChatMessage]) -> Vec<serde_json::Value> {
    messages
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect()
}

/// Tokenizes a chat with injection protection: special tokens are recognised only in template
/// text; message content is tokenized with special-token strings as plain text. Without an
/// injection attempt the ids equal tokenizing the rendered prompt with special tokens parsed.
/// BOS is prepended when the model wants one and the template did not already emit it; no EOS
/// (the prompt continues with the model's turn).
pub fn encode_chat(
    tok: &Tokenizer,
    tmpl: &ChatTemplate,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
) -> Result<Vec<u32>> {
    encode_chat_with(
        tok,
        tmpl,
        messages,
        &RenderOptions {
            add_generation_prompt,
            ..Default::default()
        },
    )
}

/// [`encode_chat`] with tools and extra template variables.
pub fn encode_chat_with(
    tok: &Tokenizer,
    tmpl: &ChatTemplate,
    messages: &[ChatMessage],
    opts: &RenderOptions,
) -> Result<Vec<u32>> {
    encode_chat_json(tok, tmpl, &messages_json(messages), opts)
}

/// [`encode_chat`] for messages given as JSON (see [`ChatTemplate::render_json`]); every string
/// in a message except `role` / `type` is protected content.
pub fn encode_chat_json(
    tok: &Tokenizer,
    tmpl: &ChatTemplate,
    messages: &[serde_json::Value],
    opts: &RenderOptions,
) -> Result<Vec<u32>> {
    Ok(encode_chat_offsets(tok, tmpl, messages, opts)?.ids)
}

/// A chat tokenized for training: the rendered text, its ids and the byte offset in `text` where
/// each id starts (a BOS the template did not write has offset 0).
pub struct EncodedChat {
    pub text: String,
    pub ids: Vec<u32>,
    pub starts: Vec<usize>,
}

/// [`encode_chat_json`] keeping the rendered text and each token's offset in it.
pub fn encode_chat_offsets(
    tok: &Tokenizer,
    tmpl: &ChatTemplate,
    messages: &[serde_json::Value],
    opts: &RenderOptions,
) -> Result<EncodedChat> {
    let specials: Vec<&str> = tok.special_tokens().collect();
    let segs = tmpl.render_segments_impl(messages, opts, &specials)?;
    let mut text = String::new();
    let mut allowed = Vec::new();
    for s in &segs {
        let start = text.len();
        text.push_str(&s.text);
        if !s.is_content {
            allowed.push((start, text.len()));
        }
    }
    let (mut ids, mut starts) = tok.encode_with_special_spans(&text, &allowed)?;
    if let (true, Some(bos)) = (tok.add_bos(), tok.bos_id()) {
        if ids.first() != Some(&bos) {
            ids.insert(0, bos);
            starts.insert(0, 0);
        }
    }
    Ok(EncodedChat { text, ids, starts })
}

// ---- rendering environment --------------------------------------------------------------------

fn build_env(
    source: &str,
    now: Option<chrono::NaiveDateTime>,
    fuel: u64,
) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_fuel(Some(fuel));
    env.set_recursion_limit(RECURSION_LIMIT);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson_filter);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("{RAISED}{msg}"),
            ))
        },
    );
    env.add_function(
        "strftime_now",
        move |fmt: String| -> std::result::Result<String, minijinja::Error> {
            strftime(
                &fmt,
                now.unwrap_or_else(|| chrono::Local::now().naive_local()),
            )
        },
    );
    env.add_template_owned(TEMPLATE_NAME, source.to_string())
        .map_err(|e| {
            Error::Template(format!("cannot parse the chat template: {}", describe(&e)))
        })?;
    Ok(env)
}

fn strftime(
    fmt: &str,
    now: chrono::NaiveDateTime,
) -> std::result::Result<String, minijinja::Error> {
    use chrono::format::{Item, StrftimeItems};
    // chrono panics when displaying an invalid format; check first.
    if StrftimeItems::new(fmt).any(|i| matches!(i, Item::Error)) {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {fmt:?}"),
        ));
    }
    Ok(now.format(fmt).to_string())
}

fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(&format!(": {inner}"));
        src = inner.source();
    }
    s
}

fn template_error(e: minijinja::Error) -> Error {
    // The template's own raise_exception: report its message as the cause.
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = cur {
        if let Some(me) = err.downcast_ref::<minijinja::Error>() {
            if let Some(msg) = me.detail().and_then(|d| d.strip_prefix(RAISED)) {
                return Error::Template(format!("the chat template raised an exception: {msg}"));
            }
        }
        cur = err.source();
    }
    match e.kind() {
        ErrorKind::OutOfFuel => Error::Template(
            "rendering stopped: the chat template executed too many instructions (fuel limit)"
                .into(),
        ),
        _ => Error::Template(format!("rendering failed: {}", describe(&e))),
    }
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' assistant-mask extension) only mark
/// spans for training masks; they have no output. minijinja does not know them, so they go.
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(pos) = rest.find("{%") {
        let after = &rest[pos + 2..];
        let inner = after.trim_start_matches('-').trim_start();
        let keyword = ["endgeneration", "generation"]
            .into_iter()
            .find(|k| inner.starts_with(k));
        let close = after.find("%}");
        match (keyword, close) {
            (Some(k), Some(c))
                if after[..c].trim_matches(|ch: char| ch == '-' || ch.is_whitespace()) == k =>
            {
                out.push_str(&rest[..pos]);
                rest = &after[c + 2..];
            }
            _ => {
                out.push_str(&rest[..pos + 2]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

// ---- sentinels --------------------------------------------------------------------------------

/// A random tag that no message contains, so sentinels cannot be forged by a user.
fn unique_tag(messages: &[serde_json::Value]) -> String {
    let all: Vec<String> = messages.iter().map(|m| m.to_string()).collect();
    loop {
        let mut h = RandomState::new().build_hasher();
        h.write_usize(messages.len());
        let tag = format!("{:016x}", h.finish());
        if !all.iter().any(|m| m.contains(&tag)) {
            return tag;
        }
    }
}

/// Splits rendered text at sentinels `\u{E000}{tag}:{i}\u{E001}`, replacing each by
/// `lookup(i)` as a content segment. `None` if a sentinel is malformed, unknown, or a stray
/// sentinel character is left (the template cut one apart).
fn split_sentinels<'a>(
    out: &str,
    tag: &str,
    lookup: impl Fn(usize) -> Option<&'a str>,
) -> Option<Vec<Segment>> {
    let open = format!("\u{E000}{tag}:");
    let mut segs = Vec::new();
    let mut rest = out;
    while let Some(pos) = rest.find(&open) {
        segs.push(Segment {
            text: rest[..pos].to_string(),
            is_content: false,
        });
        let after = &rest[pos + open.len()..];
        let end = after.find('\u{E001}')?;
        let idx: usize = after[..end].parse().ok()?;
        segs.push(Segment {
            text: lookup(idx)?.to_string(),
            is_content: true,
        });
        rest = &after[end + '\u{E001}'.len_utf8()..];
    }
    segs.push(Segment {
        text: rest.to_string(),
        is_content: false,
    });
    if segs
        .iter()
        .any(|s| !s.is_content && (s.text.contains(tag) || s.text.contains('\u{E001}')))
    {
        return None;
    }
    Some(normalize(segs))
}

/// Drops empty segments and merges neighbours of the same kind.
fn normalize(segs: Vec<Segment>) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::new();
    for s in segs {
        if s.text.is_empty() {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.is_content == s.is_content => last.text.push_str(&s.text),
            _ => out.push(s),
        }
    }
    out
}

fn concat(segs: &[Segment]) -> String {
    segs.iter().map(|s| s.text.as_str()).collect()
}

/// Replaces every occurrence of a special string in `text` (leftmost, longest first) by
/// `placeholder(special)`.
fn replace_specials<'s>(
    text: &str,
    specials: &[&'s str],
    mut placeholder: impl FnMut(&'s str) -> String,
) -> String {
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    'outer: while i < text.len() {
        let rest = &text[i..];
        let mut best: Option<&'s str> = None;
        for &s in specials {
            if !s.is_empty() && rest.starts_with(s) && best.is_none_or(|b| s.len() > b.len()) {
                best = Some(s);
            }
        }
        if let Some(s) = best {
            out.push_str(&placeholder(s));
            i += s.len();
            continue 'outer;
        }
        let ch = rest.chars().next().expect("non-empty");
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_are_removed() {
        let s = "a{% generation %}b{%- endgeneration -%}c{% if x %}d{% endif %}";
        assert_eq!(strip_generation_tags(s), "abc{% if x %}d{% endif %}");
    }

    #[test]
    fn specials_replaced_longest_first() {
        let mut seen = Vec::new();
        let out = replace_specials("a<|im_end|>b<|im|>", &["<|im|>", "<|im_end|>"], |s| {
            seen.push(s.to_string());
            "#".into()
        });
        assert_eq!(out, "a#b#");
        assert_eq!(seen, ["<|im_end|>", "<|im|>"]);
    }
}
