//! What the templates generate from, read from files: lists (seed tasks, topics, prompts),
//! documents cut into passages (qa), and texts or records to rewrite (rephrase). Each item
//! keeps its file and 1-based line, which the report names when its generation is skipped.
//!
//! Formats: a list is one item a line, or JSONL / a JSON array whose items are strings or
//! objects with one of [`LIST_FIELDS`]. Documents are `.txt` / `.md` files (a folder: all of
//! them under it, in path order), cut at blank lines into passages of at most `max_chars`.
//! Rephrase inputs are text lines (`.txt`) or records (`.csv`, `.json`, `.jsonl`, read as the
//! dataset builder reads them).
//!
//! Bad input is an error naming the file (and line) when the file as a whole cannot be used;
//! a record of a rephrase input that cannot be used is a [`Problem`] (skipped and counted).

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::super::{map, read, FileKind, Format, Item, Problem};
use crate::{Error, Result};

/// The object fields a list item is taken from, the first present one.
pub const LIST_FIELDS: &[&str] = &[
    "instruction",
    "prompt",
    "question",
    "task",
    "topic",
    "text",
    "input",
    "content",
];

/// Document files a `--source` folder is read for.
pub const DOC_EXTS: &[&str] = &["txt", "md", "markdown"];

/// One item and where it is.
#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    pub file: String,
    pub line: usize,
    pub text: String,
}

fn name_of(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().to_string(),
    )
}

fn ext(path: &Path) -> String {
    path.extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default()
}

fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    String::from_utf8(bytes).map_err(|_| Error::Data {
        path: path.into(),
        line: 0,
        msg: "the file is not UTF-8 text".into(),
    })
}

fn item_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => LIST_FIELDS
            .iter()
            .find_map(|f| o.get(*f).and_then(Value::as_str).map(str::to_string)),
        _ => None,
    }
}

/// The items of a list file (blank items are left out; an empty list is an error).
pub fn read_list(path: &Path) -> Result<Vec<Line>> {
    let text = read_text(path)?;
    parse_list(&name_of(path), &ext(path), &text)
}

/// [`read_list`] of text already read; `ext` picks the format (`jsonl`, `json`, else lines).
pub fn parse_list(file: &str, ext: &str, text: &str) -> Result<Vec<Line>> {
    let bad = |line: usize, msg: String| Error::Data {
        path: file.into(),
        line,
        msg,
    };
    let what = || {
        format!(
            "expected a string or an object with one of the text fields {}",
            LIST_FIELDS.join(", ")
        )
    };
    let mut out = Vec::new();
    match ext {
        "jsonl" | "ndjson" => {
            for (i, l) in text.lines().enumerate() {
                if l.trim().is_empty() {
                    continue;
                }
                let v: Value =
                    serde_json::from_str(l).map_err(|e| bad(i + 1, format!("not JSON: {e}")))?;
                let t = item_text(&v).ok_or_else(|| bad(i + 1, what()))?;
                out.push((i + 1, t));
            }
        }
        "json" => {
            let v: Value =
                serde_json::from_str(text).map_err(|e| bad(e.line(), format!("not JSON: {e}")))?;
            let items = v
                .as_array()
                .ok_or_else(|| bad(1, "expected one JSON array".into()))?;
            for (i, it) in items.iter().enumerate() {
                let t = item_text(it)
                    .ok_or_else(|| bad(i + 1, format!("item {}: {}", i + 1, what())))?;
                out.push((i + 1, t));
            }
        }
        _ => out.extend(
            text.lines()
                .enumerate()
                .map(|(i, l)| (i + 1, l.to_string())),
        ),
    }
    let lines: Vec<Line> = out
        .into_iter()
        .filter(|(_, t)| !t.trim().is_empty())
        .map(|(line, t)| Line {
            file: file.to_string(),
            line,
            text: t.trim().to_string(),
        })
        .collect();
    if lines.is_empty() {
        return Err(bad(0, "no items (the file has no text)".into()));
    }
    Ok(lines)
}

/// The document files of `path`: itself, or the [`DOC_EXTS`] files under the folder (named
/// relative to it), in path order.
fn documents(path: &Path) -> Result<Vec<(String, PathBuf)>> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_dir() {
        return Ok(vec![(name_of(path), path.to_path_buf())]);
    }
    let mut found = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let rd = std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))?;
        for e in rd.flatten() {
            let p = e.path();
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(p);
            } else if ft.is_file() && DOC_EXTS.contains(&ext(&p).as_str()) {
                let rel = p.strip_prefix(path).unwrap_or(&p).display().to_string();
                found.push((rel, p));
            }
        }
    }
    found.sort();
    if found.is_empty() {
        return Err(Error::Config(format!(
            "{}: no document files in the folder (looked for .{})",
            path.display(),
            DOC_EXTS.join(", .")
        )));
    }
    Ok(found)
}

