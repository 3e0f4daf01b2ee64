//! Contract of importance-matrix collection (llama-imatrix's statistics) on the committed tiny
//! Llama checkpoint:
//!
//! - every block weight's sums are exactly Σx² of the rows its matmul was given, counts are the
//!   rows (chunks x ctx), `output.weight` only with `process_output`;
//! - the sums of `blk.0.attn_q.weight` equal a direct computation (RMS-normed embeddings of the
//!   chunk tokens, BOS first);
//! - the written file reads back with the GGUF imatrix reader;
//! - quantizing MLX affine with it lowers the importance-weighted error of the weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use hf2q_cpu::LinearObserver;
use hf2q_models::convert::source::{Layout, SourceModel};
use hf2q_models::convert::NoProgress;
use hf2q_models::quantize::collect::{collect_imatrix, ImatrixOptions};
use hf2q_models::quantize::imatrix::Imatrix;
use hf2q_models::quantize::presets::QuantTarget;
use hf2q_models::quantize::{quantize, QuantizeOptions};
use hf2q_models::Model;
use hf2q_tensor::{QTensor, Tensor};

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/tiny-llama")
}

const TEXT: &str = "Importance matrices weigh each input column of a weight by the mean square of \
the activations that reach it. Columns that carry large activations matter more when the weight \
is rounded, so a quantizer spends its precision there. This text only needs to be long enough \
for a few chunks of sixteen tokens each, with some variety in its letters and words.";

/// Records every input a matmul was given, by stored weight name.
#[derive(Debug, Default)]
struct Recorder(Mutex<BTreeMap<String, Vec<Vec<f32>>>>);

impl LinearObserver for Recorder {
    fn observe(&self, w: &QTensor, x: &Tensor) {
        let (_, c) = x.dims2();
        let mut m = self.0.lock().unwrap();
        let rows = m.entry(w.name.clone()).or_default();
        rows.extend(x.data().chunks(c).map(<[f32]>::to_vec));
    }
}

fn opts(ctx: usize, chunks: Option<usize>, process_output: bool) -> ImatrixOptions {
    ImatrixOptions {
        ctx,
        max_chunks: chunks,
        process_output,
        dataset: "tiny.txt".into(),
    }
}

