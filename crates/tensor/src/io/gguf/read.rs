//! GGUF reader: parses and validates the header, metadata and tensor table of a GGUF v2/v3 file
//! held in a [`Bytes`] (normally a memory map). Tensor data is never copied: [`GgufFile::tensor_data`]
//! hands out a slice of the same map.
//!
//! Every count, length, dimension and offset read from the file is checked against the bytes that
//! remain and for overflow before it is used or allocated for, so a hostile file gets an error
//! (naming what is wrong) and never a panic or a huge allocation.
//!
//! Layout (ggml `docs/gguf.md`), all little-endian:
//! `"GGUF" u32:version u64:n_tensors u64:n_kv kv* tensor_info* pad data`, where a string is
//! `u64:len bytes`, a kv is `string:key u32:type value`, an array value is
//! `u32:elem_type u64:count value*`, and a tensor info is
//! `string:name u32:n_dims u64:ne[n_dims] u32:ggml_type u64:offset` (offset relative to the data
//! section, which starts at the end of the tensor infos rounded up to the alignment).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::value::{GgufArray, GgufValue, GgufValueType};
use crate::{Bytes, Error, GgmlType, Result};

pub(crate) const FORMAT: &str = "GGUF";
/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Data alignment when `general.alignment` is absent.
pub const GGUF_DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that sets the data alignment.
pub const KEY_ALIGNMENT: &str = "general.alignment";
/// ggml tensors have at most four dimensions (`GGML_MAX_DIMS`).
pub const GGUF_MAX_DIMS: usize = 4;
/// Arrays nest at most this deep; deeper nesting is certainly hostile and would otherwise recurse
/// once per level (a stack overflow in 12 bytes per level).
pub(crate) const MAX_ARRAY_DEPTH: usize = 8;
/// Smallest possible tensor info: name length, n_dims, type, offset (a 0-d tensor, empty name).
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;
/// Smallest possible key-value pair: key length, value type, a one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Vectors are preallocated for at most this many entries. A count bounded by the remaining bytes
/// can still be far more than the entries' in-memory size warrants (a one-byte array element
/// becomes a whole `GgufValue`), so larger vectors grow only as entries are actually parsed.
const MAX_PREALLOC: u64 = 1 << 16;

fn prealloc<T>(count: u64) -> Vec<T> {
    Vec::with_capacity(count.min(MAX_PREALLOC) as usize)
}

pub(crate) fn malformed(msg: impl Into<String>) -> Error {
    Error::malformed(FORMAT, msg)
}

