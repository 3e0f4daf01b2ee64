//! The Hub access token the Lab's jobs use: the file `$HF2Q_HOME/hub_token`, written with
//! rights 0600 at a temporary name and renamed, so a reader sees the old token or the new one.
//! The runner gives it to every child as `HF_TOKEN` in its environment (never in an argv);
//! the Hub client sends it to the Hub's host only. Nothing here returns it over HTTP: the
//! server answers only whether one is set.
//!
//! Not here: the Hub itself (the `hf2q push` child), the settings page.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The file's name in the home.
pub const FILE: &str = "hub_token";

/// The longest token taken (the Hub's are ~40 characters).
const MAX_LEN: usize = 1024;

pub fn path(home: &Path) -> PathBuf {
    home.join(FILE)
}

/// A token as the Hub issues them: printable ASCII without spaces, not empty.
fn check(token: &str) -> Result<&str> {
    let t = token.trim();
    if t.is_empty() {
        return Err(Error::param("token", "is empty"));
    }
    if t.len() > MAX_LEN {
        return Err(Error::param(
            "token",
            format!("is longer than {MAX_LEN} characters"),
        ));
    }
    if !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::param(
            "token",
            "may hold only printable ASCII characters without spaces",
        ));
    }
    Ok(t)
}

/// Stores `token` (checked) as the home's token, rights 0600.
pub fn store(home: &Path, token: &str) -> Result<()> {
    let t = check(token)?;
    let dest = path(home);
    let tmp = home.join(format!(".{FILE}.tmp-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        // A temporary left by a crash may have other rights: set them before writing.
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        f.write_all(t.as_bytes())?;
        f.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(&tmp, e));
    }
    std::fs::rename(&tmp, &dest).map_err(|e| Error::io(&dest, e))
}

/// Removes the home's token (none stored is no error).
pub fn clear(home: &Path) -> Result<()> {
    let p = path(home);
    match std::fs::remove_file(&p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(&p, e)),
    }
}

/// The stored token, if one is there and readable.
pub fn read(home: &Path) -> Option<String> {
    let t = std::fs::read_to_string(path(home)).ok()?;
    check(&t).ok().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_with_owner_only_rights_and_clears() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(read(d.path()), None);
        store(d.path(), "  hf_abc123\n").unwrap();
        assert_eq!(read(d.path()).as_deref(), Some("hf_abc123"));
        let mode = std::fs::metadata(path(d.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        store(d.path(), "hf_new").unwrap();
        assert_eq!(read(d.path()).as_deref(), Some("hf_new"));
        for bad in ["", "  ", "hf abc", "hf_\u{e9}"] {
            assert!(store(d.path(), bad).is_err(), "{bad:?}");
        }
        assert_eq!(read(d.path()).as_deref(), Some("hf_new"));
        clear(d.path()).unwrap();
        clear(d.path()).unwrap();
        assert_eq!(read(d.path()), None);
        // No temporary left behind.
        let names: Vec<_> = std::fs::read_dir(d.path()).unwrap().flatten().collect();
        assert!(names.is_empty(), "{names:?}");
    }
}