#[test]
fn sums_are_the_squares_of_the_rows_each_matmul_saw() {
    let mut m = Model::load(&tiny()).unwrap();
    let ctx = 16;
    let n_tokens = m.tokenizer().encode(TEXT, true, false).unwrap().len();
    let n_chunks = n_tokens / ctx;
    assert!(n_chunks >= 4, "{n_tokens} tokens");
    let mut seen = Vec::new();
    let (imx, run) = collect_imatrix(&mut m, TEXT, &opts(ctx, Some(3), false), &mut |i, n, p| {
        seen.push((i, n, p))
    })
    .unwrap();
    assert_eq!((run.n_chunks, run.ctx, run.n_tokens), (3, ctx, n_tokens));
    assert_eq!(seen.len(), 3);
    assert!(run.ppl.is_finite() && run.ppl > 1.0 && run.running_ppl.len() == 3);
    assert_eq!((imx.chunk_count, imx.chunk_size), (3, ctx as u32));
    assert_eq!(imx.datasets, ["tiny.txt"]);
    // 2 layers x (q, k, v, o, gate, up, down); output.weight only when asked.
    assert_eq!(imx.len(), 14, "{:?}", imx.entries.keys());
    assert!(imx.entries.keys().all(|k| k.starts_with("blk.")));

    // The same chunks again, with a recorder in place of the collector.
    let rec = Arc::new(Recorder::default());
    m.set_linear_observer(Some(rec.clone()));
    let toks = m.tokenizer().encode(TEXT, true, false).unwrap();
    // The first token of each chunk is BOS when the tokenizer adds one (llama-imatrix).
    let bos = if m.tokenizer().add_bos() {
        m.tokenizer().bos_id()
    } else {
        None
    };
    let first = |c: usize| bos.unwrap_or(toks[c * ctx]);
    for c in 0..3 {
        let mut chunk = toks[c * ctx..(c + 1) * ctx].to_vec();
        chunk[0] = first(c);
        m.session(ctx).forward_all(&chunk).unwrap();
    }
    m.set_linear_observer(None);
    let rows = rec.0.lock().unwrap();
    for (stored, xs) in rows.iter() {
        let gguf = hf_gguf(stored);
        let Some(e) = imx.entries.get(&gguf) else {
            assert_eq!(gguf, "output.weight", "{stored} was not collected");
            continue;
        };
        assert_eq!(e.counts, [xs.len() as f32], "{gguf}");
        assert_eq!(xs.len(), 3 * ctx);
        let c = xs[0].len();
        let want: Vec<f32> = (0..c)
            .map(|j| xs.iter().map(|r| r[j] as f64 * r[j] as f64).sum::<f64>() as f32)
            .collect();
        assert_eq!(e.sums, want, "{gguf}");
    }

    // Independently: layer 0's q_proj sees RMSNorm(embedding) * input_layernorm.
    let src = SourceModel::open(&tiny()).unwrap();
    let read = |n: &str| {
        let t = src.tensor_by_hf(n).unwrap();
        (src.read_f32(t, Layout::Hf).unwrap(), t.cols())
    };
    let (emb, d) = read("model.embed_tokens.weight");
    let (norm, _) = read("model.layers.0.input_layernorm.weight");
    let eps = m.config.rms_eps;
    let mut direct = vec![0f64; d];
    for c in 0..3 {
        for (k, &t) in toks[c * ctx..(c + 1) * ctx].iter().enumerate() {
            let t = if k == 0 { first(c) } else { t } as usize;
            let row = &emb[t * d..(t + 1) * d];
            let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for j in 0..d {
                let y = (row[j] * inv * norm[j]) as f64;
                direct[j] += y * y;
            }
        }
    }
    let got = &imx.entries["blk.0.attn_q.weight"].sums;
    for j in 0..d {
        assert!(
            (got[j] as f64 - direct[j]).abs() <= 1e-5 * direct[j].max(1e-3),
            "column {j}: {} vs {}",
            got[j],
            direct[j]
        );
    }

    // Written and read back.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("imatrix.gguf");
    imx.save(&p).unwrap();
    let back = Imatrix::load(&p).unwrap();
    assert_eq!(back.entries, imx.entries);
    assert_eq!((back.chunk_count, back.chunk_size), (3, 16));
    assert_eq!(back.datasets, ["tiny.txt"]);
}

fn hf_gguf(stored: &str) -> String {
    hf2q_models::quantize::collect::gguf_weight_name(hf2q_models::config::Arch::Llama, stored)
        .unwrap()
}

#[test]
fn process_output_adds_the_logits_matmul() {
    let mut m = Model::load(&tiny()).unwrap();
    let (imx, _) =
        collect_imatrix(&mut m, TEXT, &opts(16, Some(2), true), &mut |_, _, _| {}).unwrap();
    assert_eq!(imx.len(), 15);
    assert_eq!(imx.entries["output.weight"].counts, [32.0]);
}

#[test]
fn refusals_are_errors() {
    let mut m = Model::load(&tiny()).unwrap();
    let n = m.tokenizer().encode(TEXT, true, false).unwrap().len();
    let err = |o: ImatrixOptions, m: &mut Model| {
        collect_imatrix(m, TEXT, &o, &mut |_, _, _| {})
            .unwrap_err()
            .to_string()
    };
    assert!(err(opts(8, None, false), &mut m).contains("too small"));
    let e = err(opts(n / 2 + 1, None, false), &mut m);
    assert!(e.contains("2 x ctx"), "{e}");
    assert!(err(opts(16, Some(0), false), &mut m).contains("--chunks 0"));
    // The observer is cleared after a failed run too: a plain forward still works.
    m.session(4).forward_all(&[1, 2, 3]).unwrap();
}

/// Σ imp_j (w_rj - ŵ_rj)² over a weight, imp = the matrix's importance.
fn weighted_error(a: &[f32], b: &[f32], imp: &[f32]) -> f64 {
    let c = imp.len();
    a.chunks(c)
        .zip(b.chunks(c))
        .map(|(x, y)| {
            x.iter()
                .zip(y)
                .zip(imp)
                .map(|((p, q), w)| *w as f64 * ((p - q) as f64).powi(2))
                .sum::<f64>()
        })
        .sum()
}

