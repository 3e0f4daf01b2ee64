//! Building a tokenizer from GGUF `tokenizer.ggml.*` metadata.
//!
//! Two GGUF tokenizer models are supported, each mapped onto the `tokenizers` pipeline that the
//! model's own `tokenizer.json` uses, so ids match the upstream tokenizer:
//!
//! - `gpt2`: byte-level BPE from `tokens` + `merges`. The pre-tokenizer is chosen by
//!   `tokenizer.ggml.pre` with llama.cpp's name table (`llama-vocab.cpp`); the regexes are the
//!   upstream `tokenizer.json` ones where llama.cpp only rewrote them for its own regex engine
//!   (e.g. `(?i:'s|...)`), else llama.cpp's. Qwen2 vocabularies get the NFC normalizer that their
//!   `tokenizer.json` has (llama.cpp skips it).
//! - `llama`: SentencePiece BPE (Llama 2, Gemma) from `tokens` + `scores`, with byte fallback
//!   (`<0xXX>`), `▁` for spaces and `add_space_prefix`. Merges are rebuilt from the scores the way
//!   `transformers`' SentencePiece converter does (`generate_merges`: rank by the score of the
//!   merged piece), which is what the model's `tokenizer.json` contains.
//!
//! Token types (`tokenizer.ggml.token_type`): 1 normal, 2 unknown, 3 control, 4 user-defined,
//! 5 unused, 6 byte. Control and unknown tokens become special added tokens (recognised in text
//! only with `parse_special`); user-defined ones become non-special added tokens (always
//! recognised, as in llama.cpp and in the upstream `tokenizer.json`). llama.cpp's converter stores
//! user-defined SentencePiece tokens with `▁` already turned into spaces; they are turned back so
//! that the vocabulary equals the upstream one.

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
};

use super::{Meta, EOG_TOKEN_TEXTS};
use crate::{Error, Result};

const TYPE_NORMAL: i32 = 1;
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

/// The tokenizer fields of a GGUF file (`tokenizer.ggml.*`, `tokenizer.chat_template`).
#[derive(Clone, Debug, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: "gpt2" or "llama".
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer name ("qwen2", "llama-bpe", "smollm", ...).
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    pub token_types: Option<Vec<i32>>,
    /// "left right" pairs, highest priority first.
    pub merges: Option<Vec<String>>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub eot_id: Option<u32>,
    pub eom_id: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    pub chat_template: Option<String>,
}

impl GgufVocab {
    /// Reads the tokenizer metadata of an open GGUF file; checks types and lengths.
    pub fn from_gguf(g: &hf2q_tensor::io::gguf::GgufFile) -> Result<GgufVocab> {
        let bad =
            |key: &str, what: &str| Error::Tokenizer(format!("GGUF metadata '{key}': {what}"));
        let model = g
            .get_str("tokenizer.ggml.model")
            .ok_or_else(|| bad("tokenizer.ggml.model", "missing or not a string"))?
            .to_string();
        let tokens: Vec<String> = g
            .get_str_array("tokenizer.ggml.tokens")
            .ok_or_else(|| {
                bad(
                    "tokenizer.ggml.tokens",
                    "missing or not an array of strings",
                )
            })?
            .into_iter()
            .map(str::to_string)
            .collect();
        // An optional array: absent is fine, present with the wrong element type is an error.
        fn opt_array<T>(key: &str, present: bool, v: Option<Vec<T>>) -> Result<Option<Vec<T>>> {
            match (present, v) {
                (false, _) => Ok(None),
                (true, None) => Err(Error::Tokenizer(format!(
                    "GGUF metadata '{key}': wrong element type"
                ))),
                (true, Some(v)) => Ok(Some(v)),
            }
        }
        let key = "tokenizer.ggml.scores";
        let scores = opt_array(key, g.get(key).is_some(), g.get_f32_array(key))?;
        let key = "tokenizer.ggml.token_type";
        let token_types = opt_array(key, g.get(key).is_some(), g.get_i32_array(key))?;
        let key = "tokenizer.ggml.merges";
        let merges = match g.get(key) {
            None => None,
            Some(_) => Some(
                g.get_str_array(key)
                    .ok_or_else(|| bad(key, "not an array of strings"))?
                    .into_iter()
                    .map(str::to_string)
                    .collect(),
            ),
        };
        let id = |key: &str| -> Result<Option<u32>> {
            match g.get(key) {
                None => Ok(None),
                Some(_) => {
                    let v = g
                        .get_u64(key)
                        .ok_or_else(|| bad(key, "not an unsigned integer"))?;
                    u32::try_from(v)
                        .map(Some)
                        .map_err(|_| bad(key, "does not fit in u32"))
                }
            }
        };
        let flag = |key: &str| -> Result<Option<bool>> {
            match g.get(key) {
                None => Ok(None),
                Some(_) => g
                    .get_bool(key)
                    .map(Some)
                    .ok_or_else(|| bad(key, "not a bool")),
            }
        };
        Ok(GgufVocab {
            model,
            pre: g.get_str("tokenizer.ggml.pre").map(str::to_string),
            tokens,
            scores,
            token_types,
            merges,
            bos_id: id("tokenizer.ggml.bos_token_id")?,
            eos_id: id("tokenizer.ggml.eos_token_id")?,
            unk_id: id("tokenizer.ggml.unknown_token_id")?,
            eot_id: id("tokenizer.ggml.eot_token_id")?,
            eom_id: id("tokenizer.ggml.eom_token_id")?,
            add_bos: flag("tokenizer.ggml.add_bos_token")?,
            add_eos: flag("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix")?,
            chat_template: g.get_str("tokenizer.chat_template").map(str::to_string),
        })
    }
}

