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
//! Other formats: [`factors`] holds an adapter independent of its file (and PEFT's reader and
//! writer of it), [`gguf_lora`] llama.cpp's LoRA GGUF, [`mlx`] mlx-lm's adapter folder, [`fuse`]
//! the sum base + B·A·scale for writing a standalone model. [`Model::load_adapter`] reads all
//! three formats, told apart by content.
//!
//! Not here: training the factors (`hf2q-train`), the layer math (`layers::lora`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hf2q_tensor::op::RopeStyle;
use hf2q_tensor::Tensor;
use serde_json::{json, Value};

pub mod factors;
pub mod fuse;
pub mod gguf_lora;
pub mod mlx;

pub use factors::{AdapterFactors, ModuleFactors};

use crate::adapter_set::ReadAdapter;
use crate::config::ModelConfig;
use crate::convert::source::permute_qk_rows;
use crate::layers::lora::Lora;
use crate::model::Model;
use crate::{Error, Result};

/// The products a LoRA may target, by PEFT's short module names.
pub const LINEAR_NAMES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
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
            return Err(Error::Msg(format!(
                "LoRA alpha {} must be positive",
                self.alpha
            )));
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

    pub(crate) fn applies(&self, layer: usize, path: &str) -> bool {
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
            None => &hf2q_cpu::CpuBackend::REFERENCE,
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

    /// Writes the attached adapters as a PEFT adapter folder `dir` (built beside it under a
    /// temporary name, then renamed into place: an interrupted save leaves no adapter that looks
    /// complete, and an existing one is replaced only once the new one is whole).
    pub fn save_adapter(&self, dir: &Path, cfg: &LoraConfig, base_name: &str) -> Result<()> {
        write_dir_atomically(dir, |tmp| self.write_adapter_files(tmp, cfg, base_name))
    }

    /// The attached adapters as format-neutral factors (B rows in checkpoint order), with the
    /// settings `cfg` they were made with.
    pub fn adapter_factors(&self, cfg: &LoraConfig, base_name: &str) -> Result<AdapterFactors> {
        let be = self.be();
        let mut modules = Vec::new();
        for (name, l) in self.adapters() {
            let a = be.to_host(&l.a)?;
            let b = be.to_host(&l.b)?;
            let mut bv = b.data().to_vec();
            let (rows, r) = b.dims2();
            let (_, cols) = a.dims2();
            self.b_rows_to_peft(&name, &mut bv, rows, r)?;
            let (layer, path) = factors::parse_module(&name)
                .ok_or_else(|| Error::Msg(format!("adapter on an unknown module '{name}'")))?;
            modules.push(ModuleFactors {
                layer,
                path: path.to_string(),
                r,
                cols,
                rows,
                alpha: cfg.alpha,
                a: a.into_data(),
                b: bv,
            });
        }
        Ok(AdapterFactors {
            config: cfg.clone(),
            base_model: Some(base_name.to_string()),
            modules,
        })
    }

    /// Writes the adapter's two files into the existing folder `dir`, each under a temporary
    /// name renamed into place, the config last: until it is there, the folder does not look
    /// like an adapter.
    pub fn write_adapter_files(&self, dir: &Path, cfg: &LoraConfig, base_name: &str) -> Result<()> {
        if self.adapters().is_empty() {
            return Err(Error::Msg("the model has no adapter to save".into()));
        }
        factors::write_peft_files(dir, &self.adapter_factors(cfg, base_name)?, base_name)
    }

    /// Loads an adapter onto this model, replacing any attached adapters: a PEFT folder (ours
    /// or `peft`'s), a llama.cpp LoRA GGUF file or an mlx-lm adapter folder, told apart by
    /// content ([`detect`]). Every tensor is checked against the config and the base: a missing
    /// or extra tensor, a wrong shape, a rank that disagrees with the config, or a value that is
    /// not finite is an error, and the model is left without adapters.
    pub fn load_adapter(&mut self, path: &Path) -> Result<LoraConfig> {
        self.detach_lora();
        let f = read_adapter(path, Some(&self.config))?;
        self.attach_factors(&f, path)?;
        Ok(f.config)
    }

    /// Attaches checked factors (see [`AdapterFactors::check`]); `file` names them in errors.
    /// On error the model is left without adapters.
    pub fn attach_factors(&mut self, f: &AdapterFactors, file: &Path) -> Result<()> {
        self.detach_lora();
        let res = self.lora_by_site(f, file).and_then(|mut by_site| {
            for block in self.blocks_mut() {
                for (_, lin) in block.linears_mut() {
                    lin.lora = by_site.get_mut(lin.site).and_then(Option::take);
                }
            }
            self.place_adapters()
        });
        if res.is_err() {
            self.detach_lora();
        }
        res
    }

    /// Reads an adapter (any format [`Model::load_adapter`] reads) for this model without
    /// attaching it, for an [`crate::adapter_set::AdapterSet`]: checked as `load_adapter`
    /// checks it, its factors on the host by product site.
    pub fn read_adapter(&self, path: &Path) -> Result<ReadAdapter> {
        let f = read_adapter(path, Some(&self.config))?;
        Ok(ReadAdapter {
            factors: self.lora_by_site(&f, path)?,
            config: f.config,
        })
    }

    /// Checks `f` against this model and lays its factors out by product site (`(sites)`, the
    /// q/k B rows in our RoPE layout where the model permutes them).
    fn lora_by_site(&self, f: &AdapterFactors, file: &Path) -> Result<Vec<Option<Lora>>> {
        let mut dims = std::collections::HashMap::new();
        for (layer, block) in self.blocks().iter().enumerate() {
            for (path, lin) in block.linears() {
                dims.insert((layer, path.to_string()), (lin.w.rows, lin.w.cols));
            }
        }
        f.check(file, self.config.n_layers, &|l, p| {
            dims.get(&(l, p.to_string())).copied()
        })?;
        let permuted = self.permuted_qk();
        let heads: Vec<Option<usize>> = f.modules.iter().map(|m| self.qk_heads(&m.path)).collect();
        let mut by_module = std::collections::HashMap::new();
        for (i, m) in f.modules.iter().enumerate() {
            by_module.insert((m.layer, m.path.clone()), i);
        }
        let mut by_site: Vec<Option<Lora>> = (0..self.sites()).map(|_| None).collect();
        let mut id = 0;
        for (layer, block) in self.blocks().iter().enumerate() {
            for (path, lin) in block.linears() {
                let Some(&i) = by_module.get(&(layer, path.to_string())) else {
                    continue;
                };
                let m = &f.modules[i];
                let mut b = m.b.clone();
                if let (true, Some(h)) = (permuted, heads[i]) {
                    permute_qk_rows(&mut b, m.rows, m.r, h, true)?;
                }
                let slot = by_site
                    .get_mut(lin.site)
                    .ok_or_else(|| Error::Msg(format!("product site {} out of range", lin.site)))?;
                *slot = Some(Lora {
                    a: Tensor::new(&[m.r, m.cols], m.a.clone())?,
                    b: Tensor::new(&[m.rows, m.r], b)?,
                    scale: f.scale_of(m),
                    dropout: f.config.dropout,
                    id,
                });
                id += 1;
            }
        }
        Ok(by_site)
    }
}

