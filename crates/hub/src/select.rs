//! Which files of a repository a model needs. A GGUF repository: the file of the requested type
//! (case-insensitive, `Q4_K_M` by default as llama.cpp does), with all parts of a split file
//! (`-00001-of-0000N.gguf`). A safetensors or MLX repository: the top-level config, tokenizer,
//! template and `*.safetensors` files. `--include` globs replace that choice, `--exclude` globs
//! remove from it (the `globset` crate; `*` matches across `/` as huggingface_hub's patterns).

use globset::{Glob, GlobBuilder, GlobSet, GlobSetBuilder};

use crate::error::{HubError, Result};

/// The GGUF type picked when the name has none (llama.cpp's default).
pub const DEFAULT_QUANT: &str = "Q4_K_M";

/// The files to fetch and the one to load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    pub files: Vec<String>,
    /// The GGUF file to load (the first part of a split one); `None`: load the snapshot folder.
    pub gguf: Option<String>,
}

/// What to select: the GGUF type and the override globs.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    pub quant: Option<String>,
    pub include: Vec<String>,
    pub exclude: Vec<String>,
}

pub(crate) fn globs(patterns: &[String], literal_separator: bool) -> Result<GlobSet> {
    let mut b = GlobSetBuilder::new();
    for p in patterns {
        let g: Glob = GlobBuilder::new(p)
            .literal_separator(literal_separator)
            .build()
            .map_err(|e| HubError::Glob {
                glob: p.clone(),
                why: e.kind().to_string(),
            })?;
        b.add(g);
    }
    b.build().map_err(|e| HubError::Glob {
        glob: patterns.join(" "),
        why: e.to_string(),
    })
}

/// The top-level files a safetensors / MLX model folder is loaded from.
const WEIGHTS_FOLDER: &[&str] = &[
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",
];

/// `name-00001-of-00003.gguf` -> (`name`, 3).
pub fn split_parts(file: &str) -> Option<(&str, usize)> {
    let stem = file.strip_suffix(".gguf")?;
    let (head, total) = stem.rsplit_once("-of-")?;
    let (prefix, index) = head.rsplit_once('-')?;
    if index.len() != 5
        || total.len() != 5
        || !index
            .bytes()
            .chain(total.bytes())
            .all(|b| b.is_ascii_digit())
    {
        return None;
    }
    Some((prefix, total.parse().ok()?))
}

/// The names of all parts of the split file that `file` is one of.
pub fn split_names(prefix: &str, total: usize) -> Vec<String> {
    (1..=total)
        .map(|i| format!("{prefix}-{i:05}-of-{total:05}.gguf"))
        .collect()
}

/// Whether a GGUF file name carries the type `quant`: the type, case-insensitive, between
/// separators (`-`, `.`, `_` or `/` before; `-` or `.` after, so `Q4_K` does not take `Q4_K_M`).
pub fn has_quant(file: &str, quant: &str) -> bool {
    let base = file.rsplit('/').next().unwrap_or(file).to_ascii_lowercase();
    let q = quant.to_ascii_lowercase();
    let bytes = base.as_bytes();
    let mut from = 0;
    while let Some(i) = base[from..].find(&q) {
        let start = from + i;
        let end = start + q.len();
        let before_ok = start == 0 || matches!(bytes[start - 1], b'-' | b'.' | b'_');
        let after_ok = end < bytes.len() && matches!(bytes[end], b'-' | b'.');
        if before_ok && after_ok {
            return true;
        }
        from = start + 1;
    }
    false
}

