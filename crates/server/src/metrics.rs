//! Server metrics and their Prometheus text exposition (format 0.0.4).
//!
//! Counters are plain atomics updated by the engine thread and the HTTP handlers; histograms
//! (time to first token, inter-token latency) keep fixed buckets behind a mutex that is held for
//! a few nanoseconds. Gauges that describe the engine's state (queue depth, running sequences,
//! KV use) live in [`crate::engine::Shared`] and are read when `/metrics` is rendered.
//!
//! What it is not: a general metrics library. The names follow Prometheus conventions
//! (`_total` counters, base units in seconds and bytes) under the `hf2q_` prefix.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Latency buckets in seconds, from one fast CPU step to a long queue wait.
const BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
];

/// Sequences in one forward step, from one to a full GPU batch.
const BATCH_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0, 256.0,
];

/// A cumulative histogram over fixed upper bounds ([`BUCKETS`], seconds, by default).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistInner>,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram::with_bounds(BUCKETS)
    }
}

#[derive(Debug, Default)]
struct HistInner {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// A histogram over these upper bounds (ascending).
    pub fn with_bounds(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            inner: Mutex::new(HistInner::default()),
        }
    }

    pub fn observe(&self, secs: f64) {
        let mut h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if h.counts.is_empty() {
            h.counts = vec![0; self.bounds.len()];
        }
        for (i, &b) in self.bounds.iter().enumerate() {
            if secs <= b {
                h.counts[i] += 1;
            }
        }
        h.sum += secs;
        h.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in self.bounds.iter().enumerate() {
            let c = h.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(out, "{name}_sum {}", h.sum);
        let _ = writeln!(out, "{name}_count {}", h.count);
    }
}

/// Generated tokens per second over a sliding window (what a dashboard wants as "tokens/s").
#[derive(Debug)]
pub struct RateMeter {
    window: Duration,
    /// (time, tokens generated in the step that ended then)
    samples: VecDeque<(Instant, u64)>,
}

impl RateMeter {
    pub fn new(window: Duration) -> RateMeter {
        RateMeter {
            window,
            samples: VecDeque::new(),
        }
    }
    pub fn add(&mut self, now: Instant, tokens: u64) {
        self.samples.push_back((now, tokens));
        self.trim(now);
    }
    fn trim(&mut self, now: Instant) {
        while self
            .samples
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > self.window)
        {
            self.samples.pop_front();
        }
    }
    /// Tokens per second over the window ending at `now`.
    pub fn rate(&mut self, now: Instant) -> f64 {
        self.trim(now);
        let n: u64 = self.samples.iter().map(|s| s.1).sum();
        n as f64 / self.window.as_secs_f64()
    }
}

/// Every counter and histogram of the server.
#[derive(Debug)]
pub struct Metrics {
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Admitted requests looked up in the prefix cache, those that reused a cached prefix, and
    /// the prompt tokens that were therefore not prefilled.
    pub prefix_cache_queries: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    pub prompt_tokens_cached: AtomicU64,
    /// Forward steps run by the engine and tokens fed through them (batch size = ratio).
    pub steps: AtomicU64,
    pub step_tokens: AtomicU64,
    /// Running sequences preempted because a step of the paged KV cache could not get its
    /// blocks (their blocks freed; recomputed when readmitted).
    pub preemptions: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    /// Wall time of each forward step (the batch's forward and its token picks).
    pub step_seconds: Histogram,
    /// Sequences in each forward step.
    pub batch_size: Histogram,
    pub rate: Mutex<RateMeter>,
    /// (route, HTTP status) -> count.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Why sequences ended: "stop", "length", "cancelled", "timeout", "error", "rejected".
    finished: Mutex<BTreeMap<&'static str, u64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            prompt_tokens_cached: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            step_tokens: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            ttft: Histogram::default(),
            itl: Histogram::default(),
            step_seconds: Histogram::default(),
            batch_size: Histogram::with_bounds(BATCH_BUCKETS),
            rate: Mutex::new(RateMeter::new(Duration::from_secs(10))),
            requests: Mutex::new(BTreeMap::new()),
            finished: Mutex::new(BTreeMap::new()),
        }
    }
}

