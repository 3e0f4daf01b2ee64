// Drives the web chat's agent mode in headless Chromium with playwright-core, against a
// server with a workspace and a real model (Qwen2.5-Coder-0.5B-Instruct).
// Usage: node agent.cjs BASE_URL CHROMIUM_PATH USER_DATA_DIR WORKSPACE_DIR
// Prints one line per check and a closing "N passed, N failed" line; exits 1 on failure.
"use strict";

const fs = require("fs");
const path = require("path");
const { chromium } = require("playwright-core");

const [base, exe, userDataDir, workspace] = process.argv.slice(2);
const results = [];

async function check(name, fn) {
  try {
    await fn();
    results.push([name, null]);
    console.log(`browser agent ${name} ... ok`);
  } catch (e) {
    results.push([name, e]);
    console.log(`browser agent ${name} ... FAILED\n${e.stack || e}`);
    throw e;
  }
}

// Sends a message and waits for the agent's turn to end. `onApproval(card, n)` decides each
// approval card (n counts them from 0); it returns the button class to click.
async function turn(page, text, onApproval) {
  // Each scenario in a chat of its own.
  await page.click("#new-chat");
  const before = await page.locator("#messages .msg.tool").count();
  await page.fill("#input", text);
  await page.press("#input", "Enter");
  await page.waitForSelector("#stop:not([hidden])");
  let n = 0;
  for (;;) {
    const done = await page.locator("#send:not([hidden])").count();
    if (done) break;
    const card = page.locator("#messages .approval").first();
    if (await card.count()) {
      const which = onApproval(card, n++);
      await card.locator("button." + which).click();
    }
    await page.waitForTimeout(100);
  }
  const tools = page.locator("#messages .msg.tool");
  const all = await tools.allTextContents();
  return all.slice(before);
}

async function main() {
  const ctx = await chromium.launchPersistentContext(userDataDir, {
    executablePath: exe,
    headless: true,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
      "--disable-component-update", "--disable-sync"],
  });
  const page = ctx.pages()[0] || (await ctx.newPage());
  page.setDefaultTimeout(120000);
  const errors = [];
  page.on("pageerror", (e) => errors.push(e));
  try {
    await check("agent mode is offered when the server has a workspace", async () => {
      await page.goto(base + "/");
      await page.waitForSelector("#agent-toggle:not([hidden])");
      const ws = await page.textContent("#workspace");
      if (!ws.includes(path.basename(workspace))) throw new Error(`workspace shown as ${ws}`);
      await page.check("#agent-mode");
      await page.click("#settings-toggle");
      await page.fill("#temperature", "0");
      await page.fill("#max-tokens", "150");
      for (const f of ["#temperature", "#max-tokens", "#agent-mode"]) await page.dispatchEvent(f, "change");
    });

    await check("'list the files' runs list_dir without asking", async () => {
      let asked = 0;
      const tools = await turn(page, "list the files", () => { asked++; return "deny"; });
      const list = tools.find((t) => t.startsWith("list_dir"));
      if (!list) throw new Error(`no list_dir call: ${JSON.stringify(tools)}`);
      if (!list.includes("readme.md") || !list.includes("src/")) throw new Error(list);
      if (asked !== 0) throw new Error(`${asked} approvals were asked for a read-only tool`);
    });

    await check("'create notes.txt saying hi' asks, is approved, the file exists", async () => {
      let preview = null;
      const tools = await turn(page, "create notes.txt saying hi", (card, n) => {
        if (n === 0) { preview = card; return "approve"; }
        return "deny"; // a model that goes on after the write gets nothing more approved
      });
      if (!preview) throw new Error(`no approval was asked: ${JSON.stringify(tools)}`);
      const w = tools.find((t) => t.startsWith("write_file"));
      if (!w || !w.includes("approved") || !w.includes("+hi")) throw new Error(JSON.stringify(tools));
      const f = path.join(workspace, "notes.txt");
      if (!fs.existsSync(f)) throw new Error("notes.txt was not written");
      if (!fs.readFileSync(f, "utf8").includes("hi")) throw new Error("notes.txt lacks 'hi'");
    });

    await check("a denied run_command does not run", async () => {
      let asked = 0;
      const tools = await turn(page, "Run the shell command: touch ran.txt", () => { asked++; return "deny"; });
      const r = tools.find((t) => t.startsWith("run_command"));
      if (!r || !r.includes("denied") || !r.includes("touch ran.txt")) throw new Error(JSON.stringify(tools));
      if (asked === 0) throw new Error("no approval was asked");
      if (fs.existsSync(path.join(workspace, "ran.txt"))) throw new Error("the denied command ran");
    });

    await check("the transcript survives a reload", async () => {
      if (await page.locator("#chat-list li").count() !== 3) throw new Error("expected three chats");
      const before = await page.locator("#messages .msg").allTextContents();
      await page.reload();
      await page.waitForSelector("#messages .msg.tool");
      const after = await page.locator("#messages .msg").allTextContents();
      if (JSON.stringify(before) !== JSON.stringify(after)) throw new Error("transcript changed on reload");
    });

    await check("no page errors", async () => {
      if (errors.length) throw new Error(errors.map(String).join("\n"));
    });
  } catch (_) {
    const msgs = await page.locator("#messages .msg").evaluateAll((els) => els.map((e) => e.className + ": " + e.textContent));
    console.log("messages on the page:\n" + msgs.join("\n") + "\nstatus: " + (await page.textContent("#status")));
  } finally {
    await ctx.close();
  }
  const failed = results.filter((r) => r[1]).length;
  console.log(`web chat agent: ${results.length - failed} passed, ${failed} failed`);
  process.exit(failed || results.length < 6 ? 1 : 0);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
