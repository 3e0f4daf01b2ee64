//! A layer's routed experts from any source, as [`Experts`] views of the stored bytes (nothing
//! copied, nothing dequantized):
//!
//! - GGUF: llama.cpp's stacked `blk.N.ffn_{gate,up}_exps` `[D, F, E]` and `ffn_down_exps`
//!   `[F, D, E]` (ggml order), read as `(E·F, D)` and `(E·D, F)`;
//! - safetensors, fused as transformers 5 holds them in memory: `mlp.experts.gate_up_proj
//!   (E, 2F, D)` (gate rows first) and `mlp.experts.down_proj (E, D, F)`;
//! - safetensors, one tensor per expert as checkpoints ship them: Qwen3-MoE's
//!   `mlp.experts.E.{gate,up,down}_proj.weight`, Mixtral's `block_sparse_moe.experts.E.{w1,w3,w2}`.
//!
//! - Gemma 4: `experts.gate_up_proj (E, 2F, D)` and `experts.down_proj (E, D, F)` beside the
//!   MLP (no `mlp.` in the path); in GGUF `ffn_gate_up_exps` (or gate and up apart) and
//!   `ffn_down_exps`.
//!
//! - GPT-OSS: MXFP4 `mlp.experts.{gate_up,down}_proj_{blocks,scales}` (`(E, R, C/32, 16)` codes,
//!   `(E, R, C/32)` E8M0 scales; gate and up rows interleaved, gate first) repacked once into
//!   ggml's MXFP4 blocks (17 bytes per 32 values, the same values: the weights stay quantized),
//!   with the products' biases (`*_proj_bias`).
//!
//!   In GGUF (llama.cpp's `gpt-oss`): `ffn_{gate,up,down}_exps.weight` (MXFP4 as its converter
//!   writes them, gate and up apart or fused as `ffn_gate_up_exps`) and their `.bias`.
//!
//! Not read yet: MLX's `switch_mlp` (refused with a message naming it); a dequantized GPT-OSS
//! checkpoint's `gate_up_proj (E, D, 2F)`.

use hf2q_tensor::moe::{expert_name, ExpertBiases, Experts};
use hf2q_tensor::quant::mxfp4;
use hf2q_tensor::{Bytes, GgmlType, QTensor};

use super::{st_dtype_to_ggml, WeightSource};
use crate::names::hf_to_gguf;
use crate::{Error, Result};

/// The three parts of an expert, in [`Experts`]' order, by their names in each layout.
const PARTS: [(&str, &str); 3] = [("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")];

/// A GGUF tensor of `n_experts` stacked experts, ggml dims `(columns, rows, experts)`, as one
/// `(experts · rows, columns)` matrix of its stored bytes.
fn stacked_tensor(
    file: &hf2q_tensor::io::gguf::GgufFile,
    info: &hf2q_tensor::io::gguf::GgufTensorInfo,
    name: &str,
    n_experts: usize,
) -> Result<QTensor> {
    let [c, r, e] = info.dims[..] else {
        return Err(Error::Config(format!(
            "tensor '{name}' has {} dims, 3 expected (columns, rows, experts)",
            info.dims.len()
        )));
    };
    if e != n_experts as u64 {
        return Err(Error::Config(format!(
            "tensor '{name}' holds {e} experts, the config says {n_experts}"
        )));
    }
    let big = || Error::Config(format!("tensor '{name}' is too large"));
    let rows = r
        .checked_mul(e)
        .and_then(|x| usize::try_from(x).ok())
        .ok_or_else(big)?;
    let cols = usize::try_from(c).map_err(|_| big())?;
    Ok(QTensor::ggml(
        name,
        info.ty,
        rows,
        cols,
        file.tensor_data(info)?,
    )?)
}

impl WeightSource {
    /// The `n_experts` experts of the layer under `prefix` (`model.layers.N`).
    pub fn experts(&self, prefix: &str, n_experts: usize) -> Result<Experts> {
        match self {
            WeightSource::Gguf { file, arch } => {
                let [g, u, d] = PARTS.map(|(p, _)| -> Result<QTensor> {
                    let hf = format!("{prefix}.mlp.experts.{p}.weight");
                    let name = hf_to_gguf(*arch, &hf).ok_or_else(|| Error::MissingTensor(hf))?;
                    let info = file
                        .tensor(&name)
                        .ok_or_else(|| Error::MissingTensor(name.clone()))?;
                    stacked_tensor(file, info, &name, n_experts)
                });
                Ok(Experts::from_stacked(n_experts, g?, u?, d?)?)
            }
            WeightSource::St { .. } => {
                for moe in ["mlp", "block_sparse_moe"] {
                    if self.contains(&format!("{prefix}.{moe}.switch_mlp.gate_proj.weight")) {
                        return Err(Error::Config(format!(
                            "{prefix}.{moe}.switch_mlp: MLX experts are not supported yet"
                        )));
                    }
                }
                if let Some(fused) = self.fused_experts(prefix, n_experts)? {
                    return Ok(fused);
                }
                let per_expert = |e: usize| -> Result<[QTensor; 3]> {
                    let qwen = format!("{prefix}.mlp.experts.{e}.gate_proj.weight");
                    let [g, u, d] = PARTS.map(|(q, m)| {
                        if self.contains(&qwen) {
                            format!("{prefix}.mlp.experts.{e}.{q}.weight")
                        } else {
                            format!("{prefix}.block_sparse_moe.experts.{e}.{m}.weight")
                        }
                    });
                    Ok([self.matrix(&g)?, self.matrix(&u)?, self.matrix(&d)?])
                };
                Ok(Experts::from_parts(
                    (0..n_experts).map(per_expert).collect::<Result<_>>()?,
                )?)
            }
        }
    }

