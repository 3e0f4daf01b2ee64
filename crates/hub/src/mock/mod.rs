//! A Hub on loopback for tests (feature `mock`): a real HTTP/1.1 server (std `TcpListener`, a
//! thread per connection, one request per connection) answering the routes of the Hub's
//! documented API, and a second loopback host standing for the CDN that LFS files redirect to.
//!
//! - `GET /api/models/{org}/{name}[/revision/{rev}]`: `{"id", "sha", "siblings": [{"rfilename"}]}`
//!   (no `siblings` after [`MockHub::omit_siblings`]);
//! - `GET /api/models/{org}/{name}/tree/{rev}[/{path}][?recursive=true]`: the paged tree
//!   listing (`tree`);
//! - `HEAD|GET /{org}/{name}/resolve/{rev}/{path}`: small files answered directly (`ETag`, `Range`);
//!   LFS files (`.gguf`, `.safetensors`, `.bin`, or 1 MiB and more) `302` to the CDN with
//!   `X-Linked-Etag` (the sha256) and `X-Linked-Size`; both carry `X-Repo-Commit`.
//! - the same under `/api/datasets/..` and `/datasets/{org}/{name}/resolve/..` for datasets;
//! - the write API (`write`): repository and branch creation, preupload, the LFS batch API with
//!   uploads to the CDN host (in parts above [`MockHub::set_multipart`]'s threshold:
//!   `multipart`) and a verify step, and NDJSON commits, each commit a new snapshot that the read
//!   routes serve;
//! - errors as the Hub words them: `X-Error-Code` `GatedRepo` (401 without a token, 403 with one
//!   that has no access), `RepoNotFound`, `RevisionNotFound`, `EntryNotFound` (404).
//!
//! Whether a file is stored in LFS follows [`MockHub::set_lfs_threshold`] (1 MiB unless set) and
//! the extensions above. Repositories come from [`MockHub::add_repo`] or a folder (`DIR/ORG/NAME/<files>`,
//! [`MockHub::add_dir`]). [`Faults`] injects a cut connection, an ignored `Range`, corrupt or
//! oversized bodies; [`MockHub::requests`] records what arrived on each host (the
//! `Authorization` header included). A small file's ETag is a 40-hex digest of its bytes (the
//! real Hub uses the git blob id: clients treat it as an opaque name).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

mod multipart;
mod tree;
mod write;

/// Faults to inject (set with [`MockHub::set_faults`]).
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Close the connection after this many body bytes of this file, once.
    pub cut_once: Option<(String, u64)>,
    /// Answer `200` with the whole file to requests with `Range`.
    pub ignore_range: bool,
    /// Serve these files with one byte changed (same size).
    pub corrupt: BTreeSet<String>,
    /// Serve these files with one byte too many.
    pub oversize: BTreeSet<String>,
    /// A multipart upload's part (1-based) answered without its ETag or with a wrong one.
    pub part_etag: Option<PartFault>,
}

/// What the CDN does to one part's ETag of a multipart upload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartFault {
    Missing(u64),
    Wrong(u64),
}

/// Which host a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Host {
    Hub,
    Cdn,
}

/// One request as received.
#[derive(Clone, Debug)]
pub struct Seen {
    pub host: Host,
    pub method: String,
    pub path: String,
    pub authorization: Option<String>,
    pub range: Option<String>,
}

type Files = BTreeMap<String, Vec<u8>>;

#[derive(Clone, Debug, Default)]
struct Repo {
    /// Commit -> the files at it.
    snapshots: BTreeMap<String, Files>,
    /// Branch or tag -> commit (`main` always).
    refs: BTreeMap<String, String>,
    /// `Some(tokens)`: gated; these tokens have accepted the licence.
    gated: Option<Vec<String>>,
}

