//! `pull`: a repository reference to a loadable path in the cache. Online: ask the Hub for the
//! revision's commit and files, select the files, learn each missing one's blob name (ETag) and
//! size (`file_metas`: from a listing of its folder for LFS files, else a HEAD), download the
//! missing blobs (one progress bar per file and a total), link them into
//! `snapshots/<commit>/`, and point `refs/<revision>` at the commit. Offline (or to avoid the
//! network when everything is there): [`find_cached`] resolves from the cache alone and names
//! what is missing.
//! [`pull_dataset`] adds the fallback of a dataset with a loading script only: its Parquet
//! conversion. The file list comes from the repo info's `siblings`, else the tree listing
//! ([`crate::tree`]).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::api::{Client, FileMeta, DEFAULT_ENDPOINT};
use crate::cache::Cache;
use crate::data_select::select_dataset;
use crate::download::fetch_blob;
use crate::error::{HubError, Result, Target};
use crate::repo::{is_commit, RepoId, RepoKind, RepoRef};
use crate::select::{missing, select, Filter, Selection};
use crate::tree::{EntryType, TreeEntry};

/// Everything the binary gathers from flags and the environment; library code reads none.
#[derive(Clone, Debug)]
pub struct HubConfig {
    /// `HF_ENDPOINT`, else [`DEFAULT_ENDPOINT`].
    pub endpoint: String,
    /// The cache root ([`crate::cache::default_root`]).
    pub cache_dir: PathBuf,
    /// `--hf-token`, else `HF_TOKEN`, else the stored token file.
    pub token: Option<String>,
    /// `--offline` or `HF_HUB_OFFLINE=1`: the cache only.
    pub offline: bool,
    /// Draw progress bars on stderr (they hide themselves when it is not a terminal).
    pub progress: bool,
}

impl HubConfig {
    pub fn new(cache_dir: impl Into<PathBuf>) -> Self {
        HubConfig {
            endpoint: DEFAULT_ENDPOINT.to_string(),
            cache_dir: cache_dir.into(),
            token: None,
            offline: false,
            progress: false,
        }
    }

    pub fn cache(&self) -> Cache {
        Cache::new(&self.cache_dir)
    }
}

/// What to pull: the repository (with `:QUANT` and revision) and the override globs.
#[derive(Clone, Debug)]
pub struct PullRequest {
    pub repo: RepoRef,
    pub include: Vec<String>,
    pub exclude: Vec<String>,
}

impl PullRequest {
    pub fn new(repo: RepoRef) -> Self {
        PullRequest {
            repo,
            include: Vec::new(),
            exclude: Vec::new(),
        }
    }

    fn filter(&self) -> Filter {
        Filter {
            quant: self.repo.quant.clone(),
            include: self.include.clone(),
            exclude: self.exclude.clone(),
        }
    }
}

/// A pulled (or found) snapshot.
#[derive(Clone, Debug)]
pub struct Pulled {
    pub repo: RepoId,
    pub commit: String,
    pub snapshot: PathBuf,
    /// The selected files (relative to the snapshot).
    pub files: Vec<String>,
    /// Those that were downloaded now (the others were in the cache).
    pub downloaded: Vec<String>,
    /// Bytes downloaded now.
    pub bytes: u64,
    /// What to load: the GGUF file (first part of a split one), else the snapshot folder.
    pub model_path: PathBuf,
}

fn model_path(snapshot: &std::path::Path, sel: &Selection) -> PathBuf {
    match &sel.gguf {
        Some(f) => snapshot.join(f),
        None => snapshot.to_path_buf(),
    }
}

