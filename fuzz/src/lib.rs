//! Fuzz targets for every parser and writer that takes outside bytes: one function per target
//! that takes arbitrary bytes, runs them through the real code path and panics only where an
//! invariant breaks (a panic inside hf2q's code is a finding too). Errors are the expected
//! answer to bad input and are not findings.
//!
//! The same functions are driven three ways:
//! - by AFL++ (`src/bin/afl.rs`, feature `afl`), coverage-guided, for the long runs that
//!   RELIABILITY.md records (`scripts/fuzz.sh`, `scripts/fuzz-campaign.sh`);
//! - by the in-process mutator of [`mutate`] (`hf2q-fuzz run`), which needs no instrumentation
//!   and is what CI runs for its short budget;
//! - by `tests/`, which replays the committed corpus and every minimised crash under
//!   `regressions/`.
//!
//! Multi-file inputs (a folder with `config.json` and weights, a template and its messages) are
//! split by [`split2`]: a little-endian `u32` length, then the first part, then the rest.
//!
//! Not here: the GPU paths (no GPU where fuzzing runs); the HTTP framing itself (hyper's, held by
//! the soak in `bench/soak.py`).

pub mod alloc_cap;
pub mod mutate;
pub mod seeds;
pub mod targets;

use std::path::PathBuf;

/// The fuzz targets, by the name used for corpus folders and on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// GGUF header, metadata and tensor table, a write/read round trip, then a forward pass on
    /// the model the file describes.
    Gguf,
    /// A safetensors shard and a `model.safetensors.index.json` naming it.
    Safetensors,
    /// `tokenizer.json` (+ text to encode and ids to decode).
    TokenizerJson,
    /// The `tokenizer.ggml.*` metadata of a GGUF file (+ text to encode).
    GgufTokenizer,
    /// A chat template and the messages it renders.
    ChatTemplate,
    /// An MLX folder: `config.json` and `model.safetensors`, loaded and run.
    Mlx,
    /// An imatrix GGUF file.
    Imatrix,
    /// A request body for `/v1/chat/completions`, `/v1/completions`, `/tokenize` or
    /// `/detokenize`, through the real router and engine on the tiny model.
    OpenaiRequest,
    /// Arbitrary text through the SSE frame and JSON writers, parsed back.
    SseJson,
}

impl Target {
    pub const ALL: [Target; 9] = [
        Target::Gguf,
        Target::Safetensors,
        Target::TokenizerJson,
        Target::GgufTokenizer,
        Target::ChatTemplate,
        Target::Mlx,
        Target::Imatrix,
        Target::OpenaiRequest,
        Target::SseJson,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Target::Gguf => "gguf",
            Target::Safetensors => "safetensors",
            Target::TokenizerJson => "tokenizer_json",
            Target::GgufTokenizer => "gguf_tokenizer",
            Target::ChatTemplate => "chat_template",
            Target::Mlx => "mlx",
            Target::Imatrix => "imatrix",
            Target::OpenaiRequest => "openai_request",
            Target::SseJson => "sse_json",
        }
    }

    pub fn from_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }

    pub fn names() -> Vec<&'static str> {
        Target::ALL.iter().map(|t| t.name()).collect()
    }

    /// Runs one input.
    pub fn run(self, data: &[u8]) {
        match self {
            Target::Gguf => targets::gguf::run(data),
            Target::Safetensors => targets::safetensors::run(data),
            Target::TokenizerJson => targets::tokenizer::run_json(data),
            Target::GgufTokenizer => targets::tokenizer::run_gguf(data),
            Target::ChatTemplate => targets::chat_template::run(data),
            Target::Mlx => targets::mlx::run(data),
            Target::Imatrix => targets::imatrix::run(data),
            Target::OpenaiRequest => targets::openai::run(data),
            Target::SseJson => targets::sse_json::run(data),
        }
    }
}

/// The committed seed corpus of `target` (`fuzz/corpus/NAME`).
pub fn corpus_dir(target: Target) -> PathBuf {
    fuzz_dir().join("corpus").join(target.name())
}

/// The minimised inputs of crashes found and fixed (`fuzz/regressions/NAME`).
pub fn regressions_dir(target: Target) -> PathBuf {
    fuzz_dir().join("regressions").join(target.name())
}

/// This crate's folder in the source tree.
pub fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The repository's test fixtures that the seeds and the targets read.
pub fn fixtures_dir() -> PathBuf {
    fuzz_dir().join("../crates/models/tests/fixtures")
}

/// Splits a two-part input: a little-endian `u32` length `n`, then `n` bytes of the first part
/// (fewer if the input ends), then the second part. Inputs shorter than 4 bytes are all second
/// part.
pub fn split2(data: &[u8]) -> (&[u8], &[u8]) {
    if data.len() < 4 {
        return (&[], data);
    }
    let n = u32::from_le_bytes([data[0], data[1], data[2], data[3]]) as usize;
    let rest = &data[4..];
    let n = n.min(rest.len());
    rest.split_at(n)
}

/// The inverse of [`split2`], for writing seeds.
pub fn join2(a: &[u8], b: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + a.len() + b.len());
    v.extend_from_slice(&(a.len() as u32).to_le_bytes());
    v.extend_from_slice(a);
    v.extend_from_slice(b);
    v
}

/// A scratch folder for targets that must go through a path (loaders that memory-map), one per
/// process and thread, reused across inputs.
pub fn scratch_dir() -> PathBuf {
    thread_local! {
        static DIR: tempfile::TempDir = tempfile::Builder::new()
            .prefix("hf2q-fuzz-")
            .tempdir()
            .expect("a scratch folder in the temporary directory");
    }
    DIR.with(|d| d.path().to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_join_are_inverse() {
        let v = join2(b"abc", b"defg");
        assert_eq!(split2(&v), (&b"abc"[..], &b"defg"[..]));
        assert_eq!(split2(b"ab"), (&b""[..], &b"ab"[..]));
        // A length past the end takes what there is.
        let mut v = join2(b"abc", b"");
        v[0] = 200;
        assert_eq!(split2(&v), (&b"abc"[..], &b""[..]));
    }

    #[test]
    fn names_round_trip() {
        for t in Target::ALL {
            assert_eq!(Target::from_name(t.name()), Some(t));
        }
    }
}
