//! The engine loop: admit, build one batch, run one forward, sample, emit; repeat.
//!
//! Per step:
//! 1. take new commands (blocking only when there is no work);
//! 2. drop cancelled requests (queued or running) and enforce deadlines;
//! 3. admit queued requests in arrival order while a slot and their KV blocks are free (FIFO:
//!    a large request at the head is not overtaken, so it cannot starve); blocks held by the
//!    prefix cache count as free (least recently used entries are evicted as needed), and a
//!    new sequence starts from the longest cached prefix of its prompt ([`super::prefix`]).
//!    With the paged KV cache, preempted sequences come first and a sequence takes only the
//!    blocks of the tokens it prefills ([`super::preempt`]);
//! 4. build the batch under the token budget ([`super::plan`]): every decoding sequence's one
//!    token first, then chunks of prompts being prefilled (oldest first) with what budget is
//!    left, a prompt whose next block another computes in the same step waiting for it. With
//!    the paged KV cache the rows' blocks are taken now, preempting the youngest sequences
//!    while the pool cannot give them, and the batch is planned again without them;
//! 5. one `Model::step_batch_served` (sequences ordered by served adapter, so each adapter's
//!    rows are one run); sample for every sequence whose prompt is complete;
//! 6. retire finished sequences: their blocks return to the budget and their caches (compacted)
//!    to the prefix cache.
//!
//! The sampling, stop-string and streaming-text logic is `hf2q_models::generate`'s, applied per
//! sequence (that module's loop is single-sequence; its pieces are reused here).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use hf2q_models::adapter_set::AdapterSet;
use hf2q_models::generate::FinishReason;
use hf2q_models::kv_cache::{KvCache, KvType};
use hf2q_models::{BatchItem, Model, PagedItem, Picked, RowPick};
use hf2q_tensor::paged::BlockTable;

use super::adapters::{valid_name, AdapterInfo, AdapterRef};
use super::kv_state::KvState;
use super::paged_blocks;
use super::plan::{self, Candidate};
use super::preempt::{self, Requeued, Reserved};
use super::prefix::{common_prefix, usable, PrefixPool, MIN_REUSE};
use super::seq::{cache_limit, Seq};
use super::{Cmd, Event, Install, Pending, Shared, BLOCK_TOKENS};