#[test]
fn mlx_with_an_imatrix_lowers_the_weighted_error() {
    let mut m = Model::load(&tiny()).unwrap();
    let (imx, _) =
        collect_imatrix(&mut m, TEXT, &opts(16, None, false), &mut |_, _, _| {}).unwrap();
    let src = SourceModel::open(&tiny()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let q = |name: &str, imatrix: Option<Imatrix>| {
        let out = dir.path().join(name);
        let r = quantize(
            &src,
            &out,
            &QuantizeOptions {
                target: QuantTarget::parse("mlx4g32", None).unwrap(),
                overrides: Default::default(),
                imatrix,
            },
            &NoProgress,
        )
        .unwrap();
        (SourceModel::open(&out).unwrap(), r.imatrix_used)
    };
    let (plain, n0) = q("plain", None);
    let (weighted, n1) = q("weighted", Some(imx.clone()));
    assert_eq!((n0, n1), (0, 14));
    let (mut e_plain, mut e_weighted) = (0f64, 0f64);
    for (gguf, _) in imx.entries.iter() {
        let imp = imx.get(gguf).unwrap();
        let t = src.tensor_by_gguf(gguf).unwrap();
        let x = src.read_f32(t, Layout::Hf).unwrap();
        let read = |s: &SourceModel| {
            s.read_f32(s.tensor_by_gguf(gguf).unwrap(), Layout::Hf)
                .unwrap()
        };
        let (a, b) = (
            weighted_error(&x, &read(&plain), imp),
            weighted_error(&x, &read(&weighted), imp),
        );
        assert!(b <= a * 1.0001, "{gguf}: {b} vs {a}");
        e_plain += a;
        e_weighted += b;
    }
    assert!(
        e_weighted < 0.95 * e_plain,
        "weighted {e_weighted} vs plain {e_plain}"
    );
}

/// SmolLM2 (`HF2Q_TEST_SMOLLM2_GGUF`; skipped without it): one entry per block matmul, named as
/// llama-imatrix names them, nothing for the tied embeddings, counts of chunks x ctx; a GGUF
/// quantized with it records llama-quantize's provenance keys.
#[test]
fn smollm2_entries_are_llama_imatrix_s() {
    let Some(p) = std::env::var_os("HF2Q_TEST_SMOLLM2_GGUF").filter(|p| !p.is_empty()) else {
        eprintln!("skipped: HF2Q_TEST_SMOLLM2_GGUF is not set");
        return;
    };
    let p = PathBuf::from(p);
    let mut m = Model::load(&p).unwrap();
    let text = TEXT.repeat(3);
    let (imx, run) =
        collect_imatrix(&mut m, &text, &opts(64, Some(2), true), &mut |_, _, _| {}).unwrap();
    assert!(run.ppl.is_finite());
    let kinds = [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ];
    let want: Vec<String> = (0..m.config.n_layers)
        .flat_map(|l| kinds.iter().map(move |k| format!("blk.{l}.{k}.weight")))
        .collect();
    let mut got: Vec<&String> = imx.entries.keys().collect();
    got.sort();
    let mut want_sorted: Vec<&String> = want.iter().collect();
    want_sorted.sort();
    // Tied embeddings: --process-output finds no output.weight, as in llama-imatrix.
    assert_eq!(got, want_sorted);
    for (k, e) in &imx.entries {
        assert_eq!(e.counts, [128.0], "{k}");
        assert!(e.sums.iter().all(|v| v.is_finite() && *v >= 0.0), "{k}");
    }
    let dir = tempfile::tempdir().unwrap();
    let ip = dir.path().join("imatrix.gguf");
    imx.save(&ip).unwrap();
    let mut back = Imatrix::load(&ip).unwrap();
    back.source = Some("imatrix.gguf".into());
    let src = SourceModel::open(&p).unwrap();
    let out = dir.path().join("q4km.gguf");
    let r = quantize(
        &src,
        &out,
        &QuantizeOptions {
            target: QuantTarget::parse("Q4_K_M", None).unwrap(),
            overrides: Default::default(),
            imatrix: Some(back),
        },
        &NoProgress,
    )
    .unwrap();
    assert_eq!(r.imatrix_used, want.len());
    let f = hf2q_tensor::io::gguf::GgufFile::open(&out).unwrap();
    assert_eq!(
        f.get_u64("quantize.imatrix.entries_count"),
        Some(want.len() as u64)
    );
    assert_eq!(f.get_u64("quantize.imatrix.chunks_count"), Some(2));
}
