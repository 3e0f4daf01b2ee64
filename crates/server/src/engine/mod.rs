//! The engine: one thread owns the model and runs the scheduler; HTTP handlers talk to it
//! through [`Engine::submit`] and receive [`Event`]s on a channel of their own.
//!
//! Continuous batching: every step the scheduler ([`scheduler`]) puts each running sequence's
//! next token (and chunks of prompts still being prefilled) into ONE forward
//! ([`hf2q_models::Model::step_batch`]); sequences join and leave between steps. The reference
//! for this design is vLLM's scheduler (admission under a KV budget, chunked prefill with a token
//! budget per step, decode first so running streams keep flowing).
//!
//! KV memory is accounted in blocks of [`BLOCK_TOKENS`] positions against a cap (`--kv-mem`).
//! With per-request caches (the default) a sequence reserves its worst case (prompt +
//! max_tokens, at most the context size) when it is admitted, and its cache is created with
//! exactly that limit, so the memory a sequence can allocate never exceeds what it reserved.
//! With the paged KV cache (`--kv-paged`, [`EngineConfig::paged_kv`]) a sequence takes only its
//! prompt's blocks at admission (a watermark of free blocks kept back) and one more block
//! whenever a step crosses into it; when a step cannot get its blocks the youngest running
//! sequence is preempted and later recomputed ([`preempt`]). Requests wait in a bounded FIFO
//! queue until their blocks are free; a full queue answers 429, a draining or dead engine 503.
//!
//! Cancellation: each request carries a flag set when its [`Ticket`] is dropped (the HTTP
//! handler or response stream went away, i.e. the client disconnected). The scheduler checks
//! flags before every step, so a request is dropped whether it is queued, prefilling,
//! decoding or preempted, and its blocks are freed at once.
//!
//! Prefix caching ([`prefix`], on unless `--no-prefix-cache`): a finished sequence's cache is
//! kept with the tokens it holds, and a new request whose prompt starts with the same tokens
//! (a multi-turn chat re-sending its history, a shared system prompt) copies those keys and
//! values instead of prefilling them; running sequences' caches serve as sources too. Kept
//! caches count against the same KV budget and are evicted least recently used first whenever
//! admission needs their blocks, so caching never makes a request wait. Host (CPU) caches only:
//! with a device backend nothing is kept. With the paged KV cache, on every device, the cache
//! is made of blocks ([`paged_blocks`], `hf2q_tensor::paged_prefix`): a block joins it once its
//! positions are all written, a new (or readmitted) sequence shares the cached blocks of its
//! leading tokens by reference instead of computing them, and blocks no sequence holds are
//! evicted least recently used first whenever admission or a step needs free blocks.
//!
//! Served adapters ([`adapters`]): a request may name a LoRA adapter loaded beside the base
//! (`--adapter`, `POST /v1/adapters`); sequences of different adapters share one batch (the
//! base products once, each adapter's over its rows: `Model::step_batch_served`), and prefix
//! cache entries are keyed by the adapter too.
//!
//! What it is not: block sharing between per-request caches (a reused prefix is copied), or
//! preemption by swapping KV to host memory
//! (a preempted sequence is recomputed), or preemption with per-request caches (their
//! reservation never runs out).

pub mod adapters;
mod kv_state;
mod paged_blocks;
mod plan;
mod preempt;
mod prefix;
mod scheduler;
mod seq;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use hf2q_models::adapter_set::ReadAdapter;
use hf2q_models::constraint::Constraint;
use hf2q_models::generate::FinishReason;
use hf2q_models::sampler::SamplerConfig;
use hf2q_models::Model;
use tokio::sync::{mpsc as tmpsc, watch};

use crate::metrics::{Gauges, Metrics};
use adapters::{AdapterRef, Registry};

/// Positions per KV block (the unit of admission accounting).
pub const BLOCK_TOKENS: usize = 16;

