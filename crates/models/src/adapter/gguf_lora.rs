//! llama.cpp's LoRA GGUF (what `convert_lora_to_gguf.py` writes and `llama_adapter_lora_init`
//! reads, `src/llama-adapter.cpp`): metadata `general.type = adapter`, `adapter.type = lora`,
//! `general.architecture` = the base's (llama.cpp refuses another), `adapter.lora.alpha` (f32;
//! llama.cpp scales each product by `alpha / r` with r = `lora_b.ne[0]`, or by 1 when alpha is
//! 0). Tensors `blk.N.attn_q.weight.lora_a` with ggml dims `[in, r]` (PEFT's A `(r, in)`) and
//! `.lora_b` `[r, out]` (PEFT's B `(out, r)`), F32 as the converter writes by default. Llama
//! bases: the converter permutes B's rows of q/k as it permutes the base's q/k weights.
//!
//! One alpha for the file: rsLoRA (`alpha / √r`) and per-module alphas are folded into it, and
//! where one alpha cannot express every module's scale, the difference is multiplied into that
//! module's B. Not here: the base model's GGUF (`crate::convert`).

use std::collections::BTreeMap;
use std::path::Path;

use hf2q_tensor::io::gguf::{GgufFile, GgufValue, GgufWriter};
use hf2q_tensor::{Bytes, GgmlType};

use super::factors::{check_finite, layers_of, parse_module, targets_of, Halves, ModuleFactors};
use super::{AdapterFactors, LoraConfig};
use crate::config::{Arch, ModelConfig};
use crate::convert::source::{dequantize_rows, gguf_to_hf_table, permute_qk_rows};
use crate::names::hf_to_gguf;
use crate::{Error, Result};

/// Heads of the q/k product at `path` of a base whose GGUF permutes q/k rows (Llama), else None.
fn permuted_heads(c: &ModelConfig, path: &str) -> Option<usize> {
    if c.arch != Arch::Llama {
        return None;
    }
    match path {
        "self_attn.q_proj" => Some(c.n_heads),
        "self_attn.k_proj" => Some(c.n_kv_heads),
        _ => None,
    }
}

fn f32_bytes(v: &[f32]) -> Bytes {
    Bytes::from_vec(v.iter().flat_map(|x| x.to_le_bytes()).collect())
}

/// Writes `f` (checked against `base`) as a llama.cpp LoRA GGUF at `out` (atomically).
pub fn write(out: &Path, f: &AdapterFactors, base: &ModelConfig) -> Result<()> {
    f.check_config(out, base)?;
    let m0 = f.modules.first().expect("check refuses an empty adapter");
    // rsLoRA and per-module alphas fold into one alpha; plain LoRA keeps the config's exactly.
    let alpha = if f.config.rslora {
        f.scale_of(m0) * m0.r as f32
    } else {
        m0.alpha
    };
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", base.arch.name())?;
    w.add_metadata("general.type", "adapter")?;
    if let Some(name) = &f.base_model {
        w.add_metadata("general.name", name.as_str())?;
    }
    w.add_metadata("general.file_type", GgufValue::U32(0))?;
    w.add_metadata("adapter.type", "lora")?;
    w.add_metadata("adapter.lora.alpha", GgufValue::F32(alpha))?;
    for m in &f.modules {
        let hf = format!("{}.weight", m.name());
        let g = hf_to_gguf(base.arch, &hf)
            .ok_or_else(|| Error::Msg(format!("{hf}: no GGUF name for {}", base.arch.name())))?;
        let mut b = m.b.clone();
        let want = f.scale_of(m);
        let got = alpha / m.r as f32;
        if want != got {
            b.iter_mut().for_each(|x| *x *= want / got);
        }
        if let Some(h) = permuted_heads(base, &m.path) {
            permute_qk_rows(&mut b, m.rows, m.r, h, true)?;
        }
        w.add_tensor(
            format!("{g}.lora_a"),
            vec![m.cols as u64, m.r as u64],
            GgmlType::F32,
            f32_bytes(&m.a),
        )?;
        w.add_tensor(
            format!("{g}.lora_b"),
            vec![m.r as u64, m.rows as u64],
            GgmlType::F32,
            f32_bytes(&b),
        )?;
    }
    w.write_file(out)?;
    Ok(())
}

