//! Constrained decoding costs, printed as a table (not criterion: the targets are a mean and a
//! 99th percentile per token, which criterion does not report).
//!
//! 1. Mask time per token on a vocabulary (default: Llama 3's 128k tokens, from
//!    `HF2Q_TEST_TOKENIZERS_DIR/llama3`, as `scripts/fetch-tokenizers.sh` lays it out): for each
//!    schema of `tests/fixtures/constrained/schemas.json`, a seeded random walk through the
//!    grammar (each step: compute the mask, then commit one allowed token chosen at random, up
//!    to 200 tokens) times every mask computation; the first mask of each schema is reported
//!    apart (paid once per request, like the compile). Random tokens are a harder workload
//!    than a model's (long tokens inside strings, odd escapes).
//! 2. Decode speed with a schema active and without, on a model (`HF2Q_BENCH_MODEL`, e.g.
//!    SmolLM2's GGUF): greedy, 128 tokens, fast CPU kernels (or the GPU with
//!    `HF2Q_BENCH_DEVICE=cuda`: the mask then goes into the decode graph), after a warm-up run.
//!
//!     HF2Q_TEST_TOKENIZERS_DIR=... HF2Q_BENCH_MODEL=model.gguf \
//!         cargo bench -p hf2q-models --bench constrained

use std::path::{Path, PathBuf};
use std::time::Instant;

use hf2q_models::chat_template::{encode_chat, ChatMessage, ChatTemplate};
use hf2q_models::constraint::{ConstraintEnv, GrammarSpec};
use hf2q_models::generate::{generate_constrained, GenerateParams};
use hf2q_models::sampler::{Rng, SamplerConfig};
use hf2q_models::tokenizer::Tokenizer;
use hf2q_models::Model;
use serde_json::Value;

fn schemas() -> Vec<(String, Value)> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/constrained/schemas.json");
    let v: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v.into_iter()
        .map(|e| (e["name"].as_str().unwrap().to_string(), e["schema"].clone()))
        .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Replays the real replies of `instances.json` (Qwen2.5-Coder's constrained greedy outputs,
/// made by `scripts/goldens/constrained-instances.sh`), tokenized with `tok`: the mask of every
/// step is computed and timed, then the reply's next token committed (it must be allowed).
fn replay(tok: &Tokenizer, env: &ConstraintEnv, verbose: bool) -> Vec<f64> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/constrained/instances.json");
    let inst: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let by_name: std::collections::HashMap<String, Value> = schemas().into_iter().collect();
    let mut times = Vec::new();
    for i in inst {
        let name = i["name"].as_str().unwrap();
        let g = env
            .compile(&GrammarSpec::JsonSchema(by_name[name].clone()))
            .unwrap();
        let mut c = env.constraint(&g);
        let ids = tok
            .encode(i["text"].as_str().unwrap(), false, false)
            .unwrap();
        for (step, &id) in ids.iter().enumerate() {
            let t = Instant::now();
            let m = c.mask().unwrap().unwrap();
            let dt = t.elapsed().as_secs_f64();
            assert!(
                m[id as usize / 32] >> (id % 32) & 1 == 1,
                "{name}: token {step} not allowed"
            );
            if step > 0 {
                times.push(dt);
            }
            if dt > 5e-4 && verbose {
                let before = tok.decode(&ids[..step], false).unwrap_or_default();
                println!("slow mask: {name} {:.2} ms after {before:?}", dt * 1e3);
            }
            c.commit(id).unwrap();
        }
    }
    times
}

fn stats(label: &str, mut times: Vec<f64>) {
    times.sort_by(f64::total_cmp);
    let us = 1e6;
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    println!(
        "| {label} ({} masks) | mean {:.1} us | p50 {:.1} us | p99 {:.1} us | max {:.1} us |",
        times.len(),
        mean * us,
        percentile(&times, 0.5) * us,
        percentile(&times, 0.99) * us,
        times.last().copied().unwrap_or(0.0) * us
    );
}

