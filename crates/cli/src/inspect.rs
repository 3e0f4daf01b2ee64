//! `hf2q inspect`: what a model is, as a readable table or as JSON (`ModelInfo`).

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
}

pub fn inspect(a: InspectArgs) -> Result<()> {
    let (_, model) = args::load_model(a.model.as_deref())?;
    let info = model.info();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        print!("{}", table(&info));
    }
    Ok(())
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
