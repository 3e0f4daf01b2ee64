// hf2q web chat, agent mode: runs the model's tool calls through /api/agent and shows each
// call, its approval and its result in the transcript. Read-only tools run at once; a change
// (write_file, edit_file, run_command) comes back "pending" with the exact diff or command,
// and runs only when the person approves it here. Loaded before app.js, whose globals
// ($, state, headers, render, ...) these functions use when called.
"use strict";

/// GET /api/agent: whether the server has a workspace, and the tool definitions.
async function loadAgent() {
  state.agent = null;
  try {
    const r = await fetch("/api/agent", { headers: headers() });
    const j = await r.json();
    if (r.ok && j.enabled) state.agent = j;
  } catch (_) { /* agent mode unavailable */ }
  const on = !!state.agent;
  $("agent-toggle").hidden = !on;
  $("workspace").textContent = on ? "workspace: " + state.agent.workspace : "";
}

function agentOn() {
  return !!state.agent && $("agent-mode").checked;
}

async function agentPost(path, body) {
  const r = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body) });
  const j = await r.json();
  if (!r.ok) throw new Error(j.error ? j.error.message : r.status + " " + r.statusText);
  return j;
}

/// The text a tool message carries back to the model for an /api/agent answer.
function toolText(j) {
  switch (j.status) {
    case "done": return j.result;
    case "denied": return "Denied: " + j.reason + ". Do not retry this action unless the person asks.";
    case "refused": return "Refused: " + j.error;
    default: return "Error: " + (j.error || j.status);
  }
}

function fillToolMessage(div, m) {
  div.textContent = "";
  const head = document.createElement("div");
  head.className = "toolhead";
  head.textContent = m.name + (m.status ? " — " + m.status : "");
  div.append(head);
  if (m.preview) {
    const p = document.createElement("pre");
    p.className = "preview";
    p.textContent = m.preview;
    div.append(p);
  }
  if (m.content) {
    const pre = document.createElement("pre");
    pre.className = "result";
    pre.textContent = m.content;
    div.append(pre);
  }
}

/// Shows approve / deny / always buttons on the tool message `el`; resolves with the decision,
/// or "expired" when the server's time limit passes first (the server then denies).
function askApproval(el, approval, signal) {
  return new Promise((resolve) => {
    const bar = document.createElement("div");
    bar.className = "approval";
    const left = document.createElement("span");
    left.className = "countdown";
    const done = (d) => { clearInterval(timer); bar.remove(); resolve(d); };
    const button = (cls, label, d) => {
      const b = document.createElement("button");
      b.type = "button";
      b.className = cls;
      b.textContent = label;
      b.onclick = () => done(d);
      return b;
    };
    const until = performance.now() + approval.expires_in_s * 1000;
    const tick = () => {
      const s = Math.max(0, Math.round((until - performance.now()) / 1000));
      left.textContent = `denied automatically in ${s} s`;
      if (s <= 0) done("expired");
    };
    const timer = setInterval(tick, 250);
    tick();
    signal.addEventListener("abort", () => done("deny"));
    bar.append(button("approve", "Approve", "approve"), button("deny", "Deny", "deny"),
      button("always", "Always allow " + approval.tool + " in this chat", "always"), left);
    el.append(bar);
    el.scrollIntoView({ block: "end" });
  });
}

/// Runs one tool call of the model (asking for approval when the server holds it) and adds
/// its tool message to the chat.
async function runToolCall(chat, call, signal) {
  const m = { role: "tool", tool_call_id: call.id, name: call.function.name, content: "", status: "running" };
  chat.messages.push(m);
  saveChats();
  render();
  const el = $("messages").lastElementChild;
  let j;
  try {
    try { JSON.parse(call.function.arguments || "{}"); } catch (_) {
      throw new Error("the call was cut off (its arguments are not complete JSON); it was not run");
    }
    j = await agentPost("/api/agent/tool", { chat_id: chat.id, name: call.function.name, arguments: call.function.arguments });
    if (j.status === "pending") {
      m.status = "waiting for approval";
      m.preview = j.approval.preview;
      fillToolMessage(el, m);
      $("status").textContent = "waiting for your approval";
      const d = await askApproval(el, j.approval, signal);
      $("status").textContent = "generating…";
      if (d === "expired") {
        j = { status: "denied", reason: "no decision within the time limit" };
      } else {
        j = await agentPost("/api/agent/approvals/" + encodeURIComponent(j.approval.id), { decision: d });
        m.decision = d;
      }
    }
  } catch (e) {
    j = { status: "error", error: e.message };
  }
  m.status = j.status === "done" ? (m.decision ? (m.decision === "always" ? "approved (always)" : "approved") + ", done" : "done") : j.status;
  m.content = toolText(j);
  fillToolMessage(el, m);
  saveChats();
}
