//! A model opened for conversion: its tensors listed under both names (HF and GGUF), their stored
//! types, and f32 reads in either tensor layout.
//!
//! Two layouts differ by more than names (llama.cpp's `convert_hf_to_gguf.py` is the reference):
//!
//! - **Llama q/k rows.** The converter permutes `q_proj` / `k_proj` rows (`permute(w, n_head,
//!   n_head_kv)`) so that ggml's interleaved RoPE equals HF's `rotate_half`: within each head, HF
//!   row `j * Dh/2 + i` (half j, pair i) becomes GGUF row `2 i + j`.
//! - **Gemma norms.** Gemma computes `x * (1 + w)`; the converter stores `w + 1` for every
//!   `*norm.weight`.
//!
//! [`SourceModel::read_f32`] reads a tensor in either layout, converting when the source's layout
//! differs, so writers never think about it.
//!
//! Routed experts (Qwen3-MoE, Mixtral) are listed as llama.cpp stores them whatever the source:
//! per layer three stacked tensors `mlp.experts.{gate,up,down}_proj.weight` (HF-side names of
//! `ffn_{gate,up,down}_exps`) of shape `(E, F, D)` / `(E, D, F)`. A folder's per-expert or fused
//! tensors are read into that form (expert after expert, as ggml's layout is), so every writer
//! sees one 3-D tensor; [`super::hf_out`] splits it again into the checkpoint's own names.
//! GPT-OSS's MXFP4 experts are listed the same way (stored type MXFP4, gate and up apart, as
//! llama.cpp's converter writes them) with their biases beside them (`super::stacked`).

use std::path::{Path, PathBuf};

use hf2q_tensor::io::gguf::GgufFile;
use hf2q_tensor::io::safetensors::StDtype;
use hf2q_tensor::quant::mlx::AffineParams;
use hf2q_tensor::{Bytes, GgmlType};
use rayon::prelude::*;
use serde_json::Value;

use super::stacked::{stacked_expert_bias, stacked_tensors};
use crate::config::{Arch, ModelConfig};
use crate::names::hf_to_gguf;
use crate::source::{read_config_json, resolve_hf_cache, Format, WeightSource};
use crate::{Error, Result};

/// GGUF's (and hf2q's HF-side) name of Llama 3's RoPE frequency factors.
pub const ROPE_FREQS: &str = "rope_freqs.weight";
/// LongRoPE's factors in GGUF (config.json keeps them in `rope_parameters`).
pub const ROPE_FACTORS_SHORT: &str = "rope_factors_short.weight";
pub const ROPE_FACTORS_LONG: &str = "rope_factors_long.weight";

/// Which naming/orientation convention tensor values follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// GGUF (llama.cpp converter): permuted Llama q/k rows, Gemma norms stored as 1 + w.
    Gguf,
    /// Hugging Face / MLX checkpoints.
    Hf,
}

/// How a source tensor is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    Ggml(GgmlType),
    /// MLX affine (bits, group); scales/biases beside it.
    Affine(AffineParams),
}

impl Stored {
    pub fn name(&self) -> String {
        match self {
            Stored::Ggml(t) => t.to_string(),
            Stored::Affine(p) => format!("mlx{}g{}", p.bits, p.group_size),
        }
    }
    /// Whether reading it as f32 loses nothing relative to its own values (float storage).
    pub fn is_float(&self) -> bool {
        matches!(
            self,
            Stored::Ggml(GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
        )
    }
}

/// One tensor of the source.
#[derive(Clone, Debug)]
pub struct SrcTensor {
    /// Hugging Face name (`model.layers.0.self_attn.q_proj.weight`).
    pub hf: String,
    /// GGUF name (`blk.0.attn_q.weight`).
    pub gguf: String,
    /// Row-major shape, outermost first: `(R, C)` for a matrix, `(N)` for a vector.
    pub shape: Vec<usize>,
    pub stored: Stored,
}

impl SrcTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Row length (C, or N for a vector).
    pub fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&0)
    }
    pub fn rows(&self) -> usize {
        self.numel() / self.cols().max(1)
    }
    /// GGUF dims (ne0 first).
    pub fn gguf_dims(&self) -> Vec<u64> {
        self.shape.iter().rev().map(|&d| d as u64).collect()
    }
}

