//! MLX-folder loading held to mlx-lm itself: folders written by `mlx_lm.convert` (quantize=True)
//! from the tiny random checkpoints, logits recorded by `mlx_lm.load` + forward, float32 on CPU.
//! Fixtures and their pinned versions: `scripts/goldens/make_mlx_goldens.py` (versions also in
//! each fixture's `golden.json` "meta").
//!
//! - mlx-llama-q4g32: uniform 4 bits / group 32, separate quantized lm_head.
//! - mlx-qwen3-q8g64: uniform 8 bits / group 64, tied quantized embeddings as the lm_head.
//! - mlx-gemma3-mixed: per-layer overrides in config.json (2/3/5/6/8 bits, groups 32/64/128), one
//!   Linear left float, tied 6-bit embeddings, Gemma's (1 + w) norms and embedding scale.
//! - mlx-qwen2-mixed-bf16: mlx-lm's `mixed_3_6` recipe with bf16 scales, biases and norms.
//!
//! Plus hostile folders (built in a tempdir from a good one): no quantization block, scales of
//! the wrong shape, a non-affine mode: each must fail to load with an error naming the problem.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hf2q_models::Model;
use hf2q_tensor::io::safetensors::{write_safetensors, SafeTensors, StTensorRef};
use serde_json::Value;

fn mlx_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx")
}

fn load_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

const MLX: &[&str] = &[
    "mlx-llama-q4g32",
    "mlx-qwen3-q8g64",
    "mlx-gemma3-mixed",
    "mlx-qwen2-mixed-bf16",
];

// Tolerance on every logit: both sides dequantize the same codes with the same f32 scales and
// biases (bit-exact, tested in hf2q-tensor), so what remains is f32 accumulation order (MLX's
// CPU quantized matmul and attention vs our dot products) through two layers. Measured max
// |Δ| over each fixture's 20 x 259 logits (|logit| <= 2.4): 6.3e-7 llama, 9.2e-7 qwen3, 1.5e-6
// gemma3, 6.6e-7 qwen2. 1e-4 leaves ~60x room for other CPUs and summation orders, while a
// misread weight cannot hide under it: even 8-bit rounding of every matrix moves these logits
// by 3e-2 (quantized vs float goldens), so a wrong bit width, group, override or scale moves
// them by far more than 1e-4.
const TOL: f32 = 1e-4;

