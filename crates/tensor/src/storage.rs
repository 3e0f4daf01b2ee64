//! `Bytes`: a cheap, clonable view of immutable bytes owned by a memory map or a vector.
//! Weights stay in their stored (quantized) form inside a `Bytes`; nothing is copied on load.

use std::ops::Range;
use std::sync::Arc;

use crate::{Error, Result};

#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn Owner>,
    start: usize,
    len: usize,
}

/// What holds the bytes of a [`Bytes`].
trait Owner: AsRef<[u8]> + Send + Sync {
    /// Lets go of the memory behind `range` where it can be had back unchanged (see
    /// [`Bytes::release_pages`]); by default nothing.
    fn release(&self, _range: Range<usize>) {}
}

impl Owner for Vec<u8> {}

struct MmapOwner(memmap2::Mmap);
impl AsRef<[u8]> for MmapOwner {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Owner for MmapOwner {
    fn release(&self, range: Range<usize>) {
        // SAFETY: the map is a read-only shared mapping of a file: MADV_DONTNEED only drops this
        // process's page-table entries, and the next read faults the same bytes back in from the
        // file (never zeros, as it would for private or anonymous memory). No reference is
        // invalidated. Failure only means the pages stay resident.
        #[cfg(unix)]
        unsafe {
            let _ = self.0.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                range.start,
                range.end - range.start,
            );
        }
        #[cfg(not(unix))]
        let _ = range;
    }
}

impl Bytes {
    pub fn from_vec(v: Vec<u8>) -> Bytes {
        let len = v.len();
        Bytes {
            owner: Arc::new(v),
            start: 0,
            len,
        }
    }
    pub fn from_mmap(m: memmap2::Mmap) -> Bytes {
        let len = m.len();
        Bytes {
            owner: Arc::new(MmapOwner(m)),
            start: 0,
            len,
        }
    }
    /// Memory-maps a whole file read-only.
    pub fn map_file(path: &std::path::Path) -> Result<Bytes> {
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
        if len == 0 {
            return Ok(Bytes::from_vec(Vec::new()));
        }
        // SAFETY: the map is read-only; hf2q never writes to a file it has mapped. A file truncated
        // by another process while mapped is outside what any mmap-based loader can defend against.
        let m = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(path, e))?;
        Ok(Bytes::from_mmap(m))
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
    /// Hands the memory behind these bytes back to the OS when it can be had back unchanged: for
    /// a mapped file, the pages are dropped from this process (its resident set) and read
    /// from the file again if these bytes are used later; for bytes in memory, nothing. For a
    /// weight whose bytes a kernel has copied into a layout of its own (`cpu::kernels::pack`),
    /// so that the copy does not count twice.
    pub fn release_pages(&self) {
        if self.len > 0 {
            self.owner.release(self.start..self.start + self.len);
        }
    }
    /// A sub-view; errors (never panics) when the range is outside this view.
    pub fn slice(&self, r: Range<usize>) -> Result<Bytes> {
        if r.start > r.end || r.end > self.len {
            return Err(Error::Msg(format!(
                "byte range {}..{} is outside a buffer of {} bytes",
                r.start, r.end, self.len
            )));
        }
        Ok(Bytes {
            owner: self.owner.clone(),
            start: self.start + r.start,
            len: r.end - r.start,
        })
    }
}

impl AsRef<[u8]> for Bytes {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({} bytes)", self.len)
    }
}