/// The passages of the documents at `path` (a file or a folder).
pub fn read_documents(path: &Path, max_chars: usize) -> Result<Vec<Line>> {
    let mut out = Vec::new();
    for (name, p) in documents(path)? {
        out.extend(passages(&name, &read_text(&p)?, max_chars));
    }
    if out.is_empty() {
        return Err(Error::Config(format!(
            "{}: the documents have no text",
            path.display()
        )));
    }
    Ok(out)
}

/// `text` cut into passages of at most `max_chars` characters: paragraphs (split at blank
/// lines) are packed together while they fit; a longer paragraph is cut at spaces (a word
/// longer than `max_chars` at characters). Each passage names its first line.
pub fn passages(file: &str, text: &str, max_chars: usize) -> Vec<Line> {
    let max = max_chars.max(1);
    let mut paras: Vec<(usize, String)> = Vec::new();
    let mut cur: Option<(usize, String)> = None;
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            paras.extend(cur.take());
            continue;
        }
        match &mut cur {
            Some((_, s)) => {
                s.push('\n');
                s.push_str(l.trim_end());
            }
            None => cur = Some((i + 1, l.trim_end().to_string())),
        }
    }
    paras.extend(cur);
    let mut out: Vec<Line> = Vec::new();
    let mut open: Option<Line> = None;
    let len = |s: &str| s.chars().count();
    for (line, p) in paras {
        for piece in cut(&p, max) {
            match &mut open {
                Some(o) if len(&o.text) + 2 + len(&piece) <= max => {
                    o.text.push_str("\n\n");
                    o.text.push_str(&piece);
                }
                _ => {
                    out.extend(open.take());
                    open = Some(Line {
                        file: file.to_string(),
                        line,
                        text: piece,
                    });
                }
            }
        }
    }
    out.extend(open);
    out
}

/// A paragraph in pieces of at most `max` characters, cut at whitespace where there is some.
fn cut(p: &str, max: usize) -> Vec<String> {
    if p.chars().count() <= max {
        return vec![p.to_string()];
    }
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut n = 0usize;
    for word in p.split_whitespace() {
        let w = word.chars().count();
        if n > 0 && n + 1 + w > max {
            out.push(std::mem::take(&mut cur));
            n = 0;
        }
        if w > max {
            let chars: Vec<char> = word.chars().collect();
            for c in chars.chunks(max) {
                if n > 0 {
                    out.push(std::mem::take(&mut cur));
                }
                cur = c.iter().collect();
                n = c.len();
            }
            continue;
        }
        if n > 0 {
            cur.push(' ');
            n += 1;
        }
        cur.push_str(word);
        n += w;
    }
    if n > 0 {
        out.push(cur);
    }
    out
}

/// A text or record to rewrite.
#[derive(Clone, Debug)]
pub struct ToRephrase {
    pub file: String,
    pub line: usize,
    pub what: Rephrasable,
}

#[derive(Clone, Debug)]
pub enum Rephrasable {
    /// A line of text: the record becomes prompt (the text) and completion (the rewrite).
    Text(String),
    /// A supervised record: its answer(s) are rewritten, it is written in `format` again.
    Record(Item, Format),
}

