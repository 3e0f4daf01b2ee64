//! safetensors: Hugging Face's tensor file format, read (single file or a sharded checkpoint
//! folder) and written. Spec: the `safetensors` project's README (format section); the reference
//! implementation is the `safetensors` Rust crate.
//!
//! Layout: `u64 LE: N`, then `N` bytes of JSON header (UTF-8, may end in spaces), then the data
//! buffer. The header maps each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}`
//! with offsets relative to the data buffer, plus an optional `"__metadata__"` string-to-string map.
//!
//! Reading checks the header against hostile input: its length against the file and a cap, JSON
//! validity, duplicate names, dtypes, shapes (overflow), offsets within the buffer and equal to
//! dtype size x element count, and no two tensors overlapping. Tensor data stays in the memory
//! map: [`SafeTensors::tensor_data`] is a zero-copy slice.
//!
//! Not here: what the tensors mean (the model crate's name map) or MLX's quantized layout
//! (`crate::quant::mlx`).

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;

use super::gguf::write_file_atomically;
use crate::{Bytes, Error, Result};

const FORMAT: &str = "safetensors";
/// Headers larger than this are refused (the reference implementation caps them at 100 MB too;
/// real headers are a few hundred KB at most).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;
/// The header key holding free-form string metadata.
pub const METADATA_KEY: &str = "__metadata__";
/// The index file of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

fn malformed(msg: impl Into<String>) -> Error {
    Error::malformed(FORMAT, msg)
}

/// Element types of safetensors, spelled as in the header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum StDtype {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    U32,
    U16,
    U64,
    BOOL,
    F8_E4M3,
    F8_E5M2,
}

const DTYPES: &[(StDtype, &str, usize)] = &[
    (StDtype::F64, "F64", 8),
    (StDtype::F32, "F32", 4),
    (StDtype::F16, "F16", 2),
    (StDtype::BF16, "BF16", 2),
    (StDtype::I64, "I64", 8),
    (StDtype::I32, "I32", 4),
    (StDtype::I16, "I16", 2),
    (StDtype::I8, "I8", 1),
    (StDtype::U8, "U8", 1),
    (StDtype::U32, "U32", 4),
    (StDtype::U16, "U16", 2),
    (StDtype::U64, "U64", 8),
    (StDtype::BOOL, "BOOL", 1),
    (StDtype::F8_E4M3, "F8_E4M3", 1),
    (StDtype::F8_E5M2, "F8_E5M2", 1),
];

impl StDtype {
    fn row(self) -> &'static (StDtype, &'static str, usize) {
        DTYPES
            .iter()
            .find(|r| r.0 == self)
            .expect("every StDtype is in DTYPES")
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        self.row().2
    }
    /// Name as the header spells it (`"BF16"`).
    pub fn name(self) -> &'static str {
        self.row().1
    }
    pub fn from_name(name: &str) -> Option<StDtype> {
        DTYPES.iter().find(|r| r.1 == name).map(|r| r.0)
    }
}

impl fmt::Display for StDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor's header entry. `start..end` is relative to the data buffer (as in the header).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StTensorInfo {
    pub name: String,
    pub dtype: StDtype,
    /// Row-major, outermost first: `(out_features, in_features)` for a linear weight.
    pub shape: Vec<usize>,
    pub start: usize,
    pub end: usize,
}

impl StTensorInfo {
    /// Number of elements (saturating; never overflows for infos read from a file).
    pub fn numel(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .unwrap_or(usize::MAX)
    }
    pub fn nbytes(&self) -> usize {
        self.end.saturating_sub(self.start)
    }
}

/// A parsed safetensors file. `tensors` are in header order.
#[derive(Clone, Debug)]
pub struct SafeTensors {
    pub tensors: Vec<StTensorInfo>,
    pub metadata: BTreeMap<String, String>,
    bytes: Bytes,
    /// Absolute file offset of the data buffer (8 + header length).
    data_offset: usize,
}

/// The header's top-level entries in order, keeping duplicates (serde's maps drop them silently).
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = m.next_entry()? {
                    v.push(e);
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize)]
struct RawInfo {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

impl SafeTensors {
    /// Memory-maps and parses a safetensors file.
    pub fn open(path: &Path) -> Result<SafeTensors> {
        let bytes = Bytes::map_file(path)?;
        SafeTensors::from_bytes(bytes).map_err(|e| match e {
            Error::Malformed { format, msg } => Error::Malformed {
                format,
                msg: format!("{}: {msg}", path.display()),
            },
            e => e,
        })
    }

