// Where a decoder step's time goes on onnxruntime-web's WASM build (in Node, one thread, this repo's onnxruntime-web
// for every side, so the kernels are the same): our bundles' decoders fed as the page feeds them
// (toolkit/apps/web/src/onnxformer.js: the layout's inputs, the cache tensors out of one step into the next), and
// the web race's peer, Optimum's decoder_model_merged fed as transformers.js feeds it (past_key_values in, present
// out, use_cache_branch), on the same source ids and the same forced target ids, so every side does the same steps.
//   node step_profile.mjs FOLDER... [--steps 32] [--src-len 17] [--reps 5] [--ops] [--trace] [--json FILE]
//     [--opt KEY=VALUE]... [--variant KEY=VALUE]...
// FOLDER: a bundle (it has manifest.json: ours) or the peer's onnx folder (benchmarks/race_web.py writes it at
// out/web-race/SHAPE/site-peer/models/marian/onnx). --opt: a session option for every side (e.g.
// --opt enableCpuMemArena=true); --variant: one more side per folder with that option. The sides take turns
// sentence by sentence after a warm-up sentence, so a loaded machine slows each alike.
// Printed per side (ms, medians unless said): encoder; first decoder step; later steps: the whole step, session.run
// alone and its 10th percentile (what a loaded machine moves least); a sentence (encoder and every step) and the
// fastest one. --ops: ONNX Runtime's profiler per op type, each node's median kernel time (us) summed, for the
// first and the later steps, with the run's and the executor's median (a profiled run is slower: compare sides
// within one run).
import fs, { readFileSync, writeFileSync } from "node:fs";
import { join, resolve } from "node:path";
import { pathToFileURL } from "node:url";

const WEB = resolve(import.meta.dirname, "../../toolkit/apps/web/node_modules/onnxruntime-web/dist/ort.node.min.mjs");
const argv = process.argv.slice(2), BARE = ["--ops", "--trace"];      // the flags that take no value
const folders = argv.filter((a, i) => !a.startsWith("--") && !(i > 0 && argv[i - 1].startsWith("--")
  && !BARE.includes(argv[i - 1])));
const flag = (name, dflt) => { const i = argv.indexOf(name); return i < 0 ? dflt : argv[i + 1]; };
const STEPS = Number(flag("--steps", 32)), SRC = Number(flag("--src-len", 17)), REPS = Number(flag("--reps", 5));
const OPS = argv.includes("--ops"), base = {}, variants = [];
const value = (v) => (v === "true" ? true : v === "false" ? false : isNaN(v) ? v : Number(v));
argv.forEach((a, i) => {
  const [k, v] = (argv[i + 1] || "").split("=");
  if (a === "--opt") base[k] = value(v);
  if (a === "--variant") variants.push([argv[i + 1], { [k]: value(v) }]);
});
const ort = await import(pathToFileURL(WEB));
ort.env.wasm.numThreads = 1;
const i64 = (v, dims) => new ort.Tensor("int64", BigInt64Array.from(v.map(BigInt)), dims);
const pct = (xs, q) => { const s = [...xs].sort((a, b) => a - b); return s[Math.floor(q * (s.length - 1))]; };
const median = (xs) => { const s = [...xs].sort((a, b) => a - b); return s[Math.floor(s.length / 2)]; };
const bytes = (path) => new Uint8Array(readFileSync(path));

async function open(file, data, opts) {
  const externalData = data.map(([path, b]) => ({ path, data: b }));
  return ort.InferenceSession.create(bytes(file), { executionProviders: ["wasm"], externalData,
    enableProfiling: OPS, ...opts });
}

function timed(time, p, s0, r0, r1, logits) {
  const row = logits.data.subarray(0, logits.dims.at(-1));     // what the page's search reads
  if (!row.length) throw new Error("no logits");
  time.run.push(r1 - r0); time.step.push(performance.now() - s0); time.first.push(p === 0);
}

