// hf2q web chat: plain JavaScript over the public OpenAI-style API (/v1/models,
// /v1/chat/completions with streaming). Conversations and settings live in localStorage.
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

const SETTING_FIELDS = ["system-prompt", "temperature", "top-p", "top-k", "max-tokens", "api-key"];

function loadSettings() {
  const s = load(STORE_SETTINGS, {});
  for (const f of SETTING_FIELDS) if (s[f] !== undefined) $(f).value = s[f];
}

function saveSettings() {
  const s = {};
  for (const f of SETTING_FIELDS) s[f] = $(f).value;
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
  if (m.role === "assistant" && !m.error) div.innerHTML = markdown(m.content);
  else div.textContent = m.content;
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
    state.model = m.id;
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

async function send(text) {
  let chat = currentChat();
  if (!chat) {
    chat = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "", messages: [] };
    state.chats.unshift(chat);
    state.current = chat.id;
  }
  if (!chat.title) chat.title = text.slice(0, 40);
  chat.messages.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "" };
  chat.messages.push(reply);
  saveChats();
  render();
  const box = $("messages");
  const el = box.lastElementChild;
  el.classList.add("streaming");

  const history = chat.messages.slice(0, -1).filter((m) => !m.error).map((m) => ({ role: m.role, content: m.content }));
  const system = $("system-prompt").value.trim();
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
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  $("status").textContent = "generating…";
  const t0 = performance.now();
  let usage = null;
  let finish = null;
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) {
      let msg = r.status + " " + r.statusText;
      try { const j = await r.json(); if (j.error) msg = j.error.message; } catch (_) { /* not JSON */ }
      throw new Error(msg);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    let lastSave = 0;
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
            if (c.finish_reason) finish = c.finish_reason;
          }
        }
      }
      fillMessage(el, reply);
      box.scrollTop = box.scrollHeight;
      if (performance.now() - lastSave > 1000) { saveChats(); lastSave = performance.now(); }
    }
    const secs = (performance.now() - t0) / 1000;
    if (usage) {
      $("status").textContent = `${usage.completion_tokens} tokens in ${secs.toFixed(1)} s (${(usage.completion_tokens / secs).toFixed(1)} tok/s)`;
    } else {
      $("status").textContent = "";
    }
    if (finish === "length") reply.note = "stopped at the token limit";
  } catch (e) {
    if (e.name === "AbortError") {
      reply.note = "stopped";
      $("status").textContent = "stopped";
    } else {
      reply.error = true;
      reply.content = reply.content ? reply.content + "\n\n" + e.message : "Error: " + e.message;
      $("status").textContent = "error";
    }
  } finally {
    state.controller = null;
    el.classList.remove("streaming");
    el.className = "msg assistant" + (reply.error ? " error" : "");
    fillMessage(el, reply);
    saveChats();
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
  for (const f of SETTING_FIELDS) $(f).addEventListener("change", () => { saveSettings(); if (f === "api-key") loadModel(); });
  $("messages").addEventListener("click", (ev) => {
    const b = ev.target.closest("button.copy");
    if (!b) return;
    const code = b.parentElement.querySelector("code");
    if (navigator.clipboard) navigator.clipboard.writeText(code.textContent).then(() => { b.textContent = "copied"; });
  });
}

init();
