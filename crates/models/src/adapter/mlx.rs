//! mlx-lm's LoRA adapter folder (`mlx_lm/tuner/utils.py` `load_adapters`, `tuner/lora.py`
//! `LoRALinear`): `adapters.safetensors` with `model.layers.N.PATH.lora_a` `(in, r)` and
//! `.lora_b` `(r, out)` (PEFT's A and B transposed), and `adapter_config.json` with
//! `fine_tune_type = "lora"`, `num_layers` (LoRA on the last N blocks) and `lora_parameters`
//! `{rank, scale, dropout, keys}` (`keys`: block paths such as `self_attn.q_proj`). The product is
//! `y = x Wᵀ + scale · (x lora_a) lora_b`, so mlx-lm's `scale` is PEFT's `alpha / r`.
//!
//! mlx-lm has one rank and one scale for every module, on a run of last layers: an adapter with
//! per-module ranks, or on layers that are not the last ones, is refused by name; per-module
//! scales are multiplied into B. Not here: mlx-lm's model folders (`crate::convert::mlx_out`).

use std::collections::BTreeMap;
use std::path::Path;

use hf2q_tensor::io::safetensors::{write_safetensors, SafeTensors};
use serde_json::{json, Value};

use super::factors::{
    check_finite, module_path, parse_module, targets_of, F32Tensors, Halves, ModuleFactors,
};
use super::{write_dir_atomically, write_file_atomically, AdapterFactors, LoraConfig, CONFIG_FILE};
use crate::config::ModelConfig;
use crate::{Error, Result};

pub const WEIGHTS_FILE: &str = "adapters.safetensors";

/// `(rows, cols)` row-major -> `(cols, rows)`.
pub(crate) fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; v.len()];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = v[i * cols + j];
        }
    }
    t
}

/// Writes `f` as an mlx-lm adapter folder `dir` (built under a temporary name, then renamed).
/// `n_layers`: the base's block count (mlx-lm counts `num_layers` from the last block).
pub fn write(dir: &Path, f: &AdapterFactors, base: &ModelConfig) -> Result<()> {
    f.check_config(dir, base)?;
    let n_layers = base.n_layers;
    let m0 = f.modules.first().expect("check refuses an empty adapter");
    if let Some(m) = f.modules.iter().find(|m| m.r != m0.r) {
        return Err(Error::Msg(format!(
            "mlx-lm adapters have one rank: {} has rank {}, {} rank {}",
            m0.name(),
            m0.r,
            m.name(),
            m.r
        )));
    }
    let first = match &f.config.layers {
        None => 0,
        Some(l) => {
            let lo = *l.iter().min().unwrap_or(&0);
            let run: Vec<usize> = (lo..n_layers).collect();
            let mut have = l.clone();
            have.sort();
            have.dedup();
            if have != run {
                return Err(Error::Msg(format!(
                    "mlx-lm adapters cover the last num_layers blocks: layers {have:?} of {n_layers} are not such a run"
                )));
            }
            lo
        }
    };
    let scale = f.scale_of(m0);
    let mut tensors = F32Tensors::default();
    for m in &f.modules {
        let s = f.scale_of(m);
        let mut b = m.b.clone();
        if s != scale {
            b.iter_mut().for_each(|x| *x *= s / scale);
        }
        let stem = m.name();
        tensors.push(
            format!("{stem}.lora_a"),
            vec![m.cols, m.r],
            &transpose(&m.a, m.r, m.cols),
        );
        tensors.push(
            format!("{stem}.lora_b"),
            vec![m.r, m.rows],
            &transpose(&b, m.rows, m.r),
        );
    }
    let keys: Vec<String> = f
        .config
        .targets
        .iter()
        .filter_map(|t| module_path(t).map(str::to_string))
        .collect();
    let config = json!({
        "fine_tune_type": "lora",
        "num_layers": n_layers - first,
        "lora_parameters": {
            "rank": m0.r,
            "scale": scale,
            "dropout": f.config.dropout,
            "keys": keys,
        },
    });
    write_dir_atomically(dir, |tmp| {
        let refs = tensors.refs();
        let meta = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
        write_safetensors(&tmp.join(WEIGHTS_FILE), &refs, &meta)?;
        let text = serde_json::to_string_pretty(&config)
            .map_err(|e| Error::Msg(format!("adapter config: {e}")))?;
        write_file_atomically(&tmp.join(CONFIG_FILE), (text + "\n").as_bytes())
    })
}

