//! `hf2q synth` for mixtures of experts at the tiny test shapes (a few MiB, well under a second):
//! the file holds llama.cpp's stacked experts and MoE keys, tensor types follow llama.cpp's
//! rules (the 8-expert bumps for the Mixtral shape), and hf2q loads and runs it. The real shapes
//! (Qwen3-30B-A3B, Mixtral-8x7B) are checked by the synth unit tests' plan, never written here.

use std::path::{Path, PathBuf};

use hf2q_models::convert::NoProgress;
use hf2q_models::quantize::presets::{GgufRecipe, Preset};
use hf2q_models::synth::{self, SynthOptions, SynthShape};
use hf2q_models::Model;
use hf2q_tensor::io::gguf::GgufFile;
use hf2q_tensor::GgmlType;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tiny")
        .join(name)
}

fn write(shape: &str, preset: Preset, out: &Path) {
    let (tokenizer, _) = synth::tokenizer_metadata(&fixture("tiny-qwen3-moe")).unwrap();
    let opts = SynthOptions {
        shape: SynthShape::by_name(shape).unwrap(),
        recipe: GgufRecipe {
            preset,
            pure: false,
        },
        seed: 7,
        tokenizer,
    };
    synth::synthesize(&opts, out, &NoProgress).unwrap();
}

fn ty(g: &GgufFile, name: &str) -> GgmlType {
    g.tensor(name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
        .ty
}

fn runs(path: &Path) {
    let m = Model::load(path).unwrap();
    let logits = m.session(0).forward_all(&[1, 2, 3, 4, 5]).unwrap();
    let row = logits.row(4);
    assert!(row.iter().all(|x| x.is_finite()), "{}", path.display());
    assert!(row.iter().any(|&x| x != row[0]), "constant logits");
}

#[test]
fn tiny_qwen3_moe_synth_is_stacked_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q.gguf");
    write("tiny-qwen3-moe", Preset::Q4_K_M, &out);
    let g = GgufFile::open(&out).unwrap();
    assert_eq!(g.get_u64("qwen3moe.expert_count"), Some(16));
    assert_eq!(g.get_u64("qwen3moe.expert_used_count"), Some(4));
    assert_eq!(g.get_u64("qwen3moe.expert_feed_forward_length"), Some(256));
    let t = g.tensor("blk.1.ffn_down_exps.weight").unwrap();
    assert_eq!(t.dims, [256, 256, 16]);
    assert_eq!(
        g.tensor("blk.0.ffn_gate_inp.weight").unwrap().dims,
        [256, 16]
    );
    assert!(g.tensor("blk.0.ffn_down.weight").is_none());
    // Q4_K_M over 2 layers: use_more_bits holds for layer 1 (i >= 7n/8 = 1), not for layer 0
    // (i < n/8 = 0 is false, (0 - 0) % 3 != 2).
    assert_eq!(ty(&g, "blk.0.ffn_gate_inp.weight"), GgmlType::F32);
    assert_eq!(ty(&g, "blk.0.ffn_gate_exps.weight"), GgmlType::Q4_K);
    assert_eq!(ty(&g, "blk.0.ffn_down_exps.weight"), GgmlType::Q4_K);
    assert_eq!(ty(&g, "blk.1.ffn_down_exps.weight"), GgmlType::Q6_K);
    assert_eq!(ty(&g, "blk.1.attn_v.weight"), GgmlType::Q6_K);
    assert_eq!(ty(&g, "blk.1.attn_k.weight"), GgmlType::Q4_K);
    drop(g);
    runs(&out);
}

