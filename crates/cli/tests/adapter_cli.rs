//! `hf2q fuse` and `hf2q convert` on adapters, as a user runs them, on the committed tiny Llama
//! and PEFT's own trained adapter for it (it moves the logits by ~1.45, so greedy text with and
//! without it differs):
//! - a fused model (F32 GGUF, the base's own HF folder) generates what base + `--adapter` does;
//! - PEFT -> llama.cpp LoRA GGUF, PEFT -> mlx-lm folder and both back to PEFT give adapters that
//!   `run --adapter` applies to the same text;
//! - bad arguments (a `--to` or `--type` that does not fit, a missing `--base`, a model where an
//!   adapter is wanted, an adapter of another model) fail with a message naming the problem,
//!   no panic and no output left behind;
//! - `--help` explains both commands.

mod common;

use std::path::{Path, PathBuf};

use common::{fails_with, hf2q, s, stderr, stdout, tiny};

/// PEFT's trained adapter on the tiny Llama.
fn adapter() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../train/tests/fixtures/peft/tiny-llama/peft_trained")
}

/// 24 greedy tokens of `model` (with `adapter`) on a fixed prompt, on the reference matmul path.
fn greedy(model: &Path, adapter: Option<&Path>) -> String {
    let mut args = vec![
        "run",
        s(model),
        "--raw",
        "--temp",
        "0",
        "-n",
        "24",
        "--ignore-eos",
        "--matmul",
        "reference",
        "--device",
        "cpu",
        "-p",
        "hello world",
    ];
    if let Some(a) = adapter {
        args.extend(["--adapter", s(a)]);
    }
    let o = hf2q(&args);
    assert!(o.status.success(), "hf2q {args:?}: {}", stderr(&o));
    stdout(&o)
}

