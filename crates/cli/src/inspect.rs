//! `hf2q inspect`: what a model is, as a readable table or as JSON (`ModelInfo`); with `--kv`,
//! also what its KV cache takes per token and for a context, for the chosen cache types.

use anyhow::Result;
use hf2q_models::ModelInfo;

use crate::args;

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Model: built-in name or path [default: smollm2-135m].
    pub model: Option<String>,
    /// Print the information as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Also show the KV cache's size: bytes per token and for --ctx tokens, for the cache
    /// types of --kv-type / --kv-type-k / --kv-type-v or --kv-bits, or the model folder's
    /// kv_config.json (JSON: a `kv` object).
    #[arg(long)]
    pub kv: bool,
    /// Context for --kv, in tokens [default: the model's context length].
    #[arg(long, value_name = "N", requires = "kv")]
    pub ctx: Option<usize>,
    #[command(flatten)]
    pub kv_types: args::KvArgs,
}

/// The KV cache's size for one choice of types (`inspect --kv`).
#[derive(serde::Serialize)]
struct KvSize {
    kv_type: String,
    kv_type_k: &'static str,
    kv_type_v: &'static str,
    bytes_per_token: usize,
    /// What an f16 cache takes per token (the default, for comparison).
    f16_bytes_per_token: usize,
    /// What one sequence's cache holds whatever its length (centred keys' first positions and
    /// centres; 0 for f16 / f32 keys).
    fixed_bytes: usize,
    context: usize,
    /// Keys and values of `context` tokens, all layers (`context * bytes_per_token +
    /// fixed_bytes`).
    bytes: u64,
}

pub fn inspect(a: InspectArgs) -> Result<()> {
    let (_, mut model) = args::load_model(a.model.as_deref())?;
    let info = model.info();
    let kv = if a.kv {
        let types = a.kv_types.apply(&mut model)?;
        let per = model.kv_bytes_per_token();
        let fixed = model.kv_fixed_bytes();
        let context = a.ctx.unwrap_or(model.context_length());
        Some(KvSize {
            kv_type: model.kv_type_name(),
            kv_type_k: types.k.name(),
            kv_type_v: types.v.name(),
            bytes_per_token: per,
            f16_bytes_per_token: model.kv_bytes_per_token_as(hf2q_models::kv_cache::KvType::F16),
            fixed_bytes: fixed,
            context,
            bytes: per as u64 * context as u64 + fixed as u64,
        })
    } else {
        None
    };
    if a.json {
        let mut v = serde_json::to_value(&info)?;
        if let Some(kv) = &kv {
            v["kv"] = serde_json::to_value(kv)?;
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", table(&info));
        if let Some(kv) = &kv {
            print!("{}", kv_table(kv));
        }
    }
    Ok(())
}

/// `inspect --kv`'s section, after the tensor types.
fn kv_table(kv: &KvSize) -> String {
    let pct = 100.0 * kv.bytes_per_token as f64 / kv.f16_bytes_per_token.max(1) as f64;
    format!(
        "\nkv cache:\n  type             {}\n  bytes per token  {} ({pct:.1} % of f16's {})\n  \
         fixed per seq.   {} bytes (centred keys' first positions)\n  \
         context          {} tokens: {} ({} bytes)\n",
        kv.kv_type,
        kv.bytes_per_token,
        kv.f16_bytes_per_token,
        kv.fixed_bytes,
        kv.context,
        human_bytes(kv.bytes),
        kv.bytes,
    )
}

/// 134_515_008 -> "134.5M".
fn human_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2} GB", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1} MB", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1} KB", n as f64 / 1e3),
        n => format!("{n} B"),
    }
}

fn or_dash(s: &Option<String>) -> String {
    s.as_deref()
        .map_or_else(|| "-".to_string(), |s| format!("{s:?}"))
}

pub fn table(i: &ModelInfo) -> String {
    let mut rows: Vec<(&str, String)> = vec![
        ("path", i.path.clone()),
        ("format", i.format.clone()),
        ("architecture", i.architecture.clone()),
        ("name", i.name.clone().unwrap_or_else(|| "-".into())),
        (
            "parameters",
            format!("{} ({})", human_count(i.parameters), i.parameters),
        ),
        ("size on disk", human_bytes(i.file_bytes)),
        ("bits per weight", format!("{:.2}", i.bits_per_weight)),
        ("context length", i.context_length.to_string()),
        ("layers", i.n_layers.to_string()),
        ("hidden size", i.hidden_size.to_string()),
        ("ffn size", i.intermediate_size.to_string()),
        (
            "attention heads",
            format!(
                "{} (kv {}), head dim {}",
                i.n_heads, i.n_kv_heads, i.head_dim
            ),
        ),
        ("vocab size", i.vocab_size.to_string()),
        ("rope theta", format!("{}", i.rope_theta)),
        (
            "sliding window",
            i.sliding_window
                .map_or_else(|| "-".into(), |w| w.to_string()),
        ),
        ("BOS token", or_dash(&i.bos_token)),
        ("EOS token", or_dash(&i.eos_token)),
        (
            "end of generation",
            if i.eog_tokens.is_empty() {
                "-".into()
            } else {
                i.eog_tokens
                    .iter()
                    .map(|t| format!("{t:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        ),
        ("adds BOS", if i.add_bos { "yes" } else { "no" }.into()),
        (
            "chat template",
            if i.chat_template { "yes" } else { "no" }.into(),
        ),
        ("sampling", i.generation.describe()),
    ];
    if let Some(e) = &i.experts {
        rows.push((
            "experts",
            format!(
                "{}, {} per token, width {}, {} of {} layers routed",
                e.experts, e.experts_per_token, e.expert_width, e.routed_layers, i.n_layers
            ),
        ));
        rows.push((
            "active parameters",
            format!(
                "{} ({}) per token",
                human_count(e.active_parameters),
                e.active_parameters
            ),
        ));
    }
    let mut out = String::new();
    let w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    for (k, v) in rows.drain(..) {
        out.push_str(&format!("{k:<w$}  {v}\n"));
    }
    out.push_str("\ntensor types:\n");
    out.push_str(&format!(
        "  {:<10} {:>8} {:>14} {:>7}\n",
        "type", "tensors", "elements", "share"
    ));
    let total: u64 = i.tensor_types.values().map(|v| v.1).sum();
    for (ty, (count, elems)) in &i.tensor_types {
        let share = if total > 0 {
            100.0 * *elems as f64 / total as f64
        } else {
            0.0
        };
        out.push_str(&format!(
            "  {ty:<10} {count:>8} {elems:>14} {share:>6.1}%\n"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_units() {
        assert_eq!(human_count(134_515_008), "134.5M");
        assert_eq!(human_count(2_500_000_000), "2.50B");
        assert_eq!(human_count(999), "999");
        assert_eq!(human_bytes(98_362_432), "98.4 MB");
    }
}
