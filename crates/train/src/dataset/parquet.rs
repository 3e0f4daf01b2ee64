//! Rows of a Parquet file: the format of most dataset repositories on the Hub and of their
//! `refs/convert/parquet` conversions. Read with the `parquet` crate's row reader (no Arrow):
//! each row becomes a JSON object as that crate converts it: strings, numbers and booleans as
//! themselves, lists as arrays, structs and maps as objects, binary as base64 and dates as
//! text, so a `messages` column of `list<struct<role, content>>` reads as a JSONL file's
//! `messages` field does. A row's "line" is its 1-based row number in the file.
//!
//! Codecs read: uncompressed, Snappy (pyarrow's default), zstd, gzip and LZ4; a file with
//! another (Brotli, LZO) is an error of the whole file that says so, as is one that is not
//! Parquet or whose pages do not decode.
//!
//! Not here: what the fields mean ([`super::map`]).

use bytes::Bytes;
use parquet::file::reader::{FileReader, SerializedFileReader};
use serde_json::Value;

use super::read::Row;
use super::Problem;
use crate::{Error, Result};

/// The codecs this build decodes, for error messages.
const CODECS: &str = "uncompressed, Snappy, zstd, gzip or LZ4";

/// The rows of a Parquet file's bytes (`file` names it in messages).
pub fn rows(file: &str, bytes: &[u8]) -> Result<(Vec<Row>, Vec<Problem>)> {
    let whole = |line: usize, msg: String| Error::Data {
        path: file.into(),
        line,
        msg,
    };
    let explain = |e: parquet::errors::ParquetError| {
        let m = e.to_string();
        if m.contains("Disabled feature") || m.contains("not supported") {
            format!("{m} (hf2q reads Parquet files that are {CODECS})")
        } else {
            m
        }
    };
    let reader = SerializedFileReader::new(Bytes::copy_from_slice(bytes))
        .map_err(|e| whole(0, format!("not a readable Parquet file: {}", explain(e))))?;
    let iter = reader
        .get_row_iter(None)
        .map_err(|e| whole(0, explain(e)))?;
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for (i, r) in iter.enumerate() {
        let row = r.map_err(|e| whole(i + 1, explain(e)))?;
        match row.to_json_value() {
            Value::Object(fields) => out.push(Row {
                file: file.to_string(),
                line: i + 1,
                fields,
                from_csv: false,
            }),
            other => problems.push(Problem {
                file: file.to_string(),
                line: i + 1,
                message: format!("a row read as {other}, not an object"),
            }),
        }
    }
    Ok((out, problems))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_is_not_parquet() {
        let e = rows("x.parquet", b"PAR1").unwrap_err().to_string();
        assert!(e.contains("x.parquet") && e.contains("Parquet"), "{e}");
        let e = rows("y.parquet", b"").unwrap_err().to_string();
        assert!(e.contains("y.parquet"), "{e}");
    }
}
