//! Incremental detokenization for streaming generation.
//!
//! A token is not always a whole character: byte-level BPE and SentencePiece byte fallback
//! (`<0xF0><0x9F><0x98><0x80>`) spread one emoji over several tokens, and SentencePiece decoders
//! strip the space of the first piece. Decoding token by token therefore cannot work; this
//! follows the prefix/read-offset scheme of `tokenizers`' `DecodeStream` (and `text-generation-
//! inference`): decode a small window twice (with and without the newest tokens) and emit the
//! difference once it no longer ends in an incomplete character (U+FFFD).

use super::Tokenizer;

/// Incremental decoder returned by [`Tokenizer::decoder`]: push ids, get newly completed text.
pub struct DecodeStream<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    /// The decode window: `ids[..read]` were emitted by the previous step (kept as context),
    /// `ids[read..]` are pending.
    ids: Vec<u32>,
    read: usize,
}

/// Once the window holds this many ids without completing a character, emit anyway: no encoding
/// needs more than 4 bytes per character, so such a window can never become valid text.
const MAX_PENDING: usize = 8;

impl<'a> DecodeStream<'a> {
    pub(super) fn new(tok: &'a Tokenizer, skip_special: bool) -> Self {
        DecodeStream {
            tok,
            skip_special,
            ids: Vec::new(),
            read: 0,
        }
    }

    /// Adds one generated id; returns the text it completes, if any. Ids outside the vocabulary
    /// produce no text.
    pub fn push(&mut self, id: u32) -> Option<String> {
        self.tok.token_to_str(id)?;
        self.ids.push(id);
        self.step(false)
    }

    /// Emits whatever is pending (an incomplete character comes out as U+FFFD). Call at the end
    /// of generation.
    pub fn flush(&mut self) -> Option<String> {
        self.step(true)
    }

    fn step(&mut self, force: bool) -> Option<String> {
        if self.read >= self.ids.len() {
            return None;
        }
        let prefix_text = self
            .tok
            .decode_unchecked(&self.ids[..self.read], self.skip_special)
            .ok()?;
        let new_text = self
            .tok
            .decode_unchecked(&self.ids, self.skip_special)
            .ok()?;
        let pending = self.ids.len() - self.read;
        let incomplete = new_text.ends_with('\u{FFFD}') && pending < MAX_PENDING;
        if new_text.len() <= prefix_text.len() || (incomplete && !force) {
            if force {
                self.advance();
            }
            return None;
        }
        let out = match new_text.strip_prefix(prefix_text.as_str()) {
            Some(rest) => rest.to_string(),
            // The decoder rewrote earlier text (rare: e.g. a cleanup rule spanning tokens): emit
            // the part past the old length, on a character boundary.
            None => {
                let mut cut = prefix_text.len();
                while !new_text.is_char_boundary(cut) {
                    cut += 1;
                }
                new_text[cut..].to_string()
            }
        };
        self.advance();
        Some(out)
    }

    /// Everything pushed so far has been emitted. The ids of this emission stay as left context
    /// for the next window (SentencePiece's leading-space strip and byte-fallback groups need a
    /// left neighbour that decodes cleanly on its own); older ids are dropped.
    fn advance(&mut self) {
        self.ids.drain(..self.read);
        self.read = self.ids.len();
    }
}
