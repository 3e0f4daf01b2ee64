//! The generation loop: prefill a prompt, then sample / decode token by token, streaming text.
//!
//! One loop serves the CLI and the server. It ends on an end-of-generation token (not shown),
//! a stop string (not shown; see [`crate::stop`]), `max_tokens`, a full context, or the caller
//! cancelling. Sampling is [`crate::sampler`]; the model is anything that turns tokens into
//! next-token logits ([`LogitsSource`], implemented by [`Session`]), so the loop's logic is
//! unit-tested here with a scripted fake model.
//!
//! Not here: batching several sequences (the server's scheduler), speculative decoding.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::constraint::Constraint;
use crate::model::Session;
use crate::sampler::{apply_mask, Sampler, SamplerConfig};
use crate::stop::StopMatcher;
use crate::tokenizer::DecodeStream;
use crate::{Error, Result};

/// What to generate and how to sample.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GenerateParams {
    /// Most tokens to generate (an end-of-generation token counts as one).
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Stop strings: generation ends at the first one; it is not emitted.
    pub stop: Vec<String>,
    /// Keep going through end-of-generation tokens (benchmarks); their text is decoded
    /// like any other token's.
    pub ignore_eos: bool,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 256,
            sampler: SamplerConfig::default(),
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// Why generation ended (serialized as OpenAI's `finish_reason` words where they exist).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached, or the context is full.
    Length,
    /// The text callback returned `false`.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Counts and timings of one generation.
#[derive(Clone, Debug, Serialize)]
pub struct GenerateStats {
    /// Tokens fed by the prefill (the `prompt` argument).
    pub prompt_tokens: usize,
    /// Tokens sampled (including a final end-of-generation token).
    pub completion_tokens: usize,
    pub prefill_secs: f64,
    /// Time from the end of the prefill to the end of the loop (sampling + decoding).
    pub decode_secs: f64,
    pub finish_reason: FinishReason,
    /// The sampler seed used (reproduces the run with the same settings).
    pub seed: u64,
    /// Every sampled id in order. The session holds all but the last of them (the last one
    /// was never fed back), which lets a caller reuse the cache for a continuation.
    #[serde(skip)]
    pub tokens: Vec<u32>,
}

impl GenerateStats {
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_secs)
    }
    pub fn decode_tokens_per_sec(&self) -> f64 {
        rate(self.completion_tokens, self.decode_secs)
    }
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// Something that turns tokens into next-token logits `(V)`, appending to a cache.
pub trait LogitsSource {
    /// Feeds `tokens` after what is cached; returns the logits of the last one.
    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>>;
    /// Feeds one token; returns its logits.
    fn decode(&mut self, token: u32) -> Result<Vec<f32>>;
    /// Feeds one token and draws the next with `sampler` (a source may do this without handing
    /// the logits over, e.g. on the GPU).
    fn decode_sampled(
        &mut self,
        token: u32,
        sampler: &mut Sampler,
        history: &[u32],
    ) -> Result<u32> {
        let mut logits = self.decode(token)?;
        Ok(sampler.sample(&mut logits, history))
    }
    /// [`LogitsSource::decode_sampled`] with only the tokens of `mask` allowed
    /// ([`crate::constraint`]'s bits).
    fn decode_masked(
        &mut self,
        token: u32,
        sampler: &mut Sampler,
        history: &[u32],
        mask: &[u32],
    ) -> Result<u32> {
        let mut logits = self.decode(token)?;
        apply_mask(&mut logits, mask);
        Ok(sampler.sample(&mut logits, history))
    }
    /// [`LogitsSource::decode_masked`] with the mask taken from `constraint`, which has
    /// committed `token` (a source may compute the mask while it computes the logits).
    fn decode_constrained(
        &mut self,
        token: u32,
        sampler: &mut Sampler,
        history: &[u32],
        constraint: &mut Constraint,
    ) -> Result<u32> {
        match constraint.mask()? {
            Some(m) => self.decode_masked(token, sampler, history, m),
            None => self.decode_sampled(token, sampler, history),
        }
    }
    /// Tokens in the cache.
    fn pos(&self) -> usize;
    /// Most tokens the cache can hold.
    fn max_context(&self) -> usize;
}