/// Pre-tokenizer choice for a byte-level BPE vocabulary.
struct PreSpec {
    /// Applied in order, each splitting the pieces of the previous one (matches isolated).
    regexes: &'static [&'static str],
    /// A word that is itself a vocabulary entry is taken whole, without merges.
    ignore_merges: bool,
    nfc: bool,
    /// llama.cpp's default for add_bos when the file does not say.
    add_bos: bool,
}

// The GPT-2 regex as in `tokenizers`' ByteLevel pre-tokenizer.
const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const RE_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(crate) const RE_GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_GPT2_NO_TAIL: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const RE_PORO: &str = " ?[^(\\s|.,!?\u{2026}\u{3002}\u{ff0c}\u{3001}\u{964}\u{6d4}\u{60c})]+";
// Non-ASCII characters are written as escapes: the ranges must stay byte-exact (an editor's
// Unicode normalization would silently change e.g. U+1F7D into U+03CE).
const RE_DEEPSEEK_PUNCT: &str =
    "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+";
const RE_CJK_HANGUL: &str = "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+";
const RE_CJK_KANA: &str = "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+";
const RE_DEEPSEEK_LLM_LETTERS: &str = "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+";
const RE_DEEPSEEK3_WORDS: &str = r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn pre_spec(pre: &str) -> Option<PreSpec> {
    let spec = |regexes: &'static [&'static str], ignore_merges: bool, nfc: bool, add_bos: bool| {
        Some(PreSpec {
            regexes,
            ignore_merges,
            nfc,
            add_bos,
        })
    };
    match pre {
        "default" => spec(
            &[
                r"[\p{P}\$\+<=>\^~\|]+",
                RE_GPT2_NO_TAIL,
                r"\p{N}+",
                "[0-9][0-9][0-9]",
            ],
            false,
            false,
            false,
        ),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => spec(&[RE_LLAMA3], true, false, true),
        "dbrx" | "smaug-bpe" | "chatglm-bpe" | "glm4" => spec(&[RE_LLAMA3], false, false, false),
        "deepseek-llm" => spec(
            &[
                r"[\r\n]",
                RE_DEEPSEEK_LLM_LETTERS,
                RE_DEEPSEEK_PUNCT,
                r"\s+$",
                RE_CJK_HANGUL,
                r"\p{N}+",
            ],
            false,
            false,
            false,
        ),
        "deepseek-coder" => spec(
            &[
                r"[\r\n]",
                r"\s?\p{L}+",
                r"\s?\p{P}+",
                RE_CJK_HANGUL,
                r"\p{N}",
            ],
            false,
            false,
            false,
        ),
        "deepseek-v3" => spec(
            &[r"\p{N}{1,3}", RE_CJK_KANA, RE_DEEPSEEK3_WORDS],
            false,
            false,
            false,
        ),
        "falcon" => spec(
            &[r"[\p{P}\$\+<=>\^~\|`]+", RE_GPT2_NO_TAIL, "[0-9][0-9][0-9]"],
            false,
            false,
            false,
        ),
        "gpt-2" | "gpt2" | "phi-2" | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling"
        | "exaone4" | "jina-es" | "jina-de" | "jina-v1-en" | "jina-v2-es" | "jina-v2-de"
        | "jina-v2-code" | "gigachat" | "a.x-4.0" | "mellum" | "modern-bert" | "roberta-bpe" => {
            spec(&[RE_GPT2], false, false, false)
        }
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            spec(&[r"\p{N}", RE_GPT2], false, false, false)
        }
        "qwen2" | "deepseek-r1-qwen" => spec(&[RE_QWEN2], false, true, false),
        "stablelm2" | "hunyuan" | "megrez" | "kormo" => spec(&[RE_QWEN2], false, false, false),
        "qwen35" => spec(&[RE_QWEN35], false, true, false),
        "poro-chat" | "bloom" | "gpt3-finnish" => spec(&[RE_PORO], false, false, false),
        "viking" => spec(&[RE_PORO, r"\p{N}"], false, false, false),
        "tekken" => spec(&[RE_TEKKEN], true, false, true),
        "gpt-4o" | "llama4" | "minimax-m2" => spec(&[RE_GPT4O], false, false, false),
        _ => None,
    }
}

