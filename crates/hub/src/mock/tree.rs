//! The mock Hub's tree listing: `GET /api/{models|datasets}/{org}/{name}/tree/{rev}[/{path}]`
//! in the Hub's documented shape, a JSON array of `{"type": "file"|"directory", "oid", "size",
//! "path", "lfs"?: {"oid", "size", "pointerSize"}}`: the direct children of the path, or with
//! `?recursive=true` every entry below it, in path order, [`super::MockHub::set_tree_page_size`]
//! entries a page, the next page named by a `Link: <URL>; rel="next"` header (`cursor=N`, the
//! offset: opaque to clients). A path that is no folder of the revision is `EntryNotFound`.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde_json::{json, Value};

use super::{decode, lookup, resolve_rev, sha256, small_etag, Reply, State};

/// A tree request: the repository key (`org/name`, `datasets/org/name`), the rest of the path
/// after `tree/` (revision, then folder), the query string, and the token.
pub(super) struct TreeRequest<'a> {
    pub key: String,
    /// `/api/{kind}/{org}/{name}/tree`, to build the next page's URL.
    pub base: String,
    pub rest: &'a [String],
    pub query: &'a str,
    pub token: Option<&'a str>,
}

fn query_param<'q>(query: &'q str, name: &str) -> Option<&'q str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The size of a Git LFS pointer file for `size` bytes: its version line (43 bytes), its
/// `oid sha256:<64 hex>` line (76) and its `size N` line (6 + digits).
fn pointer_size(size: u64) -> u64 {
    125 + size.to_string().len() as u64
}

pub(super) fn handle(
    req: &TreeRequest,
    reply: &mut Reply,
    state: &Mutex<State>,
) -> std::io::Result<()> {
    let Some(rev) = req.rest.first().map(|r| decode(r)) else {
        return reply.error(404, "", "not found");
    };
    let dir = decode(&req.rest[1..].join("/"))
        .trim_matches('/')
        .to_string();
    let recursive = query_param(req.query, "recursive").is_some_and(|v| v == "true" || v == "1");
    let from: usize = query_param(req.query, "cursor")
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let repo = match lookup(state, &req.key, req.token) {
        Ok(r) => r,
        Err((status, code, msg)) => return reply.error(status, code, &msg),
    };
    let Some(commit) = resolve_rev(&repo, &rev) else {
        return reply.error(404, "RevisionNotFound", &format!("Invalid rev id: {rev}"));
    };
    let files = &repo.snapshots[&commit];
    let (hub, lfs_of, page) = {
        let s = state.lock().unwrap();
        let lfs: BTreeMap<&String, bool> = files
            .iter()
            .map(|(p, d)| (p, s.is_lfs(p, d.len() as u64)))
            .collect();
        (s.hub.clone(), lfs, s.tree_page_size.max(1))
    };
    let prefix = if dir.is_empty() {
        String::new()
    } else {
        format!("{dir}/")
    };
    let below = |p: &str| p.strip_prefix(prefix.as_str()).map(str::to_string);
    if !dir.is_empty() && !files.keys().any(|p| p.starts_with(&prefix)) {
        return reply.error(
            404,
            "EntryNotFound",
            &format!("{dir} does not exist on \"{rev}\""),
        );
    }
    // Path -> entry, folders derived from the files' paths.
    let mut entries: BTreeMap<String, Value> = BTreeMap::new();
    for (path, data) in files {
        let Some(rel) = below(path) else { continue };
        let parts: Vec<&str> = rel.split('/').collect();
        let depth = if recursive { parts.len() } else { 1 };
        for i in 1..parts.len().min(depth + 1) {
            let folder = format!("{prefix}{}", parts[..i].join("/"));
            let oid = small_etag(folder.as_bytes());
            entries.insert(
                folder.clone(),
                json!({"type": "directory", "oid": oid, "size": 0, "path": folder}),
            );
        }
        if parts.len() > depth {
            continue;
        }
        let size = data.len() as u64;
        let mut e = json!({"type": "file", "oid": small_etag(data), "size": size, "path": path});
        if lfs_of[path] {
            let sha = sha256(data);
            e["lfs"] = json!({"oid": sha, "size": size, "pointerSize": pointer_size(size)});
            e["oid"] = json!(small_etag(sha.as_bytes()));
        }
        entries.insert(path.clone(), e);
    }
    let all: Vec<Value> = entries.into_values().collect();
    let end = (from + page).min(all.len());
    let body = Value::Array(all[from.min(end)..end].to_vec()).to_string();
    let mut headers = vec![("Content-Type", "application/json".to_string())];
    if end < all.len() {
        let mut next = format!("{hub}{}/{}", req.base, req.rest.join("/"));
        next.push_str(&format!(
            "?{}cursor={end}",
            if recursive { "recursive=true&" } else { "" }
        ));
        headers.push(("Link", format!("<{next}>; rel=\"next\"")));
    }
    reply.send(200, &headers, body.as_bytes())
}
