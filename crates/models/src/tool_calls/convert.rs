//! Converters for call bodies that are not JSON: FunctionGemma's `call:name{k:<escape>v<escape>}`,
//! Gemma 3's `tool_code` Python calls `name(k="v", n=1)`, and Mistral's `name[ARGS]{...}`.
//! Each returns `None` for anything it cannot read completely (the caller keeps it as content).
//!
//! The Python reader takes the literals models write in calls (strings, numbers, `True` /
//! `False` / `None`, lists, dicts) and keyword arguments only; it is not a Python parser.

use serde_json::{Map, Number, Value};

use super::ToolCall;

fn call(name: &str, args: Value) -> Option<ToolCall> {
    let name = name.trim();
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_alphanumeric() || "_-.".contains(c))
    {
        return None;
    }
    Some(ToolCall {
        name: name.to_string(),
        arguments: args.to_string(),
        id: None,
    })
}

/// `NAME[ARGS]{json}` (an optional `[CALL_ID]id` before `[ARGS]`).
pub(super) fn mistral_v11(body: &str) -> Option<ToolCall> {
    let (head, args) = body.split_once("[ARGS]")?;
    let name = head.split("[CALL_ID]").next()?;
    let id = head
        .split_once("[CALL_ID]")
        .map(|(_, i)| i.trim().to_string());
    let v: Value = serde_json::from_str(args.trim()).ok()?;
    if !v.is_object() {
        return None;
    }
    let mut c = call(name, v)?;
    c.id = id.filter(|i| !i.is_empty());
    Some(c)
}

/// FunctionGemma: `call:NAME{key:<escape>text<escape>,n:3,flag:true,obj:{...},list:[...]}`.
pub(super) fn function_gemma(body: &str) -> Option<ToolCall> {
    let rest = body.trim().strip_prefix("call:")?;
    let brace = rest.find('{')?;
    let name = &rest[..brace];
    let mut r = Reader::new(&rest[brace..]);
    let args = r.gemma_value()?;
    r.ws();
    if !r.done() || !args.is_object() {
        return None;
    }
    call(name, args)
}

/// `tool_code` block: one Python call per line, keyword arguments only.
pub(super) fn tool_code(body: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for line in body.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let line = line
            .strip_prefix("print(")
            .and_then(|l| l.strip_suffix(')'))
            .unwrap_or(line);
        let open = line.find('(')?;
        let mut r = Reader::new(&line[open + 1..]);
        let mut args = Map::new();
        loop {
            r.ws();
            if r.eat(')') {
                break;
            }
            let key = r.ident()?;
            r.ws();
            if !r.eat('=') {
                return None;
            }
            let v = r.py_value()?;
            args.insert(key, v);
            r.ws();
            if r.eat(',') {
                continue;
            }
            if r.eat(')') {
                break;
            }
            return None;
        }
        r.ws();
        if !r.done() {
            return None;
        }
        calls.push(call(&line[..open], Value::Object(args))?);
    }
    Some(calls)
}

struct Reader<'a> {
    s: &'a str,
    i: usize,
}

