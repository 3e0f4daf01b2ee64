//! Constrained decoding end to end: for every schema in `fixtures/constrained/schemas.json`
//! (59: objects, arrays, enums, nesting, anyOf/oneOf/allOf, $ref, string formats and patterns,
//! number bounds) the generated text parses and validates against the schema, checked with an
//! independent validator (the `jsonschema` crate, formats included), on the tiny random model
//! always and on SmolLM2 and Qwen2.5 when their GGUFs are given (`HF2Q_TEST_SMOLLM2_GGUF`,
//! `HF2Q_TEST_QWEN25_GGUF`). On the real models a greedy reply with a schema must equal the
//! unconstrained greedy reply whenever that one already conforms.

use std::path::Path;

use hf2q_models::chat_template::{encode_chat, ChatMessage, ChatTemplate};
use hf2q_models::constraint::{ConstraintEnv, GrammarSpec};
use hf2q_models::generate::{generate_constrained, FinishReason, GenerateParams};
use hf2q_models::sampler::SamplerConfig;
use hf2q_models::Model;
use serde_json::Value;

fn schemas() -> Vec<(String, Value)> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/constrained/schemas.json");
    let v: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v.into_iter()
        .map(|e| (e["name"].as_str().unwrap().to_string(), e["schema"].clone()))
        .collect()
}

fn validator(schema: &Value) -> jsonschema::Validator {
    jsonschema::options()
        .should_validate_formats(true)
        .build(schema)
        .unwrap_or_else(|e| panic!("the validator rejects the schema {schema}: {e}"))
}

/// Why `text` does not conform to `schema`, or `None` when it does.
fn invalid(schema: &Value, text: &str) -> Option<String> {
    let v: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return Some(format!("not JSON ({e})")),
    };
    let errs: Vec<String> = validator(schema)
        .iter_errors(&v)
        .map(|e| e.to_string())
        .collect();
    (!errs.is_empty()).then(|| errs.join("; "))
}

fn generate(
    model: &Model,
    env: Option<&ConstraintEnv>,
    schema: &Value,
    prompt: &[u32],
    sampler: SamplerConfig,
    max_tokens: usize,
) -> (String, FinishReason) {
    let mut c = env.map(|e| {
        let g = e
            .compile(&GrammarSpec::JsonSchema(schema.clone()))
            .unwrap_or_else(|err| panic!("{schema}: {err}"));
        e.constraint(&g)
    });
    let params = GenerateParams {
        max_tokens,
        sampler,
        ..Default::default()
    };
    let mut session = model.session(prompt.len() + max_tokens + 1);
    let mut text = String::new();
    let st = generate_constrained(&mut session, prompt, &params, c.as_mut(), &mut |t| {
        text.push_str(t);
        true
    })
    .unwrap();
    (text, st.finish_reason)
}

fn sampled(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 0.8,
        seed: Some(seed),
        ..Default::default()
    }
}

#[test]
fn tiny_model_outputs_follow_every_schema() {
    let model =
        Model::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/tiny-llama"))
            .unwrap();
    let env = ConstraintEnv::new(model.tokenizer(), model.vocab_size()).unwrap();
    let prompt = model.tokenizer().encode("JSON:", true, false).unwrap();
    let (mut stopped, mut cut) = (0, 0);
    for (name, schema) in schemas() {
        for (i, s) in [SamplerConfig::greedy(), sampled(1), sampled(2)]
            .into_iter()
            .enumerate()
        {
            // A random model fills strings with noise: the byte vocabulary needs many tokens.
            let (text, finish) = generate(&model, Some(&env), &schema, &prompt, s, 200);
            if finish == FinishReason::Length {
                cut += 1;
                continue;
            }
            stopped += 1;
            if let Some(why) = invalid(&schema, &text) {
                panic!("{name} (run {i}): {text:?} does not conform: {why}");
            }
        }
    }
    eprintln!("tiny model: {stopped} replies conform, {cut} reached the token limit");
    // The random model must finish most of them; a bounded grammar forces the ending.
    assert!(stopped >= 3 * 59 * 2 / 3, "{stopped} finished, {cut} cut");
}

fn real_model(var: &str, test: &str) -> Option<Model> {
    match std::env::var(var) {
        Ok(p) if !p.is_empty() => {
            let mut m = Model::load(Path::new(&p)).unwrap();
            // The CLI's and the server's kernels (the library default is the slow reference).
            m.set_matmul_path(hf2q_cpu::MatmulPath::Fast);
            m.warm_up().unwrap();
            Some(m)
        }
        _ => {
            eprintln!("{test}: skipped ({var} is not set)");
            None
        }
    }
}

