//! `hf2q chat`: an interactive conversation (rustyline: line editing, persistent history).
//!
//! Each turn re-renders the whole conversation with the chat template. When the new prompt
//! starts with exactly the tokens already in the KV cache (the usual case: the template only
//! appended the new turn), only the new tokens are fed; otherwise the cache is rebuilt. When
//! the conversation outgrows the context, the oldest turns are dropped.
//! Ctrl-C at the prompt clears the line; during a reply it stops that reply.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Result;
use hf2q_models::chat_template::ChatMessage;
use hf2q_models::generate::{generate, FinishReason, GenerateParams};
use hf2q_models::{Model, Session};
use rustyline::error::ReadlineError;

use crate::args::{self, SampleArgs};

#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    /// Model: built-in name or path [default: smollm2-135m].
    pub model: Option<String>,
    /// System prompt (change it during the chat with /system TEXT).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(short = 'n', long, value_name = "N", default_value_t = 1024)]
    pub max_tokens: usize,
    /// Print token counts and speed after every reply.
    #[arg(long)]
    pub stats: bool,
    /// Agent mode (needs --workspace): the model may use the workspace tools; every change and
    /// command asks for your approval first.
    #[arg(long, requires = "workspace")]
    pub agent: bool,
    #[command(flatten)]
    pub agent_args: args::AgentArgs,
    #[command(flatten)]
    pub sample: SampleArgs,
}

const HELP: &str = "\
commands:
  /reset          start a new conversation (keeps the system prompt)
  /system TEXT    set the system prompt and start a new conversation
  /system         show the system prompt
  /help           this list
  /quit, /exit    leave (Ctrl-D too)
Ctrl-C stops a reply while it is being written.";

/// Tokens held back for the reply when trimming old turns to fit the context.
const REPLY_RESERVE: usize = 256;

struct Conversation<'m> {
    model: &'m Model,
    session: Session<'m>,
    /// Exactly the tokens in the session's cache.
    cached: Vec<u32>,
    system: Option<String>,
    messages: Vec<ChatMessage>,
}

impl Conversation<'_> {
    fn reset(&mut self) {
        self.messages.clear();
        self.session.reset();
        self.cached.clear();
    }

    /// Renders the conversation, dropping the oldest turns until it fits with room to reply.
    fn prompt_tokens(&mut self) -> Result<Vec<u32>> {
        let ctx = self.session.max_context();
        let budget = ctx.saturating_sub(REPLY_RESERVE.min(ctx / 2));
        loop {
            let ids = args::chat_tokens(self.model, self.system.as_deref(), &self.messages)?;
            if ids.len() <= budget {
                return Ok(ids);
            }
            if self.messages.len() <= 1 {
                anyhow::bail!(
                    "this message is {} tokens; the context holds {ctx} (try a larger --ctx-size)",
                    ids.len()
                );
            }
            // Drop the oldest exchange (user + assistant), keeping the roles alternating.
            let n = self.messages.len().min(2).min(self.messages.len() - 1);
            self.messages.drain(..n);
            eprintln!("(dropped the oldest turn to fit the context)");
        }
    }

    /// One user turn: returns after the reply has been streamed (or stopped).
    fn turn(
        &mut self,
        text: &str,
        params: &GenerateParams,
        stop: &AtomicBool,
        stats: bool,
    ) -> Result<()> {
        self.messages.push(args::message("user", text));
        let ids = match self.prompt_tokens() {
            Ok(ids) => ids,
            Err(e) => {
                self.messages.pop();
                return Err(e);
            }
        };
        let reuse = !self.cached.is_empty()
            && ids.len() > self.cached.len()
            && ids.starts_with(&self.cached);
        if !reuse {
            self.session.reset();
            self.cached.clear();
        }
        let feed = ids[self.cached.len()..].to_vec();

        stop.store(false, Ordering::SeqCst);
        let mut reply = String::new();
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let mut on_text = |piece: &str| -> bool {
            reply.push_str(piece);
            let ok = out
                .write_all(piece.as_bytes())
                .and_then(|_| out.flush())
                .is_ok();
            ok && !stop.load(Ordering::SeqCst)
        };
        let result = generate(&mut self.session, &feed, params, &mut on_text);
        let _ = writeln!(out);
        let _ = out.flush();
        let st = match result {
            Ok(st) => st,
            Err(e) => {
                // The cache is in an unknown state: start it afresh next turn.
                self.session.reset();
                self.cached.clear();
                self.messages.pop();
                return Err(e.into());
            }
        };
        // The cache now holds the fed prompt and every sampled token but the last.
        self.cached.extend_from_slice(&feed);
        let fed_generated = self.session.pos().saturating_sub(self.cached.len());
        self.cached
            .extend_from_slice(&st.tokens[..fed_generated.min(st.tokens.len())]);
        if self.cached.len() != self.session.pos() {
            self.session.reset();
            self.cached.clear();
        }
        match st.finish_reason {
            FinishReason::Cancelled => eprintln!("[stopped]"),
            FinishReason::Length => eprintln!("[reply cut at {} tokens]", st.completion_tokens),
            FinishReason::Stop => {}
        }
        if stats {
            args::print_stats(&st);
        }
        self.messages.push(args::message("assistant", &reply));
        Ok(())
    }
}

