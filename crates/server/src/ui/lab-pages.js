// hf2q Lab, the Models (#/models), Quantize (#/quantize) and Datasets (#/datasets) sections:
// forms that submit jobs through /api, tables over /api/models, /api/files and /api/datasets,
// and each submitted job's live panel (lab-jobs.js). The generation templates' form is in
// lab-generate.js, fine-tuning in lab-train.js, the Push cards and the Hub token in lab-hub.js.
"use strict";

// ---- Models --------------------------------------------------------------------------------

/// Loads an adapter under adapters/ into the server and opens the chat on it.
async function tryAdapterInChat(path) {
  const name = path.split("/").pop().replace(/[^A-Za-z0-9._-]/g, "-");
  const abs = lab.home.replace(/\/$/, "") + "/" + path;
  const r = await fetch("/v1/adapters", { method: "POST", headers: headers(), body: JSON.stringify({ name, path: abs }) });
  if (!r.ok && r.status !== 409) {
    let msg = "HTTP " + r.status;
    try { msg = (await r.json()).error.message; } catch (_) { /* not JSON */ }
    throw new Error(msg);
  }
  await loadModel();
  const sel = $("model-select");
  const want = [...sel.options].find((o) => o.value.endsWith(":" + name));
  if (want) { sel.value = want.value; sel.dispatchEvent(new Event("change")); }
  location.hash = "#/chat";
}

function renderModels() {
  const m = lab.models;
  if (!m) return;
  $("home-path").textContent = lab.home;
  fillSelect($("pull-name"), m.builtin.map((b) => [b.name, b.name + (b.cached ? " (already here)" : "")]));
  const tb = $("models-table").querySelector("tbody");
  tb.textContent = "";
  $("models-empty").hidden = m.data.length > 0;
  for (const x of m.data) {
    const info = x.info || {};
    const types = info.tensor_types ? Object.keys(info.tensor_types).join(", ") : x.config ? "LoRA r " + x.config.r : "";
    const acts = h("td", { class: "acts" });
    if (x.kind === "model" && !x.error) {
      acts.append(h("button", { type: "button", class: "small", text: "Quantize", onclick: () => { location.hash = "#/quantize"; setTimeout(() => { $("q-model").value = x.path; }, 0); } }));
    }
    if (x.kind === "adapter") {
      acts.append(h("button", { type: "button", class: "small try-adapter", text: "Chat", onclick: () => tryAdapterInChat(x.path).catch((e) => showLabError(e.message)) }));
    }
    acts.append(h("button", { type: "button", class: "small danger", text: "Delete", onclick: async () => {
      if (!confirm(`Delete ${x.path}? This removes the files.`)) return;
      try { await api("DELETE", "/api/models/" + x.path); await refreshModels(); renderModels(); } catch (e) { showLabError(e.message); }
    } }));
    tb.append(h("tr", {},
      h("td", { class: "path", text: x.path, title: x.error || "" }),
      h("td", {}, h("span", { class: "badge " + x.kind, text: x.kind })),
      h("td", { class: "num", text: fmtBytes(x.bytes) }),
      h("td", { text: x.error ? "unreadable: " + x.error : types }),
      h("td", { class: "num", text: info.bits_per_weight ? info.bits_per_weight.toFixed(2) : "" }),
      h("td", { class: "num", text: fmtParams(info.parameters) }),
      h("td", { class: "num", text: info.context_length ? String(info.context_length) : "" }),
      acts));
  }
}

LAB_PAGES.models = {
  show() {
    refreshModels().then(renderModels).catch((e) => showLabError(e.message));
  },
};

$("pull-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  try {
    const job = await api("POST", "/api/models/pull", { name: $("pull-name").value });
    $("pull-status").textContent = `pull job ${job.id} queued (see Jobs)`;
    watchJob(job.id, () => refreshModels().then(renderModels));
  } catch (e) { $("pull-status").textContent = e.message; }
});

