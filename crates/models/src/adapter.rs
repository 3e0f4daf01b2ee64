//! LoRA adapters of a model in PEFT's format: attaching fresh ones (PEFT's initialisation),
//! saving them (`adapter_config.json` + `adapter_model.safetensors`, PEFT's tensor names and
//! layouts) and loading adapters made here or by `peft`.
//!
//! Names: the module `model.layers.N.self_attn.q_proj` holds
//! `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` `(r, in)` and `...lora_B.weight`
//! `(out, r)`. GGUF Llama checkpoints store q/k rows permuted for interleaved RoPE (see
//! ARCHITECTURE.md); an adapter on such a base keeps its B rows of q/k in the base's order in
//! memory and in checkpoint (Hugging Face) order on disk, so a saved adapter is the same file
//! whatever format the base was loaded from.
//!
//! Not here: training the factors (`hf2q-train`), the layer math (`layers::lora`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hf2q_tensor::io::safetensors::{write_safetensors, SafeTensors, StDtype};
use hf2q_tensor::op::RopeStyle;
use hf2q_tensor::Tensor;
use serde_json::{json, Value};

use crate::adapter_set::ReadAdapter;
use crate::convert::source::permute_qk_rows;
use crate::layers::lora::Lora;
use crate::model::Model;
use crate::{Error, Result};

/// The products a LoRA may target, by PEFT's short module names.
pub const LINEAR_NAMES: [&str; 7] = [
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
];

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// An adapter's settings (PEFT's `LoraConfig` fields that change the function).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// Rank r (PEFT `r`).
    pub r: usize,
    /// PEFT `lora_alpha`.
    pub alpha: f32,
    /// PEFT `use_rslora`: scale `alpha / √r` instead of `alpha / r`.
    pub rslora: bool,
    /// PEFT `lora_dropout`.
    pub dropout: f32,
    /// Short module names (`q_proj`, ...).
    pub targets: Vec<String>,
    /// PEFT `layers_to_transform`: only these layers (`None`: all).
    pub layers: Option<Vec<usize>>,
}

impl Default for LoraConfig {
    /// PEFT's defaults (r 8, alpha 8, no dropout) on every linear of the blocks.
    fn default() -> LoraConfig {
        LoraConfig {
            r: 8,
            alpha: 8.0,
            rslora: false,
            dropout: 0.0,
            targets: LINEAR_NAMES.iter().map(|s| s.to_string()).collect(),
            layers: None,
        }
    }
}

impl LoraConfig {
    /// The factor the low-rank term is multiplied by, for rank `r`.
    pub fn scale_for(&self, r: usize) -> f32 {
        if self.rslora {
            self.alpha / (r as f32).sqrt()
        } else {
            self.alpha / r as f32
        }
    }

    /// Checks the settings; names what is wrong.
    pub fn validate(&self) -> Result<()> {
        if self.r == 0 {
            return Err(Error::Msg("LoRA rank r must be at least 1".into()));
        }
        if !self.alpha.is_finite() || self.alpha <= 0.0 {
            return Err(Error::Msg(format!("LoRA alpha {} must be positive", self.alpha)));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::Msg(format!(
                "LoRA dropout {} must be in [0, 1)",
                self.dropout
            )));
        }
        if self.targets.is_empty() {
            return Err(Error::Msg("no LoRA target modules".into()));
        }
        for t in &self.targets {
            if !LINEAR_NAMES.contains(&t.as_str()) {
                return Err(Error::Msg(format!(
                    "unknown LoRA target module '{t}' (this model's linears: {})",
                    LINEAR_NAMES.join(", ")
                )));
            }
        }
        Ok(())
    }

    /// Target names from a comma-separated list; `all` / `all-linear` is every linear.
    pub fn parse_targets(list: &str) -> Result<Vec<String>> {
        let list = list.trim();
        if list == "all" || list == "all-linear" {
            return Ok(LINEAR_NAMES.iter().map(|s| s.to_string()).collect());
        }
        let mut v: Vec<String> = list
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        v.sort();
        v.dedup();
        Ok(v)
    }

    fn applies(&self, layer: usize, path: &str) -> bool {
        let short = path.rsplit('.').next().unwrap_or(path);
        self.targets.iter().any(|t| t == short)
            && self.layers.as_ref().is_none_or(|l| l.contains(&layer))
    }
}