/// Builds the `tokenizers` pipeline and the metadata for [`super::Tokenizer::assemble`].
pub(super) fn build(v: GgufVocab) -> Result<(tokenizers::Tokenizer, Meta)> {
    let n = v.tokens.len();
    if n == 0 {
        return Err(Error::Tokenizer("GGUF vocabulary is empty".into()));
    }
    if u32::try_from(n).is_err() {
        return Err(Error::Tokenizer(format!(
            "GGUF vocabulary has {n} tokens, more than u32 ids"
        )));
    }
    let types: Vec<i32> = match &v.token_types {
        Some(t) if t.len() < n => {
            return Err(Error::Tokenizer(format!(
                "GGUF token_type has {} entries for {n} tokens",
                t.len()
            )))
        }
        Some(t) => t[..n].to_vec(),
        None => vec![TYPE_NORMAL; n],
    };
    for (what, id) in [
        ("bos", v.bos_id),
        ("eos", v.eos_id),
        ("unknown", v.unk_id),
        ("eot", v.eot_id),
        ("eom", v.eom_id),
    ] {
        if let Some(i) = id {
            if i as usize >= n {
                return Err(Error::Tokenizer(format!(
                    "GGUF {what} token id {i} is outside the {n}-token vocabulary"
                )));
            }
        }
    }
    // Ids llama.cpp treats as control even when the file marks them otherwise.
    let mut forced_special: Vec<u32> = [v.bos_id, v.eos_id, v.eot_id, v.eom_id]
        .into_iter()
        .flatten()
        .collect();

    let (mut tok, texts, add_bos, add_eos) = match v.model.as_str() {
        "gpt2" => {
            let pre_name = v.pre.as_deref().unwrap_or("default");
            let spec = pre_spec(pre_name).ok_or_else(|| {
                Error::Tokenizer(format!(
                    "unknown GGUF pre-tokenizer type '{pre_name}' (tokenizer.ggml.pre)"
                ))
            })?;
            let texts = v.tokens.clone();
            let tok = build_byte_level_bpe(&texts, v.merges.as_deref(), &spec)?;
            (
                tok,
                texts,
                v.add_bos.unwrap_or(spec.add_bos),
                v.add_eos.unwrap_or(false),
            )
        }
        "llama" => {
            let scores = match &v.scores {
                Some(s) if s.len() >= n => &s[..n],
                Some(s) => {
                    return Err(Error::Tokenizer(format!(
                        "GGUF scores has {} entries for {n} tokens",
                        s.len()
                    )))
                }
                None => {
                    return Err(Error::Tokenizer(
                        "SentencePiece GGUF vocabulary without scores".into(),
                    ))
                }
            };
            // llama.cpp's converter pre-normalizes spaces in user-defined pieces; undo it.
            let texts: Vec<String> = v
                .tokens
                .iter()
                .zip(&types)
                .map(|(t, &ty)| {
                    if ty == TYPE_USER_DEFINED {
                        t.replace(' ', "\u{2581}")
                    } else {
                        t.clone()
                    }
                })
                .collect();
            let unk = v.unk_id.map(|i| texts[i as usize].clone());
            let add_space_prefix = v.add_space_prefix.unwrap_or(true);
            let tok = build_sentencepiece_bpe(&texts, scores, &types, unk, add_space_prefix)?;
            (
                tok,
                texts,
                v.add_bos.unwrap_or(true),
                v.add_eos.unwrap_or(false),
            )
        }
        other => {
            return Err(Error::Tokenizer(format!(
                "unsupported GGUF tokenizer model '{other}' (supported: gpt2, llama)"
            )))
        }
    };

    for (i, t) in texts.iter().enumerate() {
        if EOG_TOKEN_TEXTS.contains(&t.as_str()) {
            forced_special.push(i as u32);
        }
    }
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (i, (text, &ty)) in texts.iter().zip(&types).enumerate() {
        let forced = forced_special.contains(&(i as u32));
        if ty == TYPE_CONTROL || ty == TYPE_UNKNOWN || (forced && ty != TYPE_USER_DEFINED) {
            special.push(AddedToken::from(text.clone(), true).normalized(false));
        } else if ty == TYPE_USER_DEFINED {
            user.push(AddedToken::from(text.clone(), false).normalized(false));
        }
    }
    tok.add_special_tokens(&special);
    tok.add_tokens(&user);

    let meta = Meta {
        bos: v.bos_id,
        eos: v.eos_id,
        extra_eog: [v.eot_id, v.eom_id].into_iter().flatten().collect(),
        add_bos,
        add_eos,
        chat_template: v.chat_template,
    };
    Ok((tok, meta))
}

