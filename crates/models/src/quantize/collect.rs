//! Computing an importance matrix the way llama.cpp's `llama-imatrix` does
//! (`tools/imatrix/imatrix.cpp`), written in its GGUF format by [`super::imatrix`].
//!
//! - The text is tokenized once (BOS added when the tokenizer adds one, special tokens in the
//!   text not parsed) and cut into `n = tokens / ctx` non-overlapping chunks of `ctx` tokens; at
//!   least `2 * ctx` tokens are needed. Each chunk runs from an empty cache with its first token
//!   replaced by BOS when the tokenizer adds one.
//! - For every matmul `x (T, C) @ W^T` the collector adds `Σ_t x[t, j]²` to `W`'s column sums and
//!   `T` to its count. As llama-imatrix: only weights of the blocks (`blk.*`) are collected, plus
//!   `output.weight` with `process_output` (off by default; a model with tied embeddings has no
//!   `output.weight`, its logits come from `token_embd.weight`, which is never collected), and
//!   matmuls over fewer than 16 rows are skipped.
//! - The chunk's logits also give llama-imatrix's perplexity estimate (the second half of each
//!   chunk scored, as llama-perplexity).
//!
//! Sums are accumulated in f64 here (llama.cpp: f32) and written as f32. The collector is a
//! [`LinearObserver`] of the CPU backend: the activations are those of the model's CPU matmul
//! path (the reference path unless another is chosen).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use hf2q_cpu::LinearObserver;
use hf2q_tensor::{QTensor, Tensor};

use super::imatrix::{Imatrix, ImatrixEntry};
use crate::config::Arch;
use crate::names::hf_to_gguf;
use crate::{Error, Model, Result};

/// llama-imatrix ignores matmuls over fewer rows than this (single-token decode steps).
pub const MIN_ROWS: usize = 16;

/// The GGUF name of a weight as the model stores it: GGUF files keep GGUF names, safetensors
/// and MLX folders HF names (possibly under a multimodal checkpoint's text-model prefix).
pub fn gguf_weight_name(arch: Arch, stored: &str) -> Option<String> {
    if stored.starts_with("blk.") || matches!(stored, "output.weight" | "token_embd.weight") {
        return Some(stored.to_string());
    }
    let hf = if let Some(rest) = stored.strip_prefix("model.language_model.") {
        format!("model.{rest}")
    } else {
        stored
            .strip_prefix("language_model.")
            .unwrap_or(stored)
            .to_string()
    };
    hf_to_gguf(arch, &hf)
}

#[derive(Debug, Default)]
struct Acc {
    sums: Vec<f64>,
    rows: u64,
}

#[derive(Debug, Default)]
struct State {
    stats: BTreeMap<String, Acc>,
    /// Stored name -> GGUF name (None: not collected).
    names: BTreeMap<String, Option<String>>,
    /// The first problem met (non-finite activations, a width that changed).
    error: Option<String>,
}

/// A [`LinearObserver`] that accumulates llama-imatrix's statistics per weight.
#[derive(Debug)]
pub struct ImatrixCollector {
    arch: Arch,
    process_output: bool,
    min_rows: usize,
    state: Mutex<State>,
}

impl ImatrixCollector {
    /// Collects `blk.*` weights (and `output.weight` with `process_output`) of a model of `arch`.
    pub fn new(arch: Arch, process_output: bool) -> ImatrixCollector {
        ImatrixCollector {
            arch,
            process_output,
            min_rows: MIN_ROWS,
            state: Mutex::new(State::default()),
        }
    }

    /// Also counts matmuls over fewer than [`MIN_ROWS`] rows when `min_rows` is lower.
    pub fn with_min_rows(mut self, min_rows: usize) -> ImatrixCollector {
        self.min_rows = min_rows;
        self
    }