/// Calls `done(job, summary)` once job `id` reaches a final state (the job's state and outputs
/// from its log, which is ahead of the polled list).
function watchJob(id, done) {
  const f = follow(id);
  const check = (s) => {
    if (!FINAL_STATES.includes(s.state)) return;
    f.listeners.delete(check);
    const job = Object.assign({ id, params: {} }, jobById(id) || {}, { state: s.state });
    if (s.outputs && s.outputs.length) job.outputs = s.outputs;
    done(job, s);
  };
  f.listeners.add(check);
  check(f.summary);
}

// ---- Quantize ------------------------------------------------------------------------------

const quantizePage = { slot: null };

function quantizeMode() {
  return document.querySelector("input[name=q-mode]:checked").value;
}

function syncQuantizeForm() {
  const mixed = quantizeMode() === "mixed";
  $("q-uniform").hidden = mixed;
  $("q-mixed").hidden = !mixed;
  $("q-group-row").hidden = mixed || !$("q-type").value.startsWith("mlx");
  $("q-imatrix-file-row").hidden = $("q-imatrix-mode").value !== "compute";
  $("q-bpw-out").textContent = Number($("q-bpw").value).toFixed(1);
}

function fillFileSelects() {
  for (const sel of document.querySelectorAll("select.file-select")) {
    fillSelect(sel, textFileOptions(), sel.dataset.none || (sel.id === "q-calib" || sel.id === "q-imatrix-file" ? undefined : "none"));
  }
}

LAB_PAGES.quantize = {
  async show() {
    if (!quantizePage.slot) quantizePage.slot = panelSlot($("q-job"));
    try {
      await Promise.all([refreshModels(), refreshFiles()]);
      fillSelect($("q-model"), modelOptions());
      fillPushCard("quantize");
      fillFileSelects();
      syncQuantizeForm();
    } catch (e) { showLabError(e.message); }
  },
};

for (const id of ["q-type", "q-bpw", "q-imatrix-mode"]) $(id).addEventListener("input", syncQuantizeForm);
for (const r of document.querySelectorAll("input[name=q-mode]")) r.addEventListener("change", syncQuantizeForm);

$("quantize-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("q-error").textContent = "";
  const params = { model: $("q-model").value, output: $("q-output").value.trim() };
  if (quantizeMode() === "mixed") {
    params.target_bpw = Number($("q-bpw").value);
    params.calib = $("q-calib").value;
    if (!params.calib) { $("q-error").textContent = "mixed precision needs a calibration text (upload one on the Datasets page)"; return; }
  } else {
    params.type = $("q-type").value;
    if (params.type.startsWith("mlx")) params.group_size = Number($("q-group").value);
  }
  if ($("q-eval").value) params.eval = $("q-eval").value;
  try {
    if ($("q-imatrix-mode").value === "compute") {
      const text = $("q-imatrix-file").value;
      if (!text) throw new Error("pick a text for the importance matrix");
      const im = await submitJob("imatrix", { model: params.model, file: text, output: params.output + ".imatrix.gguf" });
      $("q-job").hidden = false;
      quantizePage.slot.open(im.id);
      watchJob(im.id, async (job) => {
        if (!job || job.state !== "succeeded") return;
        params.imatrix = job.outputs[0];
        try { openQuantizeJob(await submitJob("quantize", params)); } catch (e) { $("q-error").textContent = e.message; }
      });
      return;
    }
    openQuantizeJob(await submitJob("quantize", params));
  } catch (e) { $("q-error").textContent = e.message; }
});

function openQuantizeJob(job) {
  $("q-job").hidden = false;
  quantizePage.slot.open(job.id);
  // The new model is the one the Push card offers first.
  watchJob(job.id, async (j) => {
    if (j.state !== "succeeded") return;
    await refreshModels();
    fillPushCard("quantize");
    const out = (j.outputs || [])[0] || "";
    const sel = document.querySelector(".push-card[data-push=quantize] select");
    const hit = [...sel.options].find((o) => o.value && out.endsWith(o.value));
    if (hit) sel.value = hit.value;
  });
}

