// onnxformer in the browser: an onnxformer bundle (manifest.json, encoder/decoder graphs, tokenizer.json) run
// with onnxruntime-web's WASM execution provider; greedy and beam search as runtime/search.py does them, so the
// ids equal the Python runtime's. The page's API (stable: tests and benchmarks drive it), on window.onnxformer:
//   translate(texts, {beam, maxNewTokens, minNewTokens, srcLang, tgtLang}) -> [{ids, text, ms}]
//   translateIds(sourceIdLists, {beam, maxNewTokens, minNewTokens, tgtLang}) -> [{ids, ms}]   (alias: generate)
//     sources: source id arrays, as the bundle's tokenizer would give them (its framing included); no tokenizer runs
//   encode(texts, srcLang?) -> source id lists;  decode(idLists) -> texts;  manifest;  ep;  threads;  error
// ids without the final EOS; ms: that input's whole search, encoder and every decoder step (performance.now);
// minNewTokens: EOS is not chosen before that many new tokens (runtime SearchOptions.min_new_tokens).
// The page's URL may say ?threads=N: WASM threads for ONNX Runtime (the site is cross-origin isolated), and
// ?ep=webgpu: onnxruntime-web's WebGPU build (a site written with --webgpu has it), else the WASM one.
const PARAMS = new URLSearchParams(typeof location === "undefined" ? "" : location.search);
const EP = PARAMS.get("ep") === "webgpu" ? "webgpu" : "wasm";
const ort = await import(EP === "webgpu" ? "./ort.webgpu.min.mjs" : "./ort.wasm.min.mjs");
import { tokenizerOf } from "./text.js";

const BUNDLE = "./";                    // onnxformer web writes the site flat: page, runtime and bundle side by side
ort.env.wasm.wasmPaths = "./";
// one thread by default: the same sums, in the same order, every run
ort.env.wasm.numThreads = Number(PARAMS.get("threads")) || 1;

async function fetchJson(name) {
  const r = await fetch(BUNDLE + name);
  if (!r.ok) throw new Error(`${name}: HTTP ${r.status}`);
  return r.json();
}

async function fetchBytes(name) {
  const r = await fetch(BUNDLE + name);
  if (!r.ok) throw new Error(`${name}: HTTP ${r.status}`);
  return new Uint8Array(await r.arrayBuffer());
}

const externalFiles = new Map();         // name -> Promise of its bytes: both graphs share weights.data, fetched once

async function session(graph) {
  // a graph's external data files (onnx's location field) are named in the manifest's "files" or found by the
  // graph's own name; the exporter writes them as weights.data beside the graphs. Given as bytes, not as a URL:
  // a URL would make each session download the shared file again.
  const names = graph.external_data || ["weights.data"];
  for (const p of names) if (!externalFiles.has(p)) externalFiles.set(p, fetchBytes(p));
  const [bytes, ...data] = await Promise.all([fetchBytes(graph.file), ...names.map((p) => externalFiles.get(p))]);
  const externalData = names.map((p, i) => ({ path: p, data: data[i] }));
  return ort.InferenceSession.create(bytes, { executionProviders: [EP], externalData });
}

// --- tensors ---
const int64 = (values, dims) => new ort.Tensor("int64", BigInt64Array.from(values.map(BigInt)), dims);
const LAYOUTS = ["dynamic", "static-per-row", "static-shared"];

function repeatRows(t, k) {           // [1, ...] -> [k, ...]
  const n = t.data.length, data = new Float32Array(n * k);
  for (let r = 0; r < k; r++) data.set(t.data, r * n);
  return new ort.Tensor("float32", data, [k, ...t.dims.slice(1)]);
}

function gatherRows(t, rows) {        // rows of a float tensor [B, ...]
  const per = t.dims.slice(1).reduce((a, b) => a * b, 1), data = new Float32Array(per * rows.length);
  rows.forEach((r, j) => data.set(t.data.subarray(r * per, (r + 1) * per), j * per));
  return new ort.Tensor("float32", data, [rows.length, ...t.dims.slice(1)]);
}