#[test]
fn mlx_folders_match_mlx_lm() {
    for name in MLX {
        let dir = mlx_fixtures().join(name);
        let mut model = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        // Parity with mlx-lm is measured on the reference matmul (f32 activations) and an f32 KV
        // cache, as mlx-lm keeps its cache in the model's float32: TOL below is for summation
        // order only (an f16 cache alone moves these logits by about 5e-4).
        model.set_matmul_path(hf2q_cpu::MatmulPath::Reference);
        model.set_kv_type(hf2q_tensor::kv::KvType::F32);
        let info = model.info();
        assert_eq!(info.format, "mlx", "{name}");

        // Expected stored types, independently of the loader: every `.scales` tensor in the file
        // is one quantized matrix, typed by mlx-lm's config (per-layer override, else default).
        let g = load_json(&dir.join("golden.json"));
        let q = &g["quantization"];
        let st = SafeTensors::open(&dir.join("model.safetensors")).unwrap();
        let mut want: BTreeMap<String, usize> = BTreeMap::new();
        for t in &st.tensors {
            let Some(stem) = t.name.strip_suffix(".scales") else {
                continue;
            };
            let o = q.get(stem).filter(|o| o.is_object()).unwrap_or(q);
            *want
                .entry(format!("mlx{}g{}", o["bits"], o["group_size"]))
                .or_default() += 1;
        }
        let got: BTreeMap<String, usize> = info
            .tensor_types
            .iter()
            .filter(|(k, _)| k.starts_with("mlx"))
            .map(|(k, v)| (k.clone(), v.0))
            .collect();
        eprintln!("{name}: tensor_types {:?}", info.tensor_types);
        assert_eq!(got, want, "{name}: stored MLX types");

        let ids: Vec<u32> = g["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let logits = model.session(0).forward_all(&ids).unwrap();
        let rows = g["logits"].as_array().unwrap();
        assert_eq!(rows.len(), ids.len(), "{name}");
        let (mut max_err, mut max_ref) = (0f32, 0f32);
        for (t, row) in rows.iter().enumerate() {
            let row = row.as_array().unwrap();
            assert_eq!(row.len(), logits.row(t).len(), "{name}: vocab size");
            for (v, want) in logits.row(t).iter().zip(row) {
                let want = want.as_f64().unwrap() as f32;
                max_err = max_err.max((v - want).abs());
                max_ref = max_ref.max(want.abs());
            }
        }
        eprintln!("{name}: max |Δ| over all logits {max_err:.2e} (max |logit| {max_ref:.2})");
        assert!(max_err < TOL, "{name}: max logit error {max_err} vs mlx-lm");
    }
}

/// An MLX fixture copied into a tempdir, for editing.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(mlx_fixtures().join(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), tmp.path().join(e.file_name())).unwrap();
    }
    tmp
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let p = dir.join("config.json");
    let mut v = load_json(&p);
    f(v.as_object_mut().unwrap());
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Rewrites `model.safetensors` with `name` replaced by (new shape, new bytes).
fn replace_tensor(dir: &Path, name: &str, shape: Vec<usize>, data: Option<Vec<u8>>) {
    let p = dir.join("model.safetensors");
    let st = SafeTensors::open(&p).unwrap();
    let blobs: Vec<Vec<u8>> = st
        .tensors
        .iter()
        .map(|t| st.tensor_data(t).unwrap().as_slice().to_vec())
        .collect();
    let mut list: Vec<StTensorRef<'_>> = Vec::new();
    let mut found = false;
    let replacement = data.unwrap_or_default();
    for (t, b) in st.tensors.iter().zip(&blobs) {
        if t.name == name {
            found = true;
            let bytes: &[u8] = if replacement.is_empty() {
                b
            } else {
                &replacement
            };
            list.push((t.name.clone(), t.dtype, shape.clone(), bytes));
        } else {
            list.push((t.name.clone(), t.dtype, t.shape.clone(), b));
        }
    }
    assert!(found, "{name} not in fixture");
    let meta: BTreeMap<String, String> = st.metadata.clone();
    drop(st);
    write_safetensors(&p, &list, &meta).unwrap();
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("{}: a broken MLX folder loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn mlx_config_without_quantization_block_is_a_clear_error() {
    let tmp = copy_fixture("mlx-gemma3-mixed");
    edit_config(tmp.path(), |c| {
        c.remove("quantization");
        c.remove("quantization_config");
    });
    let e = load_err(tmp.path());
    eprintln!("no quantization block: {e}");
    assert!(e.contains("quantization") && e.contains(".scales"), "{e}");
}

#[test]
fn mlx_scales_of_wrong_shape_are_a_clear_error() {
    // layers.0.mlp.down_proj: 6 bits, group 128 over 128 inputs -> scales (64, 1).
    let t = "model.layers.0.mlp.down_proj.scales";

    // Fewer groups than the weight needs: half the rows.
    let tmp = copy_fixture("mlx-gemma3-mixed");
    let st = SafeTensors::open(&tmp.path().join("model.safetensors")).unwrap();
    let info = st.tensor(t).unwrap().clone();
    assert_eq!(info.shape, vec![64, 1]);
    let half = st.tensor_data(&info).unwrap().as_slice()[..info.nbytes() / 2].to_vec();
    drop(st);
    replace_tensor(tmp.path(), t, vec![32, 1], Some(half));
    let e = load_err(tmp.path());
    eprintln!("scales (32, 1): {e}");
    assert!(e.contains("down_proj") && e.contains("scales"), "{e}");

    // Same element count, wrong layout: (1, 64) instead of (64, 1).
    let tmp = copy_fixture("mlx-gemma3-mixed");
    replace_tensor(tmp.path(), t, vec![1, 64], None);
    let e = load_err(tmp.path());
    eprintln!("scales (1, 64): {e}");
    assert!(e.contains("down_proj") && e.contains("scales"), "{e}");
}

#[test]
fn mlx_override_that_disagrees_with_the_file_is_a_clear_error() {
    // The config claims 4 bits for a matrix stored at 6: the packed width no longer fits.
    let tmp = copy_fixture("mlx-gemma3-mixed");
    edit_config(tmp.path(), |c| {
        c["quantization"]["model.layers.0.mlp.down_proj"]["bits"] = 4.into();
        c["quantization_config"]["model.layers.0.mlp.down_proj"]["bits"] = 4.into();
    });
    let e = load_err(tmp.path());
    eprintln!("override bits 6 -> 4: {e}");
    assert!(e.contains("down_proj"), "{e}");
}

#[test]
fn mlx_non_affine_mode_is_a_clear_error() {
    let tmp = copy_fixture("mlx-qwen3-q8g64");
    edit_config(tmp.path(), |c| {
        c["quantization"]["mode"] = "mxfp8".into();
        c["quantization_config"]["mode"] = "mxfp8".into();
    });
    let e = load_err(tmp.path());
    eprintln!("mode mxfp8: {e}");
    assert!(e.contains("mxfp8"), "{e}");
}
