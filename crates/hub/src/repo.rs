//! Repository references: `ORG/NAME[:QUANT][@REVISION]`, checked with the Hub's naming rules
//! (letters, digits, `-`, `_`, `.`; no `--` or `..`; 96 characters at most a part) so a typo is
//! reported before any request, and the cache folder name `models--ORG--NAME` maps back.

use crate::error::{HubError, Result};

/// A repository on the Hub: `org/name`, a model unless `kind` says dataset.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RepoId {
    pub org: String,
    pub name: String,
    pub kind: RepoKind,
}

impl std::fmt::Display for RepoId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.org, self.name)
    }
}

/// A repository with the GGUF type and revision asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoRef {
    pub id: RepoId,
    /// `:Q4_K_M`: the GGUF file type (case-insensitive).
    pub quant: Option<String>,
    /// `@REV` or `--revision`: a branch, tag or commit; `main` when absent.
    pub revision: Option<String>,
}

/// What a repository holds: the Hub keeps models and datasets under different URL prefixes
/// (`/api/models/..`, `/api/datasets/..`; pages and git at `/ORG/NAME` and `/datasets/ORG/NAME`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RepoKind {
    #[default]
    Model,
    Dataset,
}

impl RepoKind {
    /// `model` or `dataset` (the `type` of `POST /api/repos/create`).
    pub fn name(self) -> &'static str {
        match self {
            RepoKind::Model => "model",
            RepoKind::Dataset => "dataset",
        }
    }

    /// `models` or `datasets`: `/api/{plural}/ORG/NAME/...`.
    pub fn plural(self) -> &'static str {
        match self {
            RepoKind::Model => "models",
            RepoKind::Dataset => "datasets",
        }
    }

    /// The path before `ORG/NAME` in page, resolve and git URLs: empty or `datasets/`.
    pub fn url_prefix(self) -> &'static str {
        match self {
            RepoKind::Model => "",
            RepoKind::Dataset => "datasets/",
        }
    }

    pub fn parse(s: &str) -> Option<RepoKind> {
        match s {
            "model" => Some(RepoKind::Model),
            "dataset" => Some(RepoKind::Dataset),
            _ => None,
        }
    }
}

/// The revision used when none is given.
pub const DEFAULT_REVISION: &str = "main";

impl RepoId {
    pub fn parse(s: &str) -> Result<Self> {
        let bad = |why: &str| HubError::InvalidRepo {
            name: s.to_string(),
            why: why.to_string(),
        };
        let (org, name) = s
            .split_once('/')
            .ok_or_else(|| bad("no '/' between ORG and NAME"))?;
        if name.contains('/') {
            return Err(bad("more than one '/'"));
        }
        check_part(org).map_err(|w| bad(&format!("ORG {w}")))?;
        check_part(name).map_err(|w| bad(&format!("NAME {w}")))?;
        Ok(RepoId {
            org: org.to_string(),
            name: name.to_string(),
            kind: RepoKind::Model,
        })
    }

    /// The same name as a repository of `kind`.
    pub fn of_kind(mut self, kind: RepoKind) -> Self {
        self.kind = kind;
        self
    }

    /// `models--ORG--NAME` or `datasets--ORG--NAME`, the cache folder of huggingface_hub.
    pub fn folder_name(&self) -> String {
        format!("{}--{}--{}", self.kind.plural(), self.org, self.name)
    }

    /// The inverse of [`RepoId::folder_name`] (`None` for other folders).
    pub fn from_folder_name(folder: &str) -> Option<Self> {
        let (kind, rest) = folder.split_once("--")?;
        let kind = [RepoKind::Model, RepoKind::Dataset]
            .into_iter()
            .find(|k| k.plural() == kind)?;
        let (org, name) = rest.split_once("--")?;
        RepoId::parse(&format!("{org}/{name}"))
            .ok()
            .map(|r| r.of_kind(kind))
    }

    /// `ORG/NAME` with the URL prefix of its kind (`datasets/ORG/NAME`): the repository's path in
    /// page, resolve and git URLs.
    pub fn url_path(&self) -> String {
        format!("{}{self}", self.kind.url_prefix())
    }
}