/// Every schema on a real model: 100 % conform, and the greedy reply with the schema equals the
/// unconstrained one whenever that one conforms.
fn real_model_suite(model: &Model, max_tokens: usize) {
    let env = ConstraintEnv::new(model.tokenizer(), model.vocab_size()).unwrap();
    let tmpl = match model.chat_template() {
        Some(t) => t.clone(),
        None => ChatTemplate::for_tokenizer(model.tokenizer()).unwrap(),
    };
    let (mut equal, mut cut) = (0, 0);
    for (name, schema) in schemas() {
        let ask = format!(
            "Reply with only a JSON value (no prose, no code fence) that follows this JSON Schema: {schema}"
        );
        let prompt = encode_chat(
            model.tokenizer(),
            &tmpl,
            &[ChatMessage::new("user", ask)],
            true,
        )
        .unwrap();
        let (text, finish) = generate(
            model,
            Some(&env),
            &schema,
            &prompt,
            SamplerConfig::greedy(),
            max_tokens,
        );
        if finish == FinishReason::Length {
            // Whitespace and numbers are bounded, strings here have a maxLength: only schemas
            // whose values may nest without end can run past the limit (a model repeating
            // itself).
            assert!(
                ["ref_recursive", "any_json_object"].contains(&name.as_str()),
                "{name}: reached {max_tokens} tokens: {text:?}"
            );
            cut += 1;
            continue;
        }
        if let Some(why) = invalid(&schema, &text) {
            panic!("{name}: {text:?} does not conform: {why}");
        }
        let (free, free_finish) = generate(
            model,
            None,
            &schema,
            &prompt,
            SamplerConfig::greedy(),
            max_tokens,
        );
        if free_finish == FinishReason::Stop && invalid(&schema, &free).is_none() {
            assert_eq!(text, free, "{name}: the unconstrained greedy reply conforms; the constrained one must equal it");
            equal += 1;
        }
    }
    eprintln!("{equal} unconstrained greedy replies already conformed (and matched); {cut} cut");
}

#[test]
fn smollm2_outputs_follow_every_schema() {
    let Some(m) = real_model(
        "HF2Q_TEST_SMOLLM2_GGUF",
        "smollm2_outputs_follow_every_schema",
    ) else {
        return;
    };
    real_model_suite(&m, 160);
}

#[test]
fn qwen25_outputs_follow_every_schema() {
    let Some(m) = real_model(
        "HF2Q_TEST_QWEN25_GGUF",
        "qwen25_outputs_follow_every_schema",
    ) else {
        return;
    };
    real_model_suite(&m, 160);
}

#[test]
fn bad_schemas_and_grammars_are_named_errors() {
    let model =
        Model::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/tiny-llama"))
            .unwrap();
    let env = ConstraintEnv::new(model.tokenizer(), model.vocab_size()).unwrap();
    let bad = |spec: GrammarSpec| env.compile(&spec).map(|_| ()).unwrap_err().to_string();
    let e = bad(GrammarSpec::JsonSchema(
        serde_json::json!({"type": "object", "if": {"type": "object"}, "then": {"required": ["a"]}}),
    ));
    assert!(e.contains("if") || e.contains("then"), "{e}");
    let e = bad(GrammarSpec::JsonSchema(
        serde_json::json!({"type": "frobnicate"}),
    ));
    assert!(e.contains("frobnicate"), "{e}");
    let e = bad(GrammarSpec::JsonSchema(serde_json::json!([1, 2])));
    assert!(e.contains("object or a boolean"), "{e}");
    let e = bad(GrammarSpec::Lark("start: missing_rule".into()));
    assert!(e.contains("missing_rule"), "{e}");
}

#[test]
fn lark_grammar_constrains_the_tiny_model() {
    let model =
        Model::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/tiny-llama"))
            .unwrap();
    let env = ConstraintEnv::new(model.tokenizer(), model.vocab_size()).unwrap();
    let g = env
        .compile(&GrammarSpec::Lark(
            "start: (\"yes\" | \"no\") \", \" NUM\nNUM: /[1-9][0-9]?/\n".into(),
        ))
        .unwrap();
    let prompt = model.tokenizer().encode("Answer:", true, false).unwrap();
    for seed in 0..8 {
        let mut c = env.constraint(&g);
        let params = GenerateParams {
            max_tokens: 20,
            sampler: sampled(seed),
            ..Default::default()
        };
        let mut session = model.session(64);
        let mut text = String::new();
        let st = generate_constrained(&mut session, &prompt, &params, Some(&mut c), &mut |t| {
            text.push_str(t);
            true
        })
        .unwrap();
        assert_eq!(st.finish_reason, FinishReason::Stop, "{text:?}");
        let (word, num) = text.split_once(", ").unwrap_or_else(|| panic!("{text:?}"));
        assert!(word == "yes" || word == "no", "{text:?}");
        assert!(
            num.parse::<u32>().is_ok_and(|n| (1..100).contains(&n)),
            "{text:?}"
        );
    }
}

