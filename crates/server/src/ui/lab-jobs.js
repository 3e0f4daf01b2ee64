// hf2q Lab, jobs: following a job's event log (GET /api/jobs/{id}/events as SSE over fetch,
// so the API key header goes with it; reconnects with Last-Event-ID and loses nothing), the
// running summary of a log (progress, training steps and evals, the result line), the job
// panel every page shows (state, progress, stats, plots, result, live log, cancel / resume /
// delete) and the Jobs page (#/jobs, #/jobs/ID). Uses lab.js.
"use strict";

// ---- following a log -----------------------------------------------------------------------

const followers = new Map();
/// Log lines kept in a panel's DOM (the summary keeps every step for the plots).
const LOG_LINES_SHOWN = 1500;

class Follower {
  constructor(id) {
    this.id = id;
    this.lastSeq = 0;
    this.done = false;
    this.running = false;
    this.listeners = new Set();
    this.summary = newSummary();
  }

  /// Reads the stream until the job is final; reconnects after drops.
  async run() {
    if (this.running) return;
    this.running = true;
    this.done = false;
    while (!this.done) {
      try {
        const hd = headers();
        hd["Last-Event-ID"] = String(this.lastSeq);
        const r = await fetch(`/api/jobs/${this.id}/events`, { headers: hd });
        if (r.status === 404) { this.done = true; break; }
        if (!r.ok) throw new Error("HTTP " + r.status);
        const reader = r.body.getReader();
        const dec = new TextDecoder();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += dec.decode(value, { stream: true });
          let cut;
          const batch = [];
          while ((cut = buf.indexOf("\n\n")) >= 0) {
            const frame = buf.slice(0, cut);
            buf = buf.slice(cut + 2);
            const data = frame.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
            if (!data || frame.startsWith("event: error")) continue;
            const ev = JSON.parse(data);
            if (ev.seq <= this.lastSeq) continue;
            this.lastSeq = ev.seq;
            applyEvent(this.summary, ev);
            batch.push(ev);
          }
          if (batch.length) this.notify(batch);
        }
        if (FINAL_STATES.includes(this.summary.state)) this.done = true;
      } catch (_) {
        await new Promise((res) => setTimeout(res, 1500));
      }
    }
    this.running = false;
  }

  notify(batch) {
    for (const f of this.listeners) f(this.summary, batch);
  }
}

/// The follower of job `id` (one per job, shared by every view); restarted when a resumed job
/// runs again.
function follow(id) {
  let f = followers.get(id);
  if (!f) { f = new Follower(id); followers.set(id, f); }
  const job = jobById(id);
  if (!f.running && (!f.done || (job && !FINAL_STATES.includes(job.state)))) f.run();
  return f;
}

function newSummary() {
  return { state: null, progress: null, plan: null, steps: [], evals: [], result: null, done: null,
    stopped: null, checkpoints: [], log: [], error: null, outputs: [], records: [], started: null };
}

/// Folds one event into a summary.
function applyEvent(s, ev) {
  const d = ev.data || {};
  if (ev.type === "state") {
    s.state = d.state;
    if (d.state === "running") s.started = ev.time;
    if (d.error) s.error = d.error;
    if (d.outputs) s.outputs = d.outputs;
    s.log.push({ cls: "state", text: "— " + d.state + (d.exit_status !== undefined && d.exit_status !== null ? " (exit " + d.exit_status + ")" : "") });
  } else if (ev.type === "progress") {
    switch (d.event) {
      case "start": s.progress = { label: d.label, done: 0, total: d.total, message: "", t0: ev.time, time: ev.time }; break;
      case "progress": s.progress = Object.assign(s.progress || { t0: ev.time }, { label: d.label, done: d.done, total: d.total, message: d.message || "", time: ev.time }); break;
      case "finish": if (s.progress) { s.progress.done = s.progress.total || s.progress.done; s.progress.message = d.summary || ""; } break;
      case "plan": s.plan = d; break;
      case "step": s.steps.push(d); break;
      case "eval": s.evals.push(d); break;
      case "checkpoint": s.checkpoints.push(d); break;
      case "stopped": s.stopped = d; break;
      case "done": s.done = d; break;
      case "result": s.result = d; break;
      case "record": s.records.push(d.record); break;
      default: break;
    }
    if (d.event === "step") s.log.push({ cls: "", text: `step ${d.step}/${d.total_steps} loss ${fmtNum(d.loss)} lr ${fmtNum(d.lr)} ${fmtNum(d.tokens_per_s, 0)} tok/s` });
    else if (d.event === "eval") s.log.push({ cls: "", text: `eval at step ${d.step}: loss ${fmtNum(d.loss)}` });
    else if (!["progress"].includes(d.event)) s.log.push({ cls: "", text: JSON.stringify(d) });
  } else if (ev.type === "log") {
    s.log.push({ cls: d.stream === "stderr" ? "stderr" : "", text: d.line });
  }
}

