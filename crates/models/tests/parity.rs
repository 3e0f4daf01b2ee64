//! Golden parity against transformers (PyTorch, float32), fixtures made by
//! `scripts/goldens/make_goldens.py` (versions in each fixture's `meta` and in
//! `fixtures/goldens/README.md`).
//!
//! - Real GGUF checkpoints (SmolLM2 Q4_1, Gemma 3 270M Q4_K_M, Qwen2.5-Coder 0.5B Q4_K_M): the
//!   same ids, teacher-forced; argmax agreement >= 99/100 and the top-20 reference logits within a
//!   tolerance. Paths come from `HF2Q_TEST_{SMOLLM2,GEMMA3,QWEN25}_GGUF` (set by `.ci/run`); a
//!   test without its file prints "skipped" and passes.
//! - Tiny random Hugging Face checkpoints (committed) exercise the safetensors path, every
//!   family's options (llama3 rope scaling, qkv bias, q/k norm, sliding window, sandwich norms).
//! - Cache consistency: full-prefill logits equal token-by-token decode logits.
//!
//! Golden parity runs with an f32 KV cache (transformers keeps float32 keys and values); the f16
//! cache, the default, is held to the same goldens with its own tolerance, and is what
//! `fast_path_gate` measures the shipped configuration (fast kernels, f16 cache) with.

mod common;

use std::path::{Path, PathBuf};

use common::{argmax, kl};
use hf2q_cpu::MatmulPath;
use hf2q_models::Model;
use hf2q_tensor::kv::KvType;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn load_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn model_from_env(var: &str) -> Option<Model> {
    match std::env::var(var) {
        Ok(p) if !p.is_empty() => Some(reference(
            Model::load(Path::new(&p)).unwrap_or_else(|e| panic!("{p}: {e}")),
        )),
        _ => {
            eprintln!("skipped: {var} is not set");
            None
        }
    }
}

/// Golden parity is measured on the reference matmul (f32 activations) and an f32 KV cache;
/// the fast kernels and the f16 cache are held to the reference separately (hf2q-tensor's kernel
/// tests, and `fast_path_gate` below).
fn reference(mut m: Model) -> Model {
    m.set_matmul_path(MatmulPath::Reference);
    m.set_kv_type(KvType::F32);
    m
}

/// Teacher-forced comparison with the golden top-20 (argmax agreement >= 99%, top-20 logits
/// within `tol`), with the KV cache storing `kv`.
fn gguf_parity(name: &str, var: &str, kv: KvType, tol: f32) {
    let Some(mut model) = model_from_env(var) else {
        return;
    };
    model.set_kv_type(kv);
    let g = load_json(&fixtures().join(format!("goldens/{name}.json")));
    let ids = ids_of(&g["ids"]);
    let mut s = model.session(ids.len());
    let logits = s.forward_all(&ids).unwrap();
    let steps = g["steps"].as_array().unwrap();
    let (mut agree, mut max_err) = (0usize, 0f32);
    for st in steps {
        let pos = st["pos"].as_u64().unwrap() as usize;
        let row = logits.row(pos);
        let top = ids_of(&st["top_ids"]);
        if argmax(row) == top[0] as usize {
            agree += 1;
        }
        for (id, want) in top.iter().zip(st["top_logits"].as_array().unwrap()) {
            let err = (row[*id as usize] - want.as_f64().unwrap() as f32).abs();
            max_err = max_err.max(err);
        }
    }
    eprintln!(
        "{name} ({kv:?} cache): argmax agreement {agree}/{}, max |Δ| on top-20 logits {max_err:.5}",
        steps.len()
    );
    assert!(
        agree * 100 >= 99 * steps.len(),
        "{name}: argmax agreement {agree}/{}",
        steps.len()
    );
    assert!(
        max_err <= tol,
        "{name}: top-20 logit error {max_err} > {tol}"
    );
}

