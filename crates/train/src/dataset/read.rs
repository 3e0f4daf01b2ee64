//! Rows from CSV, JSON (one array of objects), JSONL and Parquet (`super::parquet`) files, each
//! with the file and 1-based line it starts on (a Parquet row: its row number). A row is a flat JSON object: a CSV row's cells are strings under the
//! header's names; a JSON(L) record is kept as it is.
//!
//! Bad input: a CSV row with the wrong number of cells or bytes that are not UTF-8, a JSONL line
//! that is not JSON, or a JSON array element that is not an object is a [`Problem`] naming its
//! line; the caller skips it or rejects the file. A JSON array that does not parse at all, a CSV
//! without a header or an empty file is an error of the whole file.
//!
//! Not here: what the fields mean ([`super::map`]).

use std::path::Path;

use serde_json::{Map, Value};

use super::Problem;
use crate::{Error, Result};

/// How a file is read, from its extension (`.csv`, `.json`, `.jsonl`/`.ndjson`, `.parquet`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    Csv,
    Json,
    Jsonl,
    Parquet,
}

impl FileKind {
    pub fn of(path: &Path) -> Result<FileKind> {
        let ext = path
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        Ok(match ext.as_str() {
            "csv" => FileKind::Csv,
            "json" => FileKind::Json,
            "jsonl" | "ndjson" => FileKind::Jsonl,
            "parquet" => FileKind::Parquet,
            _ => {
                let want = ".csv, .json, .jsonl or .parquet";
                return Err(Error::Config(format!(
                    "{}: unknown data file type '.{ext}' (expected {want})",
                    path.display()
                )));
            }
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            FileKind::Csv => "csv",
            FileKind::Json => "json",
            FileKind::Jsonl => "jsonl",
            FileKind::Parquet => "parquet",
        }
    }
}

/// One input record and where it came from.
#[derive(Clone, Debug)]
pub struct Row {
    /// The file, as the caller named it.
    pub file: String,
    /// 1-based line the record starts on.
    pub line: usize,
    pub fields: Map<String, Value>,
    /// From a CSV file: every field is a string, and JSON-looking cells may be lists.
    pub from_csv: bool,
}

/// The rows of a file's bytes and the problems of the rows that could not be read.
pub fn read(file: &str, kind: FileKind, bytes: &[u8]) -> Result<(Vec<Row>, Vec<Problem>)> {
    let whole = |line: usize, msg: String| Error::Data {
        path: file.into(),
        line,
        msg,
    };
    let (rows, problems) = match kind {
        FileKind::Csv => csv_rows(file, bytes)?,
        FileKind::Jsonl => {
            let text = std::str::from_utf8(bytes).map_err(|e| {
                let line = bytes[..e.valid_up_to()]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count()
                    + 1;
                whole(line, "the file is not UTF-8".into())
            })?;
            jsonl_rows(file, text)
        }
        FileKind::Parquet => super::parquet::rows(file, bytes)?,
        FileKind::Json => {
            let text =
                std::str::from_utf8(bytes).map_err(|_| whole(0, "the file is not UTF-8".into()))?;
            json_rows(file, text)?
        }
    };
    if rows.is_empty() && problems.is_empty() {
        return Err(whole(0, "no records".into()));
    }
    Ok((rows, problems))
}

fn problem(file: &str, line: usize, message: impl Into<String>) -> Problem {
    Problem {
        file: file.to_string(),
        line,
        message: message.into(),
    }
}

fn row(file: &str, line: usize, v: Value, from_csv: bool) -> std::result::Result<Row, Problem> {
    match v {
        Value::Object(fields) => Ok(Row {
            file: file.to_string(),
            line,
            fields,
            from_csv,
        }),
        other => Err(problem(
            file,
            line,
            format!(
                "a record must be a JSON object, not {}",
                super::map::kind(&other)
            ),
        )),
    }
}

fn jsonl_rows(file: &str, text: &str) -> (Vec<Row>, Vec<Problem>) {
    let (mut rows, mut problems) = (Vec::new(), Vec::new());
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r = serde_json::from_str::<Value>(line)
            .map_err(|e| problem(file, i + 1, format!("not JSON: {e}")))
            .and_then(|v| row(file, i + 1, v, false));
        match r {
            Ok(r) => rows.push(r),
            Err(p) => problems.push(p),
        }
    }
    (rows, problems)
}

