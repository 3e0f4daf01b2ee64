// hf2q web chat: plain JavaScript over the public OpenAI-style API (/v1/models,
// /v1/chat/completions with streaming). Conversations and settings live in localStorage. The
// model picker lists the base and its served adapters (/v1/models). The Lab's sections are in
// lab*.js.
// Agent mode (agent.js) adds the workspace tools: the loop runs here, tools run through
// /api/agent, and changes wait for the person's approval.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE_CHATS = "hf2q.chats";
const STORE_SETTINGS = "hf2q.settings";
const STORE_CURRENT = "hf2q.current";

const state = { chats: [], current: null, model: null, controller: null };

// ---- storage -------------------------------------------------------------------------------

function load(key, fallback) {
  try {
    const v = JSON.parse(localStorage.getItem(key));
    return v === null ? fallback : v;
  } catch (_) {
    return fallback;
  }
}

function saveChats() {
  localStorage.setItem(STORE_CHATS, JSON.stringify(state.chats));
  localStorage.setItem(STORE_CURRENT, JSON.stringify(state.current));
}

const SETTING_FIELDS = ["system-prompt", "temperature", "top-p", "top-k", "max-tokens", "api-key", "agent-mode"];

function field(f) {
  const el = $(f);
  return el.type === "checkbox" ? el.checked : el.value;
}

function loadSettings() {
  const s = load(STORE_SETTINGS, {});
  for (const f of SETTING_FIELDS) {
    if (s[f] === undefined) continue;
    if ($(f).type === "checkbox") $(f).checked = s[f] === true;
    else $(f).value = s[f];
  }
}

function saveSettings() {
  const s = {};
  for (const f of SETTING_FIELDS) s[f] = field(f);
  localStorage.setItem(STORE_SETTINGS, JSON.stringify(s));
}

// ---- markdown (escape first, then a small safe subset) ------------------------------------

