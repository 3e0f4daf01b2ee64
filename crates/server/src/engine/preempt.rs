//! Preemption with the paged KV cache (`serve --kv-paged`): vLLM's recompute policy.
//!
//! With the paged cache a sequence holds only the blocks its positions fill: its prompt's at
//! admission, one more whenever a step writes into a new block. Admission keeps a watermark of
//! free blocks back ([`watermark`]) so that the running sequences can usually grow, but the
//! pool can still run out mid-generation. Before each forward the scheduler reserves every
//! planned row's blocks ([`reserve_rows`], oldest sequence first); when the pool cannot give
//! them, the youngest running sequence (the latest first admitted, admission being FIFO: the
//! latest arrival) is preempted: its table is cleared (every block back to the pool), the token
//! it sampled and did not feed yet joins its tokens, and the whole sequence object (its sampler
//! and RNG, stop matcher, text decoder, constraint, penalty history, counts) waits in
//! [`Requeued`], which is admitted before any new request. Readmitted, it prefills its prompt
//! and generated tokens again (chunked like any prompt, all their blocks taken at once; with
//! prefix caching on, its full blocks that are still cached are shared instead: a preempted
//! sequence's blocks stay cached until the pool needs them, see [`super::paged_blocks`]); the
//! last of those rows picks its next token and generation goes on: its client sees one stream,
//! with no token repeated or lost, only a pause.
//!
//! Invariants:
//! - a preempted sequence holds no blocks, and `tokens` holds everything it must recompute
//!   (`pos == 0`, `next == None`);
//! - the oldest running sequence is never preempted while another runs, so it always
//!   progresses; alone in the pool and out of blocks, it ends with `length`, as at the context
//!   size (a prompt larger than the whole pool is refused at submission, `SubmitError::TooLarge`);
//! - preempted sequences wait in arrival order and are readmitted before new requests, so later
//!   arrivals cannot starve them.
//!
//! What it is not: swapping blocks out to host memory (vLLM's other policy; recomputing costs one
//! chunked prefill), or preemption with per-request caches (their reservation at admission never
//! runs out). Recomputed keys and values equal the first ones bit for bit where the step's
//! arithmetic does not depend on the batch (the CPU); on a GPU, whose products round differently
//! with the number of rows, a recomputed sequence may differ at a near tie as any batched one can.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Instant;

use hf2q_models::generate::FinishReason;
use hf2q_tensor::paged::BlockPool;
use hf2q_tensor::paged_prefix::PrefixBlocks;

use super::paged_blocks;
use super::seq::Seq;
use super::{Shared, BLOCK_TOKENS};

/// Free blocks admission keeps back while anything runs: 1 % of the pool, at least one block
/// (vLLM's default), so that the running sequences' next blocks do not force a preemption right
/// after every admission.
pub(super) fn watermark(pool: &BlockPool) -> usize {
    (pool.n_blocks() / 100).max(1)
}

/// Preempted sequences waiting to be readmitted, oldest (first admitted) first. They count as
/// queued requests (`Shared::queued`) while here.
#[derive(Default)]
pub(super) struct Requeued<'m> {
    seqs: VecDeque<Seq<'m>>,
}

impl<'m> Requeued<'m> {
    pub(super) fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Preempts `s`: its blocks go back to `pool`, its sampled but unfed token joins the tokens
    /// to recompute, and it waits in arrival order (ahead of every request not yet admitted,
    /// which all arrived after it).
    fn preempt(
        &mut self,
        mut s: Seq<'m>,
        pool: &mut BlockPool,
        prefix: Option<&mut PrefixBlocks>,
        sh: &Shared,
    ) {
        paged_blocks::release(&mut s.table, pool, prefix);
        s.shared_blocks = 0;
        if let Some(t) = s.next.take() {
            s.tokens.push(t);
        }
        s.pos = 0;
        sh.metrics.preemptions.fetch_add(1, Ordering::Relaxed);
        sh.queued.fetch_add(1, Ordering::SeqCst);
        let at = self.seqs.partition_point(|q| q.order < s.order);
        self.seqs.insert(at, s);
    }

