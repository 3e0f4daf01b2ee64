//! Replies to text, kept trivial: a small model's reply is used as plain text, trimmed, with
//! the few wrappers such models add taken off (a "Here is ...:" line, a `Task:` label, list
//! numbering, surrounding quotes). `None` means the reply is unusable (empty once trimmed); the
//! caller skips it and counts it. Nothing here fails or panics on any input.
//!
//! Also the wire format of one non-streaming `/v1/chat/completions` exchange ([`body`],
//! [`reply`]) so that every HTTP client speaks it the same way.
//!
//! Not here: the prompts ([`super::prompts`]), the HTTP transport (the caller).

use serde_json::{json, Value};

use super::{Reply, Request};

/// The body of a chat completion request (non-streaming).
pub fn body(r: &Request) -> Value {
    let messages: Vec<Value> = r
        .messages
        .iter()
        .map(|t| json!({"role": t.role, "content": t.content}))
        .collect();
    let mut v = json!({
        "messages": messages,
        "temperature": r.temperature,
        "max_tokens": r.max_tokens,
        "seed": r.seed,
        "stream": false,
    });
    if let Some(m) = r.model {
        v["model"] = json!(m);
    }
    v
}

/// The reply of a chat completion response: `choices[0].message.content`, and whether it
/// stopped at the token limit (`finish_reason` "length").
pub fn reply(v: &Value) -> Result<Reply, String> {
    let choice = v
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or("the response has no choices[0]")?;
    let text = match choice.get("message").and_then(|m| m.get("content")) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(other) => return Err(format!("choices[0].message.content is not text: {other}")),
    };
    Ok(Reply {
        text,
        truncated: choice.get("finish_reason").and_then(Value::as_str) == Some("length"),
    })
}

/// The error message of a failed request's body (OpenAI's `{"error": {"message"}}`), else the
/// body's start.
pub fn error_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| {
            v.get("error")
                .and_then(|e| e.get("message").or(Some(e)))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_else(|| {
            body.chars()
                .take(200)
                .collect::<String>()
                .trim()
                .to_string()
        })
}

const QUOTES: &[(char, char)] = &[('"', '"'), ('\'', '\''), ('“', '”'), ('`', '`')];

fn unquote(s: &str) -> &str {
    let s = s.trim();
    for (a, b) in QUOTES {
        if s.len() >= 2 && s.starts_with(*a) && s.ends_with(*b) {
            let inner = &s[a.len_utf8()..s.len() - b.len_utf8()];
            // Only a pair that wraps the whole text: `"a" and "b"` keeps its quotes.
            if !inner.contains(*a) && !inner.contains(*b) {
                return inner.trim();
            }
        }
    }
    s
}

/// The longest first line taken for an announcement (a longer one is text).
const PREAMBLE_MAX: usize = 160;

/// How announcing first lines start (lower case).
const ANNOUNCE: &[&str] = &[
    "sure",
    "certainly",
    "of course",
    "here is",
    "here's",
    "here are",
];

/// A first line that only announces what follows ("Here is the rewritten text:", "Sure!"),
/// when more lines follow.
fn drop_preamble(s: &str) -> &str {
    let s = s.trim();
    if let Some((first, rest)) = s.split_once('\n') {
        let f = first.trim().to_ascii_lowercase();
        let announces = f.ends_with(':') || ANNOUNCE.iter().any(|w| f.starts_with(w));
        if announces && !rest.trim().is_empty() && f.chars().count() <= PREAMBLE_MAX {
            return rest.trim();
        }
    }
    s
}

/// `label:` at the start (any case), taken off.
fn drop_label<'a>(s: &'a str, labels: &[&str]) -> &'a str {
    let t = s.trim_start();
    for l in labels {
        if t.len() > l.len()
            && t.is_char_boundary(l.len())
            && t[..l.len()].eq_ignore_ascii_case(l)
            && t[l.len()..].starts_with(':')
        {
            return t[l.len() + 1..].trim_start();
        }
    }
    t
}

/// List numbering or a bullet at the start (`3.`, `3)`, `-`, `*`, `•`).
fn drop_bullet(s: &str) -> &str {
    let t = s.trim_start();
    let digits = t.chars().take_while(char::is_ascii_digit).count();
    if digits > 0 && digits <= 3 {
        let rest = &t[digits..];
        if let Some(r) = rest.strip_prefix('.').or_else(|| rest.strip_prefix(')')) {
            if r.is_empty() || r.starts_with(char::is_whitespace) {
                return r.trim_start();
            }
        }
    }
    for b in ["- ", "* ", "• "] {
        if let Some(r) = t.strip_prefix(b) {
            return r.trim_start();
        }
    }
    t
}

