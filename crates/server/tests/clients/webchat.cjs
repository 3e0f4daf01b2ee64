// Drives the web chat in headless Chromium with playwright-core.
// Usage: node webchat.cjs BASE_URL CHROMIUM_PATH USER_DATA_DIR
// (playwright-core is found through NODE_PATH). Prints one line per check and a closing
// "N passed, N failed" line; exits 1 on failure.
"use strict";

const { chromium } = require("playwright-core");

const [base, exe, userDataDir] = process.argv.slice(2);
const results = [];

async function check(name, fn) {
  try {
    await fn();
    results.push([name, null]);
    console.log(`browser ${name} ... ok`);
  } catch (e) {
    results.push([name, e]);
    console.log(`browser ${name} ... FAILED\n${e.stack || e}`);
    throw e;
  }
}

async function metric(name) {
  const r = await fetch(base + "/metrics");
  const line = (await r.text()).split("\n").find((l) => l.startsWith(name + " ") || l.startsWith(name + "{"));
  return line ? parseFloat(line.split(" ").pop()) : 0;
}

async function main() {
  const ctx = await chromium.launchPersistentContext(userDataDir, {
    executablePath: exe,
    headless: true,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
      "--disable-component-update", "--disable-sync"],
  });
  const page = ctx.pages()[0] || (await ctx.newPage());
  page.setDefaultTimeout(20000);
  const errors = [];
  page.on("pageerror", (e) => errors.push(e));
  try {
    await check("page loads with model info", async () => {
      await page.goto(base + "/");
      await page.waitForFunction(() => document.getElementById("model-info").textContent.includes("tiny"));
      if (await page.locator("#messages .msg").count() !== 0) throw new Error("fresh profile should have no messages");
    });

    await check("settings are kept", async () => {
      await page.click("#settings-toggle");
      await page.fill("#temperature", "0");
      await page.fill("#max-tokens", "40");
      await page.fill("#system-prompt", "You are terse.");
      await page.dispatchEvent("#temperature", "change");
      await page.dispatchEvent("#max-tokens", "change");
      await page.dispatchEvent("#system-prompt", "change");
    });

    await check("a message gets a streamed reply", async () => {
      await page.fill("#input", "Hello there");
      await page.press("#input", "Enter");
      // While streaming: the stop button shows and the reply grows.
      await page.waitForSelector("#stop:not([hidden])");
      await page.waitForFunction(() => {
        const m = document.querySelector("#messages .msg.assistant.streaming");
        return m && m.textContent.length > 0;
      });
      await page.waitForSelector("#send:not([hidden])", { timeout: 30000 });
      const reply = await page.locator("#messages .msg.assistant").last().textContent();
      if (!reply || reply.length === 0) throw new Error("empty reply");
      if (await page.locator("#messages .msg.user").count() !== 1) throw new Error("user message missing");
    });

    await check("stop cancels generation on the server", async () => {
      const before = await metric("hf2q_sequences_finished_total{reason=\"cancelled\"}");
      await page.fill("#max-tokens", "80");
      await page.dispatchEvent("#max-tokens", "change");
      await page.fill("#input", "Tell me a long story");
      await page.press("#input", "Enter");
      await page.waitForFunction(() => {
        const m = document.querySelector("#messages .msg.assistant.streaming");
        return m && m.textContent.length > 0;
      });
      await page.click("#stop");
      await page.waitForSelector("#send:not([hidden])");
      const note = await page.locator("#messages .msg.assistant").last().locator(".note").textContent();
      if (note !== "stopped") throw new Error(`note is ${note}`);
      const deadline = Date.now() + 5000;
      while ((await metric("hf2q_sequences_finished_total{reason=\"cancelled\"}")) <= before) {
        if (Date.now() > deadline) throw new Error("the server did not cancel the sequence");
        await new Promise((r) => setTimeout(r, 50));
      }
      if ((await metric("hf2q_running_sequences")) !== 0) throw new Error("a sequence is still running");
    });

    await check("history survives a reload", async () => {
      const before = await page.locator("#messages .msg").allTextContents();
      await page.reload();
      await page.waitForSelector("#messages .msg");
      const after = await page.locator("#messages .msg").allTextContents();
      if (JSON.stringify(before) !== JSON.stringify(after)) throw new Error(`${JSON.stringify(before)} != ${JSON.stringify(after)}`);
      if (after.length !== 4) throw new Error(`expected 4 messages, got ${after.length}`);
      if (await page.inputValue("#system-prompt") !== "You are terse.") throw new Error("settings lost");
      if (await page.locator("#chat-list li").count() !== 1) throw new Error("conversation list lost");
    });

    await check("markdown is rendered safely", async () => {
      const html = await page.evaluate(() => {
        // The renderer is the page's own; feed it a reply with code, emphasis and an injection.
        return markdown("# T\n**b** `x<y>`\n```js\nlet a = '<b>';\n```\n<img src=x onerror=alert(1)>");
      });
      if (!html.includes("<strong>b</strong>") || !html.includes("<code>x&lt;y&gt;</code>")) throw new Error(html);
      if (!html.includes('<code class="language-js">let a = &#39;&lt;b&gt;&#39;;</code>')) throw new Error(html);
      if (html.includes("<img")) throw new Error(`unescaped HTML: ${html}`);
    });

    await check("reasoning is shown folded above the answer, and not sent back", async () => {
      // A canned stream, as a reasoning model's server sends it (`reasoning_content` deltas, then
      // content): the tiny model has no reasoning channel.
      const sent = [];
      await page.route("**/v1/chat/completions", async (route) => {
        sent.push(JSON.parse(route.request().postData()));
        const frames = [
          { choices: [{ index: 0, delta: { role: "assistant" } }] },
          { choices: [{ index: 0, delta: { reasoning_content: "The user greets; " } }] },
          { choices: [{ index: 0, delta: { reasoning_content: "answer briefly." } }] },
          { choices: [{ index: 0, delta: { content: "Hi!" } }] },
          { choices: [{ index: 0, delta: {}, finish_reason: "stop" }] },
        ];
        const body = frames.map((f) => "data: " + JSON.stringify(f) + "\n\n").join("") + "data: [DONE]\n\n";
        await route.fulfill({ status: 200, headers: { "content-type": "text/event-stream" }, body });
      });
      try {
        for (const text of ["Think first", "And again"]) {
          const n = await page.locator("#messages .msg.assistant").count();
          await page.fill("#input", text);
          await page.press("#input", "Enter");
          await page.waitForFunction((n) => document.querySelectorAll("#messages .msg.assistant").length > n
            && !document.getElementById("send").hidden, n);
        }
        const last = page.locator("#messages .msg.assistant").last();
        const reasoning = await last.locator("details.reasoning").textContent();
        if (!reasoning.includes("The user greets; answer briefly.")) throw new Error(`reasoning: ${reasoning}`);
        if (await last.locator("details.reasoning").evaluate((d) => d.open)) {
          throw new Error("the reasoning should fold once the answer is there");
        }
        const answer = await last.evaluate((el) => [...el.childNodes].filter((c) => c.tagName !== "DETAILS")
          .map((c) => c.textContent).join(""));
        if (!answer.includes("Hi!") || answer.includes("greets")) throw new Error(`answer: ${answer}`);
        const second = sent[1].messages;
        if (second.some((m) => "reasoning" in m || "reasoning_content" in m)) throw new Error("reasoning sent back");
        if (!second.some((m) => m.role === "assistant" && m.content === "Hi!")) throw new Error(JSON.stringify(second));
      } finally {
        await page.unroute("**/v1/chat/completions");
      }
    });

    await check("no page errors", async () => {
      if (errors.length) throw new Error(errors.map(String).join("\n"));
    });
  } catch (_) {
    // Reported by check(); show what the page shows.
    const msgs = await page.locator("#messages .msg").evaluateAll((els) => els.map((e) => e.className + ": " + e.textContent));
    console.log("messages on the page:\n" + msgs.join("\n") + "\nstatus: " + (await page.textContent("#status")));
  } finally {
    await ctx.close();
  }
  const failed = results.filter((r) => r[1]).length;
  console.log(`web chat: ${results.length - failed} passed, ${failed} failed`);
  process.exit(failed || results.length < 8 ? 1 : 0);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
