//! GGUF writer: emits the layout ggml's `gguf_write_to_file` and gguf-py's `GGUFWriter` emit, so
//! that a file read by [`GgufFile`] and written back is identical byte for byte, and llama.cpp
//! loads what we write.
//!
//! Canonical layout: header, metadata in the order added, tensor infos in the order added, zero
//! padding to the alignment, then each tensor's data followed by zero padding to the alignment.
//! Tensor offsets are assigned here (each tensor starts where the previous one's padded data ends),
//! which is also the only layout llama.cpp's loader accepts.
//!
//! Tensor data is either attached up front ([`GgufWriter::add_tensor`], zero-copy for tensors taken
//! from another file) or produced while writing ([`GgufWriter::add_tensor_info`] +
//! [`GgufWriter::write_with`]), so a quantizer never needs the whole output in memory.

use std::io::Write;
use std::path::Path;

use super::read::{
    align_up, alignment_from_value, check_tensor_shape, malformed, GgufFile, GgufTensorInfo,
    GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, KEY_ALIGNMENT, MAX_ARRAY_DEPTH,
};
use super::value::{GgufArray, GgufValue};
use crate::{Bytes, Error, GgmlType, Result};

/// ggml's `GGML_MAX_NAME` is 64 including the terminating NUL: llama.cpp refuses longer names.
pub const GGML_MAX_NAME: usize = 64;

#[derive(Clone, Debug)]
struct PendingTensor {
    info: GgufTensorInfo,
    data: Option<Bytes>,
}

/// Builds a GGUF file: metadata and tensors in the order added.
#[derive(Clone, Debug)]
pub struct GgufWriter {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<PendingTensor>,
    /// Data-section offset where the next tensor will start.
    next_offset: u64,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter::new()
    }
}

impl GgufWriter {
    /// A GGUF version 3 writer with the default alignment (32).
    pub fn new() -> GgufWriter {
        GgufWriter {
            version: 3,
            alignment: GGUF_DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            tensors: Vec::new(),
            next_offset: 0,
        }
    }

    /// A writer for GGUF version 2 or 3 (they share one layout; only the version field differs).
    pub fn with_version(version: u32) -> Result<GgufWriter> {
        if !matches!(version, 2 | 3) {
            return Err(Error::Msg(format!(
                "cannot write GGUF version {version} (only 2 and 3)"
            )));
        }
        Ok(GgufWriter {
            version,
            ..GgufWriter::new()
        })
    }

    /// A writer holding everything in `file`: same version, metadata, tensors (data shared with
    /// `file`, not copied). Writing it reproduces a canonically laid out file byte for byte.
    pub fn from_file(file: &GgufFile) -> Result<GgufWriter> {
        let mut w = GgufWriter::with_version(file.version)?;
        for (k, v) in &file.metadata {
            w.add_metadata(k.clone(), v.clone())?;
        }
        for t in &file.tensors {
            w.add_tensor(t.name.clone(), t.dims.clone(), t.ty, file.tensor_data(t)?)?;
        }
        Ok(w)
    }

