//! Per-tensor GGUF types for a preset: llama.cpp's `llama_tensor_get_type` (`llama-quant.cpp`),
//! restricted to the presets in [`Preset`] and to the architectures hf2q loads (no Falcon).
//!
//! The rules depend on the order tensors are visited (the `attn_v` and `ffn_down` counters), so
//! [`TypeChooser`] must see tensors in the order llama.cpp visits them: by layer, then by name,
//! global tensors first ([`gguf_order`]). What it keeps from llama.cpp:
//!
//! - only 2-D+ tensors whose name ends in `weight` and is not a norm are quantized;
//! - `output.weight` (or `token_embd.weight` when embeddings are tied) gets Q6_K, or Q8_0 when its
//!   rows are not whole 256-blocks (or the preset is Q8_0);
//! - `attn_v` / `ffn_down` / `attn_output` bumps per preset, with `use_more_bits` choosing layers;
//! - a type whose block does not divide the row length falls back (Q2_K/Q3_K -> Q4_0, Q4_K ->
//!   Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then F16), as `tensor_type_fallback` does.
//!
//! Mixtures of experts: the stacked expert tensors (`ffn_{gate,up,down}_exps`, 3-D) follow the
//! rules of their kind (`ffn_down_exps` is an `ffn_down`), with the layer read from the name
//! rather than counted (llama.cpp's `layer_info` when the model has experts); the router
//! `ffn_gate_inp` is never quantized; a model of exactly 8 experts (Mixtral) gets `attn_v` and
//! `attn_k` in Q8_0 and, for the Q2_K..Q4_K_M presets, `attn_output` in Q5_K.
//!
//! `MXFP4_MOE` (made for GPT-OSS): the output (or tied embeddings) Q8_0, stacked experts MXFP4,
//! every other quantized weight Q8_0; a row that is not whole 32-blocks has no fallback.

use hf2q_tensor::GgmlType;

use super::presets::{GgufRecipe, Preset};
use crate::{Error, Result};

/// llama.cpp's broad tensor categories (`tensor_get_category`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Category {
    Output,
    TokenEmbd,
    AttnQkv,
    AttnKvB,
    AttnV,
    AttnK,
    AttnQ,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Other,
}

pub fn category(name: &str) -> Category {
    use Category::*;
    if name == "output.weight" {
        return Output;
    }
    if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        return TokenEmbd;
    }
    for (pat, c) in [
        ("attn_qkv.weight", AttnQkv),
        ("attn_kv_b.weight", AttnKvB),
        ("attn_v.weight", AttnV),
        ("attn_k.weight", AttnK),
        ("attn_q.weight", AttnQ),
        ("attn_output.weight", AttnOutput),
        ("ffn_up", FfnUp),
        ("ffn_gate", FfnGate),
        ("ffn_down", FfnDown),
    ] {
        if name.contains(pat) {
            return c;
        }
    }
    Other
}

fn is_attn_v(c: Category) -> bool {
    matches!(c, Category::AttnV | Category::AttnQkv | Category::AttnKvB)
}

/// llama.cpp's `tensor_allows_quantization`, for the tensors our architectures have.
pub fn allows_quantization(name: &str, n_dims: usize) -> bool {
    n_dims >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
        && !name.contains("position_embd")
        && !name.contains("token_types")
}

/// The order llama.cpp's loader keeps tensors in (`weight_name_comparer`): layer number
/// (`blk.N.`, global tensors count as -1), then name.
pub fn gguf_order(a: &str, b: &str) -> std::cmp::Ordering {
    fn layer(n: &str) -> i64 {
        n.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|d| d.parse().ok())
            .unwrap_or(-1)
    }
    layer(a).cmp(&layer(b)).then_with(|| a.cmp(b))
}

/// Model facts the rules read.
#[derive(Clone, Copy, Debug)]
pub struct ModelFacts {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Llama 70B (80 layers, grouped-query attention): attn_v gets more bits.
    pub is_70b: bool,
    /// Routed experts per MoE layer (llama.cpp's `n_expert`); 0 for a dense model.
    pub n_expert: usize,
}

impl ModelFacts {
    /// The facts of a parsed config.
    pub fn of(c: &crate::config::ModelConfig) -> ModelFacts {
        ModelFacts {
            n_layer: c.n_layers,
            n_head: c.n_heads,
            n_head_kv: c.n_kv_heads,
            is_70b: c.arch == crate::config::Arch::Llama
                && c.n_layers == 80
                && c.n_heads != c.n_kv_heads,
            n_expert: c.moe.as_ref().map_or(0, |m| m.n_experts),
        }
    }
}

