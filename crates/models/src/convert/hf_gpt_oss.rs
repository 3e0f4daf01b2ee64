//! GPT-OSS as a Hugging Face folder, the checkpoint layout transformers 5 reads
//! (`GptOssForCausalLM` with `quantization_config: {quant_method: mxfp4}`).
//!
//! Per layer `model.layers.N.mlp.experts.`:
//!
//! - `gate_up_proj_blocks` U8 `(E, 2F, D/32, 16)` and `gate_up_proj_scales` U8 `(E, 2F, D/32)`:
//!   gate and up interleaved by row (row `2j` is gate row `j`, `2j + 1` up row `j`, as
//!   transformers' `gate_up[..., ::2]` / `[..., 1::2]` read them);
//! - `down_proj_blocks` U8 `(E, D, F/32, 16)` and `down_proj_scales` U8 `(E, D, F/32)`;
//! - `gate_up_proj_bias` `(E, 2F)` (interleaved the same way) and `down_proj_bias` `(E, D)`, in
//!   the folder's float dtype.
//!
//! A block is 32 values: 16 bytes of E2M1 codes (value `2i` in the low nibble of byte `i`,
//! `2i + 1` in its high nibble) and one E8M0 scale byte. The source's experts are ggml MXFP4
//! blocks (stacked `ffn_{gate,up,down}_exps`, see `super::source`), which [`to_hf_blocks`]
//! repacks without changing a value: the inverse of `hf2q_tensor::quant::mxfp4::from_hf_blocks`,
//! so GGUF -> folder -> GGUF gives the experts' bytes back. Experts stored in another type
//! (a GGUF whose experts were quantized by another tool) are refused: hf2q has no MXFP4
//! quantizer.
//!
//! The router (`mlp.router.{weight,bias}`), the sinks (`self_attn.sinks`) and the rest are
//! ordinary tensors under their checkpoint names (written by `super::hf_out`).

use hf2q_tensor::io::safetensors::StDtype;
use hf2q_tensor::quant::mxfp4::{BLOCK_BYTES, QK_MXFP4};
use hf2q_tensor::GgmlType;
use serde_json::{json, Map, Value};

use super::gguf_out::WriteReport;
use super::hf_out::{encode_floats, ShardWriter};
use super::source::{stacked_expert, Layout, SourceModel, SrcTensor, Stored, EXPERT_PARTS};
use super::stacked::stacked_expert_bias;
use crate::config::gpt_oss::Yarn;
use crate::config::ModelConfig;
use crate::{Error, Result};

/// transformers' `modules_to_not_convert` for GPT-OSS (the released checkpoints' and the tiny
/// fixture's): everything but the experts stays in the float dtype.
const NOT_CONVERTED: [&str; 4] = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
];