#[derive(Default)]
struct State {
    /// `org/name` for models, `datasets/org/name` for datasets.
    repos: BTreeMap<String, Repo>,
    faults: Faults,
    seen: Vec<Seen>,
    cdn: String,
    hub: String,
    /// Files of this many bytes and more are LFS files.
    lfs_threshold: u64,
    /// LFS objects by sha256: verified (`lfs`) and uploaded, not yet verified (`lfs_pending`).
    lfs: BTreeMap<String, Vec<u8>>,
    lfs_pending: BTreeMap<String, Vec<u8>>,
    /// Objects of `.0` bytes and more are uploaded in parts of `.1` bytes.
    multipart: Option<(u64, u64)>,
    /// Multipart uploads started: oid -> (size, chunk size); parts stored by (oid, number).
    multipart_expect: BTreeMap<String, (u64, u64)>,
    parts: BTreeMap<(String, u64), Vec<u8>>,
    /// Tokens refused (403) on writes.
    read_only_tokens: Vec<String>,
    /// Entries a page of the tree listing.
    tree_page_size: usize,
    /// Answer repo info without `siblings`.
    omit_siblings: bool,
}

impl State {
    fn is_lfs(&self, path: &str, len: u64) -> bool {
        len >= self.lfs_threshold
            || [".gguf", ".safetensors", ".bin"]
                .iter()
                .any(|e| path.ends_with(e))
    }
}

/// The mock Hub and its CDN, both on 127.0.0.1; stopped when dropped.
pub struct MockHub {
    state: Arc<Mutex<State>>,
    hub_addr: String,
    cdn_addr: String,
    stop: Arc<AtomicBool>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256(b: &[u8]) -> String {
    hex(&Sha256::digest(b))
}

/// A small file's ETag: 40 hex digits of a digest of its bytes.
fn small_etag(data: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(format!("blob {}\0", data.len()));
    h.update(data);
    hex(&h.finalize())[..40].to_string()
}

impl MockHub {
    pub fn start() -> Self {
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let hub_addr = serve(Host::Hub, state.clone(), stop.clone());
        let cdn_addr = serve(Host::Cdn, state.clone(), stop.clone());
        {
            let mut s = state.lock().unwrap();
            s.cdn = format!("http://{cdn_addr}");
            s.hub = format!("http://{hub_addr}");
            s.lfs_threshold = 1 << 20;
            s.tree_page_size = 1000;
        }
        MockHub {
            state,
            hub_addr,
            cdn_addr,
            stop,
        }
    }

    /// `http://127.0.0.1:PORT`, the value for `HF_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.hub_addr)
    }

    /// The CDN host's address (`http://127.0.0.1:PORT`).
    pub fn cdn(&self) -> String {
        format!("http://{}", self.cdn_addr)
    }

    /// Adds (or replaces) a repository; returns its `main` commit (40 hex digits, derived from
    /// the name and contents).
    pub fn add_repo(&self, id: &str, files: &[(&str, &[u8])]) -> String {
        let mut h = Sha256::new();
        h.update(id.as_bytes());
        for (p, d) in files {
            h.update(p.as_bytes());
            h.update(sha256(d).as_bytes());
        }
        let commit = hex(&h.finalize())[..40].to_string();
        let repo = Repo {
            snapshots: [(
                commit.clone(),
                files
                    .iter()
                    .map(|(p, d)| (p.to_string(), d.to_vec()))
                    .collect(),
            )]
            .into(),
            refs: [("main".to_string(), commit.clone())].into(),
            gated: None,
        };
        self.state
            .lock()
            .unwrap()
            .repos
            .insert(id.to_string(), repo);
        commit
    }

    /// Adds every `DIR/ORG/NAME/` folder as repository `ORG/NAME` (files under it, recursively).
    pub fn add_dir(&self, dir: &Path) -> std::io::Result<Vec<String>> {
        let mut added = Vec::new();
        for org in std::fs::read_dir(dir)? {
            let org = org?;
            for name in std::fs::read_dir(org.path())? {
                let name = name?;
                let mut files = Vec::new();
                collect(&name.path(), "", &mut files)?;
                let id = format!(
                    "{}/{}",
                    org.file_name().to_string_lossy(),
                    name.file_name().to_string_lossy()
                );
                let refs: Vec<(&str, &[u8])> = files
                    .iter()
                    .map(|(p, d)| (p.as_str(), d.as_slice()))
                    .collect();
                self.add_repo(&id, &refs);
                added.push(id);
            }
        }
        Ok(added)
    }