/// The PEFT name stem of a block's product: `base_model.model.model.layers.N.PATH`.
pub fn peft_stem(layer: usize, path: &str) -> String {
    format!("base_model.model.model.layers.{layer}.{path}")
}

/// A small deterministic generator for initialisation (xorshift64*).
struct InitRng(u64);
impl InitRng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (x >> 40) as f32 / (1u64 << 24) as f32
    }
}

impl Model {
    /// Attaches fresh adapters as PEFT initialises them (A ~ U(±1/√in), Kaiming-uniform with
    /// a = √5; B = 0, so the model's function is unchanged), drawn from `seed`. Replaces any
    /// adapters already attached.
    pub fn attach_lora(&mut self, cfg: &LoraConfig, seed: u64) -> Result<usize> {
        cfg.validate()?;
        self.detach_lora();
        let mut rng = InitRng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut id = 0;
        for (layer, block) in self.blocks_mut().iter_mut().enumerate() {
            for (path, lin) in block.linears_mut() {
                if !cfg.applies(layer, path) {
                    continue;
                }
                let (rows, cols) = (lin.w.rows, lin.w.cols);
                let bound = 1.0 / (cols as f32).sqrt();
                let a: Vec<f32> = (0..cfg.r * cols)
                    .map(|_| (rng.uniform() * 2.0 - 1.0) * bound)
                    .collect();
                lin.lora = Some(Lora {
                    a: Tensor::new(&[cfg.r, cols], a)?,
                    b: Tensor::zeros(&[rows, cfg.r]),
                    scale: cfg.scale_for(cfg.r),
                    dropout: cfg.dropout,
                    id,
                });
                id += 1;
            }
        }
        if id == 0 {
            return Err(Error::Msg("no layer matched the LoRA targets".into()));
        }
        self.place_adapters()?;
        Ok(id)
    }

    /// Removes every adapter.
    pub fn detach_lora(&mut self) {
        for block in self.blocks_mut() {
            for (_, lin) in block.linears_mut() {
                lin.lora = None;
            }
        }
    }

    /// Every attached adapter with its module name (`model.layers.N.PATH`), in id order.
    pub fn adapters(&self) -> Vec<(String, &Lora)> {
        let mut v: Vec<(String, &Lora)> = Vec::new();
        for (layer, block) in self.blocks().iter().enumerate() {
            for (path, lin) in block.linears() {
                if let Some(l) = &lin.lora {
                    v.push((format!("model.layers.{layer}.{path}"), l));
                }
            }
        }
        v.sort_by_key(|(_, l)| l.id);
        v
    }

    /// [`Model::adapters`], mutable (an optimizer's step).
    pub fn adapters_mut(&mut self) -> Vec<(String, &mut Lora)> {
        let mut v: Vec<(String, &mut Lora)> = Vec::new();
        for (layer, block) in self.blocks_mut().iter_mut().enumerate() {
            for (path, lin) in block.linears_mut() {
                if let Some(l) = &mut lin.lora {
                    v.push((format!("model.layers.{layer}.{path}"), l));
                }
            }
        }
        v.sort_by_key(|(_, l)| l.id);
        v
    }

    /// Moves every adapter's factors to where the model's backend keeps tensors.
    pub fn place_adapters(&mut self) -> Result<()> {
        let cuda = self.cuda().cloned();
        let be: &dyn hf2q_tensor::op::Backend = match &cuda {
            Some(c) => &**c,
            None => &hf2q_tensor::cpu::CpuBackend::REFERENCE,
        };
        for (_, l) in self.adapters_mut() {
            l.a = be.upload(&l.a)?;
            l.b = be.upload(&l.b)?;
        }
        Ok(())
    }

