//! GPT-OSS's harmony format, read incrementally: a reply is a run of messages, each a header
//! and a body, e.g. (generation starts after the prompt's `<|start|>assistant`)
//!
//! ```text
//! <|channel|>analysis<|message|>thinking...<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Paris"}<|call|>
//! <|start|>assistant<|channel|>final<|message|>The answer<|return|>
//! ```
//!
//! A header runs from `<|start|>` (or the reply's start) to `<|message|>`; its `<|channel|>NAME`
//! picks where the body goes and `to=RECIPIENT` (before or after the channel) addresses a tool.
//! Bodies are routed: the `analysis` channel is reasoning ([`ToolEvent::Reasoning`]); a message
//! to `functions.NAME` of a declared tool is a call whose arguments are the body (JSON, streamed
//! raw from its `{`; checked to be one object when the message ends); everything else (`final`,
//! `commentary` without a recipient, unknown recipients) is content. A body ends at `<|end|>`,
//! `<|call|>`, `<|return|>`, a new `<|start|>`, or the end of the reply (`<|call|>` and
//! `<|return|>` end generation, so their text usually never arrives). Markup never reaches
//! content or reasoning: a tail that may still become a marker is held back.
//!
//! Calls follow the rules of [`super`]: a body that is not a JSON object, or a call of an
//! undeclared tool, is content; a call past the first is dropped when parallel calls are off.
//!
//! What it is not: the generic format's parser ([`super::stream`]), or the built-in `browser` /
//! `python` tools (messages to them are content).

use super::ToolEvent;

/// The harmony markup, each one special token of the GPT-OSS vocabulary.
pub const MARKERS: &[&str] = &[
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
];

/// Longest header kept while waiting for `<|message|>`. Real headers are under 130 bytes
/// (`<|channel|>commentary to=functions.` + a 64-character tool name + ` <|constrain|>json`);
/// text past this without `<|message|>` is taken for a body written without markup (content).
const MAX_HEADER: usize = 256;

/// Where the current message's body goes.
#[derive(Clone, Debug)]
enum Route {
    Reasoning,
    Content,
    /// A call of a declared tool; `started` once its `Start` was reported.
    Call {
        name: String,
        started: Option<usize>,
        body: String,
    },
    /// A call past the first while parallel calls are off.
    Drop,
}

/// The harmony reader of one reply.
#[derive(Clone, Debug)]
pub(super) struct Harmony {
    names: Vec<String>,
    parallel: bool,
    /// `None` while reading a header.
    route: Option<Route>,
    header: String,
    /// A possible marker's start, held back.
    pending: String,
    next_index: usize,
    completed: usize,
    out: Vec<ToolEvent>,
}

impl Harmony {
    pub fn new(names: Vec<String>, parallel: bool) -> Harmony {
        Harmony {
            names,
            parallel,
            route: None,
            header: String::new(),
            pending: String::new(),
            next_index: 0,
            completed: 0,
            out: Vec::new(),
        }
    }