/// One tensor's entry in the tensor table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `ne0` (innermost, contiguous) first. A row-major `(rows, cols)` matrix is
    /// `[cols, rows]`.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data, relative to the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements, `None` on overflow.
    pub fn checked_numel(&self) -> Option<u64> {
        self.dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// Number of elements (saturating at `u64::MAX`, which no file can hold; tensors read by
    /// [`GgufFile`] never overflow).
    pub fn numel(&self) -> u64 {
        self.checked_numel().unwrap_or(u64::MAX)
    }

    /// Bytes of data, as ggml computes them (`ne0 / block_size * type_size * ne1 * ne2 * ne3`);
    /// `None` if `ne0` is not a whole number of blocks or the size overflows.
    pub fn checked_nbytes(&self) -> Option<u64> {
        let bs = self.ty.block_size() as u64;
        let ne0 = self.dims.first().copied().unwrap_or(1);
        if ne0 % bs != 0 {
            return None;
        }
        let row = (ne0 / bs).checked_mul(self.ty.type_size() as u64)?;
        self.dims
            .iter()
            .skip(1)
            .try_fold(row, |acc, &d| acc.checked_mul(d))
    }

    /// Bytes of data (saturating at `u64::MAX`; see [`Self::checked_nbytes`]).
    pub fn nbytes(&self) -> u64 {
        self.checked_nbytes().unwrap_or(u64::MAX)
    }

    /// Dimensions in row-major order (outermost first), as PyTorch/safetensors write shapes.
    pub fn shape_row_major(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

/// A parsed GGUF file. Metadata and tensor infos are in file order.
#[derive(Clone, Debug)]
pub struct GgufFile {
    pub version: u32,
    pub alignment: u64,
    pub metadata: Vec<(String, GgufValue)>,
    pub tensors: Vec<GgufTensorInfo>,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
    pub(super) bytes: Bytes,
    /// The later parts of a split model joined by [`GgufFile::open_joined`] (empty for one file):
    /// each part's bytes and data-section offset.
    pub(super) parts: Vec<(Bytes, u64)>,
    /// Tensor name -> index in `parts` + 1, for tensors stored in a later part.
    pub(super) part_of: HashMap<String, usize>,
}

/// A cursor over the file that never reads past its end.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(malformed(format!(
                "truncated: {} needs {n} bytes at offset {}, but only {} remain",
                what(),
                self.pos,
                self.remaining()
            )));
        }
        let n = n as usize; // n <= remaining, which fits in usize
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(&|| format!("length of {}", what()))?;
        if len > self.remaining() {
            return Err(malformed(format!(
                "{} has length {len} at offset {}, but only {} bytes remain",
                what(),
                self.pos,
                self.remaining()
            )));
        }
        let at = self.pos;
        let s = self.take(len, what)?;
        String::from_utf8(s.to_vec())
            .map_err(|e| malformed(format!("{} at offset {at} is not valid UTF-8: {e}", what())))
    }

    fn value(
        &mut self,
        ty: GgufValueType,
        depth: usize,
        what: &dyn Fn() -> String,
    ) -> Result<GgufValue> {
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(self.array::<1>(what)?[0]),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            GgufValueType::U32 => GgufValue::U32(u32::from_le_bytes(self.array(what)?)),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            GgufValueType::U64 => GgufValue::U64(u64::from_le_bytes(self.array(what)?)),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            GgufValueType::Bool => {
                let at = self.pos;
                match self.array::<1>(what)?[0] {
                    0 => GgufValue::Bool(false),
                    1 => GgufValue::Bool(true),
                    b => {
                        return Err(malformed(format!(
                            "{} at offset {at} is a bool with byte value {b} (must be 0 or 1)",
                            what()
                        )))
                    }
                }
            }
            GgufValueType::String => GgufValue::String(self.string(what)?),
            GgufValueType::Array => GgufValue::Array(self.array_value(depth, what)?),
        })
    }

    fn array_value(&mut self, depth: usize, what: &dyn Fn() -> String) -> Result<GgufArray> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(malformed(format!(
                "{} nests arrays deeper than {MAX_ARRAY_DEPTH} levels",
                what()
            )));
        }
        let at = self.pos;
        let id = self.u32(&|| format!("element type of {}", what()))?;
        let elem_type = GgufValueType::from_u32(id).ok_or_else(|| {
            malformed(format!(
                "{} at offset {at} has unknown array element type {id}",
                what()
            ))
        })?;
        let count = self.u64(&|| format!("element count of {}", what()))?;
        let min = elem_type.min_encoded_size();
        // Bound the count by the bytes that remain before allocating for it.
        if count
            .checked_mul(min)
            .is_none_or(|need| need > self.remaining())
        {
            return Err(malformed(format!(
                "{} claims {count} {elem_type} elements (at least {min} bytes each), but only {} \
                 bytes remain",
                what(),
                self.remaining()
            )));
        }
        let mut values = prealloc(count);
        for i in 0..count {
            values.push(self.value(elem_type, depth + 1, &|| format!("{}[{i}]", what()))?);
        }
        Ok(GgufArray { elem_type, values })
    }
}

fn check_version(version: u32) -> Result<()> {
    match version {
        2 | 3 => Ok(()),
        1 => Err(malformed(
            "GGUF version 1 is not supported (only versions 2 and 3 are; re-convert the model)",
        )),
        v if matches!(v.swap_bytes(), 1..=3) => Err(malformed(format!(
            "big-endian GGUF file (version field reads {v:#010x}, which is version {} \
             byte-swapped); only little-endian GGUF is supported",
            v.swap_bytes()
        ))),
        v => Err(malformed(format!(
            "unsupported GGUF version {v} (only 2 and 3 are supported)"
        ))),
    }
}

