//! GGUF metadata for a Hugging Face (or MLX) source: what llama.cpp's `convert_hf_to_gguf.py`
//! writes for the families hf2q supports, and what llama.cpp's loader reads.
//!
//! - `general.*`: architecture, name, file type, quantization version.
//! - `<arch>.*`: context length, widths, block count, heads, key/value length, RMS epsilon, RoPE
//!   base (and linear scaling), vocab size; Gemma 3's sliding window and logit softcap.
//! - `tokenizer.*` from `tokenizer.json` + `tokenizer_config.json`: a byte-level BPE becomes
//!   llama.cpp's `gpt2` model (tokens, token types, merges, and the pre-tokenizer name matched
//!   from the pre-tokenizer's regex, as llama.cpp's converter identifies it by hash); a
//!   byte-fallback BPE (SentencePiece-style, Gemma) becomes the `llama` model with scores that
//!   rank tokens by the merge that makes them. BOS/EOS/UNK/PAD ids, add_bos/add_eos, chat template.
//!
//! Token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.

use std::collections::HashMap;

use hf2q_tensor::io::gguf::{GgufArray, GgufValue, GgufValueType};
use serde_json::Value;

use super::gguf_out::QUANTIZATION_VERSION;
use super::source::SourceModel;
use crate::config::{Arch, ModelConfig};
use crate::{Error, Result};

type Meta = Vec<(String, GgufValue)>;

fn arr(elem: GgufValueType, v: Vec<GgufValue>) -> GgufValue {
    GgufValue::Array(GgufArray::new(elem, v).expect("one element type"))
}

fn strs(v: Vec<String>) -> GgufValue {
    arr(
        GgufValueType::String,
        v.into_iter().map(GgufValue::String).collect(),
    )
}

const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const RE_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The splitting regexes of a pre-tokenizer in order -> llama.cpp `tokenizer.ggml.pre` names
/// (llama.cpp's converter identifies a tokenizer by hashing its output; for the families hf2q
/// supports the regexes decide it).
const PRE_NAMES: &[(&[&str], &str)] = &[
    (&[RE_GPT2], "gpt-2"),
    (&[r"\p{N}", RE_GPT2], "smollm"),
    (&[RE_LLAMA3], "llama-bpe"),
    (&[RE_QWEN2], "qwen2"),
    // o200k (GPT-OSS, Llama 4): llama.cpp's `gpt-4o`.
    (&[crate::tokenizer::gguf::RE_GPT4O], "gpt-4o"),
];

/// The regexes a tokenizer.json `pre_tokenizer` splits with: `Split` patterns, `Digits`
/// (one digit at a time), and `ByteLevel` with `use_regex` (GPT-2's regex).
fn pre_regexes(p: &Value, out: &mut Vec<String>) -> Option<()> {
    match p.get("type")?.as_str()? {
        "Sequence" => {
            for q in p.get("pretokenizers")?.as_array()? {
                pre_regexes(q, out)?;
            }
        }
        "Split" => out.push(p.pointer("/pattern/Regex")?.as_str()?.to_string()),
        "Digits" if p.get("individual_digits")?.as_bool()? => out.push(r"\p{N}".into()),
        "ByteLevel" => {
            if p.get("use_regex").and_then(Value::as_bool) != Some(false) {
                out.push(RE_GPT2.into());
            }
        }
        _ => return None,
    }
    Some(())
}

/// Names the llama.cpp pre-tokenizer equal to a tokenizer.json `pre_tokenizer`.
pub fn pre_tokenizer_name(pre: &Value) -> Result<&'static str> {
    let mut re = Vec::new();
    if pre_regexes(pre, &mut re).is_some() {
        if let Some((_, name)) = PRE_NAMES
            .iter()
            .find(|(r, _)| r.len() == re.len() && r.iter().zip(&re).all(|(a, b)| a == b))
        {
            return Ok(name);
        }
    }
    Err(Error::Tokenizer(format!(
        "this tokenizer.json pre-tokenizer is not one hf2q can name for llama.cpp (known: gpt-2, smollm, llama-bpe, qwen2): {}",
        serde_json::to_string(pre).unwrap_or_default().chars().take(200).collect::<String>()
    )))
}