// --- ours: the page's feeds (src/onnxformer.js DecodeState), one input, greedy ---
async function oursSide(bundle, opts) {
  const m = JSON.parse(readFileSync(join(bundle, "manifest.json"), "utf8")), c = m.model;
  const data = [["weights.data", bytes(join(bundle, "weights.data"))]];
  const enc = await open(join(bundle, m.graphs.encoder.file), data, opts);
  const dec = await open(join(bundle, m.graphs.decoder.file), data, opts);
  const layout = m.decoder_layout || "dynamic", H = c.n_heads, Dh = c.d_kv || c.d_model / H;
  const names = (kind, side) => [...Array(c.n_decoder_layers).keys()].flatMap((i) =>
    ["key", "value"].map((kv) => `${kind}.${i}.${side}.${kv}`));
  const past = names("past_key_values", "decoder"), present = names("present", "decoder");
  const crossIn = names("past_key_values", "encoder"), crossOut = names("present", "encoder");
  return { enc, dec, bos: c.bos_id, async run(src, tokens, time) {
    const t0 = performance.now(), srcMask = i64(src.map(() => 1), [1, src.length]);
    const e = await enc.run({ input_ids: i64(src, [1, src.length]), attention_mask: srcMask });
    time.encoder.push(performance.now() - t0);
    const cross = crossOut.map((n) => e[n]), size = layout === "dynamic" ? 0 : tokens.length;
    let cache = past.map(() => new ort.Tensor("float32", new Float32Array(H * size * Dh), [1, H, size, Dh]));
    for (const [p, token] of tokens.entries()) {
      const s0 = performance.now(), width = layout === "dynamic" ? p : size;
      const f = { input_ids: i64([token], [1, 1]), encoder_attention_mask: srcMask, position_ids: i64([p], [1, 1]) };
      if (layout !== "static-per-row") f.decoder_attention_mask = i64(Array(width).fill(1), [1, width]);
      if (layout !== "dynamic") f.past_sequence_length = new ort.Tensor("int32", Int32Array.from([p]), [1]);
      past.forEach((n, i) => { f[n] = cache[i]; });
      crossIn.forEach((n, i) => { f[n] = cross[i]; });
      const r0 = performance.now(), o = await dec.run(f), r1 = performance.now();
      cache = present.map((n) => o[n]);
      timed(time, p, s0, r0, r1, o.logits);
    }
  } };
}

// --- the peer: transformers.js' feeds of Optimum's merged decoder ---
async function peerSide(dir, opts) {
  const cfg = JSON.parse(readFileSync(join(dir, "..", "config.json"), "utf8"));
  const data = (n) => {
    const f = `${n}.onnx_data`;
    return fs.existsSync(join(dir, f)) ? [[f, bytes(join(dir, f))]] : [];
  };
  const enc = await open(join(dir, "encoder_model.onnx"), data("encoder_model"), opts);
  const dec = await open(join(dir, "decoder_model_merged.onnx"), data("decoder_model_merged"), opts);
  const L = cfg.decoder_layers, H = cfg.decoder_attention_heads, Dh = cfg.d_model / H;
  const kinds = ["decoder.key", "decoder.value", "encoder.key", "encoder.value"];
  const names = (pre) => [...Array(L).keys()].flatMap((i) => kinds.map((k) => `${pre}.${i}.${k}`));
  const pastNames = names("past_key_values"), presentNames = names("present");
  return { enc, dec, bos: cfg.decoder_start_token_id, async run(src, tokens, time) {
    const t0 = performance.now(), mask = i64(src.map(() => 1), [1, src.length]);
    const e = await enc.run({ input_ids: i64(src, [1, src.length]), attention_mask: mask });
    time.encoder.push(performance.now() - t0);
    let pkv = pastNames.map(() => new ort.Tensor("float32", new Float32Array(0), [1, H, 0, Dh]));
    for (const [p, token] of tokens.entries()) {
      const s0 = performance.now();
      const f = { input_ids: i64([token], [1, 1]), encoder_attention_mask: mask,
        encoder_hidden_states: e.last_hidden_state, use_cache_branch: new ort.Tensor("bool", [p > 0], [1]) };
      pastNames.forEach((n, i) => { f[n] = pkv[i]; });
      const r0 = performance.now(), o = await dec.run(f), r1 = performance.now();
      pkv = presentNames.map((n, i) => (p > 0 && n.includes(".encoder.") ? pkv[i] : o[n]));   // cross K/V kept
      timed(time, p, s0, r0, r1, o.logits);
    }
  } };
}

