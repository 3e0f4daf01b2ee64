//! Text <-> token ids for every model hf2q loads.
//!
//! One [`Tokenizer`] type, built either from a Hugging Face `tokenizer.json` (+ optional
//! `tokenizer_config.json`) or from the `tokenizer.ggml.*` metadata of a GGUF file. Both paths end
//! in the same `tokenizers` pipeline (normalizer -> pre-tokenizer -> BPE -> decoder), so encode,
//! decode and streaming behave identically whatever the model came from.
//!
//! Reference: the Hugging Face `tokenizers` library for `tokenizer.json` semantics (added tokens,
//! special tokens, byte-level BPE, byte fallback); llama.cpp's `llama-vocab.cpp` for what the GGUF
//! metadata means (token types, pre-tokenizer names, BOS/EOS defaults, end-of-generation tokens).
//! The GGUF builder lives in [`gguf`]; the incremental decoder in [`stream`].
//!
//! What it is not: a trainer, a WordPiece/Unigram implementation for GGUF (only the `gpt2` and
//! `llama` GGUF tokenizer models are built), or a pair-sequence encoder.
//!
//! Special tokens: an added token marked special (tokenizer.json) or a control/unknown token
//! (GGUF) is recognised in text only when `parse_special` is true. Non-special added tokens
//! (GGUF "user-defined", e.g. Gemma's `<table>` or runs of `\n`) are always recognised, as in both
//! references. Text from users must be encoded with `parse_special = false` (see
//! [`crate::chat_template::encode_chat`]) so that it cannot smuggle in control tokens.

pub(crate) mod gguf;
mod stream;

use std::collections::{HashMap, HashSet};
use std::path::Path;

use tokenizers::{AddedVocabulary, Model, OffsetType, PreTokenizer};

use crate::{Error, Result};

pub use gguf::GgufVocab;
pub use stream::DecodeStream;

/// Token texts that end generation when the vocabulary has them, besides the declared EOS/EOT/EOM
/// ids. The list follows llama.cpp's `special_eog_ids` detection (its fill-in-the-middle entries
/// are left out: they end infill, not chat).
const EOG_TOKEN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<end_of_utterance>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
];

/// A ready-to-use tokenizer: encode, decode, stream-decode, and the model's special ids.
#[derive(Clone)]
pub struct Tokenizer {
    /// The full pipeline; its added vocabulary recognises special tokens (parse_special = true).
    inner: tokenizers::Tokenizer,
    /// Copy of `inner`'s added vocabulary that leaves special tokens in the text as plain text
    /// (parse_special = false); non-special added tokens are still recognised.
    plain_added: AddedVocabulary,
    /// Token text by id (`None` for ids the vocabulary does not define).
    id_to_text: Vec<Option<String>>,
    /// Ids of special tokens (control tokens).
    special: HashSet<u32>,
    /// Special token texts -> id, and the distinct byte lengths of those texts (longest first),
    /// for scanning template text in [`Tokenizer::encode_with_special_spans`].
    special_by_text: HashMap<String, u32>,
    special_lens: Vec<usize>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    eog: Vec<u32>,
    chat_template: Option<String>,
}

/// Everything about a tokenizer that is not the `tokenizers` pipeline itself; filled by the
/// loaders and turned into a [`Tokenizer`] by [`Tokenizer::assemble`].
struct Meta {
    bos: Option<u32>,
    eos: Option<u32>,
    /// Extra end-of-generation ids declared by the file (GGUF eot/eom).
    extra_eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("eog", &self.eog)
            .finish_non_exhaustive()
    }
}

fn tok_err(context: &str, e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(format!("{context}: {e}"))
}

