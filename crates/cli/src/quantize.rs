//! `hf2q quantize IN OUT --type T`: llama.cpp presets and single ggml types into GGUF, MLX affine
//! recipes into an mlx-lm folder; `--eval TEXT` measures what it cost (perplexity and KL against
//! the input) and prints a report card. Also the progress bar shared with `convert`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use hf2q_models::convert::source::SourceModel;
use hf2q_models::convert::Progress;
use hf2q_models::perplexity::{perplexity, PerplexityOptions, PerplexityReport};
use hf2q_models::quantize::imatrix::Imatrix;
use hf2q_models::quantize::mixed::{quantize_mixed, MixedOptions};
use hf2q_models::quantize::presets::{GgufRecipe, QuantTarget};
use hf2q_models::quantize::rules::Overrides;
use hf2q_models::quantize::{quantize, QuantizeOptions, QuantizeReport};
use hf2q_models::Model;
use hf2q_tensor::GgmlType;

use crate::args::{open_device, DeviceChoice, KvTypeChoice};
use crate::pull;

#[derive(clap::Args, Debug)]
pub struct QuantizeArgs {
    /// Input model: a .gguf file, a Hugging Face or MLX folder, or a built-in name.
    pub input: String,
    /// Output: a .gguf file for GGUF types, a new folder for MLX types.
    pub output: PathBuf,
    /// Target: a llama.cpp preset (Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K
    /// Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 F16 BF16 F32 MXFP4_MOE, with llama.cpp's per-tensor rules;
    /// GPT-OSS's MXFP4 experts stay as they are under every type), Q3_K / Q4_K / Q5_K (that type
    /// for every weight), or MLX affine mlxB / mlxBgG (B in 2,3,4,5,6,8; G in 32,64,128).
    #[arg(
        short = 't',
        long = "type",
        value_name = "T",
        required_unless_present = "target_bpw"
    )]
    pub ty: Option<String>,
    /// Mixed precision instead of --type: measure on --calib text how much each layer's
    /// attention / MLP matrices (and the embeddings) move the logits at each k-quant level,
    /// then spend this many bits per weight where they cut KL most. GGUF output.
    #[arg(long, value_name = "B", conflicts_with_all = ["ty", "imatrix", "pure"], requires = "calib")]
    pub target_bpw: Option<f64>,
    /// Calibration text for --target-bpw.
    #[arg(long, value_name = "TEXT")]
    pub calib: Option<PathBuf>,
    /// Calibration tokens (from the start of --calib) for --target-bpw: each measurement runs
    /// them once, and there is one measurement per layer group and level.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub calib_tokens: usize,
    /// --target-bpw: measure every level of every group (one forward each) instead of one
    /// level per group scaled by the weights' quantization error.
    #[arg(long)]
    pub exhaustive: bool,
    /// --target-bpw: where the measurement forwards run: `auto` uses the first NVIDIA GPU when
    /// there is one, else the CPU's fast kernels.
    #[arg(long, value_enum, value_name = "DEVICE", default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    #[command(flatten)]
    pub cuda: crate::args::CudaOptArgs,
    /// MLX group size when --type does not name one.
    #[arg(long, value_name = "G")]
    pub group_size: Option<usize>,
    /// Importance matrix (llama.cpp's GGUF imatrix format, e.g. from `hf2q imatrix`) weighting
    /// the rounding error: GGUF types use llama-quantize's importance-weighted quantizers, MLX
    /// types choose each group's scale and bias to minimise the weighted error (same layout).
    #[arg(long, value_name = "FILE")]
    pub imatrix: Option<PathBuf>,
    /// Every weight gets the preset's base type (no per-tensor rules), as llama-quantize --pure.
    #[arg(long)]
    pub pure: bool,
    /// Type of output.weight (llama-quantize --output-tensor-type).
    #[arg(long, value_name = "TYPE")]
    pub output_tensor_type: Option<String>,
    /// Type of token_embd.weight (llama-quantize --token-embedding-type).
    #[arg(long, value_name = "TYPE")]
    pub token_embedding_type: Option<String>,
    /// After writing, measure perplexity and KL against the input on this text and print a
    /// report card.
    #[arg(long, value_name = "TEXT")]
    pub eval: Option<PathBuf>,
    /// Tokens per evaluation chunk.
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub eval_ctx: usize,
    /// Evaluate at most N chunks (the reference CPU forward is slow on long texts).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub eval_chunks: usize,
    /// Also print progress as NDJSON on stdout (one object a line).
    #[arg(long)]
    pub json: bool,
}

