// onnxformer's page code and graphs in Node, for benchmarks/web_logits.py (why the page's ids differ from the
// runtime's):
//   node in_node.mjs logits BUNDLE JOBS.json OUT.json
//     JOBS: [{src: source ids, tokens: target ids fed after the decoder start, capacity}]; per job the encoder's
//     cross keys/values and every decoder step's logits, one row, fed as the page feeds (toolkit/apps/web/src), on
//     onnxruntime-web's WASM build with one thread: the page's numbers without a browser
//   node in_node.mjs page SITE REQUESTS.json [ORT_NODE]
//     the site's own onnxformer.js (its search and tokenizer) answering translate requests; ORT_NODE: the folder of
//     an onnxruntime-node package, which then runs the graphs on the native CPU EP instead of WASM
import { cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { pathToFileURL } from "node:url";

const WEB = resolve(import.meta.dirname, "../../toolkit/apps/web/node_modules/onnxruntime-web/dist/ort.node.min.mjs");
const [command, ...args] = process.argv.slice(2);

async function logits(bundle, jobsFile, outFile) {
  const ort = await import(pathToFileURL(WEB));
  ort.env.wasm.numThreads = 1;
  const m = JSON.parse(readFileSync(join(bundle, "manifest.json"), "utf8")), c = m.model;
  const externalData = [{ path: "weights.data", data: new Uint8Array(readFileSync(join(bundle, "weights.data"))) }];
  const open = (g) => ort.InferenceSession.create(new Uint8Array(readFileSync(join(bundle, g.file))),
    { executionProviders: ["wasm"], externalData });
  const enc = await open(m.graphs.encoder), dec = await open(m.graphs.decoder);
  const dynamic = (m.decoder_layout || "dynamic") === "dynamic", H = c.n_heads, Dh = c.d_kv || c.d_model / H;
  const names = (kind, side) => [...Array(c.n_decoder_layers).keys()].flatMap((i) =>
    ["key", "value"].map((kv) => `${kind}.${i}.${side}.${kv}`));
  const i64 = (v, dims) => new ort.Tensor("int64", BigInt64Array.from(v.map(BigInt)), dims);
  const out = [];
  for (const job of JSON.parse(readFileSync(jobsFile, "utf8"))) {
    const S = job.src.length, size = dynamic ? 0 : job.capacity;
    const e = await enc.run({ input_ids: i64(job.src, [1, S]), attention_mask: i64(job.src.map(() => 1), [1, S]) });
    const cross = names("present", "encoder").map((n) => e[n]), steps = [];
    let cache = names("past_key_values", "decoder").map(() =>
      new ort.Tensor("float32", new Float32Array(H * size * Dh), [1, H, size, Dh]));
    for (const [p, token] of [c.bos_id, ...job.tokens].entries()) {
      const f = { input_ids: i64([token], [1, 1]), encoder_attention_mask: i64(Array(S).fill(1), [1, S]),
        position_ids: i64([p], [1, 1]) };
      if (dynamic) f.decoder_attention_mask = i64(Array(p).fill(1), [1, p]);
      else f.past_sequence_length = new ort.Tensor("int32", Int32Array.from([p]), [1]);
      if (m.decoder_layout === "static-shared") f.decoder_attention_mask = i64(Array(size).fill(1), [1, size]);
      names("past_key_values", "decoder").forEach((n, i) => { f[n] = cache[i]; });
      names("past_key_values", "encoder").forEach((n, i) => { f[n] = cross[i]; });
      const o = await dec.run(f);
      cache = names("present", "decoder").map((n) => o[n]);
      steps.push(Array.from(o.logits.data));
    }
    out.push({ cross: cross.map((t) => Array.from(t.data)), logits: steps });
  }
  writeFileSync(outFile, JSON.stringify(out));
}

function nativeShim(ortNode) {        // onnxruntime-node dressed as the page's ./ort.wasm.min.mjs
  const index = pathToFileURL(join(resolve(ortNode), "dist", "index.js"));
  return `import * as n from "${index}"; import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os"; import { join } from "node:path";
export const Tensor = n.Tensor, env = n.env;
export const InferenceSession = { async create(bytes, opts) {   // the native binding takes files: graph + its data
  const dir = mkdtempSync(join(tmpdir(), "onnxformer-native-"));
  for (const e of opts.externalData || []) writeFileSync(join(dir, e.path), e.data);
  writeFileSync(join(dir, "graph.onnx"), bytes);
  return n.InferenceSession.create(join(dir, "graph.onnx"), { executionProviders: ["cpu"], intraOpNumThreads: 1 });
} };`;
}

async function page(site, requestsFile, ortNode) {
  const dir = mkdtempSync(join(tmpdir(), "onnxformer-page-"));
  try {
    cpSync(site, dir, { recursive: true });
    const ortModule = ortNode ? nativeShim(ortNode) : `export * from "${pathToFileURL(WEB)}";`;
    writeFileSync(join(dir, "ort.wasm.min.mjs"), ortModule);
    globalThis.fetch = async (name) => {     // the page fetches its bundle from its own folder
      const b = readFileSync(join(dir, String(name)));
      return { ok: true, json: async () => JSON.parse(b.toString("utf8")),
        arrayBuffer: async () => b.buffer.slice(b.byteOffset, b.byteOffset + b.length) };
    };
    process.chdir(dir);                      // the page sets ort.env.wasm.wasmPaths = "./"
    const mod = await import(pathToFileURL(join(dir, "onnxformer.js")));
    const model = await mod.Model.load(), answers = [];
    for (const r of JSON.parse(readFileSync(requestsFile, "utf8"))) {
      answers.push(await mod.translate(model, r.texts, r));
    }
    process.stdout.write(JSON.stringify({ answers }));
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

if (command === "logits") await logits(...args);
else if (command === "page") await page(...args);
else throw new Error(`unknown command ${command}: logits or page`);
