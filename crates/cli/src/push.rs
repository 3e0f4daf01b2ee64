//! `hf2q push PATH ORG/NAME`: a model folder, a GGUF file, an adapter folder or a dataset folder
//! to a Hub repository in one commit (the hub crate's `push`), with a model card written when
//! neither the upload nor the branch has a README.md. The card's facts come from the files
//! themselves: GGUF metadata (base model, file type), `adapter_config.json` (base model, LoRA
//! settings), `config.json` (architecture, MLX quantization). A GGUF file larger than
//! `--max-file-size` is first written as llama.cpp's gguf-split parts (`PREFIX-00001-of-0000N.gguf`,
//! `hf2q_tensor`'s `write_split`) in a temporary folder, and the parts go up in the one commit.
//! The Hub settings (endpoint, token) come from `pull::hub_config`, the one place that reads
//! them from the environment.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use hf2q_hub::card::{CardFacts, CardKind};
use hf2q_hub::{PushRequest, RepoId, RepoKind};
use hf2q_models::quantize::presets::Preset;
use hf2q_tensor::io::gguf::{split_file_name, write_split, GgufFile};
use serde_json::Value;

use crate::pull;

#[derive(clap::Args, Debug)]
pub struct PushArgs {
    /// A model folder, a GGUF file, an adapter folder (PEFT files) or a dataset folder.
    #[arg(value_name = "PATH")]
    path: PathBuf,
    /// The repository to push to, created if missing.
    #[arg(value_name = "ORG/NAME")]
    repo: String,
    /// Create the repository private (an existing one keeps its visibility).
    #[arg(long)]
    private: bool,
    /// The branch to commit to, created from the default branch if missing [default: main].
    #[arg(long, value_name = "BRANCH")]
    revision: Option<String>,
    /// The commit message [default: "Upload ORG/NAME with hf2q"].
    #[arg(long, short = 'm', value_name = "M")]
    message: Option<String>,
    /// What the repository holds.
    #[arg(long, value_name = "TYPE", default_value = "model", value_parser = ["model", "dataset"])]
    repo_type: String,
    /// A GGUF file larger than this is split into llama.cpp's gguf-split parts
    /// (`NAME-00001-of-0000N.gguf`) before the upload. K, M, G, T count powers of 1000 (as
    /// gguf-split's --split-max-size), Ki, Mi, Gi, Ti powers of 1024. The parts are written under
    /// the temporary folder (TMPDIR) and removed afterwards.
    #[arg(long, value_name = "SIZE", default_value = "20G", value_parser = parse_size)]
    max_file_size: u64,
    /// Do not write a README.md model card when there is none.
    #[arg(long)]
    no_card: bool,
    /// The access token (with write access) [default: HF_TOKEN, else the token file
    /// HF_HOME/token]. Sent to the Hub's host only.
    #[arg(long, value_name = "TOKEN")]
    hf_token: Option<String>,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
}

fn read_json(p: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
}

fn is_gguf(p: &Path) -> bool {
    p.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// `20G`, `500M`, `1.5Gi`, `4096`: a size in bytes (K, M, G, T powers of 1000; Ki, Mi, Gi, Ti
/// powers of 1024; a trailing `B` allowed).
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let at = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(at);
    let u = unit.trim().to_ascii_uppercase();
    let u = u.strip_suffix('B').unwrap_or(&u);
    let mult: u64 = match u {
        "" => 1,
        "K" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "KI" => 1 << 10,
        "MI" => 1 << 20,
        "GI" => 1 << 30,
        "TI" => 1 << 40,
        _ => {
            return Err(format!(
                "'{text}': unknown unit '{}' (use K, M, G, T or Ki, Mi, Gi, Ti, e.g. 20G or 500M)",
                unit.trim()
            ))
        }
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("'{text}' is not a size (a number with K, M, G or T, e.g. 20G)"))?;
    let bytes = v * mult as f64;
    if !(1.0..1.8e19).contains(&bytes) {
        return Err(format!("'{text}': a size of at least one byte expected"));
    }
    Ok(bytes as u64)
}

