// hf2q Lab, core: the section router (hash routes #/chat, #/models, #/quantize, #/finetune,
// #/datasets, #/jobs[/ID]), the /api client (the chat's API key and JSON headers), the job
// list kept fresh by polling, small formatting helpers and the SVG line plot the job views
// draw. Pages register in LAB_PAGES (lab-jobs.js, lab-pages.js, lab-train.js); nothing here
// knows a page's fields. Loaded after app.js, whose $, esc and headers() it uses.
"use strict";

const LAB_PAGES = {};
const lab = {
  enabled: false,
  home: "",
  jobs: [],          // newest first, as GET /api/jobs answers
  jobListeners: [],  // fn(jobs) after each refresh
  models: null,      // last GET /api/models
  files: null,       // last GET /api/files
  datasets: null,    // last GET /api/datasets
};
const FINAL_STATES = ["succeeded", "failed", "cancelled", "interrupted"];
const JOB_POLL_MS = 1500;

// ---- API -----------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, body) {
    const e = body && body.error;
    super(e ? e.message : "HTTP " + status);
    this.status = status;
    this.param = e ? e.param : null;
  }
}

/// One /api call: JSON in, JSON out; throws ApiError with the server's message.
async function api(method, path, body) {
  const init = { method, headers: headers() };
  if (method !== "GET") init.body = JSON.stringify(body === undefined ? {} : body);
  const r = await fetch(path, init);
  let j = null;
  try { j = await r.json(); } catch (_) { /* empty or not JSON */ }
  if (!r.ok) throw new ApiError(r.status, j);
  return j;
}

function showLabError(msg) {
  $("lab-error").textContent = msg || "";
}

// ---- formatting ----------------------------------------------------------------------------

function fmtBytes(n) {
  if (n === undefined || n === null) return "";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return (i === 0 ? n : n.toFixed(n < 10 ? 2 : 1)) + " " + u[i];
}

function fmtSecs(s) {
  if (!Number.isFinite(s) || s < 0) return "";
  s = Math.round(s);
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}

function fmtNum(x, digits) {
  if (!Number.isFinite(x)) return "—";
  if (digits !== undefined) return x.toFixed(digits);
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return x.toExponential(2);
  return a >= 100 ? x.toFixed(0) : a >= 10 ? x.toFixed(2) : x.toFixed(4);
}

function fmtParams(n) {
  if (!n) return "";
  return n >= 1e9 ? (n / 1e9).toFixed(2) + "B" : (n / 1e6).toFixed(0) + "M";
}

function fmtTime(unix) {
  if (!unix) return "";
  const d = new Date(unix * 1000);
  return d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

/// An element with attributes and children (strings become text nodes).
function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "text") el.textContent = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of kids.flat()) if (c !== null && c !== undefined && c !== false) el.append(c);
  return el;
}

function badge(state) {
  return h("span", { class: "badge " + state, text: state });
}

// ---- plots ---------------------------------------------------------------------------------

const PLOT_COLORS = ["#2f6fde", "#e0663a", "#1f8a4c", "#8a4bd6"];

