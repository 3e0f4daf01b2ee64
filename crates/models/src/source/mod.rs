//! Where weights come from: a GGUF file, a Hugging Face folder (one or sharded safetensors) or an
//! MLX folder (affine-quantized safetensors). Every source answers in Hugging Face tensor names
//! and hands out weights in their stored form (no dequantization at load).

use std::path::{Path, PathBuf};

use hf2q_tensor::io::gguf::GgufFile;
use hf2q_tensor::io::safetensors::{ShardedSafeTensors, StDtype};
use hf2q_tensor::quant::mlx::AffineParams;
use hf2q_tensor::{GgmlType, QTensor};
use serde_json::Value;

use crate::config::{Arch, ModelConfig};
use crate::names::hf_to_gguf;
mod experts;

use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Gguf,
    Safetensors,
    Mlx,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Gguf => "gguf",
            Format::Safetensors => "safetensors",
            Format::Mlx => "mlx",
        }
    }
}

pub enum WeightSource {
    Gguf {
        file: GgufFile,
        arch: Arch,
    },
    /// Hugging Face or MLX folder; `quant` holds MLX's `quantization` block when present.
    St {
        st: ShardedSafeTensors,
        quant: Option<Value>,
        prefixes: Vec<String>,
    },
}

/// Finds the model folder inside a Hugging Face cache entry (`models--ORG--NAME`): the snapshot
/// `refs/main` names, else the only / newest snapshot. Other paths are returned unchanged.
pub fn resolve_hf_cache(path: &Path) -> Result<PathBuf> {
    let snaps = path.join("snapshots");
    if !snaps.is_dir() || path.join("config.json").exists() {
        return Ok(path.to_path_buf());
    }
    if let Ok(rev) = std::fs::read_to_string(path.join("refs").join("main")) {
        // A revision is one folder name: never let the file steer the path elsewhere.
        let rev = rev.trim();
        let valid = !rev.is_empty() && !rev.contains(['/', '\\']) && rev != "." && rev != "..";
        if valid && snaps.join(rev).is_dir() {
            return Ok(snaps.join(rev));
        }
    }
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for e in std::fs::read_dir(&snaps).map_err(|e| Error::Io {
        path: snaps.clone(),
        source: e,
    })? {
        let e = e.map_err(|e| Error::Io {
            path: snaps.clone(),
            source: e,
        })?;
        let t = e
            .metadata()
            .and_then(|m| m.modified())
            .unwrap_or(std::time::UNIX_EPOCH);
        if e.path().is_dir() && best.as_ref().is_none_or(|(bt, _)| t > *bt) {
            best = Some((t, e.path()));
        }
    }
    best.map(|(_, p)| p).ok_or_else(|| {
        Error::Msg(format!(
            "{}: Hugging Face cache entry has no snapshot",
            path.display()
        ))
    })
}

fn st_dtype_to_ggml(d: StDtype) -> Option<GgmlType> {
    match d {
        StDtype::F32 => Some(GgmlType::F32),
        StDtype::F16 => Some(GgmlType::F16),
        StDtype::BF16 => Some(GgmlType::BF16),
        _ => None,
    }
}

impl WeightSource {
    pub fn gguf(file: GgufFile, arch: Arch) -> WeightSource {
        WeightSource::Gguf { file, arch }
    }

    pub fn safetensors(dir: &Path, config: &Value) -> Result<WeightSource> {
        let st = ShardedSafeTensors::open_dir(dir)?;
        let quant = config
            .get("quantization")
            .or_else(|| config.get("quantization_config"))
            .cloned();
        // Multimodal checkpoints keep the text model under another prefix.
        let prefixes = ["", "language_model.", "model.language_model."]
            .iter()
            .map(|s| s.to_string())
            .collect();
        Ok(WeightSource::St {
            st,
            quant: quant.filter(|q| q.get("bits").is_some()),
            prefixes,
        })
    }

