//! GPT-OSS to GGUF in llama.cpp's `gpt-oss` layout (its `convert_hf_to_gguf.py` `GptOssModel`
//! and `gguf-py` constants are the reference): the tiny checkpoint converted by hf2q gives the
//! transformers golden's logits from the file (the golden test's tolerance), its tensors carry
//! llama.cpp's names, types and dims (experts kept as MXFP4, ggml type 39, gate and up apart,
//! bytes equal to an independent repacking of the checkpoint's blocks), its metadata llama.cpp's
//! keys. Back to a Hugging Face folder (transformers' MXFP4 layout) and through GGUF again every
//! tensor's bytes come back; quantized, the experts stay MXFP4 (copied) and the logits stay near
//! the source's.

use std::path::{Path, PathBuf};

use hf2q_models::convert::hf_out::HfOptions;
use hf2q_models::convert::source::SourceModel;
use hf2q_models::convert::{convert, ConvertTarget, NoProgress};
use hf2q_models::Model;
use hf2q_tensor::io::gguf::{GgufFile, GgufValue};
use hf2q_tensor::io::safetensors::SafeTensors;
use hf2q_tensor::GgmlType;
use serde_json::Value;

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/tiny-gpt-oss")
}

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(tiny().join("golden.json")).unwrap()).unwrap()
}