fn some(s: &str) -> Option<String> {
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

/// A free text reply (an answer, a rewritten text, an example): trimmed, without an
/// announcing first line, a leading `label:` or wrapping quotes.
pub fn text(reply: &str, labels: &[&str]) -> Option<String> {
    some(unquote(drop_label(drop_preamble(reply), labels)))
}

/// A one-line reply (a task, a question): the first line that has text once the announcing
/// line, a `label:`, numbering and quotes are off (a model that goes on with a second item
/// of a list has that second item dropped).
pub fn line(reply: &str, labels: &[&str]) -> Option<String> {
    let body = drop_preamble(reply);
    body.lines()
        .map(|l| unquote(drop_label(drop_bullet(l), labels)))
        .find(|l| !l.is_empty())
        .and_then(some)
}

/// A user turn written by a model playing the user: like [`text`] with a `User:` label off,
/// cut where the model goes on to write the assistant's side.
pub fn user_turn(reply: &str) -> Option<String> {
    let t = text(reply, &["user", "message"])?;
    let cut = t
        .lines()
        .position(|l| {
            let l = l.trim_start().to_ascii_lowercase();
            l.starts_with("assistant:") || l.starts_with("ai:")
        })
        .map(|i| t.lines().take(i).collect::<Vec<_>>().join("\n"))
        .unwrap_or(t);
    some(&cut)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_trimmed_and_unwrapped() {
        assert_eq!(text("  \n", &[]), None);
        assert_eq!(text("", &[]), None);
        assert_eq!(text("  Paris.  ", &[]).as_deref(), Some("Paris."));
        assert_eq!(
            text("Here is the rewritten text:\n\nTHE SKY IS BLUE.", &[]).as_deref(),
            Some("THE SKY IS BLUE.")
        );
        assert_eq!(text("\"quoted\"", &[]).as_deref(), Some("quoted"));
        assert_eq!(
            text("\"a\" and \"b\"", &[]).as_deref(),
            Some("\"a\" and \"b\"")
        );
        assert_eq!(
            text("Answer: 42", &["answer"]).as_deref(),
            Some("42"),
            "label"
        );
        // A colon line alone is the text, not a preamble.
        assert_eq!(text("Ingredients:", &[]).as_deref(), Some("Ingredients:"));
        assert_eq!(text("Sure!\n", &[]).as_deref(), Some("Sure!"));
        assert_eq!(
            text("Here's a sample of product reviews for the category \"positive\" (positive, negative):\n\nGood value.", &[]).as_deref(),
            Some("Good value.")
        );
        assert_eq!(
            text("Here's a short poem\nabout the sea", &[]).as_deref(),
            Some("about the sea")
        );
        assert_eq!(text("“curly”", &[]).as_deref(), Some("curly"));
    }

    #[test]
    fn one_line_replies_take_the_first_item() {
        let labels = ["task", "question"];
        assert_eq!(
            line("4. Write a haiku about rain.\n5. Name a fruit.", &labels).as_deref(),
            Some("Write a haiku about rain.")
        );
        assert_eq!(
            line("Sure! Here is a new task:\nTask: Sort a list.", &labels).as_deref(),
            Some("Sort a list.")
        );
        assert_eq!(
            line("\n\nQUESTION: What is the capital of France?\n", &labels).as_deref(),
            Some("What is the capital of France?")
        );
        assert_eq!(
            line("- \"Name a colour.\"", &labels).as_deref(),
            Some("Name a colour.")
        );
        assert_eq!(line("1.\n\n", &labels), None);
        assert_eq!(
            line("2021 was a year.", &labels).as_deref(),
            Some("2021 was a year.")
        );
        assert_eq!(line("Task:", &labels), None);
        // Multi-byte text near a label's length does not split a character.
        assert_eq!(line("éé", &["e"]).as_deref(), Some("éé"));
    }

    #[test]
    fn user_turns_stop_at_the_assistant_side() {
        assert_eq!(
            user_turn("User: How do I boil an egg?\nAssistant: Put it in water.").as_deref(),
            Some("How do I boil an egg?")
        );
        assert_eq!(user_turn("Assistant: hi"), None);
        assert_eq!(
            user_turn("Thanks, and pasta?").as_deref(),
            Some("Thanks, and pasta?")
        );
    }

    #[test]
    fn wire_format() {
        let turns = [crate::data::Turn {
            role: "user".into(),
            content: "hi".into(),
        }];
        let r = Request {
            messages: &turns,
            model: Some("base:sql"),
            temperature: 0.5,
            max_tokens: 16,
            seed: 7,
        };
        let b = body(&r);
        assert_eq!(b["model"], "base:sql");
        assert_eq!(b["messages"][0]["content"], "hi");
        assert_eq!(
            (b["max_tokens"].as_u64(), b["seed"].as_u64()),
            (Some(16), Some(7))
        );
        assert_eq!(b["stream"], false);
        let no_model = Request { model: None, ..r };
        assert!(body(&no_model).get("model").is_none());
        let ok = reply(&json!({"choices": [{"message": {"role": "assistant", "content": "yo"}, "finish_reason": "length"}]})).unwrap();
        assert_eq!((ok.text.as_str(), ok.truncated), ("yo", true));
        let null =
            reply(&json!({"choices": [{"message": {"content": null}, "finish_reason": "stop"}]}))
                .unwrap();
        assert_eq!((null.text.as_str(), null.truncated), ("", false));
        assert!(reply(&json!({"choices": []})).is_err());
        assert!(reply(&json!({"choices": [{"message": {"content": 3}}]})).is_err());
        assert_eq!(
            error_message(r#"{"error": {"message": "The model 'x' does not exist"}}"#),
            "The model 'x' does not exist"
        );
        assert_eq!(error_message("Bad Gateway"), "Bad Gateway");
    }
}