/// A model opened for reading every tensor.
pub struct SourceModel {
    pub path: PathBuf,
    pub weights: WeightSource,
    pub config: ModelConfig,
    /// config.json of a folder source.
    pub hf_config: Option<Value>,
    /// The folder of a safetensors/MLX source (tokenizer files live there).
    pub dir: Option<PathBuf>,
    /// Every tensor, in the source's own order.
    pub tensors: Vec<SrcTensor>,
    /// Values added to tensors as they are read, by HF name, in HF layout (`(R, C)` as the
    /// tensor): a fused adapter's `B·A·scale` (`crate::adapter::fuse`). A tensor with a delta is
    /// never copied as stored bytes.
    pub deltas: std::collections::HashMap<String, Vec<f32>>,
}

/// HF per-layer module names that the name table knows, for inverting it (the mapping itself is
/// `names::hf_to_gguf`).
const HF_LAYER_PARTS: &[&str] = &[
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    // Phi-3's fused products (after `mlp.up_proj`: its `ffn_up` is the fused gate/up).
    "self_attn.qkv_proj",
    "mlp.gate_up_proj",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "post_attention_layernorm",
];
const HF_GLOBALS: &[&str] = &[
    "model.embed_tokens",
    "model.norm",
    "lm_head",
    "rope_freqs",
    "rope_factors_short",
    "rope_factors_long",
];

/// The router and the stacked experts of a routed layer (Qwen3-MoE and Mixtral alike; Gemma 4
/// names its own).
const HF_MOE_PARTS: &[&str] = &[
    "mlp.gate",
    "mlp.experts.gate_proj",
    "mlp.experts.up_proj",
    "mlp.experts.down_proj",
];

/// The three stacked expert tensors, in `hf2q_tensor::moe::Experts`' order.
pub const EXPERT_PARTS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// `(layer, part)` of a stacked experts tensor's HF name
/// (`model.layers.N.mlp.experts.{gate,up,down}_proj.weight`; part indexes [`EXPERT_PARTS`]).
pub fn stacked_expert(hf: &str) -> Option<(usize, usize)> {
    let (l, part) = hf
        .strip_prefix("model.layers.")?
        .split_once(".mlp.experts.")?;
    let part = part.strip_suffix(".weight")?;
    Some((
        l.parse().ok()?,
        EXPERT_PARTS.iter().position(|p| *p == part)?,
    ))
}

/// Whether a checkpoint tensor is one of a routed layer's experts (per expert or fused), which
/// the stacked tensors stand for.
fn is_expert_part(hf: &str) -> bool {
    hf.starts_with("model.layers.")
        && (hf.contains(".mlp.experts.") || hf.contains(".block_sparse_moe.experts."))
}

/// Whether `c`'s experts are listed as stacked tensors (Gemma 4 keeps its own tensors).
fn stacks_experts(c: &ModelConfig) -> bool {
    c.moe.is_some() && c.arch != Arch::Gemma4
}

/// GGUF name -> HF name for every tensor of an `n_layers` model of `arch`.
pub fn gguf_to_hf_table(arch: Arch, n_layers: usize) -> std::collections::HashMap<String, String> {
    let mut m = std::collections::HashMap::new();
    let mut add = |hf: String| {
        if let Some(g) = hf_to_gguf(arch, &hf) {
            m.insert(g, hf);
        }
    };
    for s in ["weight", "bias"] {
        for g in HF_GLOBALS {
            add(format!("{g}.{s}"));
        }
        for l in 0..n_layers {
            for p in HF_LAYER_PARTS {
                add(format!("model.layers.{l}.{p}.{s}"));
            }
            if arch != Arch::Gemma4 {
                for p in HF_MOE_PARTS {
                    add(format!("model.layers.{l}.{p}.{s}"));
                }
            }
            if arch == Arch::GptOss {
                // Its router's name and its sinks (no `.weight` on the HF side).
                add(format!("model.layers.{l}.mlp.router.{s}"));
                add(format!("model.layers.{l}.self_attn.sinks"));
            }
        }
    }
    m
}

fn st_dtype_type(d: StDtype) -> Option<GgmlType> {
    match d {
        StDtype::F32 => Some(GgmlType::F32),
        StDtype::F16 => Some(GgmlType::F16),
        StDtype::BF16 => Some(GgmlType::BF16),
        _ => None,
    }
}