// ---- Datasets ------------------------------------------------------------------------------

/// `refreshed`: functions called after the section's lists are fetched (the generation form).
const datasetsPage = { slot: null, view: null, refreshed: [] };

function renderFiles() {
  const tb = $("files-table").querySelector("tbody");
  tb.textContent = "";
  const box = $("d-inputs");
  const checked = new Set([...box.querySelectorAll("input:checked")].map((i) => i.value));
  for (const l of [...box.querySelectorAll("label")]) l.remove();
  for (const f of lab.files || []) {
    tb.append(h("tr", {}, h("td", { class: "path", text: f.path }), h("td", { class: "num", text: fmtBytes(f.bytes) }),
      h("td", { class: "acts" }, h("button", { type: "button", class: "small danger", text: "Delete", onclick: async () => {
        if (!confirm(`Delete ${f.path}?`)) return;
        try { await api("DELETE", "/api/files/" + f.path); await refreshDatasetsPage(); } catch (e) { showLabError(e.message); }
      } }))));
    if (/\.(csv|json|jsonl|ndjson)$/i.test(f.path)) {
      box.append(h("label", {}, h("input", { type: "checkbox", value: f.path, checked: checked.has(f.path) }), f.path));
    }
  }
  if (!box.querySelector("label")) box.append(h("label", { class: "muted", text: "upload a CSV, JSON or JSONL file first" }));
}

function renderDatasets() {
  const d = lab.datasets;
  const tb = $("datasets-table").querySelector("tbody");
  tb.textContent = "";
  $("datasets-empty").hidden = d.data.length > 0;
  for (const x of d.data) {
    tb.append(h("tr", { class: "clickable", "data-dataset": x.name, onclick: () => showDataset(x.name, "train") },
      h("td", { class: "path", text: x.name }), h("td", { text: x.format || "" }),
      h("td", { class: "num", text: x.train === undefined ? "" : String(x.train) }), h("td", { class: "num", text: x.valid === undefined ? "" : String(x.valid) }),
      h("td", { class: "acts" }, h("button", { type: "button", class: "small danger", text: "Delete", onclick: async (e) => {
        e.stopPropagation();
        if (!confirm(`Delete the dataset ${x.name}?`)) return;
        try { await api("DELETE", "/api/datasets/" + x.name); $("dataset-view").hidden = true; await refreshDatasetsPage(); } catch (err) { showLabError(err.message); }
      } }))));
  }
}

/// The report's token histogram as bars.
function histogram(t) {
  const max = Math.max(1, ...t.histogram.map((b) => b.count));
  return h("div", { class: "hist", title: "records per token length" },
    ...t.histogram.map((b) => h("div", { style: `height:${(100 * b.count / max).toFixed(0)}%`, title: `≤ ${b.up_to} tokens: ${b.count}` }, h("span", { text: "≤" + b.up_to }))));
}

