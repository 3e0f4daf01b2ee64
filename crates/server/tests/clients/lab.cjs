// Drives the web Lab in headless Chromium with playwright-core against a real `hf2q serve`
// (SmolLM2 as `models/smollm2.gguf` in a temporary $HF2Q_HOME) and its real child jobs.
// Usage: node lab.cjs BASE_URL CHROMIUM_PATH USER_DATA_DIR FIXTURES_DIR SCREENSHOT_DIR
// FIXTURES_DIR holds upper.csv (question,answer with uppercase answers) and eval.txt.
// Prints one line per check and a closing "N passed, N failed" line; exits 1 on failure.
"use strict";

const path = require("path");
const { chromium } = require("playwright-core");

const [base, exe, userDataDir, fixtures, shots] = process.argv.slice(2);
const results = [];
const MODEL = "models/smollm2.gguf";

async function check(name, fn) {
  const t0 = Date.now();
  try {
    await fn();
    results.push([name, null]);
    console.log(`browser ${name} ... ok (${((Date.now() - t0) / 1000).toFixed(1)} s)`);
  } catch (e) {
    results.push([name, e]);
    console.log(`browser ${name} ... FAILED\n${e.stack || e}`);
    throw e;
  }
}

async function api(p) {
  const r = await fetch(base + p);
  return r.json();
}

/// Waits until job `id` is in one of `states` (polling the API, not the page).
async function jobState(id, states, ms) {
  const end = Date.now() + ms;
  for (;;) {
    const j = await api("/api/jobs/" + id);
    if (states.includes(j.state)) return j;
    if (Date.now() > end) throw new Error(`job ${id} is ${j.state}, not ${states.join("/")}: ${JSON.stringify(j)}`);
    await new Promise((r) => setTimeout(r, 300));
  }
}

async function newestJob(kind) {
  const j = await api("/api/jobs");
  const x = j.data.find((y) => y.kind === kind);
  if (!x) throw new Error("no " + kind + " job");
  return x;
}

