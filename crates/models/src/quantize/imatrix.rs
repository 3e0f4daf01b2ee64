//! Importance matrices in llama.cpp's GGUF imatrix format (`tools/imatrix/imatrix.cpp`
//! `save_imatrix`, read back by `common/imatrix-loader.cpp`).
//!
//! File: metadata `general.type = "imatrix"`, `imatrix.datasets` (string array),
//! `imatrix.chunk_count`, `imatrix.chunk_size` (u32); per weight `W` (GGUF name, e.g.
//! `blk.0.attn_q.weight`), sorted by name, two F32 tensors: `W.in_sum2` with dims
//! `[C, n_mat]` (sums of squared activations feeding each input column) and `W.counts` with
//! dims `[1, n_mat]` (how many activation rows were summed). The importance of column `j` is
//! `in_sum2[j] / count`, or 1 where nothing was counted, as llama-quantize computes it.
//!
//! Not here: llama.cpp's legacy `.dat` imatrix format.

use std::collections::BTreeMap;
use std::path::Path;

use hf2q_tensor::io::gguf::{GgufArray, GgufFile, GgufValue, GgufValueType, GgufWriter};
use hf2q_tensor::{Bytes, GgmlType};

use crate::{Error, Result};

/// One weight's accumulated statistics (dense models: one matrix).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImatrixEntry {
    /// Σ x_j² per input column, `n_mat` blocks of `C`.
    pub sums: Vec<f32>,
    /// Activation rows summed, one per matrix.
    pub counts: Vec<f32>,
}

impl ImatrixEntry {
    /// Per-column importance: `sums / count`, 1 where the count is zero.
    pub fn importance(&self) -> Vec<f32> {
        let n_mat = self.counts.len().max(1);
        let ne0 = self.sums.len() / n_mat;
        let mut out = vec![1f32; self.sums.len()];
        for (m, &c) in self.counts.iter().enumerate() {
            if c > 0.0 {
                for j in 0..ne0 {
                    out[m * ne0 + j] = self.sums[m * ne0 + j] / c;
                }
            }
        }
        out
    }
}

/// An importance matrix: statistics per weight, plus where they came from.
#[derive(Clone, Debug, Default)]
pub struct Imatrix {
    pub entries: BTreeMap<String, ImatrixEntry>,
    pub datasets: Vec<String>,
    pub chunk_count: u32,
    pub chunk_size: u32,
    /// The path the matrix was read from, as given (llama-quantize records it in the output).
    pub source: Option<String>,
    /// `importance()` of every entry, computed once.
    normalized: BTreeMap<String, Vec<f32>>,
}

fn bad(p: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Msg(format!("{}: not a usable imatrix file: {msg}", p.display()))
}

impl Imatrix {
    pub fn new(
        entries: BTreeMap<String, ImatrixEntry>,
        datasets: Vec<String>,
        chunk_count: u32,
        chunk_size: u32,
    ) -> Imatrix {
        let mut m = Imatrix {
            entries,
            datasets,
            chunk_count,
            chunk_size,
            source: None,
            normalized: BTreeMap::new(),
        };
        m.refresh();
        m
    }

    fn refresh(&mut self) {
        self.normalized = self
            .entries
            .iter()
            .map(|(k, e)| (k.clone(), e.importance()))
            .collect();
    }

    /// Importance weights of a weight by its GGUF name.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.normalized.get(name).map(Vec::as_slice)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Reads a GGUF imatrix; checks every pairing and length.
    pub fn load(path: &Path) -> Result<Imatrix> {
        let f = GgufFile::open(path)?;
        let mut sums: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        let mut counts: BTreeMap<String, Vec<f32>> = BTreeMap::new();
        for t in &f.tensors {
            let (stem, into) = if let Some(s) = t.name.strip_suffix(".in_sum2") {
                (s, &mut sums)
            } else if let Some(s) = t.name.strip_suffix(".counts") {
                (s, &mut counts)
            } else {
                continue;
            };
            if t.ty != GgmlType::F32 {
                return Err(bad(
                    path,
                    format!("tensor '{}' is {}, F32 expected", t.name, t.ty),
                ));
            }
            let data = f.tensor_data(t)?;
            let v: Vec<f32> = data
                .as_slice()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            into.insert(stem.to_string(), v);
        }
        if sums.is_empty() {
            return Err(bad(
                path,
                "no .in_sum2 tensors (a legacy .dat imatrix? only the GGUF format is read)",
            ));
        }
        let mut entries = BTreeMap::new();
        for (name, s) in sums {
            let c = counts
                .remove(&name)
                .ok_or_else(|| bad(path, format!("'{name}' has sums but no counts")))?;
            if c.is_empty()
                || s.len() % c.len() != 0
                || c.iter().any(|x| !x.is_finite() || *x < 0.0)
            {
                return Err(bad(
                    path,
                    format!(
                        "'{name}': {} sums do not split into {} matrices",
                        s.len(),
                        c.len()
                    ),
                ));
            }
            if s.iter().any(|x| !x.is_finite()) {
                return Err(bad(path, format!("'{name}' holds non-finite sums")));
            }
            // llama.cpp rounds counts to integers when loading.
            let c = c.iter().map(|x| x.round()).collect();
            entries.insert(name, ImatrixEntry { sums: s, counts: c });
        }
        if let Some(name) = counts.keys().next() {
            return Err(bad(path, format!("'{name}' has counts but no sums")));
        }
        let datasets = f
            .get_str_array("imatrix.datasets")
            .map(|v| v.into_iter().map(str::to_string).collect())
            .unwrap_or_default();
        let chunk_count = f.get_u64("imatrix.chunk_count").unwrap_or(0) as u32;
        let chunk_size = f.get_u64("imatrix.chunk_size").unwrap_or(0) as u32;
        let mut m = Imatrix::new(entries, datasets, chunk_count, chunk_size);
        m.source = Some(path.display().to_string());
        Ok(m)
    }

