//! The Hub's write API, in the shapes huggingface_hub sends and reads (`hf_api.py`
//! `create_repo` / `create_branch`, `_commit_api.py` `_fetch_upload_modes` / `create_commit`,
//! `lfs.py` `post_lfs_batch_info` / `lfs_upload`). `{kind}` is `models` or `datasets`,
//! `{prefix}` empty or `datasets/`, `{rev}` percent-encoded:
//!
//! - `POST /api/repos/create` `{"name", "organization", "type", "private", "visibility"?}` ->
//!   `{"url"}`; `409` when it exists.
//! - `POST /api/{kind}/{repo}/branch/{branch}` `{}` -> `200`; `409` when it exists.
//! - `POST /api/{kind}/{repo}/preupload/{rev}` `{"files": [{"path", "sample" (base64 of the
//!   first 512 bytes), "size"}]}` -> `{"files": [{"path", "uploadMode": "lfs"|"regular",
//!   "shouldIgnore", "oid"?}]}`.
//! - `POST /{prefix}{repo}.git/info/lfs/objects/batch` (`application/vnd.git-lfs+json`)
//!   `{"operation": "upload", "transfers": ["basic", "multipart"], "objects": [{"oid", "size"}],
//!   "hash_algo": "sha256", "ref": {"name"}}` -> `{"transfer"?, "objects": [{"oid", "size",
//!   "actions"?: {"upload": {"href", "header"?}, "verify"?: {"href", "header"?}}, "error"?:
//!   {"code", "message"}}]}`; no `actions`: the object is already stored.
//! - basic: `PUT {upload.href}` the bytes (`Content-Length` set: storage refuses chunked
//!   bodies); multipart (`upload.header` has `chunk_size` and numbered part URLs): the parts,
//!   then the completion (`lfs_multipart`); then `POST {verify.href}` `{"oid", "size"}`.
//! - `POST /api/{kind}/{repo}/commit/{rev}` (`application/x-ndjson`): a `header` line
//!   `{"summary", "description"}`, then `file` lines `{"content" (base64), "path", "encoding":
//!   "base64"}` and `lfsFile` lines `{"path", "algo": "sha256", "oid", "size"}` ->
//!   `{"commitUrl", "commitOid"}`.
//!
//! The token goes only where [`Client`] sends it: to the endpoint's own host (an upload `href` on
//! a storage host gets none). Not here: which files to send and in what order (`push`).

use std::io::Read;

use serde_json::{json, Value};

use crate::api::{encode_segment, header, Client};
use crate::error::{HubError, Result};
use crate::lfs_multipart::{self, refusal_text, Multipart};
use crate::repo::RepoId;

/// One file as the preupload API is asked about it.
#[derive(Clone, Debug)]
pub struct PreuploadFile {
    pub path: String,
    pub size: u64,
    /// The first 512 bytes (or fewer).
    pub sample: Vec<u8>,
}

/// The Hub's answer for one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UploadMode {
    pub path: String,
    pub lfs: bool,
    pub ignore: bool,
}

/// What the LFS batch API says to do with one object.
#[derive(Clone, Debug, Default)]
pub struct LfsAction {
    pub oid: String,
    /// `None`: already stored, nothing to upload.
    pub upload: Option<String>,
    pub upload_headers: Vec<(String, String)>,
    /// `Some`: upload in parts (then `upload` is the completion URL).
    pub multipart: Option<Multipart>,
    pub verify: Option<String>,
    pub verify_headers: Vec<(String, String)>,
}

/// The commit made.
#[derive(Clone, Debug)]
pub struct CommitInfo {
    pub url: String,
    pub oid: String,
}

/// An operation of the NDJSON commit.
#[derive(Clone, Debug)]
pub enum CommitOp {
    /// A small file, sent inline (base64).
    File { path: String, content: Vec<u8> },
    /// A file whose bytes went through LFS.
    Lfs {
        path: String,
        sha256: String,
        size: u64,
    },
}

/// The NDJSON body of a commit: the header line, then one line per operation.
pub fn commit_body(summary: &str, description: &str, ops: &[CommitOp]) -> Vec<u8> {
    let mut lines =
        vec![json!({"key": "header", "value": {"summary": summary, "description": description}})];
    for op in ops {
        lines.push(match op {
            CommitOp::File { path, content } => json!({"key": "file", "value": {
                "content": crate::b64::encode(content), "path": path, "encoding": "base64"}}),
            CommitOp::Lfs { path, sha256, size } => json!({"key": "lfsFile", "value": {
                "path": path, "algo": "sha256", "oid": sha256, "size": size}}),
        });
    }
    let mut out = Vec::new();
    for l in lines {
        out.extend_from_slice(l.to_string().as_bytes());
        out.push(b'\n');
    }
    out
}

