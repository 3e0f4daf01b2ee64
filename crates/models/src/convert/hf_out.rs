//! Writing a Hugging Face folder: config.json, safetensors shards with
//! `model.safetensors.index.json`, tokenizer files, generation_config.json.
//!
//! Conventions are transformers' `save_pretrained` (shards `model-00001-of-0000N.safetensors`,
//! an index `{"metadata": {"total_size"}, "weight_map"}`; one shard is `model.safetensors`) and
//! mlx-lm's, which [`super::mlx_out`] shares through [`ShardWriter`]. Tensors are written in HF
//! layout (unpermuted Llama q/k, Gemma norms without the +1).
//!
//! From a GGUF source the config is rebuilt from [`ModelConfig`] and the tokenizer files from
//! the GGUF tokenizer metadata; from a folder they are copied (an MLX folder's `quantization`
//! block removed).
//!
//! GPT-OSS keeps its experts in MXFP4 (`*_blocks` / `*_scales`, gate and up interleaved) and its
//! `quantization_config`: [`super::hf_gpt_oss`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hf2q_tensor::io::safetensors::{write_safetensors, StDtype};
use hf2q_tensor::quant::float::{f32_to_bf16_bits, f32_to_f16_bits};
use serde_json::{json, Map, Value};

use super::gguf_out::WriteReport;
use super::source::{Layout, SourceModel, Stored};
use super::{finish_dir, json_text, start_dir, write_text, Progress};
use crate::config::{Activation, Arch, ModelConfig};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// Default largest shard (transformers' default is 5 GB; smaller shards bound memory, since a
/// shard is assembled in memory before it is written).
pub const DEFAULT_SHARD_BYTES: usize = 2 << 30;

/// Files copied from a folder source besides weights and config.
const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
];

/// f32 values as little-endian bytes of `dtype` (F32, F16 or BF16).
pub fn encode_floats(v: &[f32], dtype: StDtype) -> Result<Vec<u8>> {
    Ok(match dtype {
        StDtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        StDtype::F16 => v
            .iter()
            .flat_map(|x| f32_to_f16_bits(*x).to_le_bytes())
            .collect(),
        StDtype::BF16 => v
            .iter()
            .flat_map(|x| f32_to_bf16_bits(*x).to_le_bytes())
            .collect(),
        other => return Err(Error::Msg(format!("cannot store weights as {other}"))),
    })
}

pub fn torch_dtype_name(d: StDtype) -> &'static str {
    match d {
        StDtype::F32 => "float32",
        StDtype::BF16 => "bfloat16",
        _ => "float16",
    }
}

/// The float dtype a folder output uses by default: the source's own when all its float tensors
/// share one, else F16 (quantized sources).
pub fn default_dtype(src: &SourceModel) -> StDtype {
    let mut seen = None;
    for t in &src.tensors {
        let d = match t.stored {
            Stored::Ggml(hf2q_tensor::GgmlType::F32) if t.shape.len() == 1 => continue,
            // GPT-OSS's experts are written as the MXFP4 blocks they are.
            Stored::Ggml(hf2q_tensor::GgmlType::MXFP4) => continue,
            Stored::Ggml(hf2q_tensor::GgmlType::F32) => StDtype::F32,
            Stored::Ggml(hf2q_tensor::GgmlType::F16) => StDtype::F16,
            Stored::Ggml(hf2q_tensor::GgmlType::BF16) => StDtype::BF16,
            _ => return StDtype::F16,
        };
        match seen {
            None => seen = Some(d),
            Some(s) if s != d => return StDtype::F16,
            _ => {}
        }
    }
    seen.unwrap_or(StDtype::F32)
}

/// Writes safetensors shards of at most `max_bytes` as tensors arrive, then the index.
pub struct ShardWriter {
    dir: PathBuf,
    max_bytes: usize,
    metadata: BTreeMap<String, String>,
    pending: Vec<(String, StDtype, Vec<usize>, Vec<u8>)>,
    pending_bytes: usize,
    /// (temporary shard file, tensor names in it)
    shards: Vec<(PathBuf, Vec<String>)>,
    pub total_bytes: u64,
    /// Parameters counted as the float model has them (mlx-lm's `total_parameters`).
    pub total_parameters: u64,
}