function opsOf(session, steps) {  // the profiler's kernel events (the WASM build prints its profile file with
  const lines = [], write = fs.writeSync;      // fs.writeSync(1, ...): taken here, not printed)
  fs.writeSync = (fd, d, ...rest) => (fd === 1 ? (lines.push(Buffer.from(d).toString()), d.length)
    : write(fd, d, ...rest));
  try { session.endProfiling(); } finally { fs.writeSync = write; }
  const events = JSON.parse(lines.join("").trim().replace(/,\s*\]$/, "]")), runs = [[]];
  for (const e of events) {                    // node events in order; a run's model_run event closes it
    if (e.cat === "Node" && e.name.endsWith("_kernel_time")) runs.at(-1).push(e);
    else if (e.name === "SequentialExecutor::Execute") runs.at(-1).execute = e.dur;
    else if (e.name === "model_run") { runs.at(-1).run = e.dur; runs.push([]); }
  }
  const sum = (list) => {                      // per op type: the sum over its nodes of each node's median
    const nodes = {}, ops = {};
    for (const run of list) for (const e of run) (nodes[e.name] ??= { op: e.args.op_name, durs: [] }).durs.push(e.dur);
    for (const { op, durs } of Object.values(nodes)) ops[op] = (ops[op] || 0) + median(durs);
    return Object.fromEntries(Object.entries(ops).sort((a, b) => b[1] - a[1]).map(([k, v]) => [k, Math.round(v)]));
  };
  const timing = (list) => ({ model_run: median(list.map((r) => r.run)), execute: median(list.map((r) => r.execute)),
    nodes: list[0].length, ops: sum(list) });
  const done = runs.filter((r) => r.length);
  if (steps === 1) return timing(done);        // an encoder: one run a sentence
  const first = done.filter((_, i) => i % steps === 0), later = done.filter((_, i) => i % steps);
  return { first_step: timing(first), later_steps: timing(later) };
}

const srcs = [...Array(REPS + 1).keys()].map((r) => [...Array(SRC - 1).keys()].map((i) => 5 + ((r * 31 + i * 7) % 500))
  .concat([0]));
const sides = [];                    // [name, side]: each folder with the base options, then with each variant
for (const path of folders) {
  const ours = fs.existsSync(join(path, "manifest.json"));
  const name = `${ours ? "onnxformer" : "peer"} ${path.split("/").filter(Boolean).slice(-2).join("/")}`;
  for (const [label, opts] of [["", {}], ...variants]) {
    sides.push([label ? `${name} ${label}` : name, await (ours ? oursSide : peerSide)(path, { ...base, ...opts })]);
  }
}
const fresh = () => ({ encoder: [], run: [], step: [], first: [] });
const times = sides.map(fresh);
for (const [r, src] of srcs.entries()) {      // sentence 0 warms the WASM code up, not counted
  for (const [k, [, side]] of sides.entries()) {
    await side.run(src, [side.bos, ...Array(STEPS - 1).fill(7)], r ? times[k] : fresh());
  }
}
const out = {};
for (const [k, [name, side]] of sides.entries()) {
  const time = times[k], later = (xs) => xs.filter((_, i) => !time.first[i]);
  const sentences = time.encoder.map((e, j) => e + time.step.slice(j * STEPS, (j + 1) * STEPS)
    .reduce((a, b) => a + b, 0));
  out[name in out ? `${name} #${k}` : name] = { encoder_ms: median(time.encoder),
    first_step_ms: median(time.step.filter((_, i) => time.first[i])), step_ms: median(later(time.step)),
    run_ms: median(later(time.run)), run_p10_ms: pct(later(time.run), 0.1), sentence_ms: median(sentences),
    sentence_min_ms: Math.min(...sentences),
    ...(argv.includes("--trace") ? { trace: { encoder: time.encoder, steps: time.run } } : {}),
    ...(OPS ? { decoder_us_by_op: opsOf(side.dec, STEPS), encoder_us_by_op: opsOf(side.enc, 1) } : {}) };
}
process.stdout.write(JSON.stringify(out, null, 1) + "\n");
const json = flag("--json", null);
if (json) writeFileSync(json, JSON.stringify(out));