// --- the model: encoder once, then the decoder step by step with its self-attention cache ---
class Model {
  static async load() {
    const manifest = await fetchJson("manifest.json");
    const layout = manifest.decoder_layout || "dynamic";
    if (!LAYOUTS.includes(layout)) throw new Error(`decoder layout ${layout} is not one of ${LAYOUTS.join(", ")}`);
    // one session at a time: the WebGPU EP refuses a second while one is being created
    const encoder = await session(manifest.graphs.encoder), decoder = await session(manifest.graphs.decoder);
    const tok = await fetchJson("page-tokenizer.json");
    return new Model(manifest, layout, encoder, decoder, tokenizerOf(tok));
  }
  constructor(manifest, layout, encoder, decoder, tokenizer) {
    Object.assign(this, { manifest, layout, encoder, decoder, tokenizer });
    const c = manifest.model;
    this.config = c;
    this.layers = c.n_decoder_layers;
    this.heads = c.n_heads;
    this.headDim = c.d_kv || c.d_model / c.n_heads;
    const names = (kind, side) => [...Array(this.layers).keys()].flatMap((i) =>
      ["key", "value"].map((kv) => `${kind}.${i}.${side}.${kv}`));
    this.cross = names("present", "encoder");
    this.crossIn = names("past_key_values", "encoder");
    this.past = names("past_key_values", "decoder");
    this.present = names("present", "decoder");
    if ((c.begin_suppress_tokens || []).length)   // not applied by this search: refuse rather than differ
      throw new Error("this bundle suppresses tokens at the first step (begin_suppress_tokens), which the page does not do yet");
    this.suppress = [...new Set([...(c.suppress_pad ? [c.pad_id] : []), ...(c.suppress_tokens || [])])];
    this.suppressWithEos = [...new Set([...this.suppress, c.eos_id])];   // before minNewTokens (banned)
  }

  async encode(ids) {
    const out = await this.encoder.run({ input_ids: int64(ids, [1, ids.length]),
      attention_mask: int64(ids.map(() => 1), [1, ids.length]) });
    return this.cross.map((n) => out[n]);
  }

  // a decoder state over `rows` rows of one input: step(tokens, keep) -> logits rows (Float32Array each)
  async start(ids, rows, capacity) {
    const cross = (await this.encode(ids)).map((t) => rows === 1 ? t : repeatRows(t, rows));
    return new DecodeState(this, cross, ids.length, rows, capacity);
  }
}

class DecodeState {
  // the layouts of runtime/feed.py; position_ids [B, 1] = P and the source mask [B, S] (one unpadded input: ones)
  //   dynamic         past [B, H, P, Dh] in, present [B, H, P + 1, Dh] out, decoder_attention_mask [B, P] ones
  //   static-per-row  one buffer [B, H, capacity, Dh] in and out (updated), past_sequence_length int32 [B] = P
  //   static-shared   the same, past_sequence_length [1], decoder_attention_mask [B, capacity] ones
  constructor(model, cross, srcLen, rows, capacity) {
    Object.assign(this, { model, cross, srcLen, rows, capacity, filled: 0 });
    const m = model, size = m.layout === "dynamic" ? 0 : capacity;
    this.cache = m.past.map(() => new ort.Tensor("float32", new Float32Array(rows * m.heads * size * m.headDim),
      [rows, m.heads, size, m.headDim]));
  }

  async step(tokens, keep) {
    const m = this.model, rows = keep ? keep.length : this.rows;
    if (keep) {
      this.cache = this.cache.map((t) => gatherRows(t, keep));
      if (rows !== this.rows) this.cross = this.cross.map((t) => gatherRows(t, keep));
      this.rows = rows;
    }
    if (!this.srcMask || this.srcMask.dims[0] !== rows)   // built again only when the rows change
      this.srcMask = int64(Array(rows * this.srcLen).fill(1), [rows, this.srcLen]);
    const p = this.filled, feeds = {
      input_ids: int64(tokens, [rows, 1]),
      encoder_attention_mask: this.srcMask,
      position_ids: int64(Array(rows).fill(p), [rows, 1]),
    };
    if (m.layout !== "static-per-row") {
      const width = m.layout === "dynamic" ? p : this.capacity;
      feeds.decoder_attention_mask = int64(Array(rows * width).fill(1), [rows, width]);
    }
    if (m.layout !== "dynamic") {
      const n = m.layout === "static-per-row" ? rows : 1;
      feeds.past_sequence_length = new ort.Tensor("int32", new Int32Array(n).fill(p), [n]);
    }
    m.past.forEach((n, i) => { feeds[n] = this.cache[i]; });
    m.crossIn.forEach((n, i) => { feeds[n] = this.cross[i]; });
    const out = await m.decoder.run(feeds);
    this.cache = m.present.map((n) => out[n]);
    this.filled += 1;
    const logits = out.logits, vocab = logits.dims[logits.dims.length - 1];
    // views, not copies: the output tensor is this step's alone (the next step gets a new one)
    return [...Array(rows).keys()].map((r) => logits.data.subarray(r * vocab, (r + 1) * vocab));
  }
}

