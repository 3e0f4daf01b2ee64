//! The agent's file tools, confined to one workspace folder: `list_dir`, `read_file` (a line
//! range), `search` (a regular expression over files), `write_file` and `edit_file` (one exact
//! replacement), and the previews an approval shows (the exact change as a unified diff).
//!
//! Confinement ([`Workspace::resolve`]): paths are relative to the root (a leading `/` is
//! taken as the root itself, never the machine's); a `..` component is refused outright; the
//! path's longest existing ancestor is canonicalised (symlinks resolved) and must lie inside
//! the canonical root, and so must the target itself when it exists. A symlink inside the
//! workspace that points outside is therefore refused, for reading and for writing. Writes go
//! to the resolved path, so a link swapped in between the check and the write can only point
//! where a just-checked parent does (a workspace is a person's own folder, not an adversary's:
//! this closes mistakes and model-written escapes, not a race against a local attacker).
//!
//! What it is not: a sandbox for commands (those run with the server's rights, in the root:
//! [`super::exec`]), or a general file API.

use std::fs;
use std::path::{Component, Path, PathBuf};

use super::{ToolError, ToolResult};

/// Most bytes a tool reads from one file.
pub const MAX_READ_BYTES: usize = 1 << 20;
/// Most lines `read_file` returns at once, and most matches `search` reports.
pub const MAX_LINES: usize = 2000;
/// Most entries `list_dir` returns.
pub const MAX_ENTRIES: usize = 1000;
/// Most bytes `write_file` / `edit_file` write.
pub const MAX_WRITE_BYTES: usize = 4 << 20;

/// The workspace root, canonical.
#[derive(Clone, Debug)]
pub struct Workspace {
    root: PathBuf,
}