fn golden_ids() -> Vec<u32> {
    golden()["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Reference-path logits of `path` over `ids`, row after row.
fn logits(path: &Path, ids: &[u32]) -> Vec<f32> {
    let mut m = Model::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    m.set_matmul_path(hf2q_cpu::MatmulPath::Reference);
    m.set_kv_type(hf2q_tensor::kv::KvType::F32);
    m.session(ids.len()).forward_all(ids).unwrap().into_data()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn to_gguf(dir: &Path) -> PathBuf {
    let src = SourceModel::open(&tiny()).unwrap();
    let out = dir.join("tiny-gpt-oss.gguf");
    convert(&src, &out, &ConvertTarget::Gguf(None), &NoProgress).unwrap();
    out
}

/// The checkpoint's MXFP4 `(E, R, C/32, 16)` blocks and `(E, R, C/32)` scales as ggml blocks,
/// written out as llama.cpp's `transform_nibble_layout` does it: each block's scale byte, then
/// 16 bytes whose low nibbles are values 0..16 and high nibbles 16..32 (the checkpoint packs
/// values `2k` and `2k + 1` into byte `k`). `rows` picks the rows of each expert.
fn ggml_mxfp4(
    blocks: &[u8],
    scales: &[u8],
    e: usize,
    r: usize,
    g: usize,
    rows: &[usize],
) -> Vec<u8> {
    let mut out = Vec::new();
    for ex in 0..e {
        for &row in rows {
            for b in 0..g {
                let at = (ex * r + row) * g + b;
                out.push(scales[at]);
                let q = &blocks[at * 16..at * 16 + 16];
                let val = |i: usize| (q[i / 2] >> (4 * (i % 2))) & 0xF;
                for j in 0..16 {
                    out.push(val(j) | (val(j + 16) << 4));
                }
            }
        }
    }
    out
}

#[test]
fn hf_to_gguf_matches_the_golden_in_llama_cpp_layout() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = to_gguf(dir.path());
    let f = GgufFile::open(&gguf).unwrap();

    // Metadata: llama.cpp's keys for the family.
    assert_eq!(f.architecture(), Some("gpt-oss"));
    for (k, want) in [
        ("gpt-oss.block_count", 2),
        ("gpt-oss.embedding_length", 64),
        ("gpt-oss.feed_forward_length", 32),
        ("gpt-oss.expert_feed_forward_length", 32),
        ("gpt-oss.expert_count", 4),
        ("gpt-oss.expert_used_count", 2),
        ("gpt-oss.attention.head_count", 4),
        ("gpt-oss.attention.head_count_kv", 2),
        ("gpt-oss.attention.key_length", 16),
        ("gpt-oss.attention.sliding_window", 4),
        ("gpt-oss.rope.scaling.original_context_length", 64),
        ("gpt-oss.context_length", 256),
    ] {
        assert_eq!(f.get_u64(k), Some(want), "{k}");
    }
    assert_eq!(f.get_str("gpt-oss.rope.scaling.type"), Some("yarn"));
    for (k, want) in [
        ("gpt-oss.rope.scaling.factor", 4.0),
        ("gpt-oss.rope.scaling.yarn_beta_fast", 32.0),
        ("gpt-oss.rope.scaling.yarn_beta_slow", 1.0),
        ("gpt-oss.rope.freq_base", 150000.0),
    ] {
        assert_eq!(f.get_f32(k), Some(want), "{k}");
    }
    // YaRN's default attention factor is derived, not written (as llama.cpp's converter).
    assert!(f.get_f32("gpt-oss.rope.scaling.yarn_attn_factor").is_none());

    // Tensors: llama.cpp's names, ggml dims (ne0 first) and types.
    let (d, f_e, e, h) = (64u64, 32u64, 4u64, 4u64);
    let want: Vec<(String, Vec<u64>, GgmlType)> = {
        let mut w = vec![
            ("token_embd.weight".to_string(), vec![d, 259], GgmlType::F32),
            ("output_norm.weight".to_string(), vec![d], GgmlType::F32),
            ("output.weight".to_string(), vec![d, 259], GgmlType::F32),
        ];
        for l in 0..2 {
            let b = |n: &str| format!("blk.{l}.{n}");
            w.extend([
                (b("attn_norm.weight"), vec![d], GgmlType::F32),
                (b("post_attention_norm.weight"), vec![d], GgmlType::F32),
                (b("attn_q.weight"), vec![d, 64], GgmlType::F32),
                (b("attn_q.bias"), vec![64], GgmlType::F32),
                (b("attn_k.weight"), vec![d, 32], GgmlType::F32),
                (b("attn_k.bias"), vec![32], GgmlType::F32),
                (b("attn_v.weight"), vec![d, 32], GgmlType::F32),
                (b("attn_v.bias"), vec![32], GgmlType::F32),
                (b("attn_output.weight"), vec![64, d], GgmlType::F32),
                (b("attn_output.bias"), vec![d], GgmlType::F32),
                (b("attn_sinks.weight"), vec![h], GgmlType::F32),
                (b("ffn_gate_inp.weight"), vec![d, e], GgmlType::F32),
                (b("ffn_gate_inp.bias"), vec![e], GgmlType::F32),
                (b("ffn_gate_exps.weight"), vec![d, f_e, e], GgmlType::MXFP4),
                (b("ffn_up_exps.weight"), vec![d, f_e, e], GgmlType::MXFP4),
                (b("ffn_down_exps.weight"), vec![f_e, d, e], GgmlType::MXFP4),
                (b("ffn_gate_exps.bias"), vec![f_e, e], GgmlType::F32),
                (b("ffn_up_exps.bias"), vec![f_e, e], GgmlType::F32),
                (b("ffn_down_exps.bias"), vec![d, e], GgmlType::F32),
            ]);
        }
        w
    };
    let names: Vec<&str> = f.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(f.tensors.len(), want.len(), "tensor count: {names:?}");
    for (name, dims, ty) in &want {
        let t = f
            .tensor(name)
            .unwrap_or_else(|| panic!("{name} missing from the GGUF"));
        assert_eq!(&t.dims, dims, "{name}");
        assert_eq!(t.ty, *ty, "{name}");
    }
    assert_eq!(GgmlType::MXFP4.id(), 39);

    // The experts' bytes: an independent repacking of the checkpoint's blocks (gate rows are
    // the even rows of gate_up, up rows the odd ones).
    let st = SafeTensors::open(&tiny().join("model.safetensors")).unwrap();
    let raw = |n: &str| {
        let info = st.tensor(n).unwrap_or_else(|| panic!("{n}"));
        (
            st.tensor_data(info).unwrap().as_slice().to_vec(),
            info.shape.clone(),
        )
    };
    for l in 0..2 {
        let p = format!("model.layers.{l}.mlp.experts");
        let (gb, gshape) = raw(&format!("{p}.gate_up_proj_blocks"));
        let (gs, _) = raw(&format!("{p}.gate_up_proj_scales"));
        let (e, r, g) = (gshape[0], gshape[1], gshape[2]);
        let even: Vec<usize> = (0..r).step_by(2).collect();
        let odd: Vec<usize> = (1..r).step_by(2).collect();
        let (db, dshape) = raw(&format!("{p}.down_proj_blocks"));
        let (ds, _) = raw(&format!("{p}.down_proj_scales"));
        let all: Vec<usize> = (0..dshape[1]).collect();
        for (name, bytes) in [
            ("ffn_gate_exps", ggml_mxfp4(&gb, &gs, e, r, g, &even)),
            ("ffn_up_exps", ggml_mxfp4(&gb, &gs, e, r, g, &odd)),
            (
                "ffn_down_exps",
                ggml_mxfp4(&db, &ds, e, dshape[1], dshape[2], &all),
            ),
        ] {
            let t = f.tensor(&format!("blk.{l}.{name}.weight")).unwrap();
            assert!(
                f.tensor_data(t).unwrap().as_slice() == &bytes[..],
                "blk.{l}.{name}: bytes differ from llama.cpp's repacking"
            );
        }
    }

    // The same model: the golden's logits (the golden test's 1e-4) and the folder's.
    let ids = golden_ids();
    let from_gguf = logits(&gguf, &ids);
    let from_hf = logits(&tiny(), &ids);
    let want: Vec<f32> = golden()["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
        })
        .collect();
    let (dg, dh) = (max_diff(&from_gguf, &want), max_diff(&from_gguf, &from_hf));
    eprintln!("tiny-gpt-oss GGUF: vs golden {dg:.2e}, vs the folder {dh:.2e}");
    assert!(dg < 1e-4, "GGUF vs golden: {dg}");
    assert!(dh < 1e-5, "GGUF vs folder: {dh}");

    // The fast path and token-by-token decode from the file, as the folder's test holds them.
    let m = Model::load(&gguf).unwrap();
    let info = m.info();
    assert_eq!(info.architecture, "gpt-oss");
    assert_eq!(info.sliding_window, Some(4));
    let mut s = m.session(0);
    let mut worst = 0f32;
    let n = want.len() / ids.len();
    for (t, &id) in ids.iter().enumerate() {
        let l = s.prefill(&[id]).unwrap();
        worst = worst.max(max_diff(&l, &want[t * n..(t + 1) * n]));
    }
    eprintln!("tiny-gpt-oss GGUF (fast path, token by token): {worst:.2e}");
    assert!(worst < 3e-3, "fast decode from GGUF: {worst}");
}

/// GGUF to GGUF keeps every tensor's bytes (the MXFP4 experts copied, never decoded).
#[test]
fn gguf_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = to_gguf(dir.path());
    let src = SourceModel::open(&gguf).unwrap();
    let again = dir.path().join("again.gguf");
    convert(&src, &again, &ConvertTarget::Gguf(None), &NoProgress).unwrap();
    same_gguf_tensors(&gguf, &again);
}

