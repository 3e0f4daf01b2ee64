//! Contract of `perplexity` (llama-perplexity's method) on a committed tiny checkpoint: the
//! chunking (non-overlapping chunks of ctx, first token BOS when the tokenizer adds one), the
//! scored half (positions ctx/2 .. ctx-1 predicting the next token), the error estimate, KL
//! against a base model, and the refusals.

use std::path::Path;

use hf2q_models::perplexity::{perplexity, tokenize_text, PerplexityOptions};
use hf2q_models::Model;

fn model() -> Model {
    Model::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/tiny-llama"))
        .unwrap()
}

const TEXT: &str = "The quick brown fox jumps over the lazy dog; a perplexity test needs a few dozen bytes of text.";

#[test]
fn matches_a_direct_computation() {
    let m = model();
    let ctx = 16;
    let toks = tokenize_text(&m, TEXT).unwrap();
    let n_chunks = toks.len() / ctx;
    assert!(n_chunks >= 3);
    // Direct: every chunk from an empty cache, NLL of token j+1 at positions ctx/2 .. ctx-2.
    let (mut nll, mut n) = (0f64, 0usize);
    for c in 0..n_chunks {
        let mut chunk = toks[c * ctx..(c + 1) * ctx].to_vec();
        if m.tokenizer().add_bos() {
            chunk[0] = m.tokenizer().bos_id().unwrap();
        }
        let l = m.session(ctx).forward_all(&chunk).unwrap();
        for j in ctx / 2..ctx - 1 {
            let row = l.row(j);
            let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let z = row.iter().map(|&x| (x as f64 - mx).exp()).sum::<f64>().ln() + mx;
            nll += z - row[chunk[j + 1] as usize] as f64;
            n += 1;
        }
    }
    let want = (nll / n as f64).exp();
    let mut seen = Vec::new();
    let r = perplexity(
        &m,
        None,
        TEXT,
        &PerplexityOptions {
            ctx,
            max_chunks: None,
        },
        &mut |i, k, p| seen.push((i, k, p)),
    )
    .unwrap();
    assert_eq!(
        (r.n_chunks, r.n_scored, r.n_tokens),
        (n_chunks, n, toks.len())
    );
    // The same f32 logits; perplexity takes each exp in f32 (as llama.cpp's log_softmax does)
    // and this direct sum in f64: 1e-6 relative covers that and nothing else.
    assert!((r.ppl - want).abs() <= 1e-6 * want, "{} vs {want}", r.ppl);
    assert!(r.ppl_err > 0.0 && r.kl.is_none());
    assert_eq!(seen.len(), n_chunks);
    assert_eq!(seen.last().unwrap().2, r.ppl);
    // --chunks limits the chunks.
    let r2 = perplexity(
        &m,
        None,
        TEXT,
        &PerplexityOptions {
            ctx,
            max_chunks: Some(1),
        },
        &mut |_, _, _| {},
    )
    .unwrap();
    assert_eq!((r2.n_chunks, r2.n_scored), (1, ctx - 1 - ctx / 2));
}

#[test]
fn kl_against_itself_is_zero() {
    let m = model();
    let b = model();
    let r = perplexity(
        &m,
        Some(&b),
        TEXT,
        &PerplexityOptions {
            ctx: 16,
            max_chunks: None,
        },
        &mut |_, _, _| {},
    )
    .unwrap();
    let k = r.kl.unwrap();
    assert!(k.mean_kl.abs() < 1e-9 && k.max_kl < 1e-9, "{k:?}");
    assert_eq!(k.same_top_pct, 100.0);
    assert!((k.base_ppl - r.ppl).abs() < 1e-6 * r.ppl);
}

#[test]
fn refuses_texts_too_short_and_tiny_contexts() {
    let m = model();
    let e = perplexity(
        &m,
        None,
        "short",
        &PerplexityOptions {
            ctx: 512,
            max_chunks: None,
        },
        &mut |_, _, _| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("at least"), "{e}");
    assert!(perplexity(
        &m,
        None,
        TEXT,
        &PerplexityOptions {
            ctx: 2,
            max_chunks: None
        },
        &mut |_, _, _| {}
    )
    .is_err());
}
