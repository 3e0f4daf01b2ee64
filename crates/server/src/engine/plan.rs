//! One step's batch: which sequences feed how many tokens under the step's token budget.
//!
//! Every decoding sequence's one token first, then chunks of the tokens still to prefill (in
//! admission order) with what budget is left. With the paged KV cache's prefix cache, a
//! sequence whose next full block another sequence computes in the same step, from the same
//! tokens before it and under the same adapter, sits the step out: once that block is
//! registered it takes it from the cache ([`super::paged_blocks::share_more`]) instead of
//! computing it a second time beside the first (requests arriving together with one system
//! prompt would otherwise all prefill it at once when the budget lets them).
//!
//! What it is not: the blocks a plan needs (taken, and sequences preempted for them, by
//! [`super::preempt`]), or what a step does with its rows.

/// What the planner needs to know of one running sequence.
pub(super) struct Candidate<'a> {
    /// False once the sequence is done: it sits out.
    pub live: bool,
    /// It has a sampled token to feed (a decode row).
    pub decoding: bool,
    /// Its tokens; `tokens[..pos]` are in the cache, `tokens[pos..]` still to prefill.
    pub tokens: &'a [u32],
    pub pos: usize,
    /// The served adapter's slot (rows are ordered by it) and unique id (blocks are shared
    /// only under the same adapter); `None`: the base.
    pub slot: Option<usize>,
    pub adapter: Option<u64>,
    /// Everything it wrote is a chain of cached blocks (`pos` = its shared blocks x block
    /// tokens), so its next full block can still come from the prefix cache.
    pub can_share: bool,
}

impl Candidate<'_> {
    /// Still prefilling (its prompt, or after a preemption its prompt and generated tokens).
    fn prefilling(&self) -> bool {
        !self.decoding && self.pos < self.tokens.len()
    }
}

