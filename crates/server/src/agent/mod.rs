//! Agent mode: the tools a model may call to look at and change files in one workspace folder
//! and run commands there, and the approval gate in front of every tool that changes
//! something.
//!
//! Tools: `list_dir`, `read_file` (line ranges) and `search` (a regular expression over files)
//! run at once; `write_file`, `edit_file` (one exact replacement) and `run_command` (in the
//! workspace, with a time limit and an output cap) wait for the person's decision: approve,
//! deny, or always allow this tool for this chat. A pending approval that gets no decision
//! within the approval timeout (120 s by default) is denied. Nothing in this module runs a
//! changing tool without an [`Agent::decide`] that approves it (or a standing "always" for
//! that tool in that chat), so an API caller without a person gets denials, never actions.
//!
//! The model does not talk to this module: the page (or `hf2q chat --agent`) runs the agent
//! loop against the public API and hands the model's calls to [`Agent::call`]. Confinement to
//! the workspace is [`fs`]'s, command execution [`exec`]'s. Off unless the server was started
//! with a workspace; the HTTP routes are `routes/agent.rs`.
//!
//! What it is not: an OS sandbox (see [`exec`]), or persistent (approvals and "always" live in
//! memory, per server run).

pub mod exec;
pub mod fs;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub use fs::Workspace;

/// Settings of agent mode.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub workspace: Workspace,
    /// `run_command`'s time limit.
    pub command_timeout: Duration,
    /// How long a pending approval waits before it is denied.
    pub approval_timeout: Duration,
}

impl AgentConfig {
    pub fn new(workspace: &Path) -> std::io::Result<AgentConfig> {
        Ok(AgentConfig {
            workspace: Workspace::open(workspace)?,
            command_timeout: Duration::from_secs(60),
            approval_timeout: Duration::from_secs(120),
        })
    }
}

/// Why a tool did not give a result.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ToolError {
    /// Refused before doing anything (a path outside the workspace, an unknown tool).
    #[error("refused: {0}")]
    Refused(String),
    /// Bad arguments, or the operation failed (the message goes back to the model).
    #[error("{0}")]
    Failed(String),
}

pub type ToolResult = Result<String, ToolError>;

/// The system prompt of agent mode (the page and `hf2q chat --agent` put it first).
pub const SYSTEM_PROMPT: &str = "You are an assistant working in a folder of files (the \
workspace). Use the tools to look at files and change them when the user asks. Paths are \
relative to the workspace folder (. is the folder itself). Call a tool only \
when it is needed; after a tool result, answer the user briefly.";

/// Tools that change something: they need an approval.
pub const CHANGING: &[&str] = &["write_file", "edit_file", "run_command"];

/// The tools as OpenAI `tools` entries (what the page sends with each request).
pub fn tool_definitions() -> Value {
    let f = |name: &str, desc: &str, props: Value, required: &[&str]| {
        json!({"type": "function", "function": {"name": name, "description": desc,
            "parameters": {"type": "object", "properties": props, "required": required}}})
    };
    let path = json!({"type": "string", "description": "a path relative to the workspace folder; . is the folder itself"});
    json!([
        f(
            "list_dir",
            "List the files and folders in a folder of the workspace.",
            json!({"path": path}),
            &["path"]
        ),
        f(
            "read_file",
            "Read lines of a text file of the workspace (1-based, inclusive).",
            json!({"path": path, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}}),
            &["path"]
        ),
        f(
            "search",
            "Find the lines matching a regular expression in the files under a folder.",
            json!({"pattern": {"type": "string"}, "path": path}),
            &["pattern"]
        ),
        f(
            "write_file",
            "Create or overwrite a text file in the workspace.",
            json!({"path": path, "content": {"type": "string"}}),
            &["path", "content"]
        ),
        f(
            "edit_file",
            "Replace the one occurrence of old_text by new_text in a file.",
            json!({"path": path, "old_text": {"type": "string"}, "new_text": {"type": "string"}}),
            &["path", "old_text", "new_text"]
        ),
        f(
            "run_command",
            "Run a shell command in the workspace folder.",
            json!({"command": {"type": "string"}}),
            &["command"]
        ),
    ])
}

fn arg<'a>(args: &'a Value, k: &str) -> Result<&'a str, ToolError> {
    args.get(k)
        .and_then(Value::as_str)
        .ok_or_else(|| ToolError::Failed(format!("missing string argument '{k}'")))
}

fn line(args: &Value, k: &str) -> Result<Option<usize>, ToolError> {
    match args.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| ToolError::Failed(format!("'{k}' must be a positive integer"))),
    }
}

/// A pending approval.
#[derive(Clone, Debug)]
pub struct Pending {
    pub id: String,
    pub chat: String,
    pub tool: String,
    pub arguments: Value,
    /// What approving does: the diff of a file change, or the command line.
    pub preview: String,
    created: Instant,
}

impl Pending {
    pub fn json(&self, timeout: Duration) -> Value {
        let left = timeout.saturating_sub(self.created.elapsed());
        json!({"id": self.id, "chat_id": self.chat, "tool": self.tool, "arguments": self.arguments,
               "preview": self.preview, "expires_in_s": left.as_secs_f64()})
    }
}

