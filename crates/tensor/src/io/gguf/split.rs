//! Split GGUF models in llama.cpp's `gguf-split` layout: `PREFIX-00001-of-0000N.gguf` ..
//! `PREFIX-0000N-of-0000N.gguf`, each a GGUF file of its own holding some of the tensors. The
//! first part holds all the metadata; every part holds `split.no` (u16, from 0), `split.count`
//! (u16) and `split.tensors.count` (i32, the tensors of all parts together).
//!
//! - [`GgufFile::open_joined`] opens a model: one file as [`GgufFile::open`] does, or the first
//!   part of a split one with every other part joined into one view (metadata of the first part
//!   without the `split.*` keys, the tensors of all parts in order; data stays in each part's map).
//! - [`write_split`] writes a model as parts of at most a given number of tensor-data bytes.
//!
//! Not here: finding the parts on a hub (the hub crate selects them by the same names).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use super::read::GgufFile;
use super::write::GgufWriter;
use crate::{Error, Result};

pub const KEY_SPLIT_NO: &str = "split.no";
pub const KEY_SPLIT_COUNT: &str = "split.count";
pub const KEY_SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// `DIR/m-q8_0-00002-of-00003.gguf` -> (`DIR/m-q8_0`, 2, 3); `None` for other names.
pub fn split_file_name(path: &Path) -> Option<(PathBuf, u32, u32)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (head, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(count) || !digits(no) || prefix.is_empty() {
        return None;
    }
    let (no, count): (u32, u32) = (no.parse().ok()?, count.parse().ok()?);
    if no == 0 || no > count {
        return None;
    }
    Some((path.with_file_name(prefix), no, count))
}

/// Part `no` (from 1) of `count`: `PREFIX-0000no-of-0000count.gguf`, as llama.cpp names it.
pub fn split_part_path(prefix: &Path, no: u32, count: u32) -> PathBuf {
    let base = prefix
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    prefix.with_file_name(format!("{base}-{no:05}-of-{count:05}.gguf"))
}

fn is_split_key(k: &str) -> bool {
    matches!(k, KEY_SPLIT_NO | KEY_SPLIT_COUNT | KEY_SPLIT_TENSORS_COUNT)
}

impl GgufFile {
    /// Opens a model file: a whole GGUF file, or the first part of a split one, joined with its
    /// other parts (found next to it by name). Opening a later part is refused, naming the first.
    pub fn open_joined(path: &Path) -> Result<GgufFile> {
        let first = GgufFile::open(path)?;
        let count = first.get_u64(KEY_SPLIT_COUNT).unwrap_or(1);
        if count <= 1 {
            return Ok(first);
        }
        let no = first.get_u64(KEY_SPLIT_NO).unwrap_or(0);
        let named = split_file_name(path);
        if no != 0 {
            let hint = match &named {
                Some((prefix, _, c)) => format!(
                    ": load the first part, {}",
                    split_part_path(prefix, 1, *c).display()
                ),
                None => String::new(),
            };
            return Err(Error::Msg(format!(
                "{} is part {} of {count} of a split GGUF model{hint}",
                path.display(),
                no + 1
            )));
        }
        let prefix = match named {
            Some((prefix, 1, c)) if u64::from(c) == count => prefix,
            _ => {
                return Err(Error::Msg(format!(
                    "{} is the first of {count} parts of a split GGUF model, but its name is not \
                     PREFIX-00001-of-{count:05}.gguf, so the other parts cannot be found",
                    path.display()
                )))
            }
        };
        let mut joined = first;
        let mut names: HashSet<String> = joined.tensors.iter().map(|t| t.name.clone()).collect();
        for i in 1..count as u32 {
            let p = split_part_path(&prefix, i + 1, count as u32);
            if !p.is_file() {
                return Err(Error::Msg(format!(
                    "{}: split GGUF model of {count} parts, but part {} ({}) is missing",
                    path.display(),
                    i + 1,
                    p.display()
                )));
            }
            let part = GgufFile::open(&p)?;
            let (pno, pcount) = (part.get_u64(KEY_SPLIT_NO), part.get_u64(KEY_SPLIT_COUNT));
            if pno != Some(u64::from(i)) || pcount != Some(count) {
                return Err(Error::Msg(format!(
                    "{}: says it is split.no {pno:?} of split.count {pcount:?}; part {} of {count} \
                     expected (mixed parts of different models?)",
                    p.display(),
                    i + 1
                )));
            }
            let index = joined.parts.len() + 1;
            for t in &part.tensors {
                if !names.insert(t.name.clone()) {
                    return Err(Error::Msg(format!(
                        "{}: tensor '{}' is also in an earlier part",
                        p.display(),
                        t.name
                    )));
                }
                joined.part_of.insert(t.name.clone(), index);
            }
            joined.tensors.extend(part.tensors.iter().cloned());
            joined.parts.push((part.bytes.clone(), part.data_offset));
        }
        if let Some(n) = joined.get_u64(KEY_SPLIT_TENSORS_COUNT) {
            if n != joined.tensors.len() as u64 {
                return Err(Error::Msg(format!(
                    "{}: split.tensors.count says {n} tensors, the {count} parts hold {}",
                    path.display(),
                    joined.tensors.len()
                )));
            }
        }
        joined.metadata.retain(|(k, _)| !is_split_key(k));
        Ok(joined)
    }
}

