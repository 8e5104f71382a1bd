// Drive the page in headless Chromium (playwright-core) and print window.onnxformer.translate's answers as JSON:
//   node drive.mjs URL REQUESTS.json   (REQUESTS: [{"texts": [...], "beam": 4, "maxNewTokens": 24}, ...]; a request
//   with "ids" or "sources" (source id lists) runs translateIds, one with "encode" (texts) or "decode" (id lists) the
//   tokenizer)
// The closed network needs these flags, and a fresh profile, or Chromium waits on it.
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [url, requestsFile] = process.argv.slice(2);
const requests = JSON.parse(readFileSync(requestsFile, "utf8"));
const profile = mkdtempSync(join(tmpdir(), "onnxformer-chromium-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  // WEBGPU=1: WebGPU on SwiftShader (Vulkan on the CPU), for a page opened with ?ep=webgpu
  args: ["--no-sandbox", ...(process.env.WEBGPU ? ["--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader"]
    : ["--disable-gpu"]), "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync"],
});
try {
  const page = await context.newPage();
  const logs = [];
  page.on("console", (m) => logs.push(m.text()));
  page.on("pageerror", (e) => logs.push(String(e)));
  await page.goto(url);
  await page.waitForFunction(() => window.onnxformer !== undefined, null, { timeout: 120000 });
  const error = await page.evaluate(() => window.onnxformer.error || null);
  if (error) throw new Error(`the page failed: ${error}\n${logs.join("\n")}`);
  const answers = [];
  for (const r of requests) {
    answers.push(await page.evaluate((r) => {
      const o = window.onnxformer;
      if (r.encode) return o.encode(r.encode, r.srcLang);
      if (r.decode) return o.decode(r.decode);
      const ids = r.ids || r.sources;
      return ids ? o.translateIds(ids, r) : o.translate(r.texts, r);
    }, r));
  }
  const isolated = await page.evaluate(() => self.crossOriginIsolated);
  const threads = await page.evaluate(() => window.onnxformer.threads);
  if (process.env.SCREENSHOT) {                 // the page as a user sees it, after one translation
    await page.setViewportSize({ width: 720, height: 360 });
    await page.click("#go");
    await page.waitForFunction(() => document.getElementById("output").textContent.length > 0);
    await page.screenshot({ path: process.env.SCREENSHOT });
  }
  process.stdout.write(JSON.stringify({ answers, crossOriginIsolated: isolated, threads }));
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