    pub fn format(&self) -> Format {
        match self {
            WeightSource::Gguf { .. } => Format::Gguf,
            WeightSource::St { quant: Some(_), .. } => Format::Mlx,
            WeightSource::St { .. } => Format::Safetensors,
        }
    }

    /// Resolves an HF name to the name stored in a safetensors checkpoint.
    fn st_name(st: &ShardedSafeTensors, prefixes: &[String], hf: &str) -> Option<String> {
        for p in prefixes {
            let cand = if p.is_empty() {
                hf.to_string()
            } else if p == "model.language_model." {
                match hf.strip_prefix("model.") {
                    Some(rest) => format!("{p}{rest}"),
                    None => continue,
                }
            } else {
                format!("{p}{hf}")
            };
            if st.get(&cand).is_some() {
                return Some(cand);
            }
        }
        None
    }

    pub fn contains(&self, hf: &str) -> bool {
        match self {
            WeightSource::Gguf { file, arch } => {
                hf_to_gguf(*arch, hf).is_some_and(|g| file.tensor(&g).is_some())
            }
            WeightSource::St { st, prefixes, .. } => {
                let stem = hf.strip_suffix(".weight").unwrap_or(hf);
                Self::st_name(st, prefixes, hf).is_some()
                    || Self::st_name(st, prefixes, &format!("{stem}.scales")).is_some()
            }
        }
    }

    /// A 2-D weight `(R, C)` in its stored form.
    pub fn matrix(&self, hf: &str) -> Result<QTensor> {
        match self {
            WeightSource::Gguf { file, arch } => {
                let g =
                    hf_to_gguf(*arch, hf).ok_or_else(|| Error::MissingTensor(hf.to_string()))?;
                let info = file
                    .tensor(&g)
                    .ok_or_else(|| Error::MissingTensor(format!("{g} ({hf})")))?;
                let dims = &info.dims;
                let (c, r) = match dims.len() {
                    2 => (dims[0], dims[1]),
                    _ => {
                        return Err(Error::Config(format!(
                            "tensor '{g}' has {} dims, 2 expected",
                            dims.len()
                        )))
                    }
                };
                let data = file.tensor_data(info)?;
                Ok(QTensor::ggml(
                    &g,
                    info.ty,
                    usize::try_from(r).unwrap_or(usize::MAX),
                    usize::try_from(c).unwrap_or(usize::MAX),
                    data,
                )?)
            }
            WeightSource::St {
                st,
                quant,
                prefixes,
            } => {
                let stem = hf.strip_suffix(".weight").unwrap_or(hf);
                if let Some(sname) = Self::st_name(st, prefixes, &format!("{stem}.scales")) {
                    let q = quant.as_ref().ok_or_else(|| {
                        Error::Config(format!(
                            "'{sname}' is MLX-quantized but config.json has no quantization block"
                        ))
                    })?;
                    return self.mlx_matrix(st, q, stem, &sname);
                }
                let name = Self::st_name(st, prefixes, hf)
                    .ok_or_else(|| Error::MissingTensor(hf.to_string()))?;
                let (file, info) = st
                    .get(&name)
                    .ok_or_else(|| Error::MissingTensor(name.clone()))?;
                let ty = st_dtype_to_ggml(info.dtype).ok_or_else(|| {
                    Error::Config(format!(
                        "tensor '{name}': dtype {:?} is not a float weight",
                        info.dtype
                    ))
                })?;
                if info.shape.len() != 2 {
                    return Err(Error::Config(format!(
                        "tensor '{name}' has shape {:?}, 2-D expected",
                        info.shape
                    )));
                }
                Ok(QTensor::ggml(
                    &name,
                    ty,
                    info.shape[0],
                    info.shape[1],
                    file.tensor_data(info)?,
                )?)
            }
        }
    }