    /// Parses a safetensors file held in memory.
    pub fn from_bytes(bytes: Bytes) -> Result<SafeTensors> {
        let buf = bytes.as_slice();
        let Some(len_bytes) = buf.get(..8) else {
            return Err(malformed(format!(
                "file is {} bytes, too short for the 8-byte header length",
                buf.len()
            )));
        };
        let mut n = [0u8; 8];
        n.copy_from_slice(len_bytes);
        let n = u64::from_le_bytes(n);
        let avail = (buf.len() - 8) as u64;
        if n > MAX_HEADER_BYTES {
            return Err(malformed(format!(
                "header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit"
            )));
        }
        if n > avail {
            return Err(malformed(format!(
                "header length {n} runs past the end of the file ({avail} bytes after the length)"
            )));
        }
        let data_offset = 8 + n as usize; // n <= avail, so this fits
        let header = &buf[8..data_offset];
        let data_len = buf.len() - data_offset;
        let entries: Entries = serde_json::from_slice(header)
            .map_err(|e| malformed(format!("header is not a valid JSON object: {e}")))?;

        let mut tensors = Vec::with_capacity(entries.0.len());
        let mut metadata = BTreeMap::new();
        let mut seen = HashSet::new();
        for (name, value) in entries.0 {
            if !seen.insert(name.clone()) {
                return Err(malformed(format!("duplicate header entry '{name}'")));
            }
            if name == METADATA_KEY {
                metadata = parse_metadata(value)?;
                continue;
            }
            tensors.push(parse_info(name, value, data_len)?);
        }

        let mut ranges: Vec<_> = tensors
            .iter()
            .filter(|t| t.end > t.start)
            .map(|t| (t.start, t.end, &t.name))
            .collect();
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(malformed(format!(
                    "tensor data of '{}' and '{}' overlap",
                    w[0].2, w[1].2
                )));
            }
        }
        Ok(SafeTensors {
            tensors,
            metadata,
            bytes,
            data_offset,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&StTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor's bytes: a zero-copy slice of the file.
    pub fn tensor_data(&self, info: &StTensorInfo) -> Result<Bytes> {
        let range = self
            .data_offset
            .checked_add(info.start)
            .zip(self.data_offset.checked_add(info.end))
            .filter(|(s, e)| s <= e && *e <= self.bytes.len());
        let (s, e) = range.ok_or_else(|| {
            malformed(format!(
                "tensor '{}' range {}..{} is outside the data buffer",
                info.name, info.start, info.end
            ))
        })?;
        self.bytes.slice(s..e)
    }

    /// The tensor converted to f32 (F32, F16, BF16 and F64 tensors).
    pub fn to_f32(&self, info: &StTensorInfo) -> Result<Vec<f32>> {
        let data = self.tensor_data(info)?;
        let b = data.as_slice();
        Ok(match info.dtype {
            StDtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StDtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StDtype::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StDtype::F64 => b
                .chunks_exact(8)
                .map(|c| {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(c);
                    f64::from_le_bytes(a) as f32
                })
                .collect(),
            other => {
                return Err(Error::UnsupportedType {
                    ty: format!("{other} (to_f32 reads F32, F16, BF16, F64)"),
                    tensor: info.name.clone(),
                })
            }
        })
    }

    /// Absolute file offset of the data buffer.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// The whole file.
    pub fn file_bytes(&self) -> &Bytes {
        &self.bytes
    }
}

fn parse_metadata(value: serde_json::Value) -> Result<BTreeMap<String, String>> {
    let serde_json::Value::Object(map) = value else {
        return Err(malformed(format!(
            "{METADATA_KEY} must be an object of strings"
        )));
    };
    map.into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => Ok((k, s)),
            other => Err(malformed(format!(
                "{METADATA_KEY} entry '{k}' must be a string, found {other}"
            ))),
        })
        .collect()
}