/// Reads an mlx-lm adapter folder. `base` gives the block count `num_layers` counts back from
/// (without it, the last block holding a tensor is taken as the base's last).
pub fn read(dir: &Path, base: Option<&ModelConfig>) -> Result<AdapterFactors> {
    let cpath = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&cpath).map_err(|e| Error::Io {
        path: cpath.clone(),
        source: e,
    })?;
    let c = cpath.display();
    let bad = |m: String| Error::Msg(format!("{c}: {m}"));
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let ft = v
        .get("fine_tune_type")
        .and_then(Value::as_str)
        .unwrap_or("lora");
    if ft != "lora" {
        return Err(bad(format!(
            "fine_tune_type '{ft}': only LoRA adapters are supported (not DoRA or full fine-tunes)"
        )));
    }
    let lp = v
        .get("lora_parameters")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("missing 'lora_parameters'".into()))?;
    let rank = lp
        .get("rank")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("lora_parameters: missing or invalid 'rank'".into()))?
        as usize;
    let scale = lp.get("scale").and_then(Value::as_f64).ok_or_else(|| {
        bad("lora_parameters: missing or invalid 'scale' (mlx-lm's LoRA scale)".into())
    })? as f32;
    if !scale.is_finite() || scale <= 0.0 || rank == 0 {
        return Err(bad(format!(
            "lora_parameters: rank {rank} and scale {scale} must be positive"
        )));
    }
    let dropout = lp.get("dropout").and_then(Value::as_f64).unwrap_or(0.0) as f32;
    let wpath = dir.join(WEIGHTS_FILE);
    let st = SafeTensors::open(&wpath)?;
    let w = wpath.display();
    let not_target = |name: &str| {
        Error::Msg(format!(
            "{w}: tensor '{name}' does not belong to a LoRA target of this model (layers: {})",
            base.map_or("?".to_string(), |b| b.n_layers.to_string())
        ))
    };
    let mut pairs: BTreeMap<(usize, &'static str), Halves<&str>> = BTreeMap::new();
    for t in &st.tensors {
        let n = t.name.as_str();
        let (stem, is_a) = if let Some(s) = n.strip_suffix(".lora_a") {
            (s, true)
        } else if let Some(s) = n.strip_suffix(".lora_b") {
            (s, false)
        } else {
            return Err(not_target(n));
        };
        let (layer, p) = parse_module(stem).ok_or_else(|| not_target(n))?;
        if base.is_some_and(|b| layer >= b.n_layers) {
            return Err(not_target(n));
        }
        let e = pairs.entry((layer, p)).or_default();
        if is_a {
            e.0 = Some(n);
        } else {
            e.1 = Some(n);
        }
    }
    let mut modules = Vec::new();
    for ((layer, mpath), (an, bn)) in pairs {
        let stem = format!("model.layers.{layer}.{mpath}");
        let get = |n: Option<&str>, half: &str| -> Result<(Vec<f32>, Vec<usize>)> {
            let name = n.map(str::to_string).unwrap_or(format!("{stem}.{half}"));
            let info = st
                .tensor(&name)
                .ok_or_else(|| Error::Msg(format!("{w}: missing tensor '{name}'")))?;
            let v = st.to_f32(info)?;
            check_finite(&v, &format!("{w}: tensor '{name}'"))?;
            Ok((v, info.shape.clone()))
        };
        let (a, ash) = get(an, "lora_a")?;
        let (b, bsh) = get(bn, "lora_b")?;
        if ash.len() != 2 || bsh.len() != 2 || ash[1] != rank || bsh[0] != rank {
            return Err(Error::Msg(format!(
                "{w}: '{stem}': lora_a {ash:?} and lora_b {bsh:?}, expected [in, {rank}] and [{rank}, out] (rank {rank} from {CONFIG_FILE})"
            )));
        }
        let (cols, rows) = (ash[0], bsh[1]);
        modules.push(ModuleFactors {
            layer,
            path: mpath.to_string(),
            r: rank,
            cols,
            rows,
            alpha: scale * rank as f32,
            a: transpose(&a, cols, rank),
            b: transpose(&b, rank, rows),
        });
    }
    let n_layers = match base {
        Some(b) => b.n_layers,
        None => modules.iter().map(|m| m.layer + 1).max().unwrap_or(0),
    };
    let num_layers = match v.get("num_layers").and_then(Value::as_i64) {
        Some(n) if n >= 0 => (n as usize).min(n_layers),
        // mlx-lm slices `layers[-max(n, 0):]`: a negative count is every block.
        Some(_) => n_layers,
        None => return Err(bad("missing or invalid 'num_layers'".into())),
    };
    let targets = match lp.get("keys") {
        None | Some(Value::Null) => targets_of(&modules),
        Some(Value::Array(a)) => {
            let mut t = Vec::new();
            for k in a {
                let k = k
                    .as_str()
                    .ok_or_else(|| bad("keys holds a non-string".into()))?;
                let short = k.rsplit('.').next().unwrap_or(k);
                if module_path(short) != Some(k) {
                    return Err(bad(format!(
                        "key '{k}' is not a block product hf2q adapts (self_attn.q_proj, ..., mlp.down_proj)"
                    )));
                }
                t.push(short.to_string());
            }
            t.sort();
            t.dedup();
            t
        }
        Some(_) => return Err(bad("lora_parameters.keys is not a list".into())),
    };
    let config = LoraConfig {
        r: rank,
        alpha: scale * rank as f32,
        rslora: false,
        dropout,
        targets,
        layers: if num_layers >= n_layers {
            None
        } else {
            Some((n_layers - num_layers..n_layers).collect())
        },
    };
    config.validate().map_err(|e| bad(e.to_string()))?;
    let mut f = AdapterFactors {
        config,
        base_model: None,
        modules,
    };
    f.sort();
    Ok(f)
}