/// The GGUF type a file name carries (`m-q8_0-00001-of-00002.gguf` -> `Q8_0`), for listing
/// what a repository has.
fn quant_of(file: &str) -> String {
    let base = file.rsplit('/').next().unwrap_or(file);
    let stem = split_parts(base)
        .map(|(p, _)| p)
        .unwrap_or_else(|| base.strip_suffix(".gguf").unwrap_or(base));
    let upper = stem.to_ascii_uppercase();
    let is_type = |t: &str| {
        let b = t.as_bytes();
        (b.len() >= 2 && b[0] == b'Q' && b[1].is_ascii_digit())
            || (b.len() >= 3 && t.starts_with("IQ") && b[2].is_ascii_digit())
            || matches!(t, "F16" | "BF16" | "F32")
    };
    for tok in upper.rsplit(['-', '.']) {
        if is_type(tok) {
            return tok.to_string();
        }
        if let Some(i) = tok.find("_Q").or_else(|| tok.find("_IQ")) {
            if is_type(&tok[i + 1..]) {
                return tok[i + 1..].to_string();
            }
        }
    }
    base.to_string()
}

/// Chooses the files of `repo` (its file list `files`) to fetch.
pub fn select(repo: &str, files: &[String], filter: &Filter) -> Result<Selection> {
    let mut chosen: Vec<String>;
    let mut gguf = None;
    if !filter.include.is_empty() {
        let inc = globs(&filter.include, false)?;
        chosen = files
            .iter()
            .filter(|f| inc.is_match(f.as_str()))
            .cloned()
            .collect();
    } else {
        let ggufs: Vec<&String> = files
            .iter()
            .filter(|f| f.ends_with(".gguf") && !f.contains("mmproj") && !f.contains('/'))
            .chain(
                files
                    .iter()
                    .filter(|f| f.ends_with(".gguf") && !f.contains("mmproj") && f.contains('/')),
            )
            .collect();
        if !ggufs.is_empty() {
            let (quant, defaulted) = match &filter.quant {
                Some(q) => (q.clone(), false),
                None => (DEFAULT_QUANT.to_string(), true),
            };
            let first = ggufs
                .iter()
                .find(|f| has_quant(f, &quant))
                .map(|f| f.to_string());
            let distinct = |v: &[&String]| {
                let mut sets: Vec<String> = v
                    .iter()
                    .map(|f| {
                        split_parts(f)
                            .map(|(p, _)| p.to_string())
                            .unwrap_or(f.to_string())
                    })
                    .collect();
                sets.dedup();
                sets
            };
            let first = match first {
                Some(f) => f,
                None if defaulted && distinct(&ggufs).len() == 1 => ggufs[0].to_string(),
                None => {
                    let mut available: Vec<String> = ggufs.iter().map(|f| quant_of(f)).collect();
                    available.sort();
                    available.dedup();
                    return Err(if defaulted {
                        HubError::QuantAmbiguous {
                            repo: repo.into(),
                            available,
                        }
                    } else {
                        HubError::QuantNotFound {
                            repo: repo.into(),
                            quant,
                            available,
                        }
                    });
                }
            };
            chosen = match split_parts(&first) {
                Some((prefix, total)) => split_names(prefix, total),
                None => vec![first],
            };
        } else if let Some(q) = &filter.quant {
            return Err(HubError::QuantOnNonGguf {
                repo: repo.into(),
                quant: q.clone(),
            });
        } else {
            let set = globs(
                &WEIGHTS_FOLDER
                    .iter()
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>(),
                true,
            )?;
            chosen = files
                .iter()
                .filter(|f| set.is_match(f.as_str()))
                .cloned()
                .collect();
            let has_weights = chosen.iter().any(|f| f.ends_with(".safetensors"));
            let has_config = chosen.iter().any(|f| f == "config.json");
            // Mistral's repos hold the weights twice: consolidated.safetensors is the other copy.
            if chosen
                .iter()
                .any(|f| f.starts_with("model") && f.ends_with(".safetensors"))
            {
                chosen.retain(|f| !(f.starts_with("consolidated") && f.ends_with(".safetensors")));
            }
            if !(has_weights && has_config) {
                return Err(HubError::NothingToLoad {
                    repo: repo.into(),
                    filtered: false,
                });
            }
        }
    }
    if !filter.exclude.is_empty() {
        let exc = globs(&filter.exclude, false)?;
        chosen.retain(|f| !exc.is_match(f.as_str()));
    }
    if chosen.is_empty() {
        return Err(HubError::NothingToLoad {
            repo: repo.into(),
            filtered: true,
        });
    }
    chosen.sort();
    chosen.dedup();
    if let Some(f) = chosen
        .iter()
        .find(|f| f.ends_with(".gguf") && !f.contains("mmproj"))
    {
        gguf = Some(f.clone());
    }
    Ok(Selection {
        files: chosen,
        gguf,
    })
}