/// The layer of `blk.N.*` (llama.cpp's `layer_info` for models with experts).
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// One tensor as the rules see it.
#[derive(Clone, Copy, Debug)]
pub struct TensorFacts<'a> {
    pub name: &'a str,
    /// ne[0]: the row length.
    pub cols: usize,
    pub n_dims: usize,
    /// The stored type (kept when the tensor is not quantized).
    pub current: GgmlType,
}

/// User overrides of llama-quantize's `--output-tensor-type` / `--token-embedding-type`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Overrides {
    pub output: Option<GgmlType>,
    pub token_embd: Option<GgmlType>,
}

/// A fallback that happened: (tensor, wanted, got).
pub type Fallback = (String, GgmlType, GgmlType);

/// Chooses GGUF tensor types, visiting tensors in [`gguf_order`].
#[derive(Debug)]
pub struct TypeChooser {
    recipe: GgufRecipe,
    model: ModelFacts,
    overrides: Overrides,
    has_imatrix: bool,
    has_tied_embeddings: bool,
    n_attention_wv: usize,
    i_attention_wv: usize,
    i_ffn_down: usize,
    pub fallbacks: Vec<Fallback>,
}

impl TypeChooser {
    /// `all_names`: every tensor the output will hold (for the counters llama.cpp takes first).
    pub fn new<'a>(
        recipe: GgufRecipe,
        model: ModelFacts,
        overrides: Overrides,
        has_imatrix: bool,
        all_names: impl IntoIterator<Item = &'a str>,
    ) -> TypeChooser {
        let mut n_attention_wv = 0;
        let mut has_tied_embeddings = true;
        for n in all_names {
            let c = category(n);
            if is_attn_v(c) {
                n_attention_wv += 1;
            }
            if c == Category::Output {
                has_tied_embeddings = false;
            }
        }
        TypeChooser {
            recipe,
            model,
            overrides,
            has_imatrix,
            has_tied_embeddings,
            n_attention_wv,
            i_attention_wv: 0,
            i_ffn_down: 0,
            fallbacks: Vec::new(),
        }
    }

    /// The type for the next tensor (call in [`gguf_order`]).
    pub fn choose(&mut self, t: TensorFacts<'_>) -> Result<GgmlType> {
        if !allows_quantization(t.name, t.n_dims) {
            return Ok(t.current);
        }
        let cat = category(t.name);
        if let (Some(ty), Category::TokenEmbd) = (self.overrides.token_embd, cat) {
            return Ok(ty);
        }
        if let (Some(ty), Category::Output) = (self.overrides.output, cat) {
            return Ok(ty);
        }
        let default = self.recipe.preset.default_type();
        let mut ty = default;
        if is_quantized(default) {
            if !self.recipe.pure {
                ty = self.preset_rule(ty, t, cat)?;
            }
            ty = self.fallback(t, ty)?;
        }
        Ok(ty)
    }

    /// `llama_tensor_get_type_impl` for the presets hf2q supports.
    fn preset_rule(
        &mut self,
        mut ty: GgmlType,
        t: TensorFacts<'_>,
        cat: Category,
    ) -> Result<GgmlType> {
        use GgmlType as G;
        use Preset::*;
        let ft = self.recipe.preset;
        let m = self.model;
        let n_gqa = m.n_head.checked_div(m.n_head_kv).unwrap_or(1);
        let use_more_bits = |i: usize, n: usize| -> bool {
            i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64).rem_euclid(3) == 2
        };
        if cat == Category::Output || (self.has_tied_embeddings && cat == Category::TokenEmbd) {
            if ft == MXFP4_MOE || !t.cols.is_multiple_of(ty.block_size()) {
                ty = G::Q8_0;
            } else if ty != G::Q8_0 {
                ty = G::Q6_K;
            }
        } else if ft == MXFP4_MOE {
            // Stacked experts (E, R, C) MXFP4, everything else Q8_0 (untied embeddings too).
            ty = if t.n_dims == 3 { G::MXFP4 } else { G::Q8_0 };
        } else if cat == Category::TokenEmbd {
            // Untied embeddings keep the default type for these presets.
        } else if is_attn_v(cat) {
            match ft {
                Q2_K => ty = if n_gqa >= 4 { G::Q4_K } else { G::Q3_K },
                Q3_K_M => {
                    ty = if self.i_attention_wv < 2 {
                        G::Q5_K
                    } else {
                        G::Q4_K
                    }
                }
                Q3_K_L => ty = G::Q5_K,
                Q4_K_M | Q5_K_M if use_more_bits(self.i_attention_wv, self.n_attention_wv) => {
                    ty = G::Q6_K
                }
                Q4_K_S if self.i_attention_wv < 4 => ty = G::Q5_K,
                _ => {}
            }
            if m.is_70b && matches!(ty, G::Q3_K | G::Q4_K) {
                ty = G::Q5_K;
            }
            if m.n_expert == 8 {
                ty = G::Q8_0;
            }
            self.i_attention_wv += 1;
        } else if cat == Category::AttnK {
            if m.n_expert == 8 {
                ty = G::Q8_0;
            }
        } else if cat == Category::FfnDown {
            let n = m.n_layer;
            // With experts llama.cpp reads the layer from the name (its counter would not match
            // the layer where experts were stored one tensor each); it counts the same without.
            let i = if m.n_expert > 1 {
                layer_of(t.name)
                    .filter(|&l| l < n)
                    .ok_or_else(|| bad_layer(t.name, n))?
            } else {
                self.i_ffn_down
            };
            match ft {
                Q2_K => ty = G::Q3_K,
                Q3_K_M => ty = if i < n / 16 { G::Q5_K } else { G::Q4_K },
                Q3_K_L => ty = G::Q5_K,
                Q4_K_M | Q5_K_M if use_more_bits(i, n) => ty = G::Q6_K,
                // Q4_K_M's chain ends here in llama.cpp (no Q4_K_S / imatrix rule below applies).
                Q4_K_M => {}
                Q4_K_S if i < n / 8 => ty = G::Q5_K,
                Q4_0 | Q5_0 if self.has_imatrix && i < n / 8 => {
                    // llama.cpp guards the first ffn_down layers of Q4_0/Q5_0 when an imatrix
                    // is given (so that without one the old result is reproduced).
                    ty = if ft == Q4_0 { G::Q4_1 } else { G::Q5_1 };
                }
                _ => {}
            }
            self.i_ffn_down += 1;
        } else if cat == Category::AttnOutput {
            if m.n_expert == 8 {
                if matches!(ft, Q2_K | Q3_K_S | Q3_K_M | Q4_K_S | Q4_K_M) {
                    ty = G::Q5_K;
                }
            } else {
                match ft {
                    Q2_K => ty = G::Q3_K,
                    Q3_K_M => ty = G::Q4_K,
                    Q3_K_L => ty = G::Q5_K,
                    _ => {}
                }
            }
        } else if cat == Category::AttnQkv {
            match ft {
                Q3_K_M | Q3_K_L => ty = G::Q4_K,
                Q4_K_M => ty = G::Q5_K,
                Q5_K_M => ty = G::Q6_K,
                _ => {}
            }
        }
        Ok(ty)
    }

    /// `tensor_type_fallback`.
    fn fallback(&mut self, t: TensorFacts<'_>, ty: GgmlType) -> Result<GgmlType> {
        let to = fallback_type(t.name, t.cols, ty)?;
        if to != ty {
            self.fallbacks.push((t.name.to_string(), ty, to));
        }
        Ok(to)
    }
}

