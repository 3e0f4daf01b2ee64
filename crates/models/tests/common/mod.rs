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
    let mut s = 0x9E37_79B9u64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}