/// Writes `file` as parts `PREFIX-0000i-of-0000N.gguf` of at most `max_data_bytes` tensor data
/// each (a tensor larger than that gets a part of its own), in llama.cpp's layout. One part is
/// still written as `PREFIX-00001-of-00001.gguf`. Returns the paths in order.
pub fn write_split(file: &GgufFile, prefix: &Path, max_data_bytes: u64) -> Result<Vec<PathBuf>> {
    // Group tensors in file order.
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut used = 0u64;
    for (i, t) in file.tensors.iter().enumerate() {
        let n = t.nbytes();
        let last = groups.last_mut().expect("one group");
        if !last.is_empty() && used.saturating_add(n) > max_data_bytes {
            groups.push(Vec::new());
            used = 0;
        }
        groups.last_mut().expect("one group").push(i);
        used = used.saturating_add(n);
    }
    let count = u16::try_from(groups.len()).map_err(|_| {
        Error::Msg(format!(
            "{} parts of at most {max_data_bytes} bytes: more than a split GGUF can number",
            groups.len()
        ))
    })?;
    let n_tensors = i32::try_from(file.tensors.len())
        .map_err(|_| Error::Msg("too many tensors for split.tensors.count".into()))?;
    let mut paths = Vec::with_capacity(groups.len());
    for (no, group) in groups.iter().enumerate() {
        let mut w = GgufWriter::with_version(file.version)?;
        if no == 0 {
            for (k, v) in file.metadata.iter().filter(|(k, _)| !is_split_key(k)) {
                w.add_metadata(k.clone(), v.clone())?;
            }
        }
        w.add_metadata(KEY_SPLIT_NO, no as u16)?;
        w.add_metadata(KEY_SPLIT_COUNT, count)?;
        w.add_metadata(KEY_SPLIT_TENSORS_COUNT, n_tensors)?;
        for &i in group {
            let t = &file.tensors[i];
            w.add_tensor(t.name.clone(), t.dims.clone(), t.ty, file.tensor_data(t)?)?;
        }
        let p = split_part_path(prefix, no as u32 + 1, u32::from(count));
        w.write_file(&p)?;
        paths.push(p);
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_names() {
        let (prefix, no, count) =
            split_file_name(Path::new("d/m-q8_0-00002-of-00003.gguf")).unwrap();
        assert_eq!((prefix, no, count), (PathBuf::from("d/m-q8_0"), 2, 3));
        assert_eq!(
            split_part_path(Path::new("d/m-q8_0"), 1, 3),
            PathBuf::from("d/m-q8_0-00001-of-00003.gguf")
        );
        for bad in [
            "m.gguf",
            "m-1-of-3.gguf",
            "m-00004-of-00003.gguf",
            "m-00000-of-00003.gguf",
            "-00001-of-00002.gguf",
            "m-00001-of-00002.bin",
        ] {
            assert!(split_file_name(Path::new(bad)).is_none(), "{bad}");
        }
    }
}