fn parse_info(name: String, value: serde_json::Value, data_len: usize) -> Result<StTensorInfo> {
    let raw: RawInfo = serde_json::from_value(value)
        .map_err(|e| malformed(format!("tensor '{name}': bad header entry: {e}")))?;
    let dtype = StDtype::from_name(&raw.dtype)
        .ok_or_else(|| malformed(format!("tensor '{name}' has unknown dtype '{}'", raw.dtype)))?;
    let [start, end] = raw.data_offsets;
    if start > end || end > data_len as u64 {
        return Err(malformed(format!(
            "tensor '{name}' has data offsets [{start}, {end}] outside the {data_len}-byte data buffer"
        )));
    }
    let shape = raw
        .shape
        .iter()
        .map(|&d| usize::try_from(d).ok())
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| malformed(format!("tensor '{name}' has a dimension that overflows")))?;
    let nbytes = shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            malformed(format!(
                "tensor '{name}': size of shape {shape:?} overflows"
            ))
        })?;
    if (end - start) as usize != nbytes {
        return Err(malformed(format!(
            "tensor '{name}' is {dtype} {shape:?} ({nbytes} bytes) but its data offsets [{start}, \
             {end}] span {} bytes",
            end - start
        )));
    }
    Ok(StTensorInfo {
        name,
        dtype,
        shape,
        start: start as usize,
        end: end as usize,
    })
}

/// One tensor to write: name, dtype, row-major shape, little-endian bytes.
pub type StTensorRef<'a> = (String, StDtype, Vec<usize>, &'a [u8]);

/// Writes a safetensors file to `w`: header (tensors in the given order, `__metadata__` first when
/// non-empty, padded with spaces to a multiple of 8 bytes as the reference writer does), then
/// the data back to back.
pub fn write_safetensors_to<W: Write + ?Sized>(
    w: &mut W,
    tensors: &[StTensorRef<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        let m = metadata
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())));
        header.insert(METADATA_KEY.into(), serde_json::Value::Object(m.collect()));
    }
    let mut offset = 0usize;
    for (name, dtype, shape, data) in tensors {
        if name == METADATA_KEY {
            return Err(Error::Msg(format!(
                "a tensor cannot be named {METADATA_KEY}"
            )));
        }
        if header.contains_key(name) {
            return Err(Error::Msg(format!(
                "duplicate safetensors tensor name '{name}'"
            )));
        }
        let nbytes = shape
            .iter()
            .try_fold(dtype.size(), |a, &d| a.checked_mul(d));
        if nbytes != Some(data.len()) {
            return Err(Error::Shape(format!(
                "tensor '{name}': {} bytes given for {dtype} {shape:?}",
                data.len()
            )));
        }
        let end = offset + data.len();
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": dtype.name(), "shape": shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut json = serde_json::to_vec(&serde_json::Value::Object(header))
        .map_err(|e| Error::Msg(format!("cannot encode safetensors header: {e}")))?;
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    w.write_all(&(json.len() as u64).to_le_bytes())?;
    w.write_all(&json)?;
    for (_, _, _, data) in tensors {
        w.write_all(data)?;
    }
    w.flush()?;
    Ok(())
}