// ---- the job panel -------------------------------------------------------------------------

/// Fraction done and a label for a job's summary (training: steps; else the progress events).
function progressOf(s) {
  if (s.steps.length) {
    const last = s.steps[s.steps.length - 1];
    return { frac: last.step / last.total_steps, text: `step ${last.step}/${last.total_steps}` };
  }
  if (s.state === "succeeded") return { frac: 1, text: "done" };
  const p = s.progress;
  if (p && p.total) return { frac: p.done / p.total, text: `${p.label}: ${p.done}/${p.total}${p.message ? " · " + p.message : ""}` };
  if (p) return { frac: 0, text: p.label + (p.message ? " · " + p.message : "") };
  return { frac: 0, text: s.state || "" };
}

/// Seconds left, from the training steps' pace or the progress events'.
function etaOf(s) {
  if (s.state !== "running") return null;
  if (s.steps.length >= 2) {
    const a = s.steps[0], b = s.steps[s.steps.length - 1];
    const per = (b.elapsed_s - a.elapsed_s) / Math.max(1, b.step - a.step);
    return per * (b.total_steps - b.step);
  }
  const p = s.progress;
  if (p && p.total && p.done > 0 && p.time > p.t0) return ((p.time - p.t0) / p.done) * (p.total - p.done);
  return null;
}

function stat(k, v) {
  return h("div", { class: "stat" }, h("div", { class: "k", text: k }), h("div", { class: "v", text: v }));
}

/// The training plots: loss (train and eval), learning rate, tokens per second; DPO adds
/// reward margins and accuracies.
function trainingPlots(box, s) {
  const dpo = s.steps.some((x) => x["rewards/margins"] !== undefined);
  const want = dpo ? 4 : 3;
  if (box.children.length !== want) {
    box.textContent = "";
    for (let i = 0; i < want; i++) box.append(h("div", { class: "plot" }));
  }
  const pts = (arr, key) => arr.map((x) => [x.step, x[key]]);
  drawPlot(box.children[0], "loss", [{ name: "train", points: pts(s.steps, "loss") }, { name: "eval", points: pts(s.evals, "loss"), dots: true }], { xlabel: "step" });
  drawPlot(box.children[1], "learning rate", [{ name: "lr", points: pts(s.steps, "lr") }], { xlabel: "step", zeroBased: true });
  drawPlot(box.children[2], "tokens/s", [{ name: "tok/s", points: pts(s.steps, "tokens_per_s") }], { xlabel: "step", zeroBased: true });
  if (dpo) drawPlot(box.children[3], "rewards", [{ name: "margin", points: pts(s.steps, "rewards/margins") }, { name: "accuracy", points: pts(s.steps, "rewards/accuracies") }], { xlabel: "step" });
}

/// The report card of a quantize (or fuse) result with --eval.
function reportCard(r) {
  const dl = h("dl", { class: "report-card" });
  const row = (k, v) => dl.append(h("dt", { text: k }), h("dd", { text: v }));
  if (r.bytes !== undefined) row("size", fmtBytes(r.bytes));
  if (r.bits_per_weight !== undefined) row("bits per weight", fmtNum(r.bits_per_weight, 3));
  if (r.types) row("tensor types", Object.entries(r.types).map(([k, v]) => `${k} ×${v}`).join(", "));
  const c = r.card;
  if (c && c.kl) {
    row("perplexity", `${fmtNum(c.ppl, 4)} ± ${fmtNum(c.ppl_err, 4)} (source ${fmtNum(c.kl.base_ppl, 4)}, ${(100 * (c.ppl / c.kl.base_ppl - 1)).toFixed(2)} %)`);
    row("KL vs source", `${c.kl.mean_kl.toExponential(3)} ± ${c.kl.mean_kl_err.toExponential(2)} nats/token`);
    row("same top token", c.kl.same_top_pct.toFixed(2) + " %");
    row("scored", `${c.n_scored} tokens in ${c.n_chunks} chunks of ${c.ctx}`);
  } else if (r.ppl !== undefined) {
    row("perplexity", `${fmtNum(r.ppl, 4)} ± ${fmtNum(r.ppl_err, 4)}`);
    if (r.kl) row("KL vs base", r.kl.mean_kl.toExponential(3));
  }
  if (r.seconds !== undefined) row("time", fmtSecs(r.seconds));
  if (r.allocation) row("mixed: estimated KL", r.allocation.estimated_kl.toExponential(3));
  return dl;
}