    /// Copies every adapter's factors to the host (before the backend changes).
    pub(crate) fn adapters_to_host(&mut self) -> Result<()> {
        let cuda = self.cuda().cloned();
        let Some(c) = cuda else { return Ok(()) };
        for (_, l) in self.adapters_mut() {
            l.a = hf2q_tensor::op::Backend::to_host(&*c, &l.a)?;
            l.b = hf2q_tensor::op::Backend::to_host(&*c, &l.b)?;
        }
        Ok(())
    }

    /// Whether this base keeps q/k rows in GGUF's permuted order.
    fn permuted_qk(&self) -> bool {
        self.config.rope_style == RopeStyle::Interleaved
    }

    /// Heads of a q or k projection (`None` for the other products).
    fn qk_heads(&self, path: &str) -> Option<usize> {
        if path.ends_with("q_proj") {
            Some(self.config.n_heads)
        } else if path.ends_with("k_proj") {
            Some(self.config.n_kv_heads)
        } else {
            None
        }
    }

    /// Puts the rows of a B factor (or of its gradient) `(rows, r)` of module `name`
    /// (`model.layers.N.PATH`) from this base's order into the checkpoint's (PEFT's) order:
    /// un-permutes q/k rows of GGUF Llama bases, leaves everything else.
    pub fn b_rows_to_peft(&self, name: &str, b: &mut [f32], rows: usize, r: usize) -> Result<()> {
        if let (true, Some(heads)) = (self.permuted_qk(), self.qk_heads(name)) {
            permute_qk_rows(b, rows, r, heads, false)?;
        }
        Ok(())
    }

    /// The adapters' tensors in PEFT's names and layout, `(name, shape, f32 values)`.
    pub fn adapter_tensors(&self) -> Result<Vec<(String, Vec<usize>, Vec<f32>)>> {
        let be = self.be();
        let mut out = Vec::new();
        for (name, l) in self.adapters() {
            let stem = format!("base_model.model.{name}");
            let a = be.to_host(&l.a)?;
            let b = be.to_host(&l.b)?;
            let mut bv = b.data().to_vec();
            let (rows, r) = b.dims2();
            self.b_rows_to_peft(&name, &mut bv, rows, r)?;
            out.push((format!("{stem}.lora_A.weight"), a.shape().to_vec(), a.into_data()));
            out.push((format!("{stem}.lora_B.weight"), vec![rows, r], bv));
        }
        Ok(out)
    }

    /// Writes the attached adapters as a PEFT adapter folder `dir` (built beside it under a
    /// temporary name, then renamed into place: an interrupted save leaves no adapter that looks
    /// complete, and an existing one is replaced only once the new one is whole).
    pub fn save_adapter(&self, dir: &Path, cfg: &LoraConfig, base_name: &str) -> Result<()> {
        write_dir_atomically(dir, |tmp| self.write_adapter_files(tmp, cfg, base_name))
    }

    /// Writes the adapter's two files into the existing folder `dir`, each under a temporary
    /// name renamed into place, the config last: until it is there, the folder does not look
    /// like an adapter.
    pub fn write_adapter_files(&self, dir: &Path, cfg: &LoraConfig, base_name: &str) -> Result<()> {
        let tensors = self.adapter_tensors()?;
        if tensors.is_empty() {
            return Err(Error::Msg("the model has no adapter to save".into()));
        }
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let refs: Vec<_> = tensors
            .iter()
            .zip(&bytes)
            .map(|((n, s, _), b)| (n.clone(), StDtype::F32, s.clone(), b.as_slice()))
            .collect();
        let config = peft_config_json(cfg, base_name);
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        write_safetensors(&dir.join(WEIGHTS_FILE), &refs, &meta)?;
        let text = serde_json::to_string_pretty(&config)
            .map_err(|e| Error::Msg(format!("adapter config: {e}")))?;
        write_file_atomically(&dir.join(CONFIG_FILE), (text + "\n").as_bytes())
    }

