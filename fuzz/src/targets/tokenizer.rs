//! Tokenizer loading and use: `tokenizer.json` (+ text) through the Hugging Face loader, and the
//! `tokenizer.ggml.*` metadata of a GGUF file (+ text) through the GGUF vocabulary builder. Each
//! loaded tokenizer encodes the text, decodes the result, decodes ids taken from the input
//! (in and out of range), and streams them through the incremental decoder the server uses.

use hf2q_models::tokenizer::Tokenizer;
use hf2q_tensor::io::gguf::GgufFile;
use hf2q_tensor::Bytes;

/// Input: [`crate::split2`] of `tokenizer.json` and the text.
pub fn run_json(data: &[u8]) {
    let (json, text) = crate::split2(data);
    if let Ok(tok) = Tokenizer::from_hf_bytes(json, None) {
        exercise(&tok, text);
    }
}

/// Input: [`crate::split2`] of a GGUF file and the text.
pub fn run_gguf(data: &[u8]) {
    let (gguf, text) = crate::split2(data);
    let Ok(file) = GgufFile::from_bytes(Bytes::from_vec(gguf.to_vec())) else {
        return;
    };
    if let Ok(tok) = Tokenizer::from_gguf(&file) {
        exercise(&tok, text);
    }
}

fn exercise(tok: &Tokenizer, text: &[u8]) {
    let s = String::from_utf8_lossy(text);
    for (add_special, parse_special) in [(true, true), (false, false)] {
        if let Ok(ids) = tok.encode(&s, add_special, parse_special) {
            let vocab = tok.vocab_size();
            for &id in &ids {
                assert!(
                    (id as usize) < vocab.max(1) || tok.token_to_str(id).is_some(),
                    "encode gave id {id} outside the vocabulary of {vocab}"
                );
            }
            let _ = tok.decode(&ids, false);
            let _ = tok.decode(&ids, true);
        }
    }
    // Ids straight from the input: in range, and a few past the end.
    let vocab = tok.vocab_size() as u32;
    let ids: Vec<u32> = text
        .chunks(2)
        .map(|c| {
            let x = u16::from_le_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32;
            x % (vocab + 4)
        })
        .take(256)
        .collect();
    let _ = tok.decode(&ids, false);
    let mut stream = tok.decoder();
    for &id in &ids {
        let _ = stream.push(id);
    }
    let _ = stream.flush();
    for &id in ids.iter().take(16) {
        let _ = tok.token_to_str(id);
        let _ = tok.is_special(id);
        let _ = tok.is_eog(id);
    }
    let _ = tok.chat_template();
}