    fn mlx_matrix(
        &self,
        st: &ShardedSafeTensors,
        q: &Value,
        stem: &str,
        scales_name: &str,
    ) -> Result<QTensor> {
        // Per-layer overrides are keyed by the module path as stored (with or without prefix).
        let stored_stem = scales_name.strip_suffix(".scales").unwrap_or(stem);
        let over = q.get(stored_stem).or_else(|| q.get(stem));
        let pick = |k: &str| {
            over.and_then(|o| o.get(k))
                .or_else(|| q.get(k))
                .and_then(Value::as_u64)
        };
        let bits =
            pick("bits").ok_or_else(|| Error::Config("MLX quantization lacks bits".into()))? as u32;
        let group = pick("group_size").unwrap_or(64) as usize;
        let wname = format!("{stored_stem}.weight");
        // mlx-lm writes "mode" (affine, mxfp4, nvfp4, mxfp8); only affine is this layout.
        let mode = over
            .and_then(|o| o.get("mode"))
            .or_else(|| q.get("mode"))
            .and_then(Value::as_str)
            .unwrap_or("affine");
        if mode != "affine" {
            return Err(Error::Config(format!(
                "MLX '{wname}': quantization mode '{mode}' is not supported (affine only)"
            )));
        }
        let bname = format!("{stored_stem}.biases");
        let (wf, wi) = st
            .get(&wname)
            .ok_or_else(|| Error::MissingTensor(wname.clone()))?;
        let (sf, si) = st
            .get(scales_name)
            .ok_or_else(|| Error::MissingTensor(scales_name.to_string()))?;
        let (bf, bi) = st
            .get(&bname)
            .ok_or_else(|| Error::MissingTensor(bname.clone()))?;
        if wi.shape.len() != 2 || wi.dtype != StDtype::U32 {
            return Err(Error::Config(format!(
                "MLX weight '{wname}' must be 2-D uint32, found {:?} {:?}",
                wi.dtype, wi.shape
            )));
        }
        if bits == 0 || bits > 8 {
            return Err(Error::Config(format!(
                "MLX '{wname}': {bits} bits is not supported"
            )));
        }
        let rows = wi.shape[0];
        let row_bits = wi.shape[1]
            .checked_mul(32)
            .ok_or_else(|| Error::Config("MLX shape overflows".into()))?;
        let cols = row_bits / bits as usize;
        // Scales and biases are (R, C / group): checked as 2-D shapes, not only as counts, so a
        // transposed tensor or a config whose bits/group disagree with the file is refused here.
        if !row_bits.is_multiple_of(bits as usize) || group == 0 || !cols.is_multiple_of(group) {
            return Err(Error::Config(format!(
                "MLX '{wname}' {:?} does not hold whole groups at {bits} bits / group {group} (config.json disagrees with the file)",
                wi.shape
            )));
        }
        let want = [rows, cols / group];
        for (n, i) in [(scales_name, si), (bname.as_str(), bi)] {
            if i.shape != want {
                return Err(Error::Config(format!(
                    "MLX '{n}' has shape {:?}; weight {:?} at {bits} bits / group {group} (config.json) needs {want:?}",
                    i.shape, wi.shape
                )));
            }
        }
        Ok(QTensor::affine(
            &wname,
            AffineParams {
                bits,
                group_size: group,
            },
            rows,
            cols,
            wf.tensor_data(wi)?,
            sf.to_f32(si)?,
            bf.to_f32(bi)?,
        )?)
    }