    /// Loads a PEFT LoRA adapter folder (ours or `peft`'s) onto this model, replacing any
    /// attached adapters. Every tensor is checked against the config and the base (see
    /// [`Model::read_adapter`]); on an error the model is left without adapters.
    pub fn load_adapter(&mut self, dir: &Path) -> Result<LoraConfig> {
        self.detach_lora();
        let read = self.read_adapter(dir)?;
        let mut factors = read.factors;
        for block in self.blocks_mut() {
            for (_, lin) in block.linears_mut() {
                lin.lora = factors.get_mut(lin.site).and_then(Option::take);
            }
        }
        if let Err(e) = self.place_adapters() {
            self.detach_lora();
            return Err(e);
        }
        Ok(read.config)
    }

    /// Reads a PEFT LoRA adapter folder for this model without attaching it (for an
    /// [`crate::adapter_set::AdapterSet`], or [`Model::load_adapter`]). Every tensor is checked
    /// against the config and the base: a missing or extra tensor, a wrong shape, a rank that
    /// disagrees with the config, or a value that is not finite is an error. The factors are on
    /// the host.
    pub fn read_adapter(&self, dir: &Path) -> Result<ReadAdapter> {
        let cfg = read_peft_config(dir)?;
        let path = dir.join(WEIGHTS_FILE);
        if !path.is_file() {
            return Err(Error::Msg(format!(
                "{}: no {WEIGHTS_FILE} (only safetensors adapters are read)",
                dir.display()
            )));
        }
        let st = SafeTensors::open(&path)?;
        let mut expected: std::collections::HashSet<String> = std::collections::HashSet::new();
        let permuted = self.permuted_qk();
        let (n_heads, n_kv) = (self.config.n_heads, self.config.n_kv_heads);
        let mut factors: Vec<Option<Lora>> = (0..self.sites()).map(|_| None).collect();
        let mut id = 0;
        for (layer, block) in self.blocks().iter().enumerate() {
            for (path_in, lin) in block.linears() {
                if !cfg.config.applies(layer, path_in) {
                    continue;
                }
                let stem = peft_stem(layer, path_in);
                let (an, bn) = (format!("{stem}.lora_A.weight"), format!("{stem}.lora_B.weight"));
                let (a, ash) = read_f32(&st, &an, &path)?;
                let (mut b, bsh) = read_f32(&st, &bn, &path)?;
                let (rows, cols) = (lin.w.rows, lin.w.cols);
                let r = cfg.rank_for(layer, path_in);
                if ash != [r, cols] || bsh != [rows, r] {
                    return Err(Error::Msg(format!(
                        "{}: '{stem}': lora_A {ash:?} and lora_B {bsh:?}, expected [{r}, {cols}] and [{rows}, {r}] (rank {r} from {CONFIG_FILE})",
                        path.display()
                    )));
                }
                let heads = if path_in.ends_with("q_proj") {
                    Some(n_heads)
                } else if path_in.ends_with("k_proj") {
                    Some(n_kv)
                } else {
                    None
                };
                if let (true, Some(h)) = (permuted, heads) {
                    permute_qk_rows(&mut b, rows, r, h, true)?;
                }
                let slot = factors
                    .get_mut(lin.site)
                    .ok_or_else(|| Error::Msg(format!("product site {} out of range", lin.site)))?;
                *slot = Some(Lora {
                    a: Tensor::new(&[r, cols], a)?,
                    b: Tensor::new(&[rows, r], b)?,
                    scale: cfg.scale_for(layer, path_in, r),
                    dropout: cfg.config.dropout,
                    id,
                });
                id += 1;
                expected.insert(an);
                expected.insert(bn);
            }
        }
        if let Some(extra) = st.tensors.iter().map(|t| &t.name).find(|n| !expected.contains(*n)) {
            return Err(Error::Msg(format!(
                "{}: tensor '{extra}' does not belong to a LoRA target of this model (targets: {}; layers: {})",
                path.display(),
                cfg.config.targets.join(", "),
                self.config.n_layers
            )));
        }
        if id == 0 {
            return Err(Error::Msg(format!(
                "{}: the adapter targets no module of this model",
                dir.display()
            )));
        }
        Ok(ReadAdapter {
            config: cfg.config,
            factors,
        })
    }
}

