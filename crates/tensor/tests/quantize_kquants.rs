//! Contract: hf2q's k-quant quantizers (and the importance-weighted legacy quantizers) produce
//! exactly the bytes ggml produces, on vectors made by ggml itself
//! (`scripts/fixtures/make_kquant_vectors.sh`: `ggml_quantize_chunk` with and without an
//! importance matrix, `quantize_row_q8_K_ref`), stored in `tests/fixtures/quantize/`.
//!
//! Inputs cover the awkward cases (all-zero and constant super-blocks, values below ggml's
//! epsilon, huge values, all-positive and all-negative rows, outliers, rounding ties, one
//! non-zero per block, sub-blocks at very different scales). No tolerance: byte equality.

use hf2q_tensor::quant::{dequantize, kquant_quantize::quantize_weighted, quantize};
use hf2q_tensor::GgmlType;
use serde_json::Value;

fn unhex(s: &str) -> Vec<u8> {
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
        "{}/tests/fixtures/quantize/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

struct Inputs {
    rows: usize,
    cols: usize,
    x: Vec<f32>,
    imatrix: Vec<f32>,
    desc: Vec<String>,
}

fn inputs() -> Inputs {
    let v = load("inputs.json");
    let rows = v["rows"].as_u64().unwrap() as usize;
    let cols = v["cols"].as_u64().unwrap() as usize;
    let x = f32s(v["input_f32"].as_str().unwrap());
    let imatrix = f32s(v["imatrix_f32"].as_str().unwrap());
    assert_eq!(x.len(), rows * cols);
    assert_eq!(imatrix.len(), cols);
    let desc = v["rows_desc"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap().to_string())
        .collect();
    Inputs {
        rows,
        cols,
        x,
        imatrix,
        desc,
    }
}

/// Names the first differing row, block and byte for a readable failure.
fn compare(what: &str, ty: GgmlType, inp: &Inputs, ours: &[u8], theirs: &[u8]) {
    assert_eq!(ours.len(), theirs.len(), "{what}: length");
    let rb = ty.row_bytes(inp.cols).unwrap();
    if let Some(i) = ours.iter().zip(theirs).position(|(a, b)| a != b) {
        let (row, off) = (i / rb, i % rb);
        panic!(
            "{what}: first difference in row {row} ({}), block {}, byte {} of the block: ours {:#04x}, ggml {:#04x}",
            inp.desc[row],
            off / ty.type_size(),
            off % ty.type_size(),
            ours[i],
            theirs[i]
        );
    }
}

const TYPES: &[&str] = &[
    "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0",
];

#[test]
fn plain_quantization_matches_ggml_byte_for_byte() {
    let inp = inputs();
    for name in TYPES.iter().chain(&["q8_K"]) {
        let ty = GgmlType::from_name(name).unwrap();
        let doc = load(&format!("kquant_{name}.json"));
        let want = unhex(doc["plain"].as_str().unwrap());
        let mut got = vec![0u8; ty.row_bytes(inp.cols).unwrap() * inp.rows];
        quantize(ty, &inp.x, &mut got).unwrap();
        compare(&format!("{name} plain"), ty, &inp, &got, &want);
    }
}

#[test]
fn importance_weighted_quantization_matches_ggml_byte_for_byte() {
    let inp = inputs();
    for name in TYPES {
        let ty = GgmlType::from_name(name).unwrap();
        let doc = load(&format!("kquant_{name}.json"));
        let want = unhex(doc["imatrix"].as_str().unwrap());
        let mut got = vec![0u8; ty.row_bytes(inp.cols).unwrap() * inp.rows];
        quantize_weighted(ty, &inp.x, &mut got, &inp.imatrix).unwrap();
        compare(&format!("{name} imatrix"), ty, &inp, &got, &want);
    }
}

#[test]
fn importance_weights_lower_the_weighted_error() {
    // Sanity of the fixture itself: with the importance matrix, error weighted by it is lower
    // than without (summed over the weight-like rows), for every k-quant.
    let inp = inputs();
    for name in ["q2_K", "q3_K", "q4_K", "q5_K", "q6_K"] {
        let ty = GgmlType::from_name(name).unwrap();
        let rb = ty.row_bytes(inp.cols).unwrap();
        let err = |weighted: bool| -> f64 {
            let mut q = vec![0u8; rb * inp.rows];
            if weighted {
                quantize_weighted(ty, &inp.x, &mut q, &inp.imatrix).unwrap();
            } else {
                quantize(ty, &inp.x, &mut q).unwrap();
            }
            let mut y = vec![0f32; inp.x.len()];
            dequantize(ty, &q, &mut y).unwrap();
            // Rows 0, 1 and 4: normal, weight-like, heavy-tailed.
            [0usize, 1, 4]
                .iter()
                .map(|&r| {
                    let s = r * inp.cols;
                    let scale: f64 = inp.x[s..s + inp.cols]
                        .iter()
                        .map(|v| (*v as f64).powi(2))
                        .sum();
                    (0..inp.cols)
                        .map(|c| inp.imatrix[c] as f64 * ((inp.x[s + c] - y[s + c]) as f64).powi(2))
                        .sum::<f64>()
                        / scale
                })
                .sum()
        };
        let (plain, weighted) = (err(false), err(true));
        assert!(
            weighted < plain,
            "{name}: weighted error {weighted} not below plain {plain}"
        );
    }
}