async function main() {
  const ctx = await chromium.launchPersistentContext(userDataDir, {
    executablePath: exe,
    headless: true,
    viewport: { width: 1360, height: 900 },
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
      "--disable-component-update", "--disable-sync"],
  });
  const page = ctx.pages()[0] || (await ctx.newPage());
  page.setDefaultTimeout(30000);
  const errors = [];
  page.on("pageerror", (e) => errors.push(e));
  const external = [];
  page.on("request", (r) => { if (!r.url().startsWith(base)) external.push(r.url()); });
  const shot = (name) => page.screenshot({ path: path.join(shots, name + ".png") });
  try {
    await check("the Lab loads with every section, without network resources", async () => {
      const t0 = Date.now();
      await page.goto(base + "/#/models");
      await page.waitForSelector("#page-models:not([hidden])");
      await page.waitForFunction(() => document.querySelector("#models-table tbody tr"));
      console.log(`  Models section with its table in ${Date.now() - t0} ms`);
      for (const s of ["chat", "models", "quantize", "finetune", "datasets", "jobs"]) {
        if (await page.locator(`#lab-nav a[data-page=${s}]`).count() !== 1) throw new Error("no nav entry " + s);
      }
      const text = await page.locator("#models-table").textContent();
      if (!text.includes(MODEL)) throw new Error("the served model is not listed: " + text);
      await shot("models-before");
    });

    await check("Datasets: upload a CSV, build a dataset, preview it", async () => {
      await page.click("#lab-nav a[data-page=datasets]");
      for (const f of ["upper.csv", "eval.txt"]) {
        await page.setInputFiles("#upload-file", path.join(fixtures, f));
        await page.click("#upload-form button[type=submit]");
        await page.waitForFunction((n) => document.querySelector("#upload-status").textContent.includes("saved data/" + n), f);
      }
      await page.check('#d-inputs input[value="data/upper.csv"]');
      await page.fill("#d-output", "upper");
      await page.selectOption("#d-to", "alpaca");
      await page.fill("#d-map", "instruction=question\noutput=answer");
      await page.fill("#d-valid_split", "0.125");
      await page.selectOption("#d-model", MODEL);
      await page.click("#dataset-form button[type=submit]");
      await page.waitForSelector("#d-job .badge.succeeded", { timeout: 60000 });
      await page.waitForSelector('#datasets-table tr[data-dataset="upper"]');
      await page.waitForFunction(() => document.querySelectorAll("#dataset-view .records pre").length > 0);
      const view = await page.locator("#dataset-view").textContent();
      if (!view.includes("21 train + 3 validation")) throw new Error("unexpected split: " + view);
      await shot("datasets");
    });

    await check("Datasets: a template generates records with the served model, previewed live", async () => {
      await page.selectOption("#g-template", "classify");
      await page.fill("#g-output", "labels");
      await page.fill("#g-labels", "question,statement");
      await page.fill("#g-count", "2");
      await page.fill("#g-max_tokens", "16");
      await page.click("#generate-form button[type=submit]");
      await page.waitForSelector("#g-job .badge.succeeded", { timeout: 120000 });
      await page.waitForFunction(() => document.querySelectorAll("#g-job .records pre").length > 0);
      const rec = await page.locator("#g-job .records pre").first().textContent();
      if (!rec.includes("messages")) throw new Error("not a messages record: " + rec);
      await page.waitForSelector('#datasets-table tr[data-dataset="labels"]');
      await shot("datasets-generate");
    });

    await check("Quantize: SmolLM2 to Q4_0 with a report card", async () => {
      await page.click("#lab-nav a[data-page=quantize]");
      await page.waitForFunction((m) => [...document.querySelectorAll("#q-model option")].some((o) => o.value === m), MODEL);
      await page.selectOption("#q-model", MODEL);
      await page.selectOption("#q-type", "Q4_0");
      await page.selectOption("#q-eval", "data/eval.txt");
      await page.fill("#q-output", "smollm2-q4_0");
      await page.click("#quantize-form button[type=submit]");
      await page.waitForSelector("#q-job .badge.succeeded", { timeout: 180000 });
      await page.waitForFunction(() => document.querySelector("#q-job .report-card") &&
        document.querySelector("#q-job .report-card").textContent.includes("KL vs source"));
      const card = await page.locator("#q-job .report-card").textContent();
      if (!/bitsperweight\d+\.\d{3}/.test(card.replace(/\s+/g, ""))) throw new Error("report card: " + card);
      await shot("quantize");
    });

    await check("Quantize: the Push card offers the new model; the settings keep a Hub token without showing it", async () => {
      const sel = ".push-card[data-push=quantize] select";
      await page.waitForFunction((s) => document.querySelector(s).value.includes("smollm2-q4_0"), sel);
      await page.fill(".push-card[data-push=quantize] input[name=repo]", "me/smollm2-q4_0");
      await page.click("#lab-nav a[data-page=chat]");
      if (await page.locator("#settings").isHidden()) await page.click("#settings-toggle");
      await page.fill("#hub-token", "hf_browser_test_token");
      await page.click("#hub-token-save");
      await page.waitForFunction(() => document.querySelector("#hub-token-status").textContent === "a token is set");
      if (await page.inputValue("#hub-token") !== "") throw new Error("the token stays in the field");
      const s = await api("/api/settings");
      if (s.hub_token_set !== true || JSON.stringify(s).includes("hf_browser_test_token")) throw new Error("settings: " + JSON.stringify(s));
      await shot("settings-hub-token");
      await page.click("#hub-token-clear");
      await page.waitForFunction(() => document.querySelector("#hub-token-status").textContent === "no token set");
      await page.click("#settings-toggle");
      await page.click("#lab-nav a[data-page=quantize]");
      await shot("quantize-push");
    });

    let trainId = null;
    await check("Fine-tune: a short SFT run whose loss plot moves", async () => {
      await page.click("#lab-nav a[data-page=finetune]");
      await page.waitForFunction(() => [...document.querySelectorAll("#t-data option")].some((o) => o.value === "ds:upper"));
      await page.selectOption("#t-model", MODEL);
      await page.selectOption("#t-data", "ds:upper");
      await page.fill("#t-output", "upper");
      await page.fill("#t-steps", "16");
      await page.fill("#t-batch", "2");
      await page.fill("#t-max_seq_len", "96");
      await page.fill("#t-lr", "0.002");
      await page.click("#t-advanced summary");
      await page.fill("#t-eval_every", "4");
      await page.fill("#t-save_every", "4");
      await page.click("#train-form button[type=submit]");
      trainId = (await newestJob("train_sft")).id;
      // The loss line gains points while the job runs.
      const points = () => page.evaluate(() => {
        const l = document.querySelector("#t-job .plot polyline");
        return l ? l.getAttribute("points").trim().split(/\s+/).length : 0;
      });
      await page.waitForFunction(() => {
        const l = document.querySelector("#t-job .plot polyline");
        return l && l.getAttribute("points").trim().split(/\s+/).length >= 2;
      }, null, { timeout: 120000 });
      const first = await points();
      await page.waitForFunction((n) => {
        const l = document.querySelector("#t-job .plot polyline");
        return l && l.getAttribute("points").trim().split(/\s+/).length > n;
      }, first, { timeout: 120000 });
      await shot("finetune-running");
    });

    await check("reload mid-job: the job is still running and its log is replayed", async () => {
      const j = await api("/api/jobs/" + trainId);
      if (j.state !== "running") throw new Error("expected the job to still run, it is " + j.state);
      await page.goto(base + "/#/jobs/" + trainId);
      await page.reload();
      await page.waitForSelector(`#job-detail .badge.running`);
      await page.waitForFunction(() => document.querySelector("#job-detail .log").textContent.includes("step 1/16"));
      await page.waitForSelector(`#jobs-table tr[data-job="${trainId}"] .badge.running`);
      await shot("jobs-running");
    });

    await check("the run finishes with an adapter and eval loss on the plot", async () => {
      await jobState(trainId, ["succeeded"], 240000);
      await page.goto(base + "/#/finetune");
      await page.selectOption("#t-runs", String(trainId));
      await page.waitForSelector("#t-job .badge.succeeded");
      await page.waitForSelector("#t-job .after-training .try-in-chat");
      const evalDots = await page.locator("#t-job .plot").first().locator("circle").count();
      if (evalDots === 0) throw new Error("no eval points on the loss plot");
      await shot("finetune");
    });

    await check("cancel a job from the Jobs section", async () => {
      await page.goto(base + "/#/finetune");
      await page.waitForFunction(() => [...document.querySelectorAll("#t-data option")].some((o) => o.value === "ds:upper"));
      await page.selectOption("#t-model", MODEL);
      await page.selectOption("#t-data", "ds:upper");
      await page.fill("#t-output", "long");
      await page.fill("#t-steps", "500");
      await page.fill("#t-max_seq_len", "64");
      await page.click("#train-form button[type=submit]");
      const id = (await newestJob("train_sft")).id;
      if (id === trainId) throw new Error("no new job");
      await jobState(id, ["running"], 60000);
      await page.goto(base + "/#/jobs/" + id);
      await page.click(`#jobs-table tr[data-job="${id}"] .job-cancel`);
      await jobState(id, ["cancelled"], 60000);
      await page.waitForSelector(`#jobs-table tr[data-job="${id}"] .badge.cancelled`);
    });

    await check("chat with the trained adapter", async () => {
      const ask = async () => {
        await page.click("#new-chat");
        await page.fill("#input", "What is the capital of France?");
        await page.press("#input", "Enter");
        await page.waitForSelector("#stop:not([hidden])");
        await page.waitForSelector("#send:not([hidden])", { timeout: 120000 });
        return (await page.locator("#messages .msg.assistant").last().textContent()).trim();
      };
      await page.goto(base + "/#/chat");
      await page.click("#settings-toggle");
      await page.fill("#temperature", "0");
      await page.fill("#max-tokens", "24");
      await page.dispatchEvent("#temperature", "change");
      await page.dispatchEvent("#max-tokens", "change");
      const plain = await ask();
      await page.goto(base + "/#/finetune");
      await page.selectOption("#t-runs", String(trainId));
      await page.click("#t-job .after-training .try-in-chat");
      await page.waitForSelector("#page-chat:not([hidden])");
      const model = await page.inputValue("#model-select");
      if (!model.endsWith(":upper")) throw new Error("the chat did not switch to the adapter: " + model);
      const tuned = await ask();
      console.log(`  base: ${JSON.stringify(plain)}\n  adapter: ${JSON.stringify(tuned)}`);
      if (!tuned) throw new Error("empty reply from the adapter");
      if (tuned === plain) throw new Error("the adapter's greedy reply equals the base's");
      await shot("chat-adapter");
    });

    await check("Models lists the quantized model and the adapter", async () => {
      await page.goto(base + "/#/models");
      await page.waitForFunction(() => document.querySelector("#models-table").textContent.includes("adapters/upper"));
      const text = await page.locator("#models-table").textContent();
      if (!text.includes("models/smollm2-q4_0.gguf")) throw new Error("quantized model missing: " + text);
      await page.goto(base + "/#/jobs");
      await page.waitForSelector("#jobs-table tbody tr");
      await shot("jobs");
      await page.goto(base + "/#/models");
      await page.waitForFunction(() => document.querySelector("#models-table").textContent.includes("adapters/upper"));
      await shot("models");
    });

    await check("no page errors and no request leaves the server", async () => {
      if (errors.length) throw new Error(errors.map(String).join("\n"));
      if (external.length) throw new Error("external requests: " + external.join(", "));
    });
  } catch (_) {
    try { await shot("failure"); } catch (_) { /* the page may be gone */ }
  } finally {
    await ctx.close();
  }
  const failed = results.filter((r) => r[1]).length;
  console.log(`${results.length - failed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}

main().catch((e) => { console.error(e); process.exit(1); });
