//! Mixtures of experts through `convert` and `quantize` on the committed tiny checkpoints
//! (Qwen3-MoE with a dense layer, Mixtral; transformers 5.17, f32, with golden logits):
//!
//! - HF -> GGUF writes llama.cpp's layout: the Qwen3-MoE output equals, tensor for tensor and
//!   byte for byte, the GGUF that gguf-py wrote in llama.cpp's layout from the same folder
//!   (`scripts/fixtures/gen_moe_gguf.py`), with the MoE keys llama.cpp's loader reads;
//! - GGUF -> HF writes the per-expert tensors the checkpoints ship (and transformers 5 loads);
//! - both directions keep the golden logits (f32 throughout: the tiny checkpoints' 1e-4);
//! - quantize keeps llama.cpp's per-tensor rules for stacked experts and the router, Q8_0
//!   stays near the f32 golden, and an imatrix row per expert weights that expert alone.

use std::path::{Path, PathBuf};

use hf2q_cpu::MatmulPath;
use hf2q_models::convert::hf_out::HfOptions;
use hf2q_models::convert::source::SourceModel;
use hf2q_models::convert::{convert, ConvertTarget, NoProgress};
use hf2q_models::quantize::presets::QuantTarget;
use hf2q_models::quantize::{quantize, QuantizeOptions};
use hf2q_models::Model;
use hf2q_tensor::io::gguf::GgufFile;
use hf2q_tensor::io::safetensors::StDtype;
use hf2q_tensor::kv::KvType;
use hf2q_tensor::GgmlType;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn tiny(name: &str) -> PathBuf {
    fixtures().join("tiny").join(name)
}