/// Token text -> id; a repeated text would make two ids indistinguishable, so it is an error
/// (llama.cpp asserts the same).
fn vocab_map(texts: &[String]) -> Result<Vocab> {
    let mut vocab = Vocab::with_capacity(texts.len());
    for (i, t) in texts.iter().enumerate() {
        if let Some(prev) = vocab.insert(t.clone(), i as u32) {
            return Err(Error::Tokenizer(format!(
                "GGUF vocabulary repeats token {t:?} (ids {prev} and {i})"
            )));
        }
    }
    Ok(vocab)
}

fn build_byte_level_bpe(
    texts: &[String],
    merges: Option<&[String]>,
    spec: &PreSpec,
) -> Result<tokenizers::Tokenizer> {
    let vocab = vocab_map(texts)?;
    let merges = merges.ok_or_else(|| {
        Error::Tokenizer("gpt2 GGUF tokenizer without tokenizer.ggml.merges".into())
    })?;
    let mut pairs = Vec::with_capacity(merges.len());
    for m in merges {
        // As llama.cpp: split at the first space after the first character.
        let first = m.chars().next().map_or(0, char::len_utf8);
        let Some(pos) = m
            .get(first..)
            .and_then(|rest| rest.find(' '))
            .map(|p| p + first)
        else {
            return Err(Error::Tokenizer(format!(
                "GGUF merge {m:?} is not 'left right'"
            )));
        };
        let (l, r) = (&m[..pos], &m[pos + 1..]);
        // A merge whose parts or result are not in the vocabulary can never apply; skip it.
        if vocab.contains_key(l) && vocab.contains_key(r) && vocab.contains_key(&format!("{l}{r}"))
        {
            pairs.push((l.to_string(), r.to_string()));
        }
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, pairs)
        .ignore_merges(spec.ignore_merges)
        .build()
        .map_err(|e| Error::Tokenizer(format!("building BPE: {e}")))?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    let mut pre: Vec<PreTokenizerWrapper> = Vec::new();
    for re in spec.regexes {
        let split = Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| Error::Tokenizer(format!("pre-tokenizer regex {re:?}: {e}")))?;
        pre.push(split.into());
    }
    pre.push(ByteLevel::new(false, false, false).into());
    tok.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(PreSequence::new(pre))));
    if spec.nfc {
        tok.with_normalizer(Some(NormalizerWrapper::NFC(NFC)));
    }
    tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::new(
        false, false, false,
    ))));
    Ok(tok)
}