/// The largest `general.alignment` accepted: writers use 32 (ggml's default) up to a page; a
/// larger value only adds padding, and one near 2^63 would make a writer that copies the file pad
/// forever (found by the `gguf` fuzz target: a round trip asked for 328 MB of padding).
pub const MAX_ALIGNMENT: u64 = 1 << 20;

/// The alignment set by a `general.alignment` value: a non-zero power of two, at most
/// [`MAX_ALIGNMENT`].
pub(crate) fn alignment_from_value(v: &GgufValue) -> Result<u64> {
    let a = v.as_u64().ok_or_else(|| {
        malformed(format!(
            "{KEY_ALIGNMENT} must be an unsigned integer, found a {}",
            v.value_type()
        ))
    })?;
    if a == 0 || !a.is_power_of_two() {
        return Err(malformed(format!(
            "{KEY_ALIGNMENT} is {a}; it must be a non-zero power of two"
        )));
    }
    if a > MAX_ALIGNMENT {
        return Err(malformed(format!(
            "{KEY_ALIGNMENT} is {a}; more than {MAX_ALIGNMENT} is not accepted"
        )));
    }
    Ok(a)
}

/// Validates the parts of a tensor info that do not depend on the rest of the file.
pub(crate) fn check_tensor_shape(name: &str, dims: &[u64], ty: GgmlType) -> Result<u64> {
    if dims.len() > GGUF_MAX_DIMS {
        return Err(malformed(format!(
            "tensor '{name}' has {} dimensions (ggml allows at most {GGUF_MAX_DIMS})",
            dims.len()
        )));
    }
    // ggml stores dimensions as int64_t.
    if let Some(d) = dims.iter().find(|&&d| d > i64::MAX as u64) {
        return Err(malformed(format!(
            "tensor '{name}' has dimension {d}, which overflows int64"
        )));
    }
    let numel = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
    if numel.is_none_or(|n| n > i64::MAX as u64) {
        return Err(malformed(format!(
            "tensor '{name}' has dimensions {dims:?} whose product overflows int64"
        )));
    }
    let bs = ty.block_size() as u64;
    let ne0 = dims.first().copied().unwrap_or(1);
    if ne0 % bs != 0 {
        return Err(malformed(format!(
            "tensor '{name}' has ne0 = {ne0}, not a multiple of the {ty} block size {bs}"
        )));
    }
    let info = GgufTensorInfo {
        name: name.to_owned(),
        dims: dims.to_vec(),
        ty,
        offset: 0,
    };
    info.checked_nbytes().ok_or_else(|| {
        malformed(format!(
            "tensor '{name}': data size of {dims:?} x {ty} overflows"
        ))
    })
}

/// Rounds `x` up to a multiple of the power of two `align`; `None` on overflow.
pub(crate) fn align_up(x: u64, align: u64) -> Option<u64> {
    Some(x.checked_add(align - 1)? & !(align - 1))
}