/// Reads a llama.cpp LoRA GGUF. `base` gives the layer count and, for Llama, the head counts
/// that undo the q/k row permutation (a Llama adapter touching q/k cannot be read without it).
pub fn read(path: &Path, base: Option<&ModelConfig>) -> Result<AdapterFactors> {
    let file = GgufFile::open(path)?;
    let p = path.display();
    let bad = |m: String| Error::Msg(format!("{p}: {m}"));
    match file.get_str("general.type") {
        Some("adapter") => {}
        other => {
            return Err(bad(format!(
                "general.type is {}, not 'adapter': not a LoRA adapter GGUF",
                other.map_or("missing".to_string(), |s| format!("'{s}'"))
            )))
        }
    }
    match file.get_str("adapter.type") {
        Some("lora") => {}
        other => {
            return Err(bad(format!(
                "adapter.type is {}, not 'lora' (only LoRA adapters are supported)",
                other.map_or("missing".to_string(), |s| format!("'{s}'"))
            )))
        }
    }
    let arch_name = file
        .get_str("general.architecture")
        .ok_or_else(|| bad("no general.architecture".into()))?;
    let arch = Arch::from_gguf(arch_name).ok_or_else(|| {
        bad(format!(
            "general.architecture '{arch_name}' is not supported"
        ))
    })?;
    if let Some(b) = base {
        if b.arch != arch {
            return Err(bad(format!(
                "an adapter for '{arch_name}', but the base is '{}'",
                b.arch.name()
            )));
        }
    }
    // llama.cpp reads a missing alpha as 0, which means scale 1.
    let alpha = file.get_f32("adapter.lora.alpha").unwrap_or(0.0);
    if !alpha.is_finite() || alpha < 0.0 {
        return Err(bad(format!(
            "adapter.lora.alpha {alpha} is not a non-negative number"
        )));
    }
    let max_layer = file
        .tensors
        .iter()
        .filter_map(|t| {
            t.name
                .strip_prefix("blk.")?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .max();
    let n_layers = base.map_or(max_layer.map_or(0, |l| l + 1), |b| b.n_layers);
    let table = gguf_to_hf_table(arch, n_layers);
    let not_target = |name: &str| {
        bad(format!(
            "tensor '{name}' does not belong to a LoRA target of this model (layers: {n_layers})"
        ))
    };
    let mut pairs: BTreeMap<(usize, &'static str), Halves<usize>> = BTreeMap::new();
    for (i, t) in file.tensors.iter().enumerate() {
        let (stem, is_a) = if let Some(s) = t.name.strip_suffix(".lora_a") {
            (s, true)
        } else if let Some(s) = t.name.strip_suffix(".lora_b") {
            (s, false)
        } else if t.name.ends_with("_norm.weight") {
            continue; // llama.cpp skips norm vectors in adapters too
        } else {
            return Err(bad(format!(
                "tensor '{}' has an unexpected suffix (expected .lora_a or .lora_b)",
                t.name
            )));
        };
        let hf = table.get(stem).ok_or_else(|| not_target(&t.name))?;
        let module = hf.strip_suffix(".weight").unwrap_or(hf);
        let (layer, mpath) = parse_module(module).ok_or_else(|| not_target(&t.name))?;
        let e = pairs.entry((layer, mpath)).or_default();
        if is_a {
            e.0 = Some(i);
        } else {
            e.1 = Some(i);
        }
    }
    let mut modules = Vec::new();
    for ((layer, mpath), (ai, bi)) in pairs {
        let g =
            hf_to_gguf(arch, &format!("model.layers.{layer}.{mpath}.weight")).unwrap_or_default();
        let (Some(ai), Some(bi)) = (ai, bi) else {
            let half = if ai.is_none() { "lora_a" } else { "lora_b" };
            return Err(bad(format!(
                "missing tensor '{g}.{half}' (each product needs lora_a and lora_b)"
            )));
        };
        let (ta, tb) = (&file.tensors[ai], &file.tensors[bi]);
        if ta.dims.len() != 2 || tb.dims.len() != 2 || ta.dims[1] != tb.dims[0] {
            return Err(bad(format!(
                "'{g}': lora_a dims {:?} and lora_b dims {:?} do not make a rank-r pair (expected [in, r] and [r, out])",
                ta.dims, tb.dims
            )));
        }
        let (cols, r, rows) = (
            ta.dims[0] as usize,
            ta.dims[1] as usize,
            tb.dims[1] as usize,
        );
        let a = dequantize_rows(ta.ty, file.tensor_data(ta)?.as_slice(), r, cols, &ta.name)?;
        let mut b = dequantize_rows(tb.ty, file.tensor_data(tb)?.as_slice(), rows, r, &tb.name)?;
        check_finite(&a, &format!("{p}: tensor '{}'", ta.name))?;
        check_finite(&b, &format!("{p}: tensor '{}'", tb.name))?;
        if arch == Arch::Llama && (mpath == "self_attn.q_proj" || mpath == "self_attn.k_proj") {
            let c = base.ok_or_else(|| {
                bad("a Llama adapter's q/k factors are stored in llama.cpp's permuted row order: give the base model to read it".into())
            })?;
            let h = permuted_heads(c, mpath).expect("llama q/k");
            permute_qk_rows(&mut b, rows, r, h, false).map_err(|e| bad(format!("'{g}': {e}")))?;
        }
        modules.push(ModuleFactors {
            layer,
            path: mpath.to_string(),
            r,
            cols,
            rows,
            alpha: if alpha == 0.0 { r as f32 } else { alpha },
            a,
            b,
        });
    }
    let Some(m0) = modules.first() else {
        return Err(bad("no LoRA tensors".into()));
    };
    let config = LoraConfig {
        r: m0.r,
        alpha: m0.alpha,
        rslora: false,
        dropout: 0.0,
        targets: targets_of(&modules),
        layers: layers_of(&modules, n_layers),
    };
    config.validate().map_err(|e| bad(e.to_string()))?;
    let mut f = AdapterFactors {
        config,
        base_model: file.get_str("general.name").map(str::to_string),
        modules,
    };
    f.sort();
    Ok(f)
}