fn read_json(path: &std::path::Path) -> Result<Value> {
    let s = std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    serde_json::from_str(&s).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
}

/// A token named in tokenizer_config.json (a string, or an AddedToken object).
fn config_token(cfg: &Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        Value::String(s) => Some(s.clone()),
        o => o.get("content").and_then(Value::as_str).map(str::to_string),
    }
}

/// `tokenizer.*` keys from a folder's tokenizer.json + tokenizer_config.json.
pub fn tokenizer_metadata(dir: &std::path::Path, vocab_size: usize) -> Result<Meta> {
    let tj = read_json(&dir.join("tokenizer.json"))?;
    let tc_path = dir.join("tokenizer_config.json");
    let tc = if tc_path.is_file() {
        read_json(&tc_path)?
    } else {
        Value::Null
    };
    let model = tj
        .get("model")
        .ok_or_else(|| Error::Tokenizer("tokenizer.json has no model".into()))?;
    if model.get("type").and_then(Value::as_str) != Some("BPE") {
        return Err(Error::Tokenizer(
            "only BPE tokenizer.json files can be written to GGUF".into(),
        ));
    }
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| Error::Tokenizer("BPE model has no vocab".into()))?;
    let mut texts: Vec<Option<String>> = vec![None; vocab_size];
    let mut types = vec![1i32; vocab_size];
    let mut place = |id: usize, text: &str| -> Result<()> {
        if id >= vocab_size {
            return Err(Error::Tokenizer(format!(
                "token id {id} ('{text}') is beyond the model's vocabulary of {vocab_size}"
            )));
        }
        texts[id] = Some(text.to_string());
        Ok(())
    };
    for (text, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| Error::Tokenizer("vocab ids must be integers".into()))?
            as usize;
        place(id, text)?;
    }
    let added = tj
        .get("added_tokens")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for a in &added {
        let id = a
            .get("id")
            .and_then(Value::as_u64)
            .ok_or_else(|| Error::Tokenizer("added token without id".into()))?
            as usize;
        let content = a.get("content").and_then(Value::as_str).unwrap_or("");
        place(id, content)?;
        types[id] = if a.get("special").and_then(Value::as_bool) == Some(true) {
            3
        } else {
            4
        };
    }
    let byte_fallback = model.get("byte_fallback").and_then(Value::as_bool) == Some(true);
    let unk = model
        .get("unk_token")
        .and_then(Value::as_str)
        .map(str::to_string);
    let tokens: Vec<String> = texts
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.unwrap_or_else(|| {
                types[i] = 4;
                format!("[PAD{i}]")
            })
        })
        .collect();
    let merges: Vec<String> = model
        .get("merges")
        .and_then(Value::as_array)
        .map(|m| {
            m.iter()
                .filter_map(|x| match x {
                    Value::String(s) => Some(s.clone()),
                    Value::Array(p) if p.len() == 2 => {
                        Some(format!("{} {}", p[0].as_str()?, p[1].as_str()?))
                    }
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let id_of: HashMap<&str, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i as u32))
        .collect();
    let mut m: Meta = Vec::new();
    if byte_fallback {
        // SentencePiece-style BPE: llama.cpp merges by token score, so a token made by merge
        // rank r scores -r (earlier merges win), and tokens no merge makes score below all.
        let mut scores = vec![-1e9f32; tokens.len()];
        for (r, mg) in merges.iter().enumerate() {
            if let Some((a, b)) = mg.split_once(' ') {
                if let Some(&id) = id_of.get(format!("{a}{b}").as_str()) {
                    let s = &mut scores[id as usize];
                    *s = s.max(-(r as f32));
                }
            }
        }
        for (i, t) in tokens.iter().enumerate() {
            if t.len() == 6 && t.starts_with("<0x") && t.ends_with('>') && types[i] == 1 {
                types[i] = 6;
            }
            if Some(t) == unk.as_ref() {
                types[i] = 2;
            }
        }
        m.push(("tokenizer.ggml.model".into(), "llama".into()));
        m.push(("tokenizer.ggml.pre".into(), "default".into()));
        m.push(("tokenizer.ggml.tokens".into(), strs(tokens.clone())));
        m.push((
            "tokenizer.ggml.scores".into(),
            arr(
                GgufValueType::F32,
                scores.into_iter().map(GgufValue::F32).collect(),
            ),
        ));
        m.push((
            "tokenizer.ggml.token_type".into(),
            arr(
                GgufValueType::I32,
                types.into_iter().map(GgufValue::I32).collect(),
            ),
        ));
        let prefix = tj
            .get("normalizer")
            .map(|n| n.to_string().contains("Prepend"))
            .unwrap_or(false);
        m.push((
            "tokenizer.ggml.add_space_prefix".into(),
            GgufValue::Bool(prefix),
        ));
    } else {
        let pre = pre_tokenizer_name(tj.get("pre_tokenizer").unwrap_or(&Value::Null))?;
        m.push(("tokenizer.ggml.model".into(), "gpt2".into()));
        m.push(("tokenizer.ggml.pre".into(), pre.into()));
        m.push(("tokenizer.ggml.tokens".into(), strs(tokens.clone())));
        m.push((
            "tokenizer.ggml.token_type".into(),
            arr(
                GgufValueType::I32,
                types.into_iter().map(GgufValue::I32).collect(),
            ),
        ));
        m.push(("tokenizer.ggml.merges".into(), strs(merges)));
    }
    let lookup = |name: Option<String>| name.and_then(|n| id_of.get(n.as_str()).copied());
    for (key, cfg_key) in [
        ("tokenizer.ggml.bos_token_id", "bos_token"),
        ("tokenizer.ggml.eos_token_id", "eos_token"),
        ("tokenizer.ggml.unknown_token_id", "unk_token"),
        ("tokenizer.ggml.padding_token_id", "pad_token"),
    ] {
        let name = config_token(&tc, cfg_key).or_else(|| {
            if cfg_key == "unk_token" {
                unk.clone()
            } else {
                None
            }
        });
        if let Some(id) = lookup(name) {
            m.push((key.into(), GgufValue::U32(id)));
        }
    }
    // add_bos: tokenizer_config's flag, else whether the post-processor inserts the BOS token.
    let bos_name = config_token(&tc, "bos_token");
    let add_bos = tc
        .get("add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or_else(|| {
            let pp = tj
                .get("post_processor")
                .map(|p| p.to_string())
                .unwrap_or_default();
            bos_name
                .as_ref()
                .is_some_and(|b| pp.contains(&format!("\"id\":\"{b}\"")))
        });
    m.push((
        "tokenizer.ggml.add_bos_token".into(),
        GgufValue::Bool(add_bos),
    ));
    if let Some(e) = tc.get("add_eos_token").and_then(Value::as_bool) {
        m.push(("tokenizer.ggml.add_eos_token".into(), GgufValue::Bool(e)));
    }
    if let Some(t) = chat_template(dir, &tc)? {
        m.push(("tokenizer.chat_template".into(), GgufValue::String(t)));
    }
    Ok(m)
}

