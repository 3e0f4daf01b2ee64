//! The shared cache in huggingface_hub's layout, so Python's `huggingface_hub`, llama.cpp and
//! hf2q find each other's downloads:
//!
//! ```text
//! ROOT/models--ORG--NAME/
//!   blobs/<etag>                    the file's bytes, named by its ETag (sha256 for LFS files)
//!   blobs/<etag>.incomplete         a download in progress (resumed from its length)
//!   snapshots/<commit>/<path>       relative symlink -> ../../blobs/<etag>
//!   refs/<revision>                 the commit a branch or tag pointed to when last pulled
//! ```
//!
//! The root comes from [`default_root`], given the values of `HF_HUB_CACHE`, `HF_HOME` and the
//! home folder by the binary: library code reads no environment variables. Every write goes to
//! a temporary name and is renamed into place, so a name in `blobs/`, `snapshots/` or `refs/`
//! is always whole.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{IoContext, Result};
use crate::repo::{is_commit, RepoId};

/// The cache root: `hf_hub_cache`, else `hf_home/hub`, else `home/.cache/huggingface/hub`
/// (huggingface_hub's order). Empty values count as unset.
pub fn default_root(
    hf_hub_cache: Option<PathBuf>,
    hf_home: Option<PathBuf>,
    home: Option<PathBuf>,
) -> Option<PathBuf> {
    let set = |p: Option<PathBuf>| p.filter(|p| !p.as_os_str().is_empty());
    set(hf_hub_cache)
        .or_else(|| set(hf_home.clone()).map(|h| h.join("hub")))
        .or_else(|| set(home).map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// `HF_HOME`, else `home/.cache/huggingface`: where huggingface_hub keeps its `token` file.
pub fn default_hf_home(hf_home: Option<PathBuf>, home: Option<PathBuf>) -> Option<PathBuf> {
    hf_home.filter(|p| !p.as_os_str().is_empty()).or_else(|| {
        home.filter(|p| !p.as_os_str().is_empty())
            .map(|h| h.join(".cache").join("huggingface"))
    })
}

/// The token stored by `hf auth login` (`HF_HOME/token`), trimmed; `None` when absent or empty.
pub fn read_token_file(hf_home: &Path) -> Option<String> {
    let t = fs::read_to_string(hf_home.join("token")).ok()?;
    let t = t.trim();
    (!t.is_empty()).then(|| t.to_string())
}

/// A cache root.
#[derive(Clone, Debug)]
pub struct Cache {
    root: PathBuf,
}

/// One repository in the cache, for `pull --list`.
#[derive(Clone, Debug)]
pub struct CachedRepo {
    pub id: RepoId,
    pub dir: PathBuf,
    /// Bytes of all its blobs.
    pub size: u64,
    pub revisions: Vec<CachedRevision>,
}

#[derive(Clone, Debug)]
pub struct CachedRevision {
    pub commit: String,
    /// The refs (branches, tags) pointing at it.
    pub refs: Vec<String>,
    pub files: usize,
    /// Bytes of the blobs its files link to.
    pub size: u64,
}

/// What [`Cache::remove`] took away.
#[derive(Clone, Debug, Default)]
pub struct Removed {
    pub snapshots: Vec<String>,
    pub blobs: usize,
    pub bytes: u64,
}

/// A temporary name beside `p`, unique to this process and call (pulls may run on threads).
fn tmp_name(p: &Path) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    p.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()))
}

impl Cache {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Cache { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn repo_dir(&self, id: &RepoId) -> PathBuf {
        self.root.join(id.folder_name())
    }

    pub fn blob_path(&self, id: &RepoId, etag: &str) -> PathBuf {
        self.repo_dir(id).join("blobs").join(etag)
    }

    pub fn incomplete_path(&self, id: &RepoId, etag: &str) -> PathBuf {
        self.repo_dir(id)
            .join("blobs")
            .join(format!("{etag}.incomplete"))
    }

    pub fn snapshot_dir(&self, id: &RepoId, commit: &str) -> PathBuf {
        self.repo_dir(id).join("snapshots").join(commit)
    }

    /// Holds huggingface_hub's lock of one blob (`ROOT/.locks/models--ORG--NAME/<etag>.lock`,
    /// an exclusive `flock` as its `filelock` takes), so concurrent pulls of the same file, by
    /// hf2q or by Python, wait for each other instead of writing one `.incomplete` together.
    /// Released when the returned file is dropped.
    pub fn lock_blob(&self, id: &RepoId, etag: &str) -> Result<fs::File> {
        let dir = self.root.join(".locks").join(id.folder_name());
        fs::create_dir_all(&dir).at(&dir)?;
        let path = dir.join(format!("{etag}.lock"));
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .at(&path)?;
        f.lock().at(&path)?;
        Ok(f)
    }