/// The type a row of `cols` values can hold in place of `ty` (llama.cpp's
/// `tensor_type_fallback`): `ty` itself when its blocks divide the row, else Q2_K/Q3_K -> Q4_0,
/// Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 when even that does not divide it.
pub fn fallback_type(name: &str, cols: usize, ty: GgmlType) -> Result<GgmlType> {
    use GgmlType as G;
    if cols.is_multiple_of(ty.block_size()) {
        return Ok(ty);
    }
    let to = match ty {
        G::Q2_K | G::Q3_K => G::Q4_0,
        G::Q4_K => G::Q5_0,
        G::Q5_K => G::Q5_1,
        G::Q6_K => G::Q8_0,
        other => {
            return Err(Error::Msg(format!(
                "tensor '{name}': rows of {cols} are not whole {other} blocks of {}, and {other} has no fallback type",
                other.block_size()
            )))
        }
    };
    Ok(if !cols.is_multiple_of(to.block_size()) {
        G::F16
    } else {
        to
    })
}

fn bad_layer(name: &str, n_layer: usize) -> Error {
    Error::Msg(format!(
        "tensor '{name}': no layer number below {n_layer} in its name (a model with experts names its layers blk.N)"
    ))
}

pub fn is_quantized(ty: GgmlType) -> bool {
    !matches!(
        ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::F64
            | GgmlType::I8
            | GgmlType::I16
            | GgmlType::I32
            | GgmlType::I64
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlType as G;

    /// SmolLM2-135M's tensors (30 layers, 9 heads / 3 kv heads, D 576, F 1536, tied embeddings).
    fn smollm2() -> (ModelFacts, Vec<(String, usize, usize)>) {
        let mut t = vec![
            ("token_embd.weight".to_string(), 576, 2),
            ("output_norm.weight".into(), 576, 1),
        ];
        for l in 0..30 {
            for (n, c, d) in [
                ("attn_k.weight", 576, 2),
                ("attn_norm.weight", 576, 1),
                ("attn_output.weight", 576, 2),
                ("attn_q.weight", 576, 2),
                ("attn_v.weight", 576, 2),
                ("ffn_down.weight", 1536, 2),
                ("ffn_gate.weight", 576, 2),
                ("ffn_norm.weight", 576, 1),
                ("ffn_up.weight", 576, 2),
            ] {
                t.push((format!("blk.{l}.{n}"), c, d));
            }
        }
        t.sort_by(|a, b| gguf_order(&a.0, &b.0));
        (
            ModelFacts {
                n_layer: 30,
                n_head: 9,
                n_head_kv: 3,
                is_70b: false,
                n_expert: 0,
            },
            t,
        )
    }

    fn types(preset: Preset, pure: bool) -> Vec<(String, GgmlType)> {
        let (m, t) = smollm2();
        let mut c = TypeChooser::new(
            GgufRecipe { preset, pure },
            m,
            Overrides::default(),
            false,
            t.iter().map(|x| x.0.as_str()),
        );
        t.iter()
            .map(|(n, cols, d)| {
                (
                    n.clone(),
                    c.choose(TensorFacts {
                        name: n,
                        cols: *cols,
                        n_dims: *d,
                        current: G::F32,
                    })
                    .unwrap(),
                )
            })
            .collect()
    }

    fn of(v: &[(String, GgmlType)], name: &str) -> GgmlType {
        v.iter().find(|x| x.0 == name).unwrap().1
    }

    #[test]
    fn q4_k_m_on_smollm2_matches_llama_cpp() {
        // What llama-quantize prints for SmolLM2-135M Q4_K_M: the 576-wide tensors fall back from
        // Q4_K to Q5_0; tied embeddings get Q8_0 (Q6_K impossible at 576); ffn_down (1536 wide)
        // stays a k-quant, Q6_K on the use_more_bits layers; attn_v (576 wide) Q6_K -> Q8_0 on
        // those layers, else Q4_K -> Q5_0.
        let v = types(Preset::Q4_K_M, false);
        assert_eq!(of(&v, "token_embd.weight"), G::Q8_0);
        assert_eq!(of(&v, "output_norm.weight"), G::F32);
        assert_eq!(of(&v, "blk.0.attn_q.weight"), G::Q5_0);
        assert_eq!(of(&v, "blk.0.ffn_down.weight"), G::Q6_K);
        assert_eq!(of(&v, "blk.4.ffn_down.weight"), G::Q4_K);
        assert_eq!(of(&v, "blk.5.ffn_down.weight"), G::Q6_K); // (5 - 3) % 3 == 2
        assert_eq!(of(&v, "blk.29.ffn_down.weight"), G::Q6_K);
        assert_eq!(of(&v, "blk.0.attn_v.weight"), G::Q8_0);
        assert_eq!(of(&v, "blk.4.attn_v.weight"), G::Q5_0);
    }

    #[test]
    fn q3_k_m_and_q2_k_bumps() {
        let v = types(Preset::Q3_K_M, false);
        assert_eq!(of(&v, "blk.0.attn_v.weight"), G::Q5_1); // Q5_K -> fallback
        assert_eq!(of(&v, "blk.2.attn_v.weight"), G::Q5_0); // Q4_K -> fallback
        assert_eq!(of(&v, "blk.0.ffn_down.weight"), G::Q5_K); // 0 < 30/16
        assert_eq!(of(&v, "blk.9.ffn_down.weight"), G::Q4_K);
        assert_eq!(of(&v, "blk.3.attn_output.weight"), G::Q5_0);
        let v = types(Preset::Q2_K, false);
        assert_eq!(of(&v, "blk.3.ffn_down.weight"), G::Q3_K);
        assert_eq!(of(&v, "blk.3.ffn_up.weight"), G::Q4_0);
    }

    #[test]
    fn pure_and_float_presets() {
        let v = types(Preset::Q4_K_S, true);
        assert_eq!(of(&v, "token_embd.weight"), G::Q5_0);
        assert_eq!(of(&v, "blk.7.ffn_down.weight"), G::Q4_K);
        let v = types(Preset::F16, false);
        assert_eq!(of(&v, "token_embd.weight"), G::F16);
        assert_eq!(of(&v, "blk.0.attn_norm.weight"), G::F32);
        let v = types(Preset::Q8_0, false);
        assert!(v
            .iter()
            .filter(|x| x.0.ends_with("proj") || x.0.contains("attn_q"))
            .all(|x| x.1 == G::Q8_0));
        // Q4_0 puts tied embeddings at Q6_K, which a 576-wide row cannot hold: Q8_0.
        let v = types(Preset::Q4_0, false);
        assert_eq!(of(&v, "token_embd.weight"), G::Q8_0);
    }

    /// A mixture of experts' tensor names (stacked experts, routers), Mixtral-8x7B's widths.
    fn experts_model(n_expert: usize, n_layer: usize) -> (ModelFacts, Vec<(String, usize, usize)>) {
        let mut t = vec![
            ("output.weight".to_string(), 4096, 2),
            ("token_embd.weight".into(), 4096, 2),
        ];
        for l in 0..n_layer {
            for (n, c, d) in [
                ("attn_k.weight", 4096, 2),
                ("attn_output.weight", 4096, 2),
                ("attn_q.weight", 4096, 2),
                ("attn_v.weight", 4096, 2),
                ("ffn_down_exps.weight", 14336, 3),
                ("ffn_gate_exps.weight", 4096, 3),
                ("ffn_gate_inp.weight", 4096, 2),
                ("ffn_up_exps.weight", 4096, 3),
            ] {
                t.push((format!("blk.{l}.{n}"), c, d));
            }
        }
        t.sort_by(|a, b| gguf_order(&a.0, &b.0));
        let m = ModelFacts {
            n_layer,
            n_head: 32,
            n_head_kv: 8,
            is_70b: false,
            n_expert,
        };
        (m, t)
    }

    fn types_of(
        (m, t): (ModelFacts, Vec<(String, usize, usize)>),
        preset: Preset,
    ) -> Vec<(String, GgmlType)> {
        let mut c = TypeChooser::new(
            GgufRecipe {
                preset,
                pure: false,
            },
            m,
            Overrides::default(),
            false,
            t.iter().map(|x| x.0.as_str()),
        );
        t.iter()
            .map(|(n, cols, d)| {
                let ty = c
                    .choose(TensorFacts {
                        name: n,
                        cols: *cols,
                        n_dims: *d,
                        current: G::F32,
                    })
                    .unwrap();
                (n.clone(), ty)
            })
            .collect()
    }

    #[test]
    fn experts_follow_llama_cpp_per_preset() {
        // llama_tensor_get_type_impl read for a model of 8 experts (Mixtral, 32 layers, GQA 4):
        // attn_v and attn_k Q8_0 whatever the preset; attn_output Q5_K for Q2_K..Q4_K_M only;
        // ffn_down_exps by the layer in its name; the router kept.
        // (preset, attn_v, attn_k, attn_output, ffn_down_exps layer 0, layer 4, ffn_up_exps)
        let want = [
            (
                Preset::Q2_K,
                G::Q8_0,
                G::Q8_0,
                G::Q5_K,
                G::Q3_K,
                G::Q3_K,
                G::Q2_K,
            ),
            (
                Preset::Q3_K_S,
                G::Q8_0,
                G::Q8_0,
                G::Q5_K,
                G::Q3_K,
                G::Q3_K,
                G::Q3_K,
            ),
            (
                Preset::Q3_K_M,
                G::Q8_0,
                G::Q8_0,
                G::Q5_K,
                G::Q5_K,
                G::Q4_K,
                G::Q3_K,
            ),
            (
                Preset::Q3_K_L,
                G::Q8_0,
                G::Q8_0,
                G::Q3_K,
                G::Q5_K,
                G::Q5_K,
                G::Q3_K,
            ),
            (
                Preset::Q4_K_S,
                G::Q8_0,
                G::Q8_0,
                G::Q5_K,
                G::Q5_K,
                G::Q4_K,
                G::Q4_K,
            ),
            (
                Preset::Q4_K_M,
                G::Q8_0,
                G::Q8_0,
                G::Q5_K,
                G::Q6_K,
                G::Q4_K,
                G::Q4_K,
            ),
            (
                Preset::Q5_K_M,
                G::Q8_0,
                G::Q8_0,
                G::Q5_K,
                G::Q6_K,
                G::Q5_K,
                G::Q5_K,
            ),
            (
                Preset::Q6_K,
                G::Q8_0,
                G::Q8_0,
                G::Q6_K,
                G::Q6_K,
                G::Q6_K,
                G::Q6_K,
            ),
            (
                Preset::Q8_0,
                G::Q8_0,
                G::Q8_0,
                G::Q8_0,
                G::Q8_0,
                G::Q8_0,
                G::Q8_0,
            ),
            (
                Preset::Q4_0,
                G::Q8_0,
                G::Q8_0,
                G::Q4_0,
                G::Q4_0,
                G::Q4_0,
                G::Q4_0,
            ),
        ];
        for (p, v, k, o, d0, d4, up) in want {
            let t = types_of(experts_model(8, 32), p);
            let got = (
                of(&t, "blk.4.attn_v.weight"),
                of(&t, "blk.4.attn_k.weight"),
                of(&t, "blk.4.attn_output.weight"),
                of(&t, "blk.0.ffn_down_exps.weight"),
                of(&t, "blk.4.ffn_down_exps.weight"),
                of(&t, "blk.4.ffn_up_exps.weight"),
            );
            assert_eq!(got, (v, k, o, d0, d4, up), "{p:?}");
            assert_eq!(of(&t, "blk.4.ffn_gate_inp.weight"), G::F32, "{p:?}");
        }
        // Other expert counts: no 8-expert bumps (Q4_K_M: attn_v by use_more_bits).
        let t = types_of(experts_model(128, 48), Preset::Q4_K_M);
        assert_eq!(of(&t, "blk.0.attn_v.weight"), G::Q6_K);
        assert_eq!(of(&t, "blk.6.attn_v.weight"), G::Q4_K);
        assert_eq!(of(&t, "blk.6.attn_k.weight"), G::Q4_K);
        assert_eq!(of(&t, "blk.6.attn_output.weight"), G::Q4_K);
        assert_eq!(of(&t, "blk.8.ffn_down_exps.weight"), G::Q6_K);
        // F16: nothing quantized, the router kept as stored.
        let t = types_of(experts_model(8, 2), Preset::F16);
        assert_eq!(of(&t, "blk.0.ffn_down_exps.weight"), G::F16);
        assert_eq!(of(&t, "blk.0.ffn_gate_inp.weight"), G::F32);
        // A tensor of a model with experts whose layer cannot be read is refused.
        let (m, _) = experts_model(8, 2);
        let mut c = TypeChooser::new(
            GgufRecipe {
                preset: Preset::Q4_K_M,
                pure: false,
            },
            m,
            Overrides::default(),
            false,
            ["blk.9.ffn_down_exps.weight"],
        );
        let e = c
            .choose(TensorFacts {
                name: "blk.9.ffn_down_exps.weight",
                cols: 256,
                n_dims: 3,
                current: G::F32,
            })
            .unwrap_err();
        assert!(e.to_string().contains("blk.9.ffn_down_exps"), "{e}");
    }

    #[test]
    fn order_is_layer_then_name() {
        let mut v = vec![
            "blk.10.a",
            "blk.2.b",
            "output.weight",
            "blk.2.a",
            "token_embd.weight",
        ];
        v.sort_by(|a, b| gguf_order(a, b));
        assert_eq!(
            v,
            [
                "output.weight",
                "token_embd.weight",
                "blk.2.a",
                "blk.2.b",
                "blk.10.a"
            ]
        );
    }
}
