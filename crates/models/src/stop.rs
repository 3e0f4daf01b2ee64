//! Stop strings over streamed text.
//!
//! Generated text arrives in pieces (one token's worth at a time). A stop string may straddle
//! pieces, so [`StopMatcher`] holds back the longest tail that could still be the start of a
//! stop string and emits only text that can no longer become part of one. When a stop string
//! appears, the text before it is emitted and the stop string and anything after it are
//! dropped: the stop string is not part of the output (OpenAI's `stop` semantics).
//!
//! Matching is on exact bytes of UTF-8 text; held-back and emitted text always splits at
//! character boundaries. Not here: token-id stops (end-of-generation ids are handled by the
//! generation loop before any text exists).

/// What one [`StopMatcher::push`] produced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text that is safe to show now (may be empty).
    pub text: String,
    /// Index into the stop list of the stop string that matched; generation should end.
    pub matched: Option<usize>,
}

#[derive(Clone, Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet emitted (at most the longest stop string's length - 1 bytes
    /// between pushes).
    pending: String,
    matched: Option<usize>,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new<S: AsRef<str>>(stops: &[S]) -> StopMatcher {
        let stops = stops
            .iter()
            .map(|s| s.as_ref().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        StopMatcher {
            stops,
            pending: String::new(),
            matched: None,
        }
    }

    /// True when there are no stop strings (everything passes straight through).
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// The stop strings in use (empty ones removed).
    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// The index of the stop string that matched, once one has.
    pub fn matched(&self) -> Option<usize> {
        self.matched
    }

    /// Feeds the next piece of text. After a match, further pushes produce nothing.
    pub fn push(&mut self, text: &str) -> StopOutput {
        if self.matched.is_some() {
            return StopOutput {
                text: String::new(),
                matched: self.matched,
            };
        }
        if self.stops.is_empty() {
            return StopOutput {
                text: text.to_string(),
                matched: None,
            };
        }
        self.pending.push_str(text);
        if let Some((at, which)) = self.find_stop() {
            self.matched = Some(which);
            let mut out = std::mem::take(&mut self.pending);
            out.truncate(at);
            return StopOutput {
                text: out,
                matched: Some(which),
            };
        }
        let hold = self.held_tail_len();
        let split = self.pending.len() - hold;
        let tail = self.pending.split_off(split);
        let out = std::mem::replace(&mut self.pending, tail);
        StopOutput {
            text: out,
            matched: None,
        }
    }

    /// Ends the stream: returns whatever was held back (empty after a match).
    pub fn finish(&mut self) -> String {
        if self.matched.is_some() {
            self.pending.clear();
        }
        std::mem::take(&mut self.pending)
    }

    /// Earliest stop occurrence in `pending`: (byte offset, stop index). On equal offsets the
    /// stop listed first wins.
    fn find_stop(&self) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize)> = None;
        for (i, s) in self.stops.iter().enumerate() {
            if let Some(at) = self.pending.find(s.as_str()) {
                if best.is_none_or(|(b, _)| at < b) {
                    best = Some((at, i));
                }
            }
        }
        best
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of some stop string
    /// and starts on a character boundary.
    fn held_tail_len(&self) -> usize {
        let p = self.pending.as_bytes();
        let max_stop = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let longest = p.len().min(max_stop.saturating_sub(1));
        for len in (1..=longest).rev() {
            let start = p.len() - len;
            if !self.pending.is_char_boundary(start) {
                continue;
            }
            let tail = &p[start..];
            if self
                .stops
                .iter()
                .any(|s| s.len() > len && s.as_bytes().starts_with(tail))
            {
                return len;
            }
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pushes every piece and returns (emitted text, matched index, flushed tail).
    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        let mut m = StopMatcher::new(stops);
        let mut out = String::new();
        for p in pieces {
            let o = m.push(p);
            out.push_str(&o.text);
            if o.matched.is_some() {
                return (out, o.matched);
            }
        }
        out.push_str(&m.finish());
        (out, None)
    }

    #[test]
    fn no_stops_pass_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), None));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".into(), None));
    }

    #[test]
    fn stop_within_one_piece_truncates() {
        assert_eq!(
            run(&["\n\n"], &["Hello\n\nWorld"]),
            ("Hello".into(), Some(0))
        );
    }

    #[test]
    fn stop_split_across_pieces() {
        assert_eq!(
            run(&["</end>"], &["abc</", "en", "d>tail"]),
            ("abc".into(), Some(0))
        );
        // One byte per push.
        let text = "xx STOP yy";
        let pieces: Vec<String> = text.chars().map(|c| c.to_string()).collect();
        let pieces: Vec<&str> = pieces.iter().map(|s| s.as_str()).collect();
        assert_eq!(run(&["STOP"], &pieces), ("xx ".into(), Some(0)));
    }

    #[test]
    fn held_text_is_released_when_it_cannot_match() {
        let mut m = StopMatcher::new(&["abc"]);
        assert_eq!(m.push("xa").text, "x");
        assert_eq!(m.push("b").text, "");
        // "abd" cannot become "abc": release all of it.
        assert_eq!(m.push("d").text, "abd");
        assert_eq!(m.push("ab").text, "");
        assert_eq!(m.finish(), "ab");
    }

    #[test]
    fn overlapping_prefixes() {
        // "aab" contains "ab" starting at 1: the first 'a' is safe once "aa" is seen.
        assert_eq!(run(&["ab"], &["a", "a", "b"]), ("a".into(), Some(0)));
        // A tail that is a prefix of the stop only from its second byte.
        assert_eq!(
            run(&["aab"], &["a", "a", "a", "b", "c"]),
            ("a".into(), Some(0))
        );
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(
            run(&["world", "lo"], &["hello world"]),
            ("hel".into(), Some(1))
        );
        assert_eq!(
            run(&["lo w", "lo"], &["hello world"]),
            ("hel".into(), Some(0))
        );
    }

    #[test]
    fn multibyte_characters() {
        // The stop is a multi-byte string split inside a character's worth of pieces.
        assert_eq!(
            run(&["世界"], &["你好", "世", "界!"]),
            ("你好".into(), Some(0))
        );
        // A stop sharing the first bytes of a character must not split that character.
        let mut m = StopMatcher::new(&["é!"]);
        let o = m.push("café");
        assert_eq!(o.text, "caf");
        let o = m.push("?");
        assert_eq!(o.text, "é?");
        // Emoji then stop.
        assert_eq!(
            run(&["<|im_end|>"], &["ok 👍", "<|im_", "end|>"]),
            ("ok 👍".into(), Some(0))
        );
    }

    #[test]
    fn after_match_nothing_more() {
        let mut m = StopMatcher::new(&["x"]);
        assert_eq!(m.push("axb").matched, Some(0));
        assert_eq!(
            m.push("more"),
            StopOutput {
                text: String::new(),
                matched: Some(0)
            }
        );
        assert_eq!(m.finish(), "");
        assert_eq!(m.matched(), Some(0));
    }

    #[test]
    fn emitted_text_never_exceeds_input_and_concatenates() {
        // Property over all 2-way splits of a text: output = text up to the stop.
        let text = "The answer: 42.\nUser: next";
        for cut in 0..=text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let (a, b) = text.split_at(cut);
            let (out, m) = run(&["\nUser:"], &[a, b]);
            assert_eq!(out, "The answer: 42.");
            assert_eq!(m, Some(0));
        }
    }
}