/// Parses a `tokenizer.json`. The `tokenizers` crate panics (instead of failing) on some
/// malformed files, e.g. a syntax error inside `decoder`, which its deserializer meets while
/// buffering an untagged enum (fuzz target `tokenizer_json`); the panic is caught here and the
/// file reported with the JSON error when it has one, so a hostile file is an error, never a
/// crash. (Parsing into a `serde_json::Value` first would avoid the panic but costs 40-60% more
/// load time on large vocabularies: 0.37 -> 0.56 s for Qwen2.5's, 1.5 -> 2.3 s for Gemma 3's.)
fn parse_tokenizer_json(bytes: &[u8], context: &str) -> Result<tokenizers::Tokenizer> {
    match std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(bytes)) {
        Ok(parsed) => parsed.map_err(|e| tok_err(context, e)),
        Err(panic) => {
            if let Err(e) = serde_json::from_slice::<serde_json::Value>(bytes) {
                return Err(tok_err(context, format!("not valid JSON: {e}")));
            }
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            Err(tok_err(
                context,
                format!("the tokenizers library could not read this file ({why})"),
            ))
        }
    }
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`, with the BOS/EOS names, `add_bos_token` /
    /// `add_eos_token` and `chat_template` of `tokenizer_config.json` when given. Newer
    /// checkpoints keep the template beside it instead (`chat_template.jinja`, or
    /// `chat_template.json` with a `chat_template` key); those are read when the config has none.
    ///
    /// Without a config (or without `add_bos_token` in it) BOS/EOS insertion follows what the
    /// file's post-processor adds, as `transformers` does.
    pub fn from_hf_files(
        tokenizer_json: &Path,
        tokenizer_config_json: Option<&Path>,
    ) -> Result<Tokenizer> {
        let bytes = std::fs::read(tokenizer_json).map_err(|e| Error::Io {
            path: tokenizer_json.to_path_buf(),
            source: e,
        })?;
        let inner = parse_tokenizer_json(&bytes, &tokenizer_json.display().to_string())?;
        let config = match tokenizer_config_json {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| Error::Io {
                    path: p.to_path_buf(),
                    source: e,
                })?;
                let v: serde_json::Value = serde_json::from_str(&text)
                    .map_err(|e| tok_err(&p.display().to_string(), e))?;
                if !v.is_object() {
                    return Err(Error::Tokenizer(format!(
                        "{}: not a JSON object",
                        p.display()
                    )));
                }
                Some(v)
            }
            None => None,
        };
        let mut tok = Self::from_hf_parts(inner, config.as_ref())?;
        if tok.chat_template.is_none() {
            tok.chat_template = sibling_chat_template(tokenizer_json)?;
        }
        Ok(tok)
    }

    /// Same as [`Tokenizer::from_hf_files`] for in-memory contents.
    pub fn from_hf_bytes(
        tokenizer_json: &[u8],
        tokenizer_config_json: Option<&[u8]>,
    ) -> Result<Tokenizer> {
        let inner = parse_tokenizer_json(tokenizer_json, "tokenizer.json")?;
        let config = match tokenizer_config_json {
            Some(b) => Some(
                serde_json::from_slice::<serde_json::Value>(b)
                    .map_err(|e| tok_err("tokenizer_config.json", e))?,
            ),
            None => None,
        };
        Self::from_hf_parts(inner, config.as_ref())
    }

    fn from_hf_parts(
        mut inner: tokenizers::Tokenizer,
        config: Option<&serde_json::Value>,
    ) -> Result<Tokenizer> {
        // Padding/truncation settings in a tokenizer.json are training conveniences; encoding a
        // prompt must never cut or pad it.
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| tok_err("tokenizer.json", e))?;

        let cfg_str = |key: &str| -> Option<String> {
            let v = config?.get(key)?;
            match v {
                serde_json::Value::String(s) => Some(s.clone()),
                // An AddedToken dict: {"content": "<s>", "lstrip": false, ...}
                serde_json::Value::Object(m) => m.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        let cfg_bool = |key: &str| config.and_then(|c| c.get(key)).and_then(|v| v.as_bool());

        let bos = cfg_str("bos_token").and_then(|t| inner.token_to_id(&t));
        let eos = cfg_str("eos_token").and_then(|t| inner.token_to_id(&t));

        // What the post-processor adds around a sequence: the ground truth of `add_special_tokens`
        // in `transformers` unless the config states add_bos_token / add_eos_token.
        let (probe_prefix, probe_suffix) = probe_post_processor(&inner)?;
        let add_bos = cfg_bool("add_bos_token").unwrap_or(probe_prefix.is_some());
        let add_eos = cfg_bool("add_eos_token").unwrap_or(probe_suffix.is_some());
        let bos = bos.or(if add_bos { probe_prefix } else { None });
        let eos = eos.or(if add_eos { probe_suffix } else { None });

        let chat_template = config
            .and_then(|c| c.get("chat_template"))
            .and_then(pick_chat_template);

        let meta = Meta {
            bos,
            eos,
            extra_eog: Vec::new(),
            add_bos,
            add_eos,
            chat_template,
        };
        Self::assemble(inner, meta)
    }

    /// Builds the tokenizer described by the `tokenizer.ggml.*` metadata of a GGUF file.
    pub fn from_gguf(g: &hf2q_tensor::io::gguf::GgufFile) -> Result<Tokenizer> {
        Self::from_gguf_vocab(GgufVocab::from_gguf(g)?)
    }

    /// Builds a tokenizer from GGUF-style vocabulary fields (see [`GgufVocab`]).
    pub fn from_gguf_vocab(v: GgufVocab) -> Result<Tokenizer> {
        let (inner, meta) = gguf::build(v)?;
        Self::assemble(inner, meta)
    }

    fn assemble(inner: tokenizers::Tokenizer, meta: Meta) -> Result<Tokenizer> {
        let vocab = inner.get_vocab(true);
        let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let mut id_to_text: Vec<Option<String>> = vec![None; n];
        for (text, id) in vocab {
            id_to_text[id as usize] = Some(text);
        }
        let mut special = HashSet::new();
        let mut special_by_text = HashMap::new();
        for (id, tok) in inner.get_added_tokens_decoder() {
            if tok.special {
                special.insert(id);
                special_by_text.insert(tok.content.clone(), id);
            }
        }
        let mut special_lens: Vec<usize> = special_by_text.keys().map(|t| t.len()).collect();
        special_lens.sort_unstable_by(|a, b| b.cmp(a));
        special_lens.dedup();

        let mut eog: Vec<u32> = meta
            .eos
            .into_iter()
            .chain(meta.extra_eog.iter().copied())
            .collect();
        for t in EOG_TOKEN_TEXTS {
            if let Some(id) = inner.token_to_id(t) {
                eog.push(id);
            }
        }
        // Harmony (GPT-OSS): `<|end|>` closes one message of a reply (its reasoning, before the
        // answer); `<|return|>` and `<|call|>` end generation. As llama.cpp does, a vocabulary
        // with both of those does not end generation at `<|end|>`.
        let harmony = ["<|return|>", "<|call|>"]
            .iter()
            .all(|t| inner.token_to_id(t).is_some());
        if let (true, Some(end)) = (harmony, inner.token_to_id("<|end|>")) {
            eog.retain(|&id| id != end);
        }
        eog.sort_unstable();
        eog.dedup();

        let mut plain_added = inner.get_added_vocabulary().clone();
        plain_added.set_encode_special_tokens(true);

        let check = |what: &str, id: Option<u32>| -> Result<()> {
            match id {
                Some(i) if i as usize >= n => Err(Error::Tokenizer(format!(
                    "{what} id {i} is outside the vocabulary ({n} tokens)"
                ))),
                _ => Ok(()),
            }
        };
        check("BOS", meta.bos)?;
        check("EOS", meta.eos)?;
        for &e in &eog {
            check("end-of-generation", Some(e))?;
        }
        Ok(Tokenizer {
            inner,
            plain_added,
            id_to_text,
            special,
            special_by_text,
            special_lens,
            bos: meta.bos,
            eos: meta.eos,
            add_bos: meta.add_bos && meta.bos.is_some(),
            add_eos: meta.add_eos && meta.eos.is_some(),
            eog,
            chat_template: meta.chat_template,
        })
    }

    /// Encodes `text`. `add_special`: prepend BOS / append EOS as the model's metadata says
    /// ([`Tokenizer::add_bos`], [`Tokenizer::add_eos`]). `parse_special`: whether special-token
    /// strings in `text` (e.g. `<|im_end|>`) become their special ids; when false they are
    /// tokenized as ordinary text.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let mut ids = if parse_special {
            self.encode_parsed(text)?
        } else {
            self.encode_plain(text)?
        };
        if add_special {
            if let (true, Some(b)) = (self.add_bos, self.bos) {
                ids.insert(0, b);
            }
            if let (true, Some(e)) = (self.add_eos, self.eos) {
                ids.push(e);
            }
        }
        Ok(ids)
    }

    fn encode_parsed(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| tok_err("encode", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// [`Tokenizer::encode_plain`] with each token's byte offset in `text` (where its bytes
    /// start; tokens that share a start, e.g. pieces of one character, repeat it).
    fn encode_plain_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<usize>)> {
        let mut pre = self
            .plain_added
            .extract_and_normalize(self.inner.get_normalizer(), text);
        if let Some(pt) = self.inner.get_pre_tokenizer() {
            pt.pre_tokenize(&mut pre)
                .map_err(|e| tok_err("pre-tokenize", e))?;
        }
        let model = self.inner.get_model();
        pre.tokenize(|n| model.tokenize(n.get()))
            .map_err(|e| tok_err("encode", e))?;
        let enc = pre
            .into_encoding(None, 0, OffsetType::Byte)
            .map_err(|e| tok_err("encode", e))?;
        let starts = enc.get_offsets().iter().map(|o| o.0).collect();
        Ok((enc.get_ids().to_vec(), starts))
    }

    /// The `tokenizers` encode pipeline (added tokens -> normalizer -> pre-tokenizer -> model)
    /// run with `plain_added`, so special tokens stay text.
    fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encode_plain_offsets(text)?.0)
    }

    /// Encodes text whose special-token strings count only inside the given byte ranges
    /// (`allowed`, sorted, non-overlapping). Outside them special strings are plain text. Runs of
    /// text between recognised special tokens are encoded whole, so the ids equal those of
    /// `encode(text, false, true)` whenever no special string lies outside `allowed`.
    /// No BOS/EOS is added. Also returns the byte offset in `text` where each token starts
    /// (for masking a training target by the text it came from).
    pub(crate) fn encode_with_special_spans(
        &self,
        text: &str,
        allowed: &[(usize, usize)],
    ) -> Result<(Vec<u32>, Vec<usize>)> {
        let mut ids = Vec::new();
        let mut starts = Vec::new();
        let mut run_start = 0;
        let plain =
            |ids: &mut Vec<u32>, starts: &mut Vec<usize>, lo: usize, hi: usize| -> Result<()> {
                let (i, o) = self.encode_plain_offsets(&text[lo..hi])?;
                ids.extend(i);
                starts.extend(o.into_iter().map(|x| x + lo));
                Ok(())
            };
        for &(lo, hi) in allowed {
            if lo > hi || hi > text.len() || lo < run_start {
                return Err(Error::Tokenizer(format!(
                    "bad special span {lo}..{hi} for a text of {} bytes",
                    text.len()
                )));
            }
            let mut i = lo;
            while i < hi {
                if !text.is_char_boundary(i) {
                    i += 1;
                    continue;
                }
                if let Some((len, id)) = self.special_at(&text[i..hi]) {
                    plain(&mut ids, &mut starts, run_start, i)?;
                    ids.push(id);
                    starts.push(i);
                    i += len;
                    run_start = i;
                } else {
                    i += 1;
                }
            }
        }
        plain(&mut ids, &mut starts, run_start, text.len())?;
        Ok((ids, starts))
    }

    /// The longest special token that `s` starts with (leftmost-longest, as the added-vocabulary
    /// matcher of `tokenizers`).
    fn special_at(&self, s: &str) -> Option<(usize, u32)> {
        for &len in &self.special_lens {
            if let Some(prefix) = s.get(..len) {
                if let Some(&id) = self.special_by_text.get(prefix) {
                    return Some((len, id));
                }
            }
        }
        None
    }

    /// Decodes ids to text. `skip_special` drops special (control) tokens. Ids outside the
    /// vocabulary are an error.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&i| self.token_to_str(i).is_none()) {
            return Err(Error::Tokenizer(format!(
                "cannot decode token id {bad}: the vocabulary has {} tokens",
                self.vocab_size()
            )));
        }
        self.decode_unchecked(ids, skip_special)
    }

    pub(crate) fn decode_unchecked(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| tok_err("decode", e))
    }

    /// An incremental decoder for generation: special tokens are skipped (they end or frame
    /// turns; a caller that wants them uses [`Tokenizer::decoder_with`]).
    pub fn decoder(&self) -> DecodeStream<'_> {
        DecodeStream::new(self, true)
    }

    /// An incremental decoder with an explicit choice about special tokens.
    pub fn decoder_with(&self, skip_special: bool) -> DecodeStream<'_> {
        DecodeStream::new(self, skip_special)
    }

    /// Number of token ids the tokenizer knows (one past the largest id).
    pub fn vocab_size(&self) -> usize {
        self.id_to_text.len()
    }
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }
    /// Every id that ends generation: EOS, EOT/EOM when declared, and tokens such as `<|im_end|>`,
    /// `<end_of_turn>`, `<|eot_id|>`, `<|endoftext|>` when the vocabulary has them. Sorted.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }
    pub fn bos_token(&self) -> Option<&str> {
        self.token_to_str(self.bos?)
    }
    pub fn eos_token(&self) -> Option<&str> {
        self.token_to_str(self.eos?)
    }
    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }
    /// The vocabulary entry of `id` as stored (byte-level BPE shows a space as `Ġ`, SentencePiece
    /// as `▁`); not decoded text.
    pub fn token_to_str(&self, id: u32) -> Option<&str> {
        self.id_to_text.get(id as usize)?.as_deref()
    }
    /// The id of a vocabulary entry (exact match, including special tokens).
    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }
    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }
    /// Texts of all special tokens (order unspecified).
    pub fn special_tokens(&self) -> impl Iterator<Item = &str> {
        self.special_by_text.keys().map(String::as_str)
    }
    /// The model's chat template (Jinja source), if it ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The underlying `tokenizers` pipeline (what constrained decoding builds its token trie
    /// from, [`crate::constraint`]).
    pub fn hf_tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The `tokenizers` pipeline as a Hugging Face `tokenizer.json` document (used to write an
    /// HF folder from a GGUF source).
    pub fn to_tokenizer_json(&self) -> Result<String> {
        self.inner
            .to_string(true)
            .map_err(|e| tok_err("serializing tokenizer.json", e))
    }
}

/// `chat_template.jinja` / `chat_template.json` in the folder of `tokenizer.json`, if present.
fn sibling_chat_template(tokenizer_json: &Path) -> Result<Option<String>> {
    let Some(dir) = tokenizer_json.parent() else {
        return Ok(None);
    };
    let read = |p: &Path| {
        std::fs::read_to_string(p).map_err(|e| Error::Io {
            path: p.to_path_buf(),
            source: e,
        })
    };
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return Ok(Some(read(&jinja)?));
    }
    let json = dir.join("chat_template.json");
    if json.is_file() {
        let v: serde_json::Value = serde_json::from_str(&read(&json)?)
            .map_err(|e| tok_err(&json.display().to_string(), e))?;
        return Ok(v.get("chat_template").and_then(pick_chat_template));
    }
    Ok(None)
}

/// Runs the post-processor on a one-token sequence to see what `add_special_tokens` adds:
/// (token prepended, token appended).
fn probe_post_processor(inner: &tokenizers::Tokenizer) -> Result<(Option<u32>, Option<u32>)> {
    let plain = inner
        .encode_fast("a", false)
        .map_err(|e| tok_err("probe", e))?;
    let with = inner
        .encode_fast("a", true)
        .map_err(|e| tok_err("probe", e))?;
    let (p, w) = (plain.get_ids(), with.get_ids());
    if w.len() <= p.len() {
        return Ok((None, None));
    }
    // Locate the plain ids inside the processed ones; what is before is the prefix.
    let start = (0..=w.len() - p.len()).find(|&s| w[s..s + p.len()] == *p);
    Ok(match start {
        Some(s) => (
            if s > 0 { Some(w[s - 1]) } else { None },
            if s + p.len() < w.len() {
                w.last().copied()
            } else {
                None
            },
        ),
        None => (None, None),
    })
}

/// `chat_template` of a tokenizer_config.json: a string, or a list of `{name, template}` from
/// which the one named "default" (else the first) is taken.
fn pick_chat_template(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(items) => {
            let named = |item: &serde_json::Value| -> Option<(String, String)> {
                Some((
                    item.get("name")?.as_str()?.to_string(),
                    item.get("template")?.as_str()?.to_string(),
                ))
            };
            let all: Vec<(String, String)> = items.iter().filter_map(named).collect();
            all.iter()
                .find(|(n, _)| n == "default")
                .or(all.first())
                .map(|(_, t)| t.clone())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<crate::chat_template::ChatTemplate>();
    }

    #[test]
    fn chat_template_list_takes_default() {
        let v = serde_json::json!([
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"}
        ]);
        assert_eq!(pick_chat_template(&v).as_deref(), Some("D"));
        assert_eq!(
            pick_chat_template(&serde_json::json!("S")).as_deref(),
            Some("S")
        );
        assert_eq!(pick_chat_template(&serde_json::json!(null)), None);
    }
}
