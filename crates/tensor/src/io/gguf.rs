//! GGUF: ggml's single-file model format, read and written byte-compatibly with ggml/llama.cpp
//! (spec: ggml `docs/gguf.md`; reference implementations: ggml `gguf.cpp`, gguf-py).
//!
//! - [`GgufFile`] parses a memory-mapped file and validates it against hostile input;
//!   tensor data stays in the map ([`GgufFile::tensor_data`] is a zero-copy slice).
//! - [`GgufWriter`] writes the canonical layout (what llama.cpp and gguf-py write), so reading a
//!   file and writing it back reproduces it byte for byte.
//! - [`split`]: llama.cpp's split models (`PREFIX-00001-of-0000N.gguf`), joined on open and
//!   written in parts.
//!
//! Not here: what the metadata keys mean (the model crate's config) and how tensor bytes decode
//! (`crate::quant`). Only little-endian files of versions 2 and 3 are supported.

mod read;
pub mod split;
mod value;
mod write;

pub use read::{
    GgufFile, GgufTensorInfo, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_MAX_DIMS, KEY_ALIGNMENT,
};
pub use split::{split_file_name, split_part_path, write_split};
pub use value::{GgufArray, GgufValue, GgufValueType};
pub(crate) use write::write_file_atomically;
pub use write::{write_gguf_file, GgufWriter, GGML_MAX_NAME};
