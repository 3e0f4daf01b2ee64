//! The one progress display of every long command (pull, quantize, convert, imatrix,
//! perplexity, train), on `indicatif`: a bar with position, rate and ETA redrawn in place on a
//! terminal; on a pipe or a file (a log, the Lab's job runner), plain lines at most every few
//! seconds and at the end, so logs stay readable. Always on stderr: stdout is the command's
//! own output (paths, JSON). With [`set_json`] (a command's `--json`), the same progress is
//! also printed on stdout as NDJSON (`{"event": "start" | "progress" | "finish", "label", ...}`,
//! progress lines at most every 250 ms), which the Lab's job runner turns into events.

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often a non-terminal progress line is written at most.
const LINE_EVERY: Duration = Duration::from_secs(5);

/// How often an NDJSON progress line is written at most.
const JSON_EVERY: Duration = Duration::from_millis(250);

static JSON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// NDJSON progress on stdout from now on (`--json`).
pub fn set_json(on: bool) {
    JSON.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether `--json` is on: human text then stays off stdout.
pub fn json_on() -> bool {
    JSON.load(std::sync::atomic::Ordering::Relaxed)
}

/// One NDJSON line on stdout, under `--json` only.
pub fn json_line(v: serde_json::Value) {
    if json_on() {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{v}");
        let _ = out.flush();
    }
}

/// What the position counts, for the display.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Plain counts ("12/30 chunks").
    Items(&'static str),
    /// Bytes, shown in MB.
    Bytes,
}

pub struct Progress {
    bar: Option<ProgressBar>,
    label: String,
    unit: Unit,
    total: std::sync::atomic::AtomicU64,
    start: Instant,
    /// Non-terminal: the last line's time and the current message.
    plain: Mutex<(Instant, u64, String)>,
    /// The last NDJSON progress line's time.
    json_at: Mutex<Option<Instant>>,
}

impl Progress {
    /// A progress display for `total` units of work (0: unknown).
    pub fn new(label: impl Into<String>, total: u64, unit: Unit) -> Progress {
        let label = label.into();
        let tty = std::io::stderr().is_terminal();
        let bar = tty.then(|| {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            let pos = match unit {
                Unit::Items(what) => format!("{{pos}}/{{len}} {what}"),
                Unit::Bytes => "{bytes}/{total_bytes}".to_string(),
            };
            let style = ProgressStyle::with_template(&format!(
                "{{prefix}} [{{bar:30}}] {pos} {{msg}} [{{elapsed_precise}}, ETA {{eta}}]"
            ))
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("#>-");
            b.set_style(style);
            b.set_prefix(label.clone());
            b.enable_steady_tick(Duration::from_millis(250));
            b
        });
        if !tty {
            eprintln!("{label}: {}", Self::amount(unit, total));
        }
        json_line(serde_json::json!({"event": "start", "label": label, "total": total}));
        Progress {
            bar,
            label,
            unit,
            total: std::sync::atomic::AtomicU64::new(total),
            start: Instant::now(),
            plain: Mutex::new((Instant::now(), 0, String::new())),
            json_at: Mutex::new(None),
        }
    }

    fn amount(unit: Unit, n: u64) -> String {
        match unit {
            Unit::Items(what) => format!("{n} {what}"),
            Unit::Bytes => format!("{:.1} MB", n as f64 / 1e6),
        }
    }

    fn total(&self) -> u64 {
        self.total.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Changes the amount of work (when it becomes known after the start).
    pub fn set_total(&self, total: u64) {
        self.total
            .store(total, std::sync::atomic::Ordering::Relaxed);
        if let Some(b) = &self.bar {
            b.set_length(total);
        }
    }

    /// Moves to `done` units with a short status message (e.g. "loss 1.23").
    pub fn set(&self, done: u64, msg: impl Into<String>) {
        let msg = msg.into();
        if JSON.load(std::sync::atomic::Ordering::Relaxed) {
            let mut at = self.json_at.lock().unwrap_or_else(|e| e.into_inner());
            if at.is_none_or(|t| t.elapsed() >= JSON_EVERY) || done >= self.total() {
                *at = Some(Instant::now());
                json_line(
                    serde_json::json!({"event": "progress", "label": self.label, "done": done, "total": self.total(), "message": msg}),
                );
            }
        }
        match &self.bar {
            Some(b) => {
                b.set_position(done);
                b.set_message(msg);
            }
            None => {
                let mut p = self.plain.lock().unwrap_or_else(|e| e.into_inner());
                p.1 = done;
                p.2 = msg;
                if p.0.elapsed() >= LINE_EVERY && done < self.total() {
                    p.0 = Instant::now();
                    self.line(done, &p.2);
                }
            }
        }
    }

    fn line(&self, done: u64, msg: &str) {
        let secs = self.start.elapsed().as_secs_f64();
        let total = self.total();
        let eta = if done > 0 && total > done {
            format!(", ETA {:.0} s", secs / done as f64 * (total - done) as f64)
        } else {
            String::new()
        };
        let of = match self.unit {
            Unit::Items(what) => format!("{done}/{total} {what}"),
            Unit::Bytes => format!("{:.1}/{:.1} MB", done as f64 / 1e6, total as f64 / 1e6),
        };
        eprintln!("{}: {of} {msg} ({secs:.1} s{eta})", self.label);
    }

    /// Prints a line above the bar (or as a line of its own).
    pub fn println(&self, text: impl AsRef<str>) {
        match &self.bar {
            Some(b) => b.println(text.as_ref()),
            None => eprintln!("{}", text.as_ref()),
        }
    }

    /// Ends the display with a summary line.
    pub fn finish(&self, summary: impl AsRef<str>) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
        json_line(
            serde_json::json!({"event": "finish", "label": self.label, "summary": summary.as_ref(),
            "seconds": self.start.elapsed().as_secs_f64()}),
        );
        eprintln!(
            "{}: {} ({:.1} s)",
            self.label,
            summary.as_ref(),
            self.start.elapsed().as_secs_f64()
        );
    }

    /// Clears the bar without a summary (an error follows).
    pub fn abandon(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
