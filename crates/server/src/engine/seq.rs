//! One admitted sequence of the engine ([`Seq`]): its tokens and position, its sampler, stop
//! matcher and text decoder, and what it sends its client (tokens, text, log-probabilities, the
//! final usage). The scheduler ([`super::scheduler`]) decides when it runs; this module what a
//! step's pick does to it.
//!
//! What it is not: admission, batching, the KV cache's blocks (the scheduler's,
//! [`super::paged_blocks`], [`super::preempt`]).

use std::sync::atomic::Ordering;
use std::time::Instant;

use hf2q_models::generate::FinishReason;
use hf2q_models::kv_cache::KvCache;
use hf2q_models::sampler::{apply_mask, Sampler};
use hf2q_models::stop::StopMatcher;
use hf2q_models::tokenizer::DecodeStream;
use hf2q_models::{Model, Picked, RowPick};
use hf2q_tensor::paged::BlockTable;

use super::{Event, Pending, Shared, TokenLogprob};

/// One admitted sequence (running, or preempted and waiting to be readmitted).
pub(super) struct Seq<'m> {
    pub(super) p: Pending,
    /// Admission order (0 for the first request the engine admitted); kept across a preemption,
    /// so the largest is the youngest (latest arrival), the one preempted first.
    pub(super) order: u64,
    pub(super) cache: KvCache,
    /// The sequence's blocks in the engine's paged KV cache (`--kv-paged`; empty otherwise,
    /// when `cache` holds its keys and values). Covers at least `0..pos`.
    pub(super) table: BlockTable,
    /// Tokens in the cache.
    pub(super) pos: usize,
    /// `tokens[..pos]` are in the cache, `tokens[pos..]` are still to be prefilled: at first the
    /// prompt; every sampled token joins once it has been fed; after a preemption (`pos` back to
    /// 0) the prompt and every generated token, all recomputed.
    pub(super) tokens: Vec<u32>,
    /// Prompt tokens whose keys and values were copied from the prefix cache (or, with the paged
    /// KV cache, whose blocks it shares).
    pub(super) cached: usize,
    /// With the paged KV cache and prefix caching: how many of `table`'s leading blocks are in
    /// the prefix cache (shared at admission or registered since).
    pub(super) shared_blocks: usize,
    /// False once a forward step failed for this sequence: its cache may hold partial rows, so
    /// it is not offered to the prefix cache.
    pub(super) poolable: bool,
    /// The sampled token to feed next (decode phase); `None` while prefilling.
    pub(super) next: Option<u32>,
    pub(super) sampler: Sampler,
    pub(super) stop: StopMatcher,
    pub(super) tok: &'m hf2q_models::tokenizer::Tokenizer,
    pub(super) text: DecodeStream<'m>,
    /// Recent prompt + generated ids, for the penalties.
    pub(super) history: Vec<u32>,
    pub(super) generated: usize,
    /// Ids and log-probabilities sampled since the last emitted text.
    pub(super) ids: Vec<u32>,
    pub(super) lps: Vec<TokenLogprob>,
    pub(super) last_token_at: Option<Instant>,
    /// Set when the sequence must leave the batch.
    pub(super) done: Option<FinishReason>,
}

/// Most positions a request's cache may hold (what its reserved blocks cover).
pub(super) fn cache_limit(p: &Pending, ctx: usize) -> usize {
    (p.req.prompt.len() + p.req.max_tokens).min(ctx).max(1)
}