fn is_gguf_file(p: &Path) -> bool {
    use std::io::Read;
    let mut m = [0u8; 4];
    p.is_file()
        && std::fs::File::open(p)
            .and_then(|mut f| f.read_exact(&mut m))
            .is_ok()
        && &m == b"GGUF"
}

impl SourceModel {
    /// Opens a GGUF file, a Hugging Face folder (or cache entry) or an MLX folder.
    pub fn open(path: &Path) -> Result<SourceModel> {
        if !path.exists() {
            return Err(Error::Msg(format!(
                "{}: no such file or directory",
                path.display()
            )));
        }
        if is_gguf_file(path) {
            return Self::open_gguf(path);
        }
        if path.is_file() {
            return Err(Error::Msg(format!(
                "{}: neither a GGUF file nor a model folder",
                path.display()
            )));
        }
        let dir = resolve_hf_cache(path)?;
        Self::open_folder(&dir)
    }

    fn open_gguf(path: &Path) -> Result<SourceModel> {
        let file = GgufFile::open_joined(path)?;
        let config = ModelConfig::from_gguf(&file, file.tensor("output.weight").is_some())?;
        let table = gguf_to_hf_table(config.arch, config.n_layers);
        let mut tensors = Vec::new();
        for t in &file.tensors {
            let hf = table.get(&t.name).cloned().ok_or_else(|| {
                Error::Msg(format!("GGUF tensor '{}' has no Hugging Face name in hf2q's table (unsupported tensor)", t.name))
            })?;
            let shape = t
                .shape_row_major()
                .iter()
                .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
                .collect();
            tensors.push(SrcTensor {
                hf,
                gguf: t.name.clone(),
                shape,
                stored: Stored::Ggml(t.ty),
            });
        }
        let arch = config.arch;
        Ok(SourceModel {
            path: path.to_path_buf(),
            weights: WeightSource::gguf(file, arch),
            config,
            hf_config: None,
            dir: None,
            tensors,
            deltas: Default::default(),
        })
    }

    fn open_folder(dir: &Path) -> Result<SourceModel> {
        let cfg = read_config_json(dir)?;
        let config = ModelConfig::from_hf_json(&cfg)?;
        let weights = WeightSource::safetensors(dir, &cfg)?;
        let WeightSource::St { st, prefixes, .. } = &weights else {
            unreachable!("folder source")
        };
        let mut tensors = Vec::new();
        let mut names: Vec<&String> = st.names().collect();
        names.sort();
        let stacked = stacks_experts(&config);
        for stored_name in names {
            if stored_name.ends_with(".scales") || stored_name.ends_with(".biases") {
                continue;
            }
            // Undo the multimodal prefixes so the name is the text model's HF name.
            let hf = prefixes
                .iter()
                .filter(|p| !p.is_empty())
                .find_map(|p| {
                    stored_name.strip_prefix(p.as_str()).map(|r| {
                        if p == "model.language_model." {
                            format!("model.{r}")
                        } else {
                            r.to_string()
                        }
                    })
                })
                .unwrap_or_else(|| stored_name.clone());
            if stacked && is_expert_part(&hf) {
                continue; // listed below as the stacked tensors
            }
            let Some(gguf) = hf_to_gguf(config.arch, &hf) else {
                continue; // vision tower, projector, ...: not part of the text model
            };
            if hf == "lm_head.weight" && config.tie_embeddings {
                continue;
            }
            let (_, info) = st
                .get(stored_name)
                .ok_or_else(|| Error::MissingTensor(stored_name.clone()))?;
            let stem = stored_name.strip_suffix(".weight").unwrap_or(stored_name);
            let (shape, stored) = if st.get(&format!("{stem}.scales")).is_some() {
                let q = weights.matrix(&hf)?;
                let hf2q_tensor::WeightData::Affine { params, .. } = q.data else {
                    return Err(Error::Msg(format!(
                        "'{stored_name}' has scales but is not MLX affine"
                    )));
                };
                (vec![q.rows, q.cols], Stored::Affine(params))
            } else {
                let ty = st_dtype_type(info.dtype).ok_or_else(|| {
                    Error::Config(format!(
                        "tensor '{stored_name}': dtype {} is not a float",
                        info.dtype
                    ))
                })?;
                (info.shape.clone(), Stored::Ggml(ty))
            };
            tensors.push(SrcTensor {
                hf,
                gguf,
                shape,
                stored,
            });
        }
        if tensors.is_empty() {
            return Err(Error::Msg(format!(
                "{}: no text-model tensors found",
                dir.display()
            )));
        }
        if let (true, Some(moe)) = (stacked, &config.moe) {
            for l in (0..config.n_layers).filter(|&l| moe.layers[l]) {
                tensors.extend(stacked_tensors(&weights, &config, l, moe.n_experts)?);
            }
        }

        // Llama 3 RoPE scaling lives in config.json here and in a `rope_freqs` tensor in GGUF:
        // a virtual tensor computed from the config stands in for it.
        if let (Some(ff), false) = (
            config.llama3_freq_factors(),
            tensors.iter().any(|t| t.gguf == ROPE_FREQS),
        ) {
            tensors.push(SrcTensor {
                hf: ROPE_FREQS.into(),
                gguf: ROPE_FREQS.into(),
                shape: vec![ff.len()],
                stored: Stored::Ggml(GgmlType::F32),
            });
        }
        // LongRoPE's factors: virtual tensors from the config, as llama.cpp writes them.
        if let Some(l) = &config.longrope {
            for (name, f) in [
                (ROPE_FACTORS_SHORT, &l.short_factor),
                (ROPE_FACTORS_LONG, &l.long_factor),
            ] {
                if !tensors.iter().any(|t| t.gguf == name) {
                    tensors.push(SrcTensor {
                        hf: name.into(),
                        gguf: name.into(),
                        shape: vec![f.len()],
                        stored: Stored::Ggml(GgmlType::F32),
                    });
                }
            }
        }
        Ok(SourceModel {
            path: dir.to_path_buf(),
            weights,
            config,
            hf_config: Some(cfg),
            dir: Some(dir.to_path_buf()),
            tensors,
            deltas: Default::default(),
        })
    }

