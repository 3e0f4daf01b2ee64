//! The mock Hub's multipart LFS transfer (see `crate::lfs_multipart` for the client): objects of
//! [`super::MockHub::set_multipart`]'s threshold and more get an `upload` action whose `header`
//! holds `chunk_size` and numbered part URLs on the CDN host (`PUT /lfs-part/{oid}/{n}`, each
//! answered with an `ETag` of the part's bytes) and whose `href` is the completion URL on the
//! hub host (`POST /api/complete_multipart/{oid}`, presigned: no token needed). The completion
//! checks the parts list as storage does (every part, in order, its ETag, each part
//! `chunk_size` bytes but the last) and only then assembles the object, pending the verify step
//! that checks its sha256 (`write`). [`super::PartFault`] makes the CDN leave out or change one
//! part's ETag.
//!
//! Not here: the batch request itself and the basic transfer (`write`).

use std::sync::Mutex;

use serde_json::{json, Value};

use super::{sha256, PartFault, Reply, State};

/// The part ETag the CDN answers: a digest of the part's bytes, quoted (as S3 quotes its MD5).
fn part_etag(data: &[u8]) -> String {
    format!("\"{}\"", &sha256(data)[..32])
}

/// The `upload` action for object `oid` of `size` bytes when it goes in parts; records what the
/// completion must receive.
pub(super) fn action(s: &mut State, oid: &str, size: u64) -> Option<Value> {
    let (threshold, chunk) = s.multipart?;
    if size < threshold {
        return None;
    }
    let n = size.div_ceil(chunk);
    let mut header = serde_json::Map::new();
    header.insert("chunk_size".into(), json!(chunk.to_string()));
    for i in 1..=n {
        header.insert(
            format!("{i:05}"),
            json!(format!("{}/lfs-part/{oid}/{i}", s.cdn)),
        );
    }
    s.multipart_expect.insert(oid.to_string(), (size, chunk));
    Some(
        json!({"href": format!("{}/api/complete_multipart/{oid}", s.hub),
        "header": header, "expires_in": 86400}),
    )
}

/// `PUT /lfs-part/{oid}/{n}` on the CDN host.
pub(super) fn put_part(
    rest: &str,
    body: &[u8],
    reply: &mut Reply,
    state: &Mutex<State>,
) -> std::io::Result<()> {
    let Some((oid, n)) = rest
        .split_once('/')
        .and_then(|(o, n)| Some((o.to_string(), n.parse::<u64>().ok()?)))
    else {
        return reply.error(404, "", "not found");
    };
    let mut s = state.lock().unwrap();
    let etag = match s.faults.part_etag {
        Some(PartFault::Missing(k)) if k == n => None,
        Some(PartFault::Wrong(k)) if k == n => Some(part_etag(b"not this part")),
        _ => Some(part_etag(body)),
    };
    s.parts.insert((oid, n), body.to_vec());
    drop(s);
    match etag {
        Some(e) => reply.send(200, &[("ETag", e)], b""),
        None => reply.send(200, &[], b""),
    }
}

/// `POST /api/complete_multipart/{oid}` on the hub host.
pub(super) fn complete(
    oid: &str,
    body: &[u8],
    reply: &mut Reply,
    state: &Mutex<State>,
) -> std::io::Result<()> {
    let Ok(body) = serde_json::from_slice::<Value>(body) else {
        return reply.error(400, "", "the body is not JSON");
    };
    let mut s = state.lock().unwrap();
    let Some(&(size, chunk)) = s.multipart_expect.get(oid) else {
        drop(s);
        return reply.error(
            404,
            "",
            &format!("no multipart upload of {oid} was started"),
        );
    };
    let n = size.div_ceil(chunk);
    let parts = body.get("parts").and_then(Value::as_array);
    if body.get("oid").and_then(Value::as_str) != Some(oid) {
        drop(s);
        return reply.error(400, "", "'oid' does not name this upload");
    }
    let Some(parts) = parts.filter(|p| p.len() as u64 == n) else {
        drop(s);
        return reply.error(400, "", &format!("InvalidPart: {n} parts expected"));
    };
    let mut data = Vec::with_capacity(size as usize);
    for (i, p) in parts.iter().enumerate() {
        let k = i as u64 + 1;
        if p.get("partNumber").and_then(Value::as_u64) != Some(k) {
            drop(s);
            return reply.error(400, "", &format!("InvalidPartOrder: part {k} expected"));
        }
        let etag = p.get("etag").and_then(Value::as_str).unwrap_or("");
        let Some(bytes) = s.parts.get(&(oid.to_string(), k)) else {
            drop(s);
            return reply.error(400, "", &format!("InvalidPart: part {k} was not uploaded"));
        };
        if etag != part_etag(bytes) {
            drop(s);
            return reply.error(
                400,
                "",
                &format!("InvalidPart: the ETag '{etag}' of part {k} is not the part's"),
            );
        }
        let want = if k < n { chunk } else { size - chunk * (n - 1) };
        let got = bytes.len() as u64;
        if got != want {
            drop(s);
            return reply.error(
                400,
                "",
                &format!("InvalidPart: part {k} has {got} bytes, {want} expected"),
            );
        }
        data.extend_from_slice(bytes);
    }
    for k in 1..=n {
        s.parts.remove(&(oid.to_string(), k));
    }
    s.multipart_expect.remove(oid);
    s.lfs_pending.insert(oid.to_string(), data);
    drop(s);
    reply.send(
        200,
        &[("Content-Type", "application/json".into())],
        b"{\"message\":\"ok\"}",
    )
}