impl<'m> Seq<'m> {
    /// The `order`-th admitted sequence, starting from `cache`, which already holds the first
    /// `cached` prompt tokens.
    pub(super) fn new(
        p: Pending,
        order: u64,
        model: &'m Model,
        cache: KvCache,
        cached: usize,
    ) -> Seq<'m> {
        let keep = p.req.sampler.penalty_last_n;
        let history = p.req.prompt[p.req.prompt.len().saturating_sub(keep)..].to_vec();
        Seq {
            order,
            cache,
            table: BlockTable::new(),
            pos: cached,
            tokens: p.req.prompt.clone(),
            cached,
            shared_blocks: 0,
            poolable: true,
            next: None,
            sampler: Sampler::new(p.req.sampler.clone(), model.vocab_size()),
            stop: StopMatcher::new(&p.req.stop),
            tok: model.tokenizer(),
            text: model.tokenizer().decoder(),
            history,
            generated: 0,
            ids: Vec::new(),
            lps: Vec::new(),
            last_token_at: None,
            done: None,
            p,
        }
    }

    /// The served adapter's slot and unique id (`None`: the base).
    pub(super) fn slot(&self) -> Option<usize> {
        self.p.req.adapter.as_ref().map(|a| a.slot)
    }
    pub(super) fn uid(&self) -> Option<u64> {
        self.p.req.adapter.as_ref().map(|a| a.uid)
    }

    pub(super) fn cancelled(&self) -> bool {
        self.p.cancel.load(Ordering::Relaxed) || self.p.out.is_closed()
    }

    /// Marks the sequence done when its client went away or its deadline passed (then it ends
    /// with `length`, the text so far being its answer).
    pub(super) fn check_alive(&mut self, now: Instant, sh: &Shared) {
        if self.cancelled() {
            self.done = Some(FinishReason::Cancelled);
        } else if self.p.req.deadline.is_some_and(|d| now >= d) {
            sh.metrics.count_finished("timeout");
            self.done = Some(FinishReason::Length);
        }
    }

    pub(super) fn send(&mut self, ev: Event) {
        if self.p.out.send(ev).is_err() {
            self.done.get_or_insert(FinishReason::Cancelled);
        }
    }

    /// Samples the next token from `logits` `(V)` and streams its text; sets `done` when the
    /// sequence ends.
    fn sample(&mut self, mut logits: Vec<f32>, eog: &[u32], sh: &Shared, now: Instant) {
        let raw = self.p.req.logprobs.map(|k| (logits.clone(), k));
        if let Some(c) = self.p.req.constraint.as_mut() {
            match c.mask() {
                Ok(Some(m)) => apply_mask(&mut logits, m),
                Ok(None) => {}
                Err(e) => return self.fail(sh, format!("constrained decoding failed: {e}")),
            }
        }
        let id = self.sampler.sample(&mut logits, &self.history);
        if let Some(c) = self.p.req.constraint.as_mut() {
            if let Err(e) = c.commit(id) {
                return self.fail(sh, format!("constrained decoding failed: {e}"));
            }
        }
        self.accept(id, raw, eog, sh, now);
    }

    /// How a paged step should choose this sequence's token when it feeds `n` tokens: not at
    /// all mid-prompt; on the device (greedy, or a draw the device sampler can make, whose
    /// uniform number this draws) when nothing needs the logits on the host; else the logits.
    pub(super) fn row_pick(&mut self, n: usize) -> RowPick {
        if self.next.is_none() && self.pos + n < self.tokens.len() {
            return RowPick::Skip;
        }
        if self.p.req.constraint.is_some() || self.p.req.logprobs.is_some() {
            return RowPick::Logits;
        }
        let c = self.sampler.config();
        if !(c.temperature > 0.0) {
            return if c.logit_bias.is_empty() && !c.penalties_active() {
                RowPick::Greedy
            } else {
                RowPick::Logits
            };
        }
        self.sampler
            .device_args()
            .map_or(RowPick::Logits, RowPick::Sample)
    }

    /// Takes the step's result for this sequence: a token picked on the device, or logits to
    /// sample from here.
    pub(super) fn take_pick(&mut self, picked: Picked, eog: &[u32], sh: &Shared, now: Instant) {
        match picked {
            Picked::Nothing => {}
            Picked::Logits(l) => self.sample(l, eog, sh, now),
            Picked::Token(id) => {
                self.sampler.device_drew();
                self.accept(id, None, eog, sh, now)
            }
        }
    }

    /// Records the chosen token `id` (with the raw logits and the count of log-probabilities
    /// asked for, if any), streams its text and sets `done` when the sequence ends.
    fn accept(
        &mut self,
        id: u32,
        raw: Option<(Vec<f32>, usize)>,
        eog: &[u32],
        sh: &Shared,
        now: Instant,
    ) {
        self.generated += 1;
        let m = &sh.metrics;
        m.completion_tokens.fetch_add(1, Ordering::Relaxed);
        match self.last_token_at {
            None => m
                .ttft
                .observe(now.duration_since(self.p.arrived).as_secs_f64()),
            Some(t) => m.itl.observe(now.duration_since(t).as_secs_f64()),
        }
        self.last_token_at = Some(now);
        let keep = self.p.req.sampler.penalty_last_n;
        if keep > 0 {
            if self.history.len() >= 2 * keep {
                self.history.drain(..self.history.len() - keep);
            }
            self.history.push(id);
        }
        if !self.p.req.ignore_eos && eog.contains(&id) {
            self.done = Some(FinishReason::Stop);
            return;
        }
        self.ids.push(id);
        if let Some((raw, k)) = raw {
            self.lps.push(logprobs(&raw, id, k));
        }
        let kept = if self.p.req.keep_tokens.contains(&id) {
            // Markup the output's parser needs: flush what is pending, then its own text.
            let mut t = self.text.flush().unwrap_or_default();
            t.push_str(self.tok.token_to_str(id).unwrap_or_default());
            self.text = self.tok.decoder();
            Some(t)
        } else {
            self.text.push(id)
        };
        if let Some(piece) = kept {
            let out = self.stop.push(&piece);
            if out.matched.is_some() {
                // The tokens that completed the stop string are not part of the output.
                self.ids.clear();
                self.lps.clear();
            }
            if !out.text.is_empty() {
                self.emit(out.text);
            }
            if out.matched.is_some() {
                self.done = Some(FinishReason::Stop);
                return;
            }
        }
        if self.generated >= self.p.req.max_tokens || self.pos >= self.cache.limit {
            self.done = Some(FinishReason::Length);
            return;
        }
        self.next = Some(id);
    }

    /// Ends the sequence with a server error (nothing more is sent for it).
    fn fail(&mut self, sh: &Shared, message: String) {
        self.send(Event::Error {
            status: 500,
            message,
        });
        sh.metrics.count_finished("error");
        self.done = Some(FinishReason::Cancelled);
    }

    fn emit(&mut self, text: String) {
        let ev = Event::Delta {
            text,
            ids: std::mem::take(&mut self.ids),
            logprobs: std::mem::take(&mut self.lps),
        };
        self.send(ev);
    }

    /// Flushes pending text and sends `Done`.
    pub(super) fn finish(&mut self, reason: FinishReason, sh: &Shared) {
        let mut reason = reason;
        if reason == FinishReason::Cancelled || self.cancelled() {
            sh.metrics.count_finished("cancelled");
            return;
        }
        if self.stop.matched().is_none() {
            let mut rest = String::new();
            if let Some(tail) = self.text.flush() {
                let out = self.stop.push(&tail);
                rest.push_str(&out.text);
                if out.matched.is_some() {
                    reason = FinishReason::Stop;
                }
            }
            rest.push_str(&self.stop.finish());
            if !rest.is_empty() || !self.ids.is_empty() {
                self.emit(rest);
            }
        }
        sh.metrics.count_finished(reason.as_str());
        let ev = Event::Done {
            finish: reason,
            prompt_tokens: self.p.req.prompt.len(),
            cached_tokens: self.cached,
            completion_tokens: self.generated,
        };
        self.send(ev);
    }
}