impl LogitsSource for Session<'_> {
    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        Session::prefill(self, tokens)
    }
    fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        Session::decode(self, token)
    }
    fn decode_sampled(
        &mut self,
        token: u32,
        sampler: &mut Sampler,
        history: &[u32],
    ) -> Result<u32> {
        Session::decode_sampled(self, token, sampler, history)
    }
    fn decode_masked(
        &mut self,
        token: u32,
        sampler: &mut Sampler,
        history: &[u32],
        mask: &[u32],
    ) -> Result<u32> {
        Session::decode_sampled_masked(self, token, sampler, history, mask)
    }
    fn decode_constrained(
        &mut self,
        token: u32,
        sampler: &mut Sampler,
        history: &[u32],
        constraint: &mut Constraint,
    ) -> Result<u32> {
        Session::decode_constrained(self, token, sampler, history, constraint)
    }
    fn pos(&self) -> usize {
        Session::pos(self)
    }
    fn max_context(&self) -> usize {
        Session::max_context(self)
    }
}

/// An incremental detokenizer: token ids in, completed text out.
pub trait TokenText {
    /// The text `id` completes (`None` while a character is still incomplete).
    fn push(&mut self, id: u32) -> Option<String>;
    /// Whatever is still pending, at the end of generation.
    fn flush(&mut self) -> Option<String>;
}

impl TokenText for DecodeStream<'_> {
    fn push(&mut self, id: u32) -> Option<String> {
        DecodeStream::push(self, id)
    }
    fn flush(&mut self) -> Option<String> {
        DecodeStream::flush(self)
    }
}

