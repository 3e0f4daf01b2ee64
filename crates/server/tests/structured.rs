//! Structured output over HTTP, streamed: for every schema of the models crate's
//! `fixtures/constrained/schemas.json`, a streamed `response_format: json_schema` reply from
//! SmolLM2 (`HF2Q_TEST_SMOLLM2_GGUF`), reassembled from its deltas, parses and validates
//! against the schema (the `jsonschema` crate, formats included); for every fourth schema it
//! also equals the same request without streaming (prefix cache off, so that both compute
//! the same positions in the same batches).

mod common;

use std::path::Path;
use std::sync::Arc;

use common::*;
use serde_json::{json, Value};

fn schemas() -> Vec<(String, Value)> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures/constrained/schemas.json");
    let v: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v.into_iter()
        .map(|e| (e["name"].as_str().unwrap().to_string(), e["schema"].clone()))
        .collect()
}

/// Schemas that allow values nested without end (a recursive `$ref`; an object of any values).
const UNBOUNDED: &[&str] = &["ref_recursive", "any_json_object"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_json_schema_replies_validate() {
    let test = "streamed_json_schema_replies_validate";
    let Some(model) = smollm2(test) else {
        return;
    };
    let mut m = Arc::try_unwrap(model).unwrap_or_else(|_| panic!("one owner"));
    m.set_matmul_path(hf2q_cpu::MatmulPath::Fast);
    m.warm_up().unwrap();
    let mut c = real_cfg("smol");
    c.engine.prefix_cache = false;
    let h = start(Arc::new(m), c).await;
    let (mut ok, mut cut) = (0, 0);
    for (i, (name, schema)) in schemas().into_iter().enumerate() {
        let body = |stream: bool| {
            json!({
                "model": "smol", "temperature": 0, "max_tokens": 160, "stream": stream,
                "messages": [{"role": "user", "content": format!("Reply with JSON following this schema: {schema}")}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": true}},
            })
        };
        let r = post(h.addr, "/v1/chat/completions", &body(true)).await;
        assert_eq!(r.status, 200, "{name}: {}", r.text());
        let text = streamed_text(&r.text());
        let finish = sse_data(&r.text())
            .iter()
            .filter(|d| d.as_str() != "[DONE]")
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| {
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_string)
            })
            .next_back();
        if i % 4 == 0 {
            let whole = post(h.addr, "/v1/chat/completions", &body(false))
                .await
                .json();
            assert_eq!(
                whole["choices"][0]["message"]["content"],
                text.as_str(),
                "{name}: stream != whole"
            );
        }
        if finish.as_deref() == Some("length") {
            // Only schemas whose values may nest without end can run this long (see the
            // models crate's test).
            assert!(
                UNBOUNDED.contains(&name.as_str()),
                "{name}: cut at the token limit: {text:?}"
            );
            cut += 1;
            continue;
        }
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {text:?}: {e}"));
        let validator = jsonschema::options()
            .should_validate_formats(true)
            .build(&schema)
            .unwrap();
        let errs: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
        assert!(errs.is_empty(), "{name}: {text} does not conform: {errs:?}");
        ok += 1;
    }
    eprintln!("{ok} streamed replies validate, {cut} cut at the token limit");
}
