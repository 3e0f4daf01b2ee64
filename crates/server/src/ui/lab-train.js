// hf2q Lab, the Fine-tune section (#/finetune): the SFT / DPO form (the main hyper-parameters,
// the rest in an "advanced" fold; an empty field keeps the command's default), the runs picker,
// a run's live panel (loss, learning rate and tokens/s plots, ETA, GPU memory; stop and resume
// from lab-jobs.js), and what to do with a finished adapter: try it in the chat, fuse it into
// the base, export it for llama.cpp, mlx-lm or PEFT.
"use strict";

const trainPage = { slot: null, after: new Map() };
const TRAIN_FIELDS = ["lora_r", "lora_alpha", "lr", "epochs", "steps", "batch", "max_seq_len", "device",
  "lora_dropout", "targets", "schedule", "warmup_steps", "grad_accum", "weight_decay", "max_grad_norm",
  "valid_split", "eval_every", "save_every", "seed", "grad_checkpoint", "packing", "rslora"];

function trainMethod() {
  return document.querySelector("input[name=t-method]:checked").value;
}

function syncTrainForm() {
  const dpo = trainMethod() === "dpo";
  for (const el of document.querySelectorAll("#train-form .dpo-only")) el.hidden = !dpo;
  for (const el of document.querySelectorAll("#train-form .sft-only")) el.hidden = dpo;
}

/// Datasets built by the Lab (with their validation split) and raw data files.
function dataOptions() {
  const out = [];
  for (const d of (lab.datasets && lab.datasets.data) || []) {
    out.push(["ds:" + d.name, `${d.name} (${d.format || "?"}, ${d.train} train / ${d.valid} valid)`]);
  }
  for (const f of (lab.datasets && lab.datasets.files) || []) out.push(["file:" + f.path, f.path]);
  return out;
}

function trainingJobs() {
  return lab.jobs.filter((j) => j.kind === "train_sft" || j.kind === "train_dpo");
}

function renderRuns() {
  const runs = trainingJobs();
  const sel = $("t-runs");
  fillSelect(sel, runs.map((j) => [String(j.id), `#${j.id} ${j.kind === "train_dpo" ? "DPO" : "SFT"} → ${j.params.output} · ${j.state}`]));
  $("t-runs").disabled = runs.length === 0;
  if (!trainPage.slot.id && runs.length) openRun(runs[0].id);
}

function openRun(id) {
  $("t-runs").value = String(id);
  trainPage.slot.open(id, afterTraining);
}

/// The finished-adapter actions of a run (built once per job, so typing survives re-renders).
function afterTraining(s, job) {
  if (!job || job.state !== "succeeded" || !job.outputs || !job.outputs.length) return null;
  if (trainPage.after.has(job.id)) return trainPage.after.get(job.id);
  const adapter = job.outputs[0];
  const base = job.params.model || "smollm2-135m";
  const stem = adapter.split("/").pop();
  const status = h("div", { class: "muted", role: "status" });
  const run = async (kind, params) => {
    try {
      const j = await submitJob(kind, params);
      status.textContent = `${kind} job ${j.id} queued…`;
      watchJob(j.id, (done) => {
        status.textContent = "";
        status.append(`${kind} job ${j.id}: ${done ? done.state : "?"} `,
          done && done.outputs && done.outputs.length ? `→ ${done.outputs.join(", ")} ` : "",
          h("a", { href: "#/jobs/" + j.id, text: "log" }));
      });
    } catch (e) { status.textContent = e.message; }
  };
  const fuseType = h("select", { "aria-label": "Fused type" }, h("option", { value: "", text: "base's own types" }),
    ...["Q8_0", "Q4_K_M", "Q6_K", "F16"].map((t) => h("option", { text: t })));
  const fuseName = h("input", { type: "text", value: stem + "-fused", "aria-label": "Fused model name" });
  const exportTo = h("select", { "aria-label": "Export format" }, h("option", { value: "gguf-lora", text: "llama.cpp LoRA GGUF" }),
    h("option", { value: "mlx", text: "mlx-lm adapter" }), h("option", { value: "peft", text: "PEFT folder" }));
  const exportName = h("input", { type: "text", value: stem + "-export", "aria-label": "Export name" });
  const box = h("div", { class: "card after-training" },
    h("h3", { text: "Adapter " + adapter }),
    h("div", { class: "inline" }, h("button", { type: "button", class: "primary try-in-chat", text: "Try in chat",
      onclick: () => tryAdapterInChat(adapter).catch((e) => { status.textContent = e.message; }) })),
    h("div", { class: "inline", style: "margin-top:8px" }, "Fuse into", h("code", { text: base }), "as", fuseType, fuseName,
      h("button", { type: "button", text: "Fuse", onclick: () => {
        const p = { model: base, adapter, output: fuseName.value.trim() };
        if (fuseType.value) p.type = fuseType.value;
        run("fuse", p);
      } })),
    h("div", { class: "inline", style: "margin-top:8px" }, "Export as", exportTo, exportName,
      h("button", { type: "button", text: "Export", onclick: () => run("export_adapter", { adapter, output: exportName.value.trim(), to: exportTo.value, base }) })),
    status);
  trainPage.after.set(job.id, box);
  return box;
}

LAB_PAGES.finetune = {
  async show() {
    if (!trainPage.slot) {
      trainPage.slot = panelSlot($("t-job"));
      lab.jobListeners.push(() => { if (!$("page-finetune").hidden) renderRuns(); });
    }
    syncTrainForm();
    try {
      await Promise.all([refreshModels(), refreshDatasets()]);
      fillSelect($("t-model"), modelOptions());
      fillSelect($("t-data"), dataOptions());
      fillSelect($("t-adapter"), adapterOptions(), "none (a new adapter)");
      fillPushCard("finetune");
    } catch (e) { showLabError(e.message); }
    renderRuns();
  },
};

for (const r of document.querySelectorAll("input[name=t-method]")) r.addEventListener("change", syncTrainForm);
$("t-runs").addEventListener("change", () => { const id = parseInt($("t-runs").value, 10); if (id) openRun(id); });

$("train-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("t-error").textContent = "";
  const dpo = trainMethod() === "dpo";
  const params = readFields("t-", TRAIN_FIELDS, { model: $("t-model").value, output: $("t-output").value.trim() });
  const data = $("t-data").value;
  if (!data) { $("t-error").textContent = "pick a dataset (build one on the Datasets page)"; return; }
  if (data.startsWith("ds:")) {
    const name = data.slice(3);
    params.data = `datasets/${name}/train.jsonl`;
    const d = lab.datasets.data.find((x) => x.name === name);
    if (d && d.valid > 0 && params.valid_split === undefined) params.valid = `datasets/${name}/valid.jsonl`;
  } else {
    params.data = data.slice(5);
  }
  if (dpo) {
    readFields("t-", ["beta", "adapter"], params);
  } else {
    readFields("t-", ["train_on_prompt"], params);
  }
  if (params.steps !== undefined) delete params.epochs;
  try {
    const job = await submitJob(dpo ? "train_dpo" : "train_sft", params);
    renderRuns();
    openRun(job.id);
  } catch (e) { $("t-error").textContent = e.message; }
});
