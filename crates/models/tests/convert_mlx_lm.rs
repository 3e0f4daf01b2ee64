//! Contract: an MLX folder written by hf2q loads in mlx-lm (`mlx_lm.load`) and computes what hf2q
//! computes from it: teacher-forced logits of the top-8 tokens per position agree, and so does
//! the tokenizer. Runs when `HF2Q_TEST_MLX_PY` names a Python with `mlx[cpu]==0.32.4` and
//! `mlx-lm==0.32.2` (see `scripts/fixtures/mlx_lm_logits.py`); prints "skipped" otherwise.
//! Covers tiny Llama / Qwen3 / Gemma 3 checkpoints at several bit widths and, when
//! `HF2Q_TEST_SMOLLM2_GGUF` is set, SmolLM2 converted from GGUF (tokenizer rebuilt from GGUF).

use std::path::{Path, PathBuf};
use std::process::Command;

use hf2q_models::convert::mlx_out::MlxOptions;
use hf2q_models::convert::source::SourceModel;
use hf2q_models::convert::{convert, ConvertTarget, NoProgress};
use hf2q_models::Model;
use hf2q_tensor::io::safetensors::StDtype;
use hf2q_tensor::quant::mlx::AffineParams;

fn python() -> Option<String> {
    match std::env::var("HF2Q_TEST_MLX_PY") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            eprintln!("skipped: HF2Q_TEST_MLX_PY is not set");
            None
        }
    }
}

/// `real_tokenizer`: the folder's tokenizer is a real one that transformers must load (the tiny
/// checkpoints' toy vocabulary is not, under a Gemma tokenizer class).
fn check(py: &str, folder: &Path, ids: &[u32], tol: f32, real_tokenizer: bool) {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/fixtures/mlx_lm_logits.py");
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let o = Command::new(py)
        .arg(script)
        .arg(folder)
        .arg(list.join(","))
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "mlx-lm on {}: {}",
        folder.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut m = Model::load(folder).unwrap();
    // Parity with mlx-lm is measured on the reference matmul (f32 activations).
    m.set_matmul_path(hf2q_cpu::MatmulPath::Reference);
    let l = m.session(ids.len()).forward_all(ids).unwrap();
    let (mut agree, mut max_err) = (0usize, 0f32);
    for (p, row) in v["rows"].as_array().unwrap().iter().enumerate() {
        let ours = l.row(p);
        let top: Vec<usize> = row["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        let best = (0..ours.len()).fold(0, |b, i| if ours[i] > ours[b] { i } else { b });
        agree += usize::from(best == top[0]);
        for (&id, want) in top.iter().zip(row["logits"].as_array().unwrap()) {
            max_err = max_err.max((ours[id] - want.as_f64().unwrap() as f32).abs());
        }
    }
    match v["encoded"].as_array() {
        Some(e) => {
            let enc: Vec<u32> = e.iter().map(|x| x.as_u64().unwrap() as u32).collect();
            assert_eq!(
                m.tokenizer()
                    .encode("Hello world, 123!", true, false)
                    .unwrap(),
                enc,
                "{}: tokenizer",
                folder.display()
            );
        }
        None => assert!(
            !real_tokenizer,
            "{}: mlx-lm could not use the tokenizer",
            folder.display()
        ),
    }
    eprintln!(
        "{}: argmax {agree}/{}, max |diff| on mlx-lm's top-8 logits {max_err:.2e}",
        folder.display(),
        ids.len()
    );
    assert!(
        agree * 100 >= 98 * ids.len() && max_err <= tol,
        "{}: {agree}/{} {max_err}",
        folder.display(),
        ids.len()
    );
}

fn golden_ids(p: PathBuf) -> Vec<u32> {
    let g: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    g["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn hf2q_mlx_folders_load_in_mlx_lm() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    // Same weights on both sides in f32 arithmetic: summation order only (1e-3 on logits ~1).
    for (name, bits, group) in [
        ("tiny-llama", 4, 32),
        ("tiny-qwen3", 8, 64),
        ("tiny-gemma3", 3, 32),
    ] {
        let src = SourceModel::open(&fx.join("tiny").join(name)).unwrap();
        let out = dir.path().join(format!("{name}-mlx{bits}"));
        let opts = MlxOptions {
            params: AffineParams {
                bits,
                group_size: group,
            },
            overrides: Default::default(),
            dtype: None,
        };
        convert(&src, &out, &ConvertTarget::Mlx(opts), &NoProgress).unwrap();
        check(
            &py,
            &out,
            &golden_ids(fx.join("tiny").join(name).join("golden.json")),
            1e-3,
            false,
        );
    }
    if let Ok(p) = std::env::var("HF2Q_TEST_SMOLLM2_GGUF") {
        let src = SourceModel::open(Path::new(&p)).unwrap();
        let out = dir.path().join("smollm2-mlx4");
        let opts = MlxOptions {
            params: AffineParams {
                bits: 4,
                group_size: 64,
            },
            overrides: Default::default(),
            dtype: Some(StDtype::F32),
        };
        convert(&src, &out, &ConvertTarget::Mlx(opts), &NoProgress).unwrap();
        // 30 layers, logits ~10-30: summation order over a deep net, 1e-2.
        check(
            &py,
            &out,
            &golden_ids(fx.join("goldens/smollm2.json")),
            1e-2,
            true,
        );
    }
}