    /// Gemma 4's experts of the layer under `prefix` (`model.layers.N`), stored beside its MLP.
    pub fn gemma4_experts(&self, prefix: &str, n_experts: usize) -> Result<Experts> {
        let stem = format!("{prefix}.experts");
        match self {
            WeightSource::Gguf { file, arch } => {
                let get = |part: &str| -> Result<Option<(QTensor, usize)>> {
                    let hf = format!("{stem}.{part}");
                    let name = hf_to_gguf(*arch, &hf).ok_or_else(|| Error::MissingTensor(hf))?;
                    match file.tensor(&name) {
                        None => Ok(None),
                        Some(info) => {
                            let w = stacked_tensor(file, info, &name, n_experts)?;
                            let rows = w.rows / n_experts;
                            Ok(Some((w, rows)))
                        }
                    }
                };
                let need = |part: &str| -> Result<(QTensor, usize)> {
                    get(part)?.ok_or_else(|| Error::MissingTensor(format!("{stem}.{part}")))
                };
                let (down, d) = need("down_proj")?;
                match get("gate_up_proj")? {
                    Some((gu, two_f)) => fused_views(&gu, &down, n_experts, two_f / 2, d),
                    None => {
                        let (gate, _) = need("gate_proj")?;
                        let (up, _) = need("up_proj")?;
                        Ok(Experts::from_stacked(n_experts, gate, up, down)?)
                    }
                }
            }
            WeightSource::St { .. } => self
                .fused_at(
                    &format!("{stem}.gate_up_proj"),
                    &format!("{stem}.down_proj"),
                    n_experts,
                )?
                .ok_or_else(|| Error::MissingTensor(format!("{stem}.gate_up_proj"))),
        }
    }