    pub fn version(&self) -> u32 {
        self.version
    }
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }
    /// Tensor infos with the offsets they will be written at.
    pub fn tensor_infos(&self) -> impl Iterator<Item = &GgufTensorInfo> {
        self.tensors.iter().map(|t| &t.info)
    }

    /// Appends a metadata entry. `general.alignment` must be a u32 power of two (llama.cpp reads
    /// it as u32) and must come before any tensor, since it moves every tensor offset.
    pub fn add_metadata(
        &mut self,
        key: impl Into<String>,
        value: impl Into<GgufValue>,
    ) -> Result<()> {
        let key = key.into();
        if self.metadata.iter().any(|(k, _)| *k == key) {
            return Err(Error::Msg(format!("duplicate GGUF metadata key '{key}'")));
        }
        let value = value.into();
        self.check_value(&key, &value)?;
        self.metadata.push((key, value));
        Ok(())
    }

    /// Replaces the value of `key` where it stands, or appends it.
    pub fn set_metadata(
        &mut self,
        key: impl Into<String>,
        value: impl Into<GgufValue>,
    ) -> Result<()> {
        let key = key.into();
        let value = value.into();
        self.check_value(&key, &value)?;
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => *v = value,
            None => self.metadata.push((key, value)),
        }
        Ok(())
    }

    /// Removes `key`, returning its value.
    pub fn remove_metadata(&mut self, key: &str) -> Result<Option<GgufValue>> {
        if key == KEY_ALIGNMENT && !self.tensors.is_empty() {
            return Err(Error::Msg(format!(
                "cannot remove {KEY_ALIGNMENT} after tensors are added"
            )));
        }
        let Some(i) = self.metadata.iter().position(|(k, _)| k == key) else {
            return Ok(None);
        };
        if key == KEY_ALIGNMENT {
            self.alignment = GGUF_DEFAULT_ALIGNMENT;
        }
        Ok(Some(self.metadata.remove(i).1))
    }

    fn check_value(&mut self, key: &str, value: &GgufValue) -> Result<()> {
        check_array_types(key, value, 0)?;
        if key == KEY_ALIGNMENT {
            if !matches!(value, GgufValue::U32(_)) {
                return Err(Error::Msg(format!(
                    "{KEY_ALIGNMENT} must be a u32, got a {}",
                    value.value_type()
                )));
            }
            let a = alignment_from_value(value)?;
            if !self.tensors.is_empty() && a != self.alignment {
                return Err(Error::Msg(format!(
                    "{KEY_ALIGNMENT} must be set before any tensor is added"
                )));
            }
            self.alignment = a;
        }
        Ok(())
    }

    /// Adds a tensor whose data is `data` (exactly `nbytes` of the type and dims).
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: Vec<u64>,
        ty: GgmlType,
        data: Bytes,
    ) -> Result<()> {
        self.push_tensor(name.into(), dims, ty, Some(data))
    }

    /// Adds a tensor whose data will be supplied by the callback of [`Self::write_with`].
    pub fn add_tensor_info(
        &mut self,
        name: impl Into<String>,
        dims: Vec<u64>,
        ty: GgmlType,
    ) -> Result<()> {
        self.push_tensor(name.into(), dims, ty, None)
    }

    fn push_tensor(
        &mut self,
        name: String,
        dims: Vec<u64>,
        ty: GgmlType,
        data: Option<Bytes>,
    ) -> Result<()> {
        if name.len() >= GGML_MAX_NAME {
            return Err(Error::Msg(format!(
                "tensor name '{name}' is {} bytes; ggml allows at most {}",
                name.len(),
                GGML_MAX_NAME - 1
            )));
        }
        if self.tensors.iter().any(|t| t.info.name == name) {
            return Err(Error::Msg(format!("duplicate GGUF tensor name '{name}'")));
        }
        let nbytes = check_tensor_shape(&name, &dims, ty)?;
        if let Some(d) = &data {
            if d.len() as u64 != nbytes {
                return Err(Error::Shape(format!(
                    "tensor '{name}': {} bytes given, but {dims:?} x {ty} needs {nbytes}",
                    d.len()
                )));
            }
        }
        let offset = self.next_offset;
        self.next_offset = offset
            .checked_add(nbytes)
            .and_then(|end| align_up(end, self.alignment))
            .ok_or_else(|| Error::Msg(format!("tensor '{name}': data section size overflows")))?;
        self.tensors.push(PendingTensor {
            info: GgufTensorInfo {
                name,
                dims,
                ty,
                offset,
            },
            data,
        });
        Ok(())
    }

    /// Writes the whole file. Every tensor must have its data attached.
    pub fn write<W: Write + ?Sized>(&self, w: &mut W) -> Result<u64> {
        self.write_with(w, |info: &GgufTensorInfo| -> Result<Vec<u8>> {
            Err(Error::Msg(format!(
                "tensor '{}' has no data attached",
                info.name
            )))
        })
    }

    /// Writes the whole file, calling `data` (in file order) for each tensor added without data.
    /// Returns the number of bytes written.
    pub fn write_with<W, D, F>(&self, w: &mut W, mut data: F) -> Result<u64>
    where
        W: Write + ?Sized,
        D: AsRef<[u8]>,
        F: FnMut(&GgufTensorInfo) -> Result<D>,
    {
        let mut out = Counting { inner: w, n: 0 };
        self.write_header(&mut out)?;
        for t in &self.tensors {
            let produced;
            let bytes: &[u8] = match &t.data {
                Some(b) => b.as_slice(),
                None => {
                    produced = data(&t.info)?;
                    produced.as_ref()
                }
            };
            if bytes.len() as u64 != t.info.nbytes() {
                return Err(Error::Shape(format!(
                    "tensor '{}': {} bytes supplied, but its type and dims need {}",
                    t.info.name,
                    bytes.len(),
                    t.info.nbytes()
                )));
            }
            out.write_all(bytes)?;
            pad(&mut out, self.alignment)?;
        }
        out.flush()?;
        Ok(out.n)
    }

    fn write_header<W: Write + ?Sized>(&self, out: &mut Counting<W>) -> Result<()> {
        out.write_all(&GGUF_MAGIC)?;
        out.write_all(&self.version.to_le_bytes())?;
        out.write_all(&(self.tensors.len() as u64).to_le_bytes())?;
        out.write_all(&(self.metadata.len() as u64).to_le_bytes())?;
        for (k, v) in &self.metadata {
            write_str(out, k)?;
            out.write_all(&v.value_type().id().to_le_bytes())?;
            write_value(out, v)?;
        }
        for t in &self.tensors {
            let i = &t.info;
            write_str(out, &i.name)?;
            out.write_all(&(i.dims.len() as u32).to_le_bytes())?;
            for d in &i.dims {
                out.write_all(&d.to_le_bytes())?;
            }
            out.write_all(&i.ty.id().to_le_bytes())?;
            out.write_all(&i.offset.to_le_bytes())?;
        }
        pad(out, self.alignment)
    }

    /// Writes to `path` through a temporary file in the same directory, renamed into place once
    /// complete: an interrupted write never leaves a complete-looking file.
    pub fn write_file(&self, path: &Path) -> Result<()> {
        write_file_atomically(path, |w| self.write(w).map(|_| ()))
    }

    /// [`Self::write_with`] into a file, written atomically as [`Self::write_file`] is.
    pub fn write_file_with<D, F>(&self, path: &Path, data: F) -> Result<()>
    where
        D: AsRef<[u8]>,
        F: FnMut(&GgufTensorInfo) -> Result<D>,
    {
        write_file_atomically(path, |w| self.write_with(w, data).map(|_| ()))
    }
}