/// Largest |logit - golden| over every position of the fixture's golden ids, on the reference
/// matmul with an f32 KV cache (as the parity tests measure).
fn max_logit_error(path: &Path, golden: &Path) -> f32 {
    let mut model = Model::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    model.set_matmul_path(MatmulPath::Reference);
    model.set_kv_type(KvType::F32);
    let g: Value = serde_json::from_str(&std::fs::read_to_string(golden).unwrap()).unwrap();
    let ids: Vec<u32> = g["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let logits = model.session(0).forward_all(&ids).unwrap();
    let mut max_err = 0f32;
    for (t, row) in g["logits"].as_array().unwrap().iter().enumerate() {
        for (v, want) in logits.row(t).iter().zip(row.as_array().unwrap()) {
            max_err = max_err.max((v - want.as_f64().unwrap() as f32).abs());
        }
    }
    max_err
}

fn to_gguf(src: &Path, out: &Path) {
    let s = SourceModel::open(src).unwrap();
    convert(&s, out, &ConvertTarget::Gguf(None), &NoProgress).unwrap();
}

fn to_hf(src: &Path, out: &Path) {
    let s = SourceModel::open(src).unwrap();
    let o = HfOptions {
        dtype: Some(StDtype::F32),
        ..Default::default()
    };
    convert(&s, out, &ConvertTarget::Hf(o), &NoProgress).unwrap();
}

fn quantize_to(src: &Path, ty: &str, out: &Path) -> hf2q_models::Result<()> {
    let s = SourceModel::open(src)?;
    let opts = QuantizeOptions {
        target: QuantTarget::parse(ty, None)?,
        overrides: Default::default(),
        imatrix: None,
    };
    quantize(&s, out, &opts, &NoProgress).map(|_| ())
}

fn ty(g: &GgufFile, name: &str) -> GgmlType {
    g.tensor(name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
        .ty
}

fn safetensors_names(dir: &Path) -> Vec<String> {
    let idx: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let mut v: Vec<String> = idx["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    v.sort();
    v
}

#[test]
fn qwen3_moe_hf_to_gguf_is_llama_cpp_layout_and_back() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny("tiny-qwen3-moe");
    let golden = src.join("golden.json");
    let gguf = dir.path().join("q.gguf");
    to_gguf(&src, &gguf);

    // Tensor for tensor what gguf-py wrote in llama.cpp's layout from the same folder.
    let ours = GgufFile::open(&gguf).unwrap();
    let theirs = GgufFile::open(&fixtures().join("moe/tiny-qwen3-moe.gguf")).unwrap();
    assert_eq!(ours.tensors.len(), theirs.tensors.len());
    for t in &theirs.tensors {
        let o = ours
            .tensor(&t.name)
            .unwrap_or_else(|| panic!("no {}", t.name));
        assert_eq!((&o.dims, o.ty), (&t.dims, t.ty), "{}", t.name);
        let (a, b) = (ours.tensor_data(o).unwrap(), theirs.tensor_data(t).unwrap());
        assert!(a.as_slice() == b.as_slice(), "{}: bytes differ", t.name);
    }
    for k in [
        "qwen3moe.expert_count",
        "qwen3moe.expert_used_count",
        "qwen3moe.expert_feed_forward_length",
        "qwen3moe.feed_forward_length",
    ] {
        assert_eq!(ours.get_u64(k), theirs.get_u64(k), "{k}");
    }
    assert_eq!(ours.get_str("general.architecture"), Some("qwen3moe"));
    drop((ours, theirs));
    let e = max_logit_error(&gguf, &golden);
    assert!(e < 1e-4, "HF -> GGUF: max logit error {e}");

    // GGUF -> HF: the per-expert tensors of the checkpoint, router and dense layer as they were.
    let hf = dir.path().join("hf");
    to_hf(&gguf, &hf);
    let names = safetensors_names(&hf);
    for n in [
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.experts.7.down_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ] {
        assert!(names.iter().any(|x| x == n), "{n} missing: {names:?}");
    }
    assert!(!names.iter().any(|x| x.contains("experts.gate_proj")));
    let want = safetensors_names_of_fixture(&src);
    assert_eq!(names, want, "the fixture's own tensor names");
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "qwen3_moe");
    assert_eq!(cfg["mlp_only_layers"], serde_json::json!([1]));
    let e = max_logit_error(&hf, &golden);
    assert!(e < 1e-4, "GGUF -> HF: max logit error {e}");
}

/// The tensor names of a single-file safetensors fixture.
fn safetensors_names_of_fixture(dir: &Path) -> Vec<String> {
    let st =
        hf2q_tensor::io::safetensors::SafeTensors::open(&dir.join("model.safetensors")).unwrap();
    let mut v: Vec<String> = st.tensors.iter().map(|t| t.name.clone()).collect();
    v.sort();
    v
}

#[test]
fn mixtral_hf_to_gguf_and_back() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny("tiny-mixtral");
    let golden = src.join("golden.json");
    let gguf = dir.path().join("m.gguf");
    to_gguf(&src, &gguf);
    let g = GgufFile::open(&gguf).unwrap();
    assert_eq!(g.get_str("general.architecture"), Some("llama"));
    assert_eq!(g.get_u64("llama.expert_count"), Some(4));
    assert_eq!(g.get_u64("llama.expert_used_count"), Some(2));
    assert_eq!(g.get_u64("llama.feed_forward_length"), Some(48));
    assert_eq!(g.get_u64("llama.expert_feed_forward_length"), None);
    for l in 0..2 {
        let d = |n: &str| {
            g.tensor(&format!("blk.{l}.{n}.weight"))
                .unwrap()
                .dims
                .clone()
        };
        assert_eq!(d("ffn_gate_exps"), [64, 48, 4]);
        assert_eq!(d("ffn_up_exps"), [64, 48, 4]);
        assert_eq!(d("ffn_down_exps"), [48, 64, 4]);
        assert_eq!(d("ffn_gate_inp"), [64, 4]);
        assert!(g.tensor(&format!("blk.{l}.ffn_down.weight")).is_none());
    }
    drop(g);
    let e = max_logit_error(&gguf, &golden);
    assert!(e < 1e-4, "HF -> GGUF: max logit error {e}");
    let hf = dir.path().join("hf");
    to_hf(&gguf, &hf);
    assert_eq!(
        safetensors_names(&hf),
        safetensors_names_of_fixture(&src),
        "the fixture's own tensor names (block_sparse_moe.experts.E.w1/w3/w2, gate)"
    );
    let e = max_logit_error(&hf, &golden);
    assert!(e < 1e-4, "GGUF -> HF: max logit error {e}");
}