    /// GPT-OSS's MXFP4 experts of the layer under `prefix` (`model.layers.N`) with their
    /// biases: `gate_up` `(E, 2F, D)` rows interleaved (row `2j` gate `j`, `2j + 1` up `j`, as
    /// transformers' `gate_up[..., ::2]` / `[..., 1::2]` read them) become each expert's gate rows
    /// then its up rows; `down` `(E, D, F)`.
    pub fn gpt_oss_experts(&self, prefix: &str, n_experts: usize) -> Result<Experts> {
        let (st, prefixes) = match self {
            WeightSource::St { st, prefixes, .. } => (st, prefixes),
            WeightSource::Gguf { file, .. } => {
                return gguf_gpt_oss_experts(file, prefix, n_experts)
            }
        };
        let stem = format!("{prefix}.mlp.experts");
        let find = |n: &str| Self::st_name(st, prefixes, &format!("{stem}.{n}"));
        if find("gate_up_proj_blocks").is_none() && find("gate_up_proj").is_some() {
            return Err(Error::Config(format!(
                "{stem}: dequantized GPT-OSS experts (gate_up_proj) are not supported yet; \
                 the MXFP4 checkpoint (gate_up_proj_blocks / _scales) is"
            )));
        }
        // One packed part as `(E·R, C)` ggml MXFP4 rows, with `[E, R, C]`.
        let packed = |part: &str| -> Result<(Vec<u8>, [usize; 3])> {
            let get = |suffix: &str| {
                let n = format!("{part}_{suffix}");
                let name = find(&n).ok_or_else(|| Error::MissingTensor(format!("{stem}.{n}")))?;
                let (file, info) = st
                    .get(&name)
                    .ok_or_else(|| Error::MissingTensor(name.clone()))?;
                if info.dtype != hf2q_tensor::io::safetensors::StDtype::U8 {
                    return Err(Error::Config(format!(
                        "'{name}' is {:?}, uint8 MXFP4 expected",
                        info.dtype
                    )));
                }
                Ok((name, info.shape.clone(), file.tensor_data(info)?))
            };
            let (bn, bshape, blocks) = get("blocks")?;
            let (sn, sshape, scales) = get("scales")?;
            let [e, r, g, 16] = bshape[..] else {
                return Err(Error::Config(format!(
                    "'{bn}' has shape {bshape:?}, (experts, rows, blocks, 16) expected"
                )));
            };
            if sshape != [e, r, g] || e != n_experts {
                return Err(Error::Config(format!(
                    "'{bn}' {bshape:?} and '{sn}' {sshape:?} disagree, or hold other than {n_experts} experts"
                )));
            }
            let bytes = mxfp4::from_hf_blocks(blocks.as_slice(), scales.as_slice())?;
            Ok((bytes, [e, r, g * mxfp4::QK_MXFP4]))
        };
        let bias = |part: &str, want: usize| -> Result<Vec<f32>> {
            let n = format!("{part}_bias");
            let name = find(&n).ok_or_else(|| Error::MissingTensor(format!("{stem}.{n}")))?;
            let (file, info) = st
                .get(&name)
                .ok_or_else(|| Error::MissingTensor(name.clone()))?;
            let b = file.to_f32(info)?;
            if b.len() != want {
                return Err(Error::Config(format!(
                    "'{name}' has {} values, {want} expected",
                    b.len()
                )));
            }
            Ok(b)
        };
        let (gu, [_, two_f, d]) = packed("gate_up_proj")?;
        let (dn, [_, dd, f]) = packed("down_proj")?;
        if two_f != 2 * f || dd != d {
            return Err(Error::Config(format!(
                "{stem}: gate_up rows {two_f} x {d} and down {dd} x {f} disagree (2F x D and D x F)"
            )));
        }
        // Each expert's interleaved rows regrouped: gate rows, then up rows.
        let row = d / mxfp4::QK_MXFP4 * mxfp4::BLOCK_BYTES;
        let mut grouped = Vec::with_capacity(gu.len());
        for ex in gu.chunks_exact(two_f * row) {
            for first in [0, 1] {
                for j in 0..f {
                    let at = (2 * j + first) * row;
                    grouped.extend_from_slice(&ex[at..at + row]);
                }
            }
        }
        let name = |p: &str| format!("{stem}.{p}");
        let gu_w = QTensor::ggml(
            &name("gate_up_proj"),
            GgmlType::MXFP4,
            n_experts * two_f,
            d,
            Bytes::from_vec(grouped),
        )?;
        let dn_w = QTensor::ggml(
            &name("down_proj"),
            GgmlType::MXFP4,
            n_experts * d,
            f,
            Bytes::from_vec(dn),
        )?;
        let gu_b = bias("gate_up_proj", n_experts * two_f)?;
        let (gate, up) = (
            gu_b.iter().step_by(2).copied().collect(),
            gu_b.iter().skip(1).step_by(2).copied().collect(),
        );
        let down = bias("down_proj", n_experts * d)?;
        Ok(
            fused_views(&gu_w, &dn_w, n_experts, f, d)?.with_biases(ExpertBiases {
                gate,
                up,
                down,
            })?,
        )
    }

    /// transformers' fused layout, when the checkpoint has it.
    fn fused_experts(&self, prefix: &str, n_experts: usize) -> Result<Option<Experts>> {
        self.fused_at(
            &format!("{prefix}.mlp.experts.gate_up_proj"),
            &format!("{prefix}.mlp.experts.down_proj"),
            n_experts,
        )
    }

    /// The fused experts `gu_name (E, 2F, D)` and `dn_name (E, D, F)`, when the checkpoint has
    /// the first.
    fn fused_at(&self, gu_name: &str, dn_name: &str, n_experts: usize) -> Result<Option<Experts>> {
        let WeightSource::St { st, prefixes, .. } = self else {
            return Ok(None);
        };
        let Some(gu) = Self::st_name(st, prefixes, gu_name) else {
            return Ok(None);
        };
        let dn = Self::st_name(st, prefixes, dn_name)
            .ok_or_else(|| Error::MissingTensor(dn_name.to_string()))?;
        // Each 3-D tensor as the 2-D weight of its rows: (E·2F, D) and (E·D, F).
        let stacked = |name: &str| -> Result<(QTensor, [usize; 3])> {
            let (file, info) = st
                .get(name)
                .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
            let [e, r, c] = info.shape[..] else {
                return Err(Error::Config(format!(
                    "tensor '{name}' has shape {:?}, (experts, rows, columns) expected",
                    info.shape
                )));
            };
            if e != n_experts {
                return Err(Error::Config(format!(
                    "tensor '{name}' holds {e} experts, the config says {n_experts}"
                )));
            }
            let ty = st_dtype_to_ggml(info.dtype).ok_or_else(|| {
                Error::Config(format!(
                    "tensor '{name}': dtype {:?} is not a float weight",
                    info.dtype
                ))
            })?;
            let w = QTensor::ggml(name, ty, e * r, c, file.tensor_data(info)?)?;
            Ok((w, [e, r, c]))
        };
        let (gu_w, [_, two_f, d]) = stacked(&gu)?;
        let (dn_w, [_, dd, f]) = stacked(&dn)?;
        if two_f != 2 * f || dd != d {
            return Err(Error::Config(format!(
                "'{gu}' rows {two_f} x {d} and '{dn}' {dd} x {f} disagree (2F x D and D x F)"
            )));
        }
        Ok(Some(fused_views(&gu_w, &dn_w, n_experts, f, d)?))
    }
}