/// Every tensor of two GGUF files: same names, types, dims and bytes.
fn same_gguf_tensors(a: &Path, b: &Path) {
    let (a, b) = (GgufFile::open(a).unwrap(), GgufFile::open(b).unwrap());
    assert_eq!(a.tensors.len(), b.tensors.len());
    for t in &a.tensors {
        let u = b.tensor(&t.name).unwrap();
        assert_eq!((u.ty, &u.dims), (t.ty, &t.dims), "{}", t.name);
        assert!(
            a.tensor_data(t).unwrap().as_slice() == b.tensor_data(u).unwrap().as_slice(),
            "{}",
            t.name
        );
    }
}

/// Every tensor of two safetensors folders (one file each): same names, dtypes, shapes, bytes.
fn same_st_tensors(a: &Path, b: &Path) {
    let (a, b) = (
        SafeTensors::open(&a.join("model.safetensors")).unwrap(),
        SafeTensors::open(&b.join("model.safetensors")).unwrap(),
    );
    let mut names: Vec<&String> = a.tensors.iter().map(|t| &t.name).collect();
    names.sort();
    let mut other: Vec<&String> = b.tensors.iter().map(|t| &t.name).collect();
    other.sort();
    assert_eq!(names, other);
    for n in names {
        let (x, y) = (a.tensor(n).unwrap(), b.tensor(n).unwrap());
        assert_eq!((x.dtype, &x.shape), (y.dtype, &y.shape), "{n}");
        assert!(
            a.tensor_data(x).unwrap().as_slice() == b.tensor_data(y).unwrap().as_slice(),
            "{n}: bytes differ"
        );
    }
}

