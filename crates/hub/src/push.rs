//! `push`: a local folder or file to a Hub repository in one commit, as huggingface_hub's
//! `upload_folder` does it: create the repository if missing (and the branch), ask the preupload
//! API which files go through LFS, upload those with the LFS batch API's basic transfer (one
//! PUT) or, where its answer asks, the multipart one (`lfs_multipart`), then verify when asked
//! (objects the Hub already holds are skipped), then commit everything
//! with the NDJSON commit API (small files inline, LFS files by sha256). A README.md (the card)
//! given by the caller is added when neither the upload nor the branch has one.
//!
//! Not here: what the card says (`card`, facts from the binary) or splitting large files.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use sha2::{Digest, Sha256};

use crate::api::Client;
use crate::error::{HubError, IoContext, Result};
use crate::pull::HubConfig;
use crate::repo::{RepoId, DEFAULT_REVISION};
use crate::write_api::{CommitOp, PreuploadFile};

/// What to push and where.
#[derive(Clone, Debug)]
pub struct PushRequest {
    /// A folder (its files, recursively, keep their relative paths) or one file (at the top).
    pub path: PathBuf,
    /// The repository (its `kind` says model or dataset).
    pub repo: RepoId,
    /// The branch to commit to (created from the default branch if missing); `main` if `None`.
    pub revision: Option<String>,
    /// Create the repository private (an existing one keeps its visibility).
    pub private: bool,
    /// The commit summary.
    pub message: Option<String>,
    /// README.md text to add when the upload has none.
    pub card: Option<String>,
}

/// The commit made.
#[derive(Clone, Debug)]
pub struct Pushed {
    pub repo_url: String,
    pub commit_url: String,
    pub commit: String,
    /// Whether the repository was created now.
    pub created: bool,
    /// Every file committed (paths in the repository).
    pub files: Vec<String>,
    /// Those that went through LFS.
    pub lfs: Vec<String>,
    /// Bytes sent to LFS storage now (objects already stored are not sent again).
    pub lfs_bytes_sent: u64,
    /// Whether the README.md committed is the card given.
    pub card_added: bool,
}

/// A file to upload: where its bytes are, its size, sha256 and first bytes.
struct Upload {
    path: String,
    local: Option<PathBuf>,
    inline: Vec<u8>,
    size: u64,
    sha256: String,
    sample: Vec<u8>,
}

/// The files a push of `path` sends: `(path in the repository, local file)`, sorted. A folder's
/// `.git` and `.cache` folders are left out (as huggingface_hub's `upload_folder` does).
pub fn local_files(path: &Path) -> Result<Vec<(String, PathBuf)>> {
    let meta = std::fs::metadata(path).at(path)?;
    if meta.is_file() {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        return Ok(vec![(name, path.to_path_buf())]);
    }
    let mut out = Vec::new();
    walk(path, "", &mut out)?;
    out.sort();
    if out.is_empty() {
        return Err(HubError::NothingToPush {
            path: path.to_path_buf(),
            why: "the folder has no files".into(),
        });
    }
    Ok(out)
}

fn walk(dir: &Path, prefix: &str, out: &mut Vec<(String, PathBuf)>) -> Result<()> {
    for e in std::fs::read_dir(dir).at(dir)? {
        let e = e.at(dir)?;
        let name = e.file_name().to_string_lossy().into_owned();
        let rel = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}/{name}")
        };
        let p = e.path();
        let m = std::fs::metadata(&p).at(&p)?;
        if m.is_dir() {
            if prefix.is_empty() && (name == ".git" || name == ".cache") {
                continue;
            }
            walk(&p, &rel, out)?;
        } else if m.is_file() {
            out.push((rel, p));
        }
    }
    Ok(())
}