// Tolerance on top-20 logits: both sides dequantize the same blocks exactly (bit-identical
// dequantization is tested in hf2q-tensor), so what remains is f32 summation order across
// 18-30 layers (GPU reductions vs our 8-lane CPU dot): measured well under 1e-2; 2e-2 leaves
// room for other CPUs' libm without hiding a real bug (a wrong weight moves logits by >> 0.1).
const GGUF_TOL: f32 = 2e-2;

// With an f16 cache every key and value is rounded once (2^-12 relative), and that, not the
// arithmetic, is what remains: measured max |Δ| on the top-20 logits 7.0e-3 (SmolLM2), 2.5e-2
// (Gemma 3), 4.2e-2 (Qwen2.5), against 6e-5 with an f32 cache. 8e-2 leaves about 2x room; the
// argmax agreement (>= 99/100) is held as with f32, and `fast_path_gate` bounds the f16 cache's
// effect on the whole distribution (mean KL) far more tightly.
const GGUF_TOL_F16: f32 = 8e-2;

#[test]
fn smollm2_matches_transformers() {
    gguf_parity("smollm2", "HF2Q_TEST_SMOLLM2_GGUF", KvType::F32, GGUF_TOL);
    gguf_parity(
        "smollm2",
        "HF2Q_TEST_SMOLLM2_GGUF",
        KvType::F16,
        GGUF_TOL_F16,
    );
}

#[test]
fn gemma3_matches_transformers() {
    gguf_parity("gemma3", "HF2Q_TEST_GEMMA3_GGUF", KvType::F32, GGUF_TOL);
    gguf_parity("gemma3", "HF2Q_TEST_GEMMA3_GGUF", KvType::F16, GGUF_TOL_F16);
}

#[test]
fn qwen25_matches_transformers() {
    gguf_parity("qwen25", "HF2Q_TEST_QWEN25_GGUF", KvType::F32, GGUF_TOL);
    gguf_parity("qwen25", "HF2Q_TEST_QWEN25_GGUF", KvType::F16, GGUF_TOL_F16);
}

/// The largest |Δ| between `model`'s logits over a tiny golden's ids and the golden's full logits.
fn max_logit_error(model: &Model, golden: &std::path::Path) -> f32 {
    let g = load_json(golden);
    let logits = model.session(0).forward_all(&ids_of(&g["ids"])).unwrap();
    let mut max_err = 0f32;
    for (t, row) in g["logits"].as_array().unwrap().iter().enumerate() {
        for (v, want) in logits.row(t).iter().zip(row.as_array().unwrap()) {
            max_err = max_err.max((v - want.as_f64().unwrap() as f32).abs());
        }
    }
    max_err
}

const TINY: &[&str] = &[
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma3",
    "tiny-qwen3-moe",
    "tiny-mixtral",
    "tiny-gemma4",
    "tiny-gemma4-moe",
    "tiny-gemma4-e",
    "tiny-phi3",
    "tiny-mistral",
    "tiny-smollm3",
    "tiny-granite",
    "tiny-olmo2",
    "tiny-minicpm",
    "tiny-gpt-oss",
];

#[test]
fn tiny_hf_checkpoints_match_transformers() {
    for name in TINY {
        let dir = fixtures().join("tiny").join(name);
        let model = reference(Model::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}")));
        let max_err = max_logit_error(&model, &dir.join("golden.json"));
        eprintln!("{name}: max |Δ| over all logits {max_err:.2e}");
        // f32 weights on both sides, two layers: only summation order differs (~1e-6); the
        // fixture rounds to 1e-6, so 1e-4 is loose enough and still catches any real error.
        assert!(max_err < 1e-4, "{name}: max logit error {max_err}");
    }
}