/// Resolves `req` from the cache alone. Errors say what is missing: the revision, or the files.
pub fn find_cached(cfg: &HubConfig, req: &PullRequest) -> Result<Pulled> {
    let cache = cfg.cache();
    let id = &req.repo.id;
    let rev = req.repo.revision();
    let Some(commit) = cache.resolve(id, rev) else {
        let what = if cache.repo_dir(id).is_dir() {
            format!(
                "{id} is in the cache ({}) but not its revision '{rev}'",
                cache.repo_dir(id).display()
            )
        } else {
            format!(
                "{id} is not in the cache ({}): pull it while online",
                cache.root().display()
            )
        };
        return Err(HubError::Offline { what });
    };
    let snapshot = cache.snapshot_dir(id, &commit);
    let present = cache.snapshot_files(id, &commit);
    let sel = choose(id, &present, req).map_err(|e| HubError::Offline {
        what: format!(
            "the cached snapshot {commit} of {id} has no matching files ({e}); it holds: {}",
            list(&present)
        ),
    })?;
    let absent = missing(&sel, &present, |f| {
        std::fs::read_to_string(snapshot.join(f)).ok()
    });
    if !absent.is_empty() {
        return Err(HubError::Offline {
            what: format!(
                "{id}@{rev} is only partly in the cache: missing {}",
                absent.join(", ")
            ),
        });
    }
    Ok(Pulled {
        repo: id.clone(),
        model_path: model_path(&snapshot, &sel),
        commit,
        snapshot,
        files: sel.files,
        downloaded: Vec::new(),
        bytes: 0,
    })
}

/// The files to fetch: a model's (`select`), or a dataset split's (`data_select`).
fn choose(id: &RepoId, files: &[String], req: &PullRequest) -> Result<Selection> {
    match id.kind {
        RepoKind::Model => select(&id.to_string(), files, &req.filter()),
        RepoKind::Dataset => select_dataset(&id.to_string(), files, &req.filter()),
    }
}

fn list(files: &[String]) -> String {
    if files.is_empty() {
        "no files".into()
    } else {
        files.join(", ")
    }
}

/// Pulls `req` into the cache (or, offline, finds it there) and returns where it is.
pub fn pull(cfg: &HubConfig, req: &PullRequest) -> Result<Pulled> {
    if cfg.offline {
        return find_cached(cfg, req);
    }
    let cache = cfg.cache();
    let client = Client::new(&cfg.endpoint, cfg.token.clone());
    let id = &req.repo.id;
    let rev = req.repo.revision();
    let info = client.repo_info(id, rev)?;
    if !is_commit(&info.sha) {
        return Err(HubError::Protocol {
            url: client.page(id),
            why: format!("'{}' is not a commit hash", info.sha),
        });
    }
    let listed = client.repo_files(id, &info)?;
    let commit = info.sha;
    let sel = choose(id, &listed, req)?;
    for f in &sel.files {
        if !listed.contains(f) {
            return Err(HubError::FileNotFound {
                repo: id.to_string(),
                revision: rev.to_string(),
                path: f.clone(),
            });
        }
    }
    let snapshot = cache.snapshot_dir(id, &commit);
    let present = cache.snapshot_files(id, &commit);
    // The files not yet in this snapshot, with their blob names and sizes.
    let absent: Vec<String> = sel
        .files
        .iter()
        .filter(|f| !present.contains(f))
        .cloned()
        .collect();
    let todo = file_metas(&client, id, &commit, &absent)?;
    let total: u64 = todo
        .iter()
        .filter(|(_, m)| !cache.blob_path(id, &m.etag).is_file())
        .map(|(_, m)| m.size)
        .sum();
    let multi = MultiProgress::with_draw_target(if cfg.progress {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    });
    let file_style = ProgressStyle::with_template(
        "{msg:30!} {bar:30} {bytes:>10}/{total_bytes:<10} {bytes_per_sec:>12} {eta:>4}",
    )
    .expect("valid template");
    let total_bar = multi.add(ProgressBar::new(total));
    total_bar.set_style(
        ProgressStyle::with_template(
            "{msg:30!} {bar:30} {bytes:>10}/{total_bytes:<10} {bytes_per_sec:>12} {eta:>4}",
        )
        .expect("valid template"),
    );
    total_bar.set_message(format!("{id} ({} files)", todo.len()));
    let mut downloaded = Vec::new();
    let mut bytes = 0;
    for (f, meta) in &todo {
        let blob = cache.blob_path(id, &meta.etag);
        let whole = || {
            std::fs::metadata(&blob)
                .map(|m| m.is_file() && m.len() == meta.size)
                .unwrap_or(false)
        };
        // Another pull of the same blob (hf2q or huggingface_hub) finishes first; then it is there.
        let _lock = if whole() {
            None
        } else {
            Some(cache.lock_blob(id, &meta.etag)?)
        };
        if !whole() {
            let bar = multi.insert_before(&total_bar, ProgressBar::new(meta.size));
            bar.set_style(file_style.clone());
            bar.set_message(f.clone());
            let target = Target::new(id, rev, Some(f));
            let before = bar.position();
            let result = fetch_blob(&client, meta, &target, &blob, &bar);
            bar.finish_and_clear();
            result?;
            total_bar.inc(meta.size.saturating_sub(before));
            downloaded.push(f.clone());
            bytes += meta.size;
        }
        cache.link(id, &commit, f, &meta.etag)?;
    }
    total_bar.finish_and_clear();
    if rev != commit {
        cache.write_ref(id, rev, &commit)?;
    }
    Ok(Pulled {
        repo: id.clone(),
        model_path: model_path(&snapshot, &sel),
        commit,
        snapshot,
        files: sel.files,
        downloaded,
        bytes,
    })
}

