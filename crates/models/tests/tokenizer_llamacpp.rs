//! Token ids of the GGUF-built tokenizers against llama.cpp's tokenizer on the same GGUF files
//! (`tests/fixtures/tokenizer/llamacpp_ids.json`: the fixture texts and a few more, with
//! parse_special off and on). This is a second, independent reference beside the upstream
//! tokenizer.json ids of `tokenizer_parity.rs`.
//!
//! One difference is by design: Qwen2's tokenizer.json normalizes to NFC and hf2q follows it;
//! llama.cpp does not, so text with decomposed accents differs (listed in `KNOWN`).
//!
//! Needs `HF2Q_TEST_SMOLLM2_GGUF`, `HF2Q_TEST_GEMMA3_GGUF`, `HF2Q_TEST_QWEN25_GGUF`; each case
//! prints "skipped: ..." and passes without its file.

use std::path::{Path, PathBuf};

use hf2q_models::tokenizer::Tokenizer;
use serde_json::Value;

/// (model, text prefix) pairs where hf2q follows the upstream tokenizer.json, not llama.cpp.
const KNOWN: &[(&str, &str)] = &[("qwen25", "Cafe\u{301}")];

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn check(key: &str, var: &str) {
    let Some(path) = std::env::var_os(var)
        .map(PathBuf::from)
        .filter(|p| p.exists())
    else {
        eprintln!("skipped: {var} not set");
        return;
    };
    let g = hf2q_tensor::io::gguf::GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/llamacpp_ids.json");
    let f: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let (mut fails, mut compared, mut known) = (Vec::new(), 0, 0);
    for (i, case) in f[key].as_array().unwrap().iter().enumerate() {
        let text = case["text"].as_str().unwrap();
        if KNOWN.iter().any(|(k, t)| *k == key && text.starts_with(t)) {
            known += 1;
            continue;
        }
        let add = case["add_bos"].as_bool().unwrap();
        for (parse_special, field) in [(false, "ids"), (true, "ids_parse_special")] {
            let want = ids(&case[field]);
            let got = tok.encode(text, add, parse_special).unwrap();
            if got != want {
                fails.push(format!(
                    "{key} case {i} {text:?} parse_special={parse_special}:\n  llama.cpp {want:?}\n  hf2q      {got:?}"
                ));
            }
            compared += 1;
        }
    }
    eprintln!(
        "{key}: {compared} encodings compared with llama.cpp, {known} known differences skipped"
    );
    assert!(compared >= 60, "{key}: only {compared} encodings compared");
    assert!(
        fails.is_empty(),
        "{} mismatches with llama.cpp:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

#[test]
fn smollm2_matches_llama_cpp() {
    check("smollm2", "HF2Q_TEST_SMOLLM2_GGUF");
}

#[test]
fn gemma3_matches_llama_cpp() {
    check("gemma3", "HF2Q_TEST_GEMMA3_GGUF");
}

#[test]
fn qwen25_matches_llama_cpp() {
    check("qwen25", "HF2Q_TEST_QWEN25_GGUF");
}
