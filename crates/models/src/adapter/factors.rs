//! An adapter's factors independent of any file format or base: per module, A `(r, in)` and
//! B `(out, r)` as PEFT lays them out, B's rows in checkpoint (Hugging Face) order, with the
//! module's rank and alpha. Every reader (PEFT, llama.cpp's GGUF LoRA, mlx-lm) produces one and
//! every writer consumes one, so a conversion is read-then-write and the checks against a base
//! are written once ([`AdapterFactors::check`]).
//!
//! Also here: PEFT's folder as a reader and writer of these factors. Not here: attaching them to
//! a model (`super`), the other formats (`super::gguf_lora`, `super::mlx`).

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use hf2q_tensor::io::safetensors::{write_safetensors, SafeTensors, StDtype};

use super::{peft_config_json, read_peft_config, write_file_atomically, LoraConfig};
use super::{CONFIG_FILE, WEIGHTS_FILE};
use crate::config::ModelConfig;
use crate::{Error, Result};

/// The block paths of the products an adapter may target, by short name.
pub const MODULE_PATHS: [(&str, &str); 7] = [
    ("q_proj", "self_attn.q_proj"),
    ("k_proj", "self_attn.k_proj"),
    ("v_proj", "self_attn.v_proj"),
    ("o_proj", "self_attn.o_proj"),
    ("gate_proj", "mlp.gate_proj"),
    ("up_proj", "mlp.up_proj"),
    ("down_proj", "mlp.down_proj"),
];

/// One module's factors.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleFactors {
    pub layer: usize,
    /// Block path (`self_attn.q_proj`).
    pub path: String,
    /// Rank r.
    pub r: usize,
    /// in (columns of the base weight).
    pub cols: usize,
    /// out (rows of the base weight).
    pub rows: usize,
    /// PEFT alpha of this module (the config's, or its `alpha_pattern` entry).
    pub alpha: f32,
    /// A `(r, in)`, row-major.
    pub a: Vec<f32>,
    /// B `(out, r)`, row-major, rows in checkpoint order.
    pub b: Vec<f32>,
}

impl ModuleFactors {
    /// `model.layers.N.PATH`.
    pub fn name(&self) -> String {
        format!("model.layers.{}.{}", self.layer, self.path)
    }
    pub fn short(&self) -> &str {
        self.path.rsplit('.').next().unwrap_or(&self.path)
    }
}

/// A whole adapter: the settings and every module's factors (sorted by layer, then by the
/// order of [`MODULE_PATHS`]).
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterFactors {
    pub config: LoraConfig,
    pub base_model: Option<String>,
    pub modules: Vec<ModuleFactors>,
}

/// `(out, in)` of the base's product at `(layer, path)`, or None where the base has none.
pub type DimsOf<'a> = dyn Fn(usize, &str) -> Option<(usize, usize)> + 'a;

/// A product's two halves as a reader finds them: (A, B), either possibly missing so far.
pub(crate) type Halves<T> = (Option<T>, Option<T>);

/// The block path of a short module name.
pub fn module_path(short: &str) -> Option<&'static str> {
    MODULE_PATHS
        .iter()
        .find(|(s, _)| *s == short)
        .map(|(_, p)| *p)
}

fn path_rank(path: &str) -> usize {
    MODULE_PATHS
        .iter()
        .position(|(_, p)| *p == path)
        .unwrap_or(usize::MAX)
}

/// Non-finite values are an error naming the tensor and the element.
pub(crate) fn check_finite(v: &[f32], what: &str) -> Result<()> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(Error::Msg(format!(
            "{what} holds a non-finite value ({}) at element {i}",
            v[i]
        ))),
        None => Ok(()),
    }
}

impl AdapterFactors {
    /// The factor module `m`'s low-rank term is multiplied by.
    pub fn scale_of(&self, m: &ModuleFactors) -> f32 {
        LoraConfig {
            alpha: m.alpha,
            ..self.config.clone()
        }
        .scale_for(m.r)
    }

    pub(crate) fn sort(&mut self) {
        self.modules.sort_by_key(|m| (m.layer, path_rank(&m.path)));
    }