// --- search (runtime/search.py): one input at a time; its rows are its beams ---
function logSoftmax(row) {            // as runtime.search.log_softmax: float32 elementwise, the sum in float64
  let top = -Infinity;
  for (const x of row) if (x > top) top = x;
  if (!Number.isFinite(top)) throw new Error("the model gave a non-finite logit (NaN or inf) while decoding");
  const shifted = row.map((x) => Math.fround(x - top));
  let sum = 0;
  for (const x of shifted) sum += Math.fround(Math.exp(x));
  const norm = Math.fround(Math.log(sum));
  return shifted.map((x) => Math.fround(x - norm));
}

function argmax(row) {                // the first of equal maxima, as numpy's argmax
  let best = 0;
  for (let i = 1; i < row.length; i++) if (row[i] > row[best]) best = i;
  return best;
}

function banned(model, step, minNew) {   // the ids not to choose at this step: the bundle's, EOS before minNew
  return step < minNew ? model.suppressWithEos : model.suppress;
}

function suppressed(row, ids) {      // in place: every row here is this step's own (a view of its logits output,
  for (const i of ids) row[i] = -Infinity;   // or logSoftmax's new array), read once
  return row;
}

// `lead`: target ids forced after the decoder start (NLLB's target language), never scored; maxNew and minNew count
// after it
async function greedy(model, ids, maxNew, forcedEos, lead = [], minNew = 0) {
  const { bos_id: bos, eos_id: eos } = model.config, P = lead.length, tokens = [];
  const state = await model.start(ids, 1, maxNew + P);
  let last = bos;
  for (let step = 0; step < maxNew + P; step++) {
    const [logits] = await state.step([last], null);
    if (step < P) last = lead[step];
    else last = forcedEos && step === maxNew + P - 1 ? eos : argmax(suppressed(logits, banned(model, step - P, minNew)));
    tokens.push(last);
    if (last === eos && step >= P) break;
  }
  return tokens;
}

function topStable(cand, n) {         // indices of the n largest, best first, ties by lower index (one pass,
  const best = [];                    // not a sort of every candidate: k * vocab of them each step)
  for (let i = 0; i < cand.length; i++) {
    const x = cand[i];
    if (!(x > -Infinity) || (best.length === n && !(x > cand[best[n - 1]]))) continue;
    let j = best.length < n ? best.length : n - 1;
    while (j > 0 && cand[best[j - 1]] < x) { best[j] = best[j - 1]; j--; }
    best[j] = i;
  }
  for (let i = 0; i < cand.length && best.length < n; i++) if (!(cand[i] > -Infinity)) best.push(i);
  return best;
}

function attainable(score, length, maxNew, lp) {   // runtime.search.attainable
  const final = lp >= 0 ? maxNew : Math.min(length + 1, maxNew);
  return score / final ** lp;
}

