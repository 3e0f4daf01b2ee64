//! `hf2q bench` and `hf2q synth` end to end on the committed tiny checkpoints (seconds): bench
//! prints llama-bench-style JSON lines and tables and refuses bad arguments cleanly; synth writes
//! GGUF files that `inspect`, `run` and `bench` load, deterministically per seed, with the
//! tokenizer padded to the shape's vocabulary. With `HF2Q_TEST_GGUF_PY` (a Python with
//! gguf==0.19.0, see `scripts/fixtures/gguf_py_summary.py`) gguf-py must read a synthesized file
//! as hf2q does.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{fails_with, fixture, hf2q, s, stderr, stdout};

use hf2q_tensor::io::gguf::GgufFile;
use serde_json::Value;

fn json_lines(o: &Output) -> Vec<Value> {
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn bench_json_lines_and_table() {
    let t = fixture("tiny-llama");
    let o = hf2q(&[
        "bench",
        s(&t),
        "-p",
        "8",
        "-n",
        "4",
        "-r",
        "2",
        "-t",
        "1,2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = json_lines(&o);
    assert_eq!(lines.len(), 4, "{}", stdout(&o));
    let tests: Vec<(&str, u64)> = lines
        .iter()
        .map(|v| (v["test"].as_str().unwrap(), v["threads"].as_u64().unwrap()))
        .collect();
    assert_eq!(tests, [("pp8", 1), ("tg4", 1), ("pp8", 2), ("tg4", 2)]);
    for v in &lines {
        let samples = v["samples"].as_array().unwrap();
        assert_eq!(samples.len(), 2, "{v}");
        assert!(samples.iter().all(|x| x.as_f64().unwrap() > 0.0), "{v}");
        assert!(v["tokens_per_second"].as_f64().unwrap() > 0.0, "{v}");
        assert!(v["stddev"].as_f64().unwrap() >= 0.0, "{v}");
        assert!(v["model_size"].as_u64().unwrap() > 0, "{v}");
        assert!(v["n_params"].as_u64().unwrap() > 0, "{v}");
        assert!(v["kv_cache_bytes"].as_u64().unwrap() > 0, "{v}");
        assert!(v["model"].as_str().unwrap().contains("tiny-llama"), "{v}");
        assert_eq!(v["backend"], "cpu");
        assert!(!v["path"].as_str().unwrap().is_empty());
        assert_eq!(v["kv_type"], "f16", "the default cache type");
        if cfg!(target_os = "linux") {
            assert!(v["peak_rss_bytes"].as_u64().unwrap() > 0, "{v}");
        }
    }
    // Path flags, `-p 0` skips pp, and the table.
    let o = hf2q(&[
        "bench",
        s(&t),
        "-p",
        "0",
        "-n",
        "2",
        "-r",
        "1",
        "-t",
        "1",
        "--reference",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.starts_with("| model"), "{out}");
    assert!(out.contains("tg2") && !out.contains("pp"), "{out}");
    assert!(out.contains("reference") && out.contains(" ± "), "{out}");
    assert!(stderr(&o).contains("peak RSS"), "{}", stderr(&o));
    let o = hf2q(&[
        "bench",
        s(&t),
        "-p",
        "8",
        "-n",
        "0",
        "-r",
        "1",
        "-t",
        "1",
        "--fast",
        "--kv-type",
        "f32",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let f32_lines = json_lines(&o);
    assert_eq!(f32_lines.len(), 1);
    let v = &f32_lines[0];
    assert_eq!(v["path"], "fast");
    assert_eq!(v["test"], "pp8");
    assert_eq!(v["kv_type"], "f32");
    // The same 8 positions as the f16 run's pp8 above, at twice the bytes.
    assert_eq!(
        v["kv_cache_bytes"].as_u64().unwrap(),
        2 * lines[0]["kv_cache_bytes"].as_u64().unwrap()
    );
    fails_with(&hf2q(&["bench", s(&t), "--kv-type", "q5_0"]), "--kv-type");
    // Every line says what a position of the cache costs.
    for v in lines.iter().chain(&f32_lines) {
        assert!(v["kv_bytes_per_token"].as_u64().unwrap() > 0, "{v}");
    }
    assert_eq!(
        f32_lines[0]["kv_bytes_per_token"].as_u64().unwrap(),
        2 * lines[0]["kv_bytes_per_token"].as_u64().unwrap()
    );
    // q8_0 needs head widths of whole 32-value blocks: tiny-llama's are 16.
    fails_with(
        &hf2q(&["bench", s(&t), "--kv-type", "q8_0", "-r", "1"]),
        "head width 16",
    );
}

/// `--kv-type q8_0` on a model with 32-wide heads: KV bytes per token (and, with key centring
/// off, the cache's bytes) are 34/64 of f16's, reported in the JSON lines and on stderr; key
/// centring (the default) holds more bytes (its f16 first positions and centres, reported as
/// `kv_fixed_bytes`), never fewer, at the same bytes per token.
#[test]
fn bench_reports_q8_0_kv_bytes() {
    let t = fixture("tiny-qwen3");
    let run = |kv: &str, extra: &[&str]| {
        let mut args = vec![
            "bench",
            s(&t),
            "-p",
            "8",
            "-n",
            "2",
            "-r",
            "1",
            "-t",
            "1",
            "--kv-type",
            kv,
            "--device",
            "cpu",
            "--json",
        ];
        args.extend_from_slice(extra);
        let o = hf2q(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        (json_lines(&o), stderr(&o))
    };
    let off = ["--kv-key-sinks", "0"];
    let (q8, err) = run("q8_0", &off);
    let (q8c, _) = run("q8_0", &[]);
    let (f16, _) = run("f16", &[]);
    let (q4, err4) = run("q4_0", &off);
    assert!(err4.contains("28.1 % of f16"), "{err4}");
    for (a, b) in q4.iter().zip(&f16) {
        assert_eq!(a["kv_type"], "q4_0");
        let per = |v: &Value| v["kv_bytes_per_token"].as_u64().unwrap();
        assert_eq!(per(a) * 64, per(b) * 18);
    }
    assert!(
        err.contains("KV cache q8_0") && err.contains("53.1 % of f16"),
        "{err}"
    );
    for (a, b) in q8.iter().zip(&f16) {
        assert_eq!(a["kv_type"], "q8_0");
        let per = |v: &Value, k: &str| v[k].as_u64().unwrap();
        assert_eq!(
            per(a, "kv_bytes_per_token") * 64,
            per(b, "kv_bytes_per_token") * 34
        );
        assert_eq!(per(a, "kv_cache_bytes") * 64, per(b, "kv_cache_bytes") * 34);
        assert!(a["tokens_per_second"].as_f64().unwrap() > 0.0);
    }
    for (c, a) in q8c.iter().zip(&q8) {
        let per = |v: &Value, k: &str| v[k].as_u64().unwrap();
        assert_eq!(per(c, "kv_bytes_per_token"), per(a, "kv_bytes_per_token"));
        assert!(per(c, "kv_cache_bytes") > per(a, "kv_cache_bytes"));
        // The difference is what `kv_fixed_bytes` reports: the centring's first positions and
        // centres, the same whatever the context.
        assert_eq!(per(a, "kv_fixed_bytes"), 0);
        assert_eq!(
            per(c, "kv_cache_bytes"),
            per(a, "kv_cache_bytes") + per(c, "kv_fixed_bytes")
        );
    }
    for v in &f16 {
        assert_eq!(v["kv_fixed_bytes"].as_u64(), Some(0), "{v}");
    }
}

#[test]
fn bench_at_a_context_depth() {
    let t = fixture("tiny-llama");
    let o = hf2q(&[
        "bench",
        s(&t),
        "-p",
        "4",
        "-n",
        "2",
        "-d",
        "0,40",
        "-r",
        "1",
        "-t",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = json_lines(&o);
    let tests: Vec<(&str, u64)> = lines
        .iter()
        .map(|v| (v["test"].as_str().unwrap(), v["n_depth"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        tests,
        [("pp4", 0), ("tg2", 0), ("pp4 @ d40", 40), ("tg2 @ d40", 40)]
    );
    // The cache holds the depth and the test's own tokens; the CPU reports no decode path.
    let kv = |i: usize| lines[i]["kv_cache_bytes"].as_u64().unwrap();
    assert_eq!(kv(2), kv(0) * 44 / 4, "{}", stdout(&o));
    assert!(lines.iter().all(|v| v["decode_path"].is_null()));
    let o = hf2q(&[
        "bench",
        s(&t),
        "-p",
        "0",
        "-n",
        "2",
        "-d",
        "16",
        "-r",
        "1",
        "-t",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("tg2 @ d16"), "{}", stdout(&o));
    // Past the model's 256 positions: refused before measuring, naming the test.
    fails_with(
        &hf2q(&["bench", s(&t), "-p", "8", "-n", "0", "-d", "250"]),
        "pp8 @ d250 needs 258 positions",
    );
}

#[test]
fn bench_refuses_bad_arguments() {
    let t = fixture("tiny-llama");
    let t = s(&t);
    fails_with(&hf2q(&["bench", t, "-r", "0"]), "--repetitions");
    fails_with(&hf2q(&["bench", t, "-t", "1,0"]), "--threads");
    fails_with(
        &hf2q(&["bench", t, "-p", "0", "-n", "0"]),
        "nothing to measure",
    );
    let options = hf2q_cuda::CudaOptions::from_environment(|k| std::env::var_os(k)).unwrap();
    if matches!(hf2q_cuda::CudaDev::open(0, &options), Ok(None)) {
        fails_with(
            &hf2q(&["bench", t, "--device", "cuda"]),
            "no NVIDIA GPU or CUDA driver found",
        );
    }
    fails_with(&hf2q(&["bench", "/nonexistent/model.gguf"]), "model.gguf");
    fails_with(&hf2q(&["bench", t, "-p", "x"]), "invalid value");
    // A bad CUDA switch is refused when the command line is read, naming the key.
    fails_with(
        &hf2q(&["bench", t, "--cuda-opt", "gemm=f16,p8=sometimes"]),
        "CUDA option p8: 'sometimes' is not off|auto|all",
    );
    fails_with(
        &hf2q(&["bench", t, "--cuda-opt", "warp=9"]),
        "unknown CUDA option 'warp'",
    );
    fails_with(
        &hf2q(&["bench", t, "--fast", "--reference"]),
        "cannot be used with",
    );
}

/// `inspect --json` of a model.
fn inspect(p: &Path) -> Value {
    let o = hf2q(&["inspect", s(p), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn synth_tiny_loads_runs_and_is_deterministic() {
    let d = tempfile::tempdir().unwrap();
    let tok = fixture("tiny-llama");
    let a = d.path().join("a.gguf");
    let o = hf2q(&[
        "synth",
        "--shape",
        "tiny",
        "--type",
        "q4_k_m",
        "--vocab-from",
        s(&tok),
        "--seed",
        "3",
        s(&a),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("bits per weight"), "{}", stderr(&o));
    let i = inspect(&a);
    assert_eq!(i["architecture"], "llama");
    assert_eq!(i["n_layers"], 2);
    assert_eq!(i["hidden_size"], 256);
    assert_eq!(i["vocab_size"], 259);
    assert_eq!(i["chat_template"], true);
    let types = i["tensor_types"].as_object().unwrap();
    assert!(
        types.contains_key("Q4_K") && types.contains_key("Q6_K"),
        "{i}"
    );
    let g = GgufFile::open(&a).unwrap();
    assert_eq!(g.get_u64("general.file_type"), Some(15));
    assert!(g.tensor("rope_freqs.weight").is_some());
    assert!(g.tensor("output.weight").is_some());

    // A forward: greedy generation of a few tokens.
    let o = hf2q(&[
        "run",
        s(&a),
        "--raw",
        "-p",
        "hello",
        "-n",
        "4",
        "--temp",
        "0",
        "--ignore-eos",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["completion_tokens"], 4, "{r}");

    // Same seed, same bytes; another seed, other bytes.
    let b = d.path().join("b.gguf");
    let c = d.path().join("c.gguf");
    for (out, seed) in [(&b, "3"), (&c, "4")] {
        let o = hf2q(&[
            "synth",
            "--shape",
            "tiny",
            "--type",
            "q4_k_m",
            "--vocab-from",
            s(&tok),
            "--seed",
            seed,
            s(out),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let read = |p: &Path| std::fs::read(p).unwrap();
    assert!(read(&a) == read(&b));
    assert!(read(&a) != read(&c));
    assert_eq!(read(&a).len(), read(&c).len());

    // A GGUF as the tokenizer source, another architecture and a float type.
    let q = d.path().join("qwen3.gguf");
    let o = hf2q(&[
        "synth",
        "--shape",
        "tiny-qwen3",
        "--type",
        "bf16",
        "--vocab-from",
        s(&a),
        s(&q),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let i = inspect(&q);
    assert_eq!(i["architecture"], "qwen3");
    assert_eq!(i["vocab_size"], 259);
    assert!(
        i["tensor_types"].as_object().unwrap().contains_key("BF16"),
        "{i}"
    );
    let o = hf2q(&[
        "bench",
        s(&q),
        "-p",
        "4",
        "-n",
        "2",
        "-r",
        "1",
        "-t",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(json_lines(&o).len(), 2);
}

#[test]
fn synth_pads_the_vocabulary_to_the_shape() {
    // SmolLM2-135M's width with one layer; the tiny tokenizer's 259 tokens padded to 49152.
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("smol.gguf");
    let o = hf2q(&[
        "synth",
        "--shape",
        "smollm2-135m",
        "--layers",
        "1",
        "-t",
        "q8_0",
        "--vocab-from",
        s(&fixture("tiny-llama")),
        s(&out),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let g = GgufFile::open(&out).unwrap();
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(tokens[259], "[PAD259]");
    let types = g.get_i32_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!((types.len(), types[49151]), (49152, 5));
    assert_eq!(g.get_u64("llama.vocab_size"), Some(49152));
    assert_eq!(g.get_u64("llama.block_count"), Some(1));
    assert_eq!(g.get_u64("llama.embedding_length"), Some(576));
    assert_eq!(g.get_u64("llama.attention.head_count_kv"), Some(3));
    // Tied embeddings: no output.weight; no Llama 3 RoPE scaling for SmolLM2.
    assert!(g.tensor("output.weight").is_none());
    assert!(g.tensor("rope_freqs.weight").is_none());
    let o = hf2q(&[
        "bench",
        s(&out),
        "-p",
        "4",
        "-n",
        "2",
        "-r",
        "1",
        "-t",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        json_lines(&o)[0]["n_params"],
        49152 * 576 + 576 + 4 * 576 * 1536 + 2 * 576
    );
}

#[test]
fn synth_refuses_bad_arguments() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("x.gguf");
    let tok = fixture("tiny-llama");
    let run = |shape: &str, ty: &str, tok: &str| {
        hf2q(&[
            "synth",
            "--shape",
            shape,
            "--type",
            ty,
            "--vocab-from",
            tok,
            s(&out),
        ])
    };
    fails_with(&run("llama-9b", "q4_0", s(&tok)), "unknown --shape");
    fails_with(&run("tiny", "q7_0", s(&tok)), "unknown --type");
    fails_with(
        &run("tiny", "q4_0", "/nonexistent/tok.gguf"),
        "no such file",
    );
    // A file that is not GGUF.
    let junk = d.path().join("junk.gguf");
    std::fs::write(&junk, b"not a gguf file").unwrap();
    fails_with(&run("tiny", "q4_0", s(&junk)), "tokenizer");
    std::fs::remove_file(&junk).unwrap();
    fails_with(
        &hf2q(&[
            "synth",
            "--shape",
            "tiny",
            "--type",
            "q4_0",
            "--vocab-from",
            s(&tok),
            "--layers",
            "0",
            s(&out),
        ]),
        "--layers",
    );
    // Nothing was left behind, not even a temporary file.
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
}

#[test]
fn synth_output_reads_the_same_in_gguf_py() {
    let py = match std::env::var("HF2Q_TEST_GGUF_PY") {
        Ok(p) if !p.is_empty() => p,
        _ => {
            eprintln!("skipped: HF2Q_TEST_GGUF_PY is not set");
            return;
        }
    };
    let d = tempfile::tempdir().unwrap();
    for (shape, ty) in [("tiny", "q4_k_m"), ("tiny-qwen3", "q4_0"), ("tiny", "f16")] {
        let out = d.path().join(format!("{shape}-{ty}.gguf"));
        let o = hf2q(&[
            "synth",
            "--shape",
            shape,
            "--type",
            ty,
            "--vocab-from",
            s(&fixture("tiny-llama")),
            s(&out),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/fixtures/gguf_py_summary.py");
        let o = Command::new(&py).arg(&script).arg(&out).output().unwrap();
        assert!(o.status.success(), "gguf-py: {}", stderr(&o));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        let g = GgufFile::open(&out).unwrap();
        assert_eq!(v["metadata"].as_object().unwrap().len(), g.metadata.len());
        let ts = v["tensors"].as_array().unwrap();
        assert_eq!(ts.len(), g.tensors.len());
        for (p, t) in ts.iter().zip(&g.tensors) {
            assert_eq!(p["name"], t.name.as_str());
            assert_eq!(p["type"], t.ty.name(), "{}", t.name);
            let dims: Vec<u64> = p["dims"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            assert_eq!(dims, t.dims, "{}", t.name);
            let mut x = vec![0f32; t.numel() as usize];
            hf2q_tensor::quant::dequantize(t.ty, g.tensor_data(t).unwrap().as_slice(), &mut x)
                .unwrap();
            let head: Vec<f32> = p["head"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            assert_eq!(head, x[..head.len()], "{}: first values", t.name);
        }
        eprintln!("{}: gguf-py agrees", out.display());
    }
}