fn to_hf(src: &Path, out: &Path) {
    let s = SourceModel::open(src).unwrap();
    convert(
        &s,
        out,
        &ConvertTarget::Hf(HfOptions::default()),
        &NoProgress,
    )
    .unwrap_or_else(|e| panic!("{}: {e}", src.display()));
}

/// folder -> GGUF -> folder -> GGUF: the rebuilt folder holds the checkpoint's tensors byte for
/// byte (MXFP4 blocks and scales with gate and up interleaved, biases, sinks, router) and gives
/// its logits exactly; the second GGUF equals the first tensor for tensor. A folder written from
/// the folder is the same checkpoint too, its `quantization_config` kept.
#[test]
fn hf_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = to_gguf(dir.path());
    let back = dir.path().join("back");
    to_hf(&gguf, &back);
    same_st_tensors(&tiny(), &back);
    let again = dir.path().join("again.gguf");
    convert(
        &SourceModel::open(&back).unwrap(),
        &again,
        &ConvertTarget::Gguf(None),
        &NoProgress,
    )
    .unwrap();
    same_gguf_tensors(&gguf, &again);

    // The rebuilt config: transformers' GPT-OSS keys, read back as the same model.
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(back.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "gpt_oss");
    assert_eq!(cfg["architectures"][0], "GptOssForCausalLM");
    assert_eq!(cfg["quantization_config"]["quant_method"], "mxfp4");
    assert_eq!(cfg["rope_parameters"]["rope_type"], "yarn");
    assert_eq!(cfg["rope_parameters"]["truncate"], false);
    assert!(cfg["rope_parameters"].get("attention_factor").is_none());
    assert_eq!(
        cfg["layer_types"],
        serde_json::json!(["sliding_attention", "full_attention"])
    );
    assert_eq!(
        (&cfg["num_local_experts"], &cfg["intermediate_size"]),
        (&Value::from(4), &Value::from(32))
    );
    let ids = golden_ids();
    let want = logits(&tiny(), &ids);
    let d = max_diff(&logits(&back, &ids), &want);
    eprintln!("tiny-gpt-oss folder -> GGUF -> folder: logits differ by {d:.2e}");
    assert_eq!(d, 0.0, "folder -> GGUF -> folder changed the logits");

    let direct = dir.path().join("direct");
    to_hf(&tiny(), &direct);
    same_st_tensors(&tiny(), &direct);
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(direct.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["quantization_config"]["quant_method"], "mxfp4");
    assert_eq!(max_diff(&logits(&direct, &ids), &want), 0.0);
}

/// A GGUF whose experts are not MXFP4 cannot become a GPT-OSS checkpoint: refused by name, no
/// folder left behind.
#[test]
fn hf_refuses_experts_of_another_type() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = to_gguf(dir.path());
    let f = GgufFile::open(&gguf).unwrap();
    let p = dir.path().join("f32-experts.gguf");
    let mut w = hf2q_tensor::io::gguf::GgufWriter::new();
    for (k, v) in &f.metadata {
        w.add_metadata(k.clone(), v.clone()).unwrap();
    }
    let to_f32 = |t: &hf2q_tensor::io::gguf::GgufTensorInfo| t.ty == GgmlType::MXFP4;
    for t in &f.tensors {
        let ty = if to_f32(t) { GgmlType::F32 } else { t.ty };
        w.add_tensor_info(t.name.clone(), t.dims.clone(), ty)
            .unwrap();
    }
    w.write_file_with(&p, |info| {
        let t = f.tensor(&info.name).unwrap();
        let data = f.tensor_data(t).unwrap();
        if !to_f32(t) {
            return Ok(data.as_slice().to_vec());
        }
        let mut x = vec![0f32; t.numel() as usize];
        hf2q_tensor::quant::dequantize(t.ty, data.as_slice(), &mut x).unwrap();
        Ok(x.iter().flat_map(|v| v.to_le_bytes()).collect())
    })
    .unwrap();
    let out = dir.path().join("hf");
    let e = convert(
        &SourceModel::open(&p).unwrap(),
        &out,
        &ConvertTarget::Hf(HfOptions::default()),
        &NoProgress,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("ffn_") && e.contains("MXFP4"), "{e}");
    assert!(!out.exists());
}

