//! An incremental scanner for one JSON call object, `{"name": "f", "arguments": {...}}`, fed a
//! character at a time as text is generated.
//!
//! It understands exactly the object's top level: its keys, the `name` / `id` strings, and
//! where the arguments value (`arguments` or `parameters`) begins and ends; nested values are
//! only skipped over (strings, escapes, bracket depth), so the arguments come out as the exact
//! characters the model wrote. Anything that is not such an object (a missing brace, a key
//! without a colon, ...) fails the scan; the caller then treats the text as content.
//!
//! What it is not: a JSON validator. The arguments are passed through raw; the OpenAI contract
//! is that clients validate them.

/// What the scanner found at the character just fed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Found {
    /// The `name` string (decoded).
    Name(String),
    /// The `id` string (decoded).
    Id(String),
    /// The arguments value starts; `object` is true for `{...}`, false for anything else
    /// (a string that encodes the arguments, or a scalar).
    ArgsStart {
        object: bool,
    },
    /// A character of the arguments value, raw.
    Args(char),
    ArgsEnd,
}

/// Scanning outcome of one character.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    More,
    /// The object closed; the character was its closing brace.
    Done,
    Fail,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum St {
    Open,
    KeyOrEnd,
    Key,
    Colon,
    Value,
    /// Inside the `name` or `id` string.
    Str,
    /// Inside the arguments value.
    Args,
    /// Inside another key's value (skipped).
    Skip,
    AfterValue,
    Done,
}

/// Skips over one JSON value: strings with escapes, nested containers, scalars.
#[derive(Clone, Debug, Default)]
struct ValueSkip {
    started: bool,
    depth: u32,
    in_str: bool,
    esc: bool,
    scalar: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Val {
    /// The character is part of the value, which goes on.
    In,
    /// The character is the value's last.
    Last,
    /// The value ended before this character (a scalar's terminator).
    Out,
}

impl ValueSkip {
    fn feed(&mut self, c: char) -> Val {
        if !self.started {
            self.started = true;
            match c {
                '{' | '[' => self.depth = 1,
                '"' => self.in_str = true,
                _ => self.scalar = true,
            }
            return Val::In;
        }
        if self.in_str {
            if self.esc {
                self.esc = false;
            } else if c == '\\' {
                self.esc = true;
            } else if c == '"' {
                self.in_str = false;
                if self.depth == 0 {
                    return Val::Last;
                }
            }
            return Val::In;
        }
        if self.scalar {
            return if c == ',' || c == '}' || c == ']' || c.is_whitespace() {
                Val::Out
            } else {
                Val::In
            };
        }
        match c {
            '"' => self.in_str = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => {
                self.depth -= 1;
                if self.depth == 0 {
                    return Val::Last;
                }
            }
            _ => {}
        }
        Val::In
    }
}

/// The scanner of one call object. Feed characters with [`CallScanner::feed`] until it returns
/// [`Step::Done`] or [`Step::Fail`].
#[derive(Clone, Debug)]
pub(super) struct CallScanner {
    st: St,
    /// The current key (raw JSON string text, escapes undecoded).
    key: String,
    key_esc: bool,
    /// `name` / `id` string being read (raw, with its quotes).
    s: String,
    s_esc: bool,
    val: ValueSkip,
    args_keys: &'static [&'static str],
    /// Found an arguments value.
    pub has_args: bool,
}

impl CallScanner {
    /// `args_keys`: the keys that hold the arguments (`arguments`, and `parameters` for
    /// Llama 3).
    pub fn new(args_keys: &'static [&'static str]) -> CallScanner {
        CallScanner {
            st: St::Open,
            key: String::new(),
            key_esc: false,
            s: String::new(),
            s_esc: false,
            val: ValueSkip::default(),
            args_keys,
            has_args: false,
        }
    }

    /// Feeds one character; what it reveals is appended to `out`.
    pub fn feed(&mut self, c: char, out: &mut Vec<Found>) -> Step {
        match self.st {
            St::Done => Step::Fail,
            St::Open => match c {
                c if c.is_whitespace() => Step::More,
                '{' => {
                    self.st = St::KeyOrEnd;
                    Step::More
                }
                _ => Step::Fail,
            },
            St::KeyOrEnd => match c {
                c if c.is_whitespace() => Step::More,
                '"' => {
                    self.key.clear();
                    self.st = St::Key;
                    Step::More
                }
                '}' => {
                    self.st = St::Done;
                    Step::Done
                }
                _ => Step::Fail,
            },
            St::Key => {
                if self.key_esc {
                    self.key_esc = false;
                    self.key.push(c);
                } else if c == '\\' {
                    self.key_esc = true;
                    self.key.push(c);
                } else if c == '"' {
                    self.st = St::Colon;
                } else {
                    self.key.push(c);
                }
                Step::More
            }
            St::Colon => match c {
                c if c.is_whitespace() => Step::More,
                ':' => {
                    self.st = St::Value;
                    Step::More
                }
                _ => Step::Fail,
            },
            St::Value => {
                if c.is_whitespace() {
                    return Step::More;
                }
                self.val = ValueSkip::default();
                let key = self.key.as_str();
                if (key == "name" || key == "id") && c == '"' {
                    self.s.clear();
                    self.s.push(c);
                    self.s_esc = false;
                    self.st = St::Str;
                    return Step::More;
                }
                if key == "name" {
                    return Step::Fail;
                }
                if self.args_keys.contains(&key) && !self.has_args {
                    self.has_args = true;
                    self.val.feed(c);
                    self.st = St::Args;
                    out.push(Found::ArgsStart { object: c == '{' });
                    out.push(Found::Args(c));
                    return Step::More;
                }
                self.val.feed(c);
                self.st = St::Skip;
                Step::More
            }
            St::Str => {
                self.s.push(c);
                if self.s_esc {
                    self.s_esc = false;
                } else if c == '\\' {
                    self.s_esc = true;
                } else if c == '"' {
                    self.st = St::AfterValue;
                    let Ok(v) = serde_json::from_str::<String>(&self.s) else {
                        return Step::Fail;
                    };
                    out.push(if self.key == "name" {
                        Found::Name(v)
                    } else {
                        Found::Id(v)
                    });
                }
                Step::More
            }
            St::Args => match self.val.feed(c) {
                Val::In => {
                    out.push(Found::Args(c));
                    Step::More
                }
                Val::Last => {
                    out.push(Found::Args(c));
                    out.push(Found::ArgsEnd);
                    self.st = St::AfterValue;
                    Step::More
                }
                Val::Out => {
                    out.push(Found::ArgsEnd);
                    self.st = St::AfterValue;
                    self.after_value(c)
                }
            },
            St::Skip => match self.val.feed(c) {
                Val::In => Step::More,
                Val::Last => {
                    self.st = St::AfterValue;
                    Step::More
                }
                Val::Out => {
                    self.st = St::AfterValue;
                    self.after_value(c)
                }
            },
            St::AfterValue => self.after_value(c),
        }
    }

    fn after_value(&mut self, c: char) -> Step {
        match c {
            c if c.is_whitespace() => Step::More,
            ',' => {
                self.st = St::KeyOrEnd;
                Step::More
            }
            '}' => {
                self.st = St::Done;
                Step::Done
            }
            _ => Step::Fail,
        }
    }
}
