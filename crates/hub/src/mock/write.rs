//! The mock Hub's write API, answering the shapes huggingface_hub sends (see `crate::write_api`
//! for the list): `POST /api/repos/create`, `/api/{kind}/{org}/{name}/branch/{b}`,
//! `/preupload/{rev}` and `/commit/{rev}` (NDJSON), the LFS batch API at
//! `/[datasets/]{org}/{name}.git/info/lfs/objects/batch` with uploads to the CDN host
//! (`PUT /lfs-upload/{oid}`, kept pending) and a verify step on the hub host (`.../verify`, which
//! checks the sha256 and size and only then stores the object); large objects in parts
//! (`multipart`). A commit's `lfsFile` must name a
//! verified object of that size. Every write needs a token (401 without, 403 for a token of
//! [`super::MockHub::set_read_only_tokens`]).

use std::sync::Mutex;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::{hex, resolve_rev, sha256, Files, Host, Reply, Repo, State};

/// A write request as received.
pub(super) struct Request<'a> {
    pub host: Host,
    pub method: &'a str,
    pub path: &'a str,
    pub token: Option<&'a str>,
    pub body: &'a [u8],
}

fn send_json(reply: &mut Reply, status: u16, v: &Value) -> std::io::Result<()> {
    reply.send(
        status,
        &[("Content-Type", "application/json".into())],
        v.to_string().as_bytes(),
    )
}

/// `models`/`datasets` + org + name -> the mock's key (`org/name`, `datasets/org/name`).
pub(super) fn key(kind: &str, org: &str, name: &str) -> Option<String> {
    match kind {
        "models" | "model" => Some(format!("{org}/{name}")),
        "datasets" | "dataset" => Some(format!("datasets/{org}/{name}")),
        _ => None,
    }
}

pub(super) fn handle(
    req: &Request,
    reply: &mut Reply,
    state: &Mutex<State>,
) -> std::io::Result<()> {
    if req.host == Host::Cdn {
        if let ("PUT", Some(rest)) = (req.method, req.path.strip_prefix("/lfs-part/")) {
            return super::multipart::put_part(rest, req.body, reply, state);
        }
        return match (req.method, req.path.strip_prefix("/lfs-upload/")) {
            ("PUT", Some(oid)) => {
                let mut s = state.lock().unwrap();
                s.lfs_pending.insert(oid.to_string(), req.body.to_vec());
                drop(s);
                reply.send(200, &[], b"")
            }
            _ => reply.error(404, "", "not found"),
        };
    }
    // The completion URL is presigned, as the Hub's: no token needed.
    if let Some(oid) = req.path.strip_prefix("/api/complete_multipart/") {
        return super::multipart::complete(oid, req.body, reply, state);
    }
    let Some(token) = req.token else {
        return reply.error(401, "", "Invalid username or password.");
    };
    if state
        .lock()
        .unwrap()
        .read_only_tokens
        .iter()
        .any(|t| t == token)
    {
        return reply.error(
            403,
            "",
            "You don't have the rights to write to this namespace",
        );
    }
    // The commit body is NDJSON (read by `commit`); the others are one JSON object.
    let Ok(body) = (if req.path.contains("/commit/") {
        Ok(Value::Null)
    } else if req.body.is_empty() {
        Ok(json!({}))
    } else {
        serde_json::from_slice::<Value>(req.body)
    }) else {
        return reply.error(400, "", "the body is not JSON");
    };
    let segs: Vec<String> = req
        .path
        .trim_start_matches('/')
        .split('/')
        .map(super::decode)
        .collect();
    let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
    match segs.as_slice() {
        ["api", "repos", "create"] => create(&body, reply, state),
        ["api", kind, org, name, "branch", branch] => match key(kind, org, name) {
            Some(k) => branch_create(&k, branch, reply, state),
            None => reply.error(404, "", "not found"),
        },
        ["api", kind, org, name, "preupload", rev] => match key(kind, org, name) {
            Some(k) => preupload(&k, rev, &body, reply, state),
            None => reply.error(404, "", "not found"),
        },
        ["api", kind, org, name, "commit", rev] => match key(kind, org, name) {
            Some(k) => commit(&k, rev, req.body, reply, state),
            None => reply.error(404, "", "not found"),
        },
        [rest @ .., "info", "lfs", "objects", what] => {
            let (kind, org, git) = match rest {
                ["datasets", org, git] => ("datasets", *org, *git),
                [org, git] => ("models", *org, *git),
                _ => return reply.error(404, "", "not found"),
            };
            let Some(k) = git.strip_suffix(".git").and_then(|n| key(kind, org, n)) else {
                return reply.error(404, "", "not found");
            };
            match *what {
                "batch" => batch(&k, &body, reply, state),
                "verify" => verify(&body, reply, state),
                _ => reply.error(404, "", "not found"),
            }
        }
        _ => reply.error(404, "", "not found"),
    }
}