function esc(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function inline(text) {
  // Odd pieces between backticks are code; the others get emphasis and links.
  return text.split("`").map((part, i) => {
    if (i % 2 === 1) return "<code>" + esc(part) + "</code>";
    let s = esc(part);
    s = s.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
    s = s.replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    return s;
  }).join("");
}

function renderBlocks(text) {
  const out = [];
  let list = null; // "ul" | "ol"
  let para = [];
  const flushPara = () => { if (para.length) { out.push("<p>" + para.map(inline).join("<br>") + "</p>"); para = []; } };
  const closeList = () => { if (list) { out.push("</" + list + ">"); list = null; } };
  for (const line of text.split("\n")) {
    const h = /^(#{1,6})\s+(.*)$/.exec(line);
    const ul = /^\s*[-*+]\s+(.*)$/.exec(line);
    const ol = /^\s*\d+[.)]\s+(.*)$/.exec(line);
    if (h) { flushPara(); closeList(); const n = Math.min(h[1].length + 2, 6); out.push(`<h${n}>${inline(h[2])}</h${n}>`); }
    else if (ul || ol) {
      flushPara();
      const kind = ul ? "ul" : "ol";
      if (list !== kind) { closeList(); out.push("<" + kind + ">"); list = kind; }
      out.push("<li>" + inline((ul || ol)[1]) + "</li>");
    } else if (line.trim() === "") { flushPara(); closeList(); }
    else { closeList(); para.push(line); }
  }
  flushPara();
  closeList();
  return out.join("");
}

function markdown(src) {
  // Fenced code blocks first; an unclosed fence (still streaming) runs to the end.
  const parts = src.split(/^```/m);
  let html = "";
  parts.forEach((part, i) => {
    if (i % 2 === 0) { html += renderBlocks(part); return; }
    const nl = part.indexOf("\n");
    const lang = nl >= 0 ? part.slice(0, nl).trim() : part.trim();
    const code = nl >= 0 ? part.slice(nl + 1) : "";
    const cls = /^[\w+-]+$/.test(lang) ? ` class="language-${lang}"` : "";
    html += `<pre><button type="button" class="copy">copy</button><code${cls}>${esc(code.replace(/\n$/, ""))}</code></pre>`;
  });
  return html;
}

// ---- rendering -----------------------------------------------------------------------------

function currentChat() {
  return state.chats.find((c) => c.id === state.current) || null;
}

function renderList() {
  const ul = $("chat-list");
  ul.textContent = "";
  for (const c of state.chats) {
    const li = document.createElement("li");
    if (c.id === state.current) li.className = "active";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title || "New chat";
    open.onclick = () => { if (!state.controller) { state.current = c.id; saveChats(); render(); } };
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.title = "Delete";
    del.textContent = "×";
    del.onclick = () => {
      if (state.controller) return;
      state.chats = state.chats.filter((x) => x.id !== c.id);
      if (state.current === c.id) state.current = state.chats.length ? state.chats[0].id : null;
      saveChats();
      render();
    };
    li.append(open, del);
    ul.append(li);
  }
}

function messageEl(m) {
  const div = document.createElement("div");
  div.className = "msg " + m.role + (m.error ? " error" : "");
  fillMessage(div, m);
  return div;
}

function fillMessage(div, m) {
  if (m.role === "tool") { fillToolMessage(div, m); return; }
  if (m.role === "assistant" && !m.error) div.innerHTML = markdown(m.content);
  else div.textContent = m.content;
  if (m.reasoning) {
    // The model's reasoning (`reasoning_content`), folded above the answer; open while it is
    // all there is.
    const d = document.createElement("details");
    d.className = "reasoning";
    d.open = !m.content;
    const s = document.createElement("summary");
    s.textContent = "Reasoning";
    const t = document.createElement("div");
    t.textContent = m.reasoning;
    d.append(s, t);
    div.prepend(d);
  }
  for (const c of m.tool_calls || []) {
    if (!c) continue;
    const t = document.createElement("div");
    t.className = "toolcall";
    t.textContent = "→ " + c.function.name + " " + c.function.arguments;
    div.append(t);
  }
  if (m.note) {
    const n = document.createElement("div");
    n.className = "note";
    n.textContent = m.note;
    div.append(n);
  }
}

function render() {
  renderList();
  const box = $("messages");
  box.textContent = "";
  const chat = currentChat();
  if (chat) for (const m of chat.messages) box.append(messageEl(m));
  box.scrollTop = box.scrollHeight;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("input").disabled = false;
}

// ---- API -----------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const j = await r.json();
    if (!r.ok) throw new Error(j.error ? j.error.message : r.statusText);
    const m = j.data[0];
    const sel = $("model-select");
    const keep = state.model;
    sel.textContent = "";
    for (const x of j.data) {
      const o = document.createElement("option");
      o.value = x.id;
      o.textContent = x.parent ? x.id + " (adapter)" : x.id;
      sel.append(o);
    }
    sel.value = j.data.some((x) => x.id === keep) ? keep : m.id;
    state.model = sel.value;
    const meta = m.meta || {};
    const params = meta.parameters ? (meta.parameters / 1e6).toFixed(0) + "M parameters" : "";
    $("model-info").textContent = [m.id, [meta.architecture, params].filter(Boolean).join(", "),
      meta.context_length ? "context " + meta.context_length + " tokens" : ""].filter(Boolean).join("\n");
  } catch (e) {
    $("model-info").textContent = "model: unavailable (" + e.message + ")";
  }
}

function num(id, parse) {
  const v = parse($(id).value);
  return Number.isFinite(v) ? v : undefined;
}

/// The API form of a stored message (UI-only fields dropped).
function apiMessage(m) {
  const out = { role: m.role, content: m.content };
  if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
  if (m.role === "tool") { out.tool_call_id = m.tool_call_id; out.name = m.name; }
  return out;
}

/// Streams one completion into `reply` (content, reasoning_content and tool_calls deltas); returns
/// { finish, usage }. Throws on an HTTP or stream error.
async function streamReply(body, reply, el, signal) {
  const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!r.ok) {
    let msg = r.status + " " + r.statusText;
    try { const j = await r.json(); if (j.error) msg = j.error.message; } catch (_) { /* not JSON */ }
    throw new Error(msg);
  }
  const box = $("messages");
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  let lastSave = 0;
  let usage = null;
  let finish = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of frame.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const j = JSON.parse(data);
        if (j.error) throw new Error(j.error.message);
        if (j.usage) usage = j.usage;
        for (const c of j.choices || []) {
          if (c.delta && c.delta.content) reply.content += c.delta.content;
          if (c.delta && c.delta.reasoning_content) reply.reasoning = (reply.reasoning || "") + c.delta.reasoning_content;
          for (const t of (c.delta && c.delta.tool_calls) || []) {
            reply.tool_calls = reply.tool_calls || [];
            if (t.id) reply.tool_calls[t.index] = { id: t.id, type: "function", function: { name: t.function.name, arguments: "" } };
            const call = reply.tool_calls[t.index];
            if (call && t.function && t.function.arguments) call.function.arguments += t.function.arguments;
          }
          if (c.finish_reason) finish = c.finish_reason;
        }
      }
    }
    fillMessage(el, reply);
    box.scrollTop = box.scrollHeight;
    if (performance.now() - lastSave > 1000) { saveChats(); lastSave = performance.now(); }
  }
  return { finish, usage };
}

/// Most model turns of one agent reply (each may call tools).
const AGENT_STEPS = 8;

async function send(text) {
  let chat = currentChat();
  if (!chat) {
    chat = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "", messages: [] };
    state.chats.unshift(chat);
    state.current = chat.id;
  }
  if (!chat.title) chat.title = text.slice(0, 40);
  chat.messages.push({ role: "user", content: text });
  const agent = agentOn();
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const t0 = performance.now();
  let usage = null;
  let completion = 0;
  let reply = null;
  let el = null;
  try {
    for (let step = 0; step < (agent ? AGENT_STEPS : 1); step++) {
      reply = { role: "assistant", content: "" };
      chat.messages.push(reply);
      saveChats();
      render();
      el = $("messages").lastElementChild;
      el.classList.add("streaming");
      $("status").textContent = "generating…";
      const history = chat.messages.slice(0, -1).filter((m) => !m.error).map(apiMessage);
      let system = $("system-prompt").value.trim();
      if (agent) system = state.agent.system_prompt + (system ? "\n\n" + system : "");
      const body = {
        model: state.model || undefined,
        messages: system ? [{ role: "system", content: system }, ...history] : history,
        stream: true,
        stream_options: { include_usage: true },
        temperature: num("temperature", parseFloat),
        top_p: num("top-p", parseFloat),
        top_k: num("top-k", (v) => parseInt(v, 10)),
        max_tokens: num("max-tokens", (v) => parseInt(v, 10)),
      };
      // One call per turn: small models otherwise fire several at once and spiral.
      if (agent) { body.tools = state.agent.tools; body.parallel_tool_calls = false; }
      const out = await streamReply(body, reply, el, controller.signal);
      usage = out.usage;
      if (usage) completion += usage.completion_tokens;
      el.classList.remove("streaming");
      if (out.finish === "length") reply.note = "stopped at the token limit";
      if (!agent || !reply.tool_calls || !reply.tool_calls.length) break;
      reply.tool_calls = reply.tool_calls.filter(Boolean);
      for (const call of reply.tool_calls) {
        if (controller.signal.aborted) break;
        await runToolCall(chat, call, controller.signal);
      }
      if (step === AGENT_STEPS - 1) reply.note = "stopped after " + AGENT_STEPS + " tool rounds";
    }
    const secs = (performance.now() - t0) / 1000;
    $("status").textContent = usage ? `${completion} tokens in ${secs.toFixed(1)} s (${(completion / secs).toFixed(1)} tok/s)` : "";
  } catch (e) {
    if (e.name === "AbortError") {
      if (reply) reply.note = "stopped";
      $("status").textContent = "stopped";
    } else if (reply) {
      reply.error = true;
      reply.content = reply.content ? reply.content + "\n\n" + e.message : "Error: " + e.message;
      $("status").textContent = "error";
    }
  } finally {
    state.controller = null;
    saveChats();
    render();
    setBusy(false);
  }
}

// ---- wiring --------------------------------------------------------------------------------

function init() {
  state.chats = load(STORE_CHATS, []);
  state.current = load(STORE_CURRENT, null);
  if (!currentChat() && state.chats.length) state.current = state.chats[0].id;
  loadSettings();
  render();
  loadModel();
  loadAgent();

  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("model-select").addEventListener("change", () => { state.model = $("model-select").value; });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("new-chat").addEventListener("click", () => {
    if (state.controller) return;
    state.current = null;
    saveChats();
    render();
    $("input").focus();
  });
  $("settings-toggle").addEventListener("click", () => {
    const s = $("settings");
    s.hidden = !s.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!s.hidden));
  });
  for (const f of SETTING_FIELDS) $(f).addEventListener("change", () => { saveSettings(); if (f === "api-key") { loadModel(); loadAgent(); } });
  $("messages").addEventListener("click", (ev) => {
    const b = ev.target.closest("button.copy");
    if (!b) return;
    const code = b.parentElement.querySelector("code");
    if (navigator.clipboard) navigator.clipboard.writeText(code.textContent).then(() => { b.textContent = "copied"; });
  });
}

init();
