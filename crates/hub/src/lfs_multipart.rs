//! The LFS batch API's multipart transfer, in the shapes huggingface_hub's `lfs.py` reads and
//! sends: the `upload` action's `header` carries `chunk_size` (a decimal string) and one
//! presigned URL per part under numbered keys (`"00001"`, `"00002"`, ...); every chunk of
//! `chunk_size` bytes (the last one shorter) is `PUT` to its URL with `Content-Length`, each
//! answer's `ETag` kept as sent, then `POST {upload.href}` (the completion URL)
//! `{"oid": sha256, "parts": [{"partNumber": 1, "etag": ...}, ...]}`. Neither the part URLs
//! (a storage host) nor the completion URL (presigned) get the token, as huggingface_hub sends
//! none to them. The verify step that follows is the basic transfer's (`write_api`).
//!
//! Not here: the batch request (`write_api`), where the bytes come from or the progress bars
//! (`push` hands in a reader per part).

use std::io::Read;

use serde_json::{json, Value};

use crate::api::{header, origin, Client};
use crate::error::{HubError, Result};

/// What the batch answer asks for one object sent in parts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Multipart {
    /// Bytes a part (the last one may be shorter).
    pub chunk_size: u64,
    /// The part URLs, in part order.
    pub parts: Vec<String>,
    /// Where the list of parts is posted when all are stored (`upload.href`).
    pub complete: String,
}

/// Parses an `upload` action's `header` when it asks for a multipart upload of `size` bytes:
/// `Ok(None)` without `chunk_size`; the error says what is malformed.
pub fn parse(
    header: Option<&Value>,
    href: &str,
    size: u64,
) -> std::result::Result<Option<Multipart>, String> {
    let Some(obj) = header.and_then(Value::as_object) else {
        return Ok(None);
    };
    let Some(chunk) = obj.get("chunk_size") else {
        return Ok(None);
    };
    let chunk_size = match chunk {
        Value::String(s) => s.trim().parse::<u64>().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
    .filter(|&c| c > 0)
    .ok_or_else(|| format!("'chunk_size' is not a positive whole number ({chunk})"))?;
    let mut numbered = Vec::new();
    for (k, v) in obj {
        if !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()) {
            let n: u64 = k
                .parse()
                .map_err(|_| format!("part number '{k}' is too large"))?;
            let url = v
                .as_str()
                .ok_or_else(|| format!("the URL of part '{k}' is not a string"))?;
            numbered.push((n, url.to_string()));
        }
    }
    numbered.sort();
    let expected = size.div_ceil(chunk_size);
    if numbered.len() as u64 != expected {
        return Err(format!(
            "{} part URLs for {size} bytes in parts of {chunk_size} (expected {expected})",
            numbered.len()
        ));
    }
    Ok(Some(Multipart {
        chunk_size,
        parts: numbered.into_iter().map(|(_, u)| u).collect(),
        complete: href.to_string(),
    }))
}

impl Multipart {
    /// `(offset, length)` of part `i` (0-based) of an object of `size` bytes.
    pub fn span(&self, i: usize, size: u64) -> (u64, u64) {
        let from = self.chunk_size * i as u64;
        (from, self.chunk_size.min(size.saturating_sub(from)))
    }
}

/// Short text of a refused request: the Hub's `X-Error-Message`, else the JSON `error` or
/// `message`, else the body's first bytes.
pub(crate) fn refusal_text(r: ureq::http::Response<ureq::Body>) -> String {
    if let Some(m) = header(&r, "x-error-message").filter(|m| !m.is_empty()) {
        return m;
    }
    let text = r
        .into_body()
        .with_config()
        .limit(1 << 16)
        .read_to_string()
        .unwrap_or_default();
    serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| {
            ["error", "message"]
                .iter()
                .find_map(|k| v.get(k).and_then(Value::as_str).map(String::from))
        })
        .unwrap_or_else(|| text.chars().take(300).collect())
}

impl Client {
    /// Uploads object `oid` (`size` bytes, `path` in the repository) in the parts `mp` asks for:
    /// `part(offset, len)` gives the reader of each part's bytes.
    pub fn lfs_put_multipart(
        &self,
        mp: &Multipart,
        oid: &str,
        size: u64,
        path: &str,
        part: &mut dyn FnMut(u64, u64) -> Result<Box<dyn Read>>,
    ) -> Result<()> {
        let n = mp.parts.len();
        let refused = |message: String| HubError::UploadRefused {
            path: path.to_string(),
            message,
        };
        let mut etags = Vec::with_capacity(n);
        for (i, url) in mp.parts.iter().enumerate() {
            let (from, len) = mp.span(i, size);
            let reader = part(from, len)?;
            let headers = [("Content-Length".to_string(), len.to_string())];
            let r = self.send_as(
                "PUT",
                url,
                None,
                "",
                &headers,
                ureq::SendBody::from_owned_reader(reader),
            )?;
            let status = r.status().as_u16();
            if !r.status().is_success() {
                return Err(refused(format!(
                    "part {} of {n}: HTTP {status} from the storage host {}: {}",
                    i + 1,
                    origin(url),
                    refusal_text(r)
                )));
            }
            match header(&r, "etag").filter(|e| !e.trim().is_empty()) {
                Some(e) => etags.push(e),
                None => {
                    return Err(refused(format!(
                        "part {} of {n}: the storage host {} answered without an ETag, so the \
                         parts cannot be put together",
                        i + 1,
                        origin(url)
                    )))
                }
            }
        }
        let body = json!({"oid": oid, "parts": etags.iter().enumerate()
            .map(|(i, e)| json!({"partNumber": i + 1, "etag": e})).collect::<Vec<_>>()})
        .to_string()
        .into_bytes();
        let lfs = "application/vnd.git-lfs+json";
        let r = self.send_as(
            "POST",
            &mp.complete,
            None,
            lfs,
            &[("Accept".into(), lfs.into())],
            &body[..],
        )?;
        if !r.status().is_success() {
            let status = r.status().as_u16();
            return Err(refused(format!(
                "completing its {n}-part upload answered HTTP {status}: {}",
                refusal_text(r)
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_sorted_by_number_and_counted() {
        let h = json!({"chunk_size": "4", "00002": "u2", "00001": "u1", "00010": "u10",
            "00003": "u3", "00004": "u4", "00005": "u5", "00006": "u6", "00007": "u7",
            "00008": "u8", "00009": "u9"});
        let mp = parse(Some(&h), "done", 38).unwrap().unwrap();
        assert_eq!(mp.chunk_size, 4);
        assert_eq!(mp.parts[..3], ["u1", "u2", "u3"]);
        assert_eq!(mp.parts[9], "u10");
        assert_eq!(mp.span(9, 38), (36, 2));
        assert_eq!(mp.complete, "done");
        // Wrong count, bad chunk size, no chunk size.
        assert!(parse(Some(&h), "done", 50)
            .unwrap_err()
            .contains("expected 13"));
        let bad = json!({"chunk_size": "x", "00001": "u"});
        assert!(parse(Some(&bad), "", 1).unwrap_err().contains("chunk_size"));
        assert_eq!(parse(Some(&json!({"a": "b"})), "", 1), Ok(None));
        assert_eq!(parse(None, "", 1), Ok(None));
    }
}