/// An LFS file's blob name, size and URL from its listing entry: the name is its sha256
/// (`lfs.oid`, what the Hub's `X-Linked-Etag` is and huggingface_hub names the blob by), and the
/// download checks the bytes against both. `None` for other entries.
fn lfs_meta(client: &Client, id: &RepoId, commit: &str, e: &TreeEntry) -> Option<FileMeta> {
    let lfs = e.lfs.as_ref().filter(|_| e.kind == EntryType::File)?;
    let oid = lfs.oid.to_ascii_lowercase();
    let meta = FileMeta {
        commit: commit.to_string(),
        etag: oid,
        size: lfs.size,
        location: client.resolve_url(id, commit, &e.path),
    };
    meta.sha256().is_some().then_some(meta)
}

/// Each of `files`' blob name, size and URL at `commit`. Where two or more files share a folder,
/// one listing of that folder (`tree`, not recursive) describes its LFS files, which then need no
/// HEAD; every other file is asked with HEAD: a regular file's blob name is its git blob id,
/// which the download does not check (see ARCHITECTURE.md, the Hub client). A failed listing
/// (a mirror without the tree API) falls back to HEAD for all.
fn file_metas(
    client: &Client,
    id: &RepoId,
    commit: &str,
    files: &[String],
) -> Result<Vec<(String, FileMeta)>> {
    let folder = |f: &str| f.rsplit_once('/').map_or("", |(d, _)| d).to_string();
    let mut per_folder: BTreeMap<String, usize> = BTreeMap::new();
    for f in files {
        *per_folder.entry(folder(f)).or_default() += 1;
    }
    let mut listed: HashMap<String, FileMeta> = HashMap::new();
    for (dir, _) in per_folder.iter().filter(|(_, &n)| n >= 2) {
        for e in client.tree(id, commit, dir, false).unwrap_or_default() {
            if let Some(m) = lfs_meta(client, id, commit, &e) {
                listed.insert(e.path, m);
            }
        }
    }
    files
        .iter()
        .map(|f| match listed.remove(f) {
            Some(m) => Ok((f.clone(), m)),
            None => Ok((f.clone(), client.file_meta(id, commit, f)?)),
        })
        .collect()
}

/// The revision where the Hub keeps the Parquet conversion of a dataset (one per config and
/// split: `CONFIG/SPLIT/NNNN.parquet`).
pub const PARQUET_REVISION: &str = "refs/convert/parquet";

/// Pulls a dataset split (or, offline, finds it). A repository without any data file at its
/// default revision (one with a loading script only) is read from its Parquet conversion,
/// [`PARQUET_REVISION`]; when that revision is missing too, the first error stands. A revision
/// asked for is used as it is.
pub fn pull_dataset(cfg: &HubConfig, req: &PullRequest) -> Result<Pulled> {
    let first = pull(cfg, req);
    let fall_back = req.repo.revision.is_none()
        && match &first {
            Err(HubError::NoDataFiles { available, .. }) => available.is_empty(),
            Err(HubError::Offline { .. }) => cfg.offline,
            _ => false,
        };
    if !fall_back {
        return first;
    }
    let mut converted = req.clone();
    converted.repo.revision = Some(PARQUET_REVISION.to_string());
    match pull(cfg, &converted) {
        Err(HubError::RevisionNotFound { .. } | HubError::Offline { .. }) => first,
        other => other,
    }
}