/// The engine-side gauges, sampled when `/metrics` is rendered.
#[derive(Clone, Copy, Debug, Default)]
pub struct Gauges {
    pub queued: usize,
    pub running: usize,
    pub kv_reserved_bytes: u64,
    pub kv_used_bytes: u64,
    pub kv_capacity_bytes: u64,
    /// KV blocks of [`crate::engine::BLOCK_TOKENS`] positions: reserved by admitted sequences
    /// (or held by the prefix cache; with `--kv-paged`, held by running sequences' block
    /// tables), and all of them (the `--kv-mem` budget).
    pub kv_blocks_used: u64,
    pub kv_blocks_total: u64,
    /// KV memory held by the prefix cache (evicted when admission needs it).
    pub prefix_cache_bytes: u64,
    pub prefix_cache_entries: usize,
    pub up: bool,
}

impl Metrics {
    pub fn count_request(&self, route: &str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((route.to_string(), status)).or_default() += 1;
    }
    pub fn count_finished(&self, why: &'static str) {
        let mut m = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(why).or_default() += 1;
    }
    pub fn finished(&self, why: &str) -> u64 {
        let m = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        m.get(why).copied().unwrap_or(0)
    }

    /// The Prometheus text page.
    pub fn render(&self, g: &Gauges) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        {
            let m = self.requests.lock().unwrap_or_else(|e| e.into_inner());
            let _ = writeln!(
                out,
                "# HELP hf2q_requests_total HTTP requests by route and status."
            );
            let _ = writeln!(out, "# TYPE hf2q_requests_total counter");
            for ((route, status), n) in m.iter() {
                let _ = writeln!(
                    out,
                    "hf2q_requests_total{{route=\"{}\",status=\"{status}\"}} {n}",
                    escape(route)
                );
            }
        }
        {
            let m = self.finished.lock().unwrap_or_else(|e| e.into_inner());
            let _ = writeln!(
                out,
                "# HELP hf2q_sequences_finished_total Generated sequences by how they ended."
            );
            let _ = writeln!(out, "# TYPE hf2q_sequences_finished_total counter");
            for (why, n) in m.iter() {
                let _ = writeln!(out, "hf2q_sequences_finished_total{{reason=\"{why}\"}} {n}");
            }
        }
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut out,
            "hf2q_prompt_tokens_total",
            "Prompt tokens of admitted requests (cached ones included).",
            ld(&self.prompt_tokens),
        );
        counter(
            &mut out,
            "hf2q_prompt_tokens_cached_total",
            "Prompt tokens whose KV came from the prefix cache instead of being prefilled.",
            ld(&self.prompt_tokens_cached),
        );
        counter(
            &mut out,
            "hf2q_prefix_cache_queries_total",
            "Admitted requests looked up in the prefix cache.",
            ld(&self.prefix_cache_queries),
        );
        counter(
            &mut out,
            "hf2q_prefix_cache_hits_total",
            "Admitted requests that reused a cached prompt prefix.",
            ld(&self.prefix_cache_hits),
        );
        counter(
            &mut out,
            "hf2q_generation_tokens_total",
            "Tokens generated.",
            ld(&self.completion_tokens),
        );
        counter(
            &mut out,
            "hf2q_engine_steps_total",
            "Batched forward steps run.",
            ld(&self.steps),
        );
        counter(
            &mut out,
            "hf2q_engine_step_tokens_total",
            "Tokens fed through forward steps.",
            ld(&self.step_tokens),
        );
        counter(
            &mut out,
            "hf2q_preemptions_total",
            "Running sequences preempted for lack of KV blocks (--kv-paged; recomputed when readmitted).",
            ld(&self.preemptions),
        );
        gauge(
            &mut out,
            "hf2q_up",
            "1 while the engine thread is alive.",
            if g.up { 1.0 } else { 0.0 },
        );
        gauge(
            &mut out,
            "hf2q_queue_depth",
            "Requests waiting for a slot.",
            g.queued as f64,
        );
        gauge(
            &mut out,
            "hf2q_running_sequences",
            "Sequences in the running batch.",
            g.running as f64,
        );
        gauge(
            &mut out,
            "hf2q_kv_reserved_bytes",
            "KV cache memory reserved by admitted sequences.",
            g.kv_reserved_bytes as f64,
        );
        gauge(
            &mut out,
            "hf2q_kv_used_bytes",
            "KV cache memory allocated by running sequences.",
            g.kv_used_bytes as f64,
        );
        gauge(
            &mut out,
            "hf2q_kv_capacity_bytes",
            "KV cache memory cap (--kv-mem).",
            g.kv_capacity_bytes as f64,
        );
        gauge(
            &mut out,
            "hf2q_kv_blocks_used",
            "KV blocks reserved by admitted sequences (--kv-paged: held by their block tables) or held by cached prefixes.",
            g.kv_blocks_used as f64,
        );
        gauge(
            &mut out,
            "hf2q_kv_blocks_free",
            "KV blocks free for admission.",
            g.kv_blocks_total.saturating_sub(g.kv_blocks_used) as f64,
        );
        gauge(
            &mut out,
            "hf2q_prefix_cache_bytes",
            "KV cache memory held by cached prefixes of finished requests (evictable).",
            g.prefix_cache_bytes as f64,
        );
        gauge(
            &mut out,
            "hf2q_prefix_cache_entries",
            "Finished requests' KV caches kept for prefix reuse.",
            g.prefix_cache_entries as f64,
        );
        let rate = self
            .rate
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .rate(Instant::now());
        gauge(
            &mut out,
            "hf2q_generation_tokens_per_second",
            "Tokens generated per second over the last 10 s.",
            rate,
        );
        self.ttft.render(
            &mut out,
            "hf2q_time_to_first_token_seconds",
            "From arrival to the first generated token.",
        );
        self.itl.render(
            &mut out,
            "hf2q_inter_token_latency_seconds",
            "Between consecutive generated tokens of a sequence.",
        );
        self.step_seconds.render(
            &mut out,
            "hf2q_engine_step_seconds",
            "Wall time of a forward step (the batch's forward and its token picks).",
        );
        self.batch_size.render(
            &mut out,
            "hf2q_engine_batch_size",
            "Sequences in a forward step.",
        );
        out
    }
}