fn describe(path: String, local: PathBuf) -> Result<Upload> {
    let mut f = File::open(&local).at(&local)?;
    let mut h = Sha256::new();
    let mut sample = Vec::new();
    let mut size = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).at(&local)?;
        if n == 0 {
            break;
        }
        if sample.len() < 512 {
            let take = (512 - sample.len()).min(n);
            sample.extend_from_slice(&buf[..take]);
        }
        h.update(&buf[..n]);
        size += n as u64;
    }
    Ok(Upload {
        path,
        local: Some(local),
        inline: Vec::new(),
        size,
        sha256: hex(&h.finalize()),
        sample,
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// Counts bytes read into a progress bar.
struct Counted<R> {
    inner: R,
    bars: [ProgressBar; 2],
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        for b in &self.bars {
            b.inc(n as u64);
        }
        Ok(n)
    }
}

/// Pushes `req` and returns the commit.
pub fn push(cfg: &HubConfig, req: &PushRequest) -> Result<Pushed> {
    if cfg.offline {
        return Err(HubError::Offline {
            what: format!("cannot push {} while offline", req.repo),
        });
    }
    let client = Client::new(&cfg.endpoint, cfg.token.clone());
    let repo = &req.repo;
    let rev = req.revision.as_deref().unwrap_or(DEFAULT_REVISION);

    let mut uploads = Vec::new();
    for (p, local) in local_files(&req.path)? {
        uploads.push(describe(p, local)?);
    }
    let created = client.create_repo(repo, req.private)?;
    if rev != DEFAULT_REVISION {
        client.create_branch(repo, rev)?;
    }
    // The card only where neither the upload nor the branch has a README.md.
    let has_readme = |files: &[String]| files.iter().any(|f| f == "README.md");
    let card_added = match &req.card {
        Some(text)
            if !uploads.iter().any(|u| u.path == "README.md")
                && !has_readme(&client.repo_files(repo, &client.repo_info(repo, rev)?)?) =>
        {
            let b = text.as_bytes().to_vec();
            uploads.push(Upload {
                path: "README.md".into(),
                local: None,
                size: b.len() as u64,
                sha256: hex(&Sha256::digest(&b)),
                sample: b[..b.len().min(512)].to_vec(),
                inline: b,
            });
            true
        }
        _ => false,
    };

    let asks: Vec<PreuploadFile> = uploads
        .iter()
        .map(|u| PreuploadFile {
            path: u.path.clone(),
            size: u.size,
            sample: u.sample.clone(),
        })
        .collect();
    let modes = client.preupload(repo, rev, &asks)?;
    let mode = |p: &str| {
        modes
            .iter()
            .find(|m| m.path == p)
            .expect("checked by preupload")
    };
    // Files the Hub ignores (its .gitignore) are not sent; empty files are never LFS.
    uploads.retain(|u| !mode(&u.path).ignore);
    let is_lfs = |u: &Upload| mode(&u.path).lfs && u.size > 0;

    // LFS: the batch API says which objects to send and where.
    let lfs: Vec<&Upload> = uploads.iter().filter(|u| is_lfs(u)).collect();
    let mut sent = 0u64;
    if !lfs.is_empty() {
        let mut objects: Vec<(String, u64)> =
            lfs.iter().map(|u| (u.sha256.clone(), u.size)).collect();
        objects.sort();
        objects.dedup();
        let actions = client.lfs_batch(repo, rev, &objects)?;
        let todo: Vec<_> = actions
            .iter()
            .filter_map(|a| Some((a, a.upload.as_deref()?)))
            .filter_map(|(a, href)| Some((a, href, *lfs.iter().find(|u| u.sha256 == a.oid)?)))
            .collect();
        let multi = MultiProgress::with_draw_target(if cfg.progress {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        });
        let style = ProgressStyle::with_template(
            "{msg:30!} {bar:30} {bytes:>10}/{total_bytes:<10} {bytes_per_sec:>12} {eta:>4}",
        )
        .expect("valid template");
        let total: u64 = todo.iter().map(|(_, _, u)| u.size).sum();
        let total_bar = multi.add(ProgressBar::new(total));
        total_bar.set_style(style.clone());
        total_bar.set_message(format!("{repo} ({} files)", todo.len()));
        for (action, href, u) in todo {
            let local = u.local.as_ref().expect("inline files are small");
            let bar = multi.insert_before(&total_bar, ProgressBar::new(u.size));
            bar.set_style(style.clone());
            bar.set_message(u.path.clone());
            let bars = [bar.clone(), total_bar.clone()];
            let r = match &action.multipart {
                Some(mp) => {
                    let mut part = |from: u64, len: u64| -> Result<Box<dyn Read>> {
                        let mut f = File::open(local).at(local)?;
                        f.seek(SeekFrom::Start(from)).at(local)?;
                        Ok(Box::new(Counted {
                            inner: f.take(len),
                            bars: bars.clone(),
                        }))
                    };
                    client.lfs_put_multipart(mp, &action.oid, u.size, &u.path, &mut part)
                }
                None => {
                    let inner = File::open(local).at(local)?;
                    let reader = Counted { inner, bars };
                    client.lfs_put(action, href, u.size, reader, &u.path)
                }
            };
            bar.finish_and_clear();
            r?;
            if let Some(v) = action.verify.as_deref() {
                client.lfs_verify(action, v, u.size, &u.path)?;
            }
            sent += u.size;
        }
        total_bar.finish_and_clear();
    }

    let mut ops = Vec::with_capacity(uploads.len());
    for u in &uploads {
        ops.push(if is_lfs(u) {
            CommitOp::Lfs {
                path: u.path.clone(),
                sha256: u.sha256.clone(),
                size: u.size,
            }
        } else {
            let content = match &u.local {
                Some(p) => std::fs::read(p).at(p)?,
                None => u.inline.clone(),
            };
            CommitOp::File {
                path: u.path.clone(),
                content,
            }
        });
    }
    let summary = req
        .message
        .clone()
        .unwrap_or_else(|| format!("Upload {} with hf2q", req.repo));
    let info = client.commit(repo, rev, &summary, "", &ops)?;
    Ok(Pushed {
        repo_url: client.repo_url(repo),
        commit_url: info.url,
        commit: info.oid,
        created,
        files: uploads.iter().map(|u| u.path.clone()).collect(),
        lfs: uploads
            .iter()
            .filter(|u| is_lfs(u))
            .map(|u| u.path.clone())
            .collect(),
        lfs_bytes_sent: sent,
        card_added,
    })
}