/// Generates from `session` (its model's tokenizer decodes the text, skipping special tokens,
/// and names the end-of-generation ids). `prompt` is appended to what the session already
/// holds. `on_text` receives each non-empty piece of text as it becomes final; returning
/// `false` cancels.
pub fn generate(
    session: &mut Session<'_>,
    prompt: &[u32],
    params: &GenerateParams,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<GenerateStats> {
    generate_constrained(session, prompt, params, None, on_text)
}

/// [`generate`] with the output constrained by `constraint` ([`crate::constraint`]): each
/// step's mask is applied before sampling (on a GPU, before the on-device pick).
pub fn generate_constrained(
    session: &mut Session<'_>,
    prompt: &[u32],
    params: &GenerateParams,
    constraint: Option<&mut Constraint>,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<GenerateStats> {
    let tok = session.model().tokenizer();
    let mut stream = tok.decoder();
    generate_with_constraint(
        session,
        prompt,
        params,
        tok.eog_ids(),
        &mut stream,
        constraint,
        on_text,
    )
}

/// The loop itself, over any [`LogitsSource`] and [`TokenText`]; `eog` lists the
/// end-of-generation ids.
pub fn generate_with(
    src: &mut dyn LogitsSource,
    prompt: &[u32],
    params: &GenerateParams,
    eog: &[u32],
    text: &mut dyn TokenText,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<GenerateStats> {
    generate_with_constraint(src, prompt, params, eog, text, None, on_text)
}

/// [`generate_with`] under an optional constraint.
pub fn generate_with_constraint(
    src: &mut dyn LogitsSource,
    prompt: &[u32],
    params: &GenerateParams,
    eog: &[u32],
    text: &mut dyn TokenText,
    mut constraint: Option<&mut Constraint>,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<GenerateStats> {
    params.sampler.validate()?;
    if prompt.is_empty() {
        // At least one token must be fed: the loop needs its logits.
        return Err(Error::Msg("empty prompt: nothing to generate from".into()));
    }
    let (used, max_ctx) = (src.pos(), src.max_context());
    if used.checked_add(prompt.len()).is_none_or(|n| n > max_ctx) {
        return Err(Error::Msg(format!(
            "prompt of {} tokens does not fit the context of {max_ctx} tokens ({used} already in use)",
            prompt.len()
        )));
    }

    let t0 = Instant::now();
    let mut logits = src.prefill(prompt)?;
    let prefill_secs = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut sampler = Sampler::new(params.sampler.clone(), logits.len());
    let mut stop = StopMatcher::new(&params.stop);
    // Penalties look at prompt + generated tokens, as llama.cpp feeds its sampler both.
    let keep = params.sampler.penalty_last_n;
    let mut history: Vec<u32> = prompt[prompt.len().saturating_sub(keep)..].to_vec();
    let mut tokens = Vec::new();
    let mut finish = FinishReason::Length;
    // After the first token the source draws (on a GPU without the logits crossing to the host).
    let mut picked: Option<u32> = None;

    while tokens.len() < params.max_tokens {
        let id = match picked.take() {
            Some(id) => id,
            None => {
                if let Some(c) = constraint.as_deref_mut() {
                    if let Some(m) = c.mask()? {
                        apply_mask(&mut logits, m);
                    }
                }
                sampler.sample(&mut logits, &history)
            }
        };
        if let Some(c) = constraint.as_deref_mut() {
            c.commit(id)?;
        }
        tokens.push(id);
        if keep > 0 {
            // Bounded history: drop the older half when it grows past 2 * keep.
            if history.len() >= 2 * keep {
                history.drain(..history.len() - keep);
            }
            history.push(id);
        }
        if !params.ignore_eos && eog.contains(&id) {
            finish = FinishReason::Stop;
            break;
        }
        if let Some(piece) = text.push(id) {
            let out = stop.push(&piece);
            if !out.text.is_empty() && !on_text(&out.text) {
                finish = FinishReason::Cancelled;
                break;
            }
            if out.matched.is_some() {
                finish = FinishReason::Stop;
                break;
            }
        }
        if tokens.len() >= params.max_tokens || src.pos() >= src.max_context() {
            finish = FinishReason::Length;
            break;
        }
        picked = Some(match constraint.as_deref_mut() {
            Some(c) => src.decode_constrained(id, &mut sampler, &history, c)?,
            None => src.decode_sampled(id, &mut sampler, &history)?,
        });
    }
    if finish != FinishReason::Cancelled && stop.matched().is_none() {
        // Text still pending in the detokenizer, then in the stop matcher. A stop string may
        // still complete in the former; what the matcher holds back is final now.
        let mut rest = String::new();
        if let Some(tail) = text.flush() {
            let out = stop.push(&tail);
            rest.push_str(&out.text);
            if out.matched.is_some() {
                finish = FinishReason::Stop;
            }
        }
        rest.push_str(&stop.finish());
        if !rest.is_empty() {
            on_text(&rest);
        }
    }
    Ok(GenerateStats {
        prompt_tokens: prompt.len(),
        completion_tokens: tokens.len(),
        prefill_secs,
        decode_secs: t1.elapsed().as_secs_f64(),
        finish_reason: finish,
        seed: sampler.seed(),
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake model over a vocabulary of `V` tokens: with `n` tokens cached it predicts
    /// `script[(n - 1) % len]` (one-hot logits).
    struct Scripted {
        script: Vec<u32>,
        pos: usize,
        max_ctx: usize,
        fed: Vec<u32>,
        fail_at: Option<usize>,
    }

    const V: usize = 8;
    /// id -> text: 0..=5 are "a".."f", 6 is EOS (no text), 7 is half of a two-token "é".
    const EOS: u32 = 6;

    impl Scripted {
        fn new(script: &[u32], max_ctx: usize) -> Self {
            Scripted {
                script: script.to_vec(),
                pos: 0,
                max_ctx,
                fed: vec![],
                fail_at: None,
            }
        }
        fn logits(&self) -> Vec<f32> {
            let mut l = vec![0.0; V];
            let next = self.script[(self.pos - 1) % self.script.len()];
            l[next as usize] = 10.0;
            l
        }
    }

    impl LogitsSource for Scripted {
        fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
            self.pos += tokens.len();
            self.fed.extend_from_slice(tokens);
            Ok(self.logits())
        }
        fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
            if self.fail_at == Some(self.pos) {
                return Err(Error::Msg("boom".into()));
            }
            self.prefill(&[token])
        }
        fn pos(&self) -> usize {
            self.pos
        }
        fn max_context(&self) -> usize {
            self.max_ctx
        }
    }

    /// Incremental detokenizer for the fake vocabulary: token 7 twice makes "é"; a lone 7
    /// flushes as U+FFFD.
    #[derive(Default)]
    struct Pieces {
        half: bool,
    }

    impl TokenText for Pieces {
        fn push(&mut self, id: u32) -> Option<String> {
            match id {
                0..=5 => Some(((b'a' + id as u8) as char).to_string()),
                7 if self.half => {
                    self.half = false;
                    Some("é".to_string())
                }
                7 => {
                    self.half = true;
                    None
                }
                _ => None,
            }
        }
        fn flush(&mut self) -> Option<String> {
            std::mem::take(&mut self.half).then(|| "\u{FFFD}".to_string())
        }
    }

    fn pieces() -> Pieces {
        Pieces::default()
    }

    fn params(max_tokens: usize, stop: &[&str]) -> GenerateParams {
        GenerateParams {
            max_tokens,
            sampler: SamplerConfig::greedy(),
            stop: stop.iter().map(|s| s.to_string()).collect(),
            ignore_eos: false,
        }
    }

    /// Runs the loop; the script is indexed by cache position (prompt of length 2).
    fn run(src: &mut Scripted, p: &GenerateParams) -> (String, GenerateStats) {
        let mut out = String::new();
        let mut piece = pieces();
        let stats = generate_with(src, &[0, 1], p, &[EOS], &mut piece, &mut |t| {
            out.push_str(t);
            true
        })
        .unwrap();
        (out, stats)
    }

    #[test]
    fn stops_at_end_of_generation_without_emitting_it() {
        // Position 1 (last prompt token) predicts 2, then 3, then EOS.
        let mut src = Scripted::new(&[0, 2, 3, EOS, 4], 100);
        let (text, st) = run(&mut src, &params(50, &[]));
        assert_eq!(text, "cd");
        assert_eq!(st.finish_reason, FinishReason::Stop);
        assert_eq!((st.prompt_tokens, st.completion_tokens), (2, 3));
        assert_eq!(st.tokens, vec![2, 3, EOS]);
        // EOS was never fed back: the cache holds the prompt and the two text tokens.
        assert_eq!(src.fed, vec![0, 1, 2, 3]);
    }

    #[test]
    fn ignore_eos_runs_to_max_tokens() {
        let mut src = Scripted::new(&[0, 2, EOS, 3], 100);
        let mut p = params(5, &[]);
        p.ignore_eos = true;
        let (text, st) = run(&mut src, &p);
        assert_eq!(st.finish_reason, FinishReason::Length);
        assert_eq!(st.completion_tokens, 5);
        // Cycle from pos 1: 2, EOS, 3, 0, 2.
        assert_eq!(text, "cdac");
    }

    #[test]
    fn max_tokens_gives_length() {
        let mut src = Scripted::new(&[1], 100);
        let (text, st) = run(&mut src, &params(4, &[]));
        assert_eq!(text, "bbbb");
        assert_eq!(st.finish_reason, FinishReason::Length);
        // The last sampled token is not decoded (nothing would use its logits).
        assert_eq!(src.fed.len(), 2 + 3);
    }

    #[test]
    fn zero_max_tokens() {
        let mut src = Scripted::new(&[1], 100);
        let (text, st) = run(&mut src, &params(0, &[]));
        assert_eq!((text.as_str(), st.completion_tokens), ("", 0));
        assert_eq!(st.finish_reason, FinishReason::Length);
    }

    #[test]
    fn full_context_gives_length() {
        let mut src = Scripted::new(&[1], 5);
        let (text, st) = run(&mut src, &params(100, &[]));
        // Prompt 2 + 3 decoded = 5 = full; the token sampled from the last logits is still
        // emitted: 4 tokens.
        assert_eq!(text, "bbbb");
        assert_eq!(st.finish_reason, FinishReason::Length);
        assert_eq!(src.pos, 5);
    }

    #[test]
    fn prompt_longer_than_context_is_an_error() {
        let mut src = Scripted::new(&[1], 1);
        let mut piece = pieces();
        let e = generate_with(
            &mut src,
            &[0, 1],
            &params(3, &[]),
            &[EOS],
            &mut piece,
            &mut |_| true,
        )
        .unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
        let e = generate_with(
            &mut src,
            &[],
            &params(3, &[]),
            &[EOS],
            &mut piece,
            &mut |_| true,
        )
        .unwrap_err();
        assert!(e.to_string().contains("empty prompt"), "{e}");
    }

    #[test]
    fn stop_string_across_tokens_is_not_emitted() {
        // Generates a b c d e ... ; stop "cd".
        let mut src = Scripted::new(&[0, 0, 1, 2, 3, 4, 5], 100);
        let (text, st) = run(&mut src, &params(50, &["cd"]));
        // From pos 1: 0 1 2 3 -> "abcd" -> stop before "cd".
        assert_eq!(text, "ab");
        assert_eq!(st.finish_reason, FinishReason::Stop);
        assert_eq!(st.completion_tokens, 4);
    }

    #[test]
    fn held_back_text_is_flushed_at_the_end() {
        let mut src = Scripted::new(&[2], 100);
        // "cc..." with stop "cd": each 'c' is held until the next token shows it is not "cd".
        let (text, st) = run(&mut src, &params(3, &["cd"]));
        assert_eq!(text, "ccc");
        assert_eq!(st.finish_reason, FinishReason::Length);
    }

    #[test]
    fn multi_token_character() {
        let mut src = Scripted::new(&[0, 7, 7, 0, EOS], 100);
        let (text, _) = run(&mut src, &params(50, &[]));
        assert_eq!(text, "éa");
    }

    #[test]
    fn incomplete_character_is_flushed_at_the_end() {
        let mut src = Scripted::new(&[0, 7, EOS], 100);
        let (text, st) = run(&mut src, &params(50, &[]));
        assert_eq!(text, "\u{FFFD}");
        assert_eq!(st.finish_reason, FinishReason::Stop);
    }

    #[test]
    fn cancel_stops_at_once() {
        let mut src = Scripted::new(&[1], 100);
        let mut piece = pieces();
        let mut n = 0;
        let st = generate_with(
            &mut src,
            &[0],
            &params(100, &[]),
            &[EOS],
            &mut piece,
            &mut |_| {
                n += 1;
                n < 3
            },
        )
        .unwrap();
        assert_eq!(st.finish_reason, FinishReason::Cancelled);
        assert_eq!(st.completion_tokens, 3);
    }

    #[test]
    fn decode_error_propagates() {
        let mut src = Scripted::new(&[1], 100);
        src.fail_at = Some(3);
        let mut piece = pieces();
        let r = generate_with(
            &mut src,
            &[0, 1],
            &params(10, &[]),
            &[EOS],
            &mut piece,
            &mut |_| true,
        );
        assert!(r.is_err());
    }

    #[test]
    fn penalties_see_the_prompt() {
        // Logits favour token 0 (prompt token) slightly over 1; a strong presence penalty on
        // the prompt makes greedy pick 1.
        struct Flat;
        impl LogitsSource for Flat {
            fn prefill(&mut self, _: &[u32]) -> Result<Vec<f32>> {
                Ok(vec![1.0, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
            }
            fn decode(&mut self, _: u32) -> Result<Vec<f32>> {
                self.prefill(&[])
            }
            fn pos(&self) -> usize {
                0
            }
            fn max_context(&self) -> usize {
                100
            }
        }
        let mut p = params(1, &[]);
        p.sampler.presence_penalty = 0.5;
        let mut piece = pieces();
        let st = generate_with(&mut Flat, &[0], &p, &[EOS], &mut piece, &mut |_| true).unwrap();
        assert_eq!(st.tokens, vec![1]);
    }

    #[test]
    fn same_seed_same_tokens() {
        struct Wide;
        impl LogitsSource for Wide {
            fn prefill(&mut self, _: &[u32]) -> Result<Vec<f32>> {
                Ok(vec![0.3, 0.1, 0.5, 0.2, 0.4, 0.0, -9.0, 0.0])
            }
            fn decode(&mut self, _: u32) -> Result<Vec<f32>> {
                self.prefill(&[])
            }
            fn pos(&self) -> usize {
                0
            }
            fn max_context(&self) -> usize {
                1000
            }
        }
        let gen = |seed| {
            let mut p = params(40, &[]);
            p.sampler = SamplerConfig {
                seed: Some(seed),
                temperature: 1.0,
                ..Default::default()
            };
            let mut piece = pieces();
            generate_with(&mut Wide, &[0], &p, &[EOS], &mut piece, &mut |_| true).unwrap()
        };
        let (a, b) = (gen(1), gen(1));
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.seed, 1);
        assert_ne!(a.tokens, gen(2).tokens);
    }

    #[test]
    fn finish_reason_serializes_like_openai() {
        assert_eq!(
            serde_json::to_string(&FinishReason::Length).unwrap(),
            "\"length\""
        );
        assert_eq!(FinishReason::Stop.as_str(), "stop");
    }
}
