//! One module per fuzz target; each `run` takes the raw input (see the crate header).

pub mod chat_template;
pub mod gguf;
pub mod imatrix;
pub mod mlx;
pub mod openai;
pub mod safetensors;
pub mod sse_json;
pub mod tiny;
pub mod tokenizer;

use std::path::PathBuf;

/// Writes `bytes` to `name` in this thread's scratch folder and returns its path.
pub(crate) fn scratch_file(name: &str, bytes: &[u8]) -> PathBuf {
    let p = crate::scratch_dir().join(name);
    std::fs::write(&p, bytes).expect("writing a scratch file");
    p
}

/// Token ids for a forward pass: the first bytes of `seed`, folded into the vocabulary.
pub(crate) fn prompt_ids(seed: &[u8], vocab: usize) -> Vec<u32> {
    let v = vocab.max(1) as u32;
    let mut ids: Vec<u32> = seed.iter().take(4).map(|&b| b as u32 % v).collect();
    if ids.is_empty() {
        ids.push(0);
    }
    ids
}

/// Loads the model at `path` (already validated by its reader) and runs a short prefill and two
/// greedy decode steps. Errors are fine; logits that are not finite are fine too (random or
/// hostile weights); a panic is a finding.
pub(crate) fn forward(path: &std::path::Path, seed: &[u8]) {
    let Ok(model) = hf2q_models::Model::load(path) else {
        return;
    };
    let vocab = model.vocab_size();
    let ids = prompt_ids(seed, vocab);
    let mut s = model.session(16);
    let Ok(logits) = s.prefill(&ids) else { return };
    assert_eq!(
        logits.len(),
        vocab,
        "prefill returns one logit per vocabulary entry"
    );
    let mut tok = ids[0];
    for _ in 0..2 {
        match s.decode_greedy(tok) {
            Ok(t) => {
                assert!(
                    (t as usize) < vocab,
                    "greedy token {t} outside the vocabulary {vocab}"
                );
                tok = t;
            }
            Err(_) => return,
        }
    }
    // The tokenizer that came with it, on text made from the same bytes.
    let text = String::from_utf8_lossy(seed);
    if let Ok(ids) = model.tokenizer().encode(&text, true, true) {
        let _ = model.tokenizer().decode(&ids, false);
    }
}
