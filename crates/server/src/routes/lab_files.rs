//! `/api/files`: the data files under `$HF2Q_HOME/data/` that jobs read (datasets are built
//! from CSV/JSON/JSONL, calibration and evaluation texts are `.txt`/`.md`): list, upload a new
//! one (its text in a JSON body, so uploads obey the same `Content-Type`/same-origin guard as
//! every state change), delete. An upload is written under a dot-name beside its target and
//! renamed when complete, never over an existing file; nothing outside `data/` is written or
//! removed, and links that point out of the home are neither listed nor followed.
//!
//! Not here: what jobs do with the files (`hf2q_lab::kinds`), datasets (`super::lab_datasets`).

use std::io::Write;
use std::path::Path;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use hf2q_lab::paths::Home;
use serde_json::{json, Value};

use super::lab::blocking;
use super::{json_body, Shared};
use crate::error::{ApiError, ApiResult};

/// The folder of the home that holds data files.
pub const DATA_DIR: &str = "data";
/// File types listed and accepted: dataset inputs and plain texts.
pub const FILE_EXTS: &[&str] = &["csv", "json", "jsonl", "ndjson", "txt", "md"];
/// How deep the listing looks under `data/`.
const DEPTH: usize = 3;

/// The files under `dir` (up to `depth` folders down) whose extension is one of `exts`, as
/// `{"path", "bytes"}` relative to the home, sorted by path. Dot-names and anything that
/// resolves outside the home are skipped.
pub fn walk_files(home: &Home, dir: &Path, depth: usize, exts: &[&str], out: &mut Vec<Value>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = rd.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name().to_string_lossy().to_string();
        let p = e.path();
        let Ok(c) = p.canonicalize() else { continue };
        if name.starts_with('.') || !c.starts_with(home.root()) {
            continue;
        }
        if c.is_dir() {
            if depth > 0 {
                walk_files(home, &p, depth - 1, exts, out);
            }
        } else if has_ext(&name, exts) {
            let bytes = std::fs::metadata(&c).map_or(0, |m| m.len());
            out.push(json!({"path": home.relative(&p), "bytes": bytes}));
        }
    }
}

fn has_ext(name: &str, exts: &[&str]) -> bool {
    Path::new(name)
        .extension()
        .is_some_and(|x| exts.contains(&x.to_string_lossy().to_ascii_lowercase().as_str()))
}

/// `GET /api/files`: every data file.
pub async fn list(State(st): State<Shared>) -> ApiResult<Json<Value>> {
    let files = blocking(&st, |lab| {
        let home = lab.home();
        let mut out = Vec::new();
        walk_files(
            home,
            &home.root().join(DATA_DIR),
            DEPTH,
            FILE_EXTS,
            &mut out,
        );
        Ok(out)
    })
    .await?;
    Ok(Json(json!({"object": "list", "data": files})))
}

/// `POST /api/files {"name": "qa.csv", "content": "..."}`: a new file `data/NAME`; 201 with
/// `{"path", "bytes"}`.
pub async fn upload(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let v = json_body(body, st.cfg.max_body_bytes)?;
    let m = v
        .as_object()
        .ok_or_else(|| ApiError::wrong_type("body", "an object {name, content}"))?;
    if let Some(k) = m
        .keys()
        .find(|k| !["name", "content"].contains(&k.as_str()))
    {
        return Err(ApiError::invalid(
            k,
            format!("{k}: unknown field (known: name, content)"),
        ));
    }
    let name = match m.get("name") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::wrong_type("name", "a string")),
        None => return Err(ApiError::missing("name")),
    };
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => {
            return Err(ApiError::wrong_type(
                "content",
                "a string (the file's text)",
            ))
        }
        None => return Err(ApiError::missing("content")),
    };
    if !has_ext(&name, FILE_EXTS) {
        return Err(ApiError::invalid(
            "name",
            format!(
                "name: '{name}' must end in one of .{}",
                FILE_EXTS.join(", .")
            ),
        ));
    }
    let out = blocking(&st, move |lab| {
        let home = lab.home();
        let target = home.new_output("name", DATA_DIR, &name)?;
        let file = target.file_name().unwrap_or_default().to_string_lossy();
        let tmp = target.with_file_name(format!(".{file}.upload-{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(content.as_bytes())?;
            f.sync_all()?;
            // A file that appeared meanwhile is not replaced: link fails where rename would not.
            std::fs::hard_link(&tmp, &target)?;
            std::fs::remove_file(&tmp)
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(hf2q_lab::Error::io(&target, e));
        }
        Ok(json!({"path": home.relative(&target), "bytes": content.len()}))
    })
    .await?;
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

/// `DELETE /api/files/{path}`: one data file under `data/` (a symbolic link is refused, not
/// followed).
pub async fn delete(
    State(st): State<Shared>,
    UrlPath(path): UrlPath<String>,
) -> ApiResult<Json<Value>> {
    let rel = path.clone();
    blocking(&st, move |lab| {
        let home = lab.home();
        let bad = |m: String| hf2q_lab::Error::path("path", m);
        let under_data = Path::new(&rel)
            .components()
            .next()
            .is_some_and(|c| c.as_os_str() == DATA_DIR);
        if !under_data {
            return Err(bad(format!(
                "'{rel}' is not under {DATA_DIR}/ of $HF2Q_HOME"
            )));
        }
        let joined = home.root().join(&rel);
        if std::fs::symlink_metadata(&joined).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(bad(format!(
                "'{rel}' is a symbolic link; it is not followed"
            )));
        }
        let c = home.existing("path", "", &rel)?;
        if !c.is_file() || !c.starts_with(home.root().join(DATA_DIR)) {
            return Err(bad(format!("'{rel}' is not a data file")));
        }
        std::fs::remove_file(&c).map_err(|e| hf2q_lab::Error::io(&c, e))
    })
    .await?;
    Ok(Json(json!({"path": path, "deleted": true})))
}