/// The tiny Qwen3-MoE written as a GGUF by gguf-py in llama.cpp's layout (stacked
/// `ffn_*_exps`, `ffn_gate_inp`; one dense layer), held to the transformers golden of the
/// safetensors folder it was made from (scripts/fixtures/gen_moe_gguf.py).
#[test]
fn gguf_experts_match_transformers() {
    let path = fixtures().join("moe").join("tiny-qwen3-moe.gguf");
    let model = reference(Model::load(&path).unwrap_or_else(|e| panic!("{e}")));
    let max_err = max_logit_error(&model, &fixtures().join("tiny/tiny-qwen3-moe/golden.json"));
    eprintln!("tiny-qwen3-moe.gguf: max |Δ| over all logits {max_err:.2e}");
    // inspect: 8 experts, 2 used, width 32, layer 0 routed: 6 unused experts of 3·64·32.
    let info = model.info();
    let e = info.experts.expect("experts in inspect");
    assert_eq!(
        (
            e.experts,
            e.experts_per_token,
            e.expert_width,
            e.routed_layers
        ),
        (8, 2, 32, 1)
    );
    assert_eq!(e.active_parameters, info.parameters - 6 * 3 * 64 * 32);
    // The same f32 weights as the safetensors folder: the tolerance of the tiny checkpoints.
    assert!(max_err < 1e-4, "max logit error {max_err}");
}

/// The tiny Gemma 4 MoE and E2B-like checkpoints written as GGUF by gguf-py in llama.cpp's
/// `gemma4` layout (kv heads and sliding layers per layer, no `attn_v` on the MoE's global layer,
/// `rope_freqs`, fused `ffn_gate_up_exps`, router and per-expert scales, layer output scales;
/// per-layer embeddings, KV-shared layers without `attn_k`/`attn_v`), held to the transformers
/// goldens of the safetensors folders they were made from (scripts/fixtures/gen_gemma4_gguf.py);
/// and `inspect`'s experts of both forms of the MoE.
#[test]
fn gguf_gemma4_matches_transformers() {
    for name in ["tiny-gemma4-moe", "tiny-gemma4-e"] {
        let dir = fixtures().join("tiny").join(name);
        let path = fixtures().join("moe").join(format!("{name}.gguf"));
        let model = reference(Model::load(&path).unwrap_or_else(|e| panic!("{name}: {e}")));
        let max_err = max_logit_error(&model, &dir.join("golden.json"));
        eprintln!("{name}.gguf: max |Δ| over all logits {max_err:.2e}");
        assert!(max_err < 1e-4, "{name}: max logit error {max_err}");
        let hf = Model::load(&dir).unwrap();
        for info in [model.info(), hf.info()] {
            assert_eq!(info.architecture, "gemma4");
            if name == "tiny-gemma4-e" {
                assert!(info.experts.is_none());
                continue;
            }
            // 8 experts, 2 used, width 32, both layers routed: 6 unused experts of 3·64·32.
            let e = info.experts.expect("experts in inspect");
            assert_eq!(
                (
                    e.experts,
                    e.experts_per_token,
                    e.expert_width,
                    e.routed_layers
                ),
                (8, 2, 32, 2)
            );
            assert_eq!(e.active_parameters, info.parameters - 2 * 6 * 3 * 64 * 32);
        }
    }
}