/// The engine loop; returns on `Cmd::Stop` or when every handle is gone. Says on `ready`, once
/// `Shared::paged` is set, that requests may come.
pub(super) fn run(model: &Model, sh: &Shared, rx: mpsc::Receiver<Cmd>, ready: mpsc::Sender<()>) {
    let eog = model.tokenizer().eog_ids().to_vec();
    let cfg = sh.cfg.clone();
    let mut waiting: VecDeque<Pending> = VecDeque::new();
    let mut running: Vec<Seq<'_>> = Vec::new();
    // Preempted sequences (paged KV cache only), readmitted before `waiting`.
    let mut requeued = Requeued::default();
    // Admissions so far: the next sequence's `Seq::order`.
    let mut admitted: u64 = 0;
    // Where the running sequences' keys and values live, and the prefix caches.
    let mut kv = KvState::new(model, sh);
    // The served adapters' factors; the registry in `sh` names them.
    let mut set = AdapterSet::new();
    let _ = ready.send(());
    loop {
        sh.beat();
        // Unloaded adapters that no request holds any more: free their slots and cached prefixes.
        let released = sh.registry().take_released();
        for a in released {
            set.remove(a.slot);
            kv.drop_adapter(a.uid);
        }
        // 1. Commands; block only when idle (with a timeout, to keep the heartbeat fresh).
        let mut cmds: Vec<Cmd> = Vec::new();
        if waiting.is_empty() && running.is_empty() && requeued.is_empty() {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(c) => cmds.push(c),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        cmds.extend(rx.try_iter());
        for cmd in cmds {
            match cmd {
                Cmd::Submit(p) => waiting.push_back(*p),
                Cmd::Install(i) => {
                    let Install {
                        name,
                        path,
                        adapter,
                        reply,
                    } = *i;
                    let r = install(model, sh, &mut set, name, path, adapter);
                    let _ = reply.send(r);
                }
                Cmd::AbortAll(why) => {
                    for p in waiting.drain(..) {
                        sh.queued.fetch_sub(1, Ordering::SeqCst);
                        let _ = p.out.send(Event::Error {
                            status: 503,
                            message: why.clone(),
                        });
                    }
                    for mut s in running.drain(..) {
                        s.send(Event::Error {
                            status: 503,
                            message: why.clone(),
                        });
                        kv.release(&mut s);
                    }
                    for mut s in requeued.drain(sh) {
                        s.send(Event::Error {
                            status: 503,
                            message: why.clone(),
                        });
                    }
                }
                Cmd::Stop => {
                    for p in waiting.drain(..) {
                        let _ = p.out.send(Event::Error {
                            status: 503,
                            message: "the server is shutting down".into(),
                        });
                    }
                    for mut s in running.drain(..).chain(requeued.drain(sh)) {
                        s.send(Event::Error {
                            status: 503,
                            message: "the server is shutting down".into(),
                        });
                    }
                    return;
                }
                Cmd::Crash => panic!("engine crash requested (test hook)"),
            }
        }

        // 2. Cancellations and deadlines.
        let now = Instant::now();
        waiting.retain(|p| {
            if p.cancel.load(Ordering::Relaxed) || p.out.is_closed() {
                sh.queued.fetch_sub(1, Ordering::SeqCst);
                sh.metrics.count_finished("cancelled");
                return false;
            }
            if p.req.deadline.is_some_and(|d| now >= d) {
                sh.queued.fetch_sub(1, Ordering::SeqCst);
                sh.metrics.count_finished("timeout");
                let message = "the request timed out waiting for a free slot".to_string();
                let _ = p.out.send(Event::Error {
                    status: 503,
                    message,
                });
                return false;
            }
            true
        });
        for s in running.iter_mut() {
            s.check_alive(now, sh);
        }
        if let Some(pc) = kv.paged.as_ref() {
            running.extend(requeued.expire(pc.pool(), now, sh));
        }
        retire(&mut running, &mut kv, sh);

        // 3. Admission, in arrival order: preempted sequences first (paged KV cache), then
        // new requests. The prefix cache's blocks are free for the taking.
        while running.len() < cfg.max_seqs {
            if let Some(pc) = kv.paged.as_mut() {
                if let Some(s) = requeued.front() {
                    let nothing_running = running.is_empty();
                    let cache = kv.blocks_cache.as_mut();
                    match paged_blocks::admit(
                        pc.pool_mut(),
                        cache,
                        &s.tokens,
                        s.uid(),
                        nothing_running,
                    ) {
                        Some(a) => {
                            running.push(requeued.readmit(a, sh));
                            continue;
                        }
                        None => break,
                    }
                }
            }
            let Some(front) = waiting.front() else { break };
            let valid = !front.req.prompt.is_empty() && front.req.prompt.len() <= cfg.ctx_size;
            // With the paged KV cache, the prompt's blocks (its cached prefix shared) now.
            let mut blocks = None;
            if valid {
                match kv.paged.as_mut() {
                    Some(pc) => {
                        let adapter = front.req.adapter.as_ref().map(|a| a.uid);
                        let prompt = &front.req.prompt;
                        let cache = kv.blocks_cache.as_mut();
                        match paged_blocks::admit(
                            pc.pool_mut(),
                            cache,
                            prompt,
                            adapter,
                            running.is_empty(),
                        ) {
                            Some(a) => blocks = Some(a),
                            None => break,
                        }
                    }
                    None if front.blocks > kv.free_blocks + kv.pool.blocks() => break,
                    None => {}
                }
            }
            let p = waiting.pop_front().expect("front exists");
            sh.queued.fetch_sub(1, Ordering::SeqCst);
            if !valid {
                let message = format!(
                    "the prompt has {} tokens; 1 to {} are allowed",
                    p.req.prompt.len(),
                    cfg.ctx_size
                );
                let _ = p.out.send(Event::Error {
                    status: 400,
                    message,
                });
                continue;
            }
            let mut table = BlockTable::new();
            let mut shared_blocks = 0;
            let (cache, cached) = match blocks {
                Some(a) => {
                    if kv.blocks_cache.is_some() {
                        let m = &sh.metrics;
                        m.prefix_cache_queries.fetch_add(1, Ordering::Relaxed);
                        if a.shared > 0 {
                            count_prefix_hit(sh, a.shared * BLOCK_TOKENS);
                        }
                    }
                    table = a.table;
                    shared_blocks = a.shared;
                    // Holds nothing (nothing writes it); its limit bounds the sequence's length.
                    (
                        model.new_cache(cache_limit(&p, cfg.ctx_size)),
                        a.shared * BLOCK_TOKENS,
                    )
                }
                None => {
                    let c = start_cache(model, &p, &mut kv.pool, &running, &mut kv.free_blocks, sh);
                    kv.free_blocks -= p.blocks;
                    c
                }
            };
            sh.metrics
                .prompt_tokens
                .fetch_add(p.req.prompt.len() as u64, Ordering::Relaxed);
            let mut seq = Seq::new(p, admitted, model, cache, cached);
            admitted += 1;
            seq.table = table;
            seq.shared_blocks = shared_blocks;
            running.push(seq);
        }
        kv.publish(&running, sh);
        if running.is_empty() {
            continue;
        }

        // Sequences still prefilling take the blocks cached since they were admitted.
        if let (Some(pc), Some(c)) = (kv.paged.as_mut(), kv.blocks_cache.as_mut()) {
            for s in running
                .iter_mut()
                .filter(|s| s.done.is_none() && s.next.is_none())
            {
                let uid = s.uid();
                let (pos, shared) = (&mut s.pos, &mut s.shared_blocks);
                let took = paged_blocks::share_more(
                    pc.pool_mut(),
                    c,
                    &mut s.table,
                    &s.tokens,
                    uid,
                    pos,
                    shared,
                );
                // Prompt tokens (a readmitted sequence's recomputation is not a prompt's).
                if took > 0 && s.generated == 0 {
                    if s.cached == 0 {
                        sh.metrics.prefix_cache_hits.fetch_add(1, Ordering::Relaxed);
                    }
                    s.cached += took * BLOCK_TOKENS;
                    sh.metrics
                        .prompt_tokens_cached
                        .fetch_add((took * BLOCK_TOKENS) as u64, Ordering::Relaxed);
                }
            }
        }

        // 4. The batch: decode tokens first, then prompt chunks. With the paged KV cache, the
        // rows' blocks first: while the pool cannot give them, the youngest sequence is
        // preempted (or, alone, ended) and the batch planned again without it.
        let share_block = (kv.paged.is_some() && kv.blocks_cache.is_some()).then_some(BLOCK_TOKENS);
        let plan = loop {
            let plan = plan_batch(&running, cfg.max_batch_tokens, share_block);
            let Some(pc) = kv.paged.as_mut() else {
                break plan;
            };
            let cache = kv.blocks_cache.as_mut();
            match preempt::reserve_rows(
                &mut running,
                &plan,
                pc.pool_mut(),
                cache,
                &mut requeued,
                sh,
            ) {
                Reserved::All => break plan,
                Reserved::Changed => continue,
            }
        };
        if plan.is_empty() {
            // Everything left was preempted or ended.
            retire(&mut running, &mut kv, sh);
            continue;
        }
        let fed: usize = plan.iter().map(|p| p.1).sum();
        let step_start = Instant::now();
        let result = {
            let mut seqs = planned(&mut running, &plan);
            let slots: Vec<Option<usize>> = seqs.iter().map(|(s, _)| s.slot()).collect();
            if let Some(pc) = kv.paged.as_mut() {
                // Tokens picked on the device where the request allows; only those ids (and
                // the rows that need their logits here) come back.
                let picks: Vec<RowPick> = seqs.iter_mut().map(|(s, n)| s.row_pick(*n)).collect();
                let mut items: Vec<PagedItem<'_>> = seqs
                    .into_iter()
                    .map(|(s, n)| {
                        let tokens = tokens_fed(&s.next, &s.tokens, s.pos, n);
                        PagedItem {
                            table: &mut s.table,
                            pos0: s.pos,
                            tokens,
                        }
                    })
                    .collect();
                model.step_paged_served(pc, &mut items, &picks, Some((&set, &slots)))
            } else {
                let mut items: Vec<BatchItem<'_>> = seqs
                    .into_iter()
                    .map(|(s, n)| {
                        let tokens = tokens_fed(&s.next, &s.tokens, s.pos, n);
                        BatchItem {
                            cache: &mut s.cache,
                            pos0: s.pos,
                            tokens,
                        }
                    })
                    .collect();
                model
                    .step_batch_served(&mut items, Some((&set, &slots)))
                    .map(|rows| rows.into_iter().map(Picked::Logits).collect())
            }
        };
        sh.metrics.steps.fetch_add(1, Ordering::Relaxed);
        sh.metrics
            .step_seconds
            .observe(step_start.elapsed().as_secs_f64());
        sh.metrics.batch_size.observe(plan.len() as f64);
        sh.metrics
            .step_tokens
            .fetch_add(fed as u64, Ordering::Relaxed);
        sh.beat();

        // 5. Sample.
        let now = Instant::now();
        let mut sampled = 0u64;
        match result {
            Ok(picked) => {
                for ((i, n), l) in plan.iter().zip(picked) {
                    let s = &mut running[*i];
                    s.pos += n;
                    let fed = s.next.take();
                    let decoding = fed.is_some();
                    if let Some(t) = fed {
                        s.tokens.push(t);
                    }
                    // Blocks this step filled join the prefix cache.
                    if let Some(pc) = kv.paged.as_mut() {
                        s.shared_blocks = paged_blocks::register(
                            pc.pool_mut(),
                            kv.blocks_cache.as_mut(),
                            &s.table,
                            &s.tokens[..s.pos],
                            s.uid(),
                            s.shared_blocks,
                        );
                    }
                    // A decoded token, or the last of the tokens to prefill: pick the next.
                    if decoding || s.pos == s.tokens.len() {
                        s.take_pick(l, &eog, sh, now);
                        sampled += 1;
                    }
                }
            }
            Err(e) => {
                eprintln!("error: forward step failed: {e}");
                for (i, _) in &plan {
                    let s = &mut running[*i];
                    s.send(Event::Error {
                        status: 500,
                        message: format!("the forward pass failed: {e}"),
                    });
                    sh.metrics.count_finished("error");
                    s.poolable = false;
                    s.done = Some(FinishReason::Cancelled);
                }
            }
        }
        sh.metrics
            .rate
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(now, sampled);
        retire(&mut running, &mut kv, sh);
        if !cfg.step_delay.is_zero() {
            std::thread::sleep(cfg.step_delay);
        }
    }
}

/// One step's batch under the token budget `max_batch_tokens` ([`plan::plan`]): (index in
/// `running`, tokens fed). `share_block`: the paged prefix cache's block tokens when it is on.
fn plan_batch(
    running: &[Seq<'_>],
    max_batch_tokens: usize,
    share_block: Option<usize>,
) -> Vec<(usize, usize)> {
    let cands: Vec<Candidate<'_>> = running
        .iter()
        .map(|s| Candidate {
            live: s.done.is_none(),
            decoding: s.next.is_some(),
            tokens: &s.tokens,
            pos: s.pos,
            slot: s.slot(),
            adapter: s.uid(),
            can_share: s.pos == s.shared_blocks * BLOCK_TOKENS,
        })
        .collect();
    plan::plan(&cands, max_batch_tokens, share_block)
}

/// The tokens a sequence feeds this step: its sampled token, or the next `n` of its tokens to
/// prefill after `pos` (fields, not the sequence, so its cache or table can be borrowed beside
/// them).
fn tokens_fed<'a>(next: &'a Option<u32>, tokens: &'a [u32], pos: usize, n: usize) -> &'a [u32] {
    match next {
        Some(t) => std::slice::from_ref(t),
        None => &tokens[pos..pos + n],
    }
}

/// The sequences of `plan` (index in `running`, tokens fed), in plan order, each once.
fn planned<'a, 'm>(
    running: &'a mut [Seq<'m>],
    plan: &[(usize, usize)],
) -> Vec<(&'a mut Seq<'m>, usize)> {
    let mut seqs: Vec<Option<&mut Seq<'m>>> = running.iter_mut().map(Some).collect();
    plan.iter()
        .filter_map(|&(i, n)| seqs[i].take().map(|s| (s, n)))
        .collect()
}

/// Finishes and removes sequences whose `done` is set, returning their blocks; their caches go
/// to the prefix cache. Publishes the gauges (before the clients hear of the end, and after).
fn retire(running: &mut Vec<Seq<'_>>, kv: &mut KvState, sh: &Shared) {
    let (mut finished, still): (Vec<Seq<'_>>, Vec<Seq<'_>>) = std::mem::take(running)
        .into_iter()
        .partition(|s| s.done.is_some());
    *running = still;
    if finished.is_empty() {
        kv.publish(running, sh);
        return;
    }
    // The gauges first: a client that has its answer must also see its slot free (/metrics).
    for s in &mut finished {
        kv.release(s);
    }
    kv.publish(running, sh);
    for mut s in finished {
        let reason = s.done.expect("partitioned on done");
        s.finish(reason, sh);
        if sh.cfg.prefix_cache && s.poolable && kv.paged.is_none() {
            offer(&mut s, &mut kv.free_blocks, &mut kv.pool, sh);
        }
    }
    // And after: the prefix cache took the finished caches.
    kv.publish(running, sh);
}

/// Gives a finished sequence's cache to the prefix cache, compacted to the positions it holds
/// (a cache grows by doubling, so it usually has room to spare). Its blocks come out of
/// `free_blocks`, to which the sequence's reservation (never fewer blocks) was just returned.
/// Device caches, and caches too short to be worth reusing, are simply dropped.
fn offer(s: &mut Seq<'_>, free_blocks: &mut usize, pool: &mut PrefixPool, sh: &Shared) {
    let pos = s.pos;
    if pos < MIN_REUSE || !s.cache.is_host() || sh.bytes_per_token == 0 {
        return;
    }
    let cap = s.cache.bytes() / sh.bytes_per_token as usize;
    let cache = if cap.div_ceil(BLOCK_TOKENS) > pos.div_ceil(BLOCK_TOKENS) {
        match s.cache.prefix(pos, pos) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("warning: a finished sequence's KV cache could not be kept: {e}");
                return;
            }
        }
    } else {
        std::mem::replace(&mut s.cache, KvCache::new(0, 0, 0, 0, KvType::default()))
    };
    let blocks = (cache.bytes() / sh.bytes_per_token as usize).div_ceil(BLOCK_TOKENS);
    if blocks > *free_blocks {
        // Cannot happen (the entry is never larger than the reservation just returned); keep
        // the accounting exact rather than trust that.
        return;
    }
    *free_blocks -= blocks;
    s.tokens.truncate(pos);
    let uid = s.uid();
    *free_blocks += pool.insert(std::mem::take(&mut s.tokens), cache, blocks, uid);
}