#[test]
fn quantized_experts_follow_llama_cpp_rules() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny("tiny-qwen3-moe");
    let golden = src.join("golden.json");
    use GgmlType as G;

    // Q4_K_M on the tiny Qwen3-MoE (D 64, F_e 32, dense F 128, 8 experts, 2 layers). Rows of
    // 64 or 32 hold no 256-block, so k-quants fall back as llama.cpp's do (Q4_K -> Q5_0,
    // Q5_K -> Q5_1, Q6_K -> Q8_0); 8 experts bring llama.cpp's 8-expert bumps (attn_v and
    // attn_k Q8_0, attn_output Q5_K); ffn_down follows use_more_bits by layer (layer 1 of 2).
    let q4 = dir.path().join("q4.gguf");
    quantize_to(&src, "Q4_K_M", &q4).unwrap();
    let g = GgufFile::open(&q4).unwrap();
    for (name, want) in [
        ("token_embd.weight", G::Q5_0),
        ("output.weight", G::Q8_0),
        ("blk.0.ffn_gate_inp.weight", G::F32),
        ("blk.0.ffn_gate_exps.weight", G::Q5_0),
        ("blk.0.ffn_up_exps.weight", G::Q5_0),
        ("blk.0.ffn_down_exps.weight", G::Q5_0),
        ("blk.1.ffn_down.weight", G::Q8_0),
        ("blk.1.ffn_gate.weight", G::Q5_0),
        ("blk.0.attn_v.weight", G::Q8_0),
        ("blk.0.attn_k.weight", G::Q8_0),
        ("blk.0.attn_output.weight", G::Q5_1),
        ("blk.0.attn_q.weight", G::Q5_0),
        ("blk.0.attn_norm.weight", G::F32),
    ] {
        assert_eq!(ty(&g, name), want, "Q4_K_M {name}");
    }
    drop(g);
    // Quantizing the f32 GGUF (llama.cpp's layout) chooses the same types.
    let q4g = dir.path().join("q4g.gguf");
    quantize_to(&fixtures().join("moe/tiny-qwen3-moe.gguf"), "Q4_K_M", &q4g).unwrap();
    let (a, b) = (GgufFile::open(&q4).unwrap(), GgufFile::open(&q4g).unwrap());
    for t in &a.tensors {
        assert_eq!(t.ty, ty(&b, &t.name), "{}", t.name);
    }
    drop((a, b));
    let e4 = max_logit_error(&q4, &golden);

    // Q8_0: every weight Q8_0 (the output too), the router and norms F32.
    let q8 = dir.path().join("q8.gguf");
    quantize_to(&src, "Q8_0", &q8).unwrap();
    let g = GgufFile::open(&q8).unwrap();
    for t in &g.tensors {
        let want = if t.dims.len() == 1 || t.name.contains("ffn_gate_inp") {
            G::F32
        } else {
            G::Q8_0
        };
        assert_eq!(t.ty, want, "Q8_0 {}", t.name);
    }
    drop(g);
    let e8 = max_logit_error(&q8, &golden);
    // The dense tiny Qwen3 (same widths, an MLP in place of the experts) at Q8_0, for scale.
    let dense = tiny("tiny-qwen3");
    let q8d = dir.path().join("q8d.gguf");
    quantize_to(&dense, "Q8_0", &q8d).unwrap();
    let e8d = max_logit_error(&q8d, &dense.join("golden.json"));
    eprintln!(
        "tiny-qwen3-moe: max |Δ logit| Q8_0 {e8:.2e}, Q4_K_M {e4:.2e}; dense tiny-qwen3 Q8_0 {e8d:.2e}"
    );
    // Q8_0 rounds each weight to 1/254 of its 32-block's range: about 0.7% of these random
    // weights' scale, from the embeddings through every product to the output, so the largest
    // of 20 x 259 logits (std 0.43) moves by a few 1e-2, as the dense model's does (measured:
    // 2.6e-2 with experts, 3.1e-2 dense; Q4_K_M 0.18). 0.05 is the bound the dense Q8_0 test
    // holds.
    assert!(e8 < 0.05, "Q8_0 max logit error {e8}");
    assert!(
        e8 < 3.0 * e8d.max(1e-3),
        "experts at Q8_0 ({e8}) far worse than a dense model's ({e8d})"
    );
    assert!(e4 > e8, "Q4_K_M should be coarser than Q8_0");
}

#[test]
fn mixtral_quantized_rows_fall_back_or_refuse_as_llama_cpp() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny("tiny-mixtral");
    use GgmlType as G;
    // Q4_K_M: ffn_down_exps rows of 48 hold neither a 256- nor a 32-block: F16, as llama.cpp
    // falls back; 4 experts: no 8-expert bumps.
    let q4 = dir.path().join("q4.gguf");
    quantize_to(&src, "Q4_K_M", &q4).unwrap();
    let g = GgufFile::open(&q4).unwrap();
    for (name, want) in [
        ("blk.0.ffn_down_exps.weight", G::F16),
        ("blk.1.ffn_down_exps.weight", G::F16),
        ("blk.0.ffn_gate_exps.weight", G::Q5_0),
        ("blk.0.ffn_gate_inp.weight", G::F32),
        ("blk.0.attn_k.weight", G::Q5_0),
        ("blk.0.attn_output.weight", G::Q5_0),
    ] {
        assert_eq!(ty(&g, name), want, "Q4_K_M {name}");
    }
    drop(g);
    let e = max_logit_error(&q4, &tiny("tiny-mixtral").join("golden.json"));
    assert!(e.is_finite() && e < 0.5, "Q4_K_M runs: max logit error {e}");
    // Q8_0 has no fallback type: llama.cpp refuses rows of 48, and so does hf2q, naming the
    // tensor.
    let err = quantize_to(&src, "Q8_0", &dir.path().join("q8.gguf")).unwrap_err();
    assert!(err.to_string().contains("ffn_down_exps"), "{err}");
}