/// The tiny GPT-OSS (MXFP4 experts, sinks, sliding window, YaRN) on the fast CPU path (its
/// tiled prefill and per-head decode attention with sinks, the SIMD products of the f32
/// attention weights and of the MXFP4 experts with activations in two 8-bit parts), against the
/// transformers golden; and decode token by token against the same golden. Measured 5.8e-4 both
/// ways, before and after the experts' SIMD kernel (logits spread ~0.4; the reference path is
/// within 2e-6); 3e-3 leaves room for other vector units and catches a misplaced sink.
#[test]
fn gpt_oss_fast_path_matches_transformers() {
    let dir = fixtures().join("tiny").join("tiny-gpt-oss");
    let model = Model::load(&dir).unwrap();
    let max_err = max_logit_error(&model, &dir.join("golden.json"));
    eprintln!("tiny-gpt-oss (fast path): max |Δ| over all logits {max_err:.2e}");
    assert!(max_err < 3e-3, "fast path: max logit error {max_err}");
    let g = load_json(&dir.join("golden.json"));
    let ids = ids_of(&g["ids"]);
    let mut s = model.session(0);
    let mut worst = 0f32;
    for (t, &id) in ids.iter().enumerate() {
        let l = s.prefill(&[id]).unwrap();
        let want: Vec<f32> = g["logits"][t]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        worst = worst.max(max_diff(&l, &want));
    }
    eprintln!("tiny-gpt-oss (fast path, token by token): max |Δ| {worst:.2e}");
    assert!(worst < 3e-3, "fast decode: max logit error {worst}");
    // inspect: the family, its experts (4 of width 32, top 2, both layers routed: 2 unused
    // experts of 3·64·32 per layer), the MXFP4 experts counted as values, not bytes.
    let info = model.info();
    assert_eq!(info.architecture, "gpt-oss");
    assert_eq!(info.sliding_window, Some(4));
    let e = info.experts.expect("experts in inspect");
    assert_eq!(
        (
            e.experts,
            e.experts_per_token,
            e.expert_width,
            e.routed_layers
        ),
        (4, 2, 32, 2)
    );
    let mxfp4 = info.tensor_types.get("MXFP4").expect("MXFP4 experts");
    // Per layer: gate_up (4·64·64) and down (4·64·32) values.
    assert_eq!(*mxfp4, (4, 2 * (4 * 64 * 64 + 4 * 64 * 32)));
    assert_eq!(e.active_parameters, info.parameters - 2 * 2 * 3 * 64 * 32);
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A cache's prefix copy resumes as the cache itself would: the logits after feeding the rest
/// of the tokens to the copy equal those of the full run (every tiny family, Gemma 4's
/// KV-shared layers, whose own caches stay empty, included), with both cache types.
#[test]
fn cache_prefix_copy_resumes_every_tiny_family() {
    use hf2q_models::BatchItem;
    let ids: Vec<u32> = (0..12)
        .map(|i| 256 + (i * 41 % 250))
        .map(|x| x % 259)
        .collect();
    for name in TINY {
        let mut model = reference(Model::load(&fixtures().join("tiny").join(name)).unwrap());
        for kv in [KvType::F32, KvType::F16] {
            model.set_kv_type(kv);
            let mut full = model.new_cache(64);
            let want = model
                .step_batch(&mut [BatchItem {
                    cache: &mut full,
                    pos0: 0,
                    tokens: &ids,
                }])
                .unwrap();
            let mut copy = full.prefix(7, 64).unwrap();
            let got = model
                .step_batch(&mut [BatchItem {
                    cache: &mut copy,
                    pos0: 7,
                    tokens: &ids[7..],
                }])
                .unwrap();
            let d = max_diff(&got[0], &want[0]);
            assert!(d < 1e-5, "{name} {kv:?}: prefix copy differs by {d}");
        }
    }
}

fn cache_consistency(model: &Model, ids: &[u32], tol: f32) -> f32 {
    let full = model.session(0).forward_all(ids).unwrap();
    let mut s = model.session(0);
    // Mixed chunking: a prefill of 3, then single tokens, then a chunk of the rest.
    let mut worst = 0f32;
    let mut pos = 0;
    let chunks: Vec<usize> = {
        let mut v = vec![3.min(ids.len())];
        let mut left = ids.len() - v[0];
        for _ in 0..5 {
            if left == 0 {
                break;
            }
            v.push(1);
            left -= 1;
        }
        if left > 0 {
            v.push(left);
        }
        v
    };
    for n in chunks {
        let l = s.prefill(&ids[pos..pos + n]).unwrap();
        pos += n;
        worst = worst.max(max_diff(&l, full.row(pos - 1)));
    }
    assert!(worst <= tol, "prefill vs decode logits differ by {worst}");
    worst
}

#[test]
fn cache_consistency_every_tiny_family() {
    for name in TINY {
        let mut model = reference(Model::load(&fixtures().join("tiny").join(name)).unwrap());
        let ids: Vec<u32> = (0..14)
            .map(|i| 256 + (i * 37 % 250))
            .map(|x| x % 259)
            .collect();
        // Same arithmetic in a different grouping of tokens: differences are summation noise.
        // An f16 cache too: prefill and decode read the same stored (rounded) values.
        for kv in [KvType::F32, KvType::F16] {
            model.set_kv_type(kv);
            let w = cache_consistency(&model, &ids, 1e-4);
            eprintln!("{name} ({kv:?} cache): cache consistency max |Δ| {w:.2e}");
        }
    }
}

#[test]
fn cache_consistency_real_models() {
    for var in [
        "HF2Q_TEST_SMOLLM2_GGUF",
        "HF2Q_TEST_GEMMA3_GGUF",
        "HF2Q_TEST_QWEN25_GGUF",
    ] {
        let Some(mut model) = model_from_env(var) else {
            continue;
        };
        let ids = model
            .tokenizer()
            .encode(
                "The quick brown fox jumps over the lazy dog. 1234",
                true,
                false,
            )
            .unwrap();
        for kv in [KvType::F32, KvType::F16] {
            model.set_kv_type(kv);
            let w = cache_consistency(&model, &ids, 1e-3);
            eprintln!("{var} ({kv:?} cache): cache consistency max |Δ| {w:.2e}");
        }
    }
}

#[test]
fn batched_step_equals_separate_sequences() {
    use hf2q_models::BatchItem;
    // Both cache types: the batched and separate forwards store and read the same values.
    for (name, kv) in TINY
        .iter()
        .flat_map(|n| [(n, KvType::F32), (n, KvType::F16)])
    {
        let mut model = reference(Model::load(&fixtures().join("tiny").join(name)).unwrap());
        model.set_kv_type(kv);
        let prompts: [&[u32]; 3] = [
            &[256, 70, 71, 72, 73, 74, 75],
            &[256, 100],
            &[256, 90, 91, 92, 93],
        ];
        // Reference: each sequence alone, prompt then one decode step.
        let mut want = Vec::new();
        for p in prompts {
            let mut s = model.session(64);
            let a = s.prefill(p).unwrap();
            let b = s.decode(80).unwrap();
            want.push((a, b));
        }
        // Batched: all prompts in one forward, then all decode steps in one forward.
        let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache(64)).collect();
        let mut items: Vec<BatchItem> = caches
            .iter_mut()
            .zip(prompts)
            .map(|(c, p)| BatchItem {
                cache: c,
                pos0: 0,
                tokens: p,
            })
            .collect();
        let first = model.step_batch(&mut items).unwrap();
        let step: [u32; 1] = [80];
        let mut items: Vec<BatchItem> = caches
            .iter_mut()
            .zip(prompts)
            .map(|(c, p)| BatchItem {
                cache: c,
                pos0: p.len(),
                tokens: &step,
            })
            .collect();
        let second = model.step_batch(&mut items).unwrap();
        for i in 0..3 {
            // Identical arithmetic per row: batching must not change a single bit beyond noise.
            assert!(
                max_diff(&first[i], &want[i].0) < 1e-5,
                "{name} {kv:?}: seq {i} prefill"
            );
            assert!(
                max_diff(&second[i], &want[i].1) < 1e-5,
                "{name} {kv:?}: seq {i} decode"
            );
        }
    }
}