/// The cache a newly admitted request starts with and how many of its prompt tokens it already
/// holds (copied from the longest usable match among the prefix cache and the running
/// sequences). Also makes room for the request's blocks in `free_blocks`, evicting pooled
/// prefixes least recently used first and the match's source last; the caller checked that
/// the free and pooled blocks together suffice.
fn start_cache(
    model: &Model,
    p: &Pending,
    pool: &mut PrefixPool,
    running: &[Seq<'_>],
    free_blocks: &mut usize,
    sh: &Shared,
) -> (KvCache, usize) {
    /// Where the reused rows come from.
    enum Src {
        Pool(u64),
        Running(usize),
    }
    let prompt = &p.req.prompt;
    let adapter = p.req.adapter.as_ref().map(|a| a.uid);
    let limit = cache_limit(p, sh.cfg.ctx_size);
    let mut best: Option<(Src, usize)> = None;
    if sh.cfg.prefix_cache {
        sh.metrics
            .prefix_cache_queries
            .fetch_add(1, Ordering::Relaxed);
        best = pool.best(prompt, adapter).map(|(id, n)| (Src::Pool(id), n));
        for (i, s) in running
            .iter()
            .enumerate()
            .filter(|(_, s)| s.uid() == adapter)
        {
            let n = usable(common_prefix(&s.tokens[..s.pos], prompt), prompt.len());
            if n > best.as_ref().map_or(0, |b| b.1) && s.cache.is_host() {
                best = Some((Src::Running(i), n));
            }
        }
    }
    let keep = match best {
        Some((Src::Pool(id), _)) => Some(id),
        _ => None,
    };
    pool.evict(p.blocks, free_blocks, keep);
    let mut taken = None;
    if *free_blocks < p.blocks {
        // Only the source is left to evict: take it out, copy from it, then drop it.
        if let Some(e) = keep.and_then(|id| pool.take(id)) {
            *free_blocks += e.blocks;
            taken = Some(e);
        }
    }
    let Some((src, n)) = best else {
        return (model.new_cache(limit), 0);
    };
    let from = match (&src, &taken) {
        (_, Some(e)) => Some(&e.cache),
        (Src::Pool(id), None) => pool.get(*id).map(|e| &e.cache),
        (Src::Running(i), None) => running.get(*i).map(|s| &s.cache),
    };
    let copied = from.map(|c| c.prefix(n, limit));
    match copied {
        Some(Ok(cache)) => {
            if let (Src::Pool(id), None) = (&src, &taken) {
                pool.touch(*id);
            }
            count_prefix_hit(sh, n);
            (cache, n)
        }
        Some(Err(e)) => {
            eprintln!("warning: a cached prefix could not be copied (prefilling instead): {e}");
            (model.new_cache(limit), 0)
        }
        None => (model.new_cache(limit), 0),
    }
}

/// Counts a prefix cache hit that gave a new request `cached` of its prompt tokens.
fn count_prefix_hit(sh: &Shared, cached: usize) {
    let m = &sh.metrics;
    m.prefix_cache_hits.fetch_add(1, Ordering::Relaxed);
    m.prompt_tokens_cached
        .fetch_add(cached as u64, Ordering::Relaxed);
}

/// Puts an adapter into a free slot of `set` and registers it under `name`.
fn install(
    model: &Model,
    sh: &Shared,
    set: &mut AdapterSet,
    name: String,
    path: std::path::PathBuf,
    adapter: hf2q_models::adapter_set::ReadAdapter,
) -> Result<AdapterRef, String> {
    if !valid_name(&name) {
        return Err(format!("'{name}' is not a valid adapter name"));
    }
    if sh.registry().contains(&name) {
        return Err(format!("an adapter named '{name}' is already loaded"));
    }
    let cfg = adapter.config.clone();
    let slot = set.insert(model, adapter).map_err(|e| e.to_string())?;
    let mut reg = sh.registry();
    let info = AdapterInfo {
        name,
        path,
        slot,
        uid: reg.next_uid(),
        rank: cfg.r,
        alpha: cfg.alpha,
        targets: cfg.targets,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    let a = std::sync::Arc::new(info);
    reg.insert(a.clone());
    Ok(a)
}
