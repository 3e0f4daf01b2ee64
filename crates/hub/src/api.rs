//! The Hub's HTTP API, as huggingface_hub uses it:
//!
//! - `GET  {endpoint}/api/models/{repo}/revision/{rev}`: the commit (`sha`) and the file list
//!   (`siblings[].rfilename`);
//! - `HEAD {endpoint}/{repo}/resolve/{rev}/{path}`: `X-Repo-Commit`, the ETag (`X-Linked-Etag`
//!   for LFS files, whose ETag is their sha256, else `ETag`), the size (`X-Linked-Size`, else
//!   `Content-Length`), and for LFS files a redirect to a CDN host (`Location`);
//! - `GET` of that location, with `Range: bytes=N-` to resume;
//! - the tree listing (`crate::tree`), where the repo info has no `siblings`.
//!
//! Errors map to [`HubError`] through `X-Error-Code` (`GatedRepo`, `RepoNotFound`,
//! `RevisionNotFound`, `EntryNotFound`) and the status. Redirects are followed here, not by the
//! HTTP client, so that the token goes only to the hub's own host: a redirect to another host
//! (the CDN) is requested without `Authorization`.

use std::time::Duration;

use crate::error::{HubError, Result, Target};
use crate::repo::RepoId;

/// The Hub used when no endpoint is given (`HF_ENDPOINT` overrides it, read by the binary).
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// A blocking client of one Hub endpoint.
#[derive(Clone)]
pub struct Client {
    pub(crate) agent: ureq::Agent,
    endpoint: String,
    pub(crate) token: Option<String>,
}

/// The commit a revision points to and the repository's files at it.
#[derive(Clone, Debug)]
pub struct RepoInfo {
    pub sha: String,
    /// `siblings[].rfilename`; `None` when the answer has no `siblings` (then the tree listing
    /// says, [`Client::repo_files`]).
    pub siblings: Option<Vec<String>>,
}

/// One file as `HEAD .../resolve/...` describes it.
#[derive(Clone, Debug)]
pub struct FileMeta {
    pub commit: String,
    /// Quotes and the weak marker removed, as the cache names blobs.
    pub etag: String,
    pub size: u64,
    /// Where to GET the bytes (the CDN for LFS files).
    pub location: String,
}

impl FileMeta {
    /// An LFS file's ETag is its sha256: those are checked after download.
    pub fn sha256(&self) -> Option<&str> {
        (self.etag.len() == 64 && self.etag.bytes().all(|b| b.is_ascii_hexdigit()))
            .then_some(self.etag.as_str())
    }
}

/// `scheme://host[:port]` of a URL (lower-case), for "same host" decisions.
pub fn origin(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let host = rest.split(['/', '?', '#']).next().unwrap_or("");
    format!(
        "{}://{}",
        scheme.to_ascii_lowercase(),
        host.to_ascii_lowercase()
    )
}

/// Percent-encodes one path segment (RFC 3986 unreserved characters kept).
pub fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A file path in a URL: each segment encoded, `/` kept.
pub fn encode_path(p: &str) -> String {
    p.split('/')
        .map(encode_segment)
        .collect::<Vec<_>>()
        .join("/")
}

/// ETag header value -> blob name: `W/"abc"` -> `abc`.
pub fn normalize_etag(v: &str) -> String {
    v.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_string()
}

