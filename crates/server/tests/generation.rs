//! A model's recommended sampling (its folder's generation_config.json) is the default of the
//! requests that leave the fields out, and the request fields still override it: the tiny
//! Llama with `do_sample: false` (greedy, as transformers reads it) answers the same text for
//! any seed unless the request sets a temperature.

mod common;

use std::sync::Arc;

use common::*;
use hf2q_models::Model;
use serde_json::json;

fn copy_with(gen: &str) -> (tempfile::TempDir, Arc<Model>) {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(tiny_path()).unwrap().flatten() {
        std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
    }
    std::fs::write(d.path().join("generation_config.json"), gen).unwrap();
    let m = Arc::new(Model::load(d.path()).unwrap());
    (d, m)
}

async fn reply(addr: std::net::SocketAddr, extra: serde_json::Value) -> String {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 24, "ignore_eos": true});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let r = post(addr, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn the_model_s_sampling_is_the_default_and_request_fields_override_it() {
    let (_d, model) = copy_with(r#"{"do_sample": false, "temperature": 0.9}"#);
    assert_eq!(model.generation_defaults().temperature, Some(0.0));
    let h = start(model, cfg()).await;
    let greedy = reply(h.addr, json!({"temperature": 0})).await;
    for seed in [1, 2, 3] {
        assert_eq!(
            reply(h.addr, json!({"seed": seed})).await,
            greedy,
            "seed {seed} without a temperature"
        );
    }
    // The request's temperature wins: 24 tokens of a random model at temperature 1.5 over
    // three seeds are not all the greedy text.
    let mut hot = Vec::new();
    for seed in [1, 2, 3] {
        hot.push(reply(h.addr, json!({"seed": seed, "temperature": 1.5})).await);
    }
    assert!(hot.iter().any(|t| *t != greedy), "{hot:?}");

    // Without a generation_config.json the OpenAI default (temperature 1) applies: seeds differ.
    let h2 = start(tiny(), cfg()).await;
    let mut plain = Vec::new();
    for seed in [1, 2, 3] {
        plain.push(reply(h2.addr, json!({"seed": seed})).await);
    }
    assert!(plain.iter().any(|t| *t != plain[0]), "{plain:?}");
}
