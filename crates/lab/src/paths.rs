//! Every path a job reads or writes, kept inside `$HF2Q_HOME`: names are relative, with no `..`
//! and no absolute or rooted part, and what they reach is canonicalized (symlinks resolved) and
//! checked to lie under the canonical home. Not here: which folder a kind writes into
//! ([`crate::kinds`]).

use std::path::{Component, Path, PathBuf};

use crate::{Error, Result};

#[derive(Clone, Debug)]
pub struct Home {
    /// Canonical.
    root: PathBuf,
}

impl Home {
    /// The home folder (created if missing).
    pub fn new(root: &Path) -> Result<Home> {
        std::fs::create_dir_all(root).map_err(|e| Error::io(root, e))?;
        let root = root.canonicalize().map_err(|e| Error::io(root, e))?;
        Ok(Home { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `name` relative to the home, as a path string for the API.
    pub fn relative(&self, p: &Path) -> String {
        p.strip_prefix(&self.root)
            .unwrap_or(p)
            .display()
            .to_string()
    }

    /// A relative name made only of normal parts.
    fn check_name(param: &str, name: &str) -> Result<PathBuf> {
        if name.is_empty() {
            return Err(Error::path(param, "the name is empty"));
        }
        if name.contains('\0') {
            return Err(Error::path(param, "the name contains a NUL byte"));
        }
        let p = Path::new(name);
        for c in p.components() {
            match c {
                Component::Normal(_) => {}
                Component::CurDir => {}
                Component::ParentDir => {
                    return Err(Error::path(
                        param,
                        format!("'{name}' leaves $HF2Q_HOME (..)"),
                    ))
                }
                Component::RootDir | Component::Prefix(_) => {
                    return Err(Error::path(
                        param,
                        format!("'{name}' is absolute: give a name relative to $HF2Q_HOME"),
                    ))
                }
            }
        }
        Ok(p.to_path_buf())
    }

    fn inside(&self, param: &str, name: &str, canonical: &Path) -> Result<()> {
        if canonical.starts_with(&self.root) {
            Ok(())
        } else {
            Err(Error::path(
                param,
                format!("'{name}' resolves outside $HF2Q_HOME (a symbolic link pointing out?)"),
            ))
        }
    }

    /// An existing file or folder `base/name` (canonical), inside the home.
    pub fn existing(&self, param: &str, base: &str, name: &str) -> Result<PathBuf> {
        let rel = Self::check_name(param, name)?;
        let p = self.root.join(base).join(rel);
        let c = p.canonicalize().map_err(|e| {
            Error::path(
                param,
                format!("'{name}' cannot be read under $HF2Q_HOME/{base}: {e}"),
            )
        })?;
        self.inside(param, name, &c)?;
        Ok(c)
    }

    /// A new path `base/name` for an output: its folder is created (inside the home) and
    /// nothing may exist at the name itself, not even a dangling symbolic link.
    pub fn new_output(&self, param: &str, base: &str, name: &str) -> Result<PathBuf> {
        let rel = Self::check_name(param, name)?;
        let p = self.root.join(base).join(&rel);
        let file = p
            .file_name()
            .ok_or_else(|| Error::path(param, format!("'{name}' names no file")))?
            .to_owned();
        if file.to_string_lossy().starts_with('.') {
            return Err(Error::path(
                param,
                format!("'{name}': output names may not start with '.'"),
            ));
        }
        let parent = p.parent().unwrap_or(&self.root);
        // Check before creating anything: an existing part of the parent may be a link out.
        let mut probe = parent.to_path_buf();
        while !probe.exists() {
            match probe.parent() {
                Some(up) => probe = up.to_path_buf(),
                None => break,
            }
        }
        let c = probe.canonicalize().map_err(|e| Error::io(&probe, e))?;
        self.inside(param, name, &c)?;
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        let parent = parent.canonicalize().map_err(|e| Error::io(parent, e))?;
        self.inside(param, name, &parent)?;
        let out = parent.join(file);
        if std::fs::symlink_metadata(&out).is_ok() {
            return Err(Error::path(
                param,
                format!("'{name}' already exists under $HF2Q_HOME/{base}; choose another name or delete it"),
            ));
        }
        Ok(out)
    }
}

/// The temporary name a job writes an output to: `.NAME.partial-ID` beside it. Dot-names are
/// never listed as models or outputs.
pub fn partial(out: &Path, job: i64) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    out.with_file_name(format!(".{name}.partial-{job}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_leaving_the_home_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret.txt"), "x").unwrap();
        let h = Home::new(&d.path().join("home")).unwrap();
        std::fs::create_dir_all(h.root().join("data")).unwrap();
        std::fs::write(h.root().join("data/ok.txt"), "x").unwrap();
        std::os::unix::fs::symlink(outside.path(), h.root().join("data/out")).unwrap();
        assert!(h.existing("file", "data", "ok.txt").is_ok());
        for bad in ["../x", "a/../../x", "/etc/passwd", "out/secret.txt", ""] {
            assert!(h.existing("file", "data", bad).is_err(), "{bad}");
        }
        assert!(h.new_output("output", "data", "new.txt").is_ok());
        for bad in ["ok.txt", "out/new.txt", "../new.txt", "/tmp/new", ".hidden"] {
            assert!(h.new_output("output", "data", bad).is_err(), "{bad}");
        }
    }
}