fn mask_bench(dir: &Path, verbose: bool) {
    let tok = Tokenizer::from_hf_files(
        &dir.join("tokenizer.json"),
        Some(&dir.join("tokenizer_config.json")),
    )
    .unwrap();
    let t0 = Instant::now();
    let env = ConstraintEnv::new(&tok, tok.vocab_size()).unwrap();
    let setup = t0.elapsed().as_secs_f64();
    let mut rng = Rng::new(7);
    let mut times: Vec<f64> = Vec::new();
    let mut compile: Vec<f64> = Vec::new();
    // The first mask of each schema apart (MaskBench's "time to first mask"), as it is paid
    // once per request, with the compile.
    let mut first: Vec<f64> = Vec::new();
    let mut slow: Vec<(f64, String, usize)> = Vec::new();
    for (name, schema) in schemas() {
        let t = Instant::now();
        let g = env.compile(&GrammarSpec::JsonSchema(schema)).unwrap();
        let mut c = env.constraint(&g);
        compile.push(t.elapsed().as_secs_f64());
        for step in 0..200 {
            let t = Instant::now();
            let allowed: Vec<u32> = {
                let m = c.mask().unwrap().unwrap();
                let dt = t.elapsed().as_secs_f64();
                if step == 0 {
                    first.push(dt);
                } else {
                    times.push(dt);
                }
                if dt > 1e-3 {
                    slow.push((dt, name.clone(), step));
                }
                (0..tok.vocab_size() as u32)
                    .filter(|&i| m[i as usize / 32] >> (i % 32) & 1 == 1)
                    .collect()
            };
            let id = allowed[(rng.next_u64() % allowed.len() as u64) as usize];
            if tok.eog_ids().contains(&id) {
                break;
            }
            c.commit(id).unwrap();
        }
    }
    if verbose {
        for (dt, name, step) in &slow {
            println!("slow mask: {name} step {step}: {:.2} ms", dt * 1e3);
        }
    }
    compile.sort_by(f64::total_cmp);
    first.sort_by(f64::total_cmp);
    let v = tok.vocab_size();
    stats(
        &format!("mask per token, real replies, {v} tokens"),
        replay(&tok, &env, verbose),
    );
    stats(&format!("mask per token, random walks, {v} tokens"), times);
    println!(
        "| compile per schema ({}) | mean {:.2} ms | p50 {:.2} ms | max {:.2} ms | trie + slices once: {:.0} ms |",
        compile.len(),
        compile.iter().sum::<f64>() / compile.len() as f64 * 1e3,
        percentile(&compile, 0.5) * 1e3,
        compile.last().copied().unwrap_or(0.0) * 1e3,
        setup * 1e3
    );
    println!(
        "| first mask per schema | mean {:.2} ms | p50 {:.2} ms | max {:.2} ms | |",
        first.iter().sum::<f64>() / first.len() as f64 * 1e3,
        percentile(&first, 0.5) * 1e3,
        first.last().copied().unwrap_or(0.0) * 1e3,
    );
}

