//! `hf2q imatrix` end to end on the committed tiny checkpoint: it writes an imatrix that
//! `hf2q quantize --imatrix` uses (GGUF and MLX), prints JSON when asked, and refuses bad
//! requests with a clear message and a failing exit status, without panicking.

mod common;

use std::path::Path;

use common::{fails_with, hf2q, stderr, tiny};

const TEXT: &str = "Importance matrices weigh each input column of a weight by the mean square of \
the activations that reach it. Columns that carry large activations matter more when the weight \
is rounded, so a quantizer spends its precision there. This text only needs to be long enough \
for a few chunks of sixteen tokens each.";

#[test]
fn imatrix_then_quantize_with_it() {
    let d = tempfile::tempdir().unwrap();
    let text = d.path().join("text.txt");
    std::fs::write(&text, TEXT).unwrap();
    let t = tiny();
    let imx = d.path().join("imatrix.gguf");
    let o = hf2q(&[
        "imatrix",
        t.to_str().unwrap(),
        "--file",
        text.to_str().unwrap(),
        "-o",
        imx.to_str().unwrap(),
        "--ctx",
        "16",
        "--chunks",
        "3",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // NDJSON: progress lines, then the summary.
    let out = String::from_utf8_lossy(&o.stdout);
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(v["event"], "result", "{v}");
    assert_eq!(v["n_chunks"], 3, "{v}");
    assert_eq!(v["chunk_count"], 3, "{v}");
    assert_eq!(v["n_entries"], 14, "{v}");
    assert!(v["ppl"].as_f64().unwrap() > 1.0, "{v}");
    assert!(imx.is_file());

    for (ty, out) in [("Q4_K_M", "q.gguf"), ("mlx4g32", "mlx")] {
        let out = d.path().join(out);
        let o = hf2q(&[
            "quantize",
            t.to_str().unwrap(),
            out.to_str().unwrap(),
            "--type",
            ty,
            "--imatrix",
            imx.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{ty}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("quantized with importance weights"),
            "{ty}: {}",
            stderr(&o)
        );
    }
}

#[test]
fn bad_requests_fail_cleanly() {
    let d = tempfile::tempdir().unwrap();
    let text = d.path().join("text.txt");
    std::fs::write(&text, TEXT).unwrap();
    let t = tiny();
    let (t, text) = (t.to_str().unwrap(), text.to_str().unwrap());
    let out = d.path().join("out.gguf");
    let out = out.to_str().unwrap();
    fails_with(
        &hf2q(&["imatrix", t, "--file", "/nonexistent/text.txt", "-o", out]),
        "reading /nonexistent/text.txt",
    );
    fails_with(
        &hf2q(&["imatrix", "/nonexistent/model", "--file", text, "-o", out]),
        "/nonexistent/model",
    );
    // The default context of 512 is far more than this text holds.
    fails_with(
        &hf2q(&["imatrix", t, "--file", text, "-o", out]),
        "at least 1024 (2 x ctx)",
    );
    fails_with(
        &hf2q(&["imatrix", t, "--file", text, "-o", out, "--ctx", "8"]),
        "too small",
    );
    fails_with(
        &hf2q(&[
            "imatrix", t, "--file", text, "-o", out, "--ctx", "16", "--chunks", "0",
        ]),
        "--chunks 0",
    );
    fails_with(
        &hf2q(&[
            "imatrix",
            t,
            "--file",
            text,
            "-o",
            d.path().to_str().unwrap(),
        ]),
        "is a folder",
    );
    // An imatrix that is not one, and one for another model.
    fails_with(
        &hf2q(&["quantize", t, out, "--type", "mlx4", "--imatrix", text]),
        "reading",
    );
    let other = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/quantize/smollm2_imatrix_l0-3.gguf");
    let mlx = d.path().join("mlx");
    fails_with(
        &hf2q(&[
            "quantize",
            t,
            mlx.to_str().unwrap(),
            "--type",
            "mlx4",
            "--imatrix",
            other.to_str().unwrap(),
        ]),
        "another model",
    );
    // Nothing was written besides the text.
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
}
