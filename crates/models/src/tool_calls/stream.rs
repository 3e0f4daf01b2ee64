//! The incremental tool-call parser: text pieces in (as the model writes them), content and
//! call events out.
//!
//! Modes: `Text` passes content through, holding back a tail that may be the start of a call
//! opener (`<tool_call>`, `[TOOL_CALLS]`, ...) and trailing whitespace (dropped when a call
//! follows or the reply ends). A JSON segment scans call objects with [`CallScanner`]: a
//! call's `Start` is reported once its name is known to be a declared tool and its arguments
//! object begins, then the arguments stream as raw fragments. Formats whose calls are not JSON
//! (FunctionGemma, `tool_code`, Mistral's `name[ARGS]`) buffer a call up to its closer and
//! convert it ([`super::convert`]). A scan that fails gives its text back as content.
//! Harmony replies (GPT-OSS) are not text with call segments but channelled messages: the whole
//! reply goes to their own reader (`super::harmony`).

use super::convert;
use super::harmony::Harmony;
use super::scan::{CallScanner, Found, Step};
use super::{ToolCall, ToolFormat};

/// What the parser reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text outside any call.
    Content(String),
    /// Reasoning text, not part of the reply's content (harmony's `analysis` channel).
    Reasoning(String),
    /// Call `index` (0, 1, ... in order) starts; reported once.
    Start {
        index: usize,
        name: String,
        id: Option<String>,
    },
    /// A fragment of call `index`'s arguments (JSON text; the fragments concatenate).
    Args { index: usize, text: String },
    /// Call `index` ended: `complete` when it closed properly; otherwise (the reply ended
    /// inside it) `raw` is its text, for callers that return such calls as content.
    End {
        index: usize,
        complete: bool,
        raw: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    /// Bare call objects, separated by whitespace or `;` (Llama 3, generic).
    Objects,
    /// One object, then a closer (Hermes).
    One,
    /// A JSON list of call objects (Mistral).
    List,
}

/// A JSON call segment in progress.
#[derive(Clone, Debug)]
struct JsonSeg {
    body: Body,
    /// What ends the segment after its objects (`</tool_call>`, a fence, `]`).
    closer: Option<&'static str>,
    phase: Phase,
    /// The current object's text (with the opener for the first), for giving it back.
    raw: String,
    /// Objects completed in this segment.
    done: usize,
    /// Characters of a possible closer seen after an object.
    closing: String,
    /// A list's `,` was seen after the last object.
    sep: bool,
}

#[derive(Clone, Debug)]
enum Phase {
    /// Before the first object (or the list's `[`).
    Lead,
    Obj(Box<ObjState>),
    /// After an object: separators, the next object or the closer.
    Between,
}

#[derive(Clone, Debug)]
struct ObjState {
    scan: CallScanner,
    name: Option<String>,
    id: Option<String>,
    /// The call's index once `Start` was reported.
    started: Option<usize>,
    /// Arguments not streamed (name not known yet, or not an object).
    args: String,
    args_object: bool,
}