/// Every format's tool-call grammars compile (markup as tokens and as text), and a reply forced
/// by them parses back into calls of the declared tools with arguments that follow their
/// schemas, even from a random model.
#[test]
fn tool_call_grammars_of_every_format_yield_valid_calls() {
    use hf2q_models::tool_calls::grammar::{self, GrammarTool};
    use hf2q_models::tool_calls::{parse_tool_calls, ToolFormat};
    let model =
        Model::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/tiny-llama"))
            .unwrap();
    let env = ConstraintEnv::new(model.tokenizer(), model.vocab_size()).unwrap();
    let schema = serde_json::json!({"type": "object", "properties": {
        "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["unit", "days"], "additionalProperties": false});
    let tools = vec![
        GrammarTool {
            name: "get_weather".into(),
            arguments: schema.clone(),
        },
        GrammarTool {
            name: "now".into(),
            arguments: serde_json::json!({"type": "object", "properties": {}, "additionalProperties": false}),
        },
    ];
    let names: Vec<String> = tools.iter().map(|t| t.name.clone()).collect();
    let prompt = model.tokenizer().encode("Call:", true, false).unwrap();
    let formats = [
        ToolFormat::Hermes,
        ToolFormat::Llama3Json,
        ToolFormat::Mistral { v11: false },
        ToolFormat::Mistral { v11: true },
        ToolFormat::FunctionGemma,
        ToolFormat::Harmony,
        ToolFormat::Generic,
    ];
    // The tiny vocabulary has no markup tokens: pretend `</s>`-like ids exist for the
    // token form (the grammar then requires that id).
    let as_token = |s: &str| match s {
        "<tool_call>" | "[TOOL_CALLS]" | "<start_function_call>" | "<|python_tag|>" => Some(256),
        "</tool_call>" | "[ARGS]" | "<end_function_call>" => Some(258),
        _ => None,
    };
    let as_text = |_: &str| None;
    for f in formats {
        for parallel in [false, true] {
            for (tokens, token) in [
                (false, &as_text as &dyn Fn(&str) -> Option<u32>),
                (true, &as_token),
            ] {
                let lark = grammar::required(f, &tools, parallel, token);
                let g = env
                    .compile(&GrammarSpec::Lark(lark.clone()))
                    .unwrap_or_else(|e| panic!("{f:?}: {e}\n{lark}"));
                for l in grammar::lazy(f, &tools, parallel, token) {
                    env.compile(&GrammarSpec::Lark(l.lark.clone()))
                        .unwrap_or_else(|e| panic!("{f:?} lazy: {e}\n{}", l.lark));
                }
                if tokens {
                    continue;
                }
                // Markup as text: the reply's text holds it, so it can be parsed back.
                for seed in 0..3 {
                    let mut c = env.constraint(&g);
                    let params = GenerateParams {
                        max_tokens: 200,
                        sampler: sampled(seed),
                        ..Default::default()
                    };
                    let mut session = model.session(prompt.len() + 201);
                    let mut text = String::new();
                    let st = generate_constrained(
                        &mut session,
                        &prompt,
                        &params,
                        Some(&mut c),
                        &mut |t| {
                            text.push_str(t);
                            true
                        },
                    )
                    .unwrap();
                    if st.finish_reason == FinishReason::Length {
                        continue;
                    }
                    if f == ToolFormat::FunctionGemma {
                        // Only the name is constrained there (see the grammar module).
                        assert!(text.starts_with("<start_function_call>call:"), "{text:?}");
                        continue;
                    }
                    let r = parse_tool_calls(f, &names, parallel, &text);
                    assert!(!r.calls.is_empty(), "{f:?}: {text:?} parsed as {r:?}");
                    assert!(parallel || r.calls.len() == 1, "{f:?}: {text:?}");
                    for call in &r.calls {
                        let args: Value = serde_json::from_str(&call.arguments).unwrap();
                        let s = if call.name == "now" {
                            &tools[1].arguments
                        } else {
                            &schema
                        };
                        assert!(invalid(s, &call.arguments).is_none(), "{f:?}: {args}");
                    }
                }
            }
        }
    }
}