/// The fast CPU path (SIMD kernels, activations in two 8-bit parts) against the reference path
/// on the golden texts: teacher-forced argmax agreement >= 98/100 and mean KL(reference || fast)
/// <= 1e-3, the gate every fast path (CPU or GPU) must meet, with the default f16 KV cache and
/// with an f32 one (the reference keeps f32). Measured: 100/100 on all three, mean KL with f16
/// 3.5e-7 (SmolLM2), 2.8e-6 (Gemma 3), 1.5e-6 (Qwen2.5); with f32 7e-8, 1.7e-7, 1.3e-8.
#[test]
fn fast_path_gate() {
    let names = ["smollm2", "gemma3", "qwen25"];
    fast_path_check(
        &names,
        MatmulPath::Fast,
        &[KvType::F16, KvType::F32],
        98,
        1e-3,
    );
}

/// The 8-bit-activation path (`--matmul fast8`, llama.cpp's rounding) is below the gate by
/// design; this keeps it from getting worse, in its shipped configuration (f16 KV cache):
/// SmolLM2 measures 97-99/100 (near-ties flip with 1e-6 changes elsewhere, e.g. the attention
/// kernel) and mean KL 2.6e-3..3.0e-3, with either cache type (the f16 rounding's share is about
/// 3e-7, see `fast_path_gate`).
#[test]
fn fast8_path_regression_smollm2() {
    fast_path_check(&["smollm2"], MatmulPath::Fast8, &[KvType::F16], 95, 5e-3);
}