    fn wanted(&self, gguf: &str) -> bool {
        gguf.starts_with("blk.") || (self.process_output && gguf == "output.weight")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves sums that are still sums.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Weights seen so far (GGUF names).
    pub fn len(&self) -> usize {
        self.lock().stats.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The largest number of rows any weight has seen.
    pub fn max_rows(&self) -> u64 {
        self.lock()
            .stats
            .values()
            .map(|a| a.rows)
            .max()
            .unwrap_or(0)
    }

    /// The statistics as an importance matrix. `chunk_count` is llama-imatrix's: the most rows
    /// any weight saw, in whole chunks of `chunk_size`.
    pub fn to_imatrix(&self, datasets: Vec<String>, chunk_size: u32) -> Result<Imatrix> {
        let st = self.lock();
        if let Some(e) = &st.error {
            return Err(Error::Msg(e.clone()));
        }
        let entries: BTreeMap<String, ImatrixEntry> = st
            .stats
            .iter()
            .map(|(k, a)| {
                (
                    k.clone(),
                    ImatrixEntry {
                        sums: a.sums.iter().map(|&v| v as f32).collect(),
                        counts: vec![a.rows as f32],
                    },
                )
            })
            .collect();
        let max_rows = st.stats.values().map(|a| a.rows).max().unwrap_or(0);
        let chunk_count = match chunk_size {
            0 => 0,
            c => (max_rows / c as u64) as u32,
        };
        Ok(Imatrix::new(entries, datasets, chunk_count, chunk_size))
    }
}

impl LinearObserver for ImatrixCollector {
    fn observe(&self, w: &QTensor, x: &Tensor) {
        let (t, c) = x.dims2();
        if t < self.min_rows || c != w.cols {
            return;
        }
        let mut st = self.lock();
        if st.error.is_some() {
            return;
        }
        let gguf = match st.names.get(&w.name) {
            Some(g) => g.clone(),
            None => {
                let g = gguf_weight_name(self.arch, &w.name).filter(|g| self.wanted(g));
                st.names.insert(w.name.clone(), g.clone());
                g
            }
        };
        let Some(gguf) = gguf else { return };
        let acc = st.stats.entry(gguf.clone()).or_default();
        if acc.sums.is_empty() {
            acc.sums = vec![0f64; c];
        } else if acc.sums.len() != c {
            let msg = format!(
                "{gguf}: inputs of {c} features after {} (the same weight with two widths)",
                acc.sums.len()
            );
            st.error = Some(msg);
            return;
        }
        for row in x.data().chunks_exact(c) {
            for (s, &v) in acc.sums.iter_mut().zip(row) {
                *s += v as f64 * v as f64;
            }
        }
        acc.rows += t as u64;
        if acc.sums.iter().any(|v| !v.is_finite()) {
            st.error = Some(format!("non-finite activations feed {gguf}"));
        }
    }
}

/// What `collect_imatrix` runs.
#[derive(Clone, Debug)]
pub struct ImatrixOptions {
    /// Tokens per chunk (llama-imatrix's `-c`).
    pub ctx: usize,
    /// At most this many chunks (`--chunks`); `None`: all that fit.
    pub max_chunks: Option<usize>,
    /// Also collect `output.weight` (llama-imatrix's `--process-output`).
    pub process_output: bool,
    /// The dataset name recorded in the file (llama-imatrix records the text file as given).
    pub dataset: String,
}

impl Default for ImatrixOptions {
    fn default() -> Self {
        ImatrixOptions {
            ctx: 512,
            max_chunks: None,
            process_output: false,
            dataset: String::new(),
        }
    }
}

/// What a collection did, besides the matrix.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ImatrixRun {
    /// Tokens in the whole text.
    pub n_tokens: usize,
    pub ctx: usize,
    pub n_chunks: usize,
    /// Weights collected.
    pub n_entries: usize,
    /// Perplexity over the scored halves of the chunks, with llama.cpp's error estimate.
    pub ppl: f64,
    pub ppl_err: f64,
    /// Running perplexity after each chunk (llama-imatrix's `[i]x` list).
    pub running_ppl: Vec<f64>,
}

/// -log p(tok) from logits, the max subtracted and the sum in f64 (as llama.cpp).
fn nll_at(logits: &[f32], tok: usize) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = logits.iter().map(|&v| (v - max).exp() as f64).sum();
    sum.ln() - (logits[tok] - max) as f64
}

/// Runs `model` over `text` as llama-imatrix does and returns the importance matrix.
/// `on_chunk(i, n, running_ppl)` is called after each chunk. The model's linear observer is
/// replaced during the run and cleared afterwards.
pub fn collect_imatrix(
    model: &mut Model,
    text: &str,
    opts: &ImatrixOptions,
    on_chunk: &mut dyn FnMut(usize, usize, f64),
) -> Result<(Imatrix, ImatrixRun)> {
    let ctx = opts.ctx;
    if ctx < MIN_ROWS {
        return Err(Error::Msg(format!(
            "context {ctx} is too small: chunks of at least {MIN_ROWS} tokens are needed \
             (llama-imatrix skips matmuls over fewer rows)"
        )));
    }
    if opts.max_chunks == Some(0) {
        return Err(Error::Msg("--chunks 0 collects nothing".into()));
    }
    let tokens = model.tokenizer().encode(text, true, false)?;
    if tokens.len() < 2 * ctx {
        return Err(Error::Msg(format!(
            "the text tokenizes to {} tokens; at least {} (2 x ctx) are needed for a context of \
             {ctx} (use a longer text or a smaller --ctx)",
            tokens.len(),
            2 * ctx
        )));
    }
    let n_max = tokens.len() / ctx;
    let n_chunk = opts.max_chunks.map_or(n_max, |m| m.min(n_max));
    let bos = if model.tokenizer().add_bos() {
        model.tokenizer().bos_id()
    } else {
        None
    };
    let collector = Arc::new(ImatrixCollector::new(
        model.config.arch,
        opts.process_output,
    ));
    model.set_linear_observer(Some(collector.clone()));
    let result = run_chunks(model, &tokens, ctx, n_chunk, bos, on_chunk);
    model.set_linear_observer(None);
    let (ppl, ppl_err, running_ppl) = result?;
    let m = collector.to_imatrix(vec![opts.dataset.clone()], ctx as u32)?;
    let run = ImatrixRun {
        n_tokens: tokens.len(),
        ctx,
        n_chunks: n_chunk,
        n_entries: m.len(),
        ppl,
        ppl_err,
        running_ppl,
    };
    Ok((m, run))
}