/// The files a selection needs that are not in `present` (a cached snapshot's files): the other
/// parts of a split GGUF, and the shards a `*.safetensors.index.json` names (read by `read`).
pub fn missing(
    selection: &Selection,
    present: &[String],
    read: impl Fn(&str) -> Option<String>,
) -> Vec<String> {
    let mut need: Vec<String> = selection.files.clone();
    for f in &selection.files {
        if f.ends_with(".safetensors.index.json") {
            if let Some(v) =
                read(f).and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            {
                if let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) {
                    need.extend(map.values().filter_map(|s| s.as_str()).map(String::from));
                }
            }
        }
    }
    need.sort();
    need.dedup();
    need.retain(|f| !present.contains(f));
    need
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn gguf_type_and_splits() {
        let files = v(&[
            "README.md",
            "m-Q4_K.gguf",
            "m-Q4_K_M.gguf",
            "m-q8_0-00001-of-00002.gguf",
            "m-q8_0-00002-of-00002.gguf",
            "mmproj-Q8_0.gguf",
        ]);
        let f = |q: Option<&str>| Filter {
            quant: q.map(String::from),
            ..Default::default()
        };
        assert_eq!(
            select("r", &files, &f(None)).unwrap().files,
            v(&["m-Q4_K_M.gguf"])
        );
        assert_eq!(
            select("r", &files, &f(Some("q4_k"))).unwrap().files,
            v(&["m-Q4_K.gguf"])
        );
        let s = select("r", &files, &f(Some("Q8_0"))).unwrap();
        assert_eq!(
            s.files,
            v(&["m-q8_0-00001-of-00002.gguf", "m-q8_0-00002-of-00002.gguf"])
        );
        assert_eq!(s.gguf.as_deref(), Some("m-q8_0-00001-of-00002.gguf"));
        let e = select("r", &files, &f(Some("Q5_K_M")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no GGUF file of type Q5_K_M") && e.contains("Q8_0") && e.contains("Q4_K_M"),
            "{e}"
        );
    }

    #[test]
    fn weights_folder_and_globs() {
        let files = v(&[
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "README.md",
            "onnx/model.onnx",
            "sub/x.json",
        ]);
        let s = select("r", &files, &Filter::default()).unwrap();
        assert_eq!(
            s.files,
            v(&["config.json", "model.safetensors", "tokenizer.json"])
        );
        assert_eq!(s.gguf, None);
        let f = Filter {
            include: v(&["*.md", "onnx/*"]),
            exclude: v(&["*.onnx"]),
            ..Default::default()
        };
        assert_eq!(select("r", &files, &f).unwrap().files, v(&["README.md"]));
        let e = select("r", &v(&["README.md"]), &Filter::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no files hf2q can load"), "{e}");
        let f = Filter {
            quant: Some("Q8_0".into()),
            ..Default::default()
        };
        assert!(select("r", &files, &f)
            .unwrap_err()
            .to_string()
            .contains("no .gguf"));
    }

    #[test]
    fn missing_names_absent_parts_and_shards() {
        let sel = Selection {
            files: v(&["config.json", "model.safetensors.index.json"]),
            gguf: None,
        };
        let idx = r#"{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}"#;
        let m = missing(
            &sel,
            &v(&[
                "config.json",
                "model.safetensors.index.json",
                "model-1.safetensors",
            ]),
            |_| Some(idx.into()),
        );
        assert_eq!(m, v(&["model-2.safetensors"]));
    }
}