/// The `quantization_config` of a GPT-OSS checkpoint with MXFP4 experts.
pub fn quantization_config() -> Value {
    json!({ "quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED })
}

/// Whether `t` is written by [`write_experts`] (a stacked experts weight or bias).
pub fn is_expert_tensor(t: &SrcTensor) -> bool {
    stacked_expert(&t.hf).is_some() || stacked_expert_bias(&t.hf).is_some()
}

/// ggml MXFP4 blocks (17 bytes: scale, then 16 bytes holding values `j` and `j + 16` in the low
/// and high nibble of byte `j`) as a checkpoint's `(blocks, scales)`: 16 bytes of codes and one
/// scale per 32 values, in the same order.
pub fn to_hf_blocks(ggml: &[u8]) -> Result<(Vec<u8>, Vec<u8>)> {
    if !ggml.len().is_multiple_of(BLOCK_BYTES) {
        return Err(Error::Msg(format!(
            "MXFP4: {} bytes are not whole blocks of {BLOCK_BYTES}",
            ggml.len()
        )));
    }
    let n = ggml.len() / BLOCK_BYTES;
    let (mut blocks, mut scales) = (Vec::with_capacity(n * 16), Vec::with_capacity(n));
    for b in ggml.chunks_exact(BLOCK_BYTES) {
        scales.push(b[0]);
        let qs = &b[1..];
        let code = |i: usize| {
            if i < QK_MXFP4 / 2 {
                qs[i] & 0x0f
            } else {
                qs[i - QK_MXFP4 / 2] >> 4
            }
        };
        blocks.extend((0..16).map(|k| code(2 * k) | (code(2 * k + 1) << 4)));
    }
    Ok((blocks, scales))
}

/// The ggml MXFP4 bytes of a stacked experts tensor `(E, R, C)` as the source stores them.
fn mxfp4_bytes(src: &SourceModel, t: &SrcTensor) -> Result<Vec<u8>> {
    let raw = match src.raw_gguf(t)? {
        Some((ty, data)) => Some((ty, data.as_slice().to_vec())),
        None => src.raw_stacked(t)?,
    };
    match raw {
        Some((GgmlType::MXFP4, data)) => Ok(data),
        Some((ty, _)) => Err(Error::Msg(format!(
            "{}: experts stored as {ty}; a GPT-OSS checkpoint holds them as MXFP4 and hf2q has \
             no MXFP4 quantizer (convert the original checkpoint or its MXFP4 GGUF)",
            t.gguf
        ))),
        None => Err(Error::Msg(format!(
            "{}: the experts' MXFP4 blocks cannot be copied (an adapter fused into them?); \
             a GPT-OSS checkpoint needs them as stored",
            t.gguf
        ))),
    }
}

/// Writes every routed layer's experts in the checkpoint's layout (module docs) into `shards`.
pub fn write_experts(
    src: &SourceModel,
    shards: &mut ShardWriter,
    report: &mut WriteReport,
    dtype: StDtype,
) -> Result<()> {
    for layer in 0..src.config.n_layers {
        let weight = |part: usize| {
            let hf = format!(
                "model.layers.{layer}.mlp.experts.{}.weight",
                EXPERT_PARTS[part]
            );
            src.tensor_by_hf(&hf)
                .ok_or_else(|| Error::MissingTensor(hf.clone()))
        };
        let bias = |part: usize| -> Result<Vec<f32>> {
            let hf = format!(
                "model.layers.{layer}.mlp.experts.{}.bias",
                EXPERT_PARTS[part]
            );
            let t = src
                .tensor_by_hf(&hf)
                .ok_or_else(|| Error::MissingTensor(hf.clone()))?;
            src.read_f32(t, Layout::Hf)
        };
        let (gate, up, down) = (weight(0)?, weight(1)?, weight(2)?);
        let (&[e, f, d], &[e2, f2, d2], &[e3, d3, f3]) =
            (&gate.shape[..], &up.shape[..], &down.shape[..])
        else {
            return Err(Error::Msg(format!(
                "layer {layer}: experts of shapes {:?} / {:?} / {:?}, three (E, R, C) expected",
                gate.shape, up.shape, down.shape
            )));
        };
        let whole = |n: usize| n > 0 && n.is_multiple_of(QK_MXFP4);
        if (e2, f2, d2) != (e, f, d)
            || (e3, d3, f3) != (e, d, f)
            || e == 0
            || !whole(d)
            || !whole(f)
        {
            return Err(Error::Msg(format!(
                "layer {layer}: experts gate {:?}, up {:?}, down {:?} disagree (E x F x D, \
                 E x D x F, none empty, rows of whole 32-blocks)",
                gate.shape, up.shape, down.shape
            )));
        }
        let (gb, ub, db) = (
            mxfp4_bytes(src, gate)?,
            mxfp4_bytes(src, up)?,
            mxfp4_bytes(src, down)?,
        );
        // Gate and up interleaved by row, expert after expert.
        let row = d / QK_MXFP4 * BLOCK_BYTES;
        let mut gu = Vec::with_capacity(gb.len() + ub.len());
        for (ge, ue) in gb.chunks_exact(f * row).zip(ub.chunks_exact(f * row)) {
            for (g, u) in ge.chunks_exact(row).zip(ue.chunks_exact(row)) {
                gu.extend_from_slice(g);
                gu.extend_from_slice(u);
            }
        }
        let (gbias, ubias, dbias) = (bias(0)?, bias(1)?, bias(2)?);
        if gbias.len() != e * f || ubias.len() != e * f || dbias.len() != e * d {
            return Err(Error::Msg(format!(
                "layer {layer}: expert biases of {} / {} / {} values, {} / {} / {} expected",
                gbias.len(),
                ubias.len(),
                dbias.len(),
                e * f,
                e * f,
                e * d
            )));
        }
        let gu_bias: Vec<f32> = gbias
            .iter()
            .zip(&ubias)
            .flat_map(|(&g, &u)| [g, u])
            .collect();
        let stem = format!("model.layers.{layer}.mlp.experts");
        let (gu_blocks, gu_scales) = to_hf_blocks(&gu)?;
        let (dn_blocks, dn_scales) = to_hf_blocks(&db)?;
        let (gd, fd) = (d / QK_MXFP4, f / QK_MXFP4);
        let outputs: [(String, StDtype, Vec<usize>, Vec<u8>); 6] = [
            (
                format!("{stem}.gate_up_proj_blocks"),
                StDtype::U8,
                vec![e, 2 * f, gd, 16],
                gu_blocks,
            ),
            (
                format!("{stem}.gate_up_proj_scales"),
                StDtype::U8,
                vec![e, 2 * f, gd],
                gu_scales,
            ),
            (
                format!("{stem}.gate_up_proj_bias"),
                dtype,
                vec![e, 2 * f],
                encode_floats(&gu_bias, dtype)?,
            ),
            (
                format!("{stem}.down_proj_blocks"),
                StDtype::U8,
                vec![e, d, fd, 16],
                dn_blocks,
            ),
            (
                format!("{stem}.down_proj_scales"),
                StDtype::U8,
                vec![e, d, fd],
                dn_scales,
            ),
            (
                format!("{stem}.down_proj_bias"),
                dtype,
                vec![e, d],
                encode_floats(&dbias, dtype)?,
            ),
        ];
        for (name, dt, shape, bytes) in outputs {
            let n: usize = shape.iter().product();
            report.tensors.push((
                name.clone(),
                Stored::Ggml(GgmlType::MXFP4).name(),
                dt.name().to_string(),
                n as u64,
                bytes.len() as u64,
            ));
            shards.add(name, dt, shape, bytes)?;
        }
    }
    Ok(())
}

/// GPT-OSS's keys of a config.json rebuilt from a GGUF (as transformers 5.17's `GptOssConfig`
/// writes them and [`ModelConfig::from_hf_json`] reads them): `rope_parameters` (YaRN with
/// `truncate: false`, `attention_factor` only when not YaRN's default), `layer_types`,
/// `sliding_window`, `swiglu_limit` and the MXFP4 `quantization_config`. The experts' keys are
/// `hf_out`'s (`num_local_experts`, `intermediate_size`).
pub(super) fn insert_keys(m: &mut Map<String, Value>, c: &ModelConfig) {
    let mut rope = Map::new();
    match &c.yarn {
        Some(y) => {
            rope.insert("rope_type".into(), json!("yarn"));
            rope.insert("factor".into(), json!(y.factor));
            rope.insert("beta_fast".into(), json!(y.beta_fast));
            rope.insert("beta_slow".into(), json!(y.beta_slow));
            rope.insert("truncate".into(), json!(y.truncate));
            rope.insert(
                "original_max_position_embeddings".into(),
                json!(y.original_max_position),
            );
            let derived = Yarn::from_hf(&Value::Object(rope.clone()), c.context_length)
                .map(|d| d.attn_factor);
            if derived.ok() != Some(y.attn_factor) {
                rope.insert("attention_factor".into(), json!(y.attn_factor));
            }
        }
        None => {
            rope.insert("rope_type".into(), json!("default"));
        }
    }
    rope.insert("rope_theta".into(), json!(c.rope_theta));
    m.insert("rope_parameters".into(), Value::Object(rope));
    m.remove("use_sliding_window");
    m.insert("sliding_window".into(), json!(c.sliding_window));
    m.insert("layer_types".into(), super::hf_out::layer_types(c));
    if let Some(limit) = c.moe.as_ref().and_then(|m| m.clamped_swiglu) {
        m.insert("swiglu_limit".into(), json!(limit));
    }
    m.insert("quantization_config".into(), quantization_config());
}

#[cfg(test)]
mod tests {
    use super::*;
    use hf2q_tensor::quant::mxfp4::from_hf_blocks;

    /// Every code in every position and a spread of scales: the repacking is the exact inverse
    /// of the reader's (`from_hf_blocks`), both ways.
    #[test]
    fn hf_blocks_round_trip() {
        let mut ggml = Vec::new();
        for b in 0..40u32 {
            ggml.push((b * 7) as u8);
            ggml.extend((0..16u32).map(|j| (((j + b) % 16) | (((j * 3 + b) % 16) << 4)) as u8));
        }
        let (blocks, scales) = to_hf_blocks(&ggml).unwrap();
        assert_eq!((blocks.len(), scales.len()), (40 * 16, 40));
        assert_eq!(from_hf_blocks(&blocks, &scales).unwrap(), ggml);
        let hf: Vec<u8> = (0..40 * 16).map(|i| (i * 37 % 256) as u8).collect();
        let sc: Vec<u8> = (0..40).map(|i| (i * 5) as u8).collect();
        let (b2, s2) = to_hf_blocks(&from_hf_blocks(&hf, &sc).unwrap()).unwrap();
        assert_eq!((b2, s2), (hf, sc));
        assert!(to_hf_blocks(&ggml[..20]).is_err());
    }
}