/// The converters' progress (a tensor at a time) on the shared progress display.
pub struct Bar {
    label: String,
    /// What a step is, for the display ("tensors").
    unit: &'static str,
    bar: Mutex<Option<crate::progress::Progress>>,
}

impl Bar {
    pub fn new(label: impl Into<String>) -> Bar {
        Bar::counting(label, "tensors")
    }
    /// A bar whose steps are `unit` (e.g. "measurements").
    pub fn counting(label: impl Into<String>, unit: &'static str) -> Bar {
        Bar {
            label: label.into(),
            unit,
            bar: Mutex::new(None),
        }
    }
}

impl Progress for Bar {
    fn start(&self, total: usize) {
        *self.bar.lock().unwrap() = Some(crate::progress::Progress::new(
            self.label.clone(),
            total as u64,
            crate::progress::Unit::Items(self.unit),
        ));
    }
    fn tensor(&self, done: usize, name: &str, from: &str, to: &str) {
        if let Some(b) = &*self.bar.lock().unwrap() {
            b.set(done as u64, format!("{name} {from} -> {to}"));
        }
    }
    fn finish(&self) {
        if let Some(b) = self.bar.lock().unwrap().take() {
            b.finish("done");
        }
    }
    fn warn(&self, msg: &str) {
        match &*self.bar.lock().unwrap() {
            Some(b) => b.println(format!("warning: {msg}")),
            None => eprintln!("warning: {msg}"),
        }
    }
}

/// Opens a model argument (path or built-in name) for conversion.
pub fn open_source(arg: &str) -> Result<SourceModel> {
    let path = pull::resolve_model_arg(arg)?;
    SourceModel::open(&path).with_context(|| format!("opening {}", path.display()))
}

fn parse_type(s: &Option<String>) -> Result<Option<GgmlType>> {
    match s {
        None => Ok(None),
        Some(n) => match GgmlType::from_name(n) {
            Some(t) if hf2q_tensor::quant::can_quantize(t) => Ok(Some(t)),
            _ => bail!("'{n}' is not a ggml type hf2q can write"),
        },
    }
}

pub fn run(a: QuantizeArgs) -> Result<()> {
    crate::progress::set_json(a.json);
    if let Some(bpw) = a.target_bpw {
        return run_mixed(&a, bpw);
    }
    let ty = a.ty.clone().unwrap_or_default();
    let mut target = QuantTarget::parse(&ty, a.group_size)?;
    if let QuantTarget::Gguf(GgufRecipe { pure, .. }) = &mut target {
        *pure |= a.pure;
    }
    let overrides = Overrides {
        output: parse_type(&a.output_tensor_type)?,
        token_embd: parse_type(&a.token_embedding_type)?,
    };
    let imatrix = match &a.imatrix {
        Some(p) => {
            let m = Imatrix::load(p).with_context(|| format!("reading {}", p.display()))?;
            eprintln!(
                "imatrix: {} entries from {} ({} chunks of {})",
                m.len(),
                p.display(),
                m.chunk_count,
                m.chunk_size
            );
            Some(m)
        }
        None => None,
    };
    let src = open_source(&a.input)?;
    let bar = Bar::new(format!("quantize {ty}"));
    let t0 = Instant::now();
    let report = quantize(
        &src,
        &a.output,
        &QuantizeOptions {
            target,
            overrides,
            imatrix,
        },
        &bar,
    )
    .with_context(|| format!("writing {}", a.output.display()))?;
    let secs = t0.elapsed().as_secs_f64();
    print_summary(&report, &a.output, secs);
    let card = match &a.eval {
        Some(text) => Some(report_card(
            &src.path,
            None,
            &a.output,
            text,
            a.eval_ctx,
            a.eval_chunks,
            &report,
        )?),
        None => None,
    };
    json_result(
        &report,
        &a.output,
        secs,
        card.as_ref(),
        serde_json::json!({}),
    );
    Ok(())
}

