//! `/api/datasets`: the datasets `dataset` jobs built under `$HF2Q_HOME/datasets/NAME/`
//! (`train.jsonl`, `valid.jsonl`, `report.json`) and the data files under `$HF2Q_HOME/data/`
//! they can be built from: list, create (a `dataset` job), preview records, the build's report,
//! delete. A dataset is named by its folder under `datasets/` (one name, no `/`); dot-names (a
//! job's temporary outputs) are neither listed nor served, and nothing outside the home is read
//! or removed (links that point out are refused).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use hf2q_lab::paths::Home;
use serde::Deserialize;
use serde_json::{json, Value};

use super::lab::blocking;
use super::{json_body, Shared};
use crate::error::{ApiError, ApiResult};

/// The most records one preview returns.
const PREVIEW_MAX: usize = 100;
/// Data file types a dataset is built from.
const DATA_EXTS: &[&str] = &["csv", "json", "jsonl", "ndjson"];

fn bad(m: String) -> hf2q_lab::Error {
    hf2q_lab::Error::path("name", m)
}

/// The canonical folder of dataset `name`, refused when it is not a plain name of a folder
/// under `datasets/` inside the home.
fn folder(home: &Home, name: &str) -> hf2q_lab::Result<PathBuf> {
    if name.contains('/') || name.starts_with('.') {
        return Err(bad(format!(
            "'{name}' is not a dataset name (a folder under datasets/, not starting with '.')"
        )));
    }
    let joined = home.root().join("datasets").join(name);
    if std::fs::symlink_metadata(&joined).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(bad(format!(
            "'{name}' is a symbolic link; it is not followed"
        )));
    }
    let c = home.existing("name", "datasets", name)?;
    if !c.is_dir() {
        return Err(bad(format!("'{name}' is not a dataset folder")));
    }
    Ok(c)
}

fn report(dir: &Path) -> Value {
    std::fs::read(dir.join("report.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null)
}

/// `GET /api/datasets`.
pub async fn list(State(st): State<Shared>) -> ApiResult<Json<Value>> {
    let (data, files) = blocking(&st, |lab| {
        let home = lab.home();
        let mut data = Vec::new();
        if let Ok(rd) = std::fs::read_dir(home.root().join("datasets")) {
            let mut names: Vec<String> = rd
                .flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| !n.starts_with('.'))
                .collect();
            names.sort();
            for n in names {
                let Ok(dir) = folder(home, &n) else { continue };
                let r = report(&dir);
                data.push(json!({
                    "name": n,
                    "path": home.relative(&dir),
                    "format": r["format"],
                    "train": r["train"],
                    "valid": r["valid"],
                }));
            }
        }
        let mut files = Vec::new();
        super::lab_files::walk_files(home, &home.root().join("data"), 3, DATA_EXTS, &mut files);
        Ok((data, files))
    })
    .await?;
    Ok(Json(
        json!({"object": "list", "data": data, "files": files}),
    ))
}

/// `POST /api/datasets {params of a dataset job}`: a `dataset` job; 201 with it.
pub async fn create(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let v = json_body(body, st.cfg.max_body_bytes)?;
    if !v.is_object() {
        return Err(ApiError::wrong_type(
            "body",
            "an object of dataset job params",
        ));
    }
    let job = blocking(&st, move |l| l.submit("dataset", v)).await?;
    Ok((StatusCode::CREATED, Json(job)).into_response())
}

#[derive(Deserialize)]
pub struct PreviewQuery {
    /// `train` (default) or `valid`.
    split: Option<String>,
    offset: Option<usize>,
    limit: Option<usize>,
}

/// `GET /api/datasets/{name}/preview?split=&offset=&limit=`: records of one split.
pub async fn preview(
    State(st): State<Shared>,
    UrlPath(name): UrlPath<String>,
    Query(q): Query<PreviewQuery>,
) -> ApiResult<Json<Value>> {
    let split = q.split.unwrap_or_else(|| "train".into());
    if split != "train" && split != "valid" {
        return Err(ApiError::invalid(
            "split",
            "split: must be 'train' or 'valid'",
        ));
    }
    let offset = q.offset.unwrap_or(0);
    let limit = q.limit.unwrap_or(20);
    if limit == 0 || limit > PREVIEW_MAX {
        return Err(ApiError::invalid(
            "limit",
            format!("limit: must be 1 to {PREVIEW_MAX}"),
        ));
    }
    let out = blocking(&st, move |lab| {
        let dir = folder(lab.home(), &name)?;
        let path = dir.join(format!("{split}.jsonl"));
        let f = std::fs::File::open(&path).map_err(|e| hf2q_lab::Error::io(&path, e))?;
        let mut records = Vec::new();
        let mut total = 0usize;
        for (i, line) in BufReader::new(f).lines().enumerate() {
            let line = line.map_err(|e| hf2q_lab::Error::io(&path, e))?;
            total += 1;
            if i >= offset && records.len() < limit {
                records.push(serde_json::from_str::<Value>(&line).unwrap_or(Value::Null));
            }
        }
        Ok(json!({"name": name, "split": split, "offset": offset, "total": total, "data": records}))
    })
    .await?;
    Ok(Json(out))
}

/// `GET /api/datasets/{name}/stats`: the build's report (counts, skipped rows, duplicates,
/// token lengths when the job named a model).
pub async fn stats(
    State(st): State<Shared>,
    UrlPath(name): UrlPath<String>,
) -> ApiResult<Json<Value>> {
    let r = blocking(&st, move |lab| {
        let dir = folder(lab.home(), &name)?;
        let p = dir.join("report.json");
        let b = std::fs::read(&p).map_err(|e| hf2q_lab::Error::io(&p, e))?;
        serde_json::from_slice::<Value>(&b).map_err(|e| {
            hf2q_lab::Error::NotFound(format!("{}: not a report: {e}", lab.home().relative(&p)))
        })
    })
    .await?;
    Ok(Json(r))
}

/// `DELETE /api/datasets/{name}`: removes the dataset's folder.
pub async fn delete(
    State(st): State<Shared>,
    UrlPath(name): UrlPath<String>,
) -> ApiResult<Json<Value>> {
    let n = name.clone();
    blocking(&st, move |lab| {
        let dir = folder(lab.home(), &n)?;
        std::fs::remove_dir_all(&dir).map_err(|e| hf2q_lab::Error::io(&dir, e))
    })
    .await?;
    Ok(Json(json!({"name": name, "deleted": true})))
}