/// Scheduler limits.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most positions (prompt + generated) one sequence may hold.
    pub ctx_size: usize,
    /// Cap on KV-cache memory reserved by all running sequences, in bytes.
    pub kv_mem_bytes: u64,
    /// Most sequences decoded together in one step.
    pub max_seqs: usize,
    /// Most requests waiting for admission; beyond it `submit` fails with `QueueFull`.
    pub max_queue: usize,
    /// Most tokens fed through one step (decode tokens first, then prompt chunks): bounds the
    /// stall that a long prompt causes to running streams.
    pub max_batch_tokens: usize,
    /// Sleep after each step. Zero in production; tests and demos use it to make generation
    /// slow enough to observe (stop buttons, disconnects).
    pub step_delay: Duration,
    /// Keep finished sequences' KV caches and start new requests from the longest cached
    /// prefix of their prompt (see the module docs); with `paged_kv`, keep full blocks and share
    /// them (`paged_blocks`).
    pub prefix_cache: bool,
    /// Keep every running sequence's keys and values in one paged cache per layer and run
    /// each step's norms, RoPE, cache writes and attention once over all rows
    /// (`Model::step_paged`) instead of per sequence; served adapters' rows ride in the same
    /// step (`Model::step_paged_served`).
    pub paged_kv: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            ctx_size: 4096,
            kv_mem_bytes: 4 << 30,
            max_seqs: 32,
            max_queue: 256,
            max_batch_tokens: 256,
            step_delay: Duration::ZERO,
            prefix_cache: true,
            paged_kv: false,
        }
    }
}

/// One sequence to generate.
#[derive(Clone, Debug)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    /// Most tokens to generate (an end-of-generation token counts).
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// `Some(k)`: report the chosen token's log-probability and the `k` most likely ones.
    pub logprobs: Option<usize>,
    pub ignore_eos: bool,
    /// After this instant a queued request fails (503) and a running one ends (`length`).
    pub deadline: Option<Instant>,
    /// Constrained decoding: the mask of each step is applied before sampling.
    pub constraint: Option<Constraint>,
    /// Special tokens whose text is kept in the output (tool-call markup such as
    /// `<|python_tag|>`); other special tokens are skipped when decoding.
    pub keep_tokens: Vec<u32>,
    /// The served adapter this sequence runs with (`None`: the base alone). Held until the
    /// sequence leaves the engine, so an unloaded adapter stays until its requests finish.
    pub adapter: Option<AdapterRef>,
}

/// Log-probabilities of one generated token (over the model's distribution, before sampling
/// settings are applied).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// The most likely tokens, best first.
    pub top: Vec<(u32, f32)>,
}

/// What the engine tells a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Text that became final, the ids sampled since the previous event (end-of-generation ids
    /// excluded) and, when asked for, their log-probabilities.
    Delta {
        text: String,
        ids: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
    },
    /// The sequence ended; nothing follows.
    Done {
        finish: FinishReason,
        prompt_tokens: usize,
        /// Prompt tokens whose keys and values came from the prefix cache (not prefilled).
        cached_tokens: usize,
        completion_tokens: usize,
    },
    /// The sequence failed; nothing follows. `status` is the HTTP status that fits.
    Error { status: u16, message: String },
}

/// Why a request was not accepted.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SubmitError {
    #[error("the server is busy: {0} requests are already waiting; retry later")]
    QueueFull(usize),
    #[error("{0}")]
    Unavailable(String),
    /// The request can never fit the whole KV pool: `need` positions (rounded up to whole
    /// blocks) of `pool`. `prompt_only`: what was counted is the prompt alone (the paged KV
    /// cache takes a sequence's blocks as it grows), not prompt + max_tokens.
    #[error(
        "this request needs {need} tokens of KV cache but the server's KV memory (--kv-mem) holds only {pool}; {}",
        if *.prompt_only { "shorten the prompt" } else { "lower max_tokens or shorten the prompt" }
    )]
    TooLarge {
        need: usize,
        pool: usize,
        prompt_only: bool,
    },
}

