//! What `--type` names: a llama.cpp file type ("preset": Q4_K_M, Q8_0, ...), a single ggml type
//! applied to every weight ("pure": Q4_K), or an MLX affine recipe (`mlx4`, `mlx3g32`, ...).
//!
//! Preset names, ids and default tensor types are llama.cpp's (`enum llama_ftype` in `llama.h`,
//! `llama_ftype_get_default_type` in `llama-quant.cpp`); the id is what GGUF's
//! `general.file_type` holds.

use hf2q_tensor::quant::mlx::AffineParams;
use hf2q_tensor::GgmlType;

use crate::{Error, Result};

/// A llama.cpp file type that hf2q can produce (the IQ*, TQ* and NVFP4 ones are not here).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum Preset {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K_S,
    Q3_K_M,
    Q3_K_L,
    Q4_K_S,
    Q4_K_M,
    Q5_K_S,
    Q5_K_M,
    Q6_K,
    /// llama.cpp's `MXFP4_MOE`: stacked experts MXFP4, every other quantized weight Q8_0.
    MXFP4_MOE,
}

use Preset::*;

/// (preset, name, `llama_ftype` id, default tensor type)
const PRESETS: &[(Preset, &str, u32, GgmlType)] = &[
    (F32, "F32", 0, GgmlType::F32),
    (F16, "F16", 1, GgmlType::F16),
    (Q4_0, "Q4_0", 2, GgmlType::Q4_0),
    (Q4_1, "Q4_1", 3, GgmlType::Q4_1),
    (Q8_0, "Q8_0", 7, GgmlType::Q8_0),
    (Q5_0, "Q5_0", 8, GgmlType::Q5_0),
    (Q5_1, "Q5_1", 9, GgmlType::Q5_1),
    (Q2_K, "Q2_K", 10, GgmlType::Q2_K),
    (Q3_K_S, "Q3_K_S", 11, GgmlType::Q3_K),
    (Q3_K_M, "Q3_K_M", 12, GgmlType::Q3_K),
    (Q3_K_L, "Q3_K_L", 13, GgmlType::Q3_K),
    (Q4_K_S, "Q4_K_S", 14, GgmlType::Q4_K),
    (Q4_K_M, "Q4_K_M", 15, GgmlType::Q4_K),
    (Q5_K_S, "Q5_K_S", 16, GgmlType::Q5_K),
    (Q5_K_M, "Q5_K_M", 17, GgmlType::Q5_K),
    (Q6_K, "Q6_K", 18, GgmlType::Q6_K),
    (BF16, "BF16", 32, GgmlType::BF16),
    (MXFP4_MOE, "MXFP4_MOE", 38, GgmlType::MXFP4),
];

impl Preset {
    fn row(self) -> &'static (Preset, &'static str, u32, GgmlType) {
        PRESETS
            .iter()
            .find(|r| r.0 == self)
            .expect("every preset is in PRESETS")
    }
    pub fn name(self) -> &'static str {
        self.row().1
    }
    /// llama.cpp's `llama_ftype` value (GGUF `general.file_type`).
    pub fn ftype(self) -> u32 {
        self.row().2
    }
    /// The type most weights get (`llama_ftype_get_default_type`).
    pub fn default_type(self) -> GgmlType {
        self.row().3
    }
    pub fn from_name(name: &str) -> Option<Preset> {
        PRESETS
            .iter()
            .find(|r| r.1.eq_ignore_ascii_case(name))
            .map(|r| r.0)
    }
    pub fn from_ftype(id: u32) -> Option<Preset> {
        PRESETS.iter().find(|r| r.2 == id).map(|r| r.0)
    }
    pub fn all() -> impl Iterator<Item = Preset> {
        PRESETS.iter().map(|r| r.0)
    }
    /// The preset whose default type is `ty` with the fewest rules (used as the file type of a
    /// pure single-type file).
    fn for_pure(ty: GgmlType) -> Option<Preset> {
        Some(match ty {
            GgmlType::Q3_K => Q3_K_S,
            GgmlType::Q4_K => Q4_K_S,
            GgmlType::Q5_K => Q5_K_S,
            other => return PRESETS.iter().find(|r| r.3 == other).map(|r| r.0),
        })
    }
}