/// llama.cpp's imatrix entries for stacked experts hold one row of importance per expert
/// (`ne0 · E` values, E counts): each expert's rows are quantized with its own row.
#[test]
fn per_expert_imatrix_rows_weight_their_own_expert() {
    use hf2q_models::quantize::imatrix::{Imatrix, ImatrixEntry};
    use std::collections::BTreeMap;
    let dir = tempfile::tempdir().unwrap();
    let src = SourceModel::open(&tiny("tiny-qwen3-moe")).unwrap();
    let name = "blk.0.ffn_gate_exps.weight";
    let (d, e) = (64usize, 8usize);
    let run = |skew: Option<usize>, out: &Path| -> Vec<u8> {
        let mut sums = vec![1f32; d * e];
        if let Some(x) = skew {
            // Expert x: the first columns matter a thousand times more.
            sums[x * d..x * d + 8].iter_mut().for_each(|v| *v = 1000.0);
        }
        let entry = ImatrixEntry {
            sums,
            counts: vec![1.0; e],
        };
        let m = Imatrix::new(BTreeMap::from([(name.to_string(), entry)]), vec![], 1, 16);
        let opts = QuantizeOptions {
            target: QuantTarget::parse("Q4_K_M", None).unwrap(),
            overrides: Default::default(),
            imatrix: Some(m),
        };
        let r = quantize(&src, out, &opts, &NoProgress).unwrap();
        assert_eq!(r.imatrix_used, 1);
        let g = GgufFile::open(out).unwrap();
        let t = g.tensor(name).unwrap();
        g.tensor_data(t).unwrap().as_slice().to_vec()
    };
    let flat = run(None, &dir.path().join("a.gguf"));
    let skewed = run(Some(5), &dir.path().join("b.gguf"));
    let per = flat.len() / e;
    for x in 0..e {
        let same = flat[x * per..(x + 1) * per] == skewed[x * per..(x + 1) * per];
        assert_eq!(same, x != 5, "expert {x}");
    }
    // An entry of another length (7 experts' rows) is refused, naming the tensor.
    let entry = ImatrixEntry {
        sums: vec![1.0; d * 7],
        counts: vec![1.0; 7],
    };
    let opts = QuantizeOptions {
        target: QuantTarget::parse("Q4_K_M", None).unwrap(),
        overrides: Default::default(),
        imatrix: Some(Imatrix::new(
            BTreeMap::from([(name.to_string(), entry)]),
            vec![],
            1,
            16,
        )),
    };
    let err = quantize(&src, &dir.path().join("c.gguf"), &opts, &NoProgress).unwrap_err();
    assert!(err.to_string().contains(name), "{err}");
}

/// Gemma 4 to GGUF is refused with a message naming the family, and no file is left behind:
/// its per-layer keys are not written yet, and a file without them would not load as the model.
#[test]
fn gemma4_to_gguf_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("g4.gguf");
    let src = SourceModel::open(&tiny("tiny-gemma4")).unwrap();
    let err = convert(&src, &out, &ConvertTarget::Gguf(None), &NoProgress)
        .expect_err("Gemma 4 to GGUF must be refused")
        .to_string();
    assert!(err.contains("Gemma 4"), "{err}");
    assert!(!out.exists());
}

/// llama.cpp's `MXFP4_MOE` on a float mixture of experts: the stacked experts quantized to
/// MXFP4 (ggml's reference quantizer), every other weight and the output Q8_0, the router and
/// norms F32, `general.file_type` 38; the model runs from the file near its golden.
#[test]
fn qwen3_moe_mxfp4_moe() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny("tiny-qwen3-moe");
    let out = dir.path().join("mxfp4.gguf");
    quantize_to(&src, "MXFP4_MOE", &out).unwrap();
    let g = GgufFile::open(&out).unwrap();
    assert_eq!(g.get_u64("general.file_type"), Some(38));
    for t in &g.tensors {
        let want = if t.name.contains("_exps") {
            GgmlType::MXFP4
        } else if t.dims.len() == 1 || t.name.contains("ffn_gate_inp") {
            GgmlType::F32
        } else {
            GgmlType::Q8_0
        };
        assert_eq!(t.ty, want, "{}", t.name);
    }
    let e = max_logit_error(&out, &src.join("golden.json"));
    eprintln!("tiny-qwen3-moe MXFP4_MOE: max |Δ logit| {e:.2e}");
    // MXFP4 keeps one mantissa bit under a power-of-two scale per 32 (a step of up to a sixth
    // of a block's largest value), on the experts only; the rest is Q8_0 (2.6e-2 on its own,
    // above), Q4_K_M 0.18. Measured 7.6e-2; the bound is between two and three times that.
    assert!(e < 0.2, "MXFP4_MOE max logit error {e}");
}