impl RepoRef {
    /// Parses `ORG/NAME`, `ORG/NAME:QUANT`, `ORG/NAME@REV` (or both, `:QUANT@REV`); a leading
    /// `hf.co/` or `https://huggingface.co/` is dropped, as the names people copy from a page.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = |why: &str| HubError::InvalidRepo {
            name: s.to_string(),
            why: why.to_string(),
        };
        let mut t = s.trim();
        for prefix in ["https://", "http://"] {
            if let Some(r) = t.strip_prefix(prefix) {
                t = r;
            }
        }
        for prefix in ["huggingface.co/", "hf.co/"] {
            if let Some(r) = t.strip_prefix(prefix) {
                t = r;
            }
        }
        let (t, revision) = match t.split_once('@') {
            Some((a, r)) => {
                check_revision(r).map_err(|w| bad(&w))?;
                (a, Some(r.to_string()))
            }
            None => (t, None),
        };
        let (t, quant) = match t.split_once(':') {
            Some((a, q)) => {
                if q.is_empty()
                    || q.len() > 32
                    || !q.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                {
                    return Err(bad(
                        "QUANT after ':' must be a GGUF type such as Q4_K_M or Q8_0",
                    ));
                }
                (a, Some(q.to_string()))
            }
            None => (t, None),
        };
        let id = RepoId::parse(t).map_err(|e| match e {
            HubError::InvalidRepo { why, .. } => bad(&why),
            e => e,
        })?;
        Ok(RepoRef {
            id,
            quant,
            revision,
        })
    }

    /// The revision asked for, `main` when none.
    pub fn revision(&self) -> &str {
        self.revision.as_deref().unwrap_or(DEFAULT_REVISION)
    }
}

impl std::fmt::Display for RepoRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.id)?;
        if let Some(q) = &self.quant {
            write!(f, ":{q}")?;
        }
        if let Some(r) = &self.revision {
            write!(f, "@{r}")?;
        }
        Ok(())
    }
}

fn check_part(p: &str) -> std::result::Result<(), String> {
    if p.is_empty() {
        return Err("is empty".into());
    }
    if p.len() > 96 {
        return Err("is longer than 96 characters".into());
    }
    if let Some(c) = p
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!(
            "has '{c}' (only letters, digits, '-', '_' and '.' are allowed)"
        ));
    }
    if p.contains("--") || p.contains("..") {
        return Err("has '--' or '..'".into());
    }
    if p.starts_with(['-', '.']) || p.ends_with(['-', '.']) {
        return Err("starts or ends with '-' or '.'".into());
    }
    Ok(())
}

/// A branch, tag or commit name: not empty, no whitespace, no `..`, not an absolute path.
pub fn check_revision(r: &str) -> std::result::Result<(), String> {
    if r.is_empty() {
        return Err("the revision after '@' is empty".into());
    }
    if r.contains("..")
        || r.starts_with('/')
        || r.ends_with('/')
        || r.chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '\\')
    {
        return Err(format!("'{r}' is not a branch, tag or commit name"));
    }
    Ok(())
}

/// A full commit hash (40 lowercase hex digits), which needs no ref to resolve.
pub fn is_commit(r: &str) -> bool {
    r.len() == 40
        && r.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_quants_and_revisions() {
        let r = RepoRef::parse("Qwen/Qwen2.5-0.5B-Instruct-GGUF:q8_0@v1.0").unwrap();
        assert_eq!(r.id.to_string(), "Qwen/Qwen2.5-0.5B-Instruct-GGUF");
        assert_eq!(r.quant.as_deref(), Some("q8_0"));
        assert_eq!(r.revision(), "v1.0");
        let r = RepoRef::parse("hf.co/org/name").unwrap();
        assert_eq!(
            (r.id.org.as_str(), r.quant.as_deref(), r.revision()),
            ("org", None, "main")
        );
        assert_eq!(
            RepoRef::parse("https://huggingface.co/a/b")
                .unwrap()
                .id
                .name,
            "b"
        );
        assert_eq!(r.id.folder_name(), "models--org--name");
        assert_eq!(
            RepoId::from_folder_name("models--org--name"),
            Some(r.id.clone())
        );
        let ds = r.id.of_kind(RepoKind::Dataset);
        assert_eq!(ds.folder_name(), "datasets--org--name");
        assert_eq!(ds.url_path(), "datasets/org/name");
        assert_eq!(RepoId::from_folder_name("datasets--org--name"), Some(ds));
        assert_eq!(RepoId::from_folder_name("spaces--org--name"), None);
    }

    #[test]
    fn refuses_bad_names_with_the_reason() {
        for (s, why) in [
            ("noslash", "no '/'"),
            ("a/b/c", "more than one"),
            ("a/b c", "has ' '"),
            ("a/b--c", "'--'"),
            ("-a/b", "starts or ends"),
            ("a/b:", "QUANT"),
            ("a/b@", "empty"),
            ("/b", "ORG is empty"),
        ] {
            let e = RepoRef::parse(s).unwrap_err().to_string();
            assert!(e.contains(why), "{s}: {e}");
        }
    }
}