/// `--target-bpw`: measure, allocate, write, print the allocation.
fn run_mixed(a: &QuantizeArgs, bpw: f64) -> Result<()> {
    let calib_path = a.calib.as_ref().expect("clap requires --calib");
    let text = std::fs::read_to_string(calib_path)
        .with_context(|| format!("reading {}", calib_path.display()))?;
    let src = open_source(&a.input)?;
    let model =
        Model::load(&src.path).with_context(|| format!("loading {}", src.path.display()))?;
    let mut calib = model.tokenizer().encode(&text, true, false)?;
    calib.truncate(a.calib_tokens.max(2));
    drop(model);
    let opts = MixedOptions {
        exhaustive: a.exhaustive,
        cuda: open_device(a.device, &a.cuda, KvTypeChoice::F16)?,
        ..MixedOptions::new(bpw, calib)
    };
    let measure = Bar::counting(format!("measure {bpw} bpw"), "measurements");
    let write = Bar::new(format!("mixed {bpw} bpw"));
    let t0 = Instant::now();
    let (report, alloc) = quantize_mixed(&src, &a.output, &opts, &measure, &write)
        .with_context(|| format!("writing {}", a.output.display()))?;
    if !crate::progress::json_on() {
        println!(
            "allocation ({} groups, estimated KL {:.5} = sum of per-group measurements):",
            alloc.groups.len(),
            alloc.estimated_kl
        );
        for g in &alloc.groups {
            let types: Vec<String> = g.types.iter().map(|t| t.to_string()).collect();
            println!(
                "  {:14} {:16} KL {:.5}  {:8.2} MB",
                g.name,
                types.join("+"),
                g.kl,
                g.bytes as f64 / 1e6
            );
        }
    }
    let q = QuantizeReport {
        written: report,
        ..Default::default()
    };
    let secs = t0.elapsed().as_secs_f64();
    print_summary(&q, &a.output, secs);
    let card = match &a.eval {
        Some(text) => Some(report_card(
            &src.path,
            None,
            &a.output,
            text,
            a.eval_ctx,
            a.eval_chunks,
            &q,
        )?),
        None => None,
    };
    let groups: Vec<serde_json::Value> = alloc
        .groups
        .iter()
        .map(|g| {
            let types: Vec<String> = g.types.iter().map(|t| t.to_string()).collect();
            serde_json::json!({"name": g.name, "types": types, "kl": g.kl, "bytes": g.bytes})
        })
        .collect();
    json_result(
        &q,
        &a.output,
        secs,
        card.as_ref(),
        serde_json::json!({"allocation": {"groups": groups, "estimated_kl": alloc.estimated_kl}}),
    );
    Ok(())
}

pub(crate) fn print_summary(r: &QuantizeReport, out: &Path, secs: f64) {
    let w = &r.written;
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    for t in &w.tensors {
        *counts.entry(t.2.clone()).or_default() += 1;
    }
    let types: Vec<String> = counts.iter().map(|(k, v)| format!("{k} x{v}")).collect();
    eprintln!(
        "wrote {} ({:.1} MB, {:.2} bits per weight, {}) in {:.1} s{}",
        out.display(),
        w.bytes_written as f64 / 1e6,
        w.bits_per_weight(),
        types.join(", "),
        secs,
        if r.fallbacks.is_empty() {
            String::new()
        } else {
            format!("; {} tensors used a fallback type", r.fallbacks.len())
        }
    );
    if r.imatrix_used > 0 {
        eprintln!(
            "{} tensors quantized with importance weights",
            r.imatrix_used
        );
    }
}

