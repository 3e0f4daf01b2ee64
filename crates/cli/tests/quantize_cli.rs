//! The `quantize`, `convert` and `perplexity` subcommands end to end on a committed tiny
//! checkpoint: they write what they say, print JSON when asked, and refuse bad requests with a
//! clear message and a failing exit status (leaving no output behind).

mod common;

use common::{hf2q, stderr, tiny};

#[test]
fn quantize_convert_perplexity_round() {
    let d = tempfile::tempdir().unwrap();
    let t = tiny();
    let q8 = d.path().join("q8.gguf");
    let o = hf2q(&[
        "quantize",
        t.to_str().unwrap(),
        q8.to_str().unwrap(),
        "--type",
        "Q8_0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("bits per weight"), "{}", stderr(&o));
    let mlx = d.path().join("mlx");
    let o = hf2q(&[
        "quantize",
        t.to_str().unwrap(),
        mlx.to_str().unwrap(),
        "--type",
        "mlx4g32",
    ]);
    assert!(
        o.status.success() && mlx.join("config.json").is_file(),
        "{}",
        stderr(&o)
    );
    let hf = d.path().join("hf");
    let o = hf2q(&[
        "convert",
        q8.to_str().unwrap(),
        hf.to_str().unwrap(),
        "--to",
        "hf",
        "--dtype",
        "bf16",
    ]);
    assert!(
        o.status.success() && hf.join("tokenizer.json").is_file(),
        "{}",
        stderr(&o)
    );
    let text = d.path().join("t.txt");
    std::fs::write(
        &text,
        "A short text, long enough for two chunks of sixteen byte-level tokens each.",
    )
    .unwrap();
    let o = hf2q(&[
        "perplexity",
        hf.to_str().unwrap(),
        "-f",
        text.to_str().unwrap(),
        "-c",
        "16",
        "--kl-base",
        t.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // `--json` prints NDJSON: progress lines, then the result.
    let out = String::from_utf8_lossy(&o.stdout);
    let v: serde_json::Value = out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "result")
        .unwrap_or_else(|| panic!("no result line in:\n{out}"));
    assert!(
        v["ppl"].as_f64().unwrap() > 1.0 && v["kl"]["mean_kl"].as_f64().unwrap() >= 0.0,
        "{v}"
    );
}

#[test]
fn bad_requests_fail_cleanly() {
    let d = tempfile::tempdir().unwrap();
    let t = tiny();
    let out = d.path().join("x.gguf");
    let o = hf2q(&[
        "quantize",
        t.to_str().unwrap(),
        out.to_str().unwrap(),
        "--type",
        "Q7_K",
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("unknown --type"),
        "{}",
        stderr(&o)
    );
    let o = hf2q(&[
        "quantize",
        t.to_str().unwrap(),
        out.to_str().unwrap(),
        "--target-bpw",
        "5",
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("--calib"),
        "{}",
        stderr(&o)
    );
    let o = hf2q(&[
        "convert",
        t.to_str().unwrap(),
        out.to_str().unwrap(),
        "--to",
        "hf",
        "--type",
        "Q4_0",
    ]);
    assert!(!o.status.success(), "{}", stderr(&o));
    let o = hf2q(&[
        "quantize",
        "/nonexistent/model",
        out.to_str().unwrap(),
        "--type",
        "Q8_0",
    ]);
    assert!(!o.status.success());
    // Nothing was written, not even a temporary file.
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
}
