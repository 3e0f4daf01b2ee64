//! Contract: `hf2q quantize` writes the same GGUF file as llama.cpp's `llama-quantize`, byte for
//! byte, for the pinned SmolLM2-135M-Instruct Q4_1 GGUF: the sha256 of every output equals the
//! one recorded by `scripts/fixtures/llama_quantize_hashes.sh` (llama.cpp commit in the fixture).
//! That covers the per-tensor type rules (attn_v / ffn_down bumps, tied-embedding output type,
//! fallbacks for SmolLM2's 576-wide rows), every quantizer's bytes (k-quants and legacy, plain
//! and importance-weighted), the tensor order, the metadata and the file layout at once.
//!
//! Needs `HF2Q_TEST_SMOLLM2_GGUF` (skipped, with a message, when unset).

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use sha2::{Digest, Sha256};

fn smollm2() -> Option<String> {
    match std::env::var("HF2Q_TEST_SMOLLM2_GGUF") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            eprintln!("skipped: HF2Q_TEST_SMOLLM2_GGUF is not set");
            None
        }
    }
}

fn sha256(p: &Path) -> String {
    let b = std::fs::read(p).unwrap();
    Sha256::digest(&b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn fixture() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/quantize/llama_quantize_smollm2.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Quantizes with `--type ty` (and the fixture imatrix) and returns the output's sha256.
fn quantize(src: &str, ty: &str, imatrix: bool) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join(format!("{ty}.gguf"));
    let mut c = Command::new(env!("CARGO_BIN_EXE_hf2q"));
    // The imatrix path is recorded in the file's metadata as given: relative to crates/cli, as
    // the fixture script passes it.
    c.current_dir(env!("CARGO_MANIFEST_DIR")).args([
        "quantize",
        src,
        out.to_str().unwrap(),
        "--type",
        ty,
    ]);
    if imatrix {
        c.args([
            "--imatrix",
            "tests/fixtures/quantize/smollm2_imatrix_l0-3.gguf",
        ]);
    }
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "hf2q quantize {ty}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    sha256(&out)
}

fn check(key: &str, imatrix: bool) {
    let Some(src) = smollm2() else { return };
    let f = fixture();
    assert_eq!(
        sha256(Path::new(&src)),
        f["input_sha256"].as_str().unwrap(),
        "not the pinned SmolLM2 GGUF"
    );
    let mut bad = Vec::new();
    for (ty, want) in f[key].as_object().unwrap() {
        let got = quantize(&src, ty, imatrix);
        eprintln!(
            "{ty}{}: {}",
            if imatrix { " + imatrix" } else { "" },
            if got == want.as_str().unwrap() {
                "identical"
            } else {
                "DIFFERENT"
            }
        );
        if got != want.as_str().unwrap() {
            bad.push(ty.clone());
        }
    }
    assert!(bad.is_empty(), "differs from llama-quantize: {bad:?}");
}

#[test]
fn presets_match_llama_quantize_byte_for_byte() {
    check("outputs", false);
}

#[test]
fn imatrix_presets_match_llama_quantize_byte_for_byte() {
    check("outputs_with_imatrix", true);
}