/// `path` with each cache type of `kvs` against the reference (reference matmul, f32 cache).
fn fast_path_check(
    names: &[&str],
    path: MatmulPath,
    kvs: &[KvType],
    min_agree: usize,
    max_kl: f64,
) {
    for (name, var) in [
        ("smollm2", "HF2Q_TEST_SMOLLM2_GGUF"),
        ("gemma3", "HF2Q_TEST_GEMMA3_GGUF"),
        ("qwen25", "HF2Q_TEST_QWEN25_GGUF"),
    ] {
        if !names.contains(&name) {
            continue;
        }
        let Some(mut model) = model_from_env(var) else {
            continue;
        };
        let g = load_json(&fixtures().join(format!("goldens/{name}.json")));
        let ids = ids_of(&g["ids"]);
        let want = model.session(ids.len()).forward_all(&ids).unwrap();
        model.set_matmul_path(path);
        for &kv in kvs {
            model.set_kv_type(kv);
            let got = model.session(ids.len()).forward_all(&ids).unwrap();
            let first = ids.len() - 100;
            let (mut agree, mut kl_sum) = (0usize, 0f64);
            for pos in first..ids.len() {
                let (p, q) = (want.row(pos), got.row(pos));
                if argmax(p) == argmax(q) {
                    agree += 1;
                }
                kl_sum += kl(p, q);
            }
            let kl_mean = kl_sum / 100.0;
            eprintln!(
                "{name}: {path:?} {kv:?} vs reference argmax {agree}/100, mean KL {kl_mean:.2e}"
            );
            assert!(
                agree >= min_agree,
                "{name}: {path:?} {kv:?} argmax agreement {agree}/100"
            );
            assert!(
                kl_mean <= max_kl,
                "{name}: {path:?} {kv:?} mean KL {kl_mean}"
            );
            // The same 100 positions decoded one token at a time (the one-token kernels and the
            // decode attention), after a prefill of the rest on the same path.
            let mut s = model.session(ids.len());
            s.prefill(&ids[..first]).unwrap();
            let (mut agree, mut kl_sum) = (0usize, 0f64);
            for pos in first..ids.len() {
                let q = s.prefill(&ids[pos..pos + 1]).unwrap();
                let p = want.row(pos);
                if argmax(p) == argmax(&q) {
                    agree += 1;
                }
                kl_sum += kl(p, &q);
            }
            let kl_mean = kl_sum / 100.0;
            eprintln!("{name}: {path:?} {kv:?} decode vs reference argmax {agree}/100, mean KL {kl_mean:.2e}");
            assert!(
                agree >= min_agree,
                "{name}: {path:?} {kv:?} decode argmax agreement {agree}/100"
            );
            assert!(
                kl_mean <= max_kl,
                "{name}: {path:?} {kv:?} decode mean KL {kl_mean}"
            );
        }
    }
}