fn build_sentencepiece_bpe(
    texts: &[String],
    scores: &[f32],
    types: &[i32],
    unk: Option<String>,
    add_space_prefix: bool,
) -> Result<tokenizers::Tokenizer> {
    let vocab = vocab_map(texts)?;
    let merges = sentencepiece_merges(texts, scores, types, &vocab);
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(u) = unk {
        builder = builder.unk_token(u);
    }
    let bpe = builder
        .build()
        .map_err(|e| Error::Tokenizer(format!("building BPE: {e}")))?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    let replace = |from: &str, to: &str| {
        Replace::new(from, to).map_err(|e| Error::Tokenizer(format!("replace normalizer: {e}")))
    };
    let space_to_meta = NormalizerWrapper::Replace(replace(" ", "\u{2581}")?);
    let normalizer = if add_space_prefix {
        // As the legacy Llama tokenizer.json (and llama.cpp): each text run between special
        // tokens gets a leading space.
        NormalizerWrapper::Sequence(NormalizerSequence::new(vec![
            NormalizerWrapper::Prepend(Prepend::new("\u{2581}".into())),
            space_to_meta,
        ]))
    } else {
        space_to_meta
    };
    tok.with_normalizer(Some(normalizer));
    let mut decoders = vec![
        DecoderWrapper::Replace(replace("\u{2581}", " ")?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if add_space_prefix {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    tok.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(
        decoders,
    ))));
    Ok(tok)
}

/// Merges of a SentencePiece BPE vocabulary, as `transformers`' `generate_merges`: every split of
/// a piece into two vocabulary pieces is a merge, ranked by the piece's score (highest first),
/// then by the lengths of the left and right parts (longest first), then by generation order.
/// Only normal and user-defined pieces are merge results: control, byte and unused pieces must
/// never come out of BPE. User-defined pieces score 0, as in the SentencePiece model (llama.cpp's
/// converter stores -1000 for them).
fn sentencepiece_merges(
    texts: &[String],
    scores: &[f32],
    types: &[i32],
    vocab: &Vocab,
) -> Vec<(String, String)> {
    struct Cand<'a> {
        score: f32,
        llen: usize,
        rlen: usize,
        l: &'a str,
        r: &'a str,
    }
    let mut all: Vec<Cand> = Vec::new();
    for (id, piece) in texts.iter().enumerate() {
        let score = match types[id] {
            TYPE_NORMAL => scores[id],
            TYPE_USER_DEFINED => 0.0,
            _ => continue,
        };
        let mut local: Vec<(u32, u32, Cand)> = Vec::new();
        for (k, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(k);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                let cand = Cand {
                    score,
                    llen: l.chars().count(),
                    rlen: r.chars().count(),
                    l,
                    r,
                };
                local.push((li, ri, cand));
            }
        }
        local.sort_by_key(|&(li, ri, _)| (li, ri));
        all.extend(local.into_iter().map(|(_, _, c)| c));
    }
    // Stable sort keeps generation order among equal keys, as Python's sorted(reverse=True).
    all.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(b.llen.cmp(&a.llen))
            .then(b.rlen.cmp(&a.rlen))
    });
    all.into_iter()
        .map(|c| (c.l.to_string(), c.r.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pre_tokenizer_regex_compiles() {
        let names = [
            "default",
            "llama-bpe",
            "dbrx",
            "deepseek-llm",
            "deepseek-coder",
            "deepseek-v3",
            "falcon",
            "gpt-2",
            "smollm",
            "qwen2",
            "stablelm2",
            "qwen35",
            "poro-chat",
            "viking",
            "tekken",
            "gpt-4o",
        ];
        for name in names {
            let spec = pre_spec(name).unwrap();
            for re in spec.regexes {
                Split::new(
                    SplitPattern::Regex(re.to_string()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .unwrap_or_else(|e| panic!("{name}: {re}: {e}"));
            }
        }
        assert!(pre_spec("no-such-pre").is_none());
    }

    #[test]
    fn sentencepiece_merges_rank_by_merged_score() {
        let texts: Vec<String> = ["<unk>", "a", "b", "c", "ab", "bc", "abc"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let scores = [0.0, -1.0, -2.0, -3.0, -5.0, -4.0, -6.0];
        let types = [TYPE_UNKNOWN, 1, 1, 1, 1, 1, 1];
        let vocab = vocab_map(&texts).unwrap();
        let m = sentencepiece_merges(&texts, &scores, &types, &vocab);
        let m: Vec<(&str, &str)> = m.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        // bc (-4) before ab (-5) before the two ways to make abc (-6): longer left part first.
        assert_eq!(m, vec![("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]);
    }
}
