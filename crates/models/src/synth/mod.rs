//! Random-weight models at real shapes: a GGUF file with the architecture metadata llama.cpp's
//! converter writes for a known model (Llama 3.x, Qwen3, SmolLM2, the mixtures of experts
//! Qwen3-30B-A3B, Mixtral-8x7B and GPT-OSS-20B, or a tiny test shape), a real
//! tokenizer copied from another file, and random weights. For speed and load tests of real sizes
//! where the real weights cannot be had (or moved).
//!
//! Quantized tensors are not made by quantizing floats: their blocks are written directly, random
//! quants with scales chosen so that the decoded weights have a standard deviation of about
//! [`WEIGHT_STD`] and mean zero (sub-block scales of alternating sign where a format's quants are
//! not centred). Norm weights are 1.0; Llama 3's `rope_freqs.weight` holds the real frequency
//! factors. Tensor types follow the preset's per-tensor rules (`crate::quantize::rules`), as
//! `hf2q quantize` would choose them for the real model. Routed layers hold llama.cpp's stacked
//! experts (`ffn_{gate,up,down}_exps`, 3-D, one expert's matrix after another) and an F32
//! router `ffn_gate_inp` of random weights.
//!
//! Generation is deterministic for a seed (each chunk of a tensor has its own generator, so the
//! thread count does not change the bytes), runs on all cores, and overlaps with writing: one
//! tensor is generated while the previous one is written, never the whole model in memory. The
//! file appears under its name only once complete (temporary name + rename).
//!
//! Not here: weights that mean anything; any architecture beyond the listed shapes.

use std::path::Path;
use std::sync::mpsc::sync_channel;

use hf2q_tensor::io::gguf::{GgufArray, GgufFile, GgufValue, GgufValueType, GgufWriter};
use hf2q_tensor::GgmlType;
use serde_json::Value;

use crate::config::{Arch, ModelConfig};
use crate::convert::gguf_out::QUANTIZATION_VERSION;
use crate::convert::{gguf_meta, Progress};
use crate::quantize::presets::GgufRecipe;
use crate::quantize::rules::{self, gguf_order, ModelFacts, Overrides, TensorFacts, TypeChooser};
use crate::{Error, Result};

mod blocks;
mod shapes;

use blocks::tensor_seed;
pub use blocks::WEIGHT_STD;
pub use shapes::{Llama3Rope, SynthMoe, SynthShape, SHAPES};

/// llama.cpp's token type for vocabulary padding (`[PAD<i>]` entries of its converter).
const TOKEN_TYPE_UNUSED: i32 = 5;
const TOKEN_TYPE_NORMAL: i32 = 1;

type Meta = Vec<(String, GgufValue)>;

/// What one output tensor holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fill {
    /// Random weights of std [`WEIGHT_STD`].
    Random,
    /// RMSNorm weights: 1.0.
    Ones,
    /// Llama 3 RoPE frequency factors.
    RopeFreqs,
}

/// One tensor of the output file.
#[derive(Clone, Debug)]
pub struct SynthTensor {
    pub name: String,
    /// GGUF order: ne0 (the row length) first.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    fill: Fill,
}