fn io_err(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source: e,
    }
}

/// A tensor of the adapter as f32 values with its shape; non-finite values are an error.
fn read_f32(st: &SafeTensors, name: &str, file: &Path) -> Result<(Vec<f32>, Vec<usize>)> {
    let info = st.tensor(name).ok_or_else(|| {
        Error::Msg(format!("{}: missing tensor '{name}'", file.display()))
    })?;
    let v = st.to_f32(info)?;
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(Error::Msg(format!(
            "{}: tensor '{name}' holds a non-finite value ({}) at element {i}",
            file.display(),
            v[i]
        )));
    }
    Ok((v, info.shape.clone()))
}

/// `adapter_config.json` as PEFT writes it for these settings.
fn peft_config_json(cfg: &LoraConfig, base_name: &str) -> Value {
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "use_rslora": cfg.rslora,
        "target_modules": cfg.targets,
        "layers_to_transform": cfg.layers,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    })
}

/// A PEFT config as read: the settings, plus per-module rank and alpha overrides.
pub struct PeftConfig {
    pub config: LoraConfig,
    pub base_model: Option<String>,
    /// PEFT `rank_pattern` / `alpha_pattern`: module-name suffix -> value.
    rank_pattern: BTreeMap<String, usize>,
    alpha_pattern: BTreeMap<String, f32>,
}

impl PeftConfig {
    /// The pattern entry whose key names this module (`key` equal to a dotted suffix of
    /// `model.layers.N.PATH`, as PEFT's plain keys match).
    fn pattern<'a, T>(map: &'a BTreeMap<String, T>, layer: usize, path: &str) -> Option<&'a T> {
        let full = format!("model.layers.{layer}.{path}");
        map.iter()
            .find(|(k, _)| full == **k || full.ends_with(&format!(".{k}")))
            .map(|(_, v)| v)
    }
    fn rank_for(&self, layer: usize, path: &str) -> usize {
        Self::pattern(&self.rank_pattern, layer, path)
            .copied()
            .unwrap_or(self.config.r)
    }
    fn scale_for(&self, layer: usize, path: &str, r: usize) -> f32 {
        let alpha = Self::pattern(&self.alpha_pattern, layer, path)
            .copied()
            .unwrap_or(self.config.alpha);
        LoraConfig {
            alpha,
            ..self.config.clone()
        }
        .scale_for(r)
    }
}

