// hf2q Lab, the Datasets section's generation form: a `dataset_generate` job (records written
// by the served model or one of its adapters through this server's /v1 API), with a form per
// template (only that template's inputs shown) and a live preview of the first records from
// the job's `record` events. Uses lab.js, lab-jobs.js and lab-pages.js.
"use strict";

const generate = { slot: null };
/// Records shown in the live preview.
const PREVIEW_RECORDS = 5;
const GENERATE_FIELDS = ["model", "count", "max_tokens", "temperature", "seed", "seeds", "source", "inputs", "style",
  "labels", "about", "topics", "turns", "prompts", "chosen_model", "chosen_temperature", "rejected_model",
  "rejected_temperature"];

function syncGenerateForm() {
  const t = $("g-template").value;
  for (const el of document.querySelectorAll("#generate-form [data-t]")) el.hidden = el.dataset.t !== t;
}

/// The served model and its adapters (GET /v1/models) for the model pickers.
async function fillServedSelects() {
  let ids = [];
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    ids = (await r.json()).data.map((m) => m.id);
  } catch (_) { /* left empty: the server answers for its own model */ }
  for (const sel of document.querySelectorAll("#generate-form select.served-select")) {
    fillSelect(sel, ids.map((id) => [id, id]), sel.dataset.none);
  }
}

/// The first records of a running or finished generation, as they arrive.
function generatePreview(s) {
  const box = h("div", { class: "records" }, h("div", { class: "muted", text: `preview: ${Math.min(PREVIEW_RECORDS, s.records.length)} of ${s.records.length} records` }));
  for (const r of s.records.slice(0, PREVIEW_RECORDS)) box.append(h("pre", { text: JSON.stringify(r, null, 1) }));
  return box;
}

datasetsPage.refreshed.push(() => {
  if (!generate.slot) generate.slot = panelSlot($("g-job"));
  for (const sel of document.querySelectorAll("#generate-form select.file-select")) fillSelect(sel, textFileOptions(), "none");
  fillServedSelects();
  syncGenerateForm();
});

$("g-template").addEventListener("change", syncGenerateForm);

$("generate-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("g-error").textContent = "";
  const params = readFields("g-", GENERATE_FIELDS, { template: $("g-template").value, output: $("g-output").value.trim() });
  try {
    const job = await submitJob("dataset_generate", params);
    $("g-job").hidden = false;
    generate.slot.open(job.id, generatePreview);
    watchJob(job.id, async (j) => {
      await refreshDatasetsPage();
      if (j.state === "succeeded") showDataset(params.output, "train");
    });
  } catch (e) { $("g-error").textContent = e.message; }
});