/// The inputs of rephrase: text lines (any extension but `.csv`, `.json`, `.jsonl`, `.parquet`) or
/// records, with the problems of rows that cannot be used.
pub fn read_rephrase(path: &Path) -> Result<(Vec<ToRephrase>, Vec<Problem>)> {
    let name = name_of(path);
    let Ok(kind) = FileKind::of(path) else {
        let lines = read_list(path)?;
        let v = lines
            .into_iter()
            .map(|l| ToRephrase {
                file: l.file,
                line: l.line,
                what: Rephrasable::Text(l.text),
            })
            .collect();
        return Ok((v, Vec::new()));
    };
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let (rows, mut problems) = read::read(&name, kind, &bytes)?;
    let mut out = Vec::new();
    for r in rows {
        let obj = map::apply_mapping(&r.fields, &[], r.from_csv, &mut []);
        match map::item(&obj) {
            Ok((item @ Item::Sft(_), shape)) => out.push(ToRephrase {
                file: r.file,
                line: r.line,
                what: Rephrasable::Record(item, Format::of_shape(shape)),
            }),
            Ok((Item::Dpo(_), _)) => problems.push(Problem {
                file: r.file,
                line: r.line,
                message:
                    "a preference record (prompt/chosen/rejected) has no one answer to rewrite"
                        .into(),
            }),
            Err(message) => problems.push(Problem {
                file: r.file,
                line: r.line,
                message,
            }),
        }
    }
    if out.is_empty() {
        return Err(Error::Data {
            path: name.into(),
            line: 0,
            msg: match problems.first() {
                Some(p) => format!("no record can be rewritten (the first problem: {p})"),
                None => "no records".into(),
            },
        });
    }
    Ok((out, problems))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_from_lines_jsonl_and_json() {
        let l = parse_list("seeds.txt", "txt", "Write a poem.\n\n  Sort a list.  \n").unwrap();
        assert_eq!(
            l.iter()
                .map(|l| (l.line, l.text.as_str()))
                .collect::<Vec<_>>(),
            [(1, "Write a poem."), (3, "Sort a list.")]
        );
        let j = parse_list(
            "s.jsonl",
            "jsonl",
            "\"a\"\n{\"instruction\": \"b\", \"output\": \"x\"}\n\n{\"topic\": \"c\"}\n",
        )
        .unwrap();
        assert_eq!(
            j.iter()
                .map(|l| (l.line, l.text.as_str()))
                .collect::<Vec<_>>(),
            [(1, "a"), (2, "b"), (4, "c")]
        );
        let a = parse_list("s.json", "json", r#"["x", {"prompt": "y"}]"#).unwrap();
        assert_eq!(a[1].text, "y");
        let e = parse_list("s.jsonl", "jsonl", "\"a\"\n{\"n\": 1}\n")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("s.jsonl:2: expected a string"), "{e}");
        let e = parse_list("s.jsonl", "jsonl", "\"a\"\nnot json\n")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("s.jsonl:2: not JSON"), "{e}");
        assert!(parse_list("e.txt", "txt", "\n \n")
            .unwrap_err()
            .to_string()
            .contains("no items"));
        assert!(parse_list("o.json", "json", r#"{"a": 1}"#).is_err());
    }

    #[test]
    fn passages_pack_paragraphs_and_cut_long_ones() {
        let text = "Title\n\nOne two three.\nFour five.\n\n\nSix seven eight nine ten eleven twelve thirteen fourteen.\n";
        let p = passages("doc.md", text, 40);
        let got: Vec<(usize, &str)> = p.iter().map(|l| (l.line, l.text.as_str())).collect();
        assert_eq!(
            got,
            [
                (1, "Title\n\nOne two three.\nFour five."),
                (7, "Six seven eight nine ten eleven twelve"),
                (7, "thirteen fourteen.")
            ]
        );
        assert!(p.iter().all(|l| l.text.chars().count() <= 40));
        let long = passages("x", &"é".repeat(25), 10);
        assert_eq!(
            long.iter()
                .map(|l| l.text.chars().count())
                .collect::<Vec<_>>(),
            [10, 10, 5]
        );
        assert!(passages("x", "\n\n", 10).is_empty());
    }

    #[test]
    fn documents_of_a_folder_in_path_order() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("b")).unwrap();
        std::fs::write(d.path().join("b/two.md"), "Second.").unwrap();
        std::fs::write(d.path().join("a.txt"), "First.").unwrap();
        std::fs::write(d.path().join("skip.csv"), "x,y").unwrap();
        let p = read_documents(d.path(), 100).unwrap();
        let got: Vec<(&str, &str)> = p
            .iter()
            .map(|l| (l.file.as_str(), l.text.as_str()))
            .collect();
        assert_eq!(got, [("a.txt", "First."), ("b/two.md", "Second.")]);
        let empty = tempfile::tempdir().unwrap();
        assert!(read_documents(empty.path(), 100)
            .unwrap_err()
            .to_string()
            .contains("no document files"));
    }

    #[test]
    fn rephrase_inputs_are_texts_or_supervised_records() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("in.jsonl");
        std::fs::write(
            &f,
            "{\"instruction\": \"Name a colour.\", \"output\": \"Blue.\"}\n{\"prompt\": \"p\", \"chosen\": \"a\", \"rejected\": \"b\"}\n",
        )
        .unwrap();
        let (v, problems) = read_rephrase(&f).unwrap();
        assert_eq!(v.len(), 1);
        assert!(matches!(v[0].what, Rephrasable::Record(_, Format::Alpaca)));
        assert_eq!((problems[0].line, problems.len()), (2, 1));
        let t = d.path().join("texts.txt");
        std::fs::write(&t, "The sky is blue.\n").unwrap();
        let (v, _) = read_rephrase(&t).unwrap();
        assert!(matches!(&v[0].what, Rephrasable::Text(s) if s == "The sky is blue."));
    }
}