impl SynthTensor {
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// The tensors of `cfg` in llama.cpp's order, typed by `recipe`'s per-tensor rules.
pub fn plan(
    cfg: &ModelConfig,
    recipe: GgufRecipe,
) -> Result<(Vec<SynthTensor>, Vec<rules::Fallback>)> {
    let (d, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (q, kv) = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
    // (name, dims with ne0 first, fill)
    let mut t: Vec<(String, Vec<usize>, Fill)> = vec![
        ("token_embd.weight".into(), vec![d, v], Fill::Random),
        ("output_norm.weight".into(), vec![d], Fill::Ones),
    ];
    if !cfg.tie_embeddings {
        t.push(("output.weight".into(), vec![d, v], Fill::Random));
    }
    if cfg.llama3_scaling.is_some() {
        t.push((
            "rope_freqs.weight".into(),
            vec![cfg.head_dim / 2],
            Fill::RopeFreqs,
        ));
    }
    for l in 0..cfg.n_layers {
        let gpt_oss = cfg.arch == Arch::GptOss;
        let mut layer: Vec<(&str, Vec<usize>, Fill)> = vec![
            ("attn_norm.weight", vec![d], Fill::Ones),
            ("attn_q.weight", vec![d, q], Fill::Random),
            ("attn_k.weight", vec![d, kv], Fill::Random),
            ("attn_v.weight", vec![d, kv], Fill::Random),
            ("attn_output.weight", vec![q, d], Fill::Random),
            // GPT-OSS's pre-MLP norm under llama.cpp's name for it.
            (
                if gpt_oss {
                    "post_attention_norm.weight"
                } else {
                    "ffn_norm.weight"
                },
                vec![d],
                Fill::Ones,
            ),
        ];
        if gpt_oss {
            // q/k/v/o biases, per-head sinks, the router's and the experts' biases
            // (`[F, E]`, `[D, E]`), all F32 under every type.
            let m = cfg
                .moe
                .as_ref()
                .ok_or_else(|| Error::Msg("a GPT-OSS shape without experts".into()))?;
            layer.extend([
                ("attn_q.bias", vec![q], Fill::Random),
                ("attn_k.bias", vec![kv], Fill::Random),
                ("attn_v.bias", vec![kv], Fill::Random),
                ("attn_output.bias", vec![d], Fill::Random),
                ("attn_sinks.weight", vec![cfg.n_heads], Fill::Random),
                ("ffn_gate_inp.bias", vec![m.n_experts], Fill::Random),
                (
                    "ffn_gate_exps.bias",
                    vec![m.expert_width, m.n_experts],
                    Fill::Random,
                ),
                (
                    "ffn_up_exps.bias",
                    vec![m.expert_width, m.n_experts],
                    Fill::Random,
                ),
                ("ffn_down_exps.bias", vec![d, m.n_experts], Fill::Random),
            ]);
        }
        match cfg.moe.as_ref().filter(|m| m.layers[l]) {
            // llama.cpp's shapes: gate/up (D, F_e, E), down (F_e, D, E), router (D, E).
            Some(m) => layer.extend([
                ("ffn_gate_inp.weight", vec![d, m.n_experts], Fill::Random),
                (
                    "ffn_gate_exps.weight",
                    vec![d, m.expert_width, m.n_experts],
                    Fill::Random,
                ),
                (
                    "ffn_up_exps.weight",
                    vec![d, m.expert_width, m.n_experts],
                    Fill::Random,
                ),
                (
                    "ffn_down_exps.weight",
                    vec![m.expert_width, d, m.n_experts],
                    Fill::Random,
                ),
            ]),
            None => layer.extend([
                ("ffn_gate.weight", vec![d, f], Fill::Random),
                ("ffn_up.weight", vec![d, f], Fill::Random),
                ("ffn_down.weight", vec![f, d], Fill::Random),
            ]),
        }
        if cfg.qk_norm {
            layer.push(("attn_q_norm.weight", vec![cfg.head_dim], Fill::Ones));
            layer.push(("attn_k_norm.weight", vec![cfg.head_dim], Fill::Ones));
        }
        t.extend(
            layer
                .into_iter()
                .map(|(n, dims, fill)| (format!("blk.{l}.{n}"), dims, fill)),
        );
    }
    t.sort_by(|a, b| gguf_order(&a.0, &b.0));
    let facts = ModelFacts::of(cfg);
    let mut chooser = TypeChooser::new(
        recipe,
        facts,
        Overrides::default(),
        false,
        t.iter().map(|x| x.0.as_str()),
    );
    let mut out = Vec::with_capacity(t.len());
    for (name, dims, fill) in t {
        let ty = chooser.choose(TensorFacts {
            name: &name,
            cols: dims[0],
            n_dims: dims.len(),
            current: GgmlType::F32,
        })?;
        out.push(SynthTensor {
            name,
            dims: dims.into_iter().map(|x| x as u64).collect(),
            ty,
            fill,
        });
    }
    Ok((out, chooser.fallbacks))
}

// ---------------------------------------------------------------------------------------------
// Tokenizer metadata
// ---------------------------------------------------------------------------------------------

/// The `tokenizer.*` metadata of `path` (a GGUF file, or a Hugging Face folder with tokenizer.json
/// and tokenizer_config.json) and its token count.
pub fn tokenizer_metadata(path: &Path) -> Result<(Meta, usize)> {
    let meta: Meta = if path.is_dir() {
        let n = hf_token_count(&path.join("tokenizer.json"))?;
        gguf_meta::tokenizer_metadata(path, n)?
    } else {
        let g = GgufFile::open(path)?;
        g.metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .cloned()
            .collect()
    };
    let n = token_list(&meta)
        .ok_or_else(|| {
            Error::Tokenizer(format!(
                "{}: no tokenizer.ggml.tokens (not a model or tokenizer file?)",
                path.display()
            ))
        })?
        .len();
    if n == 0 {
        return Err(Error::Tokenizer(format!(
            "{}: the vocabulary is empty",
            path.display()
        )));
    }
    Ok((meta, n))
}

/// Highest token id of a tokenizer.json (vocabulary and added tokens) plus one.
fn hf_token_count(path: &Path) -> Result<usize> {
    let s = std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let v: Value = serde_json::from_str(&s)
        .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
    let vocab_ids = v
        .pointer("/model/vocab")
        .and_then(Value::as_object)
        .into_iter()
        .flat_map(|m| m.values().filter_map(Value::as_u64));
    let added_ids = v
        .get("added_tokens")
        .and_then(Value::as_array)
        .into_iter()
        .flat_map(|a| a.iter().filter_map(|t| t.get("id").and_then(Value::as_u64)));
    vocab_ids
        .chain(added_ids)
        .max()
        .map(|m| m as usize + 1)
        .ok_or_else(|| Error::Tokenizer(format!("{}: no vocabulary", path.display())))
}

fn token_list(meta: &Meta) -> Option<&GgufArray> {
    meta.iter()
        .find(|(k, _)| k == "tokenizer.ggml.tokens")
        .and_then(|(_, v)| v.as_array())
        .filter(|a| a.elem_type == GgufValueType::String)
}

/// Pads the vocabulary in `meta` to `n` tokens as llama.cpp's converter pads a model whose
/// embedding has more rows than its tokenizer has tokens: `[PAD<i>]`, type unused, score -1000.
pub fn pad_vocab(meta: &mut Meta, n: usize) -> Result<()> {
    let have = token_list(meta)
        .ok_or_else(|| Error::Tokenizer("no tokenizer.ggml.tokens".into()))?
        .len();
    if n < have {
        return Err(Error::Tokenizer(format!(
            "the tokenizer has {have} tokens, more than the shape's vocabulary of {n}"
        )));
    }
    if n > have && !meta.iter().any(|(k, _)| k == "tokenizer.ggml.token_type") {
        let types = vec![GgufValue::I32(TOKEN_TYPE_NORMAL); have];
        let pos = meta
            .iter()
            .position(|(k, _)| k == "tokenizer.ggml.tokens")
            .expect("checked above");
        meta.insert(
            pos + 1,
            (
                "tokenizer.ggml.token_type".into(),
                GgufValue::Array(GgufArray {
                    elem_type: GgufValueType::I32,
                    values: types,
                }),
            ),
        );
    }
    for (k, v) in meta.iter_mut() {
        let GgufValue::Array(a) = v else { continue };
        let pad: Box<dyn Fn(usize) -> GgufValue> = match (k.as_str(), a.elem_type) {
            ("tokenizer.ggml.tokens", GgufValueType::String) => {
                Box::new(|i| GgufValue::String(format!("[PAD{i}]")))
            }
            ("tokenizer.ggml.token_type", GgufValueType::I32) => {
                Box::new(|_| GgufValue::I32(TOKEN_TYPE_UNUSED))
            }
            ("tokenizer.ggml.scores", GgufValueType::F32) => Box::new(|_| GgufValue::F32(-1000.0)),
            ("tokenizer.ggml.token_type" | "tokenizer.ggml.scores", _) => {
                return Err(Error::Tokenizer(format!(
                    "{k} is an array of {}, expected {}",
                    a.elem_type,
                    if k.ends_with("scores") {
                        "float32"
                    } else {
                        "int32"
                    }
                )))
            }
            _ => continue,
        };
        if a.values.len() != have {
            return Err(Error::Tokenizer(format!(
                "{k} has {} entries for {have} tokens",
                a.values.len()
            )));
        }
        a.values.extend((have..n).map(pad));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------

/// What `hf2q synth` writes.
#[derive(Clone, Debug)]
pub struct SynthOptions {
    pub shape: SynthShape,
    pub recipe: GgufRecipe,
    pub seed: u64,
    /// `tokenizer.*` metadata (from [`tokenizer_metadata`]); padded here to the shape's
    /// vocabulary.
    pub tokenizer: Meta,
}

/// What was written.
#[derive(Clone, Debug, Default)]
pub struct SynthReport {
    pub tensors: usize,
    pub parameters: u64,
    pub vocab_size: usize,
    /// Tokens the tokenizer had before padding.
    pub tokenizer_tokens: usize,
    /// Size of the file.
    pub bytes_written: u64,
    /// Bytes of tensor data (the file less header, metadata and padding).
    pub tensor_bytes: u64,
    /// Tensor types chosen: (type name, tensor count, element count).
    pub types: Vec<(String, usize, u64)>,
    pub fallbacks: Vec<rules::Fallback>,
}

impl SynthReport {
    /// Tensor bits over tensor elements, as llama.cpp prints BPW (metadata excluded).
    pub fn bits_per_weight(&self) -> f64 {
        self.tensor_bytes as f64 * 8.0 / self.parameters.max(1) as f64
    }
}

/// llama.cpp's converter metadata for `cfg` (everything but the tokenizer).
fn model_metadata(shape: &SynthShape, cfg: &ModelConfig) -> Result<Meta> {
    let a = cfg.arch.name();
    let k = |s: &str| format!("{a}.{s}");
    let u = |x: usize| GgufValue::U32(x as u32);
    let mut m: Meta = vec![
        ("general.architecture".into(), a.into()),
        ("general.type".into(), "model".into()),
        (
            "general.name".into(),
            format!("synthetic {} (random weights)", shape.name).into(),
        ),
        (k("block_count"), u(cfg.n_layers)),
        (k("context_length"), u(cfg.context_length)),
        (k("embedding_length"), u(cfg.hidden_size)),
        (k("feed_forward_length"), u(cfg.intermediate_size)),
        (k("attention.head_count"), u(cfg.n_heads)),
        (k("attention.head_count_kv"), u(cfg.n_kv_heads)),
        (k("rope.freq_base"), GgufValue::F32(cfg.rope_theta)),
        (
            k("attention.layer_norm_rms_epsilon"),
            GgufValue::F32(cfg.rms_eps),
        ),
        (k("attention.key_length"), u(cfg.head_dim)),
        (k("attention.value_length"), u(cfg.head_dim)),
    ];
    if cfg.arch == Arch::Llama {
        m.push((k("vocab_size"), u(cfg.vocab_size)));
        m.push((k("rope.dimension_count"), u(cfg.head_dim)));
    }
    if cfg.arch == Arch::GptOss {
        if let Some(w) = cfg.sliding_window {
            m.push((k("attention.sliding_window"), u(w)));
        }
        m.extend(gguf_meta::gpt_oss_metadata(cfg)?);
    }
    m.extend(gguf_meta::moe_metadata(cfg));
    Ok(m)
}

/// Writes a random-weight model to `out` (atomically). The tokenizer is padded to the shape's
/// vocabulary (or sets it, for shapes without one).
pub fn synthesize(opts: &SynthOptions, out: &Path, progress: &dyn Progress) -> Result<SynthReport> {
    let mut tokenizer = opts.tokenizer.clone();
    let have = token_list(&tokenizer)
        .ok_or_else(|| Error::Tokenizer("no tokenizer.ggml.tokens".into()))?
        .len();
    let vocab = opts.shape.vocab_size.unwrap_or(have);
    pad_vocab(&mut tokenizer, vocab)?;
    let cfg = opts.shape.config(vocab)?;
    let (tensors, fallbacks) = plan(&cfg, opts.recipe)?;
    let rope_freqs = cfg.llama3_freq_factors();

    let mut w = GgufWriter::new();
    for (k, v) in model_metadata(&opts.shape, &cfg)? {
        w.add_metadata(k, v)?;
    }
    for (k, v) in tokenizer {
        w.add_metadata(k, v)?;
    }
    w.add_metadata(
        "general.quantization_version",
        GgufValue::U32(QUANTIZATION_VERSION),
    )?;
    w.add_metadata(
        "general.file_type",
        GgufValue::U32(opts.recipe.preset.ftype()),
    )?;
    for t in &tensors {
        w.add_tensor_info(t.name.clone(), t.dims.clone(), t.ty)?;
    }

    let mut report = SynthReport {
        tensors: tensors.len(),
        parameters: tensors.iter().map(SynthTensor::numel).sum(),
        tensor_bytes: w.tensor_infos().map(|i| i.nbytes()).sum(),
        vocab_size: vocab,
        tokenizer_tokens: have,
        fallbacks,
        ..Default::default()
    };
    for t in &tensors {
        let name = t.ty.to_string();
        match report.types.iter_mut().find(|x| x.0 == name) {
            Some(e) => {
                e.1 += 1;
                e.2 += t.numel();
            }
            None => report.types.push((name, 1, t.numel())),
        }
    }

    progress.start(tensors.len());
    // One tensor is generated (on all cores) while the one before it is written.
    let result = std::thread::scope(|s| -> Result<()> {
        let (tx, rx) = sync_channel::<Result<Vec<u8>>>(1);
        let tensors = &tensors;
        let rope_freqs = rope_freqs.as_deref();
        let producer = s.spawn(move || {
            for (i, t) in tensors.iter().enumerate() {
                let r = generate(t, tensor_seed(opts.seed, i), rope_freqs);
                let failed = r.is_err();
                if tx.send(r).is_err() || failed {
                    break;
                }
            }
        });
        let mut done = 0usize;
        let written = w.write_file_with(out, |info| -> hf2q_tensor::Result<Vec<u8>> {
            let bytes = rx
                .recv()
                .map_err(|_| hf2q_tensor::Error::Msg("the tensor generator stopped".into()))?
                .map_err(|e| hf2q_tensor::Error::Msg(format!("tensor '{}': {e}", info.name)))?;
            done += 1;
            let t = &tensors[done - 1];
            progress.tensor(done, &t.name, "random", t.ty.name());
            Ok(bytes)
        });
        // Unblocks the generator if writing stopped early.
        drop(rx);
        producer
            .join()
            .map_err(|_| Error::Msg("the tensor generator panicked".into()))?;
        Ok(written?)
    });
    progress.finish();
    result?;
    report.bytes_written = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    Ok(report)
}

/// The bytes of one tensor.
fn generate(t: &SynthTensor, seed: u64, rope_freqs: Option<&[f32]>) -> Result<Vec<u8>> {
    let n = t.numel() as usize;
    let vals: Vec<f32> = match (t.fill, rope_freqs) {
        (Fill::Random, _) => {
            return blocks::random_tensor(t.ty, n, seed)
                .map_err(|e| Error::Msg(format!("{}: {e}", t.name)))
        }
        (Fill::Ones, _) => vec![1.0; n],
        (Fill::RopeFreqs, Some(f)) if f.len() == n => f.to_vec(),
        (Fill::RopeFreqs, _) => {
            return Err(Error::Msg(format!(
                "no {n} RoPE frequency factors for {}",
                t.name
            )))
        }
    };
    let mut out = vec![0u8; t.ty.row_bytes(n).unwrap_or(0)];
    hf2q_tensor::quant::quantize(t.ty, &vals, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize::presets::Preset;

    #[test]
    fn shapes_parse_and_plan_like_the_presets() {
        for s in SHAPES {
            let cfg = s.config(s.vocab_size.unwrap_or(1000)).unwrap();
            assert_eq!(cfg.llama3_scaling.is_some(), s.llama3_rope.is_some());
        }
        let s = SynthShape::by_name("llama-3.2-1b").unwrap();
        let cfg = s.config(128256).unwrap();
        let (t, fb) = plan(
            &cfg,
            GgufRecipe {
                preset: Preset::Q4_K_M,
                pure: false,
            },
        )
        .unwrap();
        assert!(fb.is_empty());
        let ty = |n: &str| t.iter().find(|x| x.name == n).unwrap().ty;
        // Tied embeddings get the output's Q6_K; use_more_bits layers Q6_K.
        assert_eq!(ty("token_embd.weight"), GgmlType::Q6_K);
        assert_eq!(ty("rope_freqs.weight"), GgmlType::F32);
        assert_eq!(ty("blk.0.attn_v.weight"), GgmlType::Q6_K);
        assert_eq!(ty("blk.5.ffn_down.weight"), GgmlType::Q4_K);
        assert_eq!(ty("blk.7.attn_q.weight"), GgmlType::Q4_K);
        assert_eq!(t.len(), 2 + 1 + 16 * 9);
        assert_eq!(
            t.iter().map(SynthTensor::numel).sum::<u64>(),
            1_235_814_400 + 32
        );
    }

    fn q4_k_m() -> GgufRecipe {
        GgufRecipe {
            preset: Preset::Q4_K_M,
            pure: false,
        }
    }

    #[test]
    fn expert_shapes_plan_stacked_experts_with_llama_cpp_types() {
        // Qwen3-30B-A3B: 30.5B parameters (3.3B active), llama.cpp's shapes and Q4_K_M types.
        let s = SynthShape::by_name("qwen3-30b-a3b").unwrap();
        let cfg = s.config(151936).unwrap();
        let m = cfg.moe.as_ref().unwrap();
        assert_eq!((m.n_experts, m.n_used, m.expert_width), (128, 8, 768));
        assert!(m.renormalize && m.layers.iter().all(|&r| r));
        let (t, fb) = plan(&cfg, q4_k_m()).unwrap();
        assert!(fb.is_empty());
        let get = |n: &str| t.iter().find(|x| x.name == n).unwrap();
        assert_eq!(get("blk.0.ffn_gate_exps.weight").dims, [2048, 768, 128]);
        assert_eq!(get("blk.0.ffn_up_exps.weight").dims, [2048, 768, 128]);
        assert_eq!(get("blk.0.ffn_down_exps.weight").dims, [768, 2048, 128]);
        assert_eq!(get("blk.0.ffn_gate_inp.weight").dims, [2048, 128]);
        assert_eq!(get("blk.0.ffn_gate_inp.weight").ty, GgmlType::F32);
        assert!(!t.iter().any(|x| x.name == "blk.0.ffn_down.weight"));
        assert_eq!(get("token_embd.weight").ty, GgmlType::Q4_K);
        assert_eq!(get("output.weight").ty, GgmlType::Q6_K);
        // use_more_bits over 48 layers: 0..6, 42..48, and (i - 6) % 3 == 2.
        for (l, ty) in [
            (0, GgmlType::Q6_K),
            (6, GgmlType::Q4_K),
            (8, GgmlType::Q6_K),
        ] {
            assert_eq!(get(&format!("blk.{l}.ffn_down_exps.weight")).ty, ty, "{l}");
            assert_eq!(get(&format!("blk.{l}.attn_v.weight")).ty, ty, "{l}");
        }
        assert_eq!(get("blk.47.ffn_down_exps.weight").ty, GgmlType::Q6_K);
        assert_eq!(get("blk.8.ffn_gate_exps.weight").ty, GgmlType::Q4_K);
        assert_eq!(get("blk.8.attn_k.weight").ty, GgmlType::Q4_K);
        assert_eq!(t.len(), 3 + 48 * 12);
        let total: u64 = t.iter().map(SynthTensor::numel).sum();
        assert_eq!(total, 30_532_122_624);
        // Mixtral-8x7B: 46.7B parameters; eight experts bump attn_v/attn_k to Q8_0 and
        // attn_output to Q5_K.
        let s = SynthShape::by_name("mixtral-8x7b").unwrap();
        let cfg = s.config(32000).unwrap();
        assert_eq!(cfg.arch, Arch::Llama);
        let (t, _) = plan(&cfg, q4_k_m()).unwrap();
        let get = |n: &str| t.iter().find(|x| x.name == n).unwrap();
        assert_eq!(get("blk.3.ffn_down_exps.weight").dims, [14336, 4096, 8]);
        assert_eq!(get("blk.3.ffn_down_exps.weight").ty, GgmlType::Q6_K);
        assert_eq!(get("blk.4.ffn_down_exps.weight").ty, GgmlType::Q4_K);
        assert_eq!(get("blk.4.attn_v.weight").ty, GgmlType::Q8_0);
        assert_eq!(get("blk.4.attn_k.weight").ty, GgmlType::Q8_0);
        assert_eq!(get("blk.4.attn_output.weight").ty, GgmlType::Q5_K);
        assert_eq!(get("blk.4.attn_q.weight").ty, GgmlType::Q4_K);
        let total: u64 = t.iter().map(SynthTensor::numel).sum();
        assert_eq!(total, 46_702_792_704);
        // The metadata llama.cpp's loader reads.
        let meta = model_metadata(&s, &cfg).unwrap();
        let has = |k: &str, v: u32| meta.iter().any(|(a, b)| a == k && *b == GgufValue::U32(v));
        assert!(has("llama.expert_count", 8) && has("llama.expert_used_count", 2));
        assert!(has("llama.feed_forward_length", 14336));
        let s = SynthShape::by_name("qwen3-30b-a3b").unwrap();
        let meta = model_metadata(&s, &s.config(151936).unwrap()).unwrap();
        let has = |k: &str, v: u32| meta.iter().any(|(a, b)| a == k && *b == GgufValue::U32(v));
        assert!(has("qwen3moe.expert_count", 128) && has("qwen3moe.expert_used_count", 8));
        assert!(has("qwen3moe.expert_feed_forward_length", 768));
        assert!(has("qwen3moe.feed_forward_length", 6144));
    }

    /// gpt-oss-20b at llama.cpp's MXFP4_MOE: its published 20.9B parameters, MXFP4 experts,
    /// Q8_0 attention, F32 biases, sinks and router, the family's tensors and keys; the plan
    /// loads back as the model's config (even layers sliding at 128, YaRN 32 over 4096).
    #[test]
    fn gpt_oss_shape_plans_the_family_tensors() {
        let s = SynthShape::by_name("gpt-oss-20b").unwrap();
        let cfg = s.config(201088).unwrap();
        assert_eq!(cfg.arch, Arch::GptOss);
        assert!(cfg.attention_bias && cfg.attention_sinks);
        assert_eq!(cfg.sliding_window, Some(128));
        assert!((0..24).all(|i| cfg.sliding_layers[i] == (i % 2 == 0)));
        let y = cfg.yarn.as_ref().unwrap();
        assert_eq!((y.factor, y.original_max_position), (32.0, 4096.0));
        let m = cfg.moe.as_ref().unwrap();
        assert_eq!((m.n_experts, m.n_used, m.expert_width), (32, 4, 2880));
        assert_eq!(m.clamped_swiglu, Some(7.0));
        let recipe = GgufRecipe {
            preset: Preset::MXFP4_MOE,
            pure: false,
        };
        let (t, _) = plan(&cfg, recipe).unwrap();
        let get = |n: &str| t.iter().find(|x| x.name == n).unwrap();
        assert_eq!(get("blk.0.ffn_gate_exps.weight").ty, GgmlType::MXFP4);
        assert_eq!(get("blk.23.ffn_down_exps.weight").dims, [2880, 2880, 32]);
        assert_eq!(get("blk.23.ffn_down_exps.weight").ty, GgmlType::MXFP4);
        assert_eq!(get("blk.0.attn_q.weight").ty, GgmlType::Q8_0);
        for n in [
            "blk.0.attn_sinks.weight",
            "blk.0.attn_q.bias",
            "blk.0.ffn_gate_inp.weight",
            "blk.0.ffn_gate_inp.bias",
            "blk.0.ffn_down_exps.bias",
            "blk.0.post_attention_norm.weight",
        ] {
            assert_eq!(get(n).ty, GgmlType::F32, "{n}");
        }
        assert_eq!(get("blk.0.ffn_up_exps.bias").dims, [2880, 32]);
        assert!(!t.iter().any(|x| x.name == "blk.0.ffn_norm.weight"));
        let total: u64 = t.iter().map(SynthTensor::numel).sum();
        assert!((20.8e9..21.0e9).contains(&(total as f64)), "{total}");
        let meta = model_metadata(&s, &cfg).unwrap();
        let has = |k: &str, v: GgufValue| meta.iter().any(|(a, b)| a == k && *b == v);
        assert!(has("gpt-oss.attention.sliding_window", GgufValue::U32(128)));
        assert!(has(
            "gpt-oss.expert_feed_forward_length",
            GgufValue::U32(2880)
        ));
        assert!(has("gpt-oss.rope.scaling.type", "yarn".into()));
        assert!(has("gpt-oss.rope.scaling.factor", GgufValue::F32(32.0)));
    }

    #[test]
    fn decode_bytes_of_the_expert_shapes() {
        // What one decoded token reads at Q4_K_M (bench's bandwidth floor): the non-expert
        // weights, one embedding row, and k/E of the experts.
        for (name, vocab, all_gib, token_gib) in [
            ("qwen3-30b-a3b", 151936, (17.0, 17.6), (1.7, 1.9)),
            ("mixtral-8x7b", 32000, (26.0, 27.0), (7.0, 7.7)),
        ] {
            let cfg = SynthShape::by_name(name).unwrap().config(vocab).unwrap();
            let (t, _) = plan(&cfg, q4_k_m()).unwrap();
            let tensors: Vec<(String, Vec<u64>, u64)> = t
                .iter()
                .map(|x| {
                    let rows: u64 = x.dims[1..].iter().product();
                    let rb = x.ty.row_bytes(x.dims[0] as usize).unwrap() as u64;
                    let shape = x.dims.iter().rev().copied().collect();
                    (x.name.clone(), shape, rb * rows)
                })
                .collect();
            let d = crate::convert::source::decode_bytes_of(&tensors, &cfg);
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            eprintln!(
                "{name} Q4_K_M: {:.2} GiB in all, {:.2} GiB experts, {:.3} GiB per token",
                gib(d.all),
                gib(d.experts),
                gib(d.per_token)
            );
            assert!((all_gib.0..all_gib.1).contains(&gib(d.all)), "{name}");
            assert!(
                (token_gib.0..token_gib.1).contains(&gib(d.per_token)),
                "{name}"
            );
        }
    }

    #[test]
    fn vocab_padding_marks_unused_tokens() {
        let s = |v: &[&str]| {
            GgufValue::Array(GgufArray {
                elem_type: GgufValueType::String,
                values: v.iter().map(|x| GgufValue::from(*x)).collect(),
            })
        };
        let mut m: Meta = vec![
            ("tokenizer.ggml.model".into(), "gpt2".into()),
            ("tokenizer.ggml.tokens".into(), s(&["a", "b"])),
            ("tokenizer.ggml.merges".into(), s(&["a b"])),
        ];
        pad_vocab(&mut m, 4).unwrap();
        let get = |k: &str| {
            m.iter()
                .find(|x| x.0 == k)
                .unwrap()
                .1
                .as_array()
                .unwrap()
                .clone()
        };
        assert_eq!(
            get("tokenizer.ggml.tokens").values[3],
            GgufValue::from("[PAD3]")
        );
        assert_eq!(
            get("tokenizer.ggml.token_type").values,
            vec![
                GgufValue::I32(1),
                GgufValue::I32(1),
                GgufValue::I32(5),
                GgufValue::I32(5)
            ]
        );
        assert_eq!(get("tokenizer.ggml.merges").len(), 1);
        assert!(pad_vocab(&mut m, 3).is_err());
    }
}
