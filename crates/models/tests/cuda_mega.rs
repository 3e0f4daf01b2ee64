//! The decode megakernel (`--cuda-opt decode=mega`) against the CPU reference and the per-op
//! graph, end to end: synthesized Q4_0 models at real shapes (Llama-3.2-1B; SmolLM2-135M, whose
//! heads do not fill a multiple of eight), teacher-forced over 100 positions. The gate: argmax
//! agreement >= 99/100 and mean KL <= 1e-4 against the CPU reference; the same logits bit for
//! bit over two runs (a missing wait shows as run-to-run differences); the step captured as a
//! handful of nodes (the kernel ran, not the fallback). A model the kernel does not take (biases)
//! decodes as with the graph. Without a GPU every test prints "skipped: no CUDA device" and
//! passes. Run with `--test-threads 1` (each test opens the device twice).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{argmax, gpu_with, kl, tiny, walk_ids};
use hf2q_cpu::MatmulPath;
use hf2q_cuda::backend::CudaBackend;
use hf2q_models::convert::NoProgress;
use hf2q_models::quantize::presets::{GgufRecipe, Preset};
use hf2q_models::synth::{self, SynthOptions, SynthShape};
use hf2q_models::Model;

/// Most nodes a megakernel step's graph holds: embedding, counter reset, the kernel, output
/// product, output copy (the per-op step of these models is over a hundred).
const MEGA_NODES: usize = 8;

/// The per-op backend and the megakernel backend, from this environment's options, or `None`
/// without a device.
fn backends() -> Option<(Arc<CudaBackend>, Arc<CudaBackend>)> {
    let graph = gpu_with(|o| o.decode_mega = false)?;
    Some((graph, gpu_with(|o| o.decode_mega = true)?))
}

/// A random-weight Q4_0 model of `shape` (as `hf2q synth --type q4_0`), written once per run.
fn synthesized(shape: &str) -> PathBuf {
    let out = std::env::temp_dir().join(format!("hf2q-mega-{shape}-q4_0.gguf"));
    if !out.is_file() {
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/tiny-qwen3-moe");
        let (tokenizer, _) = synth::tokenizer_metadata(&fixture).unwrap();
        let opts = SynthOptions {
            shape: SynthShape::by_name(shape).unwrap(),
            recipe: GgufRecipe {
                preset: Preset::Q4_0,
                pure: false,
            },
            seed: 5,
            tokenizer,
        };
        synth::synthesize(&opts, &out, &NoProgress).unwrap();
    }
    out
}

/// Teacher-forced decode logits of `toks` on `gpu` (prefill of the first token, then one
/// decode step per token), and the captured step's node count.
fn decode_rows(model: &mut Model, gpu: &Arc<CudaBackend>, toks: &[u32]) -> (Vec<Vec<f32>>, usize) {
    model.set_cuda(Some(gpu.clone())).unwrap();
    let mut s = model.session(toks.len() + 8);
    let mut rows = vec![s.prefill(&toks[..1]).unwrap()];
    for &t in &toks[1..] {
        rows.push(s.decode(t).unwrap());
    }
    let nodes = s.graph_nodes().unwrap_or(0);
    (rows, nodes)
}

/// Greedy decode tokens/s on `gpu` over 128 steps after 8 untimed ones (the token picked on the
/// device, as `hf2q bench`'s tg test; information, not a gate).
fn greedy_speed(model: &mut Model, gpu: &Arc<CudaBackend>) -> f64 {
    model.set_cuda(Some(gpu.clone())).unwrap();
    let mut s = model.session(256);
    let mut t = s.prefill(&[1]).map(|l| argmax(&l) as u32).unwrap();
    for _ in 0..8 {
        t = s.decode_greedy(t).unwrap();
    }
    let t0 = std::time::Instant::now();
    for _ in 0..128 {
        t = s.decode_greedy(t).unwrap();
    }
    128.0 / t0.elapsed().as_secs_f64()
}