/// GPT-OSS's experts in llama.cpp's `gpt-oss` layout: `blk.N.ffn_{gate,up,down}_exps.weight`
/// (any stored type, MXFP4 as its converter writes them) with their `.bias` `[F, E]` / `[D, E]`,
/// or gate and up fused as `ffn_gate_up_exps` (each expert's gate rows, then its up rows).
fn gguf_gpt_oss_experts(
    file: &hf2q_tensor::io::gguf::GgufFile,
    prefix: &str,
    n_experts: usize,
) -> Result<Experts> {
    let layer = prefix.strip_prefix("model.layers.").unwrap_or(prefix);
    let name = |t: &str, s: &str| format!("blk.{layer}.ffn_{t}_exps.{s}");
    let weight = |t: &str| -> Result<Option<QTensor>> {
        let n = name(t, "weight");
        file.tensor(&n)
            .map(|info| stacked_tensor(file, info, &n, n_experts))
            .transpose()
    };
    let bias = |t: &str, want: usize| -> Result<Vec<f32>> {
        let n = name(t, "bias");
        let info = file
            .tensor(&n)
            .ok_or_else(|| Error::MissingTensor(n.clone()))?;
        let count = usize::try_from(info.numel())
            .map_err(|_| Error::Config(format!("tensor '{n}' is too large")))?;
        if count != want {
            return Err(Error::Config(format!(
                "tensor '{n}' has {count} values, {want} expected"
            )));
        }
        let mut out = vec![0f32; count];
        hf2q_tensor::quant::dequantize(info.ty, file.tensor_data(info)?.as_slice(), &mut out)?;
        Ok(out)
    };
    let down = weight("down")?.ok_or_else(|| Error::MissingTensor(name("down", "weight")))?;
    let (d, f) = (down.rows / n_experts, down.cols);
    let down_b = bias("down", n_experts * d)?;
    let experts = match weight("gate_up")? {
        Some(gu) => {
            if gu.rows != n_experts * 2 * f || gu.cols != d {
                return Err(Error::Config(format!(
                    "'{}' is {} x {}, {} x {d} expected",
                    name("gate_up", "weight"),
                    gu.rows,
                    gu.cols,
                    n_experts * 2 * f
                )));
            }
            let gu_b = bias("gate_up", n_experts * 2 * f)?;
            let (mut gate, mut up) = (Vec::new(), Vec::new());
            for ex in gu_b.chunks_exact(2 * f) {
                gate.extend_from_slice(&ex[..f]);
                up.extend_from_slice(&ex[f..]);
            }
            fused_views(&gu, &down, n_experts, f, d)?.with_biases(ExpertBiases {
                gate,
                up,
                down: down_b,
            })?
        }
        None => {
            let need = |t: &str| -> Result<QTensor> {
                weight(t)?.ok_or_else(|| Error::MissingTensor(name(t, "weight")))
            };
            let (gate, up) = (need("gate")?, need("up")?);
            Experts::from_stacked(n_experts, gate, up, down)?.with_biases(ExpertBiases {
                gate: bias("gate", n_experts * f)?,
                up: bias("up", n_experts * f)?,
                down: down_b,
            })?
        }
    };
    Ok(experts)
}

/// Per-expert views of fused experts: `gu (E·2F, D)` (each expert's gate rows, then its up
/// rows) and `dn (E·D, F)`.
fn fused_views(
    gu: &QTensor,
    dn: &QTensor,
    n_experts: usize,
    f: usize,
    d: usize,
) -> Result<Experts> {
    let views = (0..n_experts)
        .map(|e| -> Result<[QTensor; 3]> {
            let name = expert_name(gu, e);
            Ok([
                gu.row_range(e * 2 * f, f, &format!("{name}.gate"))?,
                gu.row_range(e * 2 * f + f, f, &format!("{name}.up"))?,
                dn.row_range(e * d, d, &expert_name(dn, e))?,
            ])
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Experts::from_parts(views)?)
}
