//! Which files of a dataset repository hold a split, by the names the `datasets` library reads
//! splits from: data files (`.jsonl`, `.json`, `.csv`, `.parquet`) whose file stem or a folder
//! is the split's name or starts with it followed by `-`, `_` or `.` (`train.jsonl`,
//! `data/train-00000-of-00001.parquet`, `train/part-1.jsonl`); `validation` also answers to
//! `valid`, `val` and `dev`. No split asked: `train` when a file names it, else every data file.
//! `--include` globs replace the choice, `--exclude` globs remove from it.
//!
//! Not here: reading the files (the dataset builder does, for the formats it knows).

use crate::error::{HubError, Result};
use crate::select::{globs, Filter, Selection};

/// The extensions of data files.
pub const DATA_EXTENSIONS: &[&str] = &[".jsonl", ".json", ".csv", ".parquet"];

/// The names a split goes by.
fn aliases(split: &str) -> Vec<String> {
    let s = split.to_ascii_lowercase();
    match s.as_str() {
        "validation" | "valid" | "val" | "dev" => ["validation", "valid", "val", "dev"]
            .map(String::from)
            .to_vec(),
        _ => vec![s],
    }
}

fn is_data(f: &str) -> bool {
    let l = f.to_ascii_lowercase();
    DATA_EXTENSIONS.iter().any(|e| l.ends_with(e))
}

/// Whether a path component (a folder, or the file's stem) names `split`.
fn names_split(f: &str, names: &[String]) -> bool {
    let l = f.to_ascii_lowercase();
    let mut parts: Vec<&str> = l.split('/').collect();
    if let Some(last) = parts.last_mut() {
        *last = last.split('.').next().unwrap_or(last);
    }
    parts.iter().any(|p| {
        names.iter().any(|n| {
            p == n
                || p.strip_prefix(n.as_str())
                    .is_some_and(|r| r.starts_with(['-', '_', '.']))
        })
    })
}

/// The data files of `split` (`filter.quant` carries the `:SPLIT` of `ORG/NAME:SPLIT`).
pub fn select_dataset(repo: &str, files: &[String], filter: &Filter) -> Result<Selection> {
    let mut chosen: Vec<String> = if !filter.include.is_empty() {
        let inc = globs(&filter.include, false)?;
        files
            .iter()
            .filter(|f| inc.is_match(f.as_str()))
            .cloned()
            .collect()
    } else {
        let data: Vec<&String> = files.iter().filter(|f| is_data(f)).collect();
        let of = |split: &str| -> Vec<String> {
            let names = aliases(split);
            data.iter()
                .filter(|f| names_split(f, &names))
                .map(|f| f.to_string())
                .collect()
        };
        match &filter.quant {
            Some(split) => of(split),
            None => {
                let train = of("train");
                if train.is_empty() {
                    data.iter().map(|f| f.to_string()).collect()
                } else {
                    train
                }
            }
        }
    };
    if !filter.exclude.is_empty() {
        let exc = globs(&filter.exclude, false)?;
        chosen.retain(|f| !exc.is_match(f.as_str()));
    }
    chosen.sort();
    if chosen.is_empty() {
        let data: Vec<String> = files.iter().filter(|f| is_data(f)).cloned().collect();
        return Err(HubError::NoDataFiles {
            repo: repo.to_string(),
            split: filter.quant.clone(),
            available: data,
        });
    }
    Ok(Selection {
        files: chosen,
        gguf: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files() -> Vec<String> {
        [
            "README.md",
            ".gitattributes",
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
            "data/validation-00000-of-00001.parquet",
            "test.jsonl",
            "trainer_notes.txt",
            "dev/part-1.csv",
        ]
        .map(String::from)
        .to_vec()
    }

    fn pick(split: Option<&str>) -> Result<Vec<String>> {
        let f = Filter {
            quant: split.map(String::from),
            ..Filter::default()
        };
        select_dataset("o/d", &files(), &f).map(|s| s.files)
    }

    #[test]
    fn splits_by_file_and_folder_names() {
        assert_eq!(
            pick(None).unwrap(),
            vec![
                "data/train-00000-of-00002.parquet",
                "data/train-00001-of-00002.parquet"
            ]
        );
        assert_eq!(pick(Some("test")).unwrap(), vec!["test.jsonl"]);
        assert_eq!(
            pick(Some("validation")).unwrap(),
            vec!["data/validation-00000-of-00001.parquet", "dev/part-1.csv"]
        );
        let e = pick(Some("extra")).unwrap_err().to_string();
        assert!(e.contains("extra") && e.contains("test.jsonl"), "{e}");
        // No train split named: every data file.
        let only = vec![
            "a.jsonl".to_string(),
            "b.csv".to_string(),
            "c.md".to_string(),
        ];
        let s = select_dataset("o/d", &only, &Filter::default()).unwrap();
        assert_eq!(s.files, vec!["a.jsonl", "b.csv"]);
        // Globs override.
        let f = Filter {
            include: vec!["*.csv".into()],
            ..Filter::default()
        };
        assert_eq!(
            select_dataset("o/d", &files(), &f).unwrap().files,
            vec!["dev/part-1.csv"]
        );
    }
}
