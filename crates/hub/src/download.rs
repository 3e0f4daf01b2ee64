//! One file into the cache: bytes go to `blobs/<etag>.incomplete`, resumed from its length with
//! `Range: bytes=N-` after a cut connection (a `200` instead of `206` means the server ignored
//! the range: the file restarts from zero), then the size and, for LFS files, the sha256 (their
//! ETag) are checked, and only then is it renamed to `blobs/<etag>`. A size or hash that does not
//! match removes the partial file: nothing half-written stays.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use indicatif::ProgressBar;
use sha2::{Digest, Sha256};

use crate::api::{Client, FileMeta};
use crate::error::{HubError, IoContext, Result, Target};

/// Attempts per file before giving up (each resumes where the last stopped).
pub const TRIES: usize = 5;

/// Downloads `meta` to `blob` (through `blob.incomplete`), with `bar` counting bytes.
pub fn fetch_blob(
    client: &Client,
    meta: &FileMeta,
    target: &Target,
    blob: &Path,
    bar: &ProgressBar,
) -> Result<()> {
    let name = target.path.clone().unwrap_or_default();
    let partial = PathBuf::from(format!("{}.incomplete", blob.display()));
    if let Some(dir) = blob.parent() {
        fs::create_dir_all(dir).at(dir)?;
    }
    let mut last = String::new();
    for _ in 0..TRIES {
        let have = fs::metadata(&partial).map(|m| m.len()).unwrap_or(0);
        let have = if have > meta.size { 0 } else { have };
        bar.set_position(have);
        if have == meta.size && have > 0 {
            break;
        }
        let fetched = match client.get(&meta.location, have, target) {
            Ok(f) => f,
            Err(e @ HubError::Network { .. }) => {
                last = e.to_string();
                continue;
            }
            Err(e) => return Err(e),
        };
        let (mut file, from) = match fetched.status {
            206 => {
                let start = fetched
                    .response
                    .headers()
                    .get("content-range")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("bytes "))
                    .and_then(|v| v.split('-').next())
                    .and_then(|v| v.parse::<u64>().ok());
                if start != Some(have) {
                    return Err(HubError::Protocol {
                        url: fetched.url,
                        why: format!(
                            "asked for bytes from {have}, got a range starting at {start:?}"
                        ),
                    });
                }
                (
                    OpenOptions::new()
                        .append(true)
                        .create(true)
                        .open(&partial)
                        .at(&partial)?,
                    have,
                )
            }
            416 if have == meta.size => break,
            // 200: the whole file (the server ignored the range, or none was asked): restart.
            _ => (File::create(&partial).at(&partial)?, 0),
        };
        bar.set_position(from);
        let mut reader = fetched.response.into_body().into_reader();
        let mut got = from;
        let mut buf = vec![0u8; 1 << 16];
        let outcome: std::io::Result<()> = loop {
            match reader.read(&mut buf) {
                Ok(0) => break Ok(()),
                Ok(n) => {
                    got += n as u64;
                    if got > meta.size {
                        drop(file);
                        let _ = fs::remove_file(&partial);
                        return Err(HubError::SizeMismatch {
                            path: name,
                            expected: meta.size,
                            got,
                        });
                    }
                    file.write_all(&buf[..n]).at(&partial)?;
                    bar.inc(n as u64);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        file.sync_all().at(&partial)?;
        match outcome {
            Ok(()) if got == meta.size => break,
            Ok(()) => last = format!("the connection closed at byte {got} of {}", meta.size),
            Err(e) => last = e.to_string(),
        }
    }
    let got = fs::metadata(&partial).map(|m| m.len()).unwrap_or(0);
    if got != meta.size {
        if got > meta.size {
            let _ = fs::remove_file(&partial);
            return Err(HubError::SizeMismatch {
                path: name,
                expected: meta.size,
                got,
            });
        }
        return Err(HubError::Incomplete {
            path: name,
            tries: TRIES,
            last,
        });
    }
    if let Some(expected) = meta.sha256() {
        let got = sha256_file(&partial)?;
        if !got.eq_ignore_ascii_case(expected) {
            let _ = fs::remove_file(&partial);
            return Err(HubError::HashMismatch {
                path: name,
                expected: expected.to_string(),
                got,
            });
        }
    }
    fs::rename(&partial, blob).at(blob)
}

/// The sha256 of a file, in lower-case hex.
pub fn sha256_file(p: &Path) -> Result<String> {
    let mut f = File::open(p).at(p)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).at(p)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