/// The batch under `max_batch_tokens`: (index in `cands`, tokens fed), ordered by adapter slot,
/// then index, so each adapter's rows are one run of the batch. `share_block`: the paged prefix
/// cache's block tokens when it is on (then the deferral of the module header applies).
pub(super) fn plan(
    cands: &[Candidate<'_>],
    max_batch_tokens: usize,
    share_block: Option<usize>,
) -> Vec<(usize, usize)> {
    let mut budget = max_batch_tokens.max(1);
    let mut plan: Vec<(usize, usize)> = Vec::new();
    let live = || cands.iter().enumerate().filter(|(_, c)| c.live);
    for (i, c) in live() {
        if c.decoding && budget > 0 {
            plan.push((i, 1));
            budget -= 1;
        }
    }
    let decode_rows = plan.len();
    for (i, c) in live() {
        if !c.prefilling() || budget == 0 {
            continue;
        }
        let chunks = &plan[decode_rows..];
        if share_block.is_some_and(|b| computed_beside(cands, chunks, c, b)) {
            continue;
        }
        let n = (c.tokens.len() - c.pos).min(budget);
        plan.push((i, n));
        budget -= n;
    }
    plan.sort_unstable_by_key(|&(i, _)| (cands[i].slot, i));
    plan
}

/// Whether `c`'s next full block of `b` tokens (one it could take from the prefix cache: never
/// the block of its last token, whose logits it needs) is computed by one of the prefill
/// `chunks` already planned, from the same tokens and under the same adapter.
fn computed_beside(
    cands: &[Candidate<'_>],
    chunks: &[(usize, usize)],
    c: &Candidate<'_>,
    b: usize,
) -> bool {
    let p = c.pos;
    let end = p + b;
    if !c.can_share || b == 0 || end > c.tokens.len().saturating_sub(1) / b * b {
        return false;
    }
    chunks.iter().any(|&(j, n)| {
        let o = &cands[j];
        o.adapter == c.adapter
            && o.pos <= p
            && o.pos + n >= end
            && o.tokens[..end] == c.tokens[..end]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefill(tokens: &[u32], pos: usize) -> Candidate<'_> {
        Candidate {
            live: true,
            decoding: false,
            tokens,
            pos,
            slot: None,
            adapter: None,
            can_share: pos % 4 == 0,
        }
    }

    fn decode(tokens: &[u32]) -> Candidate<'_> {
        Candidate {
            decoding: true,
            pos: tokens.len(),
            ..prefill(tokens, 0)
        }
    }

    #[test]
    fn decode_rows_come_first_then_prompt_chunks_in_order() {
        let (a, b, c) = ([1u32; 10], [2u32; 6], [3u32; 3]);
        let cands = [prefill(&a, 0), decode(&b), prefill(&c, 1)];
        // Budget 8: the decode row, then 7 of the first prompt's 10, nothing left for the third.
        assert_eq!(plan(&cands, 8, None), vec![(0, 7), (1, 1)]);
        assert_eq!(plan(&cands, 100, None), vec![(0, 10), (1, 1), (2, 2)]);
        // Done sequences sit out; a budget of 0 still feeds one token.
        let mut done = prefill(&a, 0);
        done.live = false;
        assert_eq!(plan(&[done, decode(&b)], 0, None), vec![(1, 1)]);
    }

    #[test]
    fn rows_are_grouped_by_adapter_slot() {
        let t = [5u32; 4];
        let mut cands: Vec<Candidate<'_>> = (0..4).map(|_| decode(&t)).collect();
        cands[0].slot = Some(1);
        cands[2].slot = Some(0);
        let order: Vec<usize> = plan(&cands, 16, None).iter().map(|p| p.0).collect();
        assert_eq!(order, vec![1, 3, 2, 0]);
    }

    #[test]
    fn a_block_computed_beside_is_waited_for_not_computed_twice() {
        // Blocks of 4. Three prompts sharing their first 9 tokens (two full blocks).
        let common: Vec<u32> = (10..19).collect();
        let with = |tail: &[u32]| [common.as_slice(), tail].concat();
        let (x, y, z) = (with(&[1, 2, 3]), with(&[4, 5]), with(&[6]));
        let cands = [prefill(&x, 0), prefill(&y, 0), prefill(&z, 0)];
        // The first computes everything; the others wait for its blocks.
        assert_eq!(plan(&cands, 64, Some(4)), vec![(0, 12)]);
        // Without the prefix cache all three are computed.
        assert_eq!(plan(&cands, 64, None), vec![(0, 12), (1, 11), (2, 10)]);
        // A chunk starting after the block defers nobody: the first prompt from position 1
        // does not compute block 0; the second does, and the third waits for it.
        let behind = [prefill(&x, 1), prefill(&y, 0), prefill(&z, 0)];
        assert_eq!(plan(&behind, 64, Some(4)), vec![(0, 11), (1, 11)]);
        // Once the shared blocks are taken (pos 8), the rest is each one's own: all run.
        let cands = [prefill(&x, 8), prefill(&y, 8), prefill(&z, 8)];
        assert_eq!(plan(&cands, 64, Some(4)), vec![(0, 4), (1, 3), (2, 2)]);
    }

    #[test]
    fn only_a_block_that_could_be_shared_is_waited_for() {
        let common: Vec<u32> = (10..19).collect();
        let x = [common.as_slice(), &[1, 2, 3]].concat();
        // Its next block holds its last token (0..8 of a 9-token prompt: positions 4..8 hold
        // token 8): computed, never taken from the cache.
        let short = &common[..8];
        assert_eq!(
            plan(&[prefill(&x, 0), prefill(short, 4)], 64, Some(4)),
            vec![(0, 12), (1, 4)]
        );
        // Another adapter's blocks are not shared.
        let y = x.clone();
        let mut other = prefill(&y, 0);
        other.adapter = Some(7);
        assert_eq!(
            plan(&[prefill(&x, 0), other], 64, Some(4)),
            vec![(0, 12), (1, 12)]
        );
        // Different tokens before the block: not the same block.
        let mut w = x.clone();
        w[1] = 99;
        assert_eq!(
            plan(&[prefill(&x, 4), prefill(&w, 4)], 64, Some(4)),
            vec![(0, 8), (1, 8)]
        );
        // Something it wrote is its own (not a chain of cached blocks): it computes.
        let mut own = prefill(&y, 4);
        own.can_share = false;
        assert_eq!(
            plan(&[prefill(&x, 0), own], 64, Some(4)),
            vec![(0, 12), (1, 8)]
        );
    }
}