/// Perplexity and KL of the output against the input (with `adapter` applied, when given) on
/// `text`, printed as a card unless `--json` is on.
#[allow(clippy::too_many_arguments)]
pub(crate) fn report_card(
    input: &Path,
    adapter: Option<&Path>,
    output: &Path,
    text: &Path,
    ctx: usize,
    chunks: usize,
    r: &QuantizeReport,
) -> Result<PerplexityReport> {
    let s = std::fs::read_to_string(text).with_context(|| format!("reading {}", text.display()))?;
    let mut base = Model::load(input).with_context(|| format!("loading {}", input.display()))?;
    if let Some(a) = adapter {
        base.load_adapter(a)
            .with_context(|| format!("loading the adapter {}", a.display()))?;
    }
    let mut quant = Model::load(output).with_context(|| format!("loading {}", output.display()))?;
    // The SIMD kernels, as `run` and `perplexity` use by default: their own KL against the f32
    // reference (~1e-7 per token) is far below any quantization's, and the card is ~10x faster.
    base.set_matmul_path(hf2q_cpu::MatmulPath::Fast);
    quant.set_matmul_path(hf2q_cpu::MatmulPath::Fast);
    eprintln!(
        "evaluating on {} ({} chunks of {ctx} tokens at most) ...",
        text.display(),
        chunks
    );
    let opts = PerplexityOptions {
        ctx,
        max_chunks: Some(chunks),
    };
    let bar = crate::progress::Progress::new("evaluate", 0, crate::progress::Unit::Items("chunks"));
    let rep = perplexity(&quant, Some(&base), &s, &opts, &mut |i, n, p| {
        bar.set_total(n as u64);
        bar.set(i as u64, format!("PPL {p:.4}"));
    })?;
    bar.finish(format!("{} chunks", rep.n_chunks));
    if !crate::progress::json_on() {
        print_card(&rep, output, r);
    }
    Ok(rep)
}

fn print_card(rep: &PerplexityReport, output: &Path, r: &QuantizeReport) {
    let kl = rep.kl.as_ref().expect("base given");
    println!("report card: {}", output.display());
    println!(
        "  size              {:.1} MB",
        r.written.bytes_written as f64 / 1e6
    );
    println!("  bits per weight   {:.3}", r.written.bits_per_weight());
    println!(
        "  perplexity        {:.4} +/- {:.4}   (input: {:.4}, {:+.2}%)",
        rep.ppl,
        rep.ppl_err,
        kl.base_ppl,
        100.0 * (rep.ppl / kl.base_ppl - 1.0)
    );
    println!(
        "  KL vs input       {:.6} +/- {:.6} nats/token (max {:.4})",
        kl.mean_kl, kl.mean_kl_err, kl.max_kl
    );
    println!("  same top token    {:.2}%", kl.same_top_pct);
    println!(
        "  scored            {} tokens in {} chunks of {}",
        rep.n_scored, rep.n_chunks, rep.ctx
    );
}

/// The closing NDJSON line under `--json`: what was written (size, bits per weight, tensor
/// types), the seconds it took, the report card (`perplexity --json`'s result against the
/// input) when one was made, and `extra` fields of the caller.
pub(crate) fn json_result(
    r: &QuantizeReport,
    out: &Path,
    secs: f64,
    card: Option<&PerplexityReport>,
    extra: serde_json::Value,
) {
    let w = &r.written;
    let mut types: std::collections::BTreeMap<String, usize> = Default::default();
    for t in &w.tensors {
        *types.entry(t.2.clone()).or_default() += 1;
    }
    let mut v = serde_json::json!({
        "event": "result",
        "output": out.display().to_string(),
        "bytes": w.bytes_written,
        "bits_per_weight": w.bits_per_weight(),
        "types": types,
        "fallbacks": r.fallbacks.len(),
        "imatrix_used": r.imatrix_used,
        "seconds": secs,
        "card": card,
    });
    if let (Some(o), serde_json::Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
    crate::progress::json_line(v);
}