async function showDataset(name, split) {
  const box = $("dataset-view");
  box.hidden = false;
  box.textContent = "";
  box.append(h("h3", { text: "Dataset " + name }));
  try {
    const [rep, prev] = await Promise.all([
      api("GET", `/api/datasets/${encodeURIComponent(name)}/stats`),
      api("GET", `/api/datasets/${encodeURIComponent(name)}/preview?split=${split}&limit=20`),
    ]);
    const dl = h("dl", { class: "report-card" });
    const row = (k, v) => dl.append(h("dt", { text: k }), h("dd", { text: v }));
    row("format", rep.format || "");
    row("records", `${rep.train} train + ${rep.valid} validation (seed ${rep.seed}, ${Math.round(100 * rep.valid_split)} % held out)`);
    row("read", (rep.inputs || []).map((i) => `${i.file}: ${i.rows} rows`).join("; "));
    row("removed", `${rep.exact_duplicates} exact and ${rep.near_duplicates} near duplicates, ${rep.skipped} rows skipped`);
    if (rep.template) row("template", rep.template + (rep.generated !== undefined ? ` (${rep.generated} generated)` : ""));
    if (rep.tokens) {
      const t = rep.tokens;
      row("tokens (" + rep.model + ")", `min ${t.min}, median ${t.p50}, p90 ${t.p90}, max ${t.max}; ${t.over_max_len} over ${t.max_len}`);
    }
    box.append(dl);
    if (rep.tokens && rep.tokens.histogram) box.append(h("div", { class: "muted", text: "token lengths" }), histogram(rep.tokens));
    if (rep.problems && rep.problems.length) {
      box.append(h("div", { class: "muted", text: "problems" }),
        h("div", { class: "log" }, ...rep.problems.map((p) => h("div", { text: `${p.file}:${p.line}: ${p.message}` }))));
    }
    const pick = h("select", { "aria-label": "Split", onchange: (e) => showDataset(name, e.target.value) },
      h("option", { value: "train", text: "train" }), h("option", { value: "valid", text: "validation" }));
    pick.value = split;
    box.append(h("div", { class: "inline" }, h("span", { class: "muted", text: `preview: ${prev.data.length} of ${prev.total}` }), pick));
    box.append(h("div", { class: "records" }, ...prev.data.map((r) => h("pre", { text: JSON.stringify(r, null, 1) }))));
  } catch (e) {
    box.append(h("p", { class: "error-text", text: e.message }));
  }
}

async function refreshDatasetsPage() {
  await Promise.all([refreshFiles(), refreshDatasets(), refreshModels()]);
  renderFiles();
  renderDatasets();
  fillSelect($("d-model"), modelOptions(), "no token report");
  fillPushCard("datasets");
  for (const f of datasetsPage.refreshed) f();
}

LAB_PAGES.datasets = {
  show() {
    if (!datasetsPage.slot) datasetsPage.slot = panelSlot($("d-job"));
    refreshDatasetsPage().catch((e) => showLabError(e.message));
  },
};

$("upload-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const file = $("upload-file").files[0];
  if (!file) { $("upload-status").textContent = "choose a file first"; return; }
  $("upload-status").textContent = "uploading…";
  try {
    const content = await file.text();
    const r = await api("POST", "/api/files", { name: file.name, content });
    $("upload-status").textContent = `saved ${r.path} (${fmtBytes(r.bytes)})`;
    $("upload-file").value = "";
    await refreshDatasetsPage();
  } catch (e) { $("upload-status").textContent = e.message; }
});

$("dataset-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("d-error").textContent = "";
  const inputs = [...$("d-inputs").querySelectorAll("input:checked")].map((i) => i.value);
  const hub = $("d-hub").value.split("\n").map((l) => l.trim()).filter((l) => l);
  if (!inputs.length && !hub.length) { $("d-error").textContent = "tick an input file or name a Hub dataset"; return; }
  const params = readFields("d-", ["to", "on_error", "dedup", "valid_split", "seed", "model"], { output: $("d-output").value.trim() });
  if (inputs.length) params.inputs = inputs;
  if (hub.length) params.hub = hub;
  const map = {};
  for (const line of $("d-map").value.split("\n")) {
    const t = line.trim();
    if (!t) continue;
    const eq = t.indexOf("=");
    if (eq <= 0) { $("d-error").textContent = `mapping line '${t}' is not field=column`; return; }
    map[t.slice(0, eq).trim()] = t.slice(eq + 1).trim();
  }
  if (Object.keys(map).length) params.map = map;
  try {
    const job = await api("POST", "/api/datasets", params);
    await refreshJobs();
    $("d-job").hidden = false;
    datasetsPage.slot.open(job.id);
    watchJob(job.id, async (j) => {
      await refreshDatasetsPage();
      if (j && j.state === "succeeded") showDataset(params.output, "train");
    });
  } catch (e) { $("d-error").textContent = e.message; }
});