impl ShardWriter {
    pub fn new(dir: &Path, max_bytes: usize, metadata: BTreeMap<String, String>) -> ShardWriter {
        ShardWriter {
            dir: dir.to_path_buf(),
            max_bytes: max_bytes.max(1),
            metadata,
            pending: Vec::new(),
            pending_bytes: 0,
            shards: Vec::new(),
            total_bytes: 0,
            total_parameters: 0,
        }
    }

    pub fn add(
        &mut self,
        name: String,
        dtype: StDtype,
        shape: Vec<usize>,
        data: Vec<u8>,
    ) -> Result<()> {
        if !self.pending.is_empty() && self.pending_bytes + data.len() > self.max_bytes {
            self.flush()?;
        }
        self.pending_bytes += data.len();
        self.total_bytes += data.len() as u64;
        self.pending.push((name, dtype, shape, data));
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let path = self
            .dir
            .join(format!(".shard-{:05}.partial", self.shards.len() + 1));
        let refs: Vec<_> = self
            .pending
            .iter()
            .map(|(n, d, s, b)| (n.clone(), *d, s.clone(), b.as_slice()))
            .collect();
        write_safetensors(&path, &refs, &self.metadata)?;
        self.shards
            .push((path, self.pending.iter().map(|p| p.0.clone()).collect()));
        self.pending.clear();
        self.pending_bytes = 0;
        Ok(())
    }

    /// Writes the last shard, names the shards and writes `model.safetensors.index.json`.
    pub fn finish(mut self, with_parameters: bool) -> Result<()> {
        self.flush()?;
        let n = self.shards.len();
        let mut weight_map = BTreeMap::new();
        for (i, (tmp, names)) in self.shards.iter().enumerate() {
            let file = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{n:05}.safetensors", i + 1)
            };
            let dst = self.dir.join(&file);
            std::fs::rename(tmp, &dst).map_err(|e| Error::Io {
                path: dst.clone(),
                source: e,
            })?;
            for name in names {
                weight_map.insert(name.clone(), Value::String(file.clone()));
            }
        }
        let mut meta = Map::new();
        meta.insert("total_size".into(), json!(self.total_bytes));
        if with_parameters {
            meta.insert("total_parameters".into(), json!(self.total_parameters));
        }
        let index = json!({ "metadata": meta, "weight_map": weight_map });
        write_text(
            &self.dir.join("model.safetensors.index.json"),
            &json_text(&index),
        )
    }
}

fn hf_class(c: &ModelConfig) -> (&'static str, &'static str) {
    match c.arch {
        Arch::Llama if c.moe.is_some() => ("MixtralForCausalLM", "mixtral"),
        Arch::Llama => ("LlamaForCausalLM", "llama"),
        Arch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        Arch::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        Arch::Qwen3Moe => ("Qwen3MoeForCausalLM", "qwen3_moe"),
        Arch::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
        Arch::Gemma4 => ("Gemma4ForCausalLM", "gemma4_text"),
        Arch::Phi3 => ("Phi3ForCausalLM", "phi3"),
        Arch::SmolLm3 => ("SmolLM3ForCausalLM", "smollm3"),
        Arch::Granite => ("GraniteForCausalLM", "granite"),
        Arch::Olmo2 => ("Olmo2ForCausalLM", "olmo2"),
        Arch::MiniCpm => ("MiniCPMForCausalLM", "minicpm"),
        Arch::GptOss => ("GptOssForCausalLM", "gpt_oss"),
    }
}