    pub fn format(&self) -> Format {
        self.weights.format()
    }

    /// The layout the stored values follow.
    pub fn layout(&self) -> Layout {
        match self.weights {
            WeightSource::Gguf { .. } => Layout::Gguf,
            WeightSource::St { .. } => Layout::Hf,
        }
    }

    pub fn gguf_file(&self) -> Option<&GgufFile> {
        match &self.weights {
            WeightSource::Gguf { file, .. } => Some(file),
            WeightSource::St { .. } => None,
        }
    }

    /// Whether any weight is stored quantized (block formats or MLX affine).
    pub fn is_quantized(&self) -> bool {
        self.tensors.iter().any(|t| !t.stored.is_float())
    }

    pub fn tensor_by_gguf(&self, gguf: &str) -> Option<&SrcTensor> {
        self.tensors.iter().find(|t| t.gguf == gguf)
    }
    pub fn tensor_by_hf(&self, hf: &str) -> Option<&SrcTensor> {
        self.tensors.iter().find(|t| t.hf == hf)
    }

    /// The stored bytes of a GGUF source tensor (to copy without decoding), when the source is
    /// GGUF and `want` is its layout.
    pub fn raw_gguf(&self, t: &SrcTensor) -> Result<Option<(GgmlType, Bytes)>> {
        let Some(file) = self.gguf_file() else {
            return Ok(None);
        };
        if self.deltas.contains_key(&t.hf) {
            return Ok(None);
        }
        let info = file
            .tensor(&t.gguf)
            .ok_or_else(|| Error::MissingTensor(t.gguf.clone()))?;
        Ok(Some((info.ty, file.tensor_data(info)?)))
    }

