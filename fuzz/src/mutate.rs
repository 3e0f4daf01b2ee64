//! An in-process mutation fuzzer: no instrumentation, no coverage feedback, so weaker than AFL++
//! per execution, but it builds with the ordinary test profile and runs anywhere. CI runs it for a
//! short budget per target on the committed corpus; `hf2q-fuzz run` runs it by hand.
//!
//! Each round takes a corpus input, applies 1-8 of AFL's havoc mutations (bit flips, interesting
//! 8/16/32/64-bit values, arithmetic, block deletion, duplication, insertion, overwrite, splicing
//! with another input) and runs the target. A panic is caught, its input written to the findings
//! folder and reported; an input that runs longer than the hang limit is reported the same way by
//! a watchdog (the process then aborts, as a hang cannot be unwound).
//!
//! Not here: minimisation (`afl-tmin` does it for AFL's crashes; ours are small to begin with).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::Target;

/// The trainer's seeded SplitMix64 stream: fast, and the same mutations for the same seed.
pub use hf2q_train::batch::SplitMix as Rng;

const INTERESTING_8: [u8; 9] = [0, 1, 0x7f, 0x80, 0xff, 16, 32, 64, 100];
const INTERESTING_32: [u32; 10] = [
    0,
    1,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x0000_ffff,
    0x0001_0000,
    1024,
    4096,
    65535,
];

/// Inputs never grow past this (AFL's default maximum is 1 MB; ours are smaller).
pub const MAX_INPUT: usize = 1 << 20;

/// One havoc mutation of `data`; `other` is another corpus input for splicing.
pub fn mutate_once(data: &mut Vec<u8>, other: &[u8], rng: &mut Rng) {
    if data.is_empty() {
        data.push(rng.next_u64() as u8);
        return;
    }
    let len = data.len();
    match rng.below(12) {
        0 => {
            let bit = rng.below(len * 8);
            data[bit / 8] ^= 1 << (bit % 8);
        }
        1 => {
            let i = rng.below(len);
            data[i] = INTERESTING_8[rng.below(INTERESTING_8.len())];
        }
        2 | 3 => {
            // A 16/32/64-bit field set to an interesting value (little endian, as GGUF and
            // safetensors lengths are).
            let width = [2usize, 4, 8][rng.below(3)];
            if len >= width {
                let i = rng.below(len - width + 1);
                let v = INTERESTING_32[rng.below(INTERESTING_32.len())] as u64;
                let v = if width == 8 && rng.below(2) == 0 {
                    u64::MAX - v
                } else {
                    v
                };
                data[i..i + width].copy_from_slice(&v.to_le_bytes()[..width]);
            }
        }
        4 => {
            let i = rng.below(len);
            let d = (rng.below(35) as u8).wrapping_sub(17);
            data[i] = data[i].wrapping_add(d);
        }
        5 => {
            let i = rng.below(len);
            data[i] = rng.next_u64() as u8;
        }
        6 | 7 => {
            // Delete a block.
            let n = 1 + rng.below(len.min(64));
            let i = rng.below(len - n + 1);
            data.drain(i..i + n);
        }
        8 => {
            // Duplicate a block at another place.
            let n = 1 + rng.below(len.min(64));
            let from = rng.below(len - n + 1);
            let to = rng.below(len + 1);
            let block: Vec<u8> = data[from..from + n].to_vec();
            data.splice(to..to, block);
        }
        9 => {
            // Insert random bytes or a run of one byte.
            let n = 1 + rng.below(16);
            let to = rng.below(len + 1);
            let b = rng.next_u64() as u8;
            let block: Vec<u8> = if rng.below(2) == 0 {
                vec![b; n]
            } else {
                (0..n).map(|_| rng.next_u64() as u8).collect()
            };
            data.splice(to..to, block);
        }
        10 => {
            // Overwrite with a block of another input.
            if !other.is_empty() {
                let n = 1 + rng.below(other.len().min(64));
                let from = rng.below(other.len() - n + 1);
                let to = rng.below(len);
                let end = (to + n).min(len);
                data[to..end].copy_from_slice(&other[from..from + (end - to)]);
            }
        }
        _ => {
            // Splice: the head of this input, the tail of the other.
            if other.len() > 1 {
                let cut = rng.below(len);
                let from = rng.below(other.len());
                data.truncate(cut);
                data.extend_from_slice(&other[from..]);
            }
        }
    }
    data.truncate(MAX_INPUT);
}