fn headers_of(v: Option<&Value>) -> Vec<(String, String)> {
    v.and_then(Value::as_object)
        .map(|o| {
            o.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

type Response = ureq::http::Response<ureq::Body>;

impl Client {
    /// Sends `body` with `method` to `url` (`Authorization` only to the endpoint's host).
    fn send(
        &self,
        method: &str,
        url: &str,
        content_type: &str,
        headers: &[(String, String)],
        body: impl ureq::AsSendBody,
    ) -> Result<Response> {
        self.send_as(method, url, self.auth_for(url), content_type, headers, body)
    }

    /// Sends `body` with `method` (`PUT` or `POST`) to `url` with `auth` as `Authorization`.
    pub(crate) fn send_as(
        &self,
        method: &str,
        url: &str,
        auth: Option<String>,
        content_type: &str,
        headers: &[(String, String)],
        body: impl ureq::AsSendBody,
    ) -> Result<Response> {
        let mut req = match method {
            "PUT" => self.agent.put(url),
            _ => self.agent.post(url),
        };
        if let Some(a) = auth {
            req = req.header("Authorization", a);
        }
        if !content_type.is_empty() {
            req = req.header("Content-Type", content_type);
        }
        for (k, v) in headers {
            req = req.header(k.as_str(), v.as_str());
        }
        req.header("Accept-Encoding", "identity")
            .send(body)
            .map_err(|e| HubError::Network {
                url: url.to_string(),
                message: e.to_string(),
            })
    }

    fn send_json(&self, url: &str, content_type: &str, v: &Value) -> Result<Response> {
        let bytes = v.to_string().into_bytes();
        self.send("POST", url, content_type, &[], &bytes[..])
    }

    /// The error for a refused write to `repo`.
    fn write_error(&self, r: Response, url: &str, repo: &str, revision: &str) -> HubError {
        let status = r.status().as_u16();
        let code = header(&r, "x-error-code").unwrap_or_default();
        let message = refusal_text(r);
        let had_token = self.token.is_some();
        match (code.as_str(), status) {
            (_, 401) if !had_token => HubError::PushNeedsToken {
                endpoint: self.endpoint().to_string(),
            },
            (_, 401) => HubError::BadToken {
                endpoint: self.endpoint().to_string(),
            },
            (_, 403) => HubError::NoWriteAccess {
                repo: repo.to_string(),
                message,
            },
            ("RepoNotFound", _) => HubError::RepoNotFound {
                repo: repo.to_string(),
                endpoint: self.endpoint().to_string(),
                had_token,
            },
            ("RevisionNotFound", _) => HubError::RevisionNotFound {
                repo: repo.to_string(),
                revision: revision.to_string(),
            },
            _ => HubError::Http {
                status,
                url: url.to_string(),
                message,
            },
        }
    }

    fn read_json(r: Response, url: &str) -> Result<Value> {
        let text = r
            .into_body()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .map_err(|e| HubError::Network {
                url: url.to_string(),
                message: e.to_string(),
            })?;
        serde_json::from_str(&text).map_err(|e| HubError::Protocol {
            url: url.to_string(),
            why: format!("not JSON: {e}"),
        })
    }

    fn api(&self, repo: &RepoId, what: &str, rev: &str) -> String {
        format!(
            "{}/api/{}/{repo}/{what}/{}",
            self.endpoint(),
            repo.kind.plural(),
            encode_segment(rev)
        )
    }

    /// The repository's page: `{endpoint}/{prefix}{repo}`.
    pub fn repo_url(&self, repo: &RepoId) -> String {
        format!("{}/{}", self.endpoint(), repo.url_path())
    }

    /// Creates the repository; `Ok(false)` when it already exists (`409`).
    pub fn create_repo(&self, repo: &RepoId, private: bool) -> Result<bool> {
        let url = format!("{}/api/repos/create", self.endpoint());
        let mut body = json!({"name": repo.name, "organization": repo.org, "type": repo.kind.name(),
            "private": private});
        if private {
            body["visibility"] = json!("private");
        }
        let r = self.send_json(&url, "application/json", &body)?;
        match r.status().as_u16() {
            200..=299 => Ok(true),
            409 => Ok(false),
            _ => Err(self.write_error(r, &url, &repo.to_string(), "")),
        }
    }

    /// Creates branch `branch` (from the default branch); `Ok(false)` when it exists.
    pub fn create_branch(&self, repo: &RepoId, branch: &str) -> Result<bool> {
        let url = self.api(repo, "branch", branch);
        let r = self.send_json(&url, "application/json", &json!({}))?;
        match r.status().as_u16() {
            200..=299 => Ok(true),
            409 => Ok(false),
            _ => Err(self.write_error(r, &url, &repo.to_string(), branch)),
        }
    }

    /// Asks how each file is to be uploaded (up to 256 files a request, as huggingface_hub).
    pub fn preupload(
        &self,
        repo: &RepoId,
        rev: &str,
        files: &[PreuploadFile],
    ) -> Result<Vec<UploadMode>> {
        let url = self.api(repo, "preupload", rev);
        let mut out = Vec::with_capacity(files.len());
        for chunk in files.chunks(256) {
            let body = json!({"files": chunk.iter().map(|f| json!({"path": f.path,
                "sample": crate::b64::encode(&f.sample), "size": f.size})).collect::<Vec<_>>()});
            let r = self.send_json(&url, "application/json", &body)?;
            if !r.status().is_success() {
                return Err(self.write_error(r, &url, &repo.to_string(), rev));
            }
            let v = Self::read_json(r, &url)?;
            let bad = |why: &str| HubError::Protocol {
                url: url.clone(),
                why: why.to_string(),
            };
            let list = v
                .get("files")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("no 'files' list"))?;
            for f in list {
                let path = f.get("path").and_then(Value::as_str);
                let mode = f.get("uploadMode").and_then(Value::as_str);
                let (Some(path), Some(mode @ ("lfs" | "regular"))) = (path, mode) else {
                    return Err(bad(
                        "a file without 'path' or with an 'uploadMode' other than lfs/regular",
                    ));
                };
                out.push(UploadMode {
                    path: path.to_string(),
                    lfs: mode == "lfs",
                    ignore: f
                        .get("shouldIgnore")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                });
            }
        }
        for f in files {
            if !out.iter().any(|m| m.path == f.path) {
                return Err(HubError::Protocol {
                    url,
                    why: format!("no upload mode for '{}'", f.path),
                });
            }
        }
        Ok(out)
    }

    /// The LFS batch request for `objects` (sha256, size): what to do with each.
    pub fn lfs_batch(
        &self,
        repo: &RepoId,
        rev: &str,
        objects: &[(String, u64)],
    ) -> Result<Vec<LfsAction>> {
        let url = format!(
            "{}/{}.git/info/lfs/objects/batch",
            self.endpoint(),
            repo.url_path()
        );
        let body = json!({"operation": "upload", "transfers": ["basic", "multipart"],
            "objects": objects.iter().map(|(oid, size)| json!({"oid": oid, "size": size})).collect::<Vec<_>>(),
            "hash_algo": "sha256", "ref": {"name": rev}});
        let bytes = body.to_string().into_bytes();
        let lfs = "application/vnd.git-lfs+json";
        let r = self.send(
            "POST",
            &url,
            lfs,
            &[("Accept".into(), lfs.into())],
            &bytes[..],
        )?;
        if !r.status().is_success() {
            return Err(self.write_error(r, &url, &repo.to_string(), rev));
        }
        let v = Self::read_json(r, &url)?;
        let bad = |why: String| HubError::Protocol {
            url: url.clone(),
            why,
        };
        if let Some(t) = v.get("transfer").and_then(Value::as_str) {
            if t != "basic" && t != "multipart" {
                return Err(bad(format!(
                    "the LFS server chose transfer '{t}' (only 'basic' and 'multipart' are \
                     supported)"
                )));
            }
        }
        let list = v
            .get("objects")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no 'objects' list".into()))?;
        let mut out = Vec::new();
        for o in list {
            let oid = o
                .get("oid")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("an object without 'oid'".into()))?;
            if let Some(e) = o.get("error") {
                return Err(HubError::UploadRefused {
                    path: oid.to_string(),
                    message: format!(
                        "LFS error {}: {}",
                        e.get("code").map(Value::to_string).unwrap_or_default(),
                        e.get("message").and_then(Value::as_str).unwrap_or("")
                    ),
                });
            }
            let actions = o.get("actions");
            let upload = actions.and_then(|a| a.get("upload"));
            let verify = actions.and_then(|a| a.get("verify"));
            let href = |a: Option<&Value>| -> Result<Option<String>> {
                match a {
                    None => Ok(None),
                    Some(a) => a
                        .get("href")
                        .and_then(Value::as_str)
                        .map(|h| Some(h.to_string()))
                        .ok_or_else(|| bad(format!("an action of {oid} has no href"))),
                }
            };
            let upload_href = href(upload)?;
            let header = upload.and_then(|u| u.get("header"));
            let size = objects
                .iter()
                .find(|(o, _)| o == oid)
                .map(|(_, s)| *s)
                .ok_or_else(|| bad(format!("an object {oid} that was not asked for")))?;
            let multipart = match &upload_href {
                Some(h) => lfs_multipart::parse(header, h, size)
                    .map_err(|why| bad(format!("the multipart upload of {oid}: {why}")))?,
                None => None,
            };
            // A multipart action's header holds the part URLs, not HTTP headers.
            let upload_headers = if multipart.is_some() {
                Vec::new()
            } else {
                headers_of(header)
            };
            out.push(LfsAction {
                oid: oid.to_string(),
                upload: upload_href,
                upload_headers,
                multipart,
                verify: href(verify)?,
                verify_headers: headers_of(verify.and_then(|u| u.get("header"))),
            });
        }
        Ok(out)
    }

    /// `PUT` of `size` bytes from `reader` to an upload `href` (the basic transfer).
    pub fn lfs_put(
        &self,
        action: &LfsAction,
        href: &str,
        size: u64,
        reader: impl Read + 'static,
        path: &str,
    ) -> Result<()> {
        let mut headers = action.upload_headers.clone();
        headers.push(("Content-Length".into(), size.to_string()));
        let r = self.send(
            "PUT",
            href,
            "",
            &headers,
            ureq::SendBody::from_owned_reader(reader),
        )?;
        if !r.status().is_success() {
            let status = r.status().as_u16();
            return Err(HubError::UploadRefused {
                path: path.to_string(),
                message: format!(
                    "HTTP {status} from the storage host {}",
                    crate::api::origin(href)
                ),
            });
        }
        Ok(())
    }

    /// `POST {verify.href}` `{"oid", "size"}`.
    pub fn lfs_verify(&self, action: &LfsAction, href: &str, size: u64, path: &str) -> Result<()> {
        let body = json!({"oid": action.oid, "size": size})
            .to_string()
            .into_bytes();
        let r = self.send(
            "POST",
            href,
            "application/vnd.git-lfs+json",
            &action.verify_headers,
            &body[..],
        )?;
        if !r.status().is_success() {
            let status = r.status().as_u16();
            return Err(HubError::UploadRefused {
                path: path.to_string(),
                message: format!("the LFS verify step answered HTTP {status}"),
            });
        }
        Ok(())
    }

    /// The NDJSON commit of `ops` onto `rev`.
    pub fn commit(
        &self,
        repo: &RepoId,
        rev: &str,
        summary: &str,
        description: &str,
        ops: &[CommitOp],
    ) -> Result<CommitInfo> {
        let url = self.api(repo, "commit", rev);
        let body = commit_body(summary, description, ops);
        let r = self.send("POST", &url, "application/x-ndjson", &[], &body[..])?;
        if !r.status().is_success() {
            return Err(self.write_error(r, &url, &repo.to_string(), rev));
        }
        let v = Self::read_json(r, &url)?;
        let get = |k: &str| {
            v.get(k)
                .and_then(Value::as_str)
                .map(String::from)
                .ok_or_else(|| HubError::Protocol {
                    url: url.clone(),
                    why: format!("no '{k}' in the commit answer"),
                })
        };
        Ok(CommitInfo {
            url: get("commitUrl")?,
            oid: get("commitOid")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_body_is_header_then_one_line_per_file() {
        let body = commit_body(
            "Upload",
            "",
            &[
                CommitOp::File {
                    path: "a.json".into(),
                    content: b"{}".to_vec(),
                },
                CommitOp::Lfs {
                    path: "m.gguf".into(),
                    sha256: "ab".repeat(32),
                    size: 7,
                },
            ],
        );
        let lines: Vec<Value> = std::str::from_utf8(&body)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0]["key"], "header");
        assert_eq!(lines[0]["value"]["summary"], "Upload");
        assert_eq!(lines[1]["value"]["content"], "e30=");
        assert_eq!(lines[1]["value"]["encoding"], "base64");
        assert_eq!(lines[2]["key"], "lfsFile");
        assert_eq!(lines[2]["value"]["size"], 7);
        assert_eq!(lines[2]["value"]["algo"], "sha256");
    }
}