    /// A 1-D tensor (norm weight, bias, rope factors) as f32.
    pub fn vector(&self, hf: &str) -> Result<Vec<f32>> {
        match self {
            WeightSource::Gguf { file, arch } => {
                let g =
                    hf_to_gguf(*arch, hf).ok_or_else(|| Error::MissingTensor(hf.to_string()))?;
                let info = file
                    .tensor(&g)
                    .ok_or_else(|| Error::MissingTensor(format!("{g} ({hf})")))?;
                if info.dims.len() != 1 {
                    return Err(Error::Config(format!(
                        "tensor '{g}' has {} dims, 1 expected",
                        info.dims.len()
                    )));
                }
                let n = usize::try_from(info.dims[0])
                    .map_err(|_| Error::Config(format!("tensor '{g}' is too large")))?;
                let mut out = vec![0f32; n];
                hf2q_tensor::quant::dequantize(
                    info.ty,
                    file.tensor_data(info)?.as_slice(),
                    &mut out,
                )?;
                Ok(out)
            }
            WeightSource::St { st, prefixes, .. } => {
                let name = Self::st_name(st, prefixes, hf)
                    .ok_or_else(|| Error::MissingTensor(hf.to_string()))?;
                let (file, info) = st
                    .get(&name)
                    .ok_or_else(|| Error::MissingTensor(name.clone()))?;
                if info.shape.len() != 1 {
                    return Err(Error::Config(format!(
                        "tensor '{name}' has shape {:?}, 1-D expected",
                        info.shape
                    )));
                }
                Ok(file.to_f32(info)?)
            }
        }
    }

    /// Every stored tensor: (name, stored type, element count) — for `inspect`.
    pub fn tensor_summary(&self) -> Vec<(String, String, u64)> {
        match self {
            WeightSource::Gguf { file, .. } => file
                .tensors
                .iter()
                .map(|t| (t.name.clone(), t.ty.to_string(), t.numel()))
                .collect(),
            WeightSource::St { st, quant, .. } => {
                let mut out = Vec::new();
                for name in st.names() {
                    let Some((_, info)) = st.get(name) else {
                        continue;
                    };
                    if name.ends_with(".scales")
                        || name.ends_with(".biases")
                            && quant.is_some()
                            && st.get(&name.replace(".biases", ".scales")).is_some()
                    {
                        continue;
                    }
                    let n: u64 = info.shape.iter().map(|&d| d as u64).product();
                    // GPT-OSS's MXFP4 experts: two values a byte in `*_blocks`, the scales of
                    // `*_scales` counted with them.
                    if let Some(stem) = name.strip_suffix("_scales") {
                        if st.get(&format!("{stem}_blocks")).is_some() {
                            continue;
                        }
                    }
                    if let Some(stem) = name.strip_suffix("_blocks") {
                        if st.get(&format!("{stem}_scales")).is_some() {
                            out.push((name.clone(), "MXFP4".into(), n * 2));
                            continue;
                        }
                    }
                    let stem = name.strip_suffix(".weight").unwrap_or(name);
                    if let (Some(q), true) = (quant, st.get(&format!("{stem}.scales")).is_some()) {
                        let over = q.get(stem);
                        let bits = over
                            .and_then(|o| o.get("bits"))
                            .or_else(|| q.get("bits"))
                            .and_then(Value::as_u64)
                            .unwrap_or(4);
                        let g = over
                            .and_then(|o| o.get("group_size"))
                            .or_else(|| q.get("group_size"))
                            .and_then(Value::as_u64)
                            .unwrap_or(64);
                        out.push((name.clone(), format!("mlx{bits}g{g}"), n * 32 / bits.max(1)));
                    } else {
                        out.push((name.clone(), format!("{:?}", info.dtype), n));
                    }
                }
                out
            }
        }
    }
}

/// Loads the config of a safetensors/MLX folder.
pub fn read_config_json(dir: &Path) -> Result<Value> {
    let p = dir.join("config.json");
    let s = std::fs::read_to_string(&p).map_err(|e| Error::Io {
        path: p.clone(),
        source: e,
    })?;
    serde_json::from_str(&s).map_err(|e| Error::Config(format!("{}: {e}", p.display())))
}

pub fn config_from_source(src: &WeightSource, hf_config: Option<&Value>) -> Result<ModelConfig> {
    match (src, hf_config) {
        (WeightSource::Gguf { file, .. }, _) => {
            let has_output = file.tensor("output.weight").is_some();
            ModelConfig::from_gguf(file, has_output)
        }
        (_, Some(v)) => ModelConfig::from_hf_json(v),
        _ => Err(Error::Config("no config.json".into())),
    }
}