    pub fn has_calls(&self) -> bool {
        self.next_index > 0
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        for c in text.chars() {
            self.feed(c);
        }
        std::mem::take(&mut self.out)
    }

    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let rest = std::mem::take(&mut self.pending);
        for c in rest.chars() {
            self.text(c);
        }
        match self.route {
            Some(_) => self.end_message(),
            None => self.flush_header(),
        }
        std::mem::take(&mut self.out)
    }

    fn feed(&mut self, c: char) {
        self.pending.push(c);
        loop {
            if let Some(m) = MARKERS.iter().find(|m| **m == self.pending) {
                self.pending.clear();
                self.marker(*m);
                return;
            }
            if MARKERS.iter().any(|m| m.starts_with(self.pending.as_str())) {
                return;
            }
            let first = self.pending.remove(0);
            self.text(first);
            if self.pending.is_empty() {
                return;
            }
        }
    }

    fn marker(&mut self, m: &'static str) {
        match m {
            "<|start|>" | "<|end|>" | "<|call|>" | "<|return|>" => {
                if self.route.is_some() {
                    self.end_message();
                } else {
                    self.flush_header();
                }
            }
            "<|message|>" if self.route.is_none() => self.open(),
            // `<|channel|>`, `<|constrain|>`: header parts; stray markup inside a body is dropped.
            _ if self.route.is_none() => self.header.push_str(m),
            _ => {}
        }
    }

    /// A character outside markup.
    fn text(&mut self, c: char) {
        let mut buf = [0; 4];
        let s: &str = c.encode_utf8(&mut buf);
        match &self.route {
            None => {
                self.header.push(c);
                if self.header.len() > MAX_HEADER {
                    let t = strip_markers(&std::mem::take(&mut self.header));
                    self.route = Some(Route::Content);
                    self.emit_text(&t, false);
                }
            }
            Some(Route::Reasoning) => self.emit_text(s, true),
            Some(Route::Content) => self.emit_text(s, false),
            Some(Route::Drop) => {}
            Some(Route::Call { .. }) => self.call_text(c),
        }
    }

    /// A character of a call's body: `Start` once the arguments object begins, then fragments.
    fn call_text(&mut self, c: char) {
        let next = self.next_index;
        let Some(Route::Call {
            name,
            started,
            body,
        }) = &mut self.route
        else {
            return;
        };
        body.push(c);
        match *started {
            Some(index) => {
                let mut buf = [0; 4];
                let s = c.encode_utf8(&mut buf).to_string();
                self.args(index, &s);
            }
            None if body.trim_start().starts_with('{') => {
                *started = Some(next);
                let (name, args) = (name.clone(), body.trim_start().to_string());
                self.next_index += 1;
                self.out.push(ToolEvent::Start {
                    index: next,
                    name,
                    id: None,
                });
                self.args(next, &args);
            }
            None => {}
        }
    }

    fn suppressed(&self) -> bool {
        !self.parallel && self.completed > 0
    }

    /// `<|message|>`: the header is complete; choose the body's route.
    fn open(&mut self) {
        let header = std::mem::take(&mut self.header);
        let recipient = word_after(&header, "to=");
        let channel = word_after(&header, "<|channel|>");
        let route = match recipient {
            Some(r) => match r.strip_prefix("functions.") {
                Some(name) if self.names.iter().any(|n| n == name) => {
                    if self.suppressed() {
                        Route::Drop
                    } else {
                        Route::Call {
                            name: name.to_string(),
                            started: None,
                            body: String::new(),
                        }
                    }
                }
                _ => Route::Content,
            },
            None if channel == Some("analysis") => Route::Reasoning,
            None => Route::Content,
        };
        self.route = Some(route);
    }

    /// The current message ended: a call is checked and closed (or given back as content).
    fn end_message(&mut self) {
        if let Some(Route::Call { started, body, .. }) = self.route.take() {
            let object =
                serde_json::from_str::<serde_json::Value>(body.trim()).is_ok_and(|v| v.is_object());
            match started {
                Some(index) => {
                    self.out.push(ToolEvent::End {
                        index,
                        complete: object,
                        raw: if object { String::new() } else { body },
                    });
                    if object {
                        self.completed += 1;
                    }
                }
                None => self.emit_text(&body, false),
            }
        }
        self.route = None;
        self.header.clear();
    }

    /// A header that never reached `<|message|>`: its text (without markup) is content.
    fn flush_header(&mut self) {
        let t = strip_markers(&std::mem::take(&mut self.header));
        if !t.trim().is_empty() {
            self.emit_text(&t, false);
        }
    }

    fn emit_text(&mut self, t: &str, reasoning: bool) {
        if t.is_empty() {
            return;
        }
        match (self.out.last_mut(), reasoning) {
            (Some(ToolEvent::Reasoning(r)), true) => r.push_str(t),
            (Some(ToolEvent::Content(c)), false) => c.push_str(t),
            (_, true) => self.out.push(ToolEvent::Reasoning(t.to_string())),
            (_, false) => self.out.push(ToolEvent::Content(t.to_string())),
        }
    }

    fn args(&mut self, index: usize, t: &str) {
        match self.out.last_mut() {
            Some(ToolEvent::Args { index: i, text }) if *i == index => text.push_str(t),
            _ => self.out.push(ToolEvent::Args {
                index,
                text: t.to_string(),
            }),
        }
    }
}

/// The word after `key` in a header: up to whitespace or the next marker.
fn word_after<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let rest = &header[header.find(key)? + key.len()..];
    let rest = rest.trim_start();
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '<')
        .unwrap_or(rest.len());
    Some(&rest[..end]).filter(|w| !w.is_empty())
}

fn strip_markers(s: &str) -> String {
    MARKERS.iter().fold(s.to_string(), |t, m| t.replace(m, ""))
}