    /// The metadata llama-quantize adds to a file quantized with an imatrix (its `--imatrix`
    /// key/value overrides, strings cut at 127 bytes as there).
    pub fn provenance(&self) -> Vec<(String, GgufValue)> {
        let cut = |s: &str| {
            let mut n = s.len().min(127);
            while !s.is_char_boundary(n) {
                n -= 1;
            }
            s[..n].to_string()
        };
        let mut m = vec![(
            "quantize.imatrix.file".to_string(),
            GgufValue::String(cut(self.source.as_deref().unwrap_or(""))),
        )];
        if let Some(d) = self.datasets.first() {
            m.push(("quantize.imatrix.dataset".into(), GgufValue::String(cut(d))));
        }
        m.push((
            "quantize.imatrix.entries_count".into(),
            GgufValue::U32(self.entries.len() as u32),
        ));
        if self.chunk_count > 0 {
            m.push((
                "quantize.imatrix.chunks_count".into(),
                GgufValue::U32(self.chunk_count),
            ));
        }
        m
    }

    /// Writes the GGUF imatrix as llama-imatrix does (atomically).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut w = GgufWriter::new();
        w.add_metadata("general.type", "imatrix")?;
        let ds = self
            .datasets
            .iter()
            .map(|d| GgufValue::String(d.clone()))
            .collect();
        let arr = GgufArray::new(GgufValueType::String, ds)
            .ok_or_else(|| Error::Msg("dataset names".into()))?;
        w.add_metadata("imatrix.datasets", GgufValue::Array(arr))?;
        w.add_metadata("imatrix.chunk_count", GgufValue::U32(self.chunk_count))?;
        w.add_metadata("imatrix.chunk_size", GgufValue::U32(self.chunk_size))?;
        let f32_bytes =
            |v: &[f32]| Bytes::from_vec(v.iter().flat_map(|x| x.to_le_bytes()).collect());
        for (name, e) in &self.entries {
            let n_mat = e.counts.len();
            if n_mat == 0 || e.sums.len() % n_mat != 0 {
                return Err(Error::Msg(format!(
                    "imatrix entry '{name}' is inconsistent"
                )));
            }
            let ne0 = (e.sums.len() / n_mat) as u64;
            w.add_tensor(
                format!("{name}.in_sum2"),
                vec![ne0, n_mat as u64],
                GgmlType::F32,
                f32_bytes(&e.sums),
            )?;
            w.add_tensor(
                format!("{name}.counts"),
                vec![1, n_mat as u64],
                GgmlType::F32,
                f32_bytes(&e.counts),
            )?;
        }
        w.write_file(path)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_normalizes_like_llama_quantize() {
        let mut entries = BTreeMap::new();
        entries.insert(
            "blk.0.attn_q.weight".to_string(),
            ImatrixEntry {
                sums: vec![4.0, 8.0, 0.0, 2.0],
                counts: vec![4.0],
            },
        );
        entries.insert(
            "blk.0.ffn_up.weight".to_string(),
            ImatrixEntry {
                sums: vec![1.0, 1.0],
                counts: vec![0.0],
            },
        );
        let m = Imatrix::new(entries, vec!["wiki.txt".into()], 3, 512);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("imatrix.gguf");
        m.save(&p).unwrap();
        let r = Imatrix::load(&p).unwrap();
        assert_eq!(r.entries, m.entries);
        assert_eq!(r.datasets, ["wiki.txt"]);
        assert_eq!((r.chunk_count, r.chunk_size), (3, 512));
        assert_eq!(r.get("blk.0.attn_q.weight").unwrap(), [1.0, 2.0, 0.0, 0.5]);
        // Nothing counted: every column weighs 1.
        assert_eq!(r.get("blk.0.ffn_up.weight").unwrap(), [1.0, 1.0]);
    }
}