impl Workspace {
    /// Opens `dir` (which must exist and be a folder) as the root.
    pub fn open(dir: &Path) -> std::io::Result<Workspace> {
        let root = dir.canonicalize()?;
        if !root.is_dir() {
            return Err(std::io::Error::other(format!(
                "{} is not a folder",
                root.display()
            )));
        }
        Ok(Workspace { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The absolute path for `rel`, checked to stay inside the root (see the module docs).
    pub fn resolve(&self, rel: &str) -> Result<PathBuf, ToolError> {
        let refuse = |why: &str| ToolError::Refused(format!("path '{rel}' {why}"));
        if rel.contains('\0') {
            return Err(refuse("contains a NUL byte"));
        }
        let mut joined = self.root.clone();
        for c in Path::new(rel).components() {
            match c {
                Component::Normal(p) => joined.push(p),
                Component::CurDir | Component::RootDir => {}
                Component::ParentDir => return Err(refuse("leaves the workspace ('..')")),
                Component::Prefix(_) => return Err(refuse("is not a workspace path")),
            }
        }
        // The longest existing ancestor, with its symlinks resolved.
        let mut existing = joined.as_path();
        let mut rest: Vec<&std::ffi::OsStr> = Vec::new();
        while fs::symlink_metadata(existing).is_err() {
            match (existing.parent(), existing.file_name()) {
                (Some(p), Some(n)) => {
                    rest.push(n);
                    existing = p;
                }
                _ => return Err(refuse("does not exist")),
            }
        }
        let mut real = existing
            .canonicalize()
            .map_err(|e| ToolError::Failed(format!("{rel}: {e}")))?;
        if !real.starts_with(&self.root) {
            return Err(refuse("leads outside the workspace (a symbolic link)"));
        }
        for n in rest.into_iter().rev() {
            real.push(n);
        }
        Ok(real)
    }

    /// Workspace-relative display form of an absolute path inside the root.
    fn rel(&self, p: &Path) -> String {
        let r = p.strip_prefix(&self.root).unwrap_or(p);
        let s = r.to_string_lossy().to_string();
        if s.is_empty() {
            ".".into()
        } else {
            s
        }
    }

    pub fn list_dir(&self, rel: &str) -> ToolResult {
        let dir = self.resolve(rel)?;
        let entries = fs::read_dir(&dir).map_err(|e| ToolError::Failed(format!("{rel}: {e}")))?;
        let mut names: Vec<String> = Vec::new();
        for e in entries.flatten() {
            let ty = e.file_type().ok();
            let mut n = e.file_name().to_string_lossy().to_string();
            if ty.is_some_and(|t| t.is_dir()) {
                n.push('/');
            } else if ty.is_some_and(|t| t.is_symlink()) {
                n.push('@');
            }
            names.push(n);
        }
        names.sort();
        let total = names.len();
        names.truncate(MAX_ENTRIES);
        let mut out = names.join("\n");
        if total > MAX_ENTRIES {
            out.push_str(&format!("\n... ({} more entries)", total - MAX_ENTRIES));
        }
        if total == 0 {
            out = "(empty folder)".into();
        }
        Ok(out)
    }

    fn read_text(&self, path: &Path, rel: &str) -> Result<String, ToolError> {
        let meta = fs::metadata(path).map_err(|e| ToolError::Failed(format!("{rel}: {e}")))?;
        if !meta.is_file() {
            return Err(ToolError::Failed(format!("{rel} is not a file")));
        }
        if meta.len() as usize > MAX_READ_BYTES {
            return Err(ToolError::Failed(format!(
                "{rel} is {} bytes; at most {MAX_READ_BYTES} are read",
                meta.len()
            )));
        }
        let bytes = fs::read(path).map_err(|e| ToolError::Failed(format!("{rel}: {e}")))?;
        String::from_utf8(bytes).map_err(|_| ToolError::Failed(format!("{rel} is not UTF-8 text")))
    }

    /// Lines `start..=end` (1-based; defaults: the whole file, at most [`MAX_LINES`]), each
    /// prefixed with its number.
    pub fn read_file(&self, rel: &str, start: Option<usize>, end: Option<usize>) -> ToolResult {
        let path = self.resolve(rel)?;
        let text = self.read_text(&path, rel)?;
        let lines: Vec<&str> = text.lines().collect();
        let start = start.unwrap_or(1).max(1);
        let end = end
            .unwrap_or(lines.len())
            .min(lines.len())
            .min(start + MAX_LINES - 1);
        if lines.is_empty() {
            return Ok("(empty file)".into());
        }
        if start > lines.len() || start > end {
            return Err(ToolError::Failed(format!(
                "{rel} has {} lines; lines {start}..{end} are outside it",
                lines.len()
            )));
        }
        let mut out: Vec<String> = (start..=end)
            .map(|i| format!("{i}: {}", lines[i - 1]))
            .collect();
        if end < lines.len() {
            out.push(format!("... ({} more lines)", lines.len() - end));
        }
        Ok(out.join("\n"))
    }

    /// Lines matching `pattern` (a regular expression) in the files under `rel`, as
    /// `path:line: text`; hidden folders (`.git`, ...) are skipped.
    pub fn search(&self, pattern: &str, rel: &str) -> ToolResult {
        let re = regex::RegexBuilder::new(pattern)
            .size_limit(1 << 20)
            .build()
            .map_err(|e| ToolError::Failed(format!("bad regular expression: {e}")))?;
        let start = self.resolve(rel)?;
        let mut hits: Vec<String> = Vec::new();
        let mut stack = vec![start];
        let mut files = 0usize;
        while let Some(p) = stack.pop() {
            if hits.len() >= MAX_LINES || files > 10_000 {
                break;
            }
            let Ok(meta) = fs::symlink_metadata(&p) else {
                continue;
            };
            if meta.is_dir() {
                let Ok(rd) = fs::read_dir(&p) else { continue };
                let mut kids: Vec<PathBuf> = rd
                    .flatten()
                    .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
                    .map(|e| e.path())
                    .collect();
                kids.sort();
                stack.extend(kids.into_iter().rev());
            } else if meta.is_file() && (meta.len() as usize) <= MAX_READ_BYTES {
                files += 1;
                let Ok(text) = fs::read_to_string(&p) else {
                    continue;
                };
                for (i, line) in text.lines().enumerate() {
                    if re.is_match(line) {
                        hits.push(format!("{}:{}: {line}", self.rel(&p), i + 1));
                        if hits.len() >= MAX_LINES {
                            break;
                        }
                    }
                }
            }
            // Symbolic links are not followed (they may lead outside).
        }
        Ok(if hits.is_empty() {
            "(no matches)".into()
        } else {
            hits.join("\n")
        })
    }

    /// What `write_file` would change, as a unified diff (the approval's preview).
    pub fn preview_write(&self, rel: &str, content: &str) -> ToolResult {
        let path = self.resolve(rel)?;
        let old = if path.exists() {
            Some(self.read_text(&path, rel)?)
        } else {
            None
        };
        Ok(diff(rel, old.as_deref(), content))
    }

    pub fn write_file(&self, rel: &str, content: &str) -> ToolResult {
        if content.len() > MAX_WRITE_BYTES {
            return Err(ToolError::Failed(format!(
                "the content is {} bytes; at most {MAX_WRITE_BYTES} are written",
                content.len()
            )));
        }
        let path = self.resolve(rel)?;
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| ToolError::Failed(format!("{rel}: {e}")))?;
        }
        fs::write(&path, content).map_err(|e| ToolError::Failed(format!("{rel}: {e}")))?;
        Ok(format!(
            "wrote {} bytes to {}",
            content.len(),
            self.rel(&path)
        ))
    }

    /// The file after replacing the one occurrence of `old` by `new`.
    fn edited(
        &self,
        rel: &str,
        old: &str,
        new: &str,
    ) -> Result<(PathBuf, String, String), ToolError> {
        if old.is_empty() {
            return Err(ToolError::Failed("old_text must not be empty".into()));
        }
        let path = self.resolve(rel)?;
        let text = self.read_text(&path, rel)?;
        match text.matches(old).count() {
            0 => Err(ToolError::Failed(format!(
                "old_text does not occur in {rel}"
            ))),
            1 => {
                let after = text.replacen(old, new, 1);
                Ok((path, text, after))
            }
            n => Err(ToolError::Failed(format!(
                "old_text occurs {n} times in {rel}; give more context so that it occurs once"
            ))),
        }
    }

    pub fn preview_edit(&self, rel: &str, old: &str, new: &str) -> ToolResult {
        let (_, before, after) = self.edited(rel, old, new)?;
        Ok(diff(rel, Some(&before), &after))
    }

    pub fn edit_file(&self, rel: &str, old: &str, new: &str) -> ToolResult {
        let (path, _, after) = self.edited(rel, old, new)?;
        fs::write(&path, &after).map_err(|e| ToolError::Failed(format!("{rel}: {e}")))?;
        Ok(format!("edited {}", self.rel(&path)))
    }
}

/// A unified diff of `old` (none: a new file) against `new`, one hunk around the changed
/// lines (common first and last lines trimmed; three lines of context).
pub fn diff(name: &str, old: Option<&str>, new: &str) -> String {
    let a: Vec<&str> = old.map(|o| o.lines().collect()).unwrap_or_default();
    let b: Vec<&str> = new.lines().collect();
    let head = if old.is_some() {
        format!("--- a/{name}\n+++ b/{name}\n")
    } else {
        format!("--- /dev/null\n+++ b/{name}\n")
    };
    let pre = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let post = a[pre..]
        .iter()
        .rev()
        .zip(b[pre..].iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    if pre == a.len() && pre == b.len() && old.is_some() {
        return format!("{head}(no change)\n");
    }
    let ctx = 3;
    let s = pre.saturating_sub(ctx);
    let (ea, eb) = (
        (a.len() - post + ctx).min(a.len()),
        (b.len() - post + ctx).min(b.len()),
    );
    let mut out = head;
    out.push_str(&format!(
        "@@ -{},{} +{},{} @@\n",
        if ea > s { s + 1 } else { s },
        ea - s,
        if eb > s { s + 1 } else { s },
        eb - s
    ));
    for l in &a[s..pre] {
        out.push_str(&format!(" {l}\n"));
    }
    for l in &a[pre..a.len() - post] {
        out.push_str(&format!("-{l}\n"));
    }
    for l in &b[pre..b.len() - post] {
        out.push_str(&format!("+{l}\n"));
    }
    for l in &a[a.len() - post..ea] {
        out.push_str(&format!(" {l}\n"));
    }
    out
}