    /// Checks the factors against a base of `n_layers` blocks whose product at `(layer, path)`
    /// has `dims(layer, path) = Some((out, in))`: every module the config targets is present,
    /// every module present is targeted and exists in the base, every shape fits.
    /// `file` names the adapter in messages.
    pub fn check(&self, file: &Path, n_layers: usize, dims: &DimsOf<'_>) -> Result<()> {
        let f = file.display();
        let mut expected = HashSet::new();
        for layer in 0..n_layers {
            for (_, path) in MODULE_PATHS {
                if self.config.applies(layer, path) && dims(layer, path).is_some() {
                    expected.insert((layer, path.to_string()));
                }
            }
        }
        for m in &self.modules {
            if !expected.contains(&(m.layer, m.path.clone())) {
                return Err(Error::Msg(format!(
                    "{f}: tensor '{}.lora_A.weight' does not belong to a LoRA target of this model (targets: {}; layers: {n_layers})",
                    peft_stem_of(m),
                    self.config.targets.join(", "),
                )));
            }
            let (rows, cols) = dims(m.layer, &m.path).expect("expected modules exist");
            if m.rows != rows || m.cols != cols {
                let r = m.r;
                return Err(Error::Msg(format!(
                    "{f}: '{}': lora_A [{r}, {}] and lora_B [{}, {r}], expected [{r}, {cols}] and [{rows}, {r}] (rank {r})",
                    peft_stem_of(m),
                    m.cols,
                    m.rows
                )));
            }
        }
        let have: HashSet<(usize, String)> = self
            .modules
            .iter()
            .map(|m| (m.layer, m.path.clone()))
            .collect();
        let mut missing: Vec<&(usize, String)> = expected.difference(&have).collect();
        missing.sort();
        if let Some((layer, path)) = missing.first() {
            return Err(Error::Msg(format!(
                "{f}: missing tensor '{}.lora_A.weight' (the config targets it)",
                super::peft_stem(*layer, path)
            )));
        }
        if self.modules.is_empty() {
            return Err(Error::Msg(format!(
                "{f}: the adapter targets no module of this model"
            )));
        }
        Ok(())
    }

    /// [`Self::check`] against a model config (its linears' shapes follow from the config).
    pub fn check_config(&self, file: &Path, c: &ModelConfig) -> Result<()> {
        self.check(file, c.n_layers, &|_, path| config_dims(c, path))
    }
}

/// `(out, in)` of a block product of a model with config `c`.
pub fn config_dims(c: &ModelConfig, path: &str) -> Option<(usize, usize)> {
    let (d, f, dh) = (c.hidden_size, c.intermediate_size, c.head_dim);
    Some(match path {
        "self_attn.q_proj" => (c.n_heads * dh, d),
        "self_attn.k_proj" | "self_attn.v_proj" => (c.n_kv_heads * dh, d),
        "self_attn.o_proj" => (d, c.n_heads * dh),
        "mlp.gate_proj" | "mlp.up_proj" => (f, d),
        "mlp.down_proj" => (d, f),
        _ => return None,
    })
}

fn peft_stem_of(m: &ModuleFactors) -> String {
    super::peft_stem(m.layer, &m.path)
}

/// Splits `model.layers.N.PATH` (after any prefix and before a suffix the caller removed) into
/// `(N, PATH)` when PATH is a product adapters may target.
pub(crate) fn parse_module(name: &str) -> Option<(usize, &'static str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (n, path) = rest.split_once('.')?;
    let layer = n.parse().ok()?;
    MODULE_PATHS
        .iter()
        .find(|(_, p)| *p == path)
        .map(|(_, p)| (layer, *p))
}

/// Reads a PEFT adapter folder. With `base`, tensors of layers the base lacks are refused by
/// name before anything else; [`AdapterFactors::check`] does the rest against a base.
pub fn read_peft(dir: &Path, base: Option<&ModelConfig>) -> Result<AdapterFactors> {
    let cfg = read_peft_config(dir)?;
    let file = dir.join(WEIGHTS_FILE);
    if !file.is_file() {
        return Err(Error::Msg(format!(
            "{}: no {WEIGHTS_FILE} (only safetensors adapters are read)",
            dir.display()
        )));
    }
    let st = SafeTensors::open(&file)?;
    let f = file.display();
    let not_target = |name: &str| {
        Error::Msg(format!(
            "{f}: tensor '{name}' does not belong to a LoRA target of this model (targets: {}; layers: {})",
            cfg.config.targets.join(", "),
            base.map_or("?".to_string(), |b| b.n_layers.to_string())
        ))
    };
    // (layer, path) -> (A?, B?)
    let mut pairs: BTreeMap<(usize, usize), Halves<&str>> = BTreeMap::new();
    for t in &st.tensors {
        let n = t.name.as_str();
        let (stem, is_a) = if let Some(s) = n.strip_suffix(".lora_A.weight") {
            (s, true)
        } else if let Some(s) = n.strip_suffix(".lora_B.weight") {
            (s, false)
        } else {
            return Err(not_target(n));
        };
        let stem = stem.strip_prefix("base_model.model.").unwrap_or(stem);
        let Some((layer, p)) = parse_module(stem) else {
            return Err(not_target(n));
        };
        if base.is_some_and(|b| layer >= b.n_layers) || !cfg.config.applies(layer, p) {
            return Err(not_target(n));
        }
        let e = pairs.entry((layer, path_rank(p))).or_default();
        if is_a {
            e.0 = Some(n);
        } else {
            e.1 = Some(n);
        }
    }
    let mut modules = Vec::new();
    for ((layer, pi), (an, bn)) in pairs {
        let path = MODULE_PATHS[pi].1;
        let stem = super::peft_stem(layer, path);
        let an = an
            .map(str::to_string)
            .unwrap_or(format!("{stem}.lora_A.weight"));
        let bn = bn
            .map(str::to_string)
            .unwrap_or(format!("{stem}.lora_B.weight"));
        let (a, ash) = read_f32(&st, &an, &file)?;
        let (b, bsh) = read_f32(&st, &bn, &file)?;
        let r = cfg.rank_for(layer, path);
        let ok = ash.len() == 2 && bsh.len() == 2 && ash[0] == r && bsh[1] == r;
        if !ok {
            let (cols, rows) = (
                ash.get(1).copied().unwrap_or(0),
                bsh.first().copied().unwrap_or(0),
            );
            return Err(Error::Msg(format!(
                "{f}: '{stem}': lora_A {ash:?} and lora_B {bsh:?}, expected [{r}, {cols}] and [{rows}, {r}] (rank {r} from {CONFIG_FILE})"
            )));
        }
        modules.push(ModuleFactors {
            layer,
            path: path.to_string(),
            r,
            cols: ash[1],
            rows: bsh[0],
            alpha: cfg.alpha_for(layer, path),
            a,
            b,
        });
    }
    let mut out = AdapterFactors {
        config: cfg.config,
        base_model: cfg.base_model,
        modules,
    };
    out.sort();
    Ok(out)
}

