//! The Hub's tree listing, `GET /api/{models|datasets}/{repo}/tree/{rev}[/{path}]`: a JSON
//! array of entries `{"type": "file"|"directory", "oid", "size", "path", "lfs"?: {"oid",
//! "size", "pointerSize"}}`, with `?recursive=true` every entry under the path, paged with a
//! `Link: <URL>; rel="next"` header (followed until it is absent).
//!
//! [`Client::repo_files`] is where the rest of the crate gets a revision's file list: the repo
//! info's `siblings` when the answer has them, else the recursive tree listing.
//!
//! Not here: HEAD of a file for its ETag and where its bytes are ([`Client::file_meta`]), and
//! which files a pull takes from a listing instead (an LFS entry's sha256 and size, checked by
//! the download: `pull::file_metas`).

use crate::api::{encode_path, encode_segment, header, origin, Client, RepoInfo};
use crate::error::{HubError, Result, Target};
use crate::repo::RepoId;

/// How many pages a listing may have before it is taken for a loop.
const MAX_PAGES: usize = 10_000;

/// Whether an entry is a file or a folder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryType {
    File,
    Directory,
}

/// An LFS file's pointer: its sha256 (`oid`), its size and the pointer file's size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LfsInfo {
    pub oid: String,
    pub size: u64,
    pub pointer_size: u64,
}

/// One entry of a tree listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeEntry {
    pub kind: EntryType,
    /// The path from the repository's root.
    pub path: String,
    /// The git object id (a file's blob, a folder's tree).
    pub oid: String,
    /// A file's size (an LFS file's: the file's, not the pointer's).
    pub size: u64,
    pub lfs: Option<LfsInfo>,
}

/// The URL of a `Link` header's `rel="next"` target, if any.
pub fn next_link(link: &str) -> Option<String> {
    link.split(',').find_map(|part| {
        let (url, params) = part.split_once(';')?;
        let is_next = params.split(';').any(|p| {
            let p = p.trim().replace(' ', "");
            p == "rel=\"next\"" || p == "rel=next"
        });
        let url = url.trim().strip_prefix('<')?.strip_suffix('>')?;
        is_next.then(|| url.to_string())
    })
}

fn entry(v: &serde_json::Value) -> std::result::Result<TreeEntry, String> {
    let s = |k: &str| v.get(k).and_then(|x| x.as_str());
    let kind = match s("type") {
        Some("file") => EntryType::File,
        Some("directory") => EntryType::Directory,
        Some(t) => return Err(format!("unknown entry type '{t}'")),
        None => return Err("an entry without 'type'".into()),
    };
    let path = s("path").ok_or("an entry without 'path'")?.to_string();
    let lfs = match v.get("lfs") {
        None | Some(serde_json::Value::Null) => None,
        Some(l) => Some(LfsInfo {
            oid: l
                .get("oid")
                .and_then(|x| x.as_str())
                .ok_or_else(|| format!("{path}: 'lfs' without 'oid'"))?
                .to_string(),
            size: l.get("size").and_then(|x| x.as_u64()).unwrap_or(0),
            pointer_size: l.get("pointerSize").and_then(|x| x.as_u64()).unwrap_or(0),
        }),
    };
    Ok(TreeEntry {
        kind,
        oid: s("oid").unwrap_or("").to_string(),
        size: v.get("size").and_then(|x| x.as_u64()).unwrap_or(0),
        path,
        lfs,
    })
}

impl Client {
    /// The entries under `path` ("" for the root) at `revision`; every one below it with
    /// `recursive`, else its direct children. All pages are read.
    pub fn tree(
        &self,
        repo: &RepoId,
        revision: &str,
        path: &str,
        recursive: bool,
    ) -> Result<Vec<TreeEntry>> {
        let path = path.trim_matches('/');
        let mut url = format!(
            "{}/api/{}/{repo}/tree/{}",
            self.endpoint(),
            repo.kind.plural(),
            encode_segment(revision)
        );
        if !path.is_empty() {
            url = format!("{url}/{}", encode_path(path));
        }
        if recursive {
            url.push_str("?recursive=true");
        }
        let target = Target::new(repo, revision, (!path.is_empty()).then_some(path));
        let mut out = Vec::new();
        for _ in 0..MAX_PAGES {
            let fetched = self.get(&url, 0, &target)?;
            let bad = |why: String| HubError::Protocol {
                url: fetched.url.clone(),
                why,
            };
            if fetched.status != 200 {
                return Err(bad(format!("HTTP {} for a listing", fetched.status)));
            }
            let next = header(&fetched.response, "link").and_then(|l| next_link(&l));
            let text = fetched
                .response
                .into_body()
                .with_config()
                .limit(64 << 20)
                .read_to_string()
                .map_err(|e| HubError::Network {
                    url: url.clone(),
                    message: e.to_string(),
                })?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| bad(format!("the listing is not JSON: {e}")))?;
            let items = v
                .as_array()
                .ok_or_else(|| bad("the listing is not a JSON array".into()))?;
            for item in items {
                out.push(entry(item).map_err(bad)?);
            }
            match next {
                None => return Ok(out),
                // A relative next link stays on the page's host; `get` sends the token only to
                // the endpoint's.
                Some(n) if n.starts_with('/') => url = format!("{}{n}", origin(&fetched.url)),
                Some(n) => url = n,
            }
        }
        Err(HubError::Protocol {
            url,
            why: format!("more than {MAX_PAGES} pages in a listing"),
        })
    }

    /// The files of `info`'s commit: its `siblings`, else (an answer without them) the
    /// recursive tree listing of that commit.
    pub fn repo_files(&self, repo: &RepoId, info: &RepoInfo) -> Result<Vec<String>> {
        if let Some(s) = &info.siblings {
            return Ok(s.clone());
        }
        Ok(self
            .tree(repo, &info.sha, "", true)?
            .into_iter()
            .filter(|e| e.kind == EntryType::File)
            .map(|e| e.path)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_headers() {
        assert_eq!(
            next_link("<https://h/api/models/a/b/tree/main?cursor=x>; rel=\"next\"").as_deref(),
            Some("https://h/api/models/a/b/tree/main?cursor=x")
        );
        assert_eq!(
            next_link("<https://h/p1>; rel=\"prev\", </p3>; rel=next").as_deref(),
            Some("/p3")
        );
        assert_eq!(next_link("<https://h/p1>; rel=\"prev\""), None);
        assert_eq!(next_link("garbage"), None);
    }

    #[test]
    fn entries_are_checked() {
        let v = serde_json::json!({"type": "file", "oid": "ab", "size": 3, "path": "a/b.bin",
            "lfs": {"oid": "cd", "size": 3, "pointerSize": 128}});
        let e = entry(&v).unwrap();
        assert_eq!(e.kind, EntryType::File);
        assert_eq!(e.lfs.unwrap().pointer_size, 128);
        assert!(entry(&serde_json::json!({"type": "link", "path": "x"})).is_err());
        assert!(entry(&serde_json::json!({"type": "file"})).is_err());
    }
}