/// How GGUF tensor types are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgufRecipe {
    pub preset: Preset,
    /// Every quantizable weight gets the preset's default type (llama-quantize `--pure`), only
    /// changed where a row length forces a fallback.
    pub pure: bool,
}

/// MLX output: affine bits/group, plus the float dtype of scales, biases and unquantized tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlxRecipe {
    pub params: AffineParams,
}

/// What `--type` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantTarget {
    Gguf(GgufRecipe),
    Mlx(MlxRecipe),
}

impl QuantTarget {
    /// Parses a `--type` value. `group` is the MLX group size (`--group-size`), used when the
    /// name does not carry one (`mlx4` vs `mlx4g32`).
    ///
    /// - llama.cpp presets: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K_S Q3_K_M Q3_K_L
    ///   Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K MXFP4_MOE (llama.cpp's per-tensor rules apply);
    /// - Q3_K, Q4_K, Q5_K: that type for every weight (pure);
    /// - mlxB or mlxBgG, B in {2,3,4,5,6,8}, G in {32,64,128} (default 64).
    pub fn parse(s: &str, group: Option<usize>) -> Result<QuantTarget> {
        let lower = s.to_ascii_lowercase();
        if let Some(rest) = lower.strip_prefix("mlx") {
            let (b, g) = match rest.split_once('g') {
                Some((b, g)) => (b, Some(g)),
                None => (rest, None),
            };
            let bits: u32 = b.parse().map_err(|_| bad_type(s))?;
            let group_size = match g {
                Some(g) => g.parse().map_err(|_| bad_type(s))?,
                None => group.unwrap_or(64),
            };
            let params = AffineParams { bits, group_size };
            params
                .validate()
                .map_err(|e| Error::Msg(format!("--type {s}: {e}")))?;
            return Ok(QuantTarget::Mlx(MlxRecipe { params }));
        }
        if let Some(p) = Preset::from_name(s) {
            return Ok(QuantTarget::Gguf(GgufRecipe {
                preset: p,
                pure: false,
            }));
        }
        if let Some(ty) = GgmlType::from_name(s) {
            if let Some(p) = Preset::for_pure(ty) {
                return Ok(QuantTarget::Gguf(GgufRecipe {
                    preset: p,
                    pure: true,
                }));
            }
        }
        Err(bad_type(s))
    }
}

fn bad_type(s: &str) -> Error {
    let names: Vec<&str> = PRESETS.iter().map(|r| r.1).collect();
    Error::Msg(format!(
        "unknown --type '{s}': expected a llama.cpp preset ({}), Q3_K / Q4_K / Q5_K (one type for every \
         weight), or mlxB / mlxBgG (B bits in 2,3,4,5,6,8; G in 32,64,128)",
        names.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_presets_pure_types_and_mlx() {
        let g = |s: &str| QuantTarget::parse(s, None).unwrap();
        assert_eq!(
            g("q4_k_m"),
            QuantTarget::Gguf(GgufRecipe {
                preset: Q4_K_M,
                pure: false
            })
        );
        assert_eq!(
            g("Q6_K"),
            QuantTarget::Gguf(GgufRecipe {
                preset: Q6_K,
                pure: false
            })
        );
        assert_eq!(
            g("Q4_K"),
            QuantTarget::Gguf(GgufRecipe {
                preset: Q4_K_S,
                pure: true
            })
        );
        assert_eq!(
            g("mlx4"),
            QuantTarget::Mlx(MlxRecipe {
                params: AffineParams {
                    bits: 4,
                    group_size: 64
                }
            })
        );
        assert_eq!(
            g("mlx3g32"),
            QuantTarget::Mlx(MlxRecipe {
                params: AffineParams {
                    bits: 3,
                    group_size: 32
                }
            })
        );
        assert_eq!(
            QuantTarget::parse("mlx8", Some(128)).unwrap(),
            QuantTarget::Mlx(MlxRecipe {
                params: AffineParams {
                    bits: 8,
                    group_size: 128
                }
            })
        );
        for bad in ["Q7_K", "mlx7", "mlx4g48", "IQ2_XXS", ""] {
            assert!(QuantTarget::parse(bad, None).is_err(), "{bad}");
        }
        assert_eq!(Q4_K_M.ftype(), 15);
        assert_eq!(Preset::from_ftype(32), Some(BF16));
    }
}