/// GPT-OSS at llama.cpp's MXFP4_MOE: MXFP4 stacked experts, their biases, the sinks, the
/// family's keys; hf2q loads it as GPT-OSS (sinks, sliding even layers, YaRN) and runs it.
#[test]
fn tiny_gpt_oss_synth_has_the_family_tensors_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("g.gguf");
    write("tiny-gpt-oss", Preset::MXFP4_MOE, &out);
    let g = GgufFile::open(&out).unwrap();
    assert_eq!(g.get_str("general.architecture"), Some("gpt-oss"));
    assert_eq!(g.get_u64("gpt-oss.expert_count"), Some(8));
    assert_eq!(g.get_u64("gpt-oss.expert_used_count"), Some(2));
    assert_eq!(g.get_u64("gpt-oss.attention.sliding_window"), Some(128));
    assert_eq!(g.get_str("gpt-oss.rope.scaling.type"), Some("yarn"));
    assert_eq!(ty(&g, "blk.1.ffn_down_exps.weight"), GgmlType::MXFP4);
    assert_eq!(ty(&g, "blk.1.ffn_gate_exps.weight"), GgmlType::MXFP4);
    assert_eq!(ty(&g, "blk.1.attn_q.weight"), GgmlType::Q8_0);
    assert_eq!(ty(&g, "blk.1.attn_sinks.weight"), GgmlType::F32);
    assert_eq!(g.tensor("blk.1.ffn_down_exps.bias").unwrap().dims, [256, 8]);
    drop(g);
    let m = Model::load(&out).unwrap();
    let c = &m.config;
    assert!(c.attention_sinks && c.attention_bias && c.yarn.is_some());
    assert_eq!(c.sliding_layers, [true, false]);
    drop(m);
    runs(&out);
}

#[test]
fn tiny_mixtral_synth_gets_the_eight_expert_rules_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.gguf");
    write("tiny-mixtral", Preset::Q4_K_M, &out);
    let g = GgufFile::open(&out).unwrap();
    assert_eq!(g.get_str("general.architecture"), Some("llama"));
    assert_eq!(g.get_u64("llama.expert_count"), Some(8));
    assert_eq!(g.get_u64("llama.expert_used_count"), Some(2));
    assert_eq!(g.get_u64("llama.feed_forward_length"), Some(256));
    assert_eq!(
        g.tensor("blk.0.ffn_gate_exps.weight").unwrap().dims,
        [256, 256, 8]
    );
    assert_eq!(ty(&g, "blk.0.attn_v.weight"), GgmlType::Q8_0);
    assert_eq!(ty(&g, "blk.0.attn_k.weight"), GgmlType::Q8_0);
    assert_eq!(ty(&g, "blk.0.attn_output.weight"), GgmlType::Q5_K);
    assert_eq!(ty(&g, "blk.0.attn_q.weight"), GgmlType::Q4_K);
    assert_eq!(ty(&g, "blk.0.ffn_gate_inp.weight"), GgmlType::F32);
    drop(g);
    runs(&out);
    // Q8_0: every quantized weight Q8_0 (the output too), the router F32.
    let out = dir.path().join("m8.gguf");
    write("tiny-mixtral", Preset::Q8_0, &out);
    let g = GgufFile::open(&out).unwrap();
    for t in &g.tensors {
        let want = if t.dims.len() == 1 || t.name.contains("ffn_gate_inp") {
            GgmlType::F32
        } else {
            GgmlType::Q8_0
        };
        assert_eq!(t.ty, want, "{}", t.name);
    }
    drop(g);
    runs(&out);
}

#[test]
fn decode_bytes_count_k_of_e_experts_and_one_embedding_row() {
    use hf2q_models::convert::source::decode_bytes;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q.gguf");
    write("tiny-qwen3-moe", Preset::Q4_K_M, &out);
    let g = GgufFile::open(&out).unwrap();
    let size = |n: &str| g.tensor(n).unwrap().nbytes();
    let all: u64 = g.tensors.iter().map(|t| t.nbytes()).sum();
    let experts: u64 = g
        .tensors
        .iter()
        .filter(|t| t.name.contains("_exps"))
        .map(|t| t.nbytes())
        .sum();
    let embd = size("token_embd.weight");
    let vocab = g.tensor("token_embd.weight").unwrap().dims[1];
    let d = decode_bytes(&out).unwrap();
    assert_eq!((d.all, d.experts), (all, experts));
    // 4 of 16 experts per token; the untied embedding read one row at a time.
    assert_eq!(
        d.per_token,
        all - experts + experts / 4 - embd + embd / vocab
    );
    // A dense model with tied embeddings: the output reads the whole table, so every weight.
    let d = decode_bytes(&fixture("tiny-qwen3")).unwrap();
    assert_eq!(d.experts, 0);
    assert_eq!(d.per_token, d.all);
}