impl GgufFile {
    /// Memory-maps and parses a GGUF file.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let bytes = Bytes::map_file(path)?;
        GgufFile::from_bytes(bytes).map_err(|e| match e {
            Error::Malformed { format, msg } => Error::Malformed {
                format,
                msg: format!("{}: {msg}", path.display()),
            },
            e => e,
        })
    }

    /// Parses a GGUF file held in memory.
    pub fn from_bytes(bytes: Bytes) -> Result<GgufFile> {
        let buf = bytes.as_slice();
        let file_len = buf.len() as u64;
        let mut r = Cursor { buf, pos: 0 };

        let magic = r.array::<4>(&|| "magic".into())?;
        if magic != GGUF_MAGIC {
            return Err(malformed(format!(
                "not a GGUF file: starts with {magic:02x?}, expected \"GGUF\""
            )));
        }
        let version = r.u32(&|| "version".into())?;
        check_version(version)?;
        let n_tensors = r.u64(&|| "tensor count".into())?;
        let n_kv = r.u64(&|| "metadata count".into())?;
        if n_kv
            .checked_mul(MIN_KV_BYTES)
            .is_none_or(|n| n > r.remaining())
        {
            return Err(malformed(format!(
                "metadata count {n_kv} is impossible: only {} bytes remain",
                r.remaining()
            )));
        }
        if n_tensors
            .checked_mul(MIN_TENSOR_INFO_BYTES)
            .is_none_or(|n| n > r.remaining())
        {
            return Err(malformed(format!(
                "tensor count {n_tensors} is impossible: only {} bytes remain",
                r.remaining()
            )));
        }

        let mut metadata = prealloc(n_kv);
        let mut keys = HashSet::with_capacity(n_kv.min(MAX_PREALLOC) as usize);
        let mut alignment = GGUF_DEFAULT_ALIGNMENT;
        for i in 0..n_kv {
            let key = r.string(&|| format!("key of metadata entry {i}"))?;
            let at = r.pos;
            let id = r.u32(&|| format!("value type of metadata '{key}'"))?;
            let ty = GgufValueType::from_u32(id).ok_or_else(|| {
                malformed(format!(
                    "metadata '{key}' at offset {at} has unknown value type {id}"
                ))
            })?;
            let value = r.value(ty, 0, &|| format!("metadata '{key}'"))?;
            if !keys.insert(key.clone()) {
                return Err(malformed(format!("duplicate metadata key '{key}'")));
            }
            if key == KEY_ALIGNMENT {
                alignment = alignment_from_value(&value)?;
            }
            metadata.push((key, value));
        }

        let mut tensors = prealloc(n_tensors);
        let mut names = HashSet::with_capacity(n_tensors.min(MAX_PREALLOC) as usize);
        for i in 0..n_tensors {
            let name = r.string(&|| format!("name of tensor {i}"))?;
            let n_dims = r.u32(&|| format!("dimension count of tensor '{name}'"))?;
            if n_dims as usize > GGUF_MAX_DIMS {
                return Err(malformed(format!(
                    "tensor '{name}' has {n_dims} dimensions (ggml allows at most {GGUF_MAX_DIMS})"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                dims.push(r.u64(&|| format!("dimension {d} of tensor '{name}'"))?);
            }
            let id = r.u32(&|| format!("type of tensor '{name}'"))?;
            let ty = GgmlType::from_id(id).ok_or_else(|| {
                malformed(format!("tensor '{name}' has unknown ggml type id {id}"))
            })?;
            let offset = r.u64(&|| format!("data offset of tensor '{name}'"))?;
            check_tensor_shape(&name, &dims, ty)?;
            if offset % alignment != 0 {
                return Err(malformed(format!(
                    "tensor '{name}' has data offset {offset}, not a multiple of the alignment \
                     {alignment}"
                )));
            }
            if !names.insert(name.clone()) {
                return Err(malformed(format!("duplicate tensor name '{name}'")));
            }
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }

        let header_end = r.pos as u64;
        let data_offset = align_up(header_end, alignment).ok_or_else(|| {
            malformed(format!(
                "header end {header_end} rounded up to {alignment} overflows"
            ))
        })?;
        let data_len = file_len.saturating_sub(data_offset);
        if data_offset > file_len && !tensors.is_empty() {
            return Err(malformed(format!(
                "data section would start at offset {data_offset}, past the end of the file \
                 ({file_len} bytes)"
            )));
        }
        check_data_ranges(&tensors, data_len, data_offset)?;

        Ok(GgufFile {
            version,
            alignment,
            metadata,
            tensors,
            data_offset,
            bytes,
            parts: Vec::new(),
            part_of: HashMap::new(),
        })
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }
    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.get(key)?.as_i64()
    }
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f32()
    }
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }
    pub fn get_array(&self, key: &str) -> Option<&GgufArray> {
        self.get(key)?.as_array()
    }
    /// A string array; `None` if the key is missing or not an array of strings.
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get_array(key)?
            .values
            .iter()
            .map(|v| v.as_str())
            .collect()
    }
    /// A numeric array converted to f32; `None` if missing or any element is not numeric.
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get_array(key)?
            .values
            .iter()
            .map(|v| v.as_f32())
            .collect()
    }
    /// An integer array; `None` if missing or any element is not an integer that fits in i32.
    pub fn get_i32_array(&self, key: &str) -> Option<Vec<i32>> {
        self.get_array(key)?
            .values
            .iter()
            .map(|v| v.as_i64().and_then(|x| i32::try_from(x).ok()))
            .collect()
    }
    /// `general.architecture` (`llama`, `qwen2`, `gemma3`, ...).
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor's bytes: a zero-copy slice of the file (of its part, for a joined split model).
    pub fn tensor_data(&self, info: &GgufTensorInfo) -> Result<Bytes> {
        let (bytes, data_offset) = match self.part_of.get(&info.name) {
            Some(&i) => {
                let (b, o) = &self.parts[i - 1];
                (b, *o)
            }
            None => (&self.bytes, self.data_offset),
        };
        let range = data_offset.checked_add(info.offset).and_then(|start| {
            let end = start.checked_add(info.checked_nbytes()?)?;
            Some((usize::try_from(start).ok()?, usize::try_from(end).ok()?))
        });
        let (start, end) = range
            .ok_or_else(|| malformed(format!("tensor '{}': data range overflows", info.name)))?;
        if end > bytes.len() {
            return Err(malformed(format!(
                "tensor '{}' data ({start}..{end}) extends past the end of the file ({} bytes)",
                info.name,
                bytes.len()
            )));
        }
        bytes.slice(start..end)
    }

    /// The whole file (the first part, for a joined split model).
    pub fn file_bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// How many files hold the model: 1, or the parts of a joined split model.
    pub fn part_count(&self) -> usize {
        1 + self.parts.len()
    }

    /// The bytes of every file together (all parts of a joined split model).
    pub fn total_len(&self) -> u64 {
        let rest: usize = self.parts.iter().map(|(b, _)| b.len()).sum();
        (self.bytes.len() + rest) as u64
    }
}