/// A tensor of the adapter as f32 values with its shape; non-finite values are an error.
fn read_f32(st: &SafeTensors, name: &str, file: &Path) -> Result<(Vec<f32>, Vec<usize>)> {
    let info = st
        .tensor(name)
        .ok_or_else(|| Error::Msg(format!("{}: missing tensor '{name}'", file.display())))?;
    let v = st.to_f32(info)?;
    check_finite(&v, &format!("{}: tensor '{name}'", file.display()))?;
    Ok((v, info.shape.clone()))
}

/// f32 tensors gathered for one safetensors file, as `(name, shape, little-endian bytes)`.
#[derive(Default)]
pub(crate) struct F32Tensors(Vec<(String, Vec<usize>, Vec<u8>)>);

impl F32Tensors {
    pub(crate) fn push(&mut self, name: String, shape: Vec<usize>, values: &[f32]) {
        let bytes = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.0.push((name, shape, bytes));
    }
    /// The tensors as `write_safetensors` takes them.
    pub(crate) fn refs(&self) -> Vec<hf2q_tensor::io::safetensors::StTensorRef<'_>> {
        self.0
            .iter()
            .map(|(n, sh, b)| (n.clone(), StDtype::F32, sh.clone(), b.as_slice()))
            .collect()
    }
}

/// Writes factors as a PEFT folder's two files into the existing folder `dir` (each file
/// atomically, the config last). Per-module ranks and alphas that differ from the config's
/// become `rank_pattern` / `alpha_pattern` entries keyed by the full module name.
pub fn write_peft_files(dir: &Path, f: &AdapterFactors, base_name: &str) -> Result<()> {
    if f.modules.is_empty() {
        return Err(Error::Msg("the adapter has no module to save".into()));
    }
    let mut tensors = F32Tensors::default();
    for m in &f.modules {
        let stem = format!("base_model.model.{}", m.name());
        tensors.push(format!("{stem}.lora_A.weight"), vec![m.r, m.cols], &m.a);
        tensors.push(format!("{stem}.lora_B.weight"), vec![m.rows, m.r], &m.b);
    }
    let refs = tensors.refs();
    let mut config = peft_config_json(&f.config, base_name);
    let mut ranks = serde_json::Map::new();
    let mut alphas = serde_json::Map::new();
    for m in &f.modules {
        if m.r != f.config.r {
            ranks.insert(m.name(), m.r.into());
        }
        if m.alpha != f.config.alpha {
            alphas.insert(m.name(), (m.alpha as f64).into());
        }
    }
    config["rank_pattern"] = ranks.into();
    config["alpha_pattern"] = alphas.into();
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    write_safetensors(&dir.join(WEIGHTS_FILE), &refs, &meta)?;
    let text = serde_json::to_string_pretty(&config)
        .map_err(|e| Error::Msg(format!("adapter config: {e}")))?;
    write_file_atomically(&dir.join(CONFIG_FILE), (text + "\n").as_bytes())
}

/// Targets (short names, sorted) of a list of modules, for a config rebuilt from tensors.
pub(crate) fn targets_of(modules: &[ModuleFactors]) -> Vec<String> {
    let mut t: Vec<String> = modules.iter().map(|m| m.short().to_string()).collect();
    t.sort();
    t.dedup();
    t
}

/// `layers_to_transform` for modules found in `layers` of a base of `n_layers` blocks: `None`
/// when every layer has some module.
pub(crate) fn layers_of(modules: &[ModuleFactors], n_layers: usize) -> Option<Vec<usize>> {
    let mut l: Vec<usize> = modules.iter().map(|m| m.layer).collect();
    l.sort();
    l.dedup();
    if l.len() == n_layers && l.last().is_none_or(|&x| x + 1 == n_layers) {
        None
    } else {
        Some(l)
    }
}
