//! Chat template rendering parity with Python jinja2 under transformers' conventions.
//!
//! Expected renders come from `tests/fixtures/tokenizer/make_expected.py` (Jinja2 3.1.6 set up as
//! `apply_chat_template`: trim_blocks, lstrip_blocks, loop controls, json.dumps `tojson`,
//! `raise_exception`, `strftime_now` with a fixed clock). Conversations cover system prompts,
//! whitespace that templates trim, special-token strings in content, reasoning blocks, tools and
//! a role-order error that Gemma's template raises.
//!
//! SmolLM2, Qwen2.5, Qwen3 and GPT-OSS templates (Apache-2.0) are committed as fixtures, so those
//! tests always run (GPT-OSS's conversations and renders: harmony_conversations.json and
//! make_harmony_expected.py). Llama 3 / 3.2 and Gemma 3 templates are read from `HF2Q_TEST_TOKENIZERS_DIR`, the
//! Qwen2.5-Coder GGUF template from `HF2Q_TEST_QWEN25_GGUF`; token-id checks of [`encode_chat`]
//! need the matching tokenizer. Missing inputs print "skipped: ..." and pass.

use std::path::{Path, PathBuf};

use hf2q_models::chat_template::{encode_chat_json, ChatTemplate, RenderOptions};
use hf2q_models::tokenizer::Tokenizer;
use hf2q_models::tool_calls::ToolFormat;
use serde_json::Value;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

fn fixture(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir().join(name)).unwrap()).unwrap()
}

fn env_path(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .map(PathBuf::from)
        .filter(|p| p.exists())
}

struct Conv {
    name: String,
    /// Messages as JSON: string content, content parts, tool calls.
    messages: Vec<Value>,
    add_generation_prompt: bool,
    tools: Option<Value>,
    /// Templates that can take this conversation's message shape (None: all).
    only: Option<Vec<String>>,
    /// Content carries special-token strings.
    injection: bool,
    /// Template variables beyond messages and tools (`reasoning_effort`, ...).
    extra: Option<Value>,
}

impl Conv {
    fn opts(&self) -> RenderOptions<'_> {
        RenderOptions {
            add_generation_prompt: self.add_generation_prompt,
            tools: self.tools.as_ref(),
            extra: self.extra.as_ref().and_then(Value::as_object),
        }
    }
    fn applies_to(&self, template: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|t| t == template))
    }
}

fn conversations() -> Vec<Conv> {
    conversations_in("conversations.json")
}

fn conversations_in(file: &str) -> Vec<Conv> {
    let f = fixture(file);
    f["conversations"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, c)| Conv {
            name: name.clone(),
            messages: c["messages"].as_array().unwrap().clone(),
            add_generation_prompt: c["add_generation_prompt"].as_bool().unwrap(),
            tools: c.get("tools").cloned(),
            only: c.get("only").map(|o| {
                o.as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_str().unwrap().to_string())
                    .collect()
            }),
            injection: c.get("injection").and_then(Value::as_bool).unwrap_or(false),
            extra: c.get("extra").cloned(),
        })
        .collect()
}

fn fixed_now(conversations_file: &str) -> chrono::NaiveDateTime {
    let s = fixture(conversations_file)["now"]
        .as_str()
        .unwrap()
        .to_string();
    chrono::NaiveDateTime::parse_from_str(&s, "%Y-%m-%dT%H:%M:%S").unwrap()
}

/// Renders every conversation with `source` and compares with the jinja2 result.
fn check_template(name: &str, source: &str) {
    check_renders(name, source, "conversations.json", "expected_chat.json");
}