/// The forward over every chunk; returns (ppl, its error, running ppl per chunk).
fn run_chunks(
    model: &Model,
    tokens: &[u32],
    ctx: usize,
    n_chunk: usize,
    bos: Option<u32>,
    on_chunk: &mut dyn FnMut(usize, usize, f64),
) -> Result<(f64, f64, Vec<f64>)> {
    let first = ctx / 2;
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let mut running = Vec::with_capacity(n_chunk);
    for i in 0..n_chunk {
        let mut chunk = tokens[i * ctx..(i + 1) * ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        let logits = model.session(ctx).forward_all(&chunk)?;
        // Scored against the original tokens, as llama-imatrix (the BOS only replaces the
        // first token fed).
        let orig = &tokens[i * ctx..(i + 1) * ctx];
        for j in first..ctx - 1 {
            let row = logits.row(j);
            let next = orig[j + 1] as usize;
            if next >= row.len() {
                return Err(Error::Msg(format!(
                    "token id {next} is outside the model's {} logits",
                    row.len()
                )));
            }
            let v = nll_at(row, next);
            nll += v;
            nll2 += v * v;
            count += 1;
        }
        let p = (nll / count as f64).exp();
        running.push(p);
        on_chunk(i + 1, n_chunk, p);
    }
    let mean = nll / count as f64;
    let ppl = mean.exp();
    let var = nll2 / count as f64 - mean * mean;
    let err = if var > 0.0 && count > 1 {
        (var / (count - 1) as f64).sqrt() * ppl
    } else {
        0.0
    };
    Ok((ppl, err, running))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_gguf() {
        let a = Arch::Llama;
        assert_eq!(
            gguf_weight_name(a, "blk.3.attn_q.weight").as_deref(),
            Some("blk.3.attn_q.weight")
        );
        assert_eq!(
            gguf_weight_name(a, "model.layers.2.mlp.down_proj.weight").as_deref(),
            Some("blk.2.ffn_down.weight")
        );
        assert_eq!(
            gguf_weight_name(a, "language_model.model.layers.0.self_attn.o_proj.weight").as_deref(),
            Some("blk.0.attn_output.weight")
        );
        assert_eq!(
            gguf_weight_name(a, "model.language_model.layers.1.mlp.up_proj.weight").as_deref(),
            Some("blk.1.ffn_up.weight")
        );
        assert_eq!(
            gguf_weight_name(a, "lm_head.weight").as_deref(),
            Some("output.weight")
        );
        assert_eq!(
            gguf_weight_name(a, "model.embed_tokens.weight").as_deref(),
            Some("token_embd.weight")
        );
    }

    fn weight(name: &str, rows: usize, cols: usize) -> QTensor {
        let data: Vec<u8> = (0..rows * cols)
            .flat_map(|i| (i as f32 * 0.01).to_le_bytes())
            .collect();
        QTensor::ggml(
            name,
            hf2q_tensor::GgmlType::F32,
            rows,
            cols,
            hf2q_tensor::Bytes::from_vec(data),
        )
        .unwrap()
    }

    #[test]
    fn sums_squares_counts_rows_and_filters_like_llama_imatrix() {
        let c = ImatrixCollector::new(Arch::Llama, false);
        let w = weight("blk.0.attn_q.weight", 3, 2);
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 10.0).collect();
        let x = Tensor::new(&[16, 2], x).unwrap();
        c.observe(&w, &x);
        c.observe(&w, &x);
        // Fewer than 16 rows: skipped.
        c.observe(&w, &Tensor::new(&[1, 2], vec![100.0, 100.0]).unwrap());
        // Not a block weight (tied output): skipped, as is output.weight by default.
        c.observe(&weight("token_embd.weight", 3, 2), &x);
        c.observe(&weight("output.weight", 3, 2), &x);
        let m = c.to_imatrix(vec!["t.txt".into()], 16).unwrap();
        assert_eq!(m.len(), 1);
        let e = &m.entries["blk.0.attn_q.weight"];
        let want: Vec<f32> = (0..2)
            .map(|j| {
                2.0 * (0..16)
                    .map(|t| ((2 * t + j) as f64 - 10.0).powi(2))
                    .sum::<f64>() as f32
            })
            .collect();
        assert_eq!(e.sums, want);
        assert_eq!(e.counts, [32.0]);
        assert_eq!(m.chunk_count, 2);
        let c = ImatrixCollector::new(Arch::Llama, true);
        c.observe(&weight("output.weight", 3, 2), &x);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn non_finite_activations_are_an_error() {
        let c = ImatrixCollector::new(Arch::Llama, false);
        let mut x = vec![1f32; 32];
        x[5] = f32::NAN;
        c.observe(
            &weight("blk.0.ffn_up.weight", 3, 2),
            &Tensor::new(&[16, 2], x).unwrap(),
        );
        let e = c.to_imatrix(vec![], 16).unwrap_err().to_string();
        assert!(e.contains("non-finite"), "{e}");
    }
}