    /// The tensor's values as f32, row-major in its shape, in layout `want`.
    pub fn read_f32(&self, t: &SrcTensor, want: Layout) -> Result<Vec<f32>> {
        let mut v = match &self.weights {
            WeightSource::Gguf { file, .. } => {
                let info = file
                    .tensor(&t.gguf)
                    .ok_or_else(|| Error::MissingTensor(t.gguf.clone()))?;
                let data = file.tensor_data(info)?;
                dequantize_rows(info.ty, data.as_slice(), t.rows(), t.cols(), &t.gguf)?
            }
            WeightSource::St { .. } if t.hf == ROPE_FREQS && !self.weights.contains(ROPE_FREQS) => {
                self.config
                    .llama3_freq_factors()
                    .ok_or_else(|| Error::MissingTensor(ROPE_FREQS.into()))?
            }
            WeightSource::St { .. }
                if (t.hf == ROPE_FACTORS_SHORT || t.hf == ROPE_FACTORS_LONG)
                    && !self.weights.contains(&t.hf) =>
            {
                let l = self
                    .config
                    .longrope
                    .as_ref()
                    .ok_or_else(|| Error::MissingTensor(t.hf.clone()))?;
                if t.hf == ROPE_FACTORS_SHORT {
                    l.short_factor.clone()
                } else {
                    l.long_factor.clone()
                }
            }
            WeightSource::St { .. } if t.shape.len() == 3 => self.read_stacked_experts(t)?,
            WeightSource::St { .. } if stacked_expert_bias(&t.hf).is_some() => {
                self.read_expert_biases(t)?
            }
            WeightSource::St { .. } => {
                if t.shape.len() == 1 {
                    self.weights.vector(&t.hf)?
                } else if t.shape.len() == 2 {
                    self.weights.matrix(&t.hf)?.to_f32()?
                } else {
                    return Err(Error::Config(format!(
                        "tensor '{}' has {} dims",
                        t.hf,
                        t.shape.len()
                    )));
                }
            }
        };
        if v.len() != t.numel() {
            return Err(Error::Msg(format!(
                "tensor '{}': {} values read, shape {:?}",
                t.hf,
                v.len(),
                t.shape
            )));
        }
        let have = self.layout();
        if have != want {
            relayout(&self.config, t, &mut v, want)?;
        }
        if let Some(d) = self.deltas.get(&t.hf) {
            if d.len() != v.len() {
                return Err(Error::Msg(format!(
                    "tensor '{}': a delta of {} values for {}",
                    t.hf,
                    d.len(),
                    v.len()
                )));
            }
            let mut d = d.clone();
            if want != Layout::Hf {
                relayout(&self.config, t, &mut d, want)?;
            }
            v.iter_mut().zip(&d).for_each(|(x, y)| *x += y);
        }
        Ok(v)
    }
}

/// Weight bytes read to decode one token, for a bandwidth floor (`hf2q bench`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeBytes {
    /// Every weight tensor's stored bytes.
    pub all: u64,
    /// Stored bytes of the routed experts (the 3-D `*_exps` tensors), all E of them.
    pub experts: u64,
    /// What one decoded token reads: every non-expert weight (the token embedding as one row,
    /// as decode gathers it, unless it is tied and so read whole as the output), plus `k / E`
    /// of the expert bytes (a token runs `k` of the `E` experts of each routed layer).
    pub per_token: u64,
}

/// [`DecodeBytes`] of a model file or folder: a GGUF's tensor table as stored (any
/// architecture llama.cpp's names cover), a folder's tensors as [`SourceModel`] lists them.
pub fn decode_bytes(path: &Path) -> Result<DecodeBytes> {
    // (GGUF name, row-major shape, stored bytes)
    let (tensors, config): (Vec<(String, Vec<u64>, u64)>, ModelConfig) = if is_gguf_file(path) {
        let f = GgufFile::open(path)?;
        let cfg = ModelConfig::from_gguf(&f, f.tensor("output.weight").is_some())?;
        let t = f
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape_row_major(), t.nbytes()))
            .collect();
        (t, cfg)
    } else {
        let src = SourceModel::open(path)?;
        let t = src
            .tensors
            .iter()
            .map(|t| {
                let n = t.numel() as u64;
                let bytes = match t.stored {
                    Stored::Ggml(ty) => ty
                        .row_bytes(t.cols())
                        .map_or(0, |rb| (rb * t.rows()) as u64),
                    // Packed quants plus a scale and a bias (16-bit) per group.
                    Stored::Affine(p) => n * p.bits as u64 / 8 + 4 * n / p.group_size.max(1) as u64,
                };
                let shape = t.shape.iter().map(|&d| d as u64).collect();
                (t.gguf.clone(), shape, bytes)
            })
            .collect();
        (t, src.config)
    };
    Ok(decode_bytes_of(&tensors, &config))
}

pub(crate) fn decode_bytes_of(tensors: &[(String, Vec<u64>, u64)], c: &ModelConfig) -> DecodeBytes {
    let tied = !tensors.iter().any(|t| t.0 == "output.weight");
    let (k, e) = c
        .moe
        .as_ref()
        .map_or((1, 1), |m| (m.n_used as u64, m.n_experts.max(1) as u64));
    let mut d = DecodeBytes::default();
    for (name, shape, bytes) in tensors {
        d.all += bytes;
        if shape.len() == 3 && name.contains("_exps.") {
            d.experts += bytes;
            d.per_token += bytes * k / e;
        } else if name == "token_embd.weight" && !tied {
            d.per_token += bytes / shape.first().copied().unwrap_or(1).max(1);
        } else {
            d.per_token += bytes;
        }
    }
    d
}