// lead: forced on beam 0 first, scoring nothing and counted in lengths (runtime.search's prefix_counted)
async function beamSearch(model, ids, k, maxNew, forcedEos, lead = [], minNew = 0, lp = 1.0) {
  const { bos_id: bos, eos_id: eos } = model.config, P = lead.length, state = await model.start(ids, k, maxNew + P);
  let scores = [0, ...Array(k - 1).fill(-Infinity)], last = Array(k).fill(bos), keep = null;
  let seqs = Array.from({ length: k }, () => []), finished = [];
  const norm = (score, len) => score / Math.max(len, 1) ** lp;
  for (let step = 0; step < maxNew + P; step++) {
    const logits = await state.step(last, keep), vocab = logits[0].length, at = step - P, final = at === maxNew - 1;
    let picked = [];
    if (at < 0) picked.push([0, lead[step], scores[0]]);
    else {
      const cand = new Float64Array(k * vocab);
      logits.forEach((row, r) => {
        let logp = suppressed(logSoftmax(row), banned(model, at, minNew));
        if (forcedEos && final) logp = logp.map((_, v) => (v === eos ? 0 : -Infinity));
        for (let v = 0; v < vocab; v++) cand[r * vocab + v] = scores[r] + logp[v];
      });
      topStable(cand, 2 * k).forEach((c, rank) => {
        const src = Math.floor(c / vocab), tok = c % vocab, score = cand[c];
        if (tok === eos || final) {
          if (rank < k && Number.isFinite(score)) {
            const tokens = [...seqs[src], tok];
            finished.push({ tokens, score: norm(score, tokens.length), done: tok === eos });
          }
        } else if (picked.length < k) picked.push([src, tok, score]);
      });
      finished = finished.map((h, i) => [h, i]).sort((a, b) => (b[0].score - a[0].score) || (a[1] - b[1]))
        .slice(0, k).map((x) => x[0]);
      const bestLive = Math.max(...picked.map((p) => p[2]), -Infinity);
      if (final || !Number.isFinite(bestLive)
          || (finished.length >= 1 && attainable(bestLive, at + 1 + P, maxNew + P, lp) <= finished[0].score)) break;
    }
    while (picked.length < k) picked.push([0, eos, -Infinity]);   // every continuation ended: dead rows
    const rows = picked.map((p) => p[0]);
    last = picked.map((p) => p[1]);
    scores = picked.map((p) => p[2]);
    seqs = rows.map((r, j) => [...seqs[r], last[j]]);
    keep = rows.every((r, j) => r === j) ? null : rows;
  }
  return finished.length ? finished[0].tokens : [];
}

// --- the page's API ---
// translate(texts, {beam, maxNewTokens, srcLang, tgtLang}) -> [{ids, text, ms}]: each text decoded alone (its ids:
// the generated target ids, EOS dropped, a forced target-language token kept, as runtime.Translator gives them;
// ms: its wall time in the page). srcLang / tgtLang: a multilingual bundle's languages (NLLB: "deu_Latn");
// maxNewTokens: tokens after the forced ones (default min(64, max_len) less those). translateIds(idLists, opts):
// the same from source ids (the encoder's input, framing included), no tokenizer.
async function translateIds(model, sources, { beam = 1, maxNewTokens, minNewTokens = 0, tgtLang } = {}) {
  const c = model.config, forcedEos = !!c.forced_eos;
  const lead = model.tokenizer.targetStartIds ? model.tokenizer.targetStartIds(tgtLang) : [];
  if (tgtLang !== undefined && !model.tokenizer.spec?.target_start)
    throw new Error("tgtLang was given, but this model's target language is fixed: drop it");
  const maxNew = maxNewTokens ?? Math.min(64, c.max_len) - lead.length, out = [];
  for (const src of sources) {
    const t0 = performance.now();
    let tokens = beam > 1 ? await beamSearch(model, src, beam, maxNew, forcedEos, lead, minNewTokens)
      : await greedy(model, src, maxNew, forcedEos, lead, minNewTokens);
    if (tokens.length && tokens[tokens.length - 1] === c.eos_id) tokens = tokens.slice(0, -1);
    out.push({ ids: tokens, ms: performance.now() - t0 });
  }
  return out;
}

async function translate(model, texts, opts = {}) {
  const tok = model.tokenizer, answers = await translateIds(model, texts.map((t) => tok.encode(t, opts.srcLang)), opts);
  return answers.map((a) => ({ ...a, text: tok.decode(a.ids) }));
}

async function main() {
  const status = document.getElementById("status");
  try {
    const model = await Model.load();
    window.onnxformer = { ep: EP, threads: ort.env.wasm.numThreads,
      translate: (texts, opts) => translate(model, texts, opts),
      translateIds: (ids, opts) => translateIds(model, ids, opts),
      generate: (ids, opts) => translateIds(model, ids, opts),
      encode: (texts, srcLang) => texts.map((t) => model.tokenizer.encode(t, srcLang)),
      decode: (idLists) => idLists.map((ids) => model.tokenizer.decode(ids)), manifest: model.manifest };
    status.textContent = "ready";
    document.getElementById("go").onclick = async () => {
      const beam = Number(document.getElementById("beam").value) || 1;
      const [r] = await translate(model, [document.getElementById("text").value], { beam });
      document.getElementById("output").textContent = r.text;
    };
  } catch (e) {
    status.textContent = `error: ${e.message}`;
    window.onnxformer = { error: String(e.message) };
  }
}

if (typeof document !== "undefined") main();

export { Model, LAYOUTS, translate, translateIds, translateIds as generate, ort };