/// A JSON array, element by element, so each element's line is known.
fn json_rows(file: &str, text: &str) -> Result<(Vec<Row>, Vec<Problem>)> {
    let line_at = |off: usize| text[..off].bytes().filter(|&b| b == b'\n').count() + 1;
    let fail = |off: usize, msg: String| Error::Data {
        path: file.into(),
        line: line_at(off),
        msg,
    };
    let skip_ws = |mut i: usize| {
        while text.as_bytes().get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        i
    };
    let mut i = skip_ws(0);
    if text.as_bytes().get(i) != Some(&b'[') {
        return Err(fail(
            i,
            "a .json data file must be one array of records (use .jsonl for one record a line)"
                .into(),
        ));
    }
    let (mut rows, mut problems) = (Vec::new(), Vec::new());
    i = skip_ws(i + 1);
    if text.as_bytes().get(i) == Some(&b']') {
        return Ok((rows, problems));
    }
    loop {
        let start = skip_ws(i);
        let mut stream = serde_json::Deserializer::from_str(&text[start..]).into_iter::<Value>();
        let v = match stream.next() {
            Some(Ok(v)) => v,
            Some(Err(e)) => {
                // serde's position is within the element: made absolute for the file's line.
                let msg = e.to_string();
                let msg = msg.rfind(" at line ").map_or(&msg[..], |i| &msg[..i]);
                return Err(Error::Data {
                    path: file.into(),
                    line: line_at(start) + e.line().max(1) - 1,
                    msg: format!("not valid JSON: {msg} (column {})", e.column()),
                });
            }
            None => return Err(fail(start, "the array is not closed".into())),
        };
        match row(file, line_at(start), v, false) {
            Ok(r) => rows.push(r),
            Err(p) => problems.push(p),
        }
        i = skip_ws(start + stream.byte_offset());
        match text.as_bytes().get(i) {
            Some(b',') => i += 1,
            Some(b']') => break,
            _ => return Err(fail(i, "expected ',' or ']' after a record".into())),
        }
    }
    if text[i + 1..].trim().is_empty() {
        Ok((rows, problems))
    } else {
        Err(fail(i + 1, "text after the array".into()))
    }
}

fn csv_rows(file: &str, bytes: &[u8]) -> Result<(Vec<Row>, Vec<Problem>)> {
    let mut rd = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_reader(bytes);
    let headers: Vec<String> = rd
        .headers()
        .map_err(|e| Error::Data {
            path: file.into(),
            line: 1,
            msg: format!("the header row cannot be read: {e}"),
        })?
        .iter()
        .map(|h| h.trim().to_string())
        .collect();
    if headers.iter().all(String::is_empty) {
        return Err(Error::Data {
            path: file.into(),
            line: 1,
            msg: "no header row (the first row names the columns)".into(),
        });
    }
    let (mut rows, mut problems) = (Vec::new(), Vec::new());
    let mut rec = csv::ByteRecord::new();
    loop {
        match rd.read_byte_record(&mut rec) {
            Ok(false) => break,
            Ok(true) => {
                let line = rec.position().map_or(0, |p| p.line() as usize);
                let mut fields = Map::new();
                let mut bad = None;
                for (h, cell) in headers.iter().zip(rec.iter()) {
                    match std::str::from_utf8(cell) {
                        Ok(s) => {
                            fields.insert(h.clone(), Value::String(s.to_string()));
                        }
                        Err(_) => bad = Some(format!("column '{h}' is not UTF-8")),
                    }
                }
                match bad {
                    Some(m) => problems.push(problem(file, line, m)),
                    None => rows.push(Row {
                        file: file.to_string(),
                        line,
                        fields,
                        from_csv: true,
                    }),
                }
            }
            Err(e) => {
                let line = e.position().map_or(0, |p| p.line() as usize);
                match e.kind() {
                    csv::ErrorKind::UnequalLengths {
                        expected_len, len, ..
                    } => problems.push(problem(
                        file,
                        line,
                        format!("{len} cells where the header has {expected_len}"),
                    )),
                    csv::ErrorKind::Io(_) => {
                        return Err(Error::Data {
                            path: file.into(),
                            line,
                            msg: e.to_string(),
                        })
                    }
                    _ => problems.push(problem(file, line, e.to_string())),
                }
            }
        }
    }
    Ok((rows, problems))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_elements_carry_their_lines() {
        let t = "[\n {\"text\": \"a\"},\n 5,\n {\"text\":\n \"b\"}\n]\n";
        let (rows, problems) = read("a.json", FileKind::Json, t.as_bytes()).unwrap();
        assert_eq!(rows.iter().map(|r| r.line).collect::<Vec<_>>(), [2, 4]);
        assert_eq!((problems[0].line, problems.len()), (3, 1));
        let e = read(
            "a.json",
            FileKind::Json,
            b"[\n{\"text\": \"a\"},\n{oops}\n]",
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("a.json:3: not valid JSON"), "{e}");
        let e = read("a.json", FileKind::Json, b"{\"text\": 1}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("one array of records"), "{e}");
    }

    #[test]
    fn csv_rows_and_bad_rows_carry_their_lines() {
        let t = "q,a\nhi,\"hello\nthere\"\nonly one\nx,y\n";
        let (rows, problems) = read("d.csv", FileKind::Csv, t.as_bytes()).unwrap();
        assert_eq!(rows.iter().map(|r| r.line).collect::<Vec<_>>(), [2, 5]);
        assert_eq!(rows[0].fields["a"], "hello\nthere");
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].line, 4, "{problems:?}");
        assert!(problems[0]
            .message
            .contains("1 cells where the header has 2"));
    }
}
