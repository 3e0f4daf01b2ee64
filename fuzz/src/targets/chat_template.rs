//! Chat-template compilation and rendering (input: [`crate::split2`] of the template source and
//! a JSON value: a list of messages, or `{"messages", "tools", "extra"}`; text that is not JSON
//! becomes one user message). Renders plain, as segments, and tokenized with the tiny model's
//! tokenizer, the way `hf2q serve` and `hf2q chat` do.
//!
//! The instruction budget is [`FUEL`], lower than the default so that a looping template costs
//! milliseconds here; the loop is stopped the same way at any budget.

use hf2q_models::chat_template::{encode_chat_json, ChatTemplate, RenderOptions};
use serde_json::{json, Value};

pub const FUEL: u64 = 200_000;

pub fn run(data: &[u8]) {
    let (source, rest) = crate::split2(data);
    let Ok(source) = std::str::from_utf8(source) else {
        return;
    };
    let Ok(tmpl) = ChatTemplate::new(source, Some("<s>"), Some("</s>")) else {
        return;
    };
    let now = fixed_now();
    let Ok(tmpl) = tmpl.with_now(now).and_then(|t| t.with_fuel(FUEL)) else {
        return;
    };
    let tmpl = tmpl.with_special_tokens(vec!["<s>".into(), "</s>".into()]);
    let (messages, tools, extra) = inputs(rest);
    for add_generation_prompt in [true, false] {
        let opts = RenderOptions {
            add_generation_prompt,
            tools: tools.as_ref(),
            extra: extra.as_ref(),
        };
        let _ = tmpl.render_json(&messages, &opts);
        let _ = tmpl.render_segments_json(&messages, &opts);
        let _ = encode_chat_json(super::tiny::tokenizer(), &tmpl, &messages, &opts);
    }
}

/// A fixed clock (2026-01-02 03:04:05) for `strftime_now`: reproducible renders.
fn fixed_now() -> chrono::NaiveDateTime {
    chrono::NaiveDate::from_ymd_opt(2026, 1, 2)
        .and_then(|d| d.and_hms_opt(3, 4, 5))
        .expect("a fixed date")
}

type Extra = serde_json::Map<String, Value>;

fn inputs(rest: &[u8]) -> (Vec<Value>, Option<Value>, Option<Extra>) {
    match serde_json::from_slice::<Value>(rest) {
        Ok(Value::Array(messages)) => (messages, None, None),
        Ok(Value::Object(mut o)) => {
            let messages = match o.remove("messages") {
                Some(Value::Array(m)) => m,
                Some(other) => vec![other],
                None => Vec::new(),
            };
            let tools = o.remove("tools");
            let extra = match o.remove("extra") {
                Some(Value::Object(e)) => Some(e),
                _ => None,
            };
            (messages, tools, extra)
        }
        Ok(other) => (vec![json!({"role": "user", "content": other})], None, None),
        Err(_) => (
            vec![json!({"role": "user", "content": String::from_utf8_lossy(rest)})],
            None,
            None,
        ),
    }
}