fn create(body: &Value, reply: &mut Reply, state: &Mutex<State>) -> std::io::Result<()> {
    let (Some(name), Some(org)) = (
        body.get("name").and_then(Value::as_str),
        body.get("organization").and_then(Value::as_str),
    ) else {
        return reply.error(400, "", "name and organization are required");
    };
    let kind = body.get("type").and_then(Value::as_str).unwrap_or("model");
    let Some(k) = key(kind, org, name) else {
        return reply.error(400, "", "unknown repository type");
    };
    let mut s = state.lock().unwrap();
    let url = format!("{}/{k}", s.hub);
    if s.repos.contains_key(&k) {
        drop(s);
        return send_json(
            reply,
            409,
            &json!({"error": "You already created this repo", "url": url}),
        );
    }
    // A new repository has one commit with the Hub's .gitattributes, as on the Hub.
    let files: Files = [(
        ".gitattributes".to_string(),
        b"*.gguf filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs diff=lfs merge=lfs -text\n".to_vec(),
    )]
    .into();
    let commit = hex(&Sha256::digest(format!("init {k}").as_bytes()))[..40].to_string();
    s.repos.insert(
        k.clone(),
        Repo {
            snapshots: [(commit.clone(), files)].into(),
            refs: [("main".to_string(), commit)].into(),
            gated: None,
        },
    );
    drop(s);
    send_json(reply, 200, &json!({"url": url, "name": k}))
}

fn repo_missing(reply: &mut Reply, k: &str) -> std::io::Result<()> {
    reply.error(
        404,
        "RepoNotFound",
        &format!("Repository Not Found for url: {k}"),
    )
}

fn branch_create(
    k: &str,
    branch: &str,
    reply: &mut Reply,
    state: &Mutex<State>,
) -> std::io::Result<()> {
    let mut s = state.lock().unwrap();
    let Some(r) = s.repos.get_mut(k) else {
        drop(s);
        return repo_missing(reply, k);
    };
    if r.refs.contains_key(branch) {
        drop(s);
        return reply.error(
            409,
            "",
            &format!("Reference already exists: refs/heads/{branch}"),
        );
    }
    let head = r.refs["main"].clone();
    r.refs.insert(branch.to_string(), head);
    drop(s);
    send_json(reply, 200, &json!({}))
}

fn preupload(
    k: &str,
    rev: &str,
    body: &Value,
    reply: &mut Reply,
    state: &Mutex<State>,
) -> std::io::Result<()> {
    let s = state.lock().unwrap();
    let Some(r) = s.repos.get(k) else {
        drop(s);
        return repo_missing(reply, k);
    };
    if resolve_rev(r, rev).is_none() {
        drop(s);
        return reply.error(404, "RevisionNotFound", &format!("Invalid rev id: {rev}"));
    }
    let Some(files) = body.get("files").and_then(Value::as_array) else {
        drop(s);
        return reply.error(400, "", "no files");
    };
    let mut out = Vec::new();
    for f in files {
        let (Some(path), Some(size), Some(_sample)) = (
            f.get("path").and_then(Value::as_str),
            f.get("size").and_then(Value::as_u64),
            f.get("sample")
                .and_then(Value::as_str)
                .and_then(crate::b64::decode),
        ) else {
            drop(s);
            return reply.error(400, "", "each file needs path, size and a base64 sample");
        };
        let mode = if s.is_lfs(path, size) {
            "lfs"
        } else {
            "regular"
        };
        out.push(json!({"path": path, "uploadMode": mode, "shouldIgnore": false}));
    }
    drop(s);
    send_json(reply, 200, &json!({"files": out, "commitOid": Value::Null}))
}

fn batch(k: &str, body: &Value, reply: &mut Reply, state: &Mutex<State>) -> std::io::Result<()> {
    let mut s = state.lock().unwrap();
    if !s.repos.contains_key(k) {
        drop(s);
        return repo_missing(reply, k);
    }
    let transfers = body.get("transfers").and_then(Value::as_array);
    let basic = transfers.is_none_or(|t| t.iter().any(|x| x == "basic"));
    let multipart = transfers.is_some_and(|t| t.iter().any(|x| x == "multipart"));
    let (Some(objects), "upload", true) = (
        body.get("objects").and_then(Value::as_array),
        body.get("operation").and_then(Value::as_str).unwrap_or(""),
        basic,
    ) else {
        drop(s);
        return reply.error(
            422,
            "",
            "an upload batch of objects with the basic transfer expected",
        );
    };
    let git = format!("{}/{k}.git/info/lfs/objects", s.hub);
    let mut out = Vec::new();
    for o in objects {
        let (Some(oid), Some(size)) = (
            o.get("oid").and_then(Value::as_str),
            o.get("size").and_then(Value::as_u64),
        ) else {
            drop(s);
            return reply.error(422, "", "each object needs oid and size");
        };
        let verify = json!({"href": format!("{git}/verify"), "header": {}});
        if s.lfs.get(oid).is_some_and(|d| d.len() as u64 == size) {
            out.push(json!({"oid": oid, "size": size}));
        } else if s.multipart.is_some_and(|(t, _)| size >= t) {
            match multipart
                .then(|| super::multipart::action(&mut s, oid, size))
                .flatten()
            {
                Some(upload) => out.push(json!({"oid": oid, "size": size, "authenticated": true,
                    "actions": {"upload": upload, "verify": verify}})),
                None => out.push(json!({"oid": oid, "size": size, "error": {"code": 422,
                    "message": "too large for the basic transfer: ask for 'multipart'"}})),
            }
        } else {
            out.push(
                json!({"oid": oid, "size": size, "authenticated": true, "actions": {
                "upload": {"href": format!("{}/lfs-upload/{oid}", s.cdn), "expires_in": 86400},
                "verify": {"href": format!("{git}/verify"), "header": {}}}}),
            );
        }
    }
    drop(s);
    send_json(reply, 200, &json!({"transfer": "basic", "objects": out}))
}