pub(crate) fn header(r: &ureq::http::Response<ureq::Body>, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// The response of a GET, after redirects.
pub struct Fetched {
    pub status: u16,
    pub url: String,
    pub response: ureq::http::Response<ureq::Body>,
}

impl Client {
    pub fn new(endpoint: &str, token: Option<String>) -> Self {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(60)))
            .timeout_per_read(Some(Duration::from_secs(60)))
            .user_agent(concat!("hf2q/", env!("CARGO_PKG_VERSION")))
            .build();
        Client {
            agent: ureq::Agent::new_with_config(config),
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token: token.filter(|t| !t.is_empty()),
        }
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The repository's page, where a gated model's licence is accepted.
    pub fn page(&self, repo: &RepoId) -> String {
        format!("{}/{}", self.endpoint, repo.url_path())
    }

    /// Whether the token may go to `url`: only to the endpoint's own scheme, host and port.
    pub(crate) fn auth_for(&self, url: &str) -> Option<String> {
        let t = self.token.as_ref()?;
        (origin(url) == origin(&self.endpoint)).then(|| format!("Bearer {t}"))
    }

    fn request(
        &self,
        method: &str,
        url: &str,
        range_from: u64,
    ) -> Result<ureq::http::Response<ureq::Body>> {
        let mut req = match method {
            "HEAD" => self.agent.head(url),
            _ => self.agent.get(url),
        };
        if let Some(a) = self.auth_for(url) {
            req = req.header("Authorization", a);
        }
        // Byte ranges count in the file's own bytes: no content coding, whatever the HTTP
        // client's features.
        req = req.header("Accept-Encoding", "identity");
        if range_from > 0 {
            req = req.header("Range", format!("bytes={range_from}-"));
        }
        req.call().map_err(|e| HubError::Network {
            url: url.to_string(),
            message: e.to_string(),
        })
    }

    /// `HubError` for a non-success answer about `target`.
    fn error_for(
        &self,
        r: &ureq::http::Response<ureq::Body>,
        url: &str,
        target: &Target,
    ) -> HubError {
        let status = r.status().as_u16();
        let code = header(r, "x-error-code").unwrap_or_default();
        let message = header(r, "x-error-message").unwrap_or_default();
        let repo = target.repo.clone();
        let page = format!("{}/{}", self.endpoint, target.url_path);
        let had_token = self.token.is_some();
        match (code.as_str(), status) {
            ("GatedRepo", 401) => HubError::GatedNeedsToken { repo, page },
            ("GatedRepo", _) if !had_token => HubError::GatedNeedsToken { repo, page },
            ("GatedRepo", _) | ("", 403) => HubError::GatedNoAccess { repo, page },
            ("RepoNotFound", _) => HubError::RepoNotFound {
                repo,
                endpoint: self.endpoint.clone(),
                had_token,
            },
            ("RevisionNotFound", _) => HubError::RevisionNotFound {
                repo,
                revision: target.revision.clone(),
            },
            ("EntryNotFound", _) => HubError::FileNotFound {
                repo,
                revision: target.revision.clone(),
                path: target.path.clone().unwrap_or_default(),
            },
            ("", 401) if had_token => HubError::BadToken {
                endpoint: self.endpoint.clone(),
            },
            ("", 401) => HubError::RepoNotFound {
                repo,
                endpoint: self.endpoint.clone(),
                had_token,
            },
            ("", 404) => match &target.path {
                Some(p) => HubError::FileNotFound {
                    repo,
                    revision: target.revision.clone(),
                    path: p.clone(),
                },
                None => HubError::RepoNotFound {
                    repo,
                    endpoint: self.endpoint.clone(),
                    had_token,
                },
            },
            _ => HubError::Http {
                status,
                url: url.to_string(),
                message,
            },
        }
    }

    /// `GET /api/{models|datasets}/{repo}/revision/{rev}`.
    pub fn repo_info(&self, repo: &RepoId, revision: &str) -> Result<RepoInfo> {
        let url = format!(
            "{}/api/{}/{repo}/revision/{}",
            self.endpoint,
            repo.kind.plural(),
            encode_segment(revision)
        );
        let target = Target::new(repo, revision, None);
        let r = self.request("GET", &url, 0)?;
        if !r.status().is_success() {
            return Err(self.error_for(&r, &url, &target));
        }
        let text = r
            .into_body()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .map_err(|e| HubError::Network {
                url: url.clone(),
                message: e.to_string(),
            })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| HubError::Protocol {
            url: url.clone(),
            why: format!("not JSON: {e}"),
        })?;
        let sha = v
            .get("sha")
            .and_then(|s| s.as_str())
            .ok_or_else(|| HubError::Protocol {
                url: url.clone(),
                why: "no 'sha'".into(),
            })?
            .to_string();
        let siblings = v.get("siblings").and_then(|s| s.as_array()).map(|a| {
            a.iter()
                .filter_map(|s| s.get("rfilename")?.as_str().map(String::from))
                .collect()
        });
        Ok(RepoInfo { sha, siblings })
    }

    /// `{endpoint}/{repo}/resolve/{rev}/{path}`: where a file's bytes are asked for.
    pub fn resolve_url(&self, repo: &RepoId, revision: &str, path: &str) -> String {
        format!(
            "{}/{}/resolve/{}/{}",
            self.endpoint,
            repo.url_path(),
            encode_segment(revision),
            encode_path(path)
        )
    }

    /// `HEAD /{repo}/resolve/{rev}/{path}`: relative redirects (renamed repositories) are
    /// followed; a redirect to another host is where the bytes are (not followed here).
    pub fn file_meta(&self, repo: &RepoId, revision: &str, path: &str) -> Result<FileMeta> {
        let mut url = self.resolve_url(repo, revision, path);
        let target = Target::new(repo, revision, Some(path));
        for _ in 0..5 {
            let r = self.request("HEAD", &url, 0)?;
            let status = r.status().as_u16();
            let location = header(&r, "location");
            if (300..400).contains(&status) {
                if let Some(loc) = location.as_deref().filter(|l| l.starts_with('/')) {
                    url = format!("{}{loc}", origin(&url));
                    continue;
                }
            } else if !r.status().is_success() {
                return Err(self.error_for(&r, &url, &target));
            }
            let bad = |why: &str| HubError::Protocol {
                url: url.clone(),
                why: why.to_string(),
            };
            let commit =
                header(&r, "x-repo-commit").ok_or_else(|| bad("no X-Repo-Commit header"))?;
            let etag = header(&r, "x-linked-etag")
                .or_else(|| header(&r, "etag"))
                .map(|e| normalize_etag(&e))
                .filter(|e| !e.is_empty() && !e.contains(['/', '\\']) && e != "." && e != "..")
                .ok_or_else(|| bad("no usable ETag"))?;
            let size = header(&r, "x-linked-size")
                .or_else(|| header(&r, "content-length"))
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| bad("no size (X-Linked-Size or Content-Length)"))?;
            let location = match location {
                Some(l) if (300..400).contains(&status) => l,
                _ => url.clone(),
            };
            return Ok(FileMeta {
                commit,
                etag,
                size,
                location,
            });
        }
        Err(HubError::Protocol {
            url,
            why: "too many redirects".into(),
        })
    }

    /// `GET url` from byte `range_from` on, following redirects (relative ones and ones to
    /// other hosts; `Authorization` only to the endpoint's host).
    pub fn get(&self, url: &str, range_from: u64, target: &Target) -> Result<Fetched> {
        let mut url = url.to_string();
        for _ in 0..8 {
            let r = self.request("GET", &url, range_from)?;
            let status = r.status().as_u16();
            if (300..400).contains(&status) {
                let Some(loc) = header(&r, "location") else {
                    return Err(HubError::Protocol {
                        url,
                        why: format!("HTTP {status} without Location"),
                    });
                };
                url = if loc.starts_with('/') {
                    format!("{}{loc}", origin(&url))
                } else {
                    loc
                };
                continue;
            }
            if !(r.status().is_success() || status == 416) {
                return Err(self.error_for(&r, &url, target));
            }
            return Ok(Fetched {
                status,
                url,
                response: r,
            });
        }
        Err(HubError::Protocol {
            url,
            why: "too many redirects".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_and_encoding() {
        assert_eq!(origin("http://127.0.0.1:80/a?b"), "http://127.0.0.1:80");
        assert_ne!(
            origin("https://huggingface.co/x"),
            origin("https://cdn-lfs.huggingface.co/x")
        );
        assert_eq!(encode_segment("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(encode_path("a b/c.json"), "a%20b/c.json");
        assert_eq!(normalize_etag("W/\"abc\""), "abc");
    }
}