/// Quantizing, from the folder and from its GGUF: the experts stay MXFP4 with the converted
/// file's bytes (copied, never decoded), sinks, norms, biases and router stay F32 (llama.cpp's
/// rules), the attention and output follow the type's rules; the logits stay near the
/// source's.
#[test]
fn quantize_keeps_the_experts() {
    use hf2q_models::quantize::presets::QuantTarget;
    use hf2q_models::quantize::{quantize, QuantizeOptions};
    let dir = tempfile::tempdir().unwrap();
    let gguf = to_gguf(dir.path());
    let reference = GgufFile::open(&gguf).unwrap();
    let ids = golden_ids();
    let want = logits(&tiny(), &ids);
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    // Tolerances, as a share of the largest logit. Only the embeddings, attention and output
    // matrices are quantized (the experts are as before). Q8_0 rounds each weight to 1/254 of
    // its 32-block's range, about 0.7% of these random weights' scale, through every product
    // to the output: measured 2.0e-2 of the largest logit (the tiny Qwen3-MoE's Q8_0 test
    // measures the same order). Q4_K_M on rows of 32 and 64 falls back to Q5_0 (1/31 of the
    // range) for most matrices and Q8_0 for the output: measured 0.27. The bounds are about
    // twice the measurements: a rule that decoded the experts or quantized the router, sinks
    // or biases differently fails the type checks above them; rounding noise passes.
    let mut measured = Vec::new();
    for (preset, tol, attn_q) in [
        ("Q8_0", 5e-2f32, GgmlType::Q8_0),
        ("Q4_K_M", 0.5, GgmlType::Q5_0),
        // llama.cpp's preset for the family: Q8_0 for every other weight, as the Q8_0 type.
        ("MXFP4_MOE", 5e-2, GgmlType::Q8_0),
    ] {
        for (i, source) in [tiny(), gguf.clone()].into_iter().enumerate() {
            let src = SourceModel::open(&source).unwrap();
            let out = dir.path().join(format!("{preset}-{i}.gguf"));
            let opts = QuantizeOptions {
                target: QuantTarget::parse(preset, None).unwrap(),
                overrides: Default::default(),
                imatrix: None,
            };
            let report = quantize(&src, &out, &opts, &NoProgress).unwrap();
            assert!(!report.requantized, "{preset}: nothing is decoded");
            if preset == "MXFP4_MOE" {
                let ft = GgufFile::open(&out).unwrap().get_u64("general.file_type");
                assert_eq!(ft, Some(38), "llama.cpp's LLAMA_FTYPE_MOSTLY_MXFP4_MOE");
            }
            let f = GgufFile::open(&out).unwrap();
            assert_eq!(f.tensors.len(), reference.tensors.len());
            for t in &f.tensors {
                let r = reference.tensor(&t.name).unwrap();
                let n = &t.name;
                if r.ty == GgmlType::MXFP4 {
                    assert_eq!(t.ty, GgmlType::MXFP4, "{n}");
                    assert!(
                        f.tensor_data(t).unwrap().as_slice()
                            == reference.tensor_data(r).unwrap().as_slice(),
                        "{n}: expert bytes changed"
                    );
                } else if t.dims.len() == 1
                    || n.ends_with(".bias")
                    || n.contains("ffn_gate_inp")
                    || n.contains("attn_sinks")
                {
                    assert_eq!(t.ty, GgmlType::F32, "{preset} {n}");
                } else if n.contains("attn_q.weight") {
                    assert_eq!(t.ty, attn_q, "{preset} {n}");
                } else if n == "output.weight" || preset == "MXFP4_MOE" {
                    assert_eq!(t.ty, GgmlType::Q8_0, "{preset} {n}");
                }
            }
            let d = max_diff(&logits(&out, &ids), &want) / scale;
            eprintln!(
                "tiny-gpt-oss {preset} from source {i}: logits differ by {d:.2e} of the largest"
            );
            assert!(d < tol, "{preset} from source {i}: {d} >= {tol}");
            measured.push(d);
        }
    }
    assert!(
        measured[2] > measured[0],
        "Q4_K_M should be coarser than Q8_0"
    );
}