/// What [`Agent::call`] or [`Agent::decide`] gives back.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The tool ran; its result text (or error) is the tool message for the model.
    Done(Result<String, ToolError>),
    /// Waiting for a decision on this approval id.
    Pending(String),
    /// Denied by the person, or by the timeout.
    Denied(String),
}

/// A person's decision on a pending approval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Approve,
    Deny,
    /// Approve, and run this tool without asking for the rest of the chat.
    Always,
}

/// Agent state of one server (cheap to clone).
#[derive(Clone)]
pub struct Agent {
    pub cfg: Arc<AgentConfig>,
    pending: Arc<Mutex<HashMap<String, Pending>>>,
    /// (chat, tool) pairs the person always allows.
    always: Arc<Mutex<HashSet<(String, String)>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Agent {
    pub fn new(cfg: AgentConfig) -> Agent {
        Agent {
            cfg: Arc::new(cfg),
            pending: Arc::default(),
            always: Arc::default(),
        }
    }

    /// Runs a read-only tool, or a changing one that is always allowed in `chat`; holds any
    /// other changing tool as a pending approval (after checking it can be previewed: a path
    /// outside the workspace is refused here, before anyone is asked). Blocking.
    pub fn call(&self, chat: &str, tool: &str, args: &Value) -> Outcome {
        if !CHANGING.contains(&tool) {
            return Outcome::Done(self.run(tool, args));
        }
        let preview = match self.preview(tool, args) {
            Ok(p) => p,
            Err(e) => return Outcome::Done(Err(e)),
        };
        if lock(&self.always).contains(&(chat.to_string(), tool.to_string())) {
            return Outcome::Done(self.run(tool, args));
        }
        self.expire();
        static N: AtomicU64 = AtomicU64::new(1);
        let id = format!("approval-{}", N.fetch_add(1, Ordering::Relaxed));
        let p = Pending {
            id: id.clone(),
            chat: chat.to_string(),
            tool: tool.to_string(),
            arguments: args.clone(),
            preview,
            created: Instant::now(),
        };
        lock(&self.pending).insert(id.clone(), p);
        Outcome::Pending(id)
    }

    /// Applies a decision to a pending approval: runs the tool when approved. An unknown id
    /// (decided already, or expired) is `None`. Blocking.
    pub fn decide(&self, id: &str, d: Decision) -> Option<Outcome> {
        let expired = self.expire();
        let p = lock(&self.pending).remove(id);
        let Some(p) = p else {
            return expired
                .iter()
                .any(|e| e == id)
                .then(|| Outcome::Denied("no decision within the time limit".into()));
        };
        Some(match d {
            Decision::Deny => Outcome::Denied("the person denied this action".into()),
            Decision::Approve | Decision::Always => {
                if d == Decision::Always {
                    lock(&self.always).insert((p.chat.clone(), p.tool.clone()));
                }
                Outcome::Done(self.run(&p.tool, &p.arguments))
            }
        })
    }

    /// Pending approvals (oldest first), after denying the expired ones.
    pub fn pending(&self) -> Vec<Pending> {
        self.expire();
        let mut v: Vec<Pending> = lock(&self.pending).values().cloned().collect();
        v.sort_by_key(|p| p.created);
        v
    }

    /// The state of one approval: pending, or gone (decided or expired).
    pub fn get(&self, id: &str) -> Option<Pending> {
        self.expire();
        lock(&self.pending).get(id).cloned()
    }

    /// Removes approvals older than the timeout; returns their ids.
    fn expire(&self) -> Vec<String> {
        let t = self.cfg.approval_timeout;
        let mut m = lock(&self.pending);
        let old: Vec<String> = m
            .values()
            .filter(|p| p.created.elapsed() >= t)
            .map(|p| p.id.clone())
            .collect();
        for id in &old {
            m.remove(id);
        }
        old
    }

    fn preview(&self, tool: &str, args: &Value) -> ToolResult {
        let ws = &self.cfg.workspace;
        match tool {
            "write_file" => ws.preview_write(arg(args, "path")?, arg(args, "content")?),
            "edit_file" => ws.preview_edit(
                arg(args, "path")?,
                arg(args, "old_text")?,
                arg(args, "new_text")?,
            ),
            "run_command" => Ok(format!("$ {}", arg(args, "command")?)),
            other => Err(ToolError::Refused(format!("unknown tool '{other}'"))),
        }
    }

    /// Runs a tool (no approval check: callers are [`Agent::call`] and [`Agent::decide`]).
    fn run(&self, tool: &str, args: &Value) -> ToolResult {
        let ws = &self.cfg.workspace;
        match tool {
            "list_dir" => ws.list_dir(args.get("path").and_then(Value::as_str).unwrap_or(".")),
            "read_file" => ws.read_file(
                arg(args, "path")?,
                line(args, "start_line")?,
                line(args, "end_line")?,
            ),
            "search" => ws.search(
                arg(args, "pattern")?,
                args.get("path").and_then(Value::as_str).unwrap_or("."),
            ),
            "write_file" => ws.write_file(arg(args, "path")?, arg(args, "content")?),
            "edit_file" => ws.edit_file(
                arg(args, "path")?,
                arg(args, "old_text")?,
                arg(args, "new_text")?,
            ),
            "run_command" => {
                exec::run_command(ws.root(), arg(args, "command")?, self.cfg.command_timeout)
            }
            other => Err(ToolError::Refused(format!("unknown tool '{other}'"))),
        }
    }
}

#[cfg(test)]
mod tests;
