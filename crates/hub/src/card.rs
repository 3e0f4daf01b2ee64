//! The README.md written into a pushed repository that has none: a Hub model or dataset card
//! (YAML front matter the Hub reads: `base_model`, `library_name`, `tags`; then what the files
//! are and how they were made). Built from [`CardFacts`], which the binary gathers from the
//! folder's own files (GGUF metadata, `adapter_config.json`, `config.json`); nothing here reads
//! files or guesses what the facts do not say.

/// What a pushed folder is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CardKind {
    /// A GGUF file (or a folder of them).
    Gguf,
    /// A Hugging Face or MLX model folder.
    Model,
    /// A LoRA adapter (PEFT files).
    Adapter,
    /// A dataset folder.
    Dataset,
}

/// The facts a card states; `None` or empty when the files do not say.
#[derive(Clone, Debug)]
pub struct CardFacts {
    pub kind: CardKind,
    /// The repository the card is for (`org/name`).
    pub repo: String,
    /// The model this one was made from (a repository name or a model name).
    pub base_model: Option<String>,
    /// The quantization: `Q4_K_M`, `MLX 4-bit, group 64`, ...
    pub quantization: Option<String>,
    /// Settings as `(name, value)`: an adapter's training settings, a model's architecture.
    pub settings: Vec<(String, String)>,
    /// The files pushed (relative paths).
    pub files: Vec<String>,
}

/// A YAML scalar: quoted when it is not a plain word.
fn yaml(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
    {
        s.to_string()
    } else {
        format!("{:?}", s)
    }
}

/// The card's text.
pub fn render(f: &CardFacts) -> String {
    let mut tags = vec!["hf2q"];
    let library = match f.kind {
        CardKind::Gguf => {
            tags.push("gguf");
            None
        }
        CardKind::Adapter => {
            tags.extend(["lora", "adapter"]);
            Some("peft")
        }
        CardKind::Model => Some("transformers"),
        CardKind::Dataset => None,
    };
    if f.quantization.is_some() {
        tags.push("quantized");
    }
    let mut s = String::from("---\n");
    if let Some(b) = &f.base_model {
        s += &format!("base_model: {}\n", yaml(b));
    }
    if let Some(l) = library {
        s += &format!("library_name: {l}\n");
    }
    s += "tags:\n";
    for t in &tags {
        s += &format!("- {t}\n");
    }
    s += "---\n\n";
    s += &format!("# {}\n\n", f.repo);
    let what = match f.kind {
        CardKind::Gguf => "GGUF model files",
        CardKind::Model => "A model",
        CardKind::Adapter => "A LoRA adapter",
        CardKind::Dataset => "A dataset",
    };
    s += &format!("{what} pushed with hf2q");
    match &f.base_model {
        Some(b) if f.kind != CardKind::Dataset => s += &format!(", made from `{b}`"),
        _ => {}
    }
    s += ".\n\n";
    if let Some(q) = &f.quantization {
        s += &format!("Quantization: **{q}**.\n\n");
    }
    if !f.settings.is_empty() {
        s += if f.kind == CardKind::Adapter {
            "## Training settings\n\n"
        } else {
            "## Settings\n\n"
        };
        s += "| setting | value |\n|---|---|\n";
        for (k, v) in &f.settings {
            s += &format!("| {k} | {} |\n", v.replace('|', "\\|"));
        }
        s += "\n";
    }
    if !f.files.is_empty() {
        s += "## Files\n\n";
        for p in &f.files {
            s += &format!("- `{p}`\n");
        }
        s += "\n";
    }
    match f.kind {
        CardKind::Gguf | CardKind::Model => {
            s += &format!("## Use\n\n```sh\nhf2q run {}\n```\n", f.repo)
        }
        CardKind::Adapter => {
            if let Some(b) = &f.base_model {
                s += &format!("## Use\n\n```sh\nhf2q pull {0}\nhf2q run {b} --lora <path printed by the pull>\n```\n", f.repo);
            }
        }
        CardKind::Dataset => {}
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_card_states_base_and_quantization() {
        let c = render(&CardFacts {
            kind: CardKind::Gguf,
            repo: "me/tiny-GGUF".into(),
            base_model: Some("org/tiny".into()),
            quantization: Some("Q8_0".into()),
            settings: vec![],
            files: vec!["tiny-Q8_0.gguf".into()],
        });
        assert!(c.starts_with("---\nbase_model: org/tiny\n"), "{c}");
        assert!(c.contains("- gguf\n") && c.contains("**Q8_0**") && c.contains("`tiny-Q8_0.gguf`"));
        let a = render(&CardFacts {
            kind: CardKind::Adapter,
            repo: "me/lora".into(),
            base_model: Some("a model: v1".into()),
            quantization: None,
            settings: vec![("r".into(), "8".into())],
            files: vec![],
        });
        assert!(a.contains("base_model: \"a model: v1\"") && a.contains("library_name: peft"));
        assert!(a.contains("| r | 8 |"));
    }
}
