//! The tiny random Llama of the models crate's fixtures (2 layers, width 64, 259 byte-level
//! tokens), compiled into the fuzz binaries so that they run from any folder (the campaign copies
//! only the binary and the corpora). Written to the scratch folder once per process.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use hf2q_models::tokenizer::Tokenizer;
use hf2q_models::Model;

macro_rules! fixture {
    ($name:literal) => {
        include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../crates/models/tests/fixtures/tiny/tiny-llama/",
            $name
        ))
    };
}

pub const CONFIG_JSON: &[u8] = fixture!("config.json");
pub const MODEL_SAFETENSORS: &[u8] = fixture!("model.safetensors");
pub const TOKENIZER_JSON: &[u8] = fixture!("tokenizer.json");
pub const TOKENIZER_CONFIG_JSON: &[u8] = fixture!("tokenizer_config.json");

/// The tiny model's folder, written on first use.
pub fn folder() -> PathBuf {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::Builder::new()
            .prefix("hf2q-fuzz-tiny-")
            .tempdir()
            .expect("a folder for the tiny model");
        for (name, bytes) in [
            ("config.json", CONFIG_JSON),
            ("model.safetensors", MODEL_SAFETENSORS),
            ("tokenizer.json", TOKENIZER_JSON),
            ("tokenizer_config.json", TOKENIZER_CONFIG_JSON),
        ] {
            std::fs::write(d.path().join(name), bytes).expect("writing the tiny model");
        }
        d
    })
    .path()
    .to_path_buf()
}

/// The tiny model, loaded once.
pub fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| Arc::new(Model::load(&folder()).expect("the tiny model loads")))
        .clone()
}

/// Its tokenizer, loaded once.
pub fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        Tokenizer::from_hf_bytes(TOKENIZER_JSON, Some(TOKENIZER_CONFIG_JSON))
            .expect("the tiny tokenizer loads")
    })
}