/// Job actions that fit its state.
function jobActions(job, after) {
  const box = h("span", { class: "inline" });
  const act = (label, cls, fn) => box.append(h("button", { type: "button", class: "small " + cls, text: label, onclick: async (e) => {
    e.stopPropagation();
    try { await fn(); showLabError(""); } catch (err) { showLabError(err.message); }
    await refreshJobs();
    if (after) after();
  } }));
  if (job.state === "running" || job.state === "queued") act(job.state === "running" && job.kind.startsWith("train") ? "Stop (checkpoint)" : "Cancel", "danger job-cancel", () => api("POST", `/api/jobs/${job.id}/cancel`));
  if (job.state === "interrupted" || job.state === "cancelled") act("Resume", "job-resume", () => api("POST", `/api/jobs/${job.id}/resume`));
  if (FINAL_STATES.includes(job.state)) act("Delete", "job-delete", async () => {
    if (!confirm(`Delete job ${job.id} and its log? Its outputs stay.`)) return;
    await api("DELETE", `/api/jobs/${job.id}`);
  });
  return box;
}

/// A live view of one job inside `root`; `extra(summary, job)` may add a page's own part
/// (e.g. the fine-tune page's "after training" actions). Returns a handle with close().
function jobPanel(root, id, extra) {
  const f = follow(id);
  root.textContent = "";
  const title = h("h3", {});
  const meta = h("dl", { class: "job-meta" });
  const prog = h("div", { class: "progress-line" }, h("div", { class: "bar" }, h("div", {})), h("span", { class: "ptext" }));
  const stats = h("div", { class: "stats" });
  const plots = h("div", { class: "plots" });
  const result = h("div", { class: "result" });
  const extraBox = h("div", { class: "extra" });
  const logHead = h("div", { class: "muted", text: "log" });
  const log = h("div", { class: "log", role: "log" });
  root.append(title, meta, prog, stats, plots, result, extraBox, logHead, log);
  let shownLog = 0;
  let frame = 0;
  let titleKey = "";

  const render = () => {
    frame = 0;
    const s = f.summary;
    const job = jobById(id) || { id, kind: "?", state: s.state, params: {} };
    const state = s.state || job.state;
    // Rebuilt only when the state changes, so a click is never lost to a re-render.
    if (titleKey !== job.kind + state) {
      titleKey = job.kind + state;
      title.textContent = "";
      title.append(`Job ${id} · ${job.kind} `, badge(state), jobActions(Object.assign({}, job, { state }), render));
    }
    meta.textContent = "";
    const m = (k, v) => { if (v) meta.append(h("dt", { text: k }), h("dd", { text: v })); };
    const p = job.params || {};
    m("model", p.model || p.adapter || (p.inputs || []).join(", "));
    m("output", (job.outputs && job.outputs.length ? job.outputs : s.outputs || []).join(", ") || p.output);
    m("started", fmtTime(job.started));
    if (job.started) m("duration", fmtSecs((job.ended || Date.now() / 1000) - job.started));
    const eta = etaOf(s);
    if (eta !== null) m("ETA", fmtSecs(eta));
    if (job.attempts > 1) m("attempts", String(job.attempts));
    if (s.error || job.error) m("error", s.error || job.error);
    const pr = progressOf(s);
    prog.querySelector(".bar > div").style.width = (100 * Math.min(1, Math.max(0, pr.frac))).toFixed(1) + "%";
    prog.querySelector(".ptext").textContent = pr.text;
    stats.textContent = "";
    if (s.steps.length) {
      const last = s.steps[s.steps.length - 1];
      stats.append(stat("loss", fmtNum(last.loss)), stat("learning rate", fmtNum(last.lr)), stat("tokens/s", fmtNum(last.tokens_per_s, 0)),
        stat("epoch", fmtNum(last.epoch, 2)));
      if (s.evals.length) stats.append(stat("eval loss", fmtNum(s.evals[s.evals.length - 1].loss)));
      if (last.device_memory_gib !== undefined) stats.append(stat("GPU memory", last.device_memory_gib.toFixed(2) + " GiB"));
      if (last["rewards/accuracies"] !== undefined) stats.append(stat("reward accuracy", fmtNum(last["rewards/accuracies"], 3)));
      trainingPlots(plots, s);
    } else if (job.kind && job.kind.startsWith("train")) {
      trainingPlots(plots, s);
    } else {
      plots.textContent = "";
    }
    result.textContent = "";
    if (s.result) result.append(h("div", { class: "muted", text: "result" }), reportCard(s.result));
    const outs = (job.outputs && job.outputs.length ? job.outputs : s.outputs) || [];
    if (s.done) result.append(h("p", { text: `adapter written: ${outs[0] || s.done.adapter} (final loss ${fmtNum(s.done.loss)}, ${fmtSecs(s.done.elapsed_s)})` }));
    if (s.stopped) result.append(h("p", { class: "muted", text: `stopped at step ${s.stopped.step}; checkpoint ${s.stopped.checkpoint} (Resume continues from it)` }));
    extraBox.textContent = "";
    if (extra) { const x = extra(s, job); if (x) extraBox.append(x); }
    if (shownLog > s.log.length) { log.textContent = ""; shownLog = 0; }
    const stick = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    const frag = document.createDocumentFragment();
    for (; shownLog < s.log.length; shownLog++) {
      const l = s.log[shownLog];
      frag.append(h("div", { class: l.cls, text: l.text }));
    }
    log.append(frag);
    while (log.childElementCount > LOG_LINES_SHOWN) log.firstElementChild.remove();
    if (stick) log.scrollTop = log.scrollHeight;
  };
  const schedule = () => { if (!frame) frame = requestAnimationFrame(render); };
  f.listeners.add(schedule);
  lab.jobListeners.push(schedule);
  render();
  return {
    id,
    close() {
      f.listeners.delete(schedule);
      lab.jobListeners = lab.jobListeners.filter((x) => x !== schedule);
      if (frame) cancelAnimationFrame(frame);
    },
  };
}