#[derive(Clone, Debug)]
enum Mode {
    Text,
    Json(JsonSeg),
    /// A fenced block at the start of a generic reply: "```" up to its newline.
    Fence(String),
    /// A non-JSON call body up to `closer` (or the end of the reply).
    Buffer {
        kind: BufKind,
        closer: &'static str,
        raw: String,
        body: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BufKind {
    FunctionGemma,
    ToolCode,
    MistralV11,
}

/// Streaming tool-call parser for one reply (see the module docs).
pub struct ToolCallParser {
    format: ToolFormat,
    names: Vec<String>,
    parallel: bool,
    mode: Mode,
    /// Text mode: content not yet emitted (a possible opener start, trailing whitespace).
    held: String,
    /// No non-whitespace character has been seen yet.
    at_start: bool,
    /// Next call index, and calls completed.
    next_index: usize,
    completed: usize,
    out: Vec<ToolEvent>,
    found: Vec<Found>,
    /// The harmony reader, which takes the whole reply for [`ToolFormat::Harmony`].
    harmony: Option<Harmony>,
}

const ARGS_KEYS: &[&str] = &["arguments", "parameters"];

impl ToolCallParser {
    /// `tool_names`: the declared tools (a call naming another is content); `parallel`: more
    /// than one call allowed (later ones are dropped otherwise).
    pub fn new(format: ToolFormat, tool_names: Vec<String>, parallel: bool) -> ToolCallParser {
        ToolCallParser {
            harmony: (format == ToolFormat::Harmony)
                .then(|| Harmony::new(tool_names.clone(), parallel)),
            format,
            names: tool_names,
            parallel,
            mode: Mode::Text,
            held: String::new(),
            at_start: true,
            next_index: 0,
            completed: 0,
            out: Vec::new(),
            found: Vec::new(),
        }
    }

    /// Whether any call has started.
    pub fn has_calls(&self) -> bool {
        match &self.harmony {
            Some(h) => h.has_calls(),
            None => self.next_index > 0,
        }
    }

    /// Feeds the next piece of text; returns what became final.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        if let Some(h) = &mut self.harmony {
            return h.push(text);
        }
        for c in text.chars() {
            self.feed(c);
        }
        std::mem::take(&mut self.out)
    }