/// A folder removed with everything in it when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// When `path` is a GGUF file of more than `max` bytes: its gguf-split parts of at most `max`
/// bytes each (a tensor larger than that gets a part of its own), written to a temporary folder
/// under `tmp`, which is what gets pushed. `None` for anything else.
fn split_for_push(path: &Path, max: u64, tmp: &Path) -> Result<Option<TempDir>> {
    if !path.is_file() || !is_gguf(path) {
        return Ok(None);
    }
    let len = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    if len <= max {
        return Ok(None);
    }
    if split_file_name(path).is_some() {
        return Err(anyhow!(
            "{}: {} is more than --max-file-size {} and the file is already a part of a split \
             model: push the folder of its parts, or give a larger --max-file-size",
            path.display(),
            pull::human(len),
            pull::human(max)
        ));
    }
    let g = GgufFile::open(path).with_context(|| format!("reading {}", path.display()))?;
    // Each part's header is at most the whole file's (metadata, tensor infos, alignment) plus the
    // `split.*` keys: the tensor data a part may hold is what is left of `max`.
    let data: u64 = g.tensors.iter().map(|t| t.nbytes()).sum();
    let overhead = len.saturating_sub(data) + 1024;
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let dir = TempDir(tmp.join(format!("hf2q-split-{}-{stem}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir.0);
    std::fs::create_dir_all(&dir.0).with_context(|| format!("creating {}", dir.0.display()))?;
    let parts = write_split(&g, &dir.0.join(&stem), max.saturating_sub(overhead).max(1))
        .with_context(|| format!("splitting {} into {}", path.display(), dir.0.display()))?;
    let biggest = parts
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok().map(|m| m.len()))
        .max()
        .unwrap_or(0);
    eprintln!(
        "{}: {} split into {} parts of at most {} (--max-file-size {})",
        path.display(),
        pull::human(len),
        parts.len(),
        pull::human(biggest),
        pull::human(max)
    );
    if biggest > max {
        eprintln!(
            "warning: a tensor is larger than --max-file-size: its part has {}",
            pull::human(biggest)
        );
    }
    Ok(Some(dir))
}

/// The GGUF files of `path` (the file itself, or the folder's `.gguf` files), sorted.
fn gguf_files(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return if is_gguf(path) {
            vec![path.to_path_buf()]
        } else {
            Vec::new()
        };
    }
    let mut v: Vec<PathBuf> = std::fs::read_dir(path)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| is_gguf(p))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn str_of(v: &Value, k: &str) -> Option<String> {
    v.get(k)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(String::from)
}

/// What the card says about `path`, from its files.
pub fn card_facts(path: &Path, repo: &str, kind: RepoKind, files: Vec<String>) -> CardFacts {
    let mut f = CardFacts {
        kind: CardKind::Model,
        repo: repo.to_string(),
        base_model: None,
        quantization: None,
        settings: Vec::new(),
        files,
    };
    if kind == RepoKind::Dataset {
        f.kind = CardKind::Dataset;
        return f;
    }
    if let Some(a) = read_json(&path.join("adapter_config.json")) {
        f.kind = CardKind::Adapter;
        f.base_model = str_of(&a, "base_model_name_or_path");
        for k in [
            "peft_type",
            "r",
            "lora_alpha",
            "lora_dropout",
            "use_rslora",
            "target_modules",
        ] {
            if let Some(v) = a.get(k).filter(|v| !v.is_null()) {
                let text = match v {
                    Value::String(s) => s.clone(),
                    Value::Array(a) => a
                        .iter()
                        .map(|x| x.as_str().map(String::from).unwrap_or(x.to_string()))
                        .collect::<Vec<_>>()
                        .join(", "),
                    v => v.to_string(),
                };
                f.settings.push((k.to_string(), text));
            }
        }
        return f;
    }
    let ggufs = gguf_files(path);
    if let Some(g) = ggufs.first().and_then(|p| GgufFile::open(p).ok()) {
        f.kind = CardKind::Gguf;
        f.base_model = g
            .get_str("general.base_model.0.repo_url")
            .and_then(|u| u.split("huggingface.co/").nth(1))
            .map(String::from)
            .or_else(|| g.get_str("general.base_model.0.name").map(String::from))
            .or_else(|| g.get_str("general.name").map(String::from));
        f.quantization = g
            .get_u64("general.file_type")
            .and_then(|t| Preset::from_ftype(u32::try_from(t).ok()?))
            .map(|p| p.name().to_string());
        if let Some(a) = g.architecture() {
            f.settings.push(("architecture".into(), a.to_string()));
        }
        return f;
    }
    if let Some(c) = read_json(&path.join("config.json")) {
        f.base_model = str_of(&c, "_name_or_path").filter(|n| !n.starts_with(['/', '.']));
        if let Some(a) = c
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
        {
            f.settings.push(("architecture".into(), a.to_string()));
        }
        let q = c
            .get("quantization")
            .or_else(|| c.get("quantization_config"));
        if let Some(bits) = q.and_then(|q| q.get("bits")).and_then(Value::as_u64) {
            let group = q.and_then(|q| q.get("group_size")).and_then(Value::as_u64);
            f.quantization = Some(match group {
                Some(g) => format!("MLX affine {bits}-bit, group size {g}"),
                None => format!("{bits}-bit"),
            });
        }
    }
    f
}

/// `hf2q push`.
pub fn run(a: PushArgs) -> Result<()> {
    let kind = RepoKind::parse(&a.repo_type)
        .ok_or_else(|| anyhow!("--repo-type must be model or dataset"))?;
    let repo = RepoId::parse(&a.repo)?.of_kind(kind);
    if let Some(r) = &a.revision {
        hf2q_hub::repo::check_revision(r).map_err(|w| anyhow!("--revision: {w}"))?;
    }
    if !a.path.exists() {
        return Err(anyhow!("{}: no such file or folder", a.path.display()));
    }
    let cfg = pull::hub_config(a.hf_token, false)?;
    let split = split_for_push(&a.path, a.max_file_size, &std::env::temp_dir())?;
    let upload = split.as_ref().map_or(a.path.clone(), |d| d.0.clone());
    let files: Vec<String> = hf2q_hub::push::local_files(&upload)?
        .into_iter()
        .map(|(p, _)| p)
        .collect();
    let card = (!a.no_card)
        .then(|| hf2q_hub::card::render(&card_facts(&a.path, &a.repo, kind, files.clone())));
    eprintln!(
        "pushing {} ({} files) to {}{} on {}",
        a.path.display(),
        files.len(),
        repo.url_path(),
        a.revision
            .as_deref()
            .map(|r| format!("@{r}"))
            .unwrap_or_default(),
        cfg.endpoint
    );
    let req = PushRequest {
        path: upload,
        repo,
        revision: a.revision,
        private: a.private,
        message: a.message,
        card,
    };
    let p = hf2q_hub::push(&cfg, &req).with_context(|| format!("pushing to {}", a.repo))?;
    if a.json {
        let v = serde_json::json!({
            "repo": a.repo,
            "repo_type": kind.name(),
            "repo_url": p.repo_url,
            "commit": p.commit,
            "commit_url": p.commit_url,
            "created": p.created,
            "files": p.files,
            "lfs_files": p.lfs,
            "lfs_bytes_sent": p.lfs_bytes_sent,
            "card_added": p.card_added,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        eprintln!(
            "{}{}: {} files committed ({} through LFS, {} sent){}",
            if p.created { "created " } else { "" },
            p.repo_url,
            p.files.len(),
            p.lfs.len(),
            pull::human(p.lfs_bytes_sent),
            if p.card_added {
                ", README.md card written"
            } else {
                ""
            }
        );
        println!("{}", p.commit_url);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_with_units() {
        assert_eq!(parse_size("20G"), Ok(20_000_000_000));
        assert_eq!(parse_size("500M"), Ok(500_000_000));
        assert_eq!(parse_size("500mb"), Ok(500_000_000));
        assert_eq!(parse_size("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("20X").unwrap_err().contains("unknown unit 'X'"));
        assert!(parse_size("G").unwrap_err().contains("not a size"));
        assert!(parse_size("0").is_err());
    }

    #[test]
    fn adapter_and_mlx_facts_come_from_their_configs() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("adapter_config.json"),
            r#"{"base_model_name_or_path": "org/base", "r": 8, "lora_alpha": 16.0,
                "target_modules": ["q_proj", "v_proj"], "modules_to_save": null}"#,
        )
        .unwrap();
        let f = card_facts(d.path(), "me/lora", RepoKind::Model, vec![]);
        assert_eq!(f.kind, CardKind::Adapter);
        assert_eq!(f.base_model.as_deref(), Some("org/base"));
        assert!(f.settings.contains(&("r".into(), "8".into())));
        assert!(f
            .settings
            .contains(&("target_modules".into(), "q_proj, v_proj".into())));

        let m = tempfile::tempdir().unwrap();
        std::fs::write(
            m.path().join("config.json"),
            r#"{"architectures": ["LlamaForCausalLM"], "quantization": {"bits": 4, "group_size": 64}}"#,
        )
        .unwrap();
        let f = card_facts(m.path(), "me/mlx", RepoKind::Model, vec![]);
        assert_eq!(f.kind, CardKind::Model);
        assert_eq!(
            f.quantization.as_deref(),
            Some("MLX affine 4-bit, group size 64")
        );
        assert_eq!(
            card_facts(m.path(), "me/d", RepoKind::Dataset, vec![]).kind,
            CardKind::Dataset
        );
    }
}