/// The chat template: tokenizer_config.json's, else `chat_template.jinja` / `chat_template.json`.
fn chat_template(dir: &std::path::Path, tc: &Value) -> Result<Option<String>> {
    if let Some(t) = tc.get("chat_template") {
        return Ok(match t {
            Value::String(s) => Some(s.clone()),
            // A list of named templates: llama.cpp's converter keeps the default one.
            Value::Array(list) => list
                .iter()
                .find(|x| x.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|x| x.get("template").and_then(Value::as_str))
                .map(str::to_string),
            _ => None,
        });
    }
    let j = dir.join("chat_template.jinja");
    if j.is_file() {
        return Ok(Some(std::fs::read_to_string(&j).map_err(|e| {
            Error::Io {
                path: j.clone(),
                source: e,
            }
        })?));
    }
    let j = dir.join("chat_template.json");
    if j.is_file() {
        return Ok(read_json(&j)?
            .get("chat_template")
            .and_then(Value::as_str)
            .map(str::to_string));
    }
    Ok(None)
}

/// Everything llama.cpp needs from a folder source, in the order its converter writes it.
pub fn metadata_from_hf(src: &SourceModel, file_type: u32) -> Result<Meta> {
    let c = &src.config;
    let a = c.arch.name();
    let dir = src
        .dir
        .as_ref()
        .ok_or_else(|| Error::Msg("metadata_from_hf needs a folder source".into()))?;
    if c.arch == Arch::Gemma4 {
        // Its per-layer keys (kv heads, head widths, sliding pattern, MLP widths) and
        // `rope_freqs.weight` are not written yet: refuse rather than write a file that no
        // loader reads as the model.
        return Err(Error::Msg(
            "converting Gemma 4 to GGUF is not supported yet (its per-layer attention keys and \
             rope_freqs are not written); run it from the Hugging Face folder"
                .into(),
        ));
    }
    let k = |s: &str| format!("{a}.{s}");
    let u32v = |x: usize| GgufValue::U32(x as u32);
    let name = dir
        .file_name()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| "model".into());
    let mut m: Meta = vec![
        ("general.architecture".into(), a.into()),
        ("general.type".into(), "model".into()),
        ("general.name".into(), GgufValue::String(name)),
        (k("block_count"), u32v(c.n_layers)),
        (k("context_length"), u32v(c.context_length)),
        (k("embedding_length"), u32v(c.hidden_size)),
        (k("feed_forward_length"), u32v(c.intermediate_size)),
        (k("attention.head_count"), u32v(c.n_heads)),
        (k("attention.head_count_kv"), u32v(c.n_kv_heads)),
        (k("rope.freq_base"), GgufValue::F32(c.rope_theta)),
        (
            k("attention.layer_norm_rms_epsilon"),
            GgufValue::F32(c.rms_eps),
        ),
        (k("attention.key_length"), u32v(c.head_dim)),
        (k("attention.value_length"), u32v(c.head_dim)),
    ];
    if c.arch.permutes_qk() {
        m.push((k("vocab_size"), u32v(c.vocab_size)));
    }
    if c.arch.permutes_qk() || matches!(c.arch, Arch::Phi3 | Arch::Olmo2) {
        m.push((k("rope.dimension_count"), u32v(c.rope_dims)));
    }
    m.extend(llama_variant_metadata(c)?);
    if c.rope_linear_factor != 1.0 {
        m.push((k("rope.scaling.type"), "linear".into()));
        m.push((
            k("rope.scaling.factor"),
            GgufValue::F32(c.rope_linear_factor),
        ));
    }
    if c.arch == Arch::Gemma3 {
        if let Some(w) = c.sliding_window {
            m.push((k("attention.sliding_window"), u32v(w)));
            // llama.cpp's Gemma 3 makes every 6th layer global unless told another period.
            let period = (1..=c.n_layers + 1)
                .find(|&p| c.sliding_layers.iter().enumerate().all(|(i, &s)| s == ((i + 1) % p != 0)))
                .ok_or_else(|| Error::Msg("Gemma 3 sliding-window layers follow no period; llama.cpp cannot express them".into()))?;
            if period != 6 {
                m.push((k("attention.sliding_window_pattern"), u32v(period)));
            }
        }
        if let Some(cap) = c.final_logit_softcap {
            m.push((k("final_logit_softcapping"), GgufValue::F32(cap)));
        }
        // llama.cpp derives Gemma 3's attention scale from the head size; a checkpoint whose
        // query_pre_attn_scalar differs cannot be expressed.
        let want = (c.head_dim as f32).powf(-0.5);
        if (c.attn_scale - want).abs() > want * 1e-6 {
            return Err(Error::Msg(format!(
                "Gemma 3 attention scale {} differs from 1/sqrt(head_dim); llama.cpp's GGUF cannot express it",
                c.attn_scale
            )));
        }
    } else if let Some(w) = c.sliding_window {
        m.push((k("attention.sliding_window"), u32v(w)));
    }
    m.extend(moe_metadata(c));
    m.extend(tokenizer_metadata(dir, c.vocab_size)?);
    m.push((
        "general.quantization_version".into(),
        GgufValue::U32(QUANTIZATION_VERSION),
    ));
    m.push(("general.file_type".into(), GgufValue::U32(file_type)));
    Ok(m)
}