    /// The commit `refs/<revision>` names, if the cache has it.
    pub fn read_ref(&self, id: &RepoId, revision: &str) -> Option<String> {
        let s = fs::read_to_string(self.repo_dir(id).join("refs").join(revision)).ok()?;
        let s = s.trim();
        is_commit(s).then(|| s.to_string())
    }

    /// The commit a revision resolves to in the cache: its ref, or itself when it is a commit
    /// with a snapshot.
    pub fn resolve(&self, id: &RepoId, revision: &str) -> Option<String> {
        if let Some(c) = self.read_ref(id, revision) {
            return Some(c);
        }
        (is_commit(revision) && self.snapshot_dir(id, revision).is_dir())
            .then(|| revision.to_string())
    }

    /// Writes `refs/<revision>` = `commit` (temporary name, then rename).
    pub fn write_ref(&self, id: &RepoId, revision: &str, commit: &str) -> Result<()> {
        let path = self.repo_dir(id).join("refs").join(revision);
        let dir = path.parent().expect("a ref has a folder");
        fs::create_dir_all(dir).at(dir)?;
        let tmp = tmp_name(&path);
        fs::write(&tmp, commit).at(&tmp)?;
        fs::rename(&tmp, &path).at(&path)
    }

    /// Links `snapshots/<commit>/<path>` to `blobs/<etag>` with a relative symlink, as
    /// huggingface_hub does (a copy where the file system has no symlinks).
    pub fn link(&self, id: &RepoId, commit: &str, path: &str, etag: &str) -> Result<PathBuf> {
        let dest = self.snapshot_dir(id, commit).join(path);
        let dir = dest.parent().expect("a snapshot file has a folder");
        fs::create_dir_all(dir).at(dir)?;
        let depth = path.split('/').count() + 1; // snapshots/<commit>/ plus the path's folders
        let mut target = PathBuf::new();
        for _ in 0..depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(etag);
        let tmp = tmp_name(&dest);
        let _ = fs::remove_file(&tmp);
        #[cfg(unix)]
        std::os::unix::fs::symlink(&target, &tmp).at(&tmp)?;
        #[cfg(not(unix))]
        fs::copy(self.blob_path(id, etag), &tmp)
            .at(&tmp)
            .map(|_| ())?;
        fs::rename(&tmp, &dest).at(&dest)?;
        Ok(dest)
    }

    /// The files of a snapshot whose links resolve (relative paths with `/`), sorted.
    pub fn snapshot_files(&self, id: &RepoId, commit: &str) -> Vec<String> {
        let mut out = Vec::new();
        walk(&self.snapshot_dir(id, commit), "", &mut out);
        out.sort();
        out
    }

    /// Every repository in the cache with its revisions and sizes, sorted by name.
    pub fn list(&self) -> Result<Vec<CachedRepo>> {
        let mut repos = Vec::new();
        let entries = match fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(repos),
            Err(e) => return Err(crate::error::HubError::io(&self.root, e)),
        };
        for e in entries.flatten() {
            let Some(id) = RepoId::from_folder_name(&e.file_name().to_string_lossy()) else {
                continue;
            };
            let dir = e.path();
            let blob_sizes = blob_sizes(&dir.join("blobs"));
            let mut refs: BTreeMap<String, Vec<String>> = BTreeMap::new();
            let mut ref_files = Vec::new();
            walk(&dir.join("refs"), "", &mut ref_files);
            for r in ref_files {
                if let Some(c) = self.read_ref(&id, &r) {
                    refs.entry(c).or_default().push(r);
                }
            }
            let mut revisions = Vec::new();
            for s in fs::read_dir(dir.join("snapshots"))
                .into_iter()
                .flatten()
                .flatten()
            {
                let commit = s.file_name().to_string_lossy().into_owned();
                let linked = linked_blobs(&s.path());
                revisions.push(CachedRevision {
                    refs: refs.remove(&commit).unwrap_or_default(),
                    files: self.snapshot_files(&id, &commit).len(),
                    size: linked.iter().filter_map(|b| blob_sizes.get(b)).sum(),
                    commit,
                });
            }
            revisions.sort_by(|a, b| a.commit.cmp(&b.commit));
            repos.push(CachedRepo {
                size: blob_sizes.values().sum(),
                id,
                dir,
                revisions,
            });
        }
        repos.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(repos)
    }