    /// Points branch or tag `name` of `id` at its current commit.
    pub fn add_ref(&self, id: &str, name: &str) {
        let mut s = self.state.lock().unwrap();
        let r = s.repos.get_mut(id).expect("known repo");
        let c = r.refs["main"].clone();
        r.refs.insert(name.to_string(), c);
    }

    /// Files of this many bytes and more are LFS files (on reads and in preupload answers).
    pub fn set_lfs_threshold(&self, bytes: u64) {
        self.state.lock().unwrap().lfs_threshold = bytes;
    }

    /// LFS objects of `threshold` bytes and more are uploaded in parts of `chunk` bytes (the
    /// batch answer's multipart action); `None` (the default): every object in one PUT.
    pub fn set_multipart(&self, threshold_chunk: Option<(u64, u64)>) {
        self.state.lock().unwrap().multipart = threshold_chunk;
    }

    /// Entries a page of the tree listing (1000 unless set).
    pub fn set_tree_page_size(&self, n: usize) {
        self.state.lock().unwrap().tree_page_size = n;
    }

    /// Repo info answers leave out `siblings` (clients then list the tree).
    pub fn omit_siblings(&self, omit: bool) {
        self.state.lock().unwrap().omit_siblings = omit;
    }

    /// Adds a commit with `files` to `id` and points branch or ref `name` (e.g.
    /// `refs/convert/parquet`) at it, leaving `main` as it was; returns the commit.
    pub fn add_snapshot(&self, id: &str, name: &str, files: &[(&str, &[u8])]) -> String {
        let mut h = Sha256::new();
        h.update(format!("{id}@{name}"));
        for (p, d) in files {
            h.update(p.as_bytes());
            h.update(sha256(d).as_bytes());
        }
        let commit = hex(&h.finalize())[..40].to_string();
        let mut s = self.state.lock().unwrap();
        let r = s.repos.get_mut(id).expect("known repo");
        r.snapshots.insert(
            commit.clone(),
            files
                .iter()
                .map(|(p, d)| (p.to_string(), d.to_vec()))
                .collect(),
        );
        r.refs.insert(name.to_string(), commit.clone());
        commit
    }

    /// Writes with `Authorization: Bearer T` are refused (403) for these tokens.
    pub fn set_read_only_tokens(&self, tokens: &[&str]) {
        self.state.lock().unwrap().read_only_tokens =
            tokens.iter().map(|t| t.to_string()).collect();
    }

    /// The files of repository `key` (`org/name`, or `datasets/org/name`) at `revision`.
    pub fn files(&self, key: &str, revision: &str) -> Option<BTreeMap<String, Vec<u8>>> {
        let s = self.state.lock().unwrap();
        let r = s.repos.get(key)?;
        r.snapshots.get(&resolve_rev(r, revision)?).cloned()
    }

    /// The LFS objects stored (verified), by sha256.
    pub fn lfs_objects(&self) -> Vec<String> {
        self.state.lock().unwrap().lfs.keys().cloned().collect()
    }

    /// Gates `id`: only requests with `Authorization: Bearer T` for T in `tokens` get through.
    pub fn gate(&self, id: &str, tokens: &[&str]) {
        let mut s = self.state.lock().unwrap();
        s.repos.get_mut(id).expect("known repo").gated =
            Some(tokens.iter().map(|t| t.to_string()).collect());
    }

    pub fn set_faults(&self, f: Faults) {
        self.state.lock().unwrap().faults = f;
    }

    /// The requests received so far, on both hosts.
    pub fn requests(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }

    pub fn clear_requests(&self) {
        self.state.lock().unwrap().seen.clear();
    }