/// The keys of the Llama variants as llama.cpp reads them: Granite's four multipliers,
/// LongRoPE's original context and attention factor (its factors are tensors); SmolLM3's
/// no-RoPE layers have no key (llama.cpp fixes every fourth), so another pattern is refused.
fn llama_variant_metadata(c: &ModelConfig) -> Result<Meta> {
    let k = |s: &str| format!("{}.{s}", c.arch.name());
    let mut m: Meta = Vec::new();
    match c.arch {
        Arch::Granite => {
            m.push((k("embedding_scale"), GgufValue::F32(c.embed_scale)));
            m.push((k("residual_scale"), GgufValue::F32(c.residual_scale)));
            m.push((k("attention.scale"), GgufValue::F32(c.attn_scale)));
            m.push((k("logit_scale"), GgufValue::F32(1.0 / c.logit_scale)));
        }
        // As llama.cpp's converter writes them (the logit scale a divisor, as Granite's).
        Arch::MiniCpm => {
            m.push((k("embedding_scale"), GgufValue::F32(c.embed_scale)));
            m.push((k("residual_scale"), GgufValue::F32(c.residual_scale)));
            m.push((k("logit_scale"), GgufValue::F32(1.0 / c.logit_scale)));
        }
        Arch::SmolLm3 => {
            if (0..c.n_layers).any(|i| c.nope_layers[i] != ((i + 1) % 4 == 0)) {
                return Err(Error::Msg(
                    "SmolLM3 without RoPE on layers other than every fourth: llama.cpp's GGUF                      cannot express it"
                        .into(),
                ));
            }
        }
        Arch::Phi3 => {
            if let Some(l) = &c.longrope {
                m.push((
                    k("rope.scaling.original_context_length"),
                    GgufValue::U32(l.original_max_position as u32),
                ));
                m.push((k("rope.scaling.attn_factor"), GgufValue::F32(l.attn_factor)));
            }
        }
        Arch::GptOss => m.extend(gpt_oss_metadata(c)?),
        _ => {}
    }
    Ok(m)
}

