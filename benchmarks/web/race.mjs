// The web race's driver (benchmarks/race_web.py): one headless Chromium, every page open in it; the pages take
// turns round by round on the same source ids. node race.mjs CONFIG.json OUT.json, CONFIG:
//   {pages: [{label, url, api: "onnxformer" | "peer"}], sources: [[ids]], maxNewTokens, minNewTokens, rounds}
// OUT: {label: {bytes, requests, failed, loadMs, ms: [per round: [per source]], ids, crossOriginIsolated}}
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [configFile, outFile] = process.argv.slice(2);
const config = JSON.parse(readFileSync(configFile, "utf8"));
const profile = mkdtempSync(join(tmpdir(), "onnxformer-race-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding", "--disable-backgrounding-occluded-windows"],
});
const results = {};
const originOf = (url) => new URL(url).origin;
const byOrigin = new Map(config.pages.map((p) => [originOf(p.url), p.label]));
context.on("requestfinished", async (req) => {       // every response body, the page's workers' included
  const label = byOrigin.get(originOf(req.url()));
  if (!label) return;
  const sizes = await req.sizes();
  results[label].bytes += sizes.responseBodySize;
  results[label].requests.push([new URL(req.url()).pathname, sizes.responseBodySize]);
});
context.on("requestfailed", (req) => {
  const label = byOrigin.get(originOf(req.url()));
  if (label) results[label].failed.push(new URL(req.url()).pathname);
});
const call = (page, api, sources) => page.evaluate(({ api, sources, opts }) => window[api].generate(sources, opts),
  { api, sources, opts: { maxNewTokens: config.maxNewTokens, minNewTokens: config.minNewTokens } });
try {
  const pages = [];
  for (const p of config.pages) {                    // one at a time: each page's load alone on the cores
    results[p.label] = { bytes: 0, requests: [], failed: [], ms: [] };
    const page = await context.newPage(), logs = [];
    page.on("console", (m) => logs.push(m.text()));
    page.on("pageerror", (e) => logs.push(String(e)));
    const t0 = Date.now();
    await page.goto(p.url);
    await page.waitForFunction((api) => window[api] !== undefined, p.api, { timeout: 300000 });
    results[p.label].loadMs = Date.now() - t0;
    const error = await page.evaluate((api) => window[api].error || null, p.api);
    if (error) throw new Error(`${p.label}: the page failed: ${error}\n${logs.join("\n")}`);
    results[p.label].crossOriginIsolated = await page.evaluate(() => self.crossOriginIsolated);
    await call(page, p.api, config.sources);      // warm-up: a round (the WASM code tiers up as it runs)
    pages.push([p, page, logs]);
  }
  for (let round = 0; round < config.rounds; round++) {
    for (const [p, page] of pages) {
      await page.bringToFront();
      const answers = await call(page, p.api, config.sources);
      results[p.label].ms.push(answers.map((a) => a.ms));
      results[p.label].ids = answers.map((a) => a.ids);
    }
  }
  for (const [p, , logs] of pages) results[p.label].console = logs.slice(-20);
  writeFileSync(outFile, JSON.stringify(results));
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