/// The files of a corpus folder, sorted by name (missing folder: none).
pub fn read_corpus(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
        .into_iter()
        .filter_map(|p| std::fs::read(&p).ok().map(|b| (p, b)))
        .collect()
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    pub executions: u64,
    pub elapsed: Duration,
    /// Findings written (panics), with their files.
    pub findings: Vec<PathBuf>,
    /// The slowest single input and its time.
    pub slowest: Duration,
}

/// Settings of [`run`].
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub budget: Duration,
    pub seed: u64,
    /// Where panicking inputs are written (`TARGET-N.bin`).
    pub findings_dir: PathBuf,
    /// An input running longer than this is a hang: written, reported, then the process aborts.
    pub hang_limit: Duration,
    /// Stop at the first finding.
    pub stop_at_first: bool,
}

/// Replays every input of `corpus` once, then mutates for `opts.budget`.
pub fn run(target: Target, corpus: &[Vec<u8>], opts: &RunOptions) -> RunStats {
    std::fs::create_dir_all(&opts.findings_dir).expect("the findings folder");
    let mut stats = RunStats::default();
    let started = Instant::now();
    let watchdog = Watchdog::start(target, opts.findings_dir.clone(), opts.hang_limit);
    let mut rng = Rng(opts.seed);
    let seeds: Vec<Vec<u8>> = if corpus.is_empty() {
        vec![Vec::new()]
    } else {
        corpus.to_vec()
    };
    let mut round = 0u64;
    loop {
        let input = if (round as usize) < seeds.len() {
            seeds[round as usize].clone()
        } else {
            if started.elapsed() >= opts.budget {
                break;
            }
            let mut d = seeds[rng.below(seeds.len())].clone();
            let other = &seeds[rng.below(seeds.len())];
            for _ in 0..1 + rng.below(8) {
                mutate_once(&mut d, other, &mut rng);
            }
            d
        };
        round += 1;
        let t0 = Instant::now();
        watchdog.arm(&input);
        let res = std::panic::catch_unwind(|| target.run(&input));
        watchdog.disarm();
        let dt = t0.elapsed();
        stats.slowest = stats.slowest.max(dt);
        stats.executions += 1;
        if res.is_err() {
            let p =
                opts.findings_dir
                    .join(format!("{}-{}.bin", target.name(), stats.findings.len()));
            std::fs::write(&p, &input).expect("writing a finding");
            stats.findings.push(p);
            if opts.stop_at_first {
                break;
            }
        }
    }
    stats.elapsed = started.elapsed();
    stats
}

/// Aborts the process when one input runs past the limit, after writing it out.
struct Watchdog {
    state: Arc<Mutex<Option<(Instant, Vec<u8>)>>>,
    stop: Arc<AtomicBool>,
}

impl Watchdog {
    fn start(target: Target, dir: PathBuf, limit: Duration) -> Watchdog {
        let state: Arc<Mutex<Option<(Instant, Vec<u8>)>>> = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (state.clone(), stop.clone());
        std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(100));
                let guard = s.lock().unwrap_or_else(|e| e.into_inner());
                if let Some((t0, input)) = guard.as_ref() {
                    if t0.elapsed() > limit {
                        let p = dir.join(format!("{}-hang.bin", target.name()));
                        let _ = std::fs::write(&p, input);
                        eprintln!(
                            "hf2q-fuzz: {}: an input ran past {limit:?} (a hang); written to {}",
                            target.name(),
                            p.display()
                        );
                        std::process::abort();
                    }
                }
            }
        });
        Watchdog { state, stop }
    }
    fn arm(&self, input: &[u8]) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Instant::now(), input.to_vec()));
    }
    fn disarm(&self) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_are_deterministic_per_seed_and_bounded() {
        let base = b"GGUF\x03\x00\x00\x00 some bytes to mutate".to_vec();
        let go = |seed| {
            let mut rng = Rng(seed);
            let mut d = base.clone();
            for _ in 0..500 {
                mutate_once(&mut d, b"other input", &mut rng);
            }
            d
        };
        assert_eq!(go(7), go(7));
        assert_ne!(go(7), go(8));
        assert!(go(7).len() <= MAX_INPUT);
    }
}
