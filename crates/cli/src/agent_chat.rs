//! `hf2q chat --agent --workspace DIR`: the interactive chat with the agent's workspace tools.
//!
//! The same pieces as the server's agent mode: the tools, their confinement and the approval
//! gate are `hf2q_server::agent`'s; the prompt (tools through the chat template) and the
//! constraint that keeps calls well-formed are `hf2q_server::chat_tools`'; the calls are taken
//! out of the reply by `hf2q_models::tool_calls`. A changing tool prints its exact diff or
//! command and asks `[a]pprove / [d]eny / a[l]ways`; an answer after the approval time limit
//! counts as a denial (the gate decides, not the prompt). Each model turn renders the whole
//! conversation again (no KV reuse across turns).

use std::io::Write;

use anyhow::{bail, Result};
use hf2q_models::chat_template::{encode_chat_json, ChatTemplate, RenderOptions};
use hf2q_models::constraint::ConstraintEnv;
use hf2q_models::generate::{generate_constrained, GenerateParams};
use hf2q_models::tool_calls::{ToolCallParser, ToolEvent, ToolFormat};
use hf2q_models::Model;
use hf2q_server::agent::{tool_definitions, Agent, AgentConfig, Decision, Outcome, SYSTEM_PROMPT};
use hf2q_server::chat_tools::{self, output::call_id, render, ToolsRequest};
use rustyline::DefaultEditor;
use serde_json::{json, Value};

/// Most model turns for one message (each may call tools).
const STEPS: usize = 8;

pub struct AgentChat<'m> {
    model: &'m Model,
    template: ChatTemplate,
    format: ToolFormat,
    renders_tools: bool,
    tools: ToolsRequest,
    env: ConstraintEnv,
    agent: Agent,
    chat_id: String,
    ctx: usize,
    pub messages: Vec<Value>,
}

impl<'m> AgentChat<'m> {
    pub fn new(model: &'m Model, cfg: AgentConfig, ctx: usize) -> Result<AgentChat<'m>> {
        let template = match model.chat_template() {
            Some(t) => t.clone(),
            None => ChatTemplate::for_tokenizer(model.tokenizer())?,
        };
        let m = json!({"tools": tool_definitions()});
        let tools = chat_tools::parse_tools(m.as_object().expect("an object"))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .expect("the agent has tools");
        Ok(AgentChat {
            format: ToolFormat::detect(template.source()),
            renders_tools: ToolFormat::template_renders_tools(template.source()),
            template,
            tools,
            env: ConstraintEnv::new(model.tokenizer(), model.vocab_size())?,
            agent: Agent::new(cfg),
            chat_id: format!("cli-{}", std::process::id()),
            model,
            ctx,
            messages: Vec::new(),
        })
    }

    pub fn workspace(&self) -> String {
        self.agent.cfg.workspace.root().display().to_string()
    }

    /// One user message: model turns and tool calls until a reply without calls.
    pub fn turn(
        &mut self,
        system: Option<&str>,
        text: &str,
        params: &GenerateParams,
        rl: &mut DefaultEditor,
    ) -> Result<()> {
        self.messages.push(json!({"role": "user", "content": text}));
        for _ in 0..STEPS {
            let (content, calls) = self.model_turn(system, params)?;
            let mut msg = json!({"role": "assistant", "content": content});
            if !calls.is_empty() {
                msg["tool_calls"] = Value::Array(calls.clone());
            }
            self.messages.push(msg);
            if calls.is_empty() {
                return Ok(());
            }
            for c in &calls {
                let result = self.run_call(c, rl)?;
                self.messages
                    .push(json!({"role": "tool", "tool_call_id": c["id"],
                    "name": c["function"]["name"], "content": result}));
            }
        }
        eprintln!("(stopped after {STEPS} tool rounds)");
        Ok(())
    }

    /// Generates one reply, streaming its text and calls; returns the content and the calls
    /// (OpenAI's shape, with the arguments as JSON text and fresh ids).
    fn model_turn(
        &self,
        system: Option<&str>,
        params: &GenerateParams,
    ) -> Result<(String, Vec<Value>)> {
        let mut all = Vec::with_capacity(self.messages.len() + 1);
        let sys = match system {
            Some(s) => format!("{SYSTEM_PROMPT}\n\n{s}"),
            None => SYSTEM_PROMPT.to_string(),
        };
        all.push(json!({"role": "system", "content": sys}));
        all.extend(self.messages.iter().cloned());
        let (msgs, tools_var) =
            render::template_inputs(&all, Some(&self.tools), self.format, self.renders_tools);
        let opts = RenderOptions {
            add_generation_prompt: true,
            tools: tools_var.as_ref(),
            extra: None,
        };
        let tok = self.model.tokenizer();
        let ids = encode_chat_json(tok, &self.template, &msgs, &opts)?;
        if ids.len() >= self.ctx {
            bail!("the conversation is {} tokens; the context holds {} (/reset, or a larger --ctx-size)", ids.len(), self.ctx);
        }
        let mut constraint =
            render::constraint(&self.env, tok, self.format, Some(&self.tools), None)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut parser = ToolCallParser::new(self.format, self.tools.names(), true);
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let mut show = |events: Vec<ToolEvent>, out: &mut std::io::StdoutLock<'_>| {
            for e in events {
                match e {
                    ToolEvent::Content(t) => {
                        content.push_str(&t);
                        let _ = out.write_all(t.as_bytes());
                    }
                    // The model's reasoning (harmony's analysis channel) is not its reply.
                    ToolEvent::Reasoning(_) => {}
                    ToolEvent::Start { name, .. } => {
                        calls.push((name.clone(), String::new()));
                        let _ = write!(out, "\n→ {name} ");
                    }
                    ToolEvent::Args { text, .. } => {
                        if let Some(c) = calls.last_mut() {
                            c.1.push_str(&text);
                        }
                        let _ = out.write_all(text.as_bytes());
                    }
                    ToolEvent::End { complete, .. } => {
                        if !complete {
                            calls.pop();
                            let _ = write!(out, " (cut off: not run)");
                        }
                    }
                }
            }
            let _ = out.flush();
        };
        let mut session = self.model.session(self.ctx);
        let mut on_text = |piece: &str| {
            let ev = parser.push(piece);
            show(ev, &mut out);
            true
        };
        generate_constrained(
            &mut session,
            &ids,
            params,
            constraint.as_mut(),
            &mut on_text,
        )?;
        let ev = parser.finish();
        let mut out = std::io::stdout().lock();
        show(ev, &mut out);
        let _ = writeln!(out);
        let calls = calls
            .into_iter()
            .map(|(name, args)| {
                json!({"id": call_id(self.format), "type": "function",
                "function": {"name": name, "arguments": args}})
            })
            .collect();
        Ok((content, calls))
    }