/// (argmax agreements, mean KL) of `got` against `want`'s rows.
fn gate(want: &[Vec<f32>], got: &[Vec<f32>]) -> (usize, f64) {
    let mut agree = 0;
    let mut kl_sum = 0f64;
    for (i, (p, q)) in want.iter().zip(got).enumerate() {
        assert!(q.iter().all(|v| v.is_finite()), "non-finite logits at {i}");
        if argmax(p) == argmax(q) {
            agree += 1;
        }
        kl_sum += kl(p, q);
    }
    (agree, kl_sum / want.len() as f64)
}

fn check_shape(shape: &str) {
    let Some((graph, mega)) = backends() else {
        return;
    };
    let n = 100;
    let mut m = Model::load(&synthesized(shape)).unwrap();
    let toks = walk_ids(n, m.vocab_size().min(32000));
    m.set_cuda(None).unwrap();
    m.set_matmul_path(MatmulPath::Reference);
    let all = m.session(n).forward_all(&toks).unwrap();
    let want: Vec<Vec<f32>> = (0..n).map(|i| all.row(i).to_vec()).collect();

    let (by_graph, graph_nodes) = decode_rows(&mut m, &graph, &toks);
    let (by_mega, mega_nodes) = decode_rows(&mut m, &mega, &toks);
    let (again, _) = decode_rows(&mut m, &mega, &toks);
    let (ga, gk) = gate(&want, &by_graph);
    let (ma, mk) = gate(&want, &by_mega);
    let (_, gm) = gate(&by_graph, &by_mega);
    let diff = by_graph
        .iter()
        .flatten()
        .zip(by_mega.iter().flatten())
        .fold(0f32, |d, (a, b)| d.max((a - b).abs()));
    eprintln!(
        "{shape}: graph ({graph_nodes} nodes) vs CPU reference argmax {ga}/{n}, mean KL {gk:.2e}; \
         mega ({mega_nodes} nodes) argmax {ma}/{n}, mean KL {mk:.2e}; \
         mega vs graph mean KL {gm:.2e}, max |diff| {diff:.2e}"
    );
    assert!(
        mega_nodes > 0 && mega_nodes <= MEGA_NODES,
        "{shape}: the step was captured as {mega_nodes} nodes: the megakernel did not run"
    );
    let (gs, ms) = (greedy_speed(&mut m, &graph), greedy_speed(&mut m, &mega));
    eprintln!("{shape}: greedy decode, graph {gs:.0} tokens/s, mega {ms:.0} tokens/s");
    // Bit for bit: every block sums in a fixed order, whatever the timing.
    for (i, (a, b)) in by_mega.iter().zip(&again).enumerate() {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{shape}: step {i} differs between two runs"
        );
    }
    // The gate (random-weight models have near-flat logits, so a wrong cache slot or a
    // stale read costs far more than 1e-4; f32 sums in another order cost ~1e-7).
    assert!(ma >= 99, "{shape}: mega argmax {ma}/{n}");
    assert!(mk <= 1e-4, "{shape}: mega mean KL {mk}");
}

#[test]
fn mega_llama_1b_q4_0_meets_the_gate() {
    check_shape("llama-3.2-1b");
}

#[test]
fn mega_smollm2_135m_q4_0_meets_the_gate() {
    check_shape("smollm2-135m");
}

/// A model the kernel does not take (q/k/v biases) decodes through the per-op graph with
/// `decode=mega` on: the same logits as the graph backend, no error.
#[test]
fn mega_falls_back_where_it_does_not_apply() {
    let Some((graph, mega)) = backends() else {
        return;
    };
    let mut m = Model::load(&tiny("tiny-qwen2")).unwrap();
    let toks = walk_ids(12, m.vocab_size().min(32000));
    let (a, an) = decode_rows(&mut m, &graph, &toks);
    let (b, bn) = decode_rows(&mut m, &mega, &toks);
    eprintln!("tiny-qwen2: graph {an} nodes, with decode=mega {bn} nodes");
    assert_eq!(an, bn, "the fallback captured another step");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "tiny-qwen2: step {i} differs with decode=mega on"
        );
    }
}
