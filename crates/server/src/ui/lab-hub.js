// hf2q Lab, the Hugging Face Hub: the settings' Hub token (kept on the server in
// $HF2Q_HOME/hub_token through /api/settings; the page only learns whether one is set and never
// shows it) and the "Push to the Hub" cards of the Quantize, Fine-tune and Datasets sections,
// each a `push` job (hf2q push PATH ORG/NAME with the stored token) followed in its own panel.
"use strict";

// ---- the token -----------------------------------------------------------------------------

function showHubToken(set) {
  $("hub-token-status").textContent = set ? "a token is set" : "no token set";
  $("hub-token-clear").disabled = !set;
}

async function loadHubToken() {
  try { showHubToken((await api("GET", "/api/settings")).hub_token_set); } catch (e) { $("hub-token-status").textContent = e.message; }
}

// The API key may be typed after the page loaded: ask again when the settings open.
$("settings-toggle").addEventListener("click", () => { if (!$("settings").hidden) loadHubToken(); });

$("hub-token-save").addEventListener("click", async () => {
  const token = $("hub-token").value.trim();
  if (!token) { $("hub-token-status").textContent = "paste a token first"; return; }
  try {
    showHubToken((await api("POST", "/api/settings/hub-token", { token })).hub_token_set);
    $("hub-token").value = "";
  } catch (e) { $("hub-token-status").textContent = e.message; }
});

$("hub-token-clear").addEventListener("click", async () => {
  try { showHubToken((await api("DELETE", "/api/settings/hub-token")).hub_token_set); } catch (e) { $("hub-token-status").textContent = e.message; }
});

// ---- push cards ----------------------------------------------------------------------------

/// Per section: what can be pushed from it ([path, label] pairs) and the repository type.
const PUSH_SOURCES = {
  quantize: { type: "model", options: () => (lab.models ? lab.models.data : []).filter((x) => x.kind === "model" && !x.error).map((x) => [x.path, x.path]) },
  finetune: { type: "model", options: () => adapterOptions() },
  datasets: { type: "dataset", options: () => (lab.datasets ? lab.datasets.data : []).map((x) => ["datasets/" + x.name, x.name]) },
};

const pushSlots = {};

/// Refills section `page`'s push card from the lists last fetched.
function fillPushCard(page) {
  const src = PUSH_SOURCES[page];
  const card = document.querySelector(`.push-card[data-push=${page}]`);
  if (!src || !card) return;
  const options = src.options();
  fillSelect(card.querySelector("select"), options, options.length ? undefined : "nothing to push yet");
  card.querySelector("button[type=submit]").disabled = !card.querySelector("select").value;
}

for (const card of document.querySelectorAll(".push-card")) {
  const page = card.dataset.push;
  const status = card.querySelector(".push-status");
  card.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    status.textContent = "";
    const path = card.querySelector("select").value;
    const repo = card.querySelector("input[name=repo]").value.trim();
    if (!path) { status.textContent = "nothing to push yet"; return; }
    if (!/^[^/\s]+\/[^/\s]+$/.test(repo)) { status.textContent = "the repository is ORG/NAME"; return; }
    const params = { path, repo, repo_type: PUSH_SOURCES[page].type, private: card.querySelector("input[name=private]").checked };
    try {
      const job = await submitJob("push", params);
      if (!pushSlots[page]) pushSlots[page] = panelSlot(card.querySelector(".job-inline"));
      card.querySelector(".job-inline").hidden = false;
      pushSlots[page].open(job.id);
      status.textContent = `push job ${job.id} queued`;
      watchJob(job.id, (j) => {
        status.textContent = j.state === "succeeded" ? `pushed to ${repo}` : `push ${j.state} (see its log)`;
      });
    } catch (e) { status.textContent = e.message; }
  });
}

loadHubToken();