/// The experts' keys of a config.json (as [`ModelConfig::from_hf_json`] reads them).
fn insert_moe(m: &mut Map<String, Value>, c: &ModelConfig) {
    let Some(moe) = &c.moe else { return };
    m.insert("num_experts_per_tok".into(), json!(moe.n_used));
    if c.arch == Arch::Qwen3Moe {
        let dense: Vec<usize> = (0..c.n_layers).filter(|&i| !moe.layers[i]).collect();
        m.insert("num_experts".into(), json!(moe.n_experts));
        m.insert("moe_intermediate_size".into(), json!(moe.expert_width));
        m.insert("norm_topk_prob".into(), json!(moe.renormalize));
        m.insert("decoder_sparse_step".into(), json!(1));
        m.insert("mlp_only_layers".into(), json!(dense));
    } else {
        // Mixtral: every layer routed, `intermediate_size` is the expert width.
        m.insert("num_local_experts".into(), json!(moe.n_experts));
        m.insert("intermediate_size".into(), json!(moe.expert_width));
    }
}

/// A config.json for `c` (a GGUF source), readable by transformers and by [`ModelConfig::from_hf_json`].
pub fn config_from_model(
    c: &ModelConfig,
    tok: Option<&Tokenizer>,
    dtype: StDtype,
) -> Result<Value> {
    let (class, model_type) = hf_class(c);
    let mut m = Map::new();
    m.insert("architectures".into(), json!([class]));
    m.insert("model_type".into(), json!(model_type));
    m.insert("hidden_size".into(), json!(c.hidden_size));
    m.insert("intermediate_size".into(), json!(c.intermediate_size));
    m.insert("num_hidden_layers".into(), json!(c.n_layers));
    m.insert("num_attention_heads".into(), json!(c.n_heads));
    m.insert("num_key_value_heads".into(), json!(c.n_kv_heads));
    m.insert("head_dim".into(), json!(c.head_dim));
    m.insert("rms_norm_eps".into(), json!(c.rms_eps));
    m.insert("rope_theta".into(), json!(c.rope_theta));
    m.insert("max_position_embeddings".into(), json!(c.context_length));
    m.insert("vocab_size".into(), json!(c.vocab_size));
    m.insert("tie_word_embeddings".into(), json!(c.tie_embeddings));
    m.insert("attention_bias".into(), json!(c.attention_bias));
    m.insert("torch_dtype".into(), json!(torch_dtype_name(dtype)));
    insert_moe(&mut m, c);
    if let Some(t) = tok {
        if let Some(b) = t.bos_id() {
            m.insert("bos_token_id".into(), json!(b));
        }
        if let Some(e) = t.eos_id() {
            m.insert("eos_token_id".into(), json!(e));
        }
    }
    match c.activation {
        Activation::Silu => m.insert("hidden_act".into(), json!("silu")),
        Activation::GeluTanh => m.insert("hidden_activation".into(), json!("gelu_pytorch_tanh")),
    };
    if let Some(s) = &c.llama3_scaling {
        m.insert(
            "rope_scaling".into(),
            json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position,
            }),
        );
    } else if c.rope_linear_factor != 1.0 {
        m.insert(
            "rope_scaling".into(),
            json!({ "rope_type": "linear", "factor": c.rope_linear_factor }),
        );
    }
    if c.arch == Arch::Gemma3 {
        m.insert("sliding_window".into(), json!(c.sliding_window));
        m.insert(
            "rope_local_base_freq".into(),
            json!(c.rope_theta_local.unwrap_or(10000.0)),
        );
        // GGUF keeps 1/sqrt(Dh) as the attention scale.
        m.insert(
            "query_pre_attn_scalar".into(),
            json!((1.0 / (c.attn_scale * c.attn_scale)).round()),
        );
        m.insert("layer_types".into(), layer_types(c));
        if let Some(cap) = c.final_logit_softcap {
            m.insert("final_logit_softcapping".into(), json!(cap));
        }
    } else if c.sliding_window.is_some() {
        m.insert("use_sliding_window".into(), json!(true));
        m.insert("sliding_window".into(), json!(c.sliding_window));
    }
    insert_llama_variant(&mut m, c);
    Ok(Value::Object(m))
}