/// State shared by the engine thread and the HTTP side.
pub struct Shared {
    pub metrics: Metrics,
    /// Requests submitted and not yet admitted (channel + waiting queue).
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    pub kv_reserved_blocks: AtomicUsize,
    pub kv_used_bytes: AtomicU64,
    /// KV memory held by the prefix cache (evictable; not in `kv_reserved_blocks`).
    pub prefix_cache_bytes: AtomicU64,
    pub prefix_cache_entries: AtomicUsize,
    /// Milliseconds since `started` when the engine loop last made progress.
    heartbeat_ms: AtomicU64,
    started: Instant,
    draining: AtomicBool,
    dead: watch::Sender<bool>,
    pub total_blocks: usize,
    /// True when the engine runs its steps over the paged KV cache (`cfg.paged_kv` asked for it
    /// and the model has a paged path); set by the engine thread before [`Engine::start`]
    /// returns.
    paged: AtomicBool,
    pub bytes_per_token: u64,
    pub cfg: EngineConfig,
    /// The served adapters' names and reference counts.
    pub adapters: Mutex<Registry>,
}

impl Shared {
    /// The adapter registry (a poisoned lock still holds consistent data: every change is one
    /// map operation).
    pub fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.adapters.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn beat(&self) {
        self.heartbeat_ms
            .store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
    /// Time since the engine loop last made progress.
    pub fn since_heartbeat(&self) -> Duration {
        let now = self.started.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.heartbeat_ms.load(Ordering::Relaxed)))
    }
    pub fn is_dead(&self) -> bool {
        *self.dead.borrow()
    }
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }
    /// Whether the engine runs over the paged KV cache (see [`EngineConfig::paged_kv`]).
    pub fn is_paged(&self) -> bool {
        self.paged.load(Ordering::SeqCst)
    }
    /// Work submitted and not finished.
    pub fn busy(&self) -> bool {
        self.queued.load(Ordering::Relaxed) + self.running.load(Ordering::Relaxed) > 0
    }
    pub fn gauges(&self) -> Gauges {
        let blocks = self.kv_reserved_blocks.load(Ordering::Relaxed) as u64;
        let block_bytes = BLOCK_TOKENS as u64 * self.bytes_per_token;
        Gauges {
            queued: self.queued.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
            kv_reserved_bytes: blocks * block_bytes,
            kv_used_bytes: self.kv_used_bytes.load(Ordering::Relaxed),
            kv_capacity_bytes: self.total_blocks as u64 * block_bytes,
            kv_blocks_used: blocks,
            kv_blocks_total: self.total_blocks as u64,
            prefix_cache_bytes: self.prefix_cache_bytes.load(Ordering::Relaxed),
            prefix_cache_entries: self.prefix_cache_entries.load(Ordering::Relaxed),
            up: !self.is_dead(),
        }
    }
}

enum Cmd {
    Submit(Box<Pending>),
    /// Put an adapter read from its files into a free slot under a name.
    Install(Box<Install>),
    /// End every queued and running request with an error (shutdown after the drain timeout).
    AbortAll(String),
    /// Stop the loop (the engine thread exits normally).
    Stop,
    /// Test hook: panic inside the engine thread.
    #[allow(dead_code)]
    Crash,
}

/// A submitted request on its way to the scheduler.
struct Pending {
    req: GenRequest,
    out: tmpsc::UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    arrived: Instant,
    /// Blocks reserved at admission with per-request caches (prompt + max_tokens); the paged
    /// cache counts what its sequences hold in its own pool instead.
    blocks: usize,
}

/// An adapter to install, and where to answer.
struct Install {
    name: String,
    path: PathBuf,
    adapter: ReadAdapter,
    reply: tokio::sync::oneshot::Sender<Result<AdapterRef, String>>,
}

/// Sets the request's cancel flag when dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A submitted request: its events, and cancellation when dropped.
pub struct Ticket {
    events: tmpsc::UnboundedReceiver<Event>,
    _cancel: CancelOnDrop,
}