    /// Runs one call through the gate, asking in the terminal when it holds it.
    fn run_call(&self, call: &Value, rl: &mut DefaultEditor) -> Result<String> {
        let name = call["function"]["name"].as_str().unwrap_or_default();
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap_or("{}"))
                .unwrap_or_else(|_| json!({}));
        let mut outcome = self.agent.call(&self.chat_id, name, &args);
        if let Outcome::Pending(id) = &outcome {
            let preview = self.agent.get(id).map(|p| p.preview).unwrap_or_default();
            eprintln!("{name} wants to:\n{preview}");
            let secs = self.agent.cfg.approval_timeout.as_secs();
            let d = loop {
                let answer = rl.readline(&format!("[a]pprove, [d]eny, a[l]ways allow {name} in this chat (denied after {secs} s)? "));
                match answer.map(|a| a.trim().to_lowercase()) {
                    Ok(a) if a == "a" || a == "approve" || a == "y" => break Decision::Approve,
                    Ok(a) if a == "l" || a == "always" => break Decision::Always,
                    Ok(a) if a == "d" || a == "deny" || a == "n" => break Decision::Deny,
                    Ok(_) => continue,
                    Err(_) => break Decision::Deny,
                }
            };
            outcome = self
                .agent
                .decide(id, d)
                .unwrap_or(Outcome::Denied("no decision within the time limit".into()));
        }
        let text = match outcome {
            Outcome::Done(Ok(r)) => r,
            Outcome::Done(Err(e)) => format!("Error: {e}"),
            Outcome::Denied(why) => {
                format!("Denied: {why}. Do not retry this action unless the person asks.")
            }
            Outcome::Pending(_) => "Denied: not approved".into(),
        };
        let shown: String = text.chars().take(2000).collect();
        eprintln!("[{name}] {shown}");
        Ok(text)
    }
}