impl<'a> Reader<'a> {
    fn new(s: &'a str) -> Self {
        Reader { s, i: 0 }
    }
    fn rest(&self) -> &'a str {
        &self.s[self.i..]
    }
    fn done(&self) -> bool {
        self.i >= self.s.len()
    }
    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }
    fn ws(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.i += self.peek().map_or(0, char::len_utf8);
        }
    }
    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.i += c.len_utf8();
            true
        } else {
            false
        }
    }
    fn eat_str(&mut self, s: &str) -> bool {
        if self.rest().starts_with(s) {
            self.i += s.len();
            true
        } else {
            false
        }
    }
    fn ident(&mut self) -> Option<String> {
        let n = self
            .rest()
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(self.rest().len());
        if n == 0 {
            return None;
        }
        let id = self.rest()[..n].to_string();
        self.i += n;
        Some(id)
    }
    /// A bare token up to a delimiter (numbers, true/false/null and unquoted words).
    fn bare(&mut self, stops: &str) -> &'a str {
        let r = self.rest();
        let n = r.find(|c: char| stops.contains(c)).unwrap_or(r.len());
        self.i += n;
        r[..n].trim()
    }

    /// FunctionGemma values: `<escape>`-quoted strings, `{k:v,...}`, `[v,...]`, scalars.
    fn gemma_value(&mut self) -> Option<Value> {
        self.ws();
        if self.eat_str("<escape>") {
            let end = self.rest().find("<escape>")?;
            let v = self.rest()[..end].to_string();
            self.i += end + "<escape>".len();
            return Some(Value::String(v));
        }
        if self.eat('{') {
            let mut m = Map::new();
            loop {
                self.ws();
                if self.eat('}') {
                    return Some(Value::Object(m));
                }
                let key = self.bare(":}").to_string();
                if key.is_empty() || !self.eat(':') {
                    return None;
                }
                let v = self.gemma_value()?;
                m.insert(key, v);
                self.ws();
                if !self.eat(',') && self.peek() != Some('}') {
                    return None;
                }
            }
        }
        if self.eat('[') {
            let mut a = Vec::new();
            loop {
                self.ws();
                if self.eat(']') {
                    return Some(Value::Array(a));
                }
                a.push(self.gemma_value()?);
                self.ws();
                if !self.eat(',') && self.peek() != Some(']') {
                    return None;
                }
            }
        }
        scalar(self.bare(",}]"))
    }

    /// Python literals: quoted strings, numbers, True/False/None, lists, dicts.
    fn py_value(&mut self) -> Option<Value> {
        self.ws();
        match self.peek()? {
            q @ ('"' | '\'') => {
                self.i += 1;
                let mut out = String::new();
                let mut chars = self.rest().char_indices();
                while let Some((j, c)) = chars.next() {
                    match c {
                        '\\' => match chars.next()? {
                            (_, 'n') => out.push('\n'),
                            (_, 't') => out.push('\t'),
                            (_, e) => out.push(e),
                        },
                        c if c == q => {
                            self.i += j + 1;
                            return Some(Value::String(out));
                        }
                        c => out.push(c),
                    }
                }
                None
            }
            '[' => {
                self.i += 1;
                let mut a = Vec::new();
                loop {
                    self.ws();
                    if self.eat(']') {
                        return Some(Value::Array(a));
                    }
                    a.push(self.py_value()?);
                    self.ws();
                    if !self.eat(',') && self.peek() != Some(']') {
                        return None;
                    }
                }
            }
            '{' => {
                self.i += 1;
                let mut m = Map::new();
                loop {
                    self.ws();
                    if self.eat('}') {
                        return Some(Value::Object(m));
                    }
                    let Value::String(k) = self.py_value()? else {
                        return None;
                    };
                    self.ws();
                    if !self.eat(':') {
                        return None;
                    }
                    m.insert(k, self.py_value()?);
                    self.ws();
                    if !self.eat(',') && self.peek() != Some('}') {
                        return None;
                    }
                }
            }
            _ => match self.bare(",)]}") {
                "True" => Some(Value::Bool(true)),
                "False" => Some(Value::Bool(false)),
                "None" => Some(Value::Null),
                t => number(t),
            },
        }
    }
}

fn number(t: &str) -> Option<Value> {
    if let Ok(i) = t.parse::<i64>() {
        return Some(Value::Number(i.into()));
    }
    t.parse::<f64>()
        .ok()
        .and_then(Number::from_f64)
        .map(Value::Number)
}

fn scalar(t: &str) -> Option<Value> {
    match t {
        "" => None,
        "true" => Some(Value::Bool(true)),
        "false" => Some(Value::Bool(false)),
        "null" => Some(Value::Null),
        t => Some(number(t).unwrap_or_else(|| Value::String(t.to_string()))),
    }
}