/// Keeps at most one panel in a container: opening another closes the last.
function panelSlot(root) {
  let current = null;
  return {
    open(id, extra) {
      if (current && current.id === id) return current;
      if (current) current.close();
      current = jobPanel(root, id, extra);
      return current;
    },
    get id() { return current ? current.id : null; },
  };
}

// ---- the Jobs page -------------------------------------------------------------------------

const jobsPage = { slot: null, selected: null };

function jobSummaryCell(job) {
  const f = followers.get(job.id);
  if (job.state === "succeeded") return h("div", { class: "bar" }, h("div", { style: "width:100%" }));
  if (!f || job.state !== "running") return "";
  const p = progressOf(f.summary);
  return h("div", { class: "progress-line" }, h("div", { class: "bar" }, h("div", { style: `width:${(100 * p.frac).toFixed(1)}%` })));
}

/// The jobs table: a row per job, updated in place; a row's state and actions are rebuilt only
/// when its state changes.
const jobRows = new Map();

function renderJobsTable() {
  if ($("page-jobs").hidden) return;
  const tb = $("jobs-table").querySelector("tbody");
  $("jobs-empty").hidden = lab.jobs.length > 0;
  const seen = new Set();
  let prev = null;
  for (const job of lab.jobs) {
    seen.add(job.id);
    if (job.state === "running") follow(job.id);
    let row = jobRows.get(job.id);
    if (!row) {
      const tr = h("tr", { class: "clickable", "data-job": job.id, onclick: () => { location.hash = "#/jobs/" + job.id; } });
      row = { tr, state: null, cells: [0, 1, 2, 3, 4, 5, 6].map(() => h("td", {})) };
      row.cells[0].className = "num";
      row.cells[5].className = "num";
      row.cells[6].className = "acts";
      tr.append(...row.cells);
      jobRows.set(job.id, row);
    }
    const c = row.cells;
    if (row.state !== job.state) {
      row.state = job.state;
      c[0].textContent = String(job.id);
      c[1].textContent = job.kind;
      c[2].textContent = "";
      c[2].append(badge(job.state));
      c[6].textContent = "";
      c[6].append(jobActions(job));
    }
    c[3].textContent = "";
    const cell = jobSummaryCell(job);
    if (cell) c[3].append(cell);
    c[4].textContent = fmtTime(job.started || job.created);
    c[5].textContent = job.started ? fmtSecs((job.ended || Date.now() / 1000) - job.started) : "";
    row.tr.classList.toggle("selected", job.id === jobsPage.selected);
    // Newest first, as the list comes.
    if (prev ? prev.nextSibling !== row.tr : tb.firstChild !== row.tr) {
      if (prev) prev.after(row.tr); else tb.prepend(row.tr);
    }
    prev = row.tr;
  }
  for (const [id, row] of jobRows) if (!seen.has(id)) { row.tr.remove(); jobRows.delete(id); }
}

LAB_PAGES.jobs = {
  show(arg) {
    if (!jobsPage.slot) {
      jobsPage.slot = panelSlot($("job-detail"));
      lab.jobListeners.push(renderJobsTable);
    }
    const id = parseInt(arg, 10);
    jobsPage.selected = Number.isFinite(id) ? id : null;
    if (jobsPage.selected !== null) jobsPage.slot.open(jobsPage.selected);
    renderJobsTable();
    refreshJobs();
  },
};
