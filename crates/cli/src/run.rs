//! `hf2q run`: one prompt in, the generated text streamed to stdout, counts and speed to
//! stderr (or everything as one JSON object with `--json`).

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use hf2q_models::constraint::{ConstraintEnv, GrammarSpec};
use hf2q_models::generate::{generate_constrained, GenerateStats};

use crate::args::{self, SampleArgs};

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Model: built-in name or path [default: smollm2-135m].
    pub model: Option<String>,
    /// The prompt; `-p -` reads it from stdin.
    #[arg(short = 'p', long, value_name = "TEXT", conflicts_with = "file")]
    pub prompt: Option<String>,
    /// Read the prompt from FILE.
    #[arg(short = 'f', long, value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Tokenize the prompt as it is (no chat template; BOS as the model's metadata says) and
    /// print exactly the continuation, nothing else.
    #[arg(long)]
    pub raw: bool,
    /// System prompt for the chat template.
    #[arg(long, value_name = "TEXT", conflicts_with = "raw")]
    pub system: Option<String>,
    /// Most tokens to generate.
    #[arg(short = 'n', long, value_name = "N", default_value_t = 256)]
    pub max_tokens: usize,
    /// Print one JSON object (text, token counts, timings, finish reason, seed) instead of
    /// streaming.
    #[arg(long)]
    pub json: bool,
    /// Constrain the reply to JSON that follows the JSON Schema in FILE (constrained decoding:
    /// other tokens are never sampled).
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    pub json_schema: Option<PathBuf>,
    /// Constrain the reply to the Lark grammar in FILE (llguidance's dialect: `start:` rule,
    /// `%json {...}` for embedded schemas).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<PathBuf>,
    #[command(flatten)]
    pub sample: SampleArgs,
}

fn read_prompt(a: &RunArgs) -> Result<String> {
    match (&a.prompt, &a.file) {
        (Some(p), _) if p == "-" => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading the prompt from stdin")?;
            Ok(s)
        }
        (Some(p), _) => Ok(p.clone()),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading the prompt from {}", f.display())),
        (None, None) => bail!("no prompt: pass -p TEXT, -p - (read stdin) or -f FILE"),
    }
}

/// The `--json-schema` / `--grammar` constraint, read and checked before the model loads.
fn read_grammar(a: &RunArgs) -> Result<Option<GrammarSpec>> {
    let read = |p: &PathBuf| {
        std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
    };
    if let Some(p) = &a.json_schema {
        let v: serde_json::Value = serde_json::from_str(&read(p)?)
            .with_context(|| format!("{} is not JSON", p.display()))?;
        return Ok(Some(GrammarSpec::JsonSchema(v)));
    }
    Ok(a.grammar
        .as_ref()
        .map(read)
        .transpose()?
        .map(GrammarSpec::Lark))
}

pub fn run(a: RunArgs) -> Result<()> {
    // Check everything cheap before loading (or pulling) the model.
    a.sample.params(a.max_tokens, &Default::default())?;
    let spec = read_grammar(&a)?;
    let prompt = read_prompt(&a)?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let (path, mut model) = args::load_model(a.model.as_deref())?;
    a.sample.configure(&mut model)?;
    let ctx = a.sample.context(&model)?;
    // The model's recommended sampling under the flags given.
    let params = a.sample.params(a.max_tokens, model.generation_defaults())?;
    let tok = model.tokenizer();
    let ids = if a.raw {
        // As-is: specials written in the prompt are parsed (the user owns the whole text), and
        // BOS is added when the model's metadata asks for it.
        tok.encode(&prompt, true, true)?
    } else {
        args::chat_tokens(
            &model,
            a.system.as_deref(),
            &[args::message("user", &prompt)],
        )?
    };
    if ids.is_empty() {
        bail!("the prompt produced no tokens");
    }
    let mut constraint = match &spec {
        Some(spec) => {
            let env = ConstraintEnv::new(model.tokenizer(), model.vocab_size())?;
            let what = if a.json_schema.is_some() {
                "--json-schema"
            } else {
                "--grammar"
            };
            let g = env
                .compile(spec)
                .with_context(|| format!("{what}: cannot constrain to it"))?;
            Some(env.constraint(&g))
        }
        None => None,
    };
    let mut session = model.session(ctx);

    let mut text = String::new();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut write_failed = None;
    let stats = {
        let mut on_text = |piece: &str| -> bool {
            if a.json {
                text.push_str(piece);
                return true;
            }
            // A closed pipe (e.g. `| head`) ends generation quietly.
            match out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
                Ok(()) => true,
                Err(e) => {
                    write_failed = Some(e);
                    false
                }
            }
        };
        generate_constrained(
            &mut session,
            &ids,
            &params,
            constraint.as_mut(),
            &mut on_text,
        )?
    };
    if let Some(e) = write_failed {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e).context("writing to stdout");
        }
        return Ok(());
    }
    if a.json {
        let obj = json_result(&path, &text, &stats);
        writeln!(out, "{}", serde_json::to_string_pretty(&obj)?)?;
    } else if !a.raw {
        // A chat reply is a message: end it with a newline. Raw output is exactly the
        // continuation.
        writeln!(out)?;
    }
    out.flush()?;
    if !a.json {
        args::print_stats(&stats);
    }
    Ok(())
}

fn json_result(path: &std::path::Path, text: &str, st: &GenerateStats) -> serde_json::Value {
    serde_json::json!({
        "model": path.display().to_string(),
        "text": text,
        "finish_reason": st.finish_reason,
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.completion_tokens,
        "prefill_secs": st.prefill_secs,
        "decode_secs": st.decode_secs,
        "prompt_tokens_per_sec": st.prefill_tokens_per_sec(),
        "completion_tokens_per_sec": st.decode_tokens_per_sec(),
        "seed": st.seed,
    })
}