/// The formats an adapter comes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterFormat {
    /// A PEFT folder (`adapter_config.json` + `adapter_model.safetensors`).
    Peft,
    /// llama.cpp's LoRA GGUF (`general.type = adapter`).
    GgufLora,
    /// mlx-lm's folder (`adapter_config.json` + `adapters.safetensors`).
    Mlx,
}

/// Tells an adapter's format from its content: a file starting with GGUF's magic is a GGUF
/// LoRA; a folder holding mlx-lm's weights file (or a config with `lora_parameters`) is mlx-lm's;
/// any other folder is read as PEFT's.
pub fn detect(path: &Path) -> AdapterFormat {
    use std::io::Read;
    if path.is_file() {
        let mut m = [0u8; 4];
        let gguf = std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut m))
            .is_ok()
            && &m == b"GGUF";
        return if gguf {
            AdapterFormat::GgufLora
        } else {
            AdapterFormat::Peft
        };
    }
    if path.join(mlx::WEIGHTS_FILE).is_file() && !path.join(WEIGHTS_FILE).is_file() {
        return AdapterFormat::Mlx;
    }
    let mlx_config = std::fs::read_to_string(path.join(CONFIG_FILE))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .is_some_and(|v| v.get("lora_parameters").is_some());
    if mlx_config {
        AdapterFormat::Mlx
    } else {
        AdapterFormat::Peft
    }
}

