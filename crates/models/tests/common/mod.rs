//! Helpers shared by the end-to-end parity tests.
#![allow(dead_code)] // each test file uses a part of them

/// KL(softmax(p) || softmax(q)) in f64.
pub fn kl(p: &[f32], q: &[f32]) -> f64 {
    let lse = |v: &[f32]| {
        let m = v.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
    };
    let (lp, lq) = (lse(p), lse(q));
    p.iter()
        .zip(q)
        .map(|(&a, &b)| {
            let la = a as f64 - lp;
            la.exp() * (la - (b as f64 - lq))
        })
        .sum()
}

/// Index of the largest value (first on ties): the sampler's greedy rule.
pub fn argmax(row: &[f32]) -> usize {
    hf2q_models::sampler::argmax(row) as usize
}

/// A committed tiny checkpoint (`tests/fixtures/tiny/NAME`).
pub fn tiny(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tiny")
        .join(name)
}

/// Knobs of the benchmarks (`--ignored` tests), read from the environment here only, as the
/// binary reads its own: `HF2Q_BENCH_ROWS` (batch sizes, comma-separated), `HF2Q_BENCH_PROMPT`
/// (prompt tokens), `HF2Q_BENCH_STEPS` (timed steps), `HF2Q_BENCH_PROFILE` (`eager` or
/// `graphs`: the pass an attached profiler records). Unset or empty: `None`, the bench's own
/// default.
#[derive(Debug, Default)]
pub struct BenchKnobs {
    pub rows: Option<Vec<usize>>,
    pub prompt: Option<usize>,
    pub steps: Option<usize>,
    pub profile: Option<String>,
}

/// [`BenchKnobs`] from the environment (the harness's one read of it, as `gpu_with` reads the
/// device options).
pub fn bench_knobs() -> BenchKnobs {
    BenchKnobs::from_lookup(|k| std::env::var(k).ok())
}

impl BenchKnobs {
    /// The knobs from `get` (a variable's value, if set); a value that does not parse fails
    /// the bench, naming it.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> BenchKnobs {
        let var = |k: &str| get(k).filter(|v| !v.is_empty());
        let num = |k: &str, v: &str| -> usize {
            v.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{k}: '{v}' is not a count"))
        };
        BenchKnobs {
            rows: var("HF2Q_BENCH_ROWS")
                .map(|v| v.split(',').map(|r| num("HF2Q_BENCH_ROWS", r)).collect()),
            prompt: var("HF2Q_BENCH_PROMPT").map(|v| num("HF2Q_BENCH_PROMPT", &v)),
            steps: var("HF2Q_BENCH_STEPS").map(|v| num("HF2Q_BENCH_STEPS", &v)),
            profile: var("HF2Q_BENCH_PROFILE"),
        }
    }
}

/// The CUDA backend with the options the binary would open the device with in this
/// environment (the kernel cache, `--cuda-opt` settings as `HF2Q_CUDA_OPT`), or `None` (and
/// "skipped") without a device.
pub fn gpu() -> Option<std::sync::Arc<hf2q_cuda::backend::CudaBackend>> {
    gpu_with(|_| {})
}

/// [`gpu`] with the environment's options changed by `edit` first.
pub fn gpu_with(
    edit: impl FnOnce(&mut hf2q_cuda::CudaOptions),
) -> Option<std::sync::Arc<hf2q_cuda::backend::CudaBackend>> {
    let mut opts = hf2q_cuda::CudaOptions::from_environment(|k| std::env::var_os(k)).unwrap();
    edit(&mut opts);
    match hf2q_cuda::CudaDev::open(0, &opts) {
        Ok(Some(dev)) => Some(std::sync::Arc::new(
            hf2q_cuda::backend::CudaBackend::new(dev, hf2q_cuda::KvDtype::F16).unwrap(),
        )),
        Ok(None) => {
            eprintln!("skipped: no CUDA device");
            None
        }
        Err(e) => panic!("a CUDA device is present but does not work: {e}"),
    }
}

/// `n` token ids below `vocab`: a deterministic xorshift walk (the same ids on every run).
pub fn walk_ids(n: usize, vocab: usize) -> Vec<u32> {
    walk_ids_from(0x9E37_79B9, n, vocab)
}

/// [`walk_ids`] from the generator state `s` (nonzero): another fixed text per state.
pub fn walk_ids_from(mut s: u64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}