pub fn chat(a: ChatArgs) -> Result<()> {
    a.sample.params(a.max_tokens, &Default::default())?;
    let agent_cfg = if a.agent {
        a.agent_args.config()?
    } else {
        None
    };
    let (path, mut model) = args::load_model(a.model.as_deref())?;
    a.sample.configure(&mut model)?;
    let ctx = a.sample.context(&model)?;
    // The model's recommended sampling under the flags given.
    let params = a.sample.params(a.max_tokens, model.generation_defaults())?;
    if model.chat_template().is_none() {
        eprintln!("note: this model has no chat template; using a generic one");
    }

    // Ctrl-C: while a reply streams the terminal is in normal mode, so it arrives as a signal;
    // the handler only raises a flag the reply loop checks. At the prompt rustyline reads it
    // as a key instead.
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        if let Err(e) = ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst)) {
            eprintln!("note: Ctrl-C will end the program, not just the reply ({e})");
        }
    }

    let mut rl = rustyline::DefaultEditor::new()?;
    let history = crate::pull::home().ok().map(|h| h.join("chat_history.txt"));
    if let Some(h) = &history {
        let _ = rl.load_history(h);
    }
    let name = model
        .info()
        .name
        .unwrap_or_else(|| path.display().to_string());
    eprintln!("hf2q chat with {name} (context {ctx} tokens). /help for commands, Ctrl-D to quit.");

    let mut agent = match agent_cfg {
        Some(cfg) => {
            let ag = crate::agent_chat::AgentChat::new(&model, cfg, ctx)?;
            eprintln!(
                "agent mode: workspace {} (changes and commands ask first)",
                ag.workspace()
            );
            Some(ag)
        }
        None => None,
    };
    let mut conv = Conversation {
        model: &model,
        session: model.session(ctx),
        cached: Vec::new(),
        system: a.system.clone(),
        messages: Vec::new(),
    };
    loop {
        let line = match rl.readline(">>> ") {
            Ok(l) => l,
            Err(ReadlineError::Interrupted) => continue,
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e.into()),
        };
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        let _ = rl.add_history_entry(text);
        if let Some(cmd) = text.strip_prefix('/') {
            let (name, rest) = cmd.split_once(char::is_whitespace).unwrap_or((cmd, ""));
            let rest = rest.trim();
            match name {
                "quit" | "exit" | "q" => break,
                "help" | "?" => eprintln!("{HELP}"),
                "reset" | "clear" => {
                    conv.reset();
                    if let Some(ag) = agent.as_mut() {
                        ag.messages.clear();
                    }
                    eprintln!("(new conversation)");
                }
                "system" if rest.is_empty() => match &conv.system {
                    Some(s) => eprintln!("system prompt: {s}"),
                    None => eprintln!("no system prompt (set one with /system TEXT)"),
                },
                "system" => {
                    conv.system = Some(rest.to_string());
                    conv.reset();
                    if let Some(ag) = agent.as_mut() {
                        ag.messages.clear();
                    }
                    eprintln!("(system prompt set; new conversation)");
                }
                _ => eprintln!("unknown command /{name}; /help lists the commands"),
            }
            continue;
        }
        let r = match agent.as_mut() {
            Some(ag) => ag.turn(conv.system.as_deref(), text, &params, &mut rl),
            None => conv.turn(text, &params, &stop, a.stats),
        };
        if let Err(e) = r {
            eprintln!("error: {}", crate::error_text(&e));
        }
    }
    if let Some(h) = &history {
        if let Some(dir) = h.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = rl.save_history(h);
    }
    Ok(())
}