    /// Whether any request to the CDN host carried an `Authorization` header.
    pub fn cdn_saw_authorization(&self) -> bool {
        self.requests()
            .iter()
            .any(|r| r.host == Host::Cdn && r.authorization.is_some())
    }
}

impl Drop for MockHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(&self.hub_addr);
        let _ = TcpStream::connect(&self.cdn_addr);
    }
}

fn collect(dir: &Path, prefix: &str, out: &mut Vec<(String, Vec<u8>)>) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let rel = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        if e.path().is_dir() {
            collect(&e.path(), &rel, out)?;
        } else {
            out.push((rel, std::fs::read(e.path())?));
        }
    }
    Ok(())
}

fn serve(host: Host, state: Arc<Mutex<State>>, stop: Arc<AtomicBool>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            let Ok(conn) = conn else { continue };
            let state = state.clone();
            std::thread::spawn(move || {
                let _ = handle(host, conn, &state);
            });
        }
    });
    addr
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

struct Reply<'a> {
    stream: &'a mut TcpStream,
    head_only: bool,
}

impl Reply<'_> {
    fn send(
        &mut self,
        status: u16,
        headers: &[(&str, String)],
        body: &[u8],
    ) -> std::io::Result<()> {
        self.send_cut(status, headers, body, None)
    }

    /// Sends headers (Content-Length = body length) and the body, or only `cut` bytes of it
    /// before closing the connection.
    fn send_cut(
        &mut self,
        status: u16,
        headers: &[(&str, String)],
        body: &[u8],
        cut: Option<u64>,
    ) -> std::io::Result<()> {
        let reason = match status {
            200 => "OK",
            206 => "Partial Content",
            302 => "Found",
            401 => "Unauthorized",
            403 => "Forbidden",
            400 => "Bad Request",
            404 => "Not Found",
            409 => "Conflict",
            411 => "Length Required",
            422 => "Unprocessable Entity",
            416 => "Range Not Satisfiable",
            _ => "Status",
        };
        let mut head = format!("HTTP/1.1 {status} {reason}\r\nConnection: close\r\n");
        let mut has_len = false;
        for (k, v) in headers {
            has_len |= k.eq_ignore_ascii_case("content-length");
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        if !has_len {
            head.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        head.push_str("\r\n");
        self.stream.write_all(head.as_bytes())?;
        if !self.head_only {
            match cut {
                Some(n) => {
                    self.stream
                        .write_all(&body[..(n as usize).min(body.len())])?;
                    self.stream.flush()?;
                    let _ = self.stream.shutdown(Shutdown::Both);
                    return Ok(());
                }
                None => self.stream.write_all(body)?,
            }
        }
        self.stream.flush()
    }

    fn error(&mut self, status: u16, code: &str, message: &str) -> std::io::Result<()> {
        let body = serde_json::json!({ "error": message }).to_string();
        self.send(
            status,
            &[
                ("X-Error-Code", code.to_string()),
                ("X-Error-Message", message.to_string()),
                ("Content-Type", "application/json".into()),
            ],
            body.as_bytes(),
        )
    }
}

fn handle(host: Host, mut stream: TcpStream, state: &Mutex<State>) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let target = parts.next().unwrap_or("").to_string();
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let chunked = headers
        .get("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    let mut body = Vec::new();
    if let Some(n) = headers
        .get("content-length")
        .and_then(|v| v.parse::<usize>().ok())
    {
        body.resize(n, 0);
        reader.read_exact(&mut body)?;
    }
    let (path, query) = target.split_once('?').unwrap_or((target.as_str(), ""));
    let path = path.to_string();
    let auth = headers.get("authorization").cloned();
    let range = headers.get("range").cloned();
    state.lock().unwrap().seen.push(Seen {
        host,
        method: method.clone(),
        path: path.clone(),
        authorization: auth.clone(),
        range: range.clone(),
    });
    let mut reply = Reply {
        stream: &mut stream,
        head_only: method == "HEAD",
    };
    let token = auth
        .as_deref()
        .and_then(|a| a.strip_prefix("Bearer "))
        .map(str::to_string);
    if method == "POST" || method == "PUT" {
        if chunked {
            // As storage hosts do: a body of unknown length is refused.
            return reply.error(411, "", "Length Required: send Content-Length");
        }
        let req = write::Request {
            host,
            method: &method,
            path: &path,
            token: token.as_deref(),
            body: &body,
        };
        return write::handle(&req, &mut reply, state);
    }
    if method != "GET" && method != "HEAD" {
        return reply.error(405, "", "method not allowed");
    }
    if host == Host::Cdn {
        // /blobs/<sha256>/<path>
        let rest = path.strip_prefix("/blobs/").unwrap_or("");
        let (sha, file) = rest.split_once('/').unwrap_or((rest, ""));
        let file = decode(file);
        let data = {
            let s = state.lock().unwrap();
            s.repos
                .values()
                .flat_map(|r| r.snapshots.values().flat_map(|f| f.values()))
                .find(|d| sha256(d) == sha)
                .or_else(|| s.lfs.get(sha))
                .cloned()
        };
        return match data {
            Some(d) => serve_bytes(
                &mut reply,
                state,
                &file,
                &d,
                range.as_deref(),
                &[("ETag", format!("\"{sha}\""))],
            ),
            None => reply.error(404, "", "no such blob"),
        };
    }
    let mut segs: Vec<String> = path
        .trim_start_matches('/')
        .split('/')
        .map(String::from)
        .collect();
    // /api/{models|datasets}/{org}/{name}/tree/{rev}[/{path}]
    if segs.len() >= 6 && segs[0] == "api" && segs[4] == "tree" {
        let Some(key) = write::key(&segs[1], &segs[2], &segs[3]) else {
            return reply.error(404, "", "not found");
        };
        let req = tree::TreeRequest {
            key,
            base: format!("/{}", segs[..5].join("/")),
            rest: &segs[5..],
            query,
            token: token.as_deref(),
        };
        return tree::handle(&req, &mut reply, state);
    }
    // /api/{models|datasets}/{org}/{name}[/revision/{rev}]
    if segs.len() >= 4 && segs[0] == "api" && (segs[1] == "models" || segs[1] == "datasets") {
        let name = format!("{}/{}", segs[2], segs[3]);
        let id = if segs[1] == "datasets" {
            format!("datasets/{name}")
        } else {
            name.clone()
        };
        let rev = if segs.len() >= 6 && segs[4] == "revision" {
            decode(&segs[5..].join("/"))
        } else {
            "main".into()
        };
        let repo = match lookup(state, &id, token.as_deref()) {
            Ok(r) => r,
            Err((status, code, msg)) => return reply.error(status, code, &msg),
        };
        let Some(commit) = resolve_rev(&repo, &rev) else {
            return reply.error(404, "RevisionNotFound", &format!("Invalid rev id: {rev}"));
        };
        let siblings: Vec<_> = repo.snapshots[&commit]
            .keys()
            .map(|f| serde_json::json!({ "rfilename": f }))
            .collect();
        let mut info = serde_json::json!({ "id": name, "modelId": name, "sha": commit,
            "private": false, "gated": repo.gated.is_some(), "siblings": siblings });
        if state.lock().unwrap().omit_siblings {
            info.as_object_mut().map(|o| o.remove("siblings"));
        }
        let body = info.to_string();
        return reply.send(
            200,
            &[("Content-Type", "application/json".into())],
            body.as_bytes(),
        );
    }
    // [datasets/]{org}/{name}/resolve/{rev}/{path}
    let dataset = segs.first().is_some_and(|s| s == "datasets");
    if dataset {
        segs.remove(0);
    }
    if segs.len() >= 5 && segs[2] == "resolve" {
        let id = format!(
            "{}{}/{}",
            if dataset { "datasets/" } else { "" },
            segs[0],
            segs[1]
        );
        let rev = decode(&segs[3]);
        let file = decode(&segs[4..].join("/"));
        let repo = match lookup(state, &id, token.as_deref()) {
            Ok(r) => r,
            Err((status, code, msg)) => return reply.error(status, code, &msg),
        };
        let Some(commit) = resolve_rev(&repo, &rev) else {
            return reply.error(404, "RevisionNotFound", &format!("Invalid rev id: {rev}"));
        };
        let Some(data) = repo.snapshots[&commit].get(&file) else {
            return reply.error(
                404,
                "EntryNotFound",
                &format!("{file} does not exist on \"{rev}\""),
            );
        };
        let (lfs, cdn) = {
            let s = state.lock().unwrap();
            (s.is_lfs(&file, data.len() as u64), s.cdn.clone())
        };
        if lfs {
            let sha = sha256(data);
            let loc = format!("{cdn}/blobs/{sha}/{}", segs[4..].join("/"));
            return reply.send(
                302,
                &[
                    ("Location", loc),
                    ("X-Repo-Commit", commit),
                    ("X-Linked-Etag", format!("\"{sha}\"")),
                    ("X-Linked-Size", data.len().to_string()),
                    ("ETag", format!("\"{}\"", small_etag(sha.as_bytes()))),
                ],
                b"",
            );
        }
        let etag = small_etag(data);
        return serve_bytes(
            &mut reply,
            state,
            &file,
            data,
            range.as_deref(),
            &[("X-Repo-Commit", commit), ("ETag", format!("\"{etag}\""))],
        );
    }
    reply.error(404, "", "not found")
}

type Refusal = (u16, &'static str, String);

fn lookup(state: &Mutex<State>, id: &str, token: Option<&str>) -> Result<Repo, Refusal> {
    let s = state.lock().unwrap();
    let Some(repo) = s.repos.get(id) else {
        return Err((
            404,
            "RepoNotFound",
            format!("Repository Not Found for url: {id}"),
        ));
    };
    if let Some(allowed) = &repo.gated {
        match token {
            None => return Err((401, "GatedRepo", format!("Access to model {id} is restricted. You must have access to it and be authenticated to access it. Please log in."))),
            Some(t) if !allowed.iter().any(|a| a == t) => {
                return Err((403, "GatedRepo", format!("Access to model {id} is restricted and you are not in the authorized list.")))
            }
            Some(_) => {}
        }
    }
    Ok(repo.clone())
}

fn resolve_rev(repo: &Repo, rev: &str) -> Option<String> {
    if repo.snapshots.contains_key(rev) {
        return Some(rev.to_string());
    }
    repo.refs.get(rev).cloned()
}

fn serve_bytes(
    reply: &mut Reply,
    state: &Mutex<State>,
    file: &str,
    data: &[u8],
    range: Option<&str>,
    extra: &[(&str, String)],
) -> std::io::Result<()> {
    let (body, ignore_range, cut) = {
        let mut s = state.lock().unwrap();
        let mut body = data.to_vec();
        if s.faults.corrupt.contains(file) && !body.is_empty() {
            let mid = body.len() / 2;
            body[mid] ^= 0xff;
        }
        if s.faults.oversize.contains(file) {
            body.push(b'!');
        }
        let cut = match &s.faults.cut_once {
            Some((f, n)) if f == file && !reply.head_only => {
                let n = *n;
                s.faults.cut_once = None;
                Some(n)
            }
            _ => None,
        };
        (body, s.faults.ignore_range, cut)
    };
    let mut headers: Vec<(&str, String)> = extra.to_vec();
    headers.push(("Accept-Ranges", "bytes".into()));
    let start = range
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split('-').next())
        .and_then(|s| s.parse::<usize>().ok());
    match start {
        Some(from) if !ignore_range => {
            if from >= body.len() {
                headers.push(("Content-Range", format!("bytes */{}", body.len())));
                return reply.send(416, &headers, b"");
            }
            headers.push((
                "Content-Range",
                format!("bytes {from}-{}/{}", body.len() - 1, body.len()),
            ));
            reply.send_cut(206, &headers, &body[from..], cut)
        }
        _ => reply.send_cut(200, &headers, &body, cut),
    }
}