/// GPT-OSS's keys as llama.cpp's converter writes them: YaRN's `rope.scaling.*` (type, factor,
/// original context, betas; the attention factor only where it is not YaRN's default). What
/// llama.cpp fixes for the family (even layers sliding, SwiGLU limit 7) is checked, never
/// silently changed; the ramp's truncation has no key (the loader restores GPT-OSS's own).
pub(crate) fn gpt_oss_metadata(c: &ModelConfig) -> Result<Meta> {
    let k = |s: &str| format!("{}.{s}", c.arch.name());
    let mut m: Meta = Vec::new();
    if c.sliding_window.is_some() && (0..c.n_layers).any(|i| c.sliding_layers[i] != (i % 2 == 0)) {
        return Err(Error::Msg(
            "GPT-OSS whose sliding layers are not the even ones: llama.cpp's GGUF cannot express it"
                .into(),
        ));
    }
    if c.moe.as_ref().and_then(|m| m.clamped_swiglu) != Some(7.0) {
        return Err(Error::Msg(
            "GPT-OSS with a swiglu_limit other than 7: llama.cpp's GGUF cannot express it".into(),
        ));
    }
    if let Some(y) = &c.yarn {
        if y.truncate {
            // GGUF has no key for it and the loader reads GPT-OSS's own `truncate: false`.
            return Err(Error::Msg(
                "GPT-OSS with YaRN truncate true: its GGUF (no key for it) cannot express it"
                    .into(),
            ));
        }
        m.push((k("rope.scaling.type"), "yarn".into()));
        m.push((k("rope.scaling.factor"), GgufValue::F32(y.factor as f32)));
        m.push((
            k("rope.scaling.original_context_length"),
            GgufValue::U32(y.original_max_position as u32),
        ));
        m.push((
            k("rope.scaling.yarn_beta_fast"),
            GgufValue::F32(y.beta_fast as f32),
        ));
        m.push((
            k("rope.scaling.yarn_beta_slow"),
            GgufValue::F32(y.beta_slow as f32),
        ));
        let default = if y.factor <= 1.0 {
            1.0
        } else {
            (0.1 * y.factor.ln() + 1.0) as f32
        };
        if (y.attn_factor - default).abs() > 1e-6 {
            m.push((
                k("rope.scaling.yarn_attn_factor"),
                GgufValue::F32(y.attn_factor),
            ));
        }
    }
    Ok(m)
}

