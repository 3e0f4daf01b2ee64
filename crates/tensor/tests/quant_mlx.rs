//! Contract: our MLX affine quantization agrees bit for bit with the real MLX library (CPU build)
//! on the vectors in `tests/fixtures/quant/mlx_affine.json`, produced by
//! `scripts/fixtures/gen_mlx_vectors.py` (pinned versions in the fixtures' README): bits 2, 3, 4,
//! 5, 6, 8 x group sizes 32, 64, 128.
//!
//! - `dequantize_affine(mx.quantize output) == mx.dequantize output`, bits equal.
//! - `quantize_affine(input)` == `mx.quantize(input)`: packed bytes, scales and biases bits equal.
//!   No tolerance is needed: we do MLX's CPU kernel's f32 operations in its order (division, not
//!   multiplication by a reciprocal; `rint` ties to even).

use hf2q_tensor::quant::mlx::{dequantize_affine, quantize_affine, AffineParams};
use serde_json::Value;

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

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

struct Case {
    label: String,
    p: AffineParams,
    input: Vec<f32>,
    packed: Vec<u8>,
    scales: Vec<f32>,
    biases: Vec<f32>,
    deq: Vec<f32>,
}

fn cases() -> Vec<Case> {
    let path = format!(
        "{}/tests/fixtures/quant/mlx_affine.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let doc: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let p = AffineParams {
                bits: c["bits"].as_u64().unwrap() as u32,
                group_size: c["group_size"].as_u64().unwrap() as usize,
            };
            Case {
                label: format!("bits {} group {}", p.bits, p.group_size),
                p,
                input: f32s(c["input_f32"].as_str().unwrap()),
                packed: unhex(c["packed"].as_str().unwrap()),
                scales: f32s(c["scales_f32"].as_str().unwrap()),
                biases: f32s(c["biases_f32"].as_str().unwrap()),
                deq: f32s(c["dequantized_f32"].as_str().unwrap()),
            }
        })
        .collect()
}

#[test]
fn fixtures_cover_every_width_and_group_size() {
    let cs = cases();
    for bits in [2, 3, 4, 5, 6, 8] {
        for gs in [32, 64, 128] {
            assert!(
                cs.iter().any(|c| c.p
                    == AffineParams {
                        bits,
                        group_size: gs
                    }),
                "missing {bits}/{gs}"
            );
        }
    }
}

#[test]
fn dequantize_matches_mlx_bit_for_bit() {
    for c in cases() {
        let mut y = vec![0f32; c.input.len()];
        dequantize_affine(c.p, &c.packed, &c.scales, &c.biases, &mut y)
            .unwrap_or_else(|e| panic!("{}: {e}", c.label));
        if let Some(i) = (0..y.len()).find(|&i| y[i].to_bits() != c.deq[i].to_bits()) {
            panic!(
                "{}: element {i}: ours {:e}, mlx {:e}",
                c.label, y[i], c.deq[i]
            );
        }
    }
}

#[test]
fn quantize_matches_mlx_bit_for_bit() {
    for c in cases() {
        let g = c.input.len() / c.p.group_size;
        let mut packed = vec![0u8; c.packed.len()];
        let (mut s, mut b) = (vec![0f32; g], vec![0f32; g]);
        quantize_affine(c.p, &c.input, &mut packed, &mut s, &mut b)
            .unwrap_or_else(|e| panic!("{}: {e}", c.label));
        assert_eq!(
            bits_of(&s),
            bits_of(&c.scales),
            "{}: scales {s:?} vs mlx {:?}",
            c.label,
            c.scales
        );
        assert_eq!(
            bits_of(&b),
            bits_of(&c.biases),
            "{}: biases {b:?} vs mlx {:?}",
            c.label,
            c.biases
        );
        if let Some(i) = (0..packed.len()).find(|&i| packed[i] != c.packed[i]) {
            panic!(
                "{}: packed byte {i}: ours {:#04x}, mlx {:#04x}",
                c.label, packed[i], c.packed[i]
            );
        }
    }
}
