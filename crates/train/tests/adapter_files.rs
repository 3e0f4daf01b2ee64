//! Hostile or broken adapter folders are refused at load with an error naming the problem, and
//! leave the model without a half-loaded adapter: a rank that disagrees with the config, a
//! missing tensor, a wrong shape, a tensor for a module the model does not have, a non-finite
//! value, features hf2q does not compute (DoRA), a config that is not JSON.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hf2q_models::Model;
use hf2q_tensor::io::safetensors::{write_safetensors, SafeTensors, StDtype};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn model() -> Model {
    Model::load(&root().join("../models/tests/fixtures/tiny/tiny-llama")).unwrap()
}

/// The good adapter's tensors `(name, shape, values)`.
fn good() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let st = SafeTensors::open(
        &root().join("tests/fixtures/peft/tiny-llama/ours_random/adapter_model.safetensors"),
    )
    .unwrap();
    st.tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone(), st.to_f32(t).unwrap()))
        .collect()
}

fn config() -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(
            root().join("tests/fixtures/peft/tiny-llama/ours_random/adapter_config.json"),
        )
        .unwrap(),
    )
    .unwrap()
}

fn write(dir: &Path, cfg: &serde_json::Value, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("adapter_config.json"), cfg.to_string()).unwrap();
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let refs: Vec<_> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| (n.clone(), StDtype::F32, s.clone(), b.as_slice()))
        .collect();
    write_safetensors(
        &dir.join("adapter_model.safetensors"),
        &refs,
        &BTreeMap::new(),
    )
    .unwrap();
}

fn refused(dir: &Path, msg: &str) {
    let mut m = model();
    let e = m
        .load_adapter(dir)
        .expect_err("loaded a broken adapter")
        .to_string();
    assert!(e.contains(msg), "expected '{msg}' in: {e}");
    assert!(
        m.adapters().is_empty(),
        "a refused adapter was left half-loaded"
    );
}

#[test]
fn broken_adapters_are_refused_and_nothing_is_left_loaded() {
    let h = tempfile::tempdir().unwrap();
    let d = |n: &str| h.path().join(n);

    // The good one loads.
    write(&d("good"), &config(), &good());
    assert_eq!(model().load_adapter(&d("good")).unwrap().r, 4);

    let mut cfg = config();
    cfg["r"] = serde_json::json!(8);
    write(&d("rank"), &cfg, &good());
    refused(&d("rank"), "expected [8, 64]");

    let mut t = good();
    let gone = t.remove(5).0;
    write(&d("missing"), &config(), &t);
    refused(&d("missing"), &format!("missing tensor '{gone}'"));

    let mut t = good();
    t[0].1 = vec![4, 32];
    t[0].2.truncate(128);
    write(&d("shape"), &config(), &t);
    refused(&d("shape"), "lora_A [4, 32]");

    let mut t = good();
    let mut extra = t[0].clone();
    extra.0 = extra.0.replace("layers.0", "layers.7");
    t.push(extra);
    write(&d("extra"), &config(), &t);
    refused(
        &d("extra"),
        "does not belong to a LoRA target of this model",
    );

    let mut t = good();
    t[3].2[2] = f32::NAN;
    write(&d("nan"), &config(), &t);
    refused(&d("nan"), "non-finite value");

    let mut cfg = config();
    cfg["use_dora"] = serde_json::json!(true);
    write(&d("dora"), &cfg, &good());
    refused(&d("dora"), "DoRA adapters are not supported");

    write(&d("json"), &config(), &good());
    std::fs::write(d("json").join("adapter_config.json"), "{\"r\": 4,").unwrap();
    refused(&d("json"), "not JSON");

    refused(&d("nowhere"), "adapter_config.json");
}