fn decode_bench(path: &Path, cuda: bool) {
    let mut model = Model::load(path).unwrap();
    model.set_matmul_path(hf2q_cpu::MatmulPath::Fast);
    if cuda {
        let dev = hf2q_cuda::CudaDev::open(
            0,
            &hf2q_cuda::CudaOptions::from_environment(|k| std::env::var_os(k)).unwrap(),
        )
        .expect("a working CUDA driver")
        .expect("a CUDA device");
        let be = hf2q_cuda::backend::CudaBackend::new(dev, hf2q_cuda::KvDtype::F16).unwrap();
        model.set_cuda(Some(std::sync::Arc::new(be))).unwrap();
    }
    model.warm_up().unwrap();
    let env = ConstraintEnv::new(model.tokenizer(), model.vocab_size()).unwrap();
    // Long enough that the grammar never ends within the 128 tokens.
    let schema = serde_json::json!({"type": "array", "minItems": 40, "items": {"type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                       "name": {"type": "string", "maxLength": 12}},
        "required": ["id", "name"], "additionalProperties": false}});
    let g = env
        .compile(&GrammarSpec::JsonSchema(schema.clone()))
        .unwrap();
    let tmpl = model
        .chat_template()
        .cloned()
        .unwrap_or_else(|| ChatTemplate::for_tokenizer(model.tokenizer()).unwrap());
    let ask = format!("List 40 people as JSON following this schema: {schema}");
    let prompt = encode_chat(
        model.tokenizer(),
        &tmpl,
        &[ChatMessage::new("user", ask)],
        true,
    )
    .unwrap();
    let params = GenerateParams {
        max_tokens: 128,
        sampler: SamplerConfig::greedy(),
        ignore_eos: true,
        ..Default::default()
    };
    let run = |constrained: bool| {
        let mut c = constrained.then(|| env.constraint(&g));
        let mut s = model.session(prompt.len() + 129);
        let st = generate_constrained(&mut s, &prompt, &params, c.as_mut(), &mut |_| true).unwrap();
        (st.completion_tokens, st.decode_tokens_per_sec())
    };
    for c in [false, true] {
        run(c);
    }
    let mut rates = [Vec::new(), Vec::new()];
    for _ in 0..3 {
        for (i, c) in [false, true].into_iter().enumerate() {
            let (n, r) = run(c);
            assert_eq!(n, 128);
            rates[i].push(r);
        }
    }
    let mean = |v: &Vec<f64>| v.iter().sum::<f64>() / v.len() as f64;
    let (free, with) = (mean(&rates[0]), mean(&rates[1]));
    println!(
        "| decode 128 tokens, {}, {} | unconstrained {free:.1} tok/s | with a schema {with:.1} tok/s | ratio {:.3} |",
        path.file_name().unwrap_or_default().to_string_lossy(),
        if cuda { "GPU" } else { "CPU" },
        with / free
    );
}

/// What the bench is pointed at, read from the environment once, in `main`.
struct BenchConfig {
    /// `HF2Q_TEST_TOKENIZERS_DIR`: the folder of `scripts/fetch-tokenizers.sh` (mask bench).
    tokenizers: Option<PathBuf>,
    /// `HF2Q_BENCH_MODEL`: a model file (decode bench).
    model: Option<PathBuf>,
    /// `HF2Q_BENCH_DEVICE=cuda`: decode on the GPU.
    cuda: bool,
    /// `HF2Q_BENCH_VERBOSE`: list the slow masks.
    verbose: bool,
}

impl BenchConfig {
    fn from_env() -> BenchConfig {
        let path = |k: &str| {
            std::env::var(k)
                .ok()
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        BenchConfig {
            tokenizers: path("HF2Q_TEST_TOKENIZERS_DIR"),
            model: path("HF2Q_BENCH_MODEL"),
            cuda: std::env::var("HF2Q_BENCH_DEVICE").as_deref() == Ok("cuda"),
            verbose: std::env::var("HF2Q_BENCH_VERBOSE").is_ok(),
        }
    }
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is taken.
    let cfg = BenchConfig::from_env();
    let threads = rayon::current_num_threads();
    println!("(rayon threads: {threads})");
    match &cfg.tokenizers {
        Some(d) => mask_bench(&d.join("llama3"), cfg.verbose),
        None => println!("mask benchmark skipped: HF2Q_TEST_TOKENIZERS_DIR is not set"),
    }
    match &cfg.model {
        // Forward passes start from a pool worker, as in the CLI.
        Some(p) => rayon::ThreadPoolBuilder::new()
            .build()
            .unwrap()
            .install(|| decode_bench(p, cfg.cuda)),
        None => println!("decode benchmark skipped: HF2Q_BENCH_MODEL is not set"),
    }
}