impl Ticket {
    /// The next event; after `Done`/`Error`, or if the engine stopped, an `Error`.
    pub async fn recv(&mut self) -> Event {
        self.events.recv().await.unwrap_or_else(|| Event::Error {
            status: 500,
            message: "the engine stopped while generating this response".into(),
        })
    }
}

/// Handle to the engine thread (cheap to clone).
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<Cmd>,
    shared: Arc<Shared>,
    model: Arc<Model>,
}

impl Engine {
    /// Starts the engine thread over `model`.
    pub fn start(model: Arc<Model>, cfg: EngineConfig) -> std::io::Result<Engine> {
        // Keys and values of every layer, at the model's cache type (the CLI gives a GPU the same).
        let bytes_per_token = model.kv_bytes_per_token() as u64;
        let block_bytes = (BLOCK_TOKENS as u64 * bytes_per_token).max(1);
        let total_blocks = (cfg.kv_mem_bytes / block_bytes) as usize;
        let (dead, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            metrics: Metrics::default(),
            queued: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            kv_reserved_blocks: AtomicUsize::new(0),
            kv_used_bytes: AtomicU64::new(0),
            prefix_cache_bytes: AtomicU64::new(0),
            prefix_cache_entries: AtomicUsize::new(0),
            heartbeat_ms: AtomicU64::new(0),
            started: Instant::now(),
            draining: AtomicBool::new(false),
            dead,
            total_blocks,
            paged: AtomicBool::new(false),
            bytes_per_token,
            cfg,
            adapters: Mutex::new(Registry::default()),
        });
        let (tx, rx) = mpsc::channel();
        // The engine thread says once whether it runs the paged KV cache (`Shared::paged`),
        // before any request is submitted: admission limits depend on it.
        let (ready_tx, ready_rx) = mpsc::channel::<()>();
        let (m, s) = (model.clone(), shared.clone());
        std::thread::Builder::new()
            .name("hf2q-engine".into())
            .spawn(move || {
                // On a panic the sequences and the command channel are dropped while unwinding, so
                // every waiting handler sees its channel close and answers 500.
                // The steps run on a worker of a pool of their own, so that each parallel
                // step of a forward pass starts from a worker instead of being handed over
                // and waited for (hundreds of times a token).
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    match rayon::ThreadPoolBuilder::new()
                        .thread_name(|i| format!("hf2q-engine-{i}"))
                        .build()
                    {
                        Ok(pool) => pool.install(|| scheduler::run(&m, &s, rx, ready_tx)),
                        Err(_) => scheduler::run(&m, &s, rx, ready_tx),
                    }
                }));
                if r.is_err() {
                    eprintln!("error: the engine thread panicked");
                }
                s.running.store(0, Ordering::Relaxed);
                s.queued.store(0, Ordering::Relaxed);
                s.dead.send_replace(true);
            })?;
        // An error here means the thread ended first; `submit` then finds it dead.
        let _ = ready_rx.recv();
        Ok(Engine { tx, shared, model })
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// KV blocks a request reserves at admission with per-request caches (its worst case).
    pub fn blocks_for(&self, prompt: usize, max_tokens: usize) -> usize {
        (prompt + max_tokens)
            .min(self.shared.cfg.ctx_size)
            .div_ceil(BLOCK_TOKENS)
    }

    /// Refuses a request that could never be admitted, even alone: with per-request caches when
    /// its reservation exceeds the whole budget, with the paged cache when its prompt alone
    /// does (it grows block by block; alone in the pool it ends with `length` when full).
    fn check_fits(&self, r: &GenRequest) -> Result<(), SubmitError> {
        let sh = &self.shared;
        let prompt_only = sh.is_paged();
        let need = if prompt_only {
            r.prompt.len().div_ceil(BLOCK_TOKENS)
        } else {
            self.blocks_for(r.prompt.len(), r.max_tokens)
        };
        if need > sh.total_blocks {
            return Err(SubmitError::TooLarge {
                need: need * BLOCK_TOKENS,
                pool: sh.total_blocks * BLOCK_TOKENS,
                prompt_only,
            });
        }
        Ok(())
    }

    /// Submits one request (see [`Engine::submit_many`]).
    pub fn submit(&self, req: GenRequest) -> Result<Ticket, SubmitError> {
        Ok(self
            .submit_many(vec![req])?
            .pop()
            .expect("one request, one ticket"))
    }

    /// Submits requests that are admitted to the queue together or not at all (the `n` choices
    /// of one HTTP request).
    pub fn submit_many(&self, reqs: Vec<GenRequest>) -> Result<Vec<Ticket>, SubmitError> {
        let sh = &self.shared;
        if sh.is_dead() {
            return Err(SubmitError::Unavailable("the engine is not running".into()));
        }
        if sh.is_draining() {
            return Err(SubmitError::Unavailable(
                "the server is shutting down".into(),
            ));
        }
        for r in &reqs {
            self.check_fits(r)?;
        }
        let n = reqs.len();
        let before = sh.queued.fetch_add(n, Ordering::SeqCst);
        if before + n > sh.cfg.max_queue {
            sh.queued.fetch_sub(n, Ordering::SeqCst);
            sh.metrics.count_finished("rejected");
            return Err(SubmitError::QueueFull(before));
        }
        let mut tickets = Vec::with_capacity(n);
        let now = Instant::now();
        for req in reqs {
            let (out, events) = tmpsc::unbounded_channel();
            let cancel = Arc::new(AtomicBool::new(false));
            let blocks = self.blocks_for(req.prompt.len(), req.max_tokens);
            let p = Pending {
                req,
                out,
                cancel: cancel.clone(),
                arrived: now,
                blocks,
            };
            if self.tx.send(Cmd::Submit(Box::new(p))).is_err() {
                sh.queued.fetch_sub(n - tickets.len(), Ordering::SeqCst);
                return Err(SubmitError::Unavailable("the engine is not running".into()));
            }
            tickets.push(Ticket {
                events,
                _cancel: CancelOnDrop(cancel),
            });
        }
        Ok(tickets)
    }

    /// Installs `adapter` (read from `path` by `Model::read_adapter` of this engine's model)
    /// under `name`, in a free slot of the engine's set; fails when the name is taken.
    pub async fn install(
        &self,
        name: &str,
        path: PathBuf,
        adapter: ReadAdapter,
    ) -> Result<AdapterRef, String> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let cmd = Install {
            name: name.to_string(),
            path,
            adapter,
            reply,
        };
        if self.shared.is_dead() || self.tx.send(Cmd::Install(Box::new(cmd))).is_err() {
            return Err("the engine is not running".into());
        }
        rx.await
            .unwrap_or_else(|_| Err("the engine stopped before installing the adapter".into()))
    }

    /// Unloads adapter `name`: new requests for it fail at once, running ones finish with it,
    /// then its slot is freed. Returns how many requests still use it (`None`: no such adapter).
    pub fn unload(&self, name: &str) -> Option<usize> {
        self.shared.registry().unload(name)
    }

    /// From now on new requests get 503; running and queued ones continue.
    pub fn start_draining(&self) {
        self.shared.draining.store(true, Ordering::SeqCst);
    }

    /// Ends every queued and running request with a 503 error carrying `why`.
    pub fn abort_all(&self, why: &str) {
        let _ = self.tx.send(Cmd::AbortAll(why.to_string()));
    }

    /// Stops the engine thread after the current step (pending requests get errors).
    pub fn stop(&self) {
        let _ = self.tx.send(Cmd::Stop);
    }

    /// Test hook: makes the engine thread panic, as a bug in a kernel would.
    #[doc(hidden)]
    pub fn crash_for_test(&self) {
        let _ = self.tx.send(Cmd::Crash);
    }

    /// Resolves when the engine thread has ended (normally or by a panic).
    pub async fn dead(&self) {
        let mut rx = self.shared.dead.subscribe();
        let _ = rx.wait_for(|d| *d).await;
    }
}