/// Escapes a label value (backslash, quote, newline).
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let h = Histogram::default();
        h.observe(0.003);
        h.observe(0.3);
        let mut s = String::new();
        h.render(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"0.005\"} 1"), "{s}");
        assert!(s.contains("x_bucket{le=\"0.5\"} 2"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 2"), "{s}");
        assert!(s.contains("x_count 2"), "{s}");
    }

    #[test]
    fn rate_meter_forgets_old_samples() {
        let mut r = RateMeter::new(Duration::from_secs(10));
        let t0 = Instant::now();
        r.add(t0, 50);
        r.add(t0 + Duration::from_secs(5), 50);
        assert!((r.rate(t0 + Duration::from_secs(6)) - 10.0).abs() < 1e-9);
        assert!((r.rate(t0 + Duration::from_secs(12)) - 5.0).abs() < 1e-9);
    }

    #[test]
    fn render_has_every_family() {
        let m = Metrics::default();
        m.count_request("/v1/models", 200);
        m.count_finished("stop");
        m.batch_size.observe(12.0);
        m.step_seconds.observe(0.004);
        let s = m.render(&Gauges {
            queued: 3,
            up: true,
            kv_blocks_used: 5,
            kv_blocks_total: 64,
            ..Default::default()
        });
        for name in [
            "hf2q_requests_total{route=\"/v1/models\",status=\"200\"} 1",
            "hf2q_sequences_finished_total{reason=\"stop\"} 1",
            "hf2q_queue_depth 3",
            "hf2q_up 1",
            "hf2q_time_to_first_token_seconds_count 0",
            "hf2q_prefix_cache_hits_total 0",
            "hf2q_prompt_tokens_cached_total 0",
            "hf2q_prefix_cache_bytes 0",
            "hf2q_preemptions_total 0",
            "hf2q_kv_blocks_used 5",
            "hf2q_kv_blocks_free 59",
            "hf2q_engine_step_seconds_bucket{le=\"0.005\"} 1",
            // Batch sizes bucket by sequences: 12 is in 16's bucket, not in 8's.
            "hf2q_engine_batch_size_bucket{le=\"8\"} 0",
            "hf2q_engine_batch_size_bucket{le=\"16\"} 1",
        ] {
            assert!(s.contains(name), "{name} missing in\n{s}");
        }
    }
}