fn verify(body: &Value, reply: &mut Reply, state: &Mutex<State>) -> std::io::Result<()> {
    let (Some(oid), Some(size)) = (
        body.get("oid").and_then(Value::as_str),
        body.get("size").and_then(Value::as_u64),
    ) else {
        return reply.error(422, "", "oid and size expected");
    };
    let mut s = state.lock().unwrap();
    let Some(data) = s.lfs_pending.get(oid).cloned() else {
        drop(s);
        return reply.error(404, "", &format!("object {oid} was not uploaded"));
    };
    if sha256(&data) != oid || data.len() as u64 != size {
        s.lfs_pending.remove(oid);
        drop(s);
        return reply.error(
            422,
            "",
            &format!("object {oid}: the bytes uploaded do not match"),
        );
    }
    s.lfs_pending.remove(oid);
    s.lfs.insert(oid.to_string(), data);
    drop(s);
    send_json(reply, 200, &json!({"message": "ok"}))
}

fn commit(
    k: &str,
    rev: &str,
    body: &[u8],
    reply: &mut Reply,
    state: &Mutex<State>,
) -> std::io::Result<()> {
    let mut s = state.lock().unwrap();
    let hub = s.hub.clone();
    let Some(r) = s.repos.get(k) else {
        drop(s);
        return repo_missing(reply, k);
    };
    let Some(parent) = r.refs.get(rev).cloned() else {
        drop(s);
        return reply.error(
            404,
            "RevisionNotFound",
            &format!("Invalid rev id: {rev} (commits go to a branch)"),
        );
    };
    let mut files = r.snapshots[&parent].clone();
    let text = String::from_utf8_lossy(body);
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Option<Value> = lines.next().and_then(|l| serde_json::from_str(l).ok());
    let summary = header
        .as_ref()
        .filter(|h| h["key"] == "header")
        .and_then(|h| h["value"]["summary"].as_str());
    if summary.is_none_or(str::is_empty) {
        drop(s);
        return reply.error(400, "", "the first line must be the header with a summary");
    }
    let mut n_ops = 0;
    for l in lines {
        let Ok(v) = serde_json::from_str::<Value>(l) else {
            drop(s);
            return reply.error(400, "", "a line is not JSON");
        };
        let val = &v["value"];
        let Some(path) = val["path"].as_str() else {
            drop(s);
            return reply.error(400, "", "an operation without path");
        };
        match v["key"].as_str() {
            Some("file") => {
                let Some(content) = (val["encoding"] == "base64")
                    .then(|| val["content"].as_str().and_then(crate::b64::decode))
                    .flatten()
                else {
                    drop(s);
                    return reply.error(400, "", &format!("{path}: content is not base64"));
                };
                files.insert(path.to_string(), content);
            }
            Some("lfsFile") => {
                let (oid, size) = (val["oid"].as_str().unwrap_or(""), val["size"].as_u64());
                match s.lfs.get(oid) {
                    Some(d) if Some(d.len() as u64) == size && val["algo"] == "sha256" => {
                        files.insert(path.to_string(), d.clone());
                    }
                    _ => {
                        drop(s);
                        return reply.error(
                            422,
                            "",
                            &format!("{path}: LFS object {oid} of that size is not stored"),
                        );
                    }
                }
            }
            Some("deletedFile") => {
                files.remove(path);
            }
            _ => {
                drop(s);
                return reply.error(400, "", "unknown operation");
            }
        }
        n_ops += 1;
    }
    if n_ops == 0 {
        drop(s);
        return reply.error(400, "", "no operations");
    }
    let mut h = Sha256::new();
    h.update(parent.as_bytes());
    h.update(body);
    let oid = hex(&h.finalize())[..40].to_string();
    let r = s.repos.get_mut(k).expect("checked above");
    r.snapshots.insert(oid.clone(), files);
    r.refs.insert(rev.to_string(), oid.clone());
    drop(s);
    send_json(
        reply,
        200,
        &json!({"commitUrl": format!("{hub}/{k}/commit/{oid}"), "commitOid": oid, "success": true}),
    )
}