    /// Removes a repository (`revision` `None`), or one revision: its snapshot, the refs that
    /// point at it, and the blobs no remaining snapshot links to.
    pub fn remove(&self, id: &RepoId, revision: Option<&str>) -> Result<Option<Removed>> {
        let dir = self.repo_dir(id);
        if !dir.is_dir() {
            return Ok(None);
        }
        let mut removed = Removed::default();
        let Some(revision) = revision else {
            let sizes = blob_sizes(&dir.join("blobs"));
            removed.blobs = sizes.len();
            removed.bytes = sizes.values().sum();
            removed.snapshots = fs::read_dir(dir.join("snapshots"))
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            fs::remove_dir_all(&dir).at(&dir)?;
            return Ok(Some(removed));
        };
        let Some(commit) = self.resolve(id, revision) else {
            return Ok(None);
        };
        let snap = self.snapshot_dir(id, &commit);
        if snap.exists() {
            fs::remove_dir_all(&snap).at(&snap)?;
        }
        removed.snapshots.push(commit.clone());
        let mut ref_files = Vec::new();
        walk(&dir.join("refs"), "", &mut ref_files);
        for r in ref_files {
            if self.read_ref(id, &r).as_deref() == Some(commit.as_str()) {
                let p = dir.join("refs").join(&r);
                fs::remove_file(&p).at(&p)?;
            }
        }
        let mut keep = BTreeSet::new();
        for s in fs::read_dir(dir.join("snapshots"))
            .into_iter()
            .flatten()
            .flatten()
        {
            keep.extend(linked_blobs(&s.path()));
        }
        for (blob, size) in blob_sizes(&dir.join("blobs")) {
            if !keep.contains(&blob) {
                let p = dir.join("blobs").join(&blob);
                fs::remove_file(&p).at(&p)?;
                removed.blobs += 1;
                removed.bytes += size;
            }
        }
        Ok(Some(removed))
    }
}

/// Files under `dir` (following links, skipping temporaries), as paths relative to it.
fn walk(dir: &Path, prefix: &str, out: &mut Vec<String>) {
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let rel = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}/{name}")
        };
        let p = e.path();
        if p.is_dir() {
            walk(&p, &rel, out);
        } else if p.is_file() {
            out.push(rel);
        }
    }
}

/// Whole blobs (no `.incomplete`, no temporaries) and their sizes.
fn blob_sizes(blobs: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for e in fs::read_dir(blobs).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name.ends_with(".incomplete") {
            continue;
        }
        out.insert(name, e.metadata().map(|m| m.len()).unwrap_or(0));
    }
    out
}

/// The blob names a snapshot's links point to.
fn linked_blobs(snapshot: &Path) -> BTreeSet<String> {
    fn go(dir: &Path, out: &mut BTreeSet<String>) {
        for e in fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            match fs::read_link(&p) {
                Ok(t) => {
                    if let Some(n) = t.file_name() {
                        out.insert(n.to_string_lossy().into_owned());
                    }
                }
                Err(_) if p.is_dir() => go(&p, out),
                Err(_) => {}
            }
        }
    }
    let mut out = BTreeSet::new();
    go(snapshot, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_follows_huggingface_hub_order() {
        let p = |s: &str| Some(PathBuf::from(s));
        assert_eq!(default_root(p("/c"), p("/h"), p("/u")), p("/c"));
        assert_eq!(default_root(None, p("/h"), p("/u")), p("/h/hub"));
        assert_eq!(
            default_root(p(""), None, p("/u")),
            p("/u/.cache/huggingface/hub")
        );
        assert_eq!(default_hf_home(None, p("/u")), p("/u/.cache/huggingface"));
    }

    #[cfg(unix)]
    #[test]
    fn links_are_relative_and_rm_keeps_shared_blobs() {
        let d = tempfile::tempdir().unwrap();
        let c = Cache::new(d.path());
        let id = RepoId::parse("o/n").unwrap();
        let (a, b) = ("a".repeat(40), "b".repeat(40));
        fs::create_dir_all(d.path().join("models--o--n/blobs")).unwrap();
        fs::write(c.blob_path(&id, "e1"), b"one").unwrap();
        fs::write(c.blob_path(&id, "e2"), b"two!").unwrap();
        c.link(&id, &a, "x/f.txt", "e1").unwrap();
        c.link(&id, &a, "g", "e2").unwrap();
        c.link(&id, &b, "g", "e2").unwrap();
        c.write_ref(&id, "main", &b).unwrap();
        let t = fs::read_link(c.snapshot_dir(&id, &a).join("x/f.txt")).unwrap();
        assert_eq!(t, Path::new("../../../blobs/e1"));
        assert_eq!(
            fs::read(c.snapshot_dir(&id, &a).join("x/f.txt")).unwrap(),
            b"one"
        );
        assert_eq!(c.snapshot_files(&id, &a), vec!["g", "x/f.txt"]);
        let l = c.list().unwrap();
        assert_eq!(l[0].size, 7);
        assert_eq!(l[0].revisions[1].refs, vec!["main"]);
        let r = c.remove(&id, Some(&a)).unwrap().unwrap();
        assert_eq!((r.blobs, r.bytes), (1, 3));
        assert!(c.blob_path(&id, "e2").exists());
        let r = c.remove(&id, Some("main")).unwrap().unwrap();
        assert_eq!(r.blobs, 1);
        assert!(c.read_ref(&id, "main").is_none());
        assert!(c.remove(&id, None).unwrap().is_some());
        assert!(!c.repo_dir(&id).exists());
    }
}