#[test]
fn fused_models_generate_what_base_plus_adapter_does() {
    let d = tempfile::tempdir().unwrap();
    let want = greedy(&tiny(), Some(&adapter()));
    assert_ne!(
        want,
        greedy(&tiny(), None),
        "the adapter does not change the greedy text"
    );

    let gguf = d.path().join("fused.gguf");
    let o = hf2q(&[
        "fuse",
        s(&tiny()),
        s(&adapter()),
        s(&gguf),
        "--to",
        "gguf",
        "--type",
        "F32",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("modules, rank"), "{}", stderr(&o));
    assert_eq!(greedy(&gguf, None), want, "fused F32 GGUF");

    // Without --to and --type: the base's own format (an HF folder) and float dtype.
    let hf = d.path().join("fused-hf");
    let o = hf2q(&["fuse", s(&tiny()), s(&adapter()), s(&hf)]);
    assert!(
        o.status.success() && hf.join("config.json").is_file(),
        "{}",
        stderr(&o)
    );
    assert_eq!(greedy(&hf, None), want, "fused HF folder");

    // Fused and quantized, with the report card against the unfused base + adapter.
    let text = d.path().join("eval.txt");
    let line = "The quick brown fox jumps over the lazy dog while the cat sleeps by the door. ";
    std::fs::write(&text, line.repeat(40)).unwrap();
    let q8 = d.path().join("fused-q8.gguf");
    let o = hf2q(&[
        "fuse",
        s(&tiny()),
        s(&adapter()),
        s(&q8),
        "--to",
        "gguf",
        "--type",
        "Q8_0",
        "--eval",
        s(&text),
        "--eval-ctx",
        "128",
        "--eval-chunks",
        "4",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let card = stdout(&o);
    assert!(card.contains("report card"), "{card}");
    let kl: f64 = card
        .lines()
        .find_map(|l| l.trim().strip_prefix("KL vs input"))
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no KL in:\n{card}"));
    // The same model against the plain base: the adapter's own KL, which the card must not hold.
    let o = hf2q(&[
        "perplexity",
        s(&q8),
        "-f",
        s(&text),
        "-c",
        "128",
        "--chunks",
        "4",
        "--kl-base",
        s(&tiny()),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // `--json` prints NDJSON: progress lines, then the result.
    let v: serde_json::Value = stdout(&o)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "result")
        .unwrap_or_else(|| panic!("no result line in:\n{}", stdout(&o)));
    let plain_kl = v["kl"]["mean_kl"].as_f64().unwrap();
    eprintln!(
        "fused Q8_0: mean KL {kl:.2e} nats/token against base + adapter, {plain_kl:.2e} against the plain base"
    );
    // Q8_0 (8-bit codes, one scale per 32 weights) against the f32 base + adapter: 100 times
    // under the adapter's own effect, which is what a card against the plain base would show.
    assert!(
        kl * 100.0 < plain_kl,
        "fused Q8_0 KL {kl} against base + adapter (plain base: {plain_kl})"
    );
}

#[test]
fn fuse_refuses_bad_arguments() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("out.gguf");
    let (base, lora) = (tiny(), adapter());
    let fuse = |extra: &[&str]| {
        let mut args = vec!["fuse", s(&base), s(&lora), s(&out)];
        args.extend_from_slice(extra);
        hf2q(&args)
    };
    fails_with(
        &fuse(&["--to", "gguf-lora"]),
        "fuse writes a model: --to gguf, hf or mlx, not gguf-lora",
    );
    fails_with(&fuse(&["--to", "peft"]), "not peft");
    fails_with(
        &fuse(&["--to", "hf", "--type", "Q4_0"]),
        "--type must be F32, F16 or BF16, not Q4_0",
    );
    fails_with(
        &fuse(&["--to", "gguf", "--type", "mlx4"]),
        "--type mlx4 is not a GGUF type",
    );
    fails_with(
        &fuse(&["--to", "mlx", "--type", "Q4_0"]),
        "--type Q4_0 is not an MLX recipe",
    );
    fails_with(&fuse(&["--to", "gguf", "--type", "Q9_9"]), "Q9_9");
    fails_with(&fuse(&["--to", "yaml"]), "invalid value 'yaml'");

    // An adapter that is not there, a model given as the adapter, an adapter of another model.
    let nowhere = d.path().join("nowhere");
    fails_with(
        &hf2q(&["fuse", s(&tiny()), s(&nowhere), s(&out)]),
        "adapter_config.json",
    );
    fails_with(
        &hf2q(&["fuse", s(&tiny()), s(&tiny()), s(&out)]),
        "adapter_config.json",
    );
    let qwen3 = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../train/tests/fixtures/peft/tiny-qwen3/peft_trained");
    let o = hf2q(&["fuse", s(&tiny()), s(&qwen3), s(&out)]);
    fails_with(&o, &qwen3.display().to_string());
    assert!(!out.exists(), "a refused fuse left {}", out.display());
}

#[test]
fn adapters_convert_between_formats_and_run_the_same() {
    let d = tempfile::tempdir().unwrap();
    let p = |n: &str| d.path().join(n);
    let want = greedy(&tiny(), Some(&adapter()));
    let base = tiny();
    let convert = |input: &Path, out: &Path, to: &str, with_base: bool| {
        let mut args = vec!["convert", s(input), s(out), "--to", to];
        if with_base {
            args.extend(["--base", s(&base)]);
        }
        let o = hf2q(&args);
        assert!(o.status.success(), "hf2q {args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("modules, rank"), "{}", stderr(&o));
    };

    convert(&adapter(), &p("lora.gguf"), "gguf-lora", true);
    assert_eq!(&std::fs::read(p("lora.gguf")).unwrap()[..4], b"GGUF");
    assert_eq!(
        greedy(&tiny(), Some(&p("lora.gguf"))),
        want,
        "llama.cpp LoRA GGUF"
    );
    convert(&adapter(), &p("mlx"), "mlx", true);
    for f in ["adapters.safetensors", "adapter_config.json"] {
        assert!(p("mlx").join(f).is_file(), "no {f} in the mlx-lm folder");
    }
    assert_eq!(greedy(&tiny(), Some(&p("mlx"))), want, "mlx-lm folder");

    // Back to PEFT: the GGUF needs the base (Llama q/k rows are stored permuted), mlx does not.
    convert(&p("lora.gguf"), &p("from-gguf"), "peft", true);
    convert(&p("mlx"), &p("from-mlx"), "peft", false);
    for back in ["from-gguf", "from-mlx"] {
        assert!(p(back).join("adapter_model.safetensors").is_file());
        assert_eq!(greedy(&tiny(), Some(&p(back))), want, "{back}");
    }
}

#[test]
fn convert_refuses_bad_adapter_arguments() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("out.gguf");
    let a = adapter();
    fails_with(
        &hf2q(&["convert", s(&a), s(&out), "--to", "gguf-lora"]),
        "--to gguf-lora needs --base MODEL",
    );
    fails_with(
        &hf2q(&["convert", s(&a), s(&out), "--to", "mlx"]),
        "--to mlx needs --base MODEL",
    );
    fails_with(
        &hf2q(&[
            "convert",
            s(&a),
            s(&out),
            "--to",
            "hf",
            "--base",
            s(&tiny()),
        ]),
        "an adapter converts --to gguf-lora, mlx or peft, not hf",
    );
    fails_with(
        &hf2q(&[
            "convert",
            s(&a),
            s(&out),
            "--to",
            "gguf-lora",
            "--type",
            "Q4_0",
        ]),
        "--type and --dtype do not apply",
    );
    fails_with(
        &hf2q(&["convert", s(&tiny()), s(&out), "--to", "peft"]),
        "--to peft converts an adapter, and this is not one",
    );
    fails_with(
        &hf2q(&["convert", s(&tiny()), s(&out), "--to", "gguf-lora"]),
        "--to gguf-lora converts an adapter",
    );
    // The adapter's modules do not fit another model's shapes.
    let qwen3 = common::fixture("tiny-qwen3");
    let o = hf2q(&[
        "convert",
        s(&a),
        s(&out),
        "--to",
        "gguf-lora",
        "--base",
        s(&qwen3),
    ]);
    fails_with(&o, "lora_B [64, 4], expected [4, 64] and [128, 4]");
    assert!(!out.exists(), "a refused convert left {}", out.display());

    // A Llama GGUF LoRA cannot be read back without its base (permuted q/k rows).
    let lora = d.path().join("lora.gguf");
    let o = hf2q(&[
        "convert",
        s(&a),
        s(&lora),
        "--to",
        "gguf-lora",
        "--base",
        s(&tiny()),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    fails_with(
        &hf2q(&[
            "convert",
            s(&lora),
            s(&d.path().join("back")),
            "--to",
            "peft",
        ]),
        "give the base model to read it",
    );
    assert!(!d.path().join("back").exists());
}

#[test]
fn help_explains_fuse_and_adapter_convert() {
    let top = stdout(&hf2q(&["--help"]));
    assert!(top.contains("fuse"), "top-level help lacks fuse:\n{top}");
    let o = hf2q(&["fuse", "--help"]);
    assert!(o.status.success());
    let h = stdout(&o);
    for want in [
        "merged into its weights",
        "--eval",
        "--type",
        "--to",
        "report card",
        "mlx-lm",
        "llama.cpp",
    ] {
        assert!(h.contains(want), "fuse --help lacks '{want}':\n{h}");
    }
    let h = stdout(&hf2q(&["convert", "--help"]));
    for want in ["gguf-lora", "peft", "--base", "mlx-lm"] {
        assert!(h.contains(want), "convert --help lacks '{want}':\n{h}");
    }
}