/// Writes `writer` to `path` atomically (see [`GgufWriter::write_file`]).
pub fn write_gguf_file(path: &Path, writer: &GgufWriter) -> Result<()> {
    writer.write_file(path)
}

fn check_array_types(key: &str, v: &GgufValue, depth: usize) -> Result<()> {
    let GgufValue::Array(GgufArray { elem_type, values }) = v else {
        return Ok(());
    };
    if depth >= MAX_ARRAY_DEPTH {
        return Err(Error::Msg(format!(
            "metadata '{key}' nests arrays deeper than {MAX_ARRAY_DEPTH}"
        )));
    }
    for (i, x) in values.iter().enumerate() {
        if x.value_type() != *elem_type {
            return Err(Error::Msg(format!(
                "metadata '{key}': array of {elem_type} holds a {} at index {i}",
                x.value_type()
            )));
        }
        check_array_types(key, x, depth + 1)?;
    }
    Ok(())
}

fn write_str<W: Write>(out: &mut W, s: &str) -> Result<()> {
    out.write_all(&(s.len() as u64).to_le_bytes())?;
    out.write_all(s.as_bytes())?;
    Ok(())
}

fn write_value<W: Write>(out: &mut W, v: &GgufValue) -> Result<()> {
    match v {
        GgufValue::U8(x) => out.write_all(&x.to_le_bytes())?,
        GgufValue::I8(x) => out.write_all(&x.to_le_bytes())?,
        GgufValue::U16(x) => out.write_all(&x.to_le_bytes())?,
        GgufValue::I16(x) => out.write_all(&x.to_le_bytes())?,
        GgufValue::U32(x) => out.write_all(&x.to_le_bytes())?,
        GgufValue::I32(x) => out.write_all(&x.to_le_bytes())?,
        GgufValue::F32(x) => out.write_all(&x.to_le_bytes())?,
        GgufValue::U64(x) => out.write_all(&x.to_le_bytes())?,
        GgufValue::I64(x) => out.write_all(&x.to_le_bytes())?,
        GgufValue::F64(x) => out.write_all(&x.to_le_bytes())?,
        GgufValue::Bool(x) => out.write_all(&[u8::from(*x)])?,
        GgufValue::String(s) => write_str(out, s)?,
        GgufValue::Array(a) => {
            out.write_all(&a.elem_type.id().to_le_bytes())?;
            out.write_all(&(a.values.len() as u64).to_le_bytes())?;
            for x in &a.values {
                write_value(out, x)?;
            }
        }
    }
    Ok(())
}

/// A writer that counts the bytes through it, to place padding.
struct Counting<'a, W: Write + ?Sized> {
    inner: &'a mut W,
    n: u64,
}

impl<W: Write + ?Sized> Write for Counting<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn pad<W: Write + ?Sized>(out: &mut Counting<W>, alignment: u64) -> Result<()> {
    let target = align_up(out.n, alignment).ok_or_else(|| malformed("file size overflows"))?;
    const ZEROS: [u8; 256] = [0; 256];
    let mut left = target - out.n;
    while left > 0 {
        let k = left.min(ZEROS.len() as u64) as usize;
        out.write_all(&ZEROS[..k])?;
        left -= k as u64;
    }
    Ok(())
}

/// Writes a file through a temporary name in the same directory (`.<name>.<pid>.<n>.partial`),
/// flushed and synced, then renamed onto `path`. On failure the temporary file is removed and
/// `path` is untouched; leftovers of killed earlier runs beside `path` are removed first. Every
/// i/o error names `path`. Shared by the GGUF and safetensors writers.
pub(crate) fn write_file_atomically(
    path: &Path,
    body: impl FnOnce(&mut dyn Write) -> Result<()>,
) -> Result<()> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);

    let file_name = path
        .file_name()
        .ok_or_else(|| Error::Msg(format!("{}: not a file path", path.display())))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".{}.{}.{n}.partial",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    crate::io::remove_stale_temps(path);
    let result = (|| -> Result<()> {
        let f = std::fs::File::create(&tmp).map_err(|e| Error::io(path, e))?;
        let mut bw = std::io::BufWriter::with_capacity(1 << 20, f);
        body(&mut bw).map_err(|e| match e {
            Error::IoBare(e) => Error::io(path, e),
            e => e,
        })?;
        let f = bw
            .into_inner()
            .map_err(|e| Error::io(path, e.into_error()))?;
        f.sync_all().map_err(|e| Error::io(path, e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
