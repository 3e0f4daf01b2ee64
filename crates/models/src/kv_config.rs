//! `kv_config.json`: a model folder's per-layer affine KV cache (mlx-lm's layout, bits chosen
//! per layer, as the seeds' MiniCPM5 ran it). Two forms, one group size for every layer:
//!
//! ```json
//! {"group_size": 64, "bits": [8, 4, 4, 8]}
//! {"group_size": 64, "default_bits": 4, "layers": {"0": 8, "31": 8}}
//! ```
//!
//! `bits` has one entry per layer; or every layer takes `default_bits` except those `layers`
//! names (by index). Bits are 4 or 8, `group_size` 32, 64 or 128 (default 64, mlx-lm's). Any
//! other field, a missing or doubled form, a wrong count or an unknown layer is refused with a
//! message naming the field.
//!
//! Not here: the layouts (`hf2q_tensor::kv_affine`), where the types are applied
//! (`Model::set_kv_layer_types`), the command line's choice between this file and its flags.

use std::path::Path;

use serde_json::Value;

use crate::kv_cache::{AffineKv, KvType, KvTypes};
use crate::{Error, Result};

/// The file's name in a model folder.
pub const FILE: &str = "kv_config.json";

/// The per-layer cache types of `dir`'s `kv_config.json` for a model of `n_layers` layers, or
/// `None` when the folder has no such file.
pub fn from_folder(dir: &Path, n_layers: usize) -> Result<Option<Vec<KvTypes>>> {
    let path = dir.join(FILE);
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::Msg(format!("{}: {e}", path.display())))?;
    parse(&text, n_layers)
        .map(Some)
        .map_err(|e| Error::Msg(format!("{}: {e}", path.display())))
}

/// The per-layer cache types `text` (a `kv_config.json`) gives a model of `n_layers` layers.
pub fn parse(text: &str, n_layers: usize) -> Result<Vec<KvTypes>> {
    let bad = |m: String| Error::Msg(m);
    let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    for key in obj.keys() {
        if !matches!(
            key.as_str(),
            "group_size" | "bits" | "default_bits" | "layers"
        ) {
            return Err(bad(format!(
                "unknown field `{key}` (group_size, bits, default_bits, layers)"
            )));
        }
    }
    let group = match obj.get("group_size") {
        None => 64,
        Some(g) => g
            .as_u64()
            .filter(|g| matches!(g, 32 | 64 | 128))
            .ok_or_else(|| bad(format!("group_size {g} is not one of 32, 64, 128")))?
            as usize,
    };
    let layout = |field: &str, b: &Value| -> Result<KvTypes> {
        let bits = b
            .as_u64()
            .filter(|b| matches!(b, 4 | 8))
            .ok_or_else(|| bad(format!("{field} {b} is not 4 or 8")))?;
        Ok(KvType::Affine(AffineKv::new(bits as u32, group)?).into())
    };
    match (obj.get("bits"), obj.get("default_bits"), obj.get("layers")) {
        (Some(bits), None, None) => {
            let list = bits
                .as_array()
                .ok_or_else(|| bad("bits is not a list (one entry per layer)".into()))?;
            if list.len() != n_layers {
                return Err(bad(format!(
                    "bits has {} entries for a model of {n_layers} layers",
                    list.len()
                )));
            }
            list.iter()
                .enumerate()
                .map(|(i, b)| layout(&format!("bits[{i}]"), b))
                .collect()
        }
        (None, Some(default), layers) => {
            let mut out = vec![layout("default_bits", default)?; n_layers];
            let Some(layers) = layers else {
                return Ok(out);
            };
            let map = layers
                .as_object()
                .ok_or_else(|| bad("layers is not an object of layer index to bits".into()))?;
            for (k, b) in map {
                let i = k
                    .parse::<usize>()
                    .ok()
                    .filter(|&i| i < n_layers)
                    .ok_or_else(|| {
                        bad(format!(
                            "layers.\"{k}\" is not a layer index (the model has {n_layers} layers)"
                        ))
                    })?;
                out[i] = layout(&format!("layers.\"{k}\""), b)?;
            }
            Ok(out)
        }
        (Some(_), Some(_), _) | (Some(_), None, Some(_)) => Err(bad(
            "bits (one entry per layer) and default_bits / layers are two forms; give one".into(),
        )),
        (None, None, _) => Err(bad(
            "neither bits (one entry per layer) nor default_bits is given".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(bits: u32, g: usize) -> KvTypes {
        KvType::Affine(AffineKv::new(bits, g).unwrap()).into()
    }

    /// Both forms, and the default group size.
    #[test]
    fn both_forms() {
        let t = parse(r#"{"group_size": 32, "bits": [8, 4, 4]}"#, 3).unwrap();
        assert_eq!(t, vec![a(8, 32), a(4, 32), a(4, 32)]);
        let t = parse(r#"{"default_bits": 4, "layers": {"0": 8, "2": 8}}"#, 4).unwrap();
        assert_eq!(t, vec![a(8, 64), a(4, 64), a(8, 64), a(4, 64)]);
        let t = parse(r#"{"group_size": 128, "default_bits": 8}"#, 2).unwrap();
        assert_eq!(t, vec![a(8, 128); 2]);
    }

    /// Each malformed file is refused naming the field at fault.
    #[test]
    fn refusals_name_the_field() {
        for (text, needle) in [
            ("[8, 4]", "not a JSON object"),
            ("{", "not JSON"),
            (r#"{"bits": [8, 4], "extra": 1}"#, "unknown field `extra`"),
            (r#"{"group_size": 48, "bits": [8, 4, 4]}"#, "group_size 48"),
            (r#"{"bits": [8, 4]}"#, "bits has 2 entries for a model of 3"),
            (r#"{"bits": [8, 5, 4]}"#, "bits[1] 5 is not 4 or 8"),
            (r#"{"bits": 8}"#, "bits is not a list"),
            (r#"{"default_bits": 2}"#, "default_bits 2"),
            (r#"{"default_bits": 8, "layers": {"3": 4}}"#, "layers.\"3\""),
            (r#"{"default_bits": 8, "layers": {"x": 4}}"#, "layers.\"x\""),
            (
                r#"{"default_bits": 8, "layers": {"1": 16}}"#,
                "layers.\"1\" 16",
            ),
            (
                r#"{"default_bits": 8, "layers": [4]}"#,
                "layers is not an object",
            ),
            (r#"{"bits": [8, 8, 8], "default_bits": 4}"#, "two forms"),
            (r#"{"group_size": 64}"#, "neither bits"),
        ] {
            let e = parse(text, 3).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }
}
