//! Contract: our ggml block formats agree bit for bit with gguf-py (an independent numpy
//! implementation of ggml's formats) on the vectors in `tests/fixtures/quant/ggml_*.json`,
//! produced by `scripts/fixtures/gen_quant_vectors.py` (pinned versions in the fixtures' README).
//!
//! - Dequantization: every type, output bits equal (no tolerance: we do the same f32 operations
//!   in the same order, and neither side fuses multiply-adds).
//! - Quantization: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, output bytes equal.

use hf2q_tensor::quant::{dequantize, quantize};
use hf2q_tensor::GgmlType;
use serde_json::Value;

const TYPES: &[&str] = &[
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_1", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K", "Q8_K",
];

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn f32s(s: &str) -> Vec<f32> {
    unhex(s)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn load(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/quant/ggml_{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// First differing element, with both bit patterns, for a readable failure.
fn first_diff(ours: &[f32], theirs: &[f32]) -> Option<String> {
    ours.iter()
        .zip(theirs)
        .enumerate()
        .find(|(_, (a, b))| a.to_bits() != b.to_bits())
        .map(|(i, (a, b))| {
            format!(
                "element {i} (block element {}): ours {a:e} ({:#010x}), gguf-py {b:e} ({:#010x})",
                i % 32,
                a.to_bits(),
                b.to_bits()
            )
        })
}

#[test]
fn dequantize_matches_gguf_py_bit_for_bit() {
    let mut checked = 0;
    for name in TYPES {
        let ty = GgmlType::from_name(name).unwrap();
        let doc = load(name);
        for case in doc["cases"].as_array().unwrap() {
            let cname = case["name"].as_str().unwrap();
            let n = case["n"].as_u64().unwrap() as usize;
            let q = unhex(case["quantized"].as_str().unwrap());
            let want = f32s(case["dequantized_f32"].as_str().unwrap());
            assert_eq!(want.len(), n, "{name}/{cname}");
            let mut got = vec![0f32; n];
            dequantize(ty, &q, &mut got).unwrap_or_else(|e| panic!("{name}/{cname}: {e}"));
            if let Some(d) = first_diff(&got, &want) {
                panic!("{name}/{cname}: {d}");
            }
            checked += n;
        }
    }
    assert!(checked > 8_000, "only {checked} elements checked");
}

#[test]
fn quantize_matches_gguf_py_byte_for_byte() {
    let mut cases = 0;
    for name in ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"] {
        let ty = GgmlType::from_name(name).unwrap();
        let doc = load(name);
        for case in doc["cases"].as_array().unwrap() {
            let Some(input) = case.get("input_f32") else {
                continue;
            };
            let cname = case["name"].as_str().unwrap();
            let x = f32s(input.as_str().unwrap());
            let want = unhex(case["quantized"].as_str().unwrap());
            let mut got = vec![0u8; want.len()];
            quantize(ty, &x, &mut got).unwrap_or_else(|e| panic!("{name}/{cname}: {e}"));
            if got != want {
                let ts = ty.type_size();
                let i = got.iter().zip(&want).position(|(a, b)| a != b).unwrap();
                let (b0, b1) = (i / ts * ts, i / ts * ts + ts);
                panic!(
                    "{name}/{cname}: byte {i} (block {}) differs\n ours    {:02x?}\n gguf-py {:02x?}",
                    i / ts,
                    &got[b0..b1],
                    &want[b0..b1]
                );
            }
            cases += 1;
        }
    }
    assert!(cases >= 8 * 10, "only {cases} quantize cases");
}

#[test]
fn fixtures_cover_every_supported_type() {
    // MXFP4's dequantization is checked exhaustively instead (every code under every scale, in
    // `quant/mxfp4.rs`), against the OCP format's own definition of the values.
    for ty in GgmlType::all().filter(|t| t.is_supported() && *t != GgmlType::MXFP4) {
        assert!(TYPES.contains(&ty.name()), "no reference vectors for {ty}");
    }
}