/// Dequantizes `rows` rows of `cols` values of `ty` (in parallel over rows).
pub fn dequantize_rows(
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    name: &str,
) -> Result<Vec<f32>> {
    let rb = ty.row_bytes(cols).ok_or_else(|| {
        Error::Msg(format!(
            "tensor '{name}': {cols} is not a whole number of {ty} blocks"
        ))
    })?;
    if data.len() != rb * rows {
        return Err(Error::Msg(format!(
            "tensor '{name}': {} bytes, {} expected",
            data.len(),
            rb * rows
        )));
    }
    let mut out = vec![0f32; rows * cols];
    if cols == 0 {
        return Ok(out);
    }
    out.par_chunks_mut(cols)
        .zip(data.par_chunks(rb.max(1)))
        .try_for_each(|(dst, src)| hf2q_tensor::quant::dequantize(ty, src, dst))?;
    Ok(out)
}

/// Converts values of `t` from the other layout into `want` (see the module header).
fn relayout(cfg: &ModelConfig, t: &SrcTensor, v: &mut [f32], want: Layout) -> Result<()> {
    let g = t.gguf.as_str();
    // llama.cpp converts Granite, SmolLM3 and MiniCPM as Llama: q/k rows permuted too.
    if cfg.arch.permutes_qk()
        && (g.ends_with("attn_q.weight")
            || g.ends_with("attn_q.bias")
            || g.ends_with("attn_k.weight")
            || g.ends_with("attn_k.bias"))
    {
        let heads = if g.contains("attn_q.") {
            cfg.n_heads
        } else {
            cfg.n_kv_heads
        };
        permute_qk_rows(v, t.rows(), t.cols(), heads, want == Layout::Gguf)?;
    }
    if cfg.arch == Arch::Gemma3 && g.ends_with("norm.weight") {
        let d = if want == Layout::Gguf { 1.0 } else { -1.0 };
        v.iter_mut().for_each(|x| *x += d);
    }
    Ok(())
}

/// llama.cpp's `permute` (to GGUF, `forward`) and its inverse, on `rows` rows of `cols` values
/// split into `heads` heads (a bias is `rows` rows of one value).
pub fn permute_qk_rows(
    v: &mut [f32],
    rows: usize,
    cols: usize,
    heads: usize,
    forward: bool,
) -> Result<()> {
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return Err(Error::Msg(format!(
            "cannot permute {rows} rows into {heads} heads of an even size"
        )));
    }
    let dh = rows / heads;
    let half = dh / 2;
    let src = v.to_vec();
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let hf_row = h * dh + j * half + i;
                let gguf_row = h * dh + 2 * i + j;
                let (from, to) = if forward {
                    (hf_row, gguf_row)
                } else {
                    (gguf_row, hf_row)
                };
                v[to * cols..(to + 1) * cols].copy_from_slice(&src[from * cols..(from + 1) * cols]);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_matches_llama_cpp_and_inverts() {
        // 2 heads of 4 rows, 1 column: numpy's reshape(2, 2, 2).swapaxes(1, 2) order.
        let mut v: Vec<f32> = (0..8).map(|x| x as f32).collect();
        permute_qk_rows(&mut v, 8, 1, 2, true).unwrap();
        assert_eq!(v, [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        permute_qk_rows(&mut v, 8, 1, 2, false).unwrap();
        assert_eq!(v, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        assert!(permute_qk_rows(&mut v, 8, 1, 3, true).is_err());
    }

    #[test]
    fn name_table_inverts() {
        let t = gguf_to_hf_table(Arch::Llama, 2);
        assert_eq!(
            t["blk.1.ffn_norm.weight"],
            "model.layers.1.post_attention_layernorm.weight"
        );
        assert_eq!(t["token_embd.weight"], "model.embed_tokens.weight");
        let t = gguf_to_hf_table(Arch::Gemma3, 1);
        assert_eq!(
            t["blk.0.post_attention_norm.weight"],
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(
            t["blk.0.ffn_norm.weight"],
            "model.layers.0.pre_feedforward_layernorm.weight"
        );
    }
}