/// log-softmax of `logits` at `id`, and the `k` most likely tokens (best first, ties by id).
fn logprobs(logits: &[f32], id: u32, k: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| f64::from(v - max).exp())
        .sum();
    let lse = max as f64 + sum.ln();
    let lp = |v: f32| {
        if v.is_nan() {
            f32::NEG_INFINITY
        } else {
            (f64::from(v) - lse) as f32
        }
    };
    let mut top: Vec<(u32, f32)> = Vec::new();
    if k > 0 {
        let mut all: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as u32, lp(v)))
            .collect();
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = k.min(all.len());
        if k < all.len() {
            all.select_nth_unstable_by(k - 1, order);
            all.truncate(k);
        }
        all.sort_unstable_by(order);
        top = all;
    }
    TokenLogprob {
        id,
        logprob: logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&v| lp(v)),
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax() {
        let l = [1.0f32, 2.0, 3.0, f32::NAN];
        let t = logprobs(&l, 1, 2);
        let z = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((f64::from(t.logprob) - (2.0 - z)).abs() < 1e-6);
        assert_eq!(t.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 1]);
        assert_eq!(logprobs(&l, 3, 0).logprob, f32::NEG_INFINITY);
        assert!(logprobs(&l, 9, 0).top.is_empty());
    }
}
