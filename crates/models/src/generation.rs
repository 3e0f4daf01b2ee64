//! A model's recommended sampling: the values of a Hugging Face `generation_config.json`
//! beside the weights, or those a model card states (the CLI's built-in names), used as the
//! defaults of `run`, `chat` and `serve` for that model; flags and request fields override them.
//! Follows transformers' reading of the file: the sampling values count only when `do_sample`
//! is true; `do_sample: false` means greedy decoding (temperature 0); a file that says neither
//! recommends nothing. Not here: the sampler itself ([`crate::sampler`]).

use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use crate::sampler::SamplerConfig;
use crate::{Error, Result};

pub const FILE: &str = "generation_config.json";

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct GenerationDefaults {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    /// Where the values come from ("generation_config.json", "model card", ...); empty when
    /// there are none.
    pub source: &'static str,
}

impl GenerationDefaults {
    /// No recommendation.
    pub const NONE: GenerationDefaults = GenerationDefaults {
        temperature: None,
        top_k: None,
        top_p: None,
        min_p: None,
        repetition_penalty: None,
        source: "",
    };

    pub fn is_empty(&self) -> bool {
        self.temperature.is_none()
            && self.top_k.is_none()
            && self.top_p.is_none()
            && self.min_p.is_none()
            && self.repetition_penalty.is_none()
    }

    /// The folder's `generation_config.json` (none when absent); a value out of range is an
    /// error naming the file and the field.
    pub fn from_folder(dir: &Path) -> Result<GenerationDefaults> {
        let path = dir.join(FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(Error::Msg(format!("{}: {e}", path.display()))),
        };
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| Error::Msg(format!("{}: not valid JSON: {e}", path.display())))?;
        Self::from_json(&v).map_err(|m| Error::Msg(format!("{}: {m}", path.display())))
    }

    /// From the parsed file.
    pub fn from_json(v: &Value) -> std::result::Result<GenerationDefaults, String> {
        let mut g = GenerationDefaults {
            source: FILE,
            ..Default::default()
        };
        match v.get("do_sample").and_then(Value::as_bool) {
            Some(false) => {
                g.temperature = Some(0.0);
                return Ok(g);
            }
            None => return Ok(Self::default()),
            Some(true) => {}
        }
        let f = |k: &str, lo: f64, hi: f64| -> std::result::Result<Option<f32>, String> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => match x.as_f64() {
                    Some(n) if n.is_finite() && (lo..=hi).contains(&n) => Ok(Some(n as f32)),
                    _ => Err(format!("'{k}' must be a number in [{lo}, {hi}], not {x}")),
                },
            }
        };
        g.temperature = f("temperature", 0.0, 100.0)?;
        g.top_p = f("top_p", 1e-9, 1.0)?;
        g.min_p = f("min_p", 0.0, 1.0)?;
        g.repetition_penalty = f("repetition_penalty", 1e-9, 100.0)?;
        g.top_k = match v.get("top_k") {
            None | Some(Value::Null) => None,
            Some(x) => Some(
                x.as_u64()
                    .ok_or_else(|| format!("'top_k' must be a whole number >= 0, not {x}"))?
                    as usize,
            ),
        };
        Ok(g)
    }

    /// Sets the sampler's fields these defaults name.
    pub fn apply(&self, s: &mut SamplerConfig) {
        if let Some(t) = self.temperature {
            s.temperature = t;
        }
        if let Some(k) = self.top_k {
            s.top_k = k;
        }
        if let Some(p) = self.top_p {
            s.top_p = p;
        }
        if let Some(p) = self.min_p {
            s.min_p = p;
        }
        if let Some(r) = self.repetition_penalty {
            s.repetition_penalty = r;
        }
    }

    /// "temperature 0.2, top-p 0.9 (model card)", or "none".
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(t) = self.temperature {
            parts.push(format!("temperature {t}"));
        }
        if let Some(k) = self.top_k {
            parts.push(format!("top-k {k}"));
        }
        if let Some(p) = self.top_p {
            parts.push(format!("top-p {p}"));
        }
        if let Some(p) = self.min_p {
            parts.push(format!("min-p {p}"));
        }
        if let Some(r) = self.repetition_penalty {
            parts.push(format!("repetition penalty {r}"));
        }
        if parts.is_empty() {
            return "none".into();
        }
        format!("{} ({})", parts.join(", "), self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_generation_config_as_transformers_does() {
        let g = GenerationDefaults::from_json(&json!({"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1})).unwrap();
        assert_eq!(
            (g.temperature, g.top_p, g.top_k, g.repetition_penalty),
            (Some(0.7), Some(0.8), Some(20), Some(1.1))
        );
        let mut s = SamplerConfig::default();
        g.apply(&mut s);
        assert_eq!((s.temperature, s.top_p, s.top_k), (0.7, 0.8, 20));
        assert_eq!(
            s.min_p,
            SamplerConfig::default().min_p,
            "unnamed fields stay"
        );
        let greedy =
            GenerationDefaults::from_json(&json!({"do_sample": false, "temperature": 0.7}))
                .unwrap();
        assert_eq!(greedy.temperature, Some(0.0));
        assert!(
            GenerationDefaults::from_json(&json!({"bos_token_id": 1, "temperature": 0.6}))
                .unwrap()
                .is_empty()
        );
        let e = GenerationDefaults::from_json(&json!({"do_sample": true, "top_p": 3})).unwrap_err();
        assert!(e.contains("'top_p'"), "{e}");
        let e =
            GenerationDefaults::from_json(&json!({"do_sample": true, "top_k": -1})).unwrap_err();
        assert!(e.contains("'top_k'"), "{e}");
    }
}