/// Reads and checks `dir/adapter_config.json`. Features that change the function and that
/// hf2q does not compute (DoRA, trained biases, fan-in-fan-out layouts, full modules to save)
/// are errors naming the field.
pub fn read_peft_config(dir: &Path) -> Result<PeftConfig> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| io_err(&path, e))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| Error::Msg(format!("{}: not JSON: {e}", path.display())))?;
    let bad = |m: String| Error::Msg(format!("{}: {m}", path.display()));
    let obj = v.as_object().ok_or_else(|| bad("not a JSON object".into()))?;
    let peft_type = obj.get("peft_type").and_then(Value::as_str).unwrap_or("LORA");
    if peft_type != "LORA" {
        return Err(bad(format!("peft_type '{peft_type}': only LORA adapters are supported")));
    }
    let flag = |k: &str| obj.get(k).and_then(Value::as_bool).unwrap_or(false);
    if flag("use_dora") {
        return Err(bad("use_dora: DoRA adapters are not supported".into()));
    }
    if flag("fan_in_fan_out") {
        return Err(bad("fan_in_fan_out: transposed (Conv1D) layouts are not supported".into()));
    }
    if let Some(b) = obj.get("bias").and_then(Value::as_str) {
        if b != "none" {
            return Err(bad(format!("bias '{b}': trained biases are not supported")));
        }
    }
    if obj.get("modules_to_save").is_some_and(|m| !m.is_null() && m.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(bad("modules_to_save: full module copies are not supported".into()));
    }
    let r = obj
        .get("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("missing or invalid 'r'".into()))? as usize;
    let alpha = obj
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .unwrap_or(8.0) as f32;
    let targets = match obj.get("target_modules") {
        Some(Value::String(s)) if s == "all-linear" => LINEAR_NAMES.iter().map(|s| s.to_string()).collect(),
        Some(Value::String(s)) => {
            return Err(bad(format!(
                "target_modules as a pattern ('{s}') is not supported: give a list of module names"
            )))
        }
        Some(Value::Array(a)) => {
            let mut t = Vec::new();
            for x in a {
                let s = x.as_str().ok_or_else(|| bad("target_modules holds a non-string".into()))?;
                // A dotted path names the same module by its last part.
                t.push(s.rsplit('.').next().unwrap_or(s).to_string());
            }
            t.sort();
            t.dedup();
            t
        }
        _ => return Err(bad("missing 'target_modules'".into())),
    };
    let layers = match obj.get("layers_to_transform") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => Some(vec![n.as_u64().ok_or_else(|| bad("bad layers_to_transform".into()))? as usize]),
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|x| x.as_u64().map(|n| n as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("bad layers_to_transform".into()))?,
        ),
        Some(_) => return Err(bad("bad layers_to_transform".into())),
    };
    let map_of = |k: &str| -> Result<BTreeMap<String, f64>> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(BTreeMap::new()),
            Some(Value::Object(m)) => m
                .iter()
                .map(|(k2, x)| {
                    x.as_f64()
                        .map(|f| (k2.clone(), f))
                        .ok_or_else(|| bad(format!("{k}: value of '{k2}' is not a number")))
                })
                .collect(),
            Some(_) => Err(bad(format!("{k} is not an object"))),
        }
    };
    let config = LoraConfig {
        r,
        alpha,
        rslora: flag("use_rslora"),
        dropout: obj.get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0) as f32,
        targets,
        layers,
    };
    config.validate().map_err(|e| bad(e.to_string()))?;
    Ok(PeftConfig {
        config,
        base_model: obj
            .get("base_model_name_or_path")
            .and_then(Value::as_str)
            .map(str::to_string),
        rank_pattern: map_of("rank_pattern")?
            .into_iter()
            .map(|(k, v)| (k, v as usize))
            .collect(),
        alpha_pattern: map_of("alpha_pattern")?
            .into_iter()
            .map(|(k, v)| (k, v as f32))
            .collect(),
    })
}

/// Writes `bytes` to `path` through a temporary name in the same folder, renamed into place.
pub fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| Error::Msg(format!("{}: not a file name", path.display())))?
        .to_string_lossy()
        .to_string();
    let tmp = path.with_file_name(format!(".{name}.partial-{}-{}", std::process::id(), unique_suffix()));
    let res = std::fs::write(&tmp, bytes).and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(path, e));
    }
    Ok(())
}

/// Builds a folder under a temporary name beside `dir` with `fill`, then renames it into place
/// (an existing `dir` is moved aside first and removed once the new one is in place).
pub fn write_dir_atomically(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = dir
        .file_name()
        .ok_or_else(|| Error::Msg(format!("{}: not a folder name", dir.display())))?
        .to_string_lossy()
        .to_string();
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| io_err(&parent, e))?;
    let tag = format!("{}-{}", std::process::id(), unique_suffix());
    let tmp = parent.join(format!(".{name}.partial-{tag}"));
    std::fs::create_dir(&tmp).map_err(|e| io_err(&tmp, e))?;
    if let Err(e) = fill(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let old = parent.join(format!(".{name}.old-{tag}"));
    let had_old = dir.exists();
    if had_old {
        std::fs::rename(dir, &old).map_err(|e| io_err(dir, e))?;
    }
    if let Err(e) = std::fs::rename(&tmp, dir) {
        if had_old {
            let _ = std::fs::rename(&old, dir);
        }
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(io_err(dir, e));
    }
    if had_old {
        let _ = std::fs::remove_dir_all(&old);
    }
    Ok(())
}

fn unique_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64)
        .unwrap_or(0);
    t ^ (N.fetch_add(1, Ordering::Relaxed) << 32)
}