/// The Llama variants' own keys (as [`ModelConfig::from_hf_json`] reads them).
/// transformers' `layer_types`: each layer's attention, `sliding_attention` or `full_attention`.
pub(super) fn layer_types(c: &ModelConfig) -> Value {
    let types: Vec<&str> = c
        .sliding_layers
        .iter()
        .map(|&s| {
            if s {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    json!(types)
}

fn insert_llama_variant(m: &mut Map<String, Value>, c: &ModelConfig) {
    match c.arch {
        Arch::Phi3 => {
            if c.rope_dims != c.head_dim {
                m.insert(
                    "partial_rotary_factor".into(),
                    json!(c.rope_dims as f64 / c.head_dim as f64),
                );
            }
            if let Some(l) = &c.longrope {
                m.insert(
                    "original_max_position_embeddings".into(),
                    json!(l.original_max_position),
                );
                m.insert(
                    "rope_scaling".into(),
                    json!({
                        "type": "longrope",
                        "short_factor": l.short_factor,
                        "long_factor": l.long_factor,
                        "attention_factor": l.attn_factor,
                    }),
                );
            }
        }
        Arch::SmolLm3 => {
            let layers: Vec<u8> = c.nope_layers.iter().map(|&n| u8::from(!n)).collect();
            m.insert("no_rope_layers".into(), json!(layers));
        }
        Arch::Granite => {
            m.insert("embedding_multiplier".into(), json!(c.embed_scale));
            m.insert("residual_multiplier".into(), json!(c.residual_scale));
            m.insert("attention_multiplier".into(), json!(c.attn_scale));
            m.insert("logits_scaling".into(), json!(1.0 / c.logit_scale));
        }
        Arch::MiniCpm => {
            for (k, v) in crate::config::minicpm::hf_keys(c) {
                m.insert(k.into(), json!(v));
            }
        }
        Arch::GptOss => super::hf_gpt_oss::insert_keys(m, c),
        _ => {}
    }
}

/// config.json for a folder output: the source's (without MLX's quantization block) or rebuilt.
pub fn output_config(src: &SourceModel, tok: Option<&Tokenizer>, dtype: StDtype) -> Result<Value> {
    match &src.hf_config {
        Some(v) => {
            let mut v = v.clone();
            if let Some(o) = v.as_object_mut() {
                o.remove("quantization");
                o.remove("quantization_config");
                if src.config.arch == Arch::GptOss {
                    // Its experts stay MXFP4 (check_hf refused any other method).
                    o.insert(
                        "quantization_config".into(),
                        super::hf_gpt_oss::quantization_config(),
                    );
                }
                o.insert("torch_dtype".into(), json!(torch_dtype_name(dtype)));
                add_legacy_rope_keys(o, &src.config);
            }
            Ok(v)
        }
        None => {
            let mut c = src.config.clone();
            c.llama3_scaling = llama3_scaling_from_gguf(src)?;
            config_from_model(&c, tok, dtype)
        }
    }
}

/// Recovers Llama 3 RoPE scaling parameters from a GGUF `rope_freqs.weight` (the per-frequency
/// divisors llama.cpp's converter computed from them), so config.json can carry them again.
///
/// The divisors are 1 for wavelengths below `orig / high`, `factor` above `orig / low`, and
/// `1 / ((1 - s) / factor + s)` with `s = (orig / wavelen - low) / (high - low)` between. Only
/// the ratios matter, so `low` is fixed at 1; `orig` and `high` come from the smooth entries
/// (two or more determine them; with one or none the boundaries are placed between the
/// neighbouring wavelengths). The result is checked by recomputing every divisor.
pub fn llama3_scaling_from_gguf(src: &SourceModel) -> Result<Option<crate::config::Llama3Scaling>> {
    use crate::config::Llama3Scaling;
    let Some(t) = src.tensor_by_gguf(super::source::ROPE_FREQS) else {
        return Ok(None);
    };
    let d: Vec<f64> = src
        .read_f32(t, Layout::Gguf)?
        .iter()
        .map(|&x| x as f64)
        .collect();
    let fail = || {
        Error::Msg("rope_freqs.weight does not follow Llama 3's frequency scaling; config.json cannot express it".into())
    };
    let factor = d.iter().cloned().fold(1.0, f64::max);
    if d.iter().all(|&x| x == 1.0) {
        return Ok(None);
    }
    let c = &src.config;
    let wav: Vec<f64> = (0..d.len())
        .map(|i| {
            2.0 * std::f64::consts::PI
                * (c.rope_theta as f64).powf(2.0 * i as f64 / c.head_dim as f64)
        })
        .collect();
    let tol = 1e-5;
    let smooth: Vec<usize> = (0..d.len())
        .filter(|&i| d[i] > 1.0 + tol && d[i] < factor * (1.0 - tol))
        .collect();
    let s_of = |i: usize| (1.0 / d[i] - 1.0 / factor) / (1.0 - 1.0 / factor);
    let last_one = (0..d.len())
        .filter(|&i| (d[i] - 1.0).abs() <= tol)
        .map(|i| wav[i])
        .fold(0.0, f64::max);
    let first_full = (0..d.len())
        .filter(|&i| d[i] >= factor * (1.0 - tol))
        .map(|i| wav[i])
        .fold(f64::INFINITY, f64::min);
    let (orig, high) = match smooth.as_slice() {
        [] => {
            let hw = if last_one > 0.0 && first_full.is_finite() {
                (last_one * first_full).sqrt()
            } else {
                return Err(fail());
            };
            (hw * (1.0 + 1e-6), 1.0 + 1e-6)
        }
        [i] => {
            let upper = if first_full.is_finite() {
                first_full
            } else {
                wav[*i] * 4.0
            };
            let orig = (wav[*i] * upper).sqrt();
            (orig, 1.0 + (orig / wav[*i] - 1.0) / s_of(*i))
        }
        many => {
            let (a, b) = (many[0], many[many.len() - 1]);
            // s (high - 1) = orig / w - 1 at two wavelengths.
            let (sa, sb) = (s_of(a), s_of(b));
            let orig = (sa - sb) / (sa / wav[b] - sb / wav[a]);
            (orig, 1.0 + (orig / wav[a] - 1.0) / sa)
        }
    };
    if !(orig.is_finite() && high.is_finite() && high > 1.0 && orig > 0.0) {
        return Err(fail());
    }
    let s = Llama3Scaling {
        factor: factor as f32,
        low_freq_factor: 1.0,
        high_freq_factor: high as f32,
        original_max_position: orig.round().max(1.0) as usize,
    };
    let mut check = src.config.clone();
    check.llama3_scaling = Some(s.clone());
    // original_max_position is an integer in config.json: if rounding it moved a divisor, the
    // exact value is kept by scaling low/high instead.
    let ok = |cfg: &crate::config::ModelConfig| {
        cfg.llama3_freq_factors().is_some_and(|f| {
            f.iter()
                .zip(&d)
                .all(|(&x, &y)| ((x as f64) - y).abs() <= 1e-4 * y)
        })
    };
    if ok(&check) {
        return Ok(Some(s));
    }
    let k = orig.round().max(1.0) / orig;
    let s2 = Llama3Scaling {
        low_freq_factor: k as f32,
        high_freq_factor: (high * k) as f32,
        ..s
    };
    check.llama3_scaling = Some(s2.clone());
    if ok(&check) {
        Ok(Some(s2))
    } else {
        Err(fail())
    }
}

/// transformers 5 writes RoPE settings only as `rope_parameters` (Gemma 3: keyed by layer type,
/// with `layer_types`); readers written before it (mlx-lm 0.32 among them) look for the older
/// top-level keys. Adds `rope_theta`, `rope_scaling`, and Gemma 3's `rope_local_base_freq` and
/// `sliding_window_pattern` where missing, with the values the config already implies.
fn add_legacy_rope_keys(o: &mut Map<String, Value>, c: &ModelConfig) {
    if !o.contains_key("rope_parameters") {
        return;
    }
    o.entry("rope_theta").or_insert(json!(c.rope_theta));
    if !o.contains_key("rope_scaling") {
        if let Some(s) = &c.llama3_scaling {
            o.insert(
                "rope_scaling".into(),
                json!({ "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                        "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position }),
            );
        } else if c.rope_linear_factor != 1.0 {
            o.insert(
                "rope_scaling".into(),
                json!({ "rope_type": "linear", "factor": c.rope_linear_factor }),
            );
        }
    }
    if c.arch == Arch::Gemma3 {
        if let Some(t) = c.rope_theta_local {
            o.entry("rope_local_base_freq").or_insert(json!(t));
        }
        let period = (1..=c.n_layers + 1).find(|&p| {
            c.sliding_layers
                .iter()
                .enumerate()
                .all(|(i, &s)| s == ((i + 1) % p != 0))
        });
        if let (Some(p), false) = (period, o.contains_key("sliding_window_pattern")) {
            o.insert("sliding_window_pattern".into(), json!(p));
        }
    }
}

/// Tokenizer and generation files: copied from a folder source, rebuilt from GGUF metadata.
pub fn write_tokenizer_files(src: &SourceModel, dir: &Path, progress: &dyn Progress) -> Result<()> {
    if let Some(from) = &src.dir {
        for f in TOKENIZER_FILES {
            let p = from.join(f);
            if p.is_file() {
                std::fs::copy(&p, dir.join(f)).map_err(|e| Error::Io {
                    path: p.clone(),
                    source: e,
                })?;
            }
        }
        if !dir.join("tokenizer.json").is_file() {
            progress.warn("the source folder has no tokenizer.json; the output has none either");
        }
        return Ok(());
    }
    let file = src
        .gguf_file()
        .ok_or_else(|| Error::Msg("source has neither a folder nor a GGUF file".into()))?;
    let tok = Tokenizer::from_gguf(file)?;
    write_text(&dir.join("tokenizer.json"), &tok.to_tokenizer_json()?)?;
    let name = |id: Option<u32>| id.and_then(|i| tok.token_to_str(i)).map(str::to_string);
    let mut tc = Map::new();
    tc.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    tc.insert("clean_up_tokenization_spaces".into(), json!(false));
    tc.insert("model_max_length".into(), json!(src.config.context_length));
    if let Some(b) = name(tok.bos_id()) {
        tc.insert("bos_token".into(), json!(b));
    }
    if let Some(e) = name(tok.eos_id()) {
        tc.insert("eos_token".into(), json!(e));
    }
    for (key, gkey) in [
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(t) = name(file.get_u64(gkey).map(|x| x as u32)) {
            tc.insert(key.into(), json!(t));
        }
    }
    tc.insert("add_bos_token".into(), json!(tok.add_bos()));
    tc.insert("add_eos_token".into(), json!(tok.add_eos()));
    if let Some(t) = tok.chat_template() {
        tc.insert("chat_template".into(), json!(t));
    }
    write_text(
        &dir.join("tokenizer_config.json"),
        &json_text(&Value::Object(tc)),
    )?;
    let mut gen = Map::new();
    if let Some(b) = tok.bos_id() {
        gen.insert("bos_token_id".into(), json!(b));
    }
    if let Some(e) = tok.eos_id() {
        gen.insert("eos_token_id".into(), json!(e));
    }
    write_text(
        &dir.join("generation_config.json"),
        &json_text(&Value::Object(gen)),
    )
}

/// Options of an HF folder output.
#[derive(Clone, Debug)]
pub struct HfOptions {
    /// Weight dtype (F32, F16, BF16); `None`: [`default_dtype`].
    pub dtype: Option<StDtype>,
    pub shard_bytes: usize,
}

impl Default for HfOptions {
    fn default() -> Self {
        HfOptions {
            dtype: None,
            shard_bytes: DEFAULT_SHARD_BYTES,
        }
    }
}

/// The checkpoint tensors (name, shape) one source tensor is written as, in the order of its
/// values: stacked experts `(E, R, C)` become one matrix per expert under the names the
/// families' checkpoints use and transformers 5 loads (Qwen3-MoE
/// `mlp.experts.E.{gate,up,down}_proj.weight`, Mixtral `block_sparse_moe.experts.E.{w1,w3,w2}`),
/// Mixtral's router is `block_sparse_moe.gate`; every other tensor is itself.
pub fn checkpoint_tensors(
    c: &ModelConfig,
    t: &super::source::SrcTensor,
) -> Vec<(String, Vec<usize>)> {
    let mixtral = c.arch == Arch::Llama && c.moe.is_some();
    if let (Some((layer, part)), &[e, r, k]) = (super::source::stacked_expert(&t.hf), &t.shape[..])
    {
        return (0..e)
            .map(|i| {
                let name = if mixtral {
                    let w = ["w1", "w3", "w2"][part];
                    format!("model.layers.{layer}.block_sparse_moe.experts.{i}.{w}.weight")
                } else {
                    let p = super::source::EXPERT_PARTS[part];
                    format!("model.layers.{layer}.mlp.experts.{i}.{p}.weight")
                };
                (name, vec![r, k])
            })
            .collect();
    }
    let name = match t.hf.strip_suffix(".mlp.gate.weight") {
        Some(stem) if mixtral => format!("{stem}.block_sparse_moe.gate.weight"),
        _ => t.hf.clone(),
    };
    vec![(name, t.shape.clone())]
}

/// Writes `src` as a Hugging Face folder at `out` (which must not exist, or be empty).
pub fn write_hf(
    src: &SourceModel,
    out: &Path,
    opts: &HfOptions,
    progress: &dyn Progress,
) -> Result<WriteReport> {
    let dtype = opts.dtype.unwrap_or_else(|| default_dtype(src));
    if !matches!(dtype, StDtype::F32 | StDtype::F16 | StDtype::BF16) {
        return Err(Error::Msg(format!(
            "HF output dtype must be F32, F16 or BF16, not {dtype}"
        )));
    }
    let tmp = start_dir(out)?;
    let result = (|| -> Result<WriteReport> {
        let tok = match src.gguf_file() {
            Some(f) => Some(Tokenizer::from_gguf(f)?),
            None => None,
        };
        let config = output_config(src, tok.as_ref(), dtype)?;
        let mut shards = ShardWriter::new(
            &tmp,
            opts.shard_bytes,
            BTreeMap::from([("format".to_string(), "pt".to_string())]),
        );
        let mut report = WriteReport::default();
        let gpt_oss = src.config.arch == Arch::GptOss;
        let mut order: Vec<usize> = (0..src.tensors.len()).collect();
        order.sort_by(|&a, &b| src.tensors[a].hf.cmp(&src.tensors[b].hf));
        progress.start(order.len());
        for (k, i) in order.into_iter().enumerate() {
            let t = &src.tensors[i];
            if gpt_oss && super::hf_gpt_oss::is_expert_tensor(t) {
                continue; // below, in the checkpoint's MXFP4 layout
            }
            if t.hf == super::source::ROPE_FREQS {
                continue; // refused above by the config builder when it matters
            }
            if t.hf == super::source::ROPE_FACTORS_SHORT || t.hf == super::source::ROPE_FACTORS_LONG
            {
                continue; // config.json's rope_scaling carries them
            }
            let x = src.read_f32(t, Layout::Hf)?;
            let parts = checkpoint_tensors(&src.config, t);
            let mut at = 0usize;
            for (name, shape) in parts {
                let n: usize = shape.iter().product();
                let part = x.get(at..at + n).ok_or_else(|| {
                    Error::Msg(format!("tensor '{}': fewer values than its parts", t.hf))
                })?;
                at += n;
                // Norms and biases stay in the chosen dtype too, as save_pretrained writes them.
                let bytes = encode_floats(part, dtype)?;
                report.tensors.push((
                    name.clone(),
                    t.stored.name(),
                    dtype.name().to_string(),
                    n as u64,
                    bytes.len() as u64,
                ));
                shards.add(name, dtype, shape, bytes)?;
            }
            progress.tensor(k + 1, &t.hf, &t.stored.name(), dtype.name());
        }
        if gpt_oss {
            super::hf_gpt_oss::write_experts(src, &mut shards, &mut report, dtype)?;
        }
        progress.finish();
        shards.finish(false)?;
        write_text(&tmp.join("config.json"), &json_text(&config))?;
        write_tokenizer_files(src, &tmp, progress)?;
        Ok(report)
    })();
    match result {
        Ok(mut r) => {
            finish_dir(&tmp, out)?;
            r.bytes_written = dir_size(out);
            Ok(r)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}

pub fn dir_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}