/// The mixture-of-experts keys of `c` as llama.cpp's converter writes them: `expert_count` and
/// `expert_used_count`; Qwen3-MoE's `expert_feed_forward_length` (Mixtral's expert width is its
/// `feed_forward_length`); `expert_weights_norm` only where the chosen experts' probabilities
/// are not renormalised (llama.cpp's graphs for these families always renormalise; hf2q reads
/// the key). Empty for a dense model.
pub fn moe_metadata(c: &ModelConfig) -> Meta {
    let Some(moe) = &c.moe else {
        return Vec::new();
    };
    let k = |s: &str| format!("{}.{s}", c.arch.name());
    let u = |x: usize| GgufValue::U32(x as u32);
    let mut m: Meta = vec![
        (k("expert_count"), u(moe.n_experts)),
        (k("expert_used_count"), u(moe.n_used)),
    ];
    if c.arch != Arch::Llama {
        m.push((k("expert_feed_forward_length"), u(moe.expert_width)));
    }
    if !moe.renormalize {
        m.push((k("expert_weights_norm"), GgufValue::Bool(false)));
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_known_pre_tokenizers() {
        assert_eq!(
            pre_tokenizer_name(&json!({"type": "ByteLevel", "use_regex": true})).unwrap(),
            "gpt-2"
        );
        let smol = json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, {"type": "ByteLevel", "use_regex": true}]});
        assert_eq!(pre_tokenizer_name(&smol).unwrap(), "smollm");
        let qwen = json!({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": RE_QWEN2}}, {"type": "ByteLevel", "use_regex": false}]});
        let gguf_smol = json!({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": r"\p{N}"}}, {"type": "Split", "pattern": {"Regex": RE_GPT2}}, {"type": "ByteLevel", "use_regex": false}]});
        assert_eq!(pre_tokenizer_name(&gguf_smol).unwrap(), "smollm");
        assert_eq!(pre_tokenizer_name(&qwen).unwrap(), "qwen2");
        let o200k = json!({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": crate::tokenizer::gguf::RE_GPT4O}, "behavior": "Isolated", "invert": false}, {"type": "ByteLevel", "use_regex": false}]});
        assert_eq!(pre_tokenizer_name(&o200k).unwrap(), "gpt-4o");
        assert!(pre_tokenizer_name(&json!({"type": "Whitespace"})).is_err());
    }
}