/// [`check_template`] over the conversations of `conversations_file` and the renders of
/// `expected_file`.
fn check_renders(name: &str, source: &str, conversations_file: &str, expected_file: &str) {
    let expected = &fixture(expected_file)["templates"][name];
    let bos = expected["bos_token"].as_str();
    let eos = expected["eos_token"].as_str();
    let tmpl = ChatTemplate::new(source, bos, eos)
        .unwrap()
        .with_now(fixed_now(conversations_file))
        .unwrap();
    let mut fails = Vec::new();
    for conv in conversations_in(conversations_file)
        .into_iter()
        .filter(|c| c.applies_to(name))
    {
        let want = &expected["renders"][&conv.name];
        let got = tmpl.render_json(&conv.messages, &conv.opts());
        match (want.get("text").and_then(Value::as_str), got) {
            (Some(w), Ok(g)) if w == g => {}
            (Some(w), Ok(g)) => fails.push(format!(
                "{name}/{}:\n--- want\n{w}\n--- got\n{g}",
                conv.name
            )),
            (Some(_), Err(e)) => fails.push(format!("{name}/{}: unexpected error {e}", conv.name)),
            (None, Ok(g)) => fails.push(format!(
                "{name}/{}: expected an error, got {g:?}",
                conv.name
            )),
            (None, Err(e)) => {
                // The template's own raise_exception message must come through.
                let msg = want["error"].as_str().unwrap();
                if want["raised"].as_bool() == Some(true) && !e.to_string().contains(msg) {
                    fails.push(format!(
                        "{name}/{}: error {e} does not carry {msg:?}",
                        conv.name
                    ));
                }
            }
        }
    }
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

fn committed_template(name: &str) -> String {
    std::fs::read_to_string(
        fixture_dir()
            .join("templates")
            .join(format!("{name}.jinja")),
    )
    .unwrap()
}

#[test]
fn smollm2_template() {
    check_template("smollm2", &committed_template("smollm2"));
}

#[test]
fn qwen2_5_template() {
    check_template("qwen2_5", &committed_template("qwen2_5"));
}

#[test]
fn qwen3_template() {
    check_template("qwen3", &committed_template("qwen3"));
}

/// GPT-OSS's harmony template (Apache-2.0, committed): system and developer messages, tools
/// rendered as TypeScript namespaces, an assistant tool call with its analysis, a tool result,
/// `reasoning_effort` / `builtin_tools` / `model_identity`, and the template's own errors.
/// Expected renders: make_harmony_expected.py.
#[test]
fn gpt_oss_template() {
    let source = committed_template("gpt_oss");
    check_renders(
        "gpt_oss",
        &source,
        "harmony_conversations.json",
        "expected_harmony.json",
    );
    assert_eq!(ToolFormat::detect(&source), ToolFormat::Harmony);
}

fn hf_tokenizer(name: &str) -> Option<Tokenizer> {
    let Some(dir) = env_path("HF2Q_TEST_TOKENIZERS_DIR") else {
        eprintln!("skipped: HF2Q_TEST_TOKENIZERS_DIR not set (scripts/fetch-tokenizers.sh DIR)");
        return None;
    };
    let d = dir.join(name);
    Some(
        Tokenizer::from_hf_files(
            &d.join("tokenizer.json"),
            Some(&d.join("tokenizer_config.json")),
        )
        .unwrap(),
    )
}

fn gguf_tokenizer(var: &str) -> Option<Tokenizer> {
    let Some(path) = env_path(var) else {
        eprintln!("skipped: {var} not set");
        return None;
    };
    let g = hf2q_tensor::io::gguf::GgufFile::open(&path).unwrap();
    Some(Tokenizer::from_gguf(&g).unwrap())
}

/// encode_chat of the conversations without injection equals the Python tokenization of the
/// jinja2 render (special tokens parsed), i.e. protection costs nothing on honest input. For the
/// conversations with special strings in content, the ids still decode to the render, but with
/// fewer special ids than parsing the whole render would give: the content's stayed text.
fn check_chat_ids(tok: &Tokenizer, source: &str, template_name: &str, ids_name: &str) {
    let expected = fixture(&format!("expected_ids_{ids_name}.json"));
    let chat = &fixture("expected_chat.json")["templates"][template_name];
    let tmpl = ChatTemplate::new(
        source,
        chat["bos_token"].as_str(),
        chat["eos_token"].as_str(),
    )
    .unwrap()
    .with_now(fixed_now("conversations.json"))
    .unwrap();
    let (mut honest, mut hostile) = (0, 0);
    for conv in conversations()
        .into_iter()
        .filter(|c| c.applies_to(template_name))
    {
        let Some(rendered) = chat["renders"][&conv.name]
            .get("text")
            .and_then(Value::as_str)
        else {
            continue;
        };
        let got = encode_chat_json(tok, &tmpl, &conv.messages, &conv.opts()).unwrap();
        if conv.injection {
            assert_eq!(
                tok.decode(&got, false).unwrap(),
                rendered,
                "{template_name}/{}: ids do not spell the render",
                conv.name
            );
            // Only strings that are special tokens of this vocabulary are an injection here.
            let content = serde_json::to_string(&conv.messages).unwrap();
            if tok.special_tokens().any(|sp| content.contains(sp)) {
                let parsed = tok.encode(rendered, false, true).unwrap();
                let specials = |v: &[u32]| v.iter().filter(|&&i| tok.is_special(i)).count();
                assert!(
                    specials(&got) < specials(&parsed),
                    "{template_name}/{}: injected special tokens were parsed",
                    conv.name
                );
                hostile += 1;
            }
        } else {
            let want: Vec<u32> = expected["chat_ids"][&conv.name]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(got, want, "{template_name}/{}: encode_chat ids", conv.name);
            honest += 1;
        }
    }
    assert!(
        honest >= 5 && hostile >= 1,
        "{template_name}: only {honest} + {hostile} conversations checked"
    );
}

#[test]
fn llama3_template_and_ids() {
    let Some(tok) = hf_tokenizer("llama3") else {
        return;
    };
    check_template("llama3", tok.chat_template().unwrap());
    check_chat_ids(&tok, tok.chat_template().unwrap(), "llama3", "llama3");
}

#[test]
fn llama3_2_template_and_ids() {
    let Some(tok) = hf_tokenizer("llama3_2") else {
        return;
    };
    check_template("llama3_2", tok.chat_template().unwrap());
    check_chat_ids(&tok, tok.chat_template().unwrap(), "llama3_2", "llama3_2");
}

#[test]
fn gemma3_template_and_ids() {
    let Some(tok) = hf_tokenizer("gemma3") else {
        return;
    };
    check_template("gemma3", tok.chat_template().unwrap());
    check_chat_ids(&tok, tok.chat_template().unwrap(), "gemma3", "gemma3");
}

#[test]
fn qwen_npm_templates_match_committed_and_ids() {
    for name in ["qwen2_5", "qwen3"] {
        let Some(tok) = hf_tokenizer(name) else {
            return;
        };
        assert_eq!(
            tok.chat_template().unwrap(),
            committed_template(name),
            "{name} template fixture is stale"
        );
        check_chat_ids(&tok, tok.chat_template().unwrap(), name, name);
    }
}

#[test]
fn smollm2_gguf_template_and_ids() {
    let Some(tok) = gguf_tokenizer("HF2Q_TEST_SMOLLM2_GGUF") else {
        return;
    };
    assert_eq!(
        tok.chat_template().unwrap(),
        committed_template("smollm2"),
        "smollm2 template fixture is stale"
    );
    check_chat_ids(&tok, tok.chat_template().unwrap(), "smollm2", "smollm2");
}

#[test]
fn qwen25_coder_gguf_template_and_ids() {
    let Some(tok) = gguf_tokenizer("HF2Q_TEST_QWEN25_GGUF") else {
        return;
    };
    check_template("qwen2_5_coder_gguf", tok.chat_template().unwrap());
    // Same vocabulary as the Qwen2.5 tokenizer.json: with the Qwen2.5 template, the GGUF-built
    // tokenizer must give the upstream ids for every render.
    check_chat_ids(&tok, &committed_template("qwen2_5"), "qwen2_5", "qwen2_5");
}