/// Writes a safetensors file through a temporary name in the same directory, renamed into place
/// once complete: an interrupted write never leaves a complete-looking file.
pub fn write_safetensors(
    path: &Path,
    tensors: &[StTensorRef<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    write_file_atomically(path, |w| write_safetensors_to(w, tensors, metadata))
}

/// A checkpoint split over several safetensors files (or just one), addressed by tensor name.
#[derive(Debug)]
pub struct ShardedSafeTensors {
    shards: Vec<(PathBuf, SafeTensors)>,
    /// name -> (shard index, tensor index in that shard)
    index: BTreeMap<String, (usize, usize)>,
}

#[derive(Deserialize)]
struct IndexFile {
    weight_map: BTreeMap<String, String>,
}

impl ShardedSafeTensors {
    /// A file opens as a single shard; a directory through [`Self::open_dir`].
    pub fn open(path: &Path) -> Result<ShardedSafeTensors> {
        if path.is_dir() {
            ShardedSafeTensors::open_dir(path)
        } else {
            let st = SafeTensors::open(path)?;
            ShardedSafeTensors::from_shards(vec![(path.to_path_buf(), st)])
        }
    }

    /// Opens `model.safetensors.index.json`'s shards (its `weight_map` says which tensor is in
    /// which file) or, without an index, every `*.safetensors` file in `dir`.
    pub fn open_dir(dir: &Path) -> Result<ShardedSafeTensors> {
        let index_path = dir.join(INDEX_FILE);
        if index_path.is_file() {
            return ShardedSafeTensors::open_index(dir, &index_path);
        }
        let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
        let mut files = Vec::new();
        for e in rd {
            let e = e.map_err(|e| Error::io(dir, e))?;
            let name = e.file_name().to_string_lossy().into_owned();
            // Names starting with '.' are hidden files (editor/OS leftovers, partial writes).
            if name.ends_with(".safetensors") && !name.starts_with('.') && e.path().is_file() {
                files.push(e.path());
            }
        }
        files.sort();
        if files.is_empty() {
            return Err(Error::Msg(format!(
                "{}: no *.safetensors files and no {INDEX_FILE}",
                dir.display()
            )));
        }
        let shards = files
            .into_iter()
            .map(|p| SafeTensors::open(&p).map(|st| (p, st)))
            .collect::<Result<Vec<_>>>()?;
        ShardedSafeTensors::from_shards(shards)
    }

    fn from_shards(shards: Vec<(PathBuf, SafeTensors)>) -> Result<ShardedSafeTensors> {
        let mut index = BTreeMap::new();
        for (si, (path, st)) in shards.iter().enumerate() {
            for (ti, t) in st.tensors.iter().enumerate() {
                if let Some((other, _)) = index.insert(t.name.clone(), (si, ti)) {
                    return Err(malformed(format!(
                        "tensor '{}' is in both {} and {}",
                        t.name,
                        shards[other].0.display(),
                        path.display()
                    )));
                }
            }
        }
        Ok(ShardedSafeTensors { shards, index })
    }

    fn open_index(dir: &Path, index_path: &Path) -> Result<ShardedSafeTensors> {
        let len = std::fs::metadata(index_path)
            .map_err(|e| Error::io(index_path, e))?
            .len();
        if len > MAX_HEADER_BYTES {
            return Err(malformed(format!(
                "{}: {len} bytes is too large for an index",
                index_path.display()
            )));
        }
        let text = std::fs::read(index_path).map_err(|e| Error::io(index_path, e))?;
        let idx: IndexFile = serde_json::from_slice(&text)
            .map_err(|e| malformed(format!("{}: {e}", index_path.display())))?;
        let mut shards: Vec<(PathBuf, SafeTensors)> = Vec::new();
        let mut index = BTreeMap::new();
        for (name, file) in idx.weight_map {
            // Shards live beside the index: a file name, never a path that could point elsewhere.
            let plain = Path::new(&file)
                .file_name()
                .is_some_and(|f| f == file.as_str());
            if !plain || file == ".." || file.contains(['/', '\\']) {
                return Err(malformed(format!(
                    "{}: tensor '{name}' maps to '{file}', which is not a plain file name",
                    index_path.display()
                )));
            }
            let path = dir.join(&file);
            let si = match shards.iter().position(|(p, _)| *p == path) {
                Some(i) => i,
                None => {
                    shards.push((path.clone(), SafeTensors::open(&path)?));
                    shards.len() - 1
                }
            };
            let ti = shards[si]
                .1
                .tensors
                .iter()
                .position(|t| t.name == name)
                .ok_or_else(|| {
                    malformed(format!(
                        "tensor '{name}' is listed in {INDEX_FILE} but missing from {file}"
                    ))
                })?;
            index.insert(name, (si, ti));
        }
        Ok(ShardedSafeTensors { shards, index })
    }

    pub fn get(&self, name: &str) -> Option<(&SafeTensors, &StTensorInfo)> {
        let &(si, ti) = self.index.get(name)?;
        let st = &self.shards[si].1;
        Some((st, &st.tensors[ti]))
    }

    /// The tensor's bytes (zero-copy).
    pub fn tensor_data(&self, name: &str) -> Result<Bytes> {
        let (st, info) = self
            .get(name)
            .ok_or_else(|| Error::Msg(format!("no tensor named '{name}'")))?;
        st.tensor_data(info)
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.index.keys()
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub fn shards(&self) -> impl Iterator<Item = (&Path, &SafeTensors)> {
        self.shards.iter().map(|(p, s)| (p.as_path(), s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_names_round_trip() {
        for &(d, name, size) in DTYPES {
            assert_eq!(StDtype::from_name(name), Some(d));
            assert_eq!((d.name(), d.size()), (name, size));
        }
        assert_eq!(
            StDtype::from_name("f32"),
            None,
            "names are case-sensitive, as in the spec"
        );
    }

    #[test]
    fn info_sizes_saturate() {
        let t = StTensorInfo {
            name: "t".into(),
            dtype: StDtype::U8,
            shape: vec![usize::MAX, 2],
            start: 4,
            end: 2,
        };
        assert_eq!((t.numel(), t.nbytes()), (usize::MAX, 0));
    }
}
