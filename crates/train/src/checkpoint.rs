//! Checkpoints of a run: `OUT/checkpoint-NNNNNN/` holding the adapter (PEFT files), the
//! optimizer's moments (`optimizer.safetensors`) and `trainer_state.json` (step, data position,
//! settings, the base model's identity). Each is built under a temporary name and renamed into
//! place whole; `--resume` takes a checkpoint folder or the run's output folder (its latest
//! checkpoint), and refuses one made for another model or other adapter settings.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hf2q_models::adapter::{write_dir_atomically, LoraConfig};
use hf2q_models::Model;
use hf2q_tensor::io::safetensors::{write_safetensors, SafeTensors, StDtype};
use hf2q_tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::optim::AdamW;
use crate::{Error, Result};

pub const STATE_FILE: &str = "trainer_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// What identifies a base model for resuming (a checkpoint from another one is refused).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModelIdentity {
    pub architecture: String,
    pub file: String,
    pub parameters: u64,
    pub n_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
}

impl ModelIdentity {
    pub fn of(m: &Model) -> ModelIdentity {
        let i = m.info();
        ModelIdentity {
            architecture: i.architecture,
            file: m
                .path()
                .file_name()
                .map(|s| s.to_string_lossy().to_string())
                .unwrap_or_default(),
            parameters: i.parameters,
            n_layers: i.n_layers,
            hidden_size: i.hidden_size,
            vocab_size: i.vocab_size,
        }
    }
}

/// The adapter settings as stored in a checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LoraSettings {
    pub r: usize,
    pub alpha: f32,
    pub rslora: bool,
    pub dropout: f32,
    pub targets: Vec<String>,
}

impl From<&LoraConfig> for LoraSettings {
    fn from(c: &LoraConfig) -> LoraSettings {
        LoraSettings {
            r: c.r,
            alpha: c.alpha,
            rslora: c.rslora,
            dropout: c.dropout,
            targets: c.targets.clone(),
        }
    }
}

/// Where a run is: enough to continue it exactly.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TrainState {
    /// Optimizer steps done.
    pub step: u64,
    pub total_steps: u64,
    /// The epoch in progress and the micro-batches of it already used.
    pub epoch: u64,
    pub micro: usize,
    pub seed: u64,
    pub tokens_seen: u64,
    pub model: ModelIdentity,
    pub lora: LoraSettings,
}

/// The folder of the checkpoint after `step` steps.
pub fn checkpoint_dir(out: &Path, step: u64) -> PathBuf {
    out.join(format!("checkpoint-{step:06}"))
}

/// Writes a checkpoint of the model's adapters, the optimizer and `state` under `out`.
pub fn save(
    out: &Path,
    model: &Model,
    lora: &LoraConfig,
    base_name: &str,
    adam: &AdamW,
    state: &TrainState,
) -> Result<PathBuf> {
    let dir = checkpoint_dir(out, state.step);
    let moments = adam.state()?;
    write_dir_atomically(&dir, |tmp| {
        model.write_adapter_files(tmp, lora, base_name)?;
        let names = ["m_a", "v_a", "m_b", "v_b"];
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = moments
            .iter()
            .enumerate()
            .flat_map(|(i, ms)| {
                ms.iter().zip(names).map(move |(t, n)| {
                    (
                        format!("{i}.{n}"),
                        t.shape().to_vec(),
                        t.data().iter().flat_map(|x| x.to_le_bytes()).collect(),
                    )
                })
            })
            .collect();
        let refs: Vec<_> = bytes
            .iter()
            .map(|(n, s, b)| (n.clone(), StDtype::F32, s.clone(), b.as_slice()))
            .collect();
        let mut meta = BTreeMap::new();
        meta.insert("step".to_string(), adam.step.to_string());
        write_safetensors(&tmp.join(OPTIMIZER_FILE), &refs, &meta)?;
        let json = serde_json::to_string_pretty(state)
            .map_err(|e| hf2q_models::Error::Msg(format!("trainer state: {e}")))?;
        std::fs::write(tmp.join(STATE_FILE), json + "\n").map_err(|e| hf2q_models::Error::Io {
            path: tmp.join(STATE_FILE),
            source: e,
        })?;
        Ok(())
    })?;
    Ok(dir)
}

/// The checkpoint folder `path` names: itself, or the latest `checkpoint-*` inside it.
pub fn find(path: &Path) -> Result<PathBuf> {
    if path.join(STATE_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    let rd = std::fs::read_dir(path).map_err(|e| Error::io(path, e))?;
    let mut best: Option<(u64, PathBuf)> = None;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(n) = name
            .strip_prefix("checkpoint-")
            .and_then(|s| s.parse::<u64>().ok())
        {
            if e.path().join(STATE_FILE).is_file() && best.as_ref().is_none_or(|b| n > b.0) {
                best = Some((n, e.path()));
            }
        }
    }
    best.map(|b| b.1).ok_or_else(|| {
        Error::Config(format!(
            "{}: no checkpoint to resume from (a checkpoint-N folder with {STATE_FILE})",
            path.display()
        ))
    })
}

/// Reads a checkpoint's state and checks it belongs to this model and these adapter settings.
pub fn read_state(dir: &Path, model: &Model, lora: &LoraConfig) -> Result<TrainState> {
    let p = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&p).map_err(|e| Error::io(&p, e))?;
    let state: TrainState = serde_json::from_str(&text)
        .map_err(|e| Error::Config(format!("{}: not a trainer state: {e}", p.display())))?;
    let here = ModelIdentity::of(model);
    if state.model != here {
        return Err(Error::Config(format!(
            "{}: this checkpoint was made for another model ({} '{}', {} parameters), not {} '{}' ({} parameters)",
            dir.display(),
            state.model.architecture,
            state.model.file,
            state.model.parameters,
            here.architecture,
            here.file,
            here.parameters
        )));
    }
    let want = LoraSettings::from(lora);
    if state.lora != want {
        return Err(Error::Config(format!(
            "{}: this checkpoint has other adapter settings ({:?}) than asked for ({:?})",
            dir.display(),
            state.lora,
            want
        )));
    }
    Ok(state)
}

/// The optimizer moments of a checkpoint (host tensors, adapter order).
pub fn read_moments(dir: &Path, adapters: usize) -> Result<Vec<[Tensor; 4]>> {
    let st = SafeTensors::open(&dir.join(OPTIMIZER_FILE))?;
    (0..adapters)
        .map(|i| -> Result<[Tensor; 4]> {
            let get = |n: &str| -> Result<Tensor> {
                let key = format!("{i}.{n}");
                let info = st.tensor(&key).ok_or_else(|| {
                    Error::Config(format!("{}: no optimizer state '{key}'", dir.display()))
                })?;
                Ok(Tensor::new(&info.shape, st.to_f32(info)?)?)
            };
            Ok([get("m_a")?, get("v_a")?, get("m_b")?, get("v_b")?])
        })
        .collect()
}
