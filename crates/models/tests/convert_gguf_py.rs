//! Contract: a GGUF written by hf2q reads the same in gguf-py (llama.cpp's Python reader) as in
//! hf2q: every metadata key and value, every tensor's name, type, dims and size, and the values
//! gguf-py's own dequantizers decode (sum and first elements).
//!
//! Runs when `HF2Q_TEST_GGUF_PY` names a Python with `gguf==0.19.0` installed (see
//! `scripts/fixtures/gguf_py_summary.py`); prints "skipped" otherwise. Covers float and
//! quantized outputs of every family (tiny checkpoints; GPT-OSS with its MXFP4 experts), and SmolLM2 presets when
//! `HF2Q_TEST_SMOLLM2_GGUF` is set too.

use std::path::{Path, PathBuf};
use std::process::Command;

use hf2q_models::convert::source::SourceModel;
use hf2q_models::convert::{convert, ConvertTarget, NoProgress};
use hf2q_models::quantize::presets::QuantTarget;
use hf2q_models::quantize::{quantize, QuantizeOptions};
use hf2q_tensor::io::gguf::{GgufFile, GgufValue};
use serde_json::Value;

fn python() -> Option<String> {
    match std::env::var("HF2Q_TEST_GGUF_PY") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            eprintln!("skipped: HF2Q_TEST_GGUF_PY is not set");
            None
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn summary(py: &str, file: &Path) -> Value {
    let o = Command::new(py)
        .arg(root().join("scripts/fixtures/gguf_py_summary.py"))
        .arg(file)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "gguf-py on {}: {}",
        file.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

/// hf2q's value in the script's JSON shape.
fn as_json(v: &GgufValue) -> Value {
    match v {
        GgufValue::Array(a) => {
            serde_json::json!({ "array_len": a.values.len(), "first": a.values.first().map(as_json) })
        }
        GgufValue::String(s) => Value::String(s.clone()),
        GgufValue::Bool(b) => Value::Bool(*b),
        GgufValue::F32(x) => serde_json::json!(*x as f64),
        GgufValue::F64(x) => serde_json::json!(*x),
        other => serde_json::json!(other.as_i64().expect("integer")),
    }
}

fn check(py: &str, file: &Path) {
    let s = summary(py, file);
    let f = GgufFile::open(file).unwrap();
    let meta = s["metadata"].as_object().unwrap();
    assert_eq!(
        meta.len(),
        f.metadata.len(),
        "{}: metadata count",
        file.display()
    );
    for (k, v) in &f.metadata {
        assert_eq!(
            meta.get(k),
            Some(&as_json(v)),
            "{}: metadata {k}",
            file.display()
        );
    }
    let ts = s["tensors"].as_array().unwrap();
    assert_eq!(ts.len(), f.tensors.len());
    for (t, p) in f.tensors.iter().zip(ts) {
        assert_eq!(p["name"], t.name.as_str());
        assert_eq!(p["type"], t.ty.name(), "{}", t.name);
        let dims: Vec<u64> = p["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(dims, t.dims, "{}", t.name);
        assert_eq!(p["n_bytes"].as_u64().unwrap(), t.nbytes(), "{}", t.name);
        let n = t.numel() as usize;
        let mut x = vec![0f32; n];
        hf2q_tensor::quant::dequantize(t.ty, f.tensor_data(t).unwrap().as_slice(), &mut x).unwrap();
        let head: Vec<f32> = p["head"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(head, x[..head.len()], "{}: first values", t.name);
        let (sum, abs): (f64, f64) = x.iter().fold((0.0, 0.0), |(s, a), &v| {
            (s + v as f64, a + (v as f64).abs())
        });
        // Sums in f64 in another order: equal to ~1e-12 of the magnitude.
        assert!(
            (sum - p["sum"].as_f64().unwrap()).abs() <= 1e-9 * abs.max(1.0),
            "{}: sum {sum} vs {}",
            t.name,
            p["sum"]
        );
    }
    if f.architecture() == Some("gpt-oss") {
        // Every name and key is one gguf-py's constants give the family (llama.cpp's loader
        // looks tensors up by these names).
        let set = |k: &str| -> Vec<String> {
            s[k].as_array()
                .unwrap_or_else(|| panic!("gguf-py does not know gpt-oss"))
                .iter()
                .map(|v| v.as_str().unwrap().to_string())
                .collect()
        };
        let (names, keys) = (set("arch_names"), set("arch_keys"));
        for t in &f.tensors {
            let stem = t.name.rsplit_once('.').map_or(t.name.as_str(), |x| x.0);
            assert!(
                names.iter().any(|n| n == stem),
                "{}: not a gpt-oss tensor in gguf-py",
                t.name
            );
        }
        for (k, _) in &f.metadata {
            if !k.starts_with("tokenizer.") && !k.starts_with("general.") {
                assert!(keys.contains(k), "{k}: not a key gguf-py names");
            }
        }
    }
    eprintln!(
        "{}: gguf-py agrees ({} keys, {} tensors)",
        file.display(),
        f.metadata.len(),
        f.tensors.len()
    );
}

#[test]
fn hf2q_gguf_reads_the_same_in_gguf_py() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny");
    for (name, ty) in [
        ("tiny-llama", None),
        ("tiny-qwen2", Some("Q8_0")),
        ("tiny-qwen3", Some("Q4_0")),
        ("tiny-gemma3", Some("BF16")),
        // llama.cpp's `gpt-oss` names, its MXFP4 experts (type 39) decoded by gguf-py too.
        ("tiny-gpt-oss", None),
    ] {
        let src = SourceModel::open(&tiny.join(name)).unwrap();
        let out = dir.path().join(format!("{name}.gguf"));
        let target = match ty {
            None => ConvertTarget::Gguf(None),
            Some(t) => match QuantTarget::parse(t, None).unwrap() {
                QuantTarget::Gguf(r) => ConvertTarget::Gguf(Some(r)),
                _ => unreachable!(),
            },
        };
        convert(&src, &out, &target, &NoProgress).unwrap();
        check(&py, &out);
    }
    if let Ok(p) = std::env::var("HF2Q_TEST_SMOLLM2_GGUF") {
        let src = SourceModel::open(Path::new(&p)).unwrap();
        for ty in ["Q4_K_M", "Q6_K", "Q2_K"] {
            let out = dir.path().join(format!("smollm2-{ty}.gguf"));
            let opts = QuantizeOptions {
                target: QuantTarget::parse(ty, None).unwrap(),
                overrides: Default::default(),
                imatrix: None,
            };
            quantize(&src, &out, &opts, &NoProgress).unwrap();
            check(&py, &out);
        }
    }
}