/// What llama.cpp's `gpt-oss` keys cannot say (YaRN truncated, other sliding layers, another
/// SwiGLU limit) is refused when converting, never written as another model.
#[test]
fn inexpressible_configs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (edit, words) in [
        ("truncate", "truncate true"),
        ("layers", "sliding layers"),
        ("limit", "swiglu_limit"),
    ] {
        let d = dir.path().join(edit);
        std::fs::create_dir_all(&d).unwrap();
        for e in std::fs::read_dir(tiny()).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
        }
        let mut cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
        match edit {
            "truncate" => cfg["rope_parameters"]["truncate"] = true.into(),
            "layers" => {
                cfg["layer_types"] = serde_json::json!(["full_attention", "sliding_attention"])
            }
            _ => cfg["swiglu_limit"] = 5.0.into(),
        }
        std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
        let src = SourceModel::open(&d).unwrap();
        let out = dir.path().join(format!("{edit}.gguf"));
        let e = convert(&src, &out, &ConvertTarget::Gguf(None), &NoProgress)
            .unwrap_err()
            .to_string();
        assert!(e.contains(words), "{edit}: {e}");
        assert!(!out.exists());
    }
}

/// A GGUF lacking an expert bias, or of another RoPE scaling, fails with a message naming it.
#[test]
fn bad_gguf_fails_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = to_gguf(dir.path());
    let f = GgufFile::open(&gguf).unwrap();
    let rewrite = |path: &Path, skip: &str, key: Option<(&str, GgufValue)>| {
        let mut w = hf2q_tensor::io::gguf::GgufWriter::new();
        for (k, v) in &f.metadata {
            let v = match &key {
                Some((kk, nv)) if kk == k => nv.clone(),
                _ => v.clone(),
            };
            w.add_metadata(k.clone(), v).unwrap();
        }
        let kept: Vec<_> = f.tensors.iter().filter(|t| t.name != skip).collect();
        for t in &kept {
            w.add_tensor_info(t.name.clone(), t.dims.clone(), t.ty)
                .unwrap();
        }
        w.write_file_with(path, |info| {
            let t = f.tensor(&info.name).unwrap();
            Ok(f.tensor_data(t).unwrap().as_slice().to_vec())
        })
        .unwrap();
    };
    let p = dir.path().join("no-bias.gguf");
    rewrite(&p, "blk.1.ffn_up_exps.bias", None);
    let e = Model::load(&p).err().expect("refused").to_string();
    assert!(e.contains("blk.1.ffn_up_exps.bias"), "{e}");
    let p = dir.path().join("linear.gguf");
    rewrite(
        &p,
        "",
        Some((
            "gpt-oss.rope.scaling.type",
            GgufValue::String("linear".into()),
        )),
    );
    let e = Model::load(&p).err().expect("refused").to_string();
    assert!(e.contains("RoPE scaling 'linear'"), "{e}");
}

/// Mixed precision (`--target-bpw`) from the folder and from its GGUF: the experts are in no
/// group (their MXFP4 bytes copied at every level), the file loads and runs.
#[test]
fn mixed_precision_keeps_the_experts() {
    use hf2q_models::quantize::mixed::{quantize_mixed, MixedOptions};
    let dir = tempfile::tempdir().unwrap();
    let gguf = to_gguf(dir.path());
    let reference = GgufFile::open(&gguf).unwrap();
    let ids = golden_ids();
    for (i, source) in [tiny(), gguf.clone()].into_iter().enumerate() {
        let src = SourceModel::open(&source).unwrap();
        let out = dir.path().join(format!("mixed-{i}.gguf"));
        let (_, alloc) = quantize_mixed(
            &src,
            &out,
            &MixedOptions::new(8.0, ids.clone()),
            &NoProgress,
            &NoProgress,
        )
        .unwrap_or_else(|e| panic!("source {i}: {e}"));
        assert!(
            alloc.groups.iter().all(|g| !g.name.contains("ffn")),
            "{:?}",
            alloc.groups.iter().map(|g| &g.name).collect::<Vec<_>>()
        );
        let f = GgufFile::open(&out).unwrap();
        for t in reference.tensors.iter().filter(|t| t.ty == GgmlType::MXFP4) {
            let u = f.tensor(&t.name).unwrap();
            assert_eq!(u.ty, GgmlType::MXFP4, "{}", t.name);
            assert!(
                f.tensor_data(u).unwrap().as_slice()
                    == reference.tensor_data(t).unwrap().as_slice(),
                "{}: expert bytes changed",
                t.name
            );
        }
        assert!(logits(&out, &ids).iter().all(|x| x.is_finite()));
    }
}