    /// The reply ended: flushes held text and reports a call left open as incomplete.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        if let Some(h) = &mut self.harmony {
            return h.finish();
        }
        match std::mem::replace(&mut self.mode, Mode::Text) {
            Mode::Text => {}
            Mode::Fence(buf) => self.held.push_str(&buf),
            Mode::Json(seg) => match seg.phase {
                Phase::Obj(o) => self.give_back(&seg.raw, o.started),
                Phase::Lead => self.content(&seg.raw),
                Phase::Between => {}
            },
            Mode::Buffer {
                kind, raw, body, ..
            } => self.convert_buffer(kind, &raw, &body),
        }
        let held = std::mem::take(&mut self.held);
        if !held.trim().is_empty() {
            self.content(&held);
        }
        std::mem::take(&mut self.out)
    }

    fn openers(&self) -> &'static [&'static str] {
        match self.format {
            ToolFormat::Hermes => &["<tool_call>"],
            ToolFormat::Llama3Json => &["<|python_tag|>"],
            ToolFormat::Mistral { .. } => &["[TOOL_CALLS]"],
            ToolFormat::FunctionGemma => &["<start_function_call>"],
            ToolFormat::Generic => &["```tool_code"],
            ToolFormat::Harmony => &[],
        }
    }

    fn allowed(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// Calls past the first are dropped when parallel calls are off.
    fn suppressed(&self) -> bool {
        !self.parallel && self.completed > 0
    }

    fn content(&mut self, t: &str) {
        if t.is_empty() || self.suppressed() && t.trim().is_empty() {
            return;
        }
        if let Some(ToolEvent::Content(c)) = self.out.last_mut() {
            c.push_str(t);
        } else {
            self.out.push(ToolEvent::Content(t.to_string()));
        }
    }

    fn args(&mut self, index: usize, c: &str) {
        match self.out.last_mut() {
            Some(ToolEvent::Args { index: i, text }) if *i == index => text.push_str(c),
            _ => self.out.push(ToolEvent::Args {
                index,
                text: c.to_string(),
            }),
        }
    }

    fn start(&mut self, name: String, id: Option<String>) -> Option<usize> {
        if self.suppressed() {
            return None;
        }
        let index = self.next_index;
        self.next_index += 1;
        self.out.push(ToolEvent::Start { index, name, id });
        Some(index)
    }

    fn end(&mut self, index: Option<usize>) {
        if let Some(index) = index {
            self.out.push(ToolEvent::End {
                index,
                complete: true,
                raw: String::new(),
            });
        }
        self.completed += 1;
    }

    /// A failed or unfinished call: its text goes back as content, or, when its start was
    /// already reported, it ends as incomplete.
    fn give_back(&mut self, raw: &str, started: Option<usize>) {
        match started {
            Some(index) => self.out.push(ToolEvent::End {
                index,
                complete: false,
                raw: raw.to_string(),
            }),
            None if self.suppressed() => {}
            None => self.content(raw),
        }
    }

    /// Emits whole calls found by a converter (one `Start`, one `Args`, `End` each).
    fn emit_calls(&mut self, calls: Vec<ToolCall>) {
        for c in calls {
            let index = self.start(c.name, c.id);
            if let Some(i) = index {
                self.args(i, &c.arguments);
            }
            self.end(index);
        }
    }

    fn feed(&mut self, c: char) {
        match &mut self.mode {
            Mode::Text => self.feed_text(c),
            Mode::Fence(buf) => {
                buf.push(c);
                if c == '\n' || buf.len() > 24 {
                    let buf = std::mem::take(buf);
                    let head = buf.trim();
                    self.mode = Mode::Text;
                    if c == '\n' && (head == "```json" || head == "```") {
                        self.mode = Mode::Json(JsonSeg::new(Body::Objects, Some("```"), buf));
                    } else {
                        for ch in buf.chars() {
                            self.feed_text(ch);
                        }
                    }
                }
            }
            Mode::Json(_) => self.feed_json(c),
            Mode::Buffer {
                kind,
                closer,
                raw,
                body,
            } => {
                raw.push(c);
                body.push(c);
                if body.ends_with(*closer) {
                    let (kind, closer) = (*kind, *closer);
                    let raw = std::mem::take(raw);
                    let body = body[..body.len() - closer.len()].to_string();
                    self.mode = Mode::Text;
                    self.convert_buffer(kind, &raw, &body);
                    if kind == BufKind::MistralV11 {
                        // The closer was the next call's opener.
                        self.open(closer);
                    }
                }
            }
        }
    }

    fn convert_buffer(&mut self, kind: BufKind, raw: &str, body: &str) {
        let calls = match kind {
            BufKind::FunctionGemma => convert::function_gemma(body).map(|c| vec![c]),
            BufKind::ToolCode => convert::tool_code(body),
            BufKind::MistralV11 => convert::mistral_v11(body).map(|c| vec![c]),
        };
        match calls {
            Some(calls) if !calls.is_empty() && calls.iter().all(|c| self.allowed(&c.name)) => {
                self.emit_calls(calls)
            }
            _ => self.give_back(raw, None),
        }
    }

    fn feed_text(&mut self, c: char) {
        // Hermes models also write a bare (or fenced) call object without the tags:
        // Qwen2.5-Coder does.
        let json_at_start = matches!(
            self.format,
            ToolFormat::Llama3Json | ToolFormat::Generic | ToolFormat::Hermes
        );
        if self.at_start && !c.is_whitespace() {
            self.at_start = false;
            if json_at_start && c == '{' {
                let mut raw = std::mem::take(&mut self.held);
                raw.push(c);
                let mut seg = JsonSeg::new(Body::Objects, None, String::new());
                seg.raw = raw;
                seg.phase = Phase::Obj(Box::new(ObjState::new()));
                self.mode = Mode::Json(seg);
                self.feed_json_char('{');
                return;
            }
            if matches!(self.format, ToolFormat::Generic | ToolFormat::Hermes) && c == '`' {
                let mut buf = std::mem::take(&mut self.held);
                buf.push(c);
                self.mode = Mode::Fence(buf);
                return;
            }
        }
        self.held.push(c);
        let openers = self.openers();
        if let Some(op) = openers.iter().find(|o| self.held.ends_with(**o)) {
            let before = self.held[..self.held.len() - op.len()]
                .trim_end()
                .to_string();
            self.held.clear();
            self.content(&before);
            self.open(op);
            return;
        }
        // Keep back the longest tail that could start an opener, and trailing whitespace.
        let mut keep = self.held.len();
        for op in openers {
            for (i, _) in self.held.char_indices() {
                if op.starts_with(&self.held[i..]) {
                    keep = keep.min(i);
                    break;
                }
            }
        }
        let head = &self.held[..keep];
        let cut = head.trim_end().len();
        if cut > 0 {
            let emit = self.held[..cut].to_string();
            self.held.drain(..cut);
            self.content(&emit);
        }
    }

    /// An opener was seen: start its segment.
    fn open(&mut self, opener: &'static str) {
        self.at_start = false;
        let raw = opener.to_string();
        self.mode = match (self.format, opener) {
            (ToolFormat::Hermes, _) => {
                Mode::Json(JsonSeg::new(Body::One, Some("</tool_call>"), raw))
            }
            (ToolFormat::Mistral { .. }, _) => Mode::Json(JsonSeg::new(Body::List, Some("]"), raw)),
            (ToolFormat::FunctionGemma, _) => Mode::Buffer {
                kind: BufKind::FunctionGemma,
                closer: "<end_function_call>",
                raw,
                body: String::new(),
            },
            (ToolFormat::Generic, _) => Mode::Buffer {
                kind: BufKind::ToolCode,
                closer: "```",
                raw,
                body: String::new(),
            },
            (ToolFormat::Llama3Json, _) => Mode::Json(JsonSeg::new(Body::Objects, None, raw)),
            // Harmony replies are read by their own reader and have no opener.
            (ToolFormat::Harmony, _) => Mode::Text,
        };
    }

    fn feed_json(&mut self, c: char) {
        let Mode::Json(seg) = &mut self.mode else {
            return;
        };
        match &mut seg.phase {
            Phase::Lead => {
                seg.raw.push(c);
                if c.is_whitespace() {
                    return;
                }
                match (seg.body, c) {
                    (Body::List, '[') => seg.phase = Phase::Between,
                    (Body::List, _) if self.format == (ToolFormat::Mistral { v11: true }) => {
                        // `[TOOL_CALLS]name[ARGS]{...}`: buffered up to the next call or the end.
                        let raw = std::mem::take(&mut seg.raw);
                        self.mode = Mode::Buffer {
                            kind: BufKind::MistralV11,
                            closer: "[TOOL_CALLS]",
                            raw,
                            body: c.to_string(),
                        };
                    }
                    (Body::One | Body::Objects, '{') => {
                        seg.phase = Phase::Obj(Box::new(ObjState::new()));
                        self.feed_json_char(c);
                    }
                    _ => self.fail_segment(),
                }
            }
            Phase::Obj(_) => {
                seg.raw.push(c);
                self.feed_json_char(c);
            }
            Phase::Between => self.between(c),
        }
    }

    /// The current segment failed: its current text goes back as content.
    fn fail_segment(&mut self) {
        if let Mode::Json(seg) = std::mem::replace(&mut self.mode, Mode::Text) {
            let started = match &seg.phase {
                Phase::Obj(o) => o.started,
                _ => None,
            };
            self.give_back(&seg.raw, started);
        }
    }

    /// Feeds an object character (already appended to the segment's raw text).
    fn feed_json_char(&mut self, c: char) {
        let Mode::Json(seg) = &mut self.mode else {
            return;
        };
        let Phase::Obj(o) = &mut seg.phase else {
            return;
        };
        self.found.clear();
        let step = o.scan.feed(c, &mut self.found);
        let found = std::mem::take(&mut self.found);
        for f in found {
            self.on_found(f);
        }
        match step {
            Step::More => {}
            Step::Fail => self.fail_segment(),
            Step::Done => self.object_done(),
        }
    }

    fn obj(&mut self) -> Option<&mut ObjState> {
        match &mut self.mode {
            Mode::Json(JsonSeg {
                phase: Phase::Obj(o),
                ..
            }) => Some(o),
            _ => None,
        }
    }

    fn on_found(&mut self, f: Found) {
        let suppressed = self.suppressed();
        let Some(o) = self.obj() else { return };
        match f {
            Found::Name(n) => o.name = Some(n),
            Found::Id(i) => o.id = Some(i),
            Found::ArgsStart { object } => {
                o.args_object = object;
                let ready = object && o.name.is_some();
                let (name, id) = (o.name.clone(), o.id.clone());
                if ready && !suppressed {
                    let name = name.unwrap_or_default();
                    if self.allowed(&name) {
                        let index = self.start(name, id);
                        if let Some(o) = self.obj() {
                            o.started = index;
                        }
                    }
                }
            }
            Found::Args(c) => match o.started {
                Some(index) => {
                    let mut b = [0u8; 4];
                    self.args(index, c.encode_utf8(&mut b));
                }
                None => o.args.push(c),
            },
            Found::ArgsEnd => {}
        }
    }

    fn object_done(&mut self) {
        let Mode::Json(seg) = &mut self.mode else {
            return;
        };
        let Phase::Obj(o) = std::mem::replace(&mut seg.phase, Phase::Between) else {
            return;
        };
        let raw = std::mem::take(&mut seg.raw);
        seg.done += 1;
        let one = seg.body == Body::One;
        if let Some(index) = o.started {
            self.end(Some(index));
        } else {
            let name = o.name.clone().unwrap_or_default();
            if !self.allowed(&name) {
                // Not a call of a declared tool: the object is content.
                if let Mode::Json(seg) = &mut self.mode {
                    seg.raw = raw;
                    seg.phase = Phase::Lead;
                }
                self.fail_segment();
                return;
            }
            let arguments = if !o.scan.has_args {
                "{}".to_string()
            } else if o.args_object {
                o.args
            } else {
                // A string that encodes the arguments: decode it.
                serde_json::from_str::<String>(&o.args).unwrap_or(o.args)
            };
            self.emit_calls(vec![ToolCall {
                name,
                arguments,
                id: o.id,
            }]);
        }
        if one {
            if let Mode::Json(seg) = &mut self.mode {
                seg.phase = Phase::Between;
            }
        }
    }

    fn between(&mut self, c: char) {
        let Mode::Json(seg) = &mut self.mode else {
            return;
        };
        if let Some(closer) = seg.closer {
            let mut next = seg.closing.clone();
            next.push(c);
            if closer.starts_with(&next) {
                seg.closing = next;
                if seg.closing == closer {
                    self.mode = Mode::Text;
                }
                return;
            }
        }
        let pending = std::mem::take(&mut seg.closing);
        if pending.is_empty() {
            match (seg.body, c) {
                (_, c) if c.is_whitespace() => return,
                (Body::Objects, ';') => return,
                (Body::List, ',') if seg.done > 0 && !seg.sep => {
                    seg.sep = true;
                    return;
                }
                (Body::Objects, '{') | (Body::List, '{')
                    if seg.body == Body::Objects || seg.done == 0 || seg.sep =>
                {
                    seg.sep = false;
                    seg.raw = c.to_string();
                    seg.phase = Phase::Obj(Box::new(ObjState::new()));
                    self.feed_json_char(c);
                    return;
                }
                _ => {}
            }
        }
        // Anything else ends the calls; the rest is content.
        self.mode = Mode::Text;
        for ch in pending.chars().chain(std::iter::once(c)) {
            self.feed_text(ch);
        }
    }
}

impl JsonSeg {
    fn new(body: Body, closer: Option<&'static str>, raw: String) -> JsonSeg {
        JsonSeg {
            body,
            closer,
            phase: Phase::Lead,
            raw,
            done: 0,
            closing: String::new(),
            sep: false,
        }
    }
}

impl ObjState {
    fn new() -> ObjState {
        ObjState {
            scan: CallScanner::new(ARGS_KEYS),
            name: None,
            id: None,
            started: None,
            args: String::new(),
            args_object: false,
        }
    }
}