/// Whether `path` holds an adapter rather than a model: a folder with `adapter_config.json`, or
/// a GGUF file whose `general.type` is `adapter`.
pub fn is_adapter(path: &Path) -> bool {
    if path.is_dir() {
        return path.join(CONFIG_FILE).is_file();
    }
    detect(path) == AdapterFormat::GgufLora
        && hf2q_tensor::io::gguf::GgufFile::open(path)
            .is_ok_and(|f| f.get_str("general.type") == Some("adapter"))
}

/// Reads an adapter in any of the three formats ([`detect`]). `base` (the model it is for)
/// lets readers refuse tensors of layers the base lacks and undo llama.cpp's q/k row order.
pub fn read_adapter(path: &Path, base: Option<&ModelConfig>) -> Result<AdapterFactors> {
    match detect(path) {
        AdapterFormat::Peft => factors::read_peft(path, base),
        AdapterFormat::GgufLora => gguf_lora::read(path, base),
        AdapterFormat::Mlx => mlx::read(path, base),
    }
}

fn io_err(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source: e,
    }
}

/// `adapter_config.json` as PEFT writes it for these settings.
pub(crate) fn peft_config_json(cfg: &LoraConfig, base_name: &str) -> Value {
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
    pub(crate) fn rank_for(&self, layer: usize, path: &str) -> usize {
        Self::pattern(&self.rank_pattern, layer, path)
            .copied()
            .unwrap_or(self.config.r)
    }
    pub(crate) fn alpha_for(&self, layer: usize, path: &str) -> f32 {
        Self::pattern(&self.alpha_pattern, layer, path)
            .copied()
            .unwrap_or(self.config.alpha)
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
    let obj = v
        .as_object()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    let peft_type = obj
        .get("peft_type")
        .and_then(Value::as_str)
        .unwrap_or("LORA");
    if peft_type != "LORA" {
        return Err(bad(format!(
            "peft_type '{peft_type}': only LORA adapters are supported"
        )));
    }
    let flag = |k: &str| obj.get(k).and_then(Value::as_bool).unwrap_or(false);
    if flag("use_dora") {
        return Err(bad("use_dora: DoRA adapters are not supported".into()));
    }
    if flag("fan_in_fan_out") {
        return Err(bad(
            "fan_in_fan_out: transposed (Conv1D) layouts are not supported".into(),
        ));
    }
    if let Some(b) = obj.get("bias").and_then(Value::as_str) {
        if b != "none" {
            return Err(bad(format!("bias '{b}': trained biases are not supported")));
        }
    }
    if obj
        .get("modules_to_save")
        .is_some_and(|m| !m.is_null() && m.as_array().is_none_or(|a| !a.is_empty()))
    {
        return Err(bad(
            "modules_to_save: full module copies are not supported".into()
        ));
    }
    let r = obj
        .get("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("missing or invalid 'r'".into()))? as usize;
    let alpha = obj.get("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0) as f32;
    let targets = match obj.get("target_modules") {
        Some(Value::String(s)) if s == "all-linear" => {
            LINEAR_NAMES.iter().map(|s| s.to_string()).collect()
        }
        Some(Value::String(s)) => {
            return Err(bad(format!(
                "target_modules as a pattern ('{s}') is not supported: give a list of module names"
            )))
        }
        Some(Value::Array(a)) => {
            let mut t = Vec::new();
            for x in a {
                let s = x
                    .as_str()
                    .ok_or_else(|| bad("target_modules holds a non-string".into()))?;
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
        Some(Value::Number(n)) => Some(vec![n
            .as_u64()
            .ok_or_else(|| bad("bad layers_to_transform".into()))?
            as usize]),
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
        dropout: obj
            .get("lora_dropout")
            .and_then(Value::as_f64)
            .unwrap_or(0.0) as f32,
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

/// Writes `bytes` to `path` through a temporary name in the same folder, synced, then renamed
/// into place; on failure the temporary is removed and the error names `path`.
pub fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| Error::Msg(format!("{}: not a file name", path.display())))?
        .to_string_lossy()
        .to_string();
    hf2q_tensor::io::remove_stale_temps(path);
    let tmp = path.with_file_name(format!(
        ".{name}.partial-{}-{}",
        std::process::id(),
        unique_suffix()
    ));
    let res = std::fs::File::create(&tmp)
        .and_then(|mut f| {
            use std::io::Write;
            f.write_all(bytes).and_then(|_| f.sync_all())
        })
        .and_then(|_| std::fs::rename(&tmp, path));
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
    hf2q_tensor::io::remove_stale_temps(dir);
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