/// Checks that every tensor's data lies inside the data section and that no two overlap.
fn check_data_ranges(tensors: &[GgufTensorInfo], data_len: u64, data_offset: u64) -> Result<()> {
    let mut ranges = Vec::with_capacity(tensors.len());
    for t in tensors {
        let nbytes = t.nbytes(); // checked in check_tensor_shape
        let end = t.offset.checked_add(nbytes);
        if end.is_none_or(|e| e > data_len) {
            return Err(malformed(format!(
                "tensor '{}' data (offset {} + {nbytes} bytes in the data section at {data_offset}) \
                 extends past the end of the file (data section holds {data_len} bytes)",
                t.name, t.offset
            )));
        }
        if nbytes > 0 {
            ranges.push((t.offset, t.offset + nbytes, t.name.as_str()));
        }
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        let ((_, a_end, a), (b_start, _, b)) = (w[0], w[1]);
        if b_start < a_end {
            return Err(malformed(format!("tensor data of '{a}' and '{b}' overlap")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn align_up_rounds_and_detects_overflow() {
        assert_eq!(align_up(0, 32), Some(0));
        assert_eq!(align_up(1, 32), Some(32));
        assert_eq!(align_up(64, 32), Some(64));
        assert_eq!(align_up(u64::MAX - 3, 8), None);
    }

    #[test]
    fn versions() {
        assert!(check_version(2).is_ok() && check_version(3).is_ok());
        assert!(check_version(1)
            .unwrap_err()
            .to_string()
            .contains("version 1"));
        assert!(check_version(3u32.swap_bytes())
            .unwrap_err()
            .to_string()
            .contains("big-endian"));
        assert!(check_version(0)
            .unwrap_err()
            .to_string()
            .contains("unsupported GGUF version 0"));
    }

    #[test]
    fn tensor_sizes_follow_ggml() {
        let t = |dims: Vec<u64>, ty| GgufTensorInfo {
            name: "t".into(),
            dims,
            ty,
            offset: 0,
        };
        assert_eq!(
            t(vec![576, 576], GgmlType::Q4_1).nbytes(),
            576 / 32 * 20 * 576
        );
        assert_eq!(t(vec![], GgmlType::F32).nbytes(), 4);
        assert_eq!(t(vec![7, 0], GgmlType::F16).nbytes(), 0);
        assert_eq!(t(vec![33], GgmlType::Q8_0).checked_nbytes(), None);
        assert_eq!(t(vec![u64::MAX, 2], GgmlType::F32).numel(), u64::MAX);
        assert_eq!(t(vec![3, 2], GgmlType::F32).shape_row_major(), vec![2, 3]);
    }
}
