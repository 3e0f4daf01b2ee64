//! A model whose chat template is harmony-shaped (GPT-OSS's format) served end to end: every
//! reply is read for its channels, tools or not, the `analysis` channel comes back as
//! `reasoning_content` (whole and streamed) and only the `final` channel as `content`;
//! `reasoning_effort` reaches the template, and is refused for a template without it.
//!
//! The tiny Llama stands in for GPT-OSS: its vocabulary has no harmony tokens and its weights are
//! random, so the reply is forced with `response_format` (a JSON string constant that spells a
//! harmony reply as text). The template is cut down: the real one's system prompt alone is longer
//! than the tiny model's 256 positions (the real template's rendering is checked in the models
//! crate, chat_template_parity.rs).

mod common;

use std::sync::Arc;

use common::*;
use hf2q_models::Model;
use serde_json::{json, Value};

const TEMPLATE: &str = "{% if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>{% endif %}\
{% for m in messages %}{% if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>\
{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}\
{% if add_generation_prompt %}<|start|>assistant{% endif %}";

/// The reply the model is made to write (as a JSON string: the quotes are header text, dropped).
const REPLY: &str =
    "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Done";

fn harmony_model() -> (tempfile::TempDir, Arc<Model>) {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(tiny_path()).unwrap().flatten() {
        std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
    }
    let cfg = json!({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": TEMPLATE});
    std::fs::write(d.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let m = Arc::new(Model::load(d.path()).unwrap());
    (d, m)
}

fn body(stream: bool, extra: Value) -> Value {
    let mut b = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 120,
        "temperature": 0,
        "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": {"const": REPLY}}},
    });
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

#[tokio::test]
async fn reasoning_is_kept_apart_and_reasoning_effort_reaches_the_template() {
    let (_d, model) = harmony_model();
    let h = start(model, cfg()).await;

    let r = post(h.addr, "/v1/chat/completions", &body(false, json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "Think.", "{v}");
    // The JSON string's closing quote is the final channel's text too.
    assert_eq!(m["content"], "Done\"", "{v}");

    let r = post(h.addr, "/v1/chat/completions", &body(true, json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let mut reasoning = String::new();
    for d in sse_data(&r.text()).iter().filter(|d| *d != "[DONE]") {
        let c: Value = serde_json::from_str(d).unwrap();
        if let Some(t) = c["choices"][0]["delta"]["reasoning_content"].as_str() {
            reasoning.push_str(t);
        }
    }
    assert_eq!(reasoning, "Think.");
    assert_eq!(streamed_text(&r.text()), "Done\"");

    // The effort is rendered into the prompt: "high" is one byte token longer than "low".
    let mut prompt = Vec::new();
    for effort in ["low", "high"] {
        let r = post(
            h.addr,
            "/v1/chat/completions",
            &body(false, json!({"reasoning_effort": effort, "max_tokens": 1})),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        prompt.push(r.json()["usage"]["prompt_tokens"].as_u64().unwrap());
    }
    assert_eq!(prompt[1], prompt[0] + 1, "{prompt:?}");

    // A template without a reasoning effort refuses it.
    let h2 = start(tiny(), cfg()).await;
    let r = post(
        h2.addr,
        "/v1/chat/completions",
        &chat_body("hi", 4, false)
            .as_object()
            .unwrap()
            .clone()
            .into_iter()
            .chain([("reasoning_effort".to_string(), json!("low"))])
            .collect::<serde_json::Map<_, _>>()
            .into(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "reasoning_effort");
}