    /// The oldest preempted sequence: the next to readmit (nothing else is admitted before it:
    /// FIFO).
    pub(super) fn front(&self) -> Option<&Seq<'m>> {
        self.seqs.front()
    }

    /// Takes the oldest preempted sequence out to run again: the caller gave it blocks for every
    /// token to recompute ([`paged_blocks::admit`]; its cached prefix is not recomputed).
    pub(super) fn readmit(&mut self, admitted: paged_blocks::Admitted, sh: &Shared) -> Seq<'m> {
        let mut s = self.seqs.pop_front().expect("a preempted sequence waits");
        sh.queued.fetch_sub(1, Ordering::SeqCst);
        s.pos = admitted.shared * BLOCK_TOKENS;
        s.table = admitted.table;
        s.shared_blocks = admitted.shared;
        s
    }

    /// Takes out, `done` set, the sequences that leave without being readmitted: cancelled, past
    /// their deadline, or (not expected: a preempted sequence held all its tokens but one in the
    /// pool) needing more blocks than the whole pool has, which end with `length`.
    pub(super) fn expire(&mut self, pool: &BlockPool, now: Instant, sh: &Shared) -> Vec<Seq<'m>> {
        let mut gone = Vec::new();
        let mut kept = VecDeque::with_capacity(self.seqs.len());
        for mut s in self.seqs.drain(..) {
            s.check_alive(now, sh);
            if s.done.is_none() && pool.blocks_for(s.tokens.len()) > pool.n_blocks() {
                s.done = Some(FinishReason::Length);
            }
            if s.done.is_some() {
                sh.queued.fetch_sub(1, Ordering::SeqCst);
                gone.push(s);
            } else {
                kept.push_back(s);
            }
        }
        self.seqs = kept;
        gone
    }

    /// Every waiting sequence (shutdown, abort); they hold no blocks.
    pub(super) fn drain(&mut self, sh: &Shared) -> Vec<Seq<'m>> {
        sh.queued.fetch_sub(self.seqs.len(), Ordering::SeqCst);
        self.seqs.drain(..).collect()
    }
}

/// What [`reserve_rows`] did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Reserved {
    /// Every planned row has its blocks: run the step.
    All,
    /// The pool ran out: one sequence was preempted (removed from `running`) or, alone in the
    /// pool, ended (`done` set). Plan the batch again without it and call again.
    Changed,
}

/// Takes the blocks each row of `plan` (index in `running`, tokens fed) needs for the positions
/// it writes, oldest sequence first, so that a shortage falls on the youngest. On the first row
/// the pool cannot serve, frees blocks once (see [`Reserved::Changed`]); blocks already taken
/// stay with their sequences, and the next call finds them in place. Each `Changed` removes or
/// ends one sequence, so the caller's loop ends.
pub(super) fn reserve_rows<'m>(
    running: &mut Vec<Seq<'m>>,
    plan: &[(usize, usize)],
    pool: &mut BlockPool,
    mut prefix: Option<&mut PrefixBlocks>,
    requeued: &mut Requeued<'m>,
    sh: &Shared,
) -> Reserved {
    let mut rows = plan.to_vec();
    rows.sort_unstable_by_key(|&(i, _)| running[i].order);
    for (i, n) in rows {
        let s = &mut running[i];
        // Cached blocks no table holds go before any sequence does.
        let need = pool
            .blocks_for(s.pos + n)
            .saturating_sub(s.table.blocks().len());
        paged_blocks::make_room(pool, prefix.as_deref_mut(), need);
        if s.table.reserve(pool, s.pos + n).is_ok() {
            continue;
        }
        let live = running.iter().filter(|s| s.done.is_none()).count();
        let youngest = running
            .iter()
            .enumerate()
            .filter(|(_, s)| s.done.is_none())
            .max_by_key(|(_, s)| s.order)
            .map_or(i, |(j, _)| j);
        if live <= 1 {
            // Nothing else holds blocks: the pool is smaller than this sequence.
            running[i].done = Some(FinishReason::Length);
        } else {
            let victim = running.remove(youngest);
            requeued.preempt(victim, pool, prefix, sh);
        }
        return Reserved::Changed;
    }
    Reserved::All
}