/// Draws line series into `el` (a .plot div): series = [{name, points: [[x, y], ...]}].
/// Linear axes from the data's range; a handful of ticks; no library.
function drawPlot(el, title, series, opts) {
  opts = opts || {};
  const W = 300, H = 140, L = 44, R = 8, T = 8, B = 18;
  const all = series.flatMap((s) => s.points).filter((p) => Number.isFinite(p[0]) && Number.isFinite(p[1]));
  el.textContent = "";
  const head = h("div", { class: "title" }, h("span", { text: title }),
    ...series.map((s, i) => h("span", { class: "key" }, h("i", { style: "background:" + PLOT_COLORS[i % PLOT_COLORS.length] }), s.name)));
  el.append(head);
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  el.append(svg);
  const add = (name, attrs, text) => {
    const n = document.createElementNS(svgNS, name);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    svg.append(n);
    return n;
  };
  add("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B });
  add("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B });
  if (all.length === 0) { add("text", { x: L + 8, y: H / 2 }, "waiting for data…"); return; }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (opts.zeroBased) y0 = Math.min(0, y0);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += Math.abs(y1) * 0.05 || 1; y0 -= Math.abs(y0) * 0.05 || 0; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  for (let i = 0; i <= 3; i++) {
    const y = y0 + ((y1 - y0) * i) / 3;
    add("text", { x: L - 4, y: sy(y) + 3, "text-anchor": "end" }, fmtNum(y));
  }
  add("text", { x: L, y: H - 4 }, String(Math.round(x0)));
  add("text", { x: W - R, y: H - 4, "text-anchor": "end" }, (opts.xlabel ? opts.xlabel + " " : "") + Math.round(x1));
  series.forEach((s, i) => {
    const pts = s.points.filter((p) => Number.isFinite(p[1]));
    if (!pts.length) return;
    const color = PLOT_COLORS[i % PLOT_COLORS.length];
    add("polyline", { points: pts.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" "),
      fill: "none", stroke: color, "stroke-width": 1.6, "vector-effect": "non-scaling-stroke" });
    if (pts.length <= 30 || s.dots) {
      for (const p of pts) add("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2, fill: color });
    }
  });
}

// ---- jobs ----------------------------------------------------------------------------------

async function refreshJobs() {
  if (!lab.enabled) return;
  try {
    const j = await api("GET", "/api/jobs");
    lab.jobs = j.data;
    showLabError("");
  } catch (e) {
    showLabError("Lab: " + e.message);
    return;
  }
  const running = lab.jobs.filter((j) => j.state === "running" || j.state === "queued").length;
  $("nav-running").hidden = running === 0;
  $("nav-running").textContent = String(running);
  for (const f of lab.jobListeners) f(lab.jobs);
}

function jobById(id) {
  return lab.jobs.find((j) => j.id === id) || null;
}

/// Submits a job; refreshes the list; answers the job.
async function submitJob(kind, params) {
  const job = await api("POST", "/api/jobs", { kind, params });
  await refreshJobs();
  return job;
}

// ---- shared lists --------------------------------------------------------------------------

async function refreshModels() {
  lab.models = await api("GET", "/api/models");
  lab.home = lab.models.home || "";
  return lab.models;
}

async function refreshFiles() {
  lab.files = (await api("GET", "/api/files")).data;
  return lab.files;
}

async function refreshDatasets() {
  lab.datasets = await api("GET", "/api/datasets");
  return lab.datasets;
}

/// Fills a <select> with [value, label] pairs, keeping the current choice when it is still
/// there. `none` adds a first empty option with that label.
function fillSelect(sel, options, none) {
  const keep = sel.value;
  sel.textContent = "";
  if (none !== undefined) sel.append(h("option", { value: "", text: none }));
  for (const [value, label] of options) sel.append(h("option", { value, text: label }));
  if ([...sel.options].some((o) => o.value === keep)) sel.value = keep;
}

/// Model choices for a job: built-in names, then local models (not adapters).
function modelOptions() {
  const m = lab.models || { data: [], builtin: [] };
  const out = m.builtin.map((b) => [b.name, b.name + (b.cached ? "" : " (pulled on first use)")]);
  for (const x of m.data) if (x.kind === "model" && !x.error) out.push([x.path, x.path]);
  return out;
}

function adapterOptions() {
  const m = lab.models || { data: [] };
  return m.data.filter((x) => x.kind === "adapter").map((x) => [x.path, x.path]);
}

/// Text files for calibration and evaluation (`data/*.txt`, `.md`, and the rest).
function textFileOptions() {
  return (lab.files || []).map((f) => [f.path, f.path + " (" + fmtBytes(f.bytes) + ")"]);
}

/// Reads numeric, text and checkbox fields `prefix + name` into params (empty fields are left
/// out, so the command's own defaults apply).
function readFields(prefix, names, params) {
  for (const n of names) {
    const el = $(prefix + n);
    if (!el || el.closest("[hidden]")) continue;
    if (el.type === "checkbox") { if (el.checked) params[n] = true; continue; }
    const v = el.value.trim();
    if (v === "") continue;
    params[n] = el.type === "number" ? Number(v) : v;
  }
  return params;
}

// ---- router --------------------------------------------------------------------------------

function route() {
  const parts = (location.hash || "#/chat").replace(/^#\/?/, "").split("/");
  let page = parts[0] || "chat";
  if (!$("page-" + page) || (!lab.enabled && page !== "chat")) page = "chat";
  for (const s of document.querySelectorAll("section.page")) s.hidden = s.id !== "page-" + page;
  for (const a of document.querySelectorAll("#lab-nav a")) a.classList.toggle("active", a.dataset.page === page);
  document.title = page === "chat" ? "hf2q" : "hf2q · " + $("lab-nav").querySelector(`[data-page=${page}]`).textContent.trim();
  const p = LAB_PAGES[page];
  if (p && p.show) p.show(parts.slice(1).join("/"));
}

let jobTimer = null;

/// Finds out whether this server has the Lab (and whether the key opens it); called at load
/// and again when the key changes.
async function initLab() {
  if (lab.enabled) return;
  try {
    await api("GET", "/api/jobs");
    lab.enabled = true;
    showLabError("");
  } catch (e) {
    // 404: the Lab is off (--no-lab); 401: the key is missing (the chat's settings take it).
    lab.enabled = false;
    if (e.status === 401) showLabError("the Lab needs the API key (chat Settings)");
  }
  document.body.classList.toggle("no-lab", !lab.enabled);
  if (lab.enabled && !jobTimer) {
    refreshJobs();
    jobTimer = setInterval(refreshJobs, JOB_POLL_MS);
  }
  route();
}

window.addEventListener("hashchange", route);
$("api-key").addEventListener("change", initLab);
window.addEventListener("DOMContentLoaded", initLab);
