// The web race's peer (benchmarks/race_web.py): transformers.js running models/marian (Optimum's export) on the
// WASM execution provider, everything from this folder (no remote models, no CDN). URL: peer.html?dtype=fp32|q8
// &threads=N. window.peer.generate(sources, {maxNewTokens, minNewTokens}) -> [{ids, ms}], as the onnxformer page's
// window.onnxformer.generate: greedy, batch 1, ids without the decoder start and the final EOS, ms of generate.
import { AutoModelForSeq2SeqLM, Tensor, env } from "./transformers.min.js";

const params = new URLSearchParams(location.search);
env.allowRemoteModels = false;
env.allowLocalModels = true;
env.localModelPath = new URL("./models/", location.href).href;
env.useBrowserCache = false;
env.backends.onnx.wasm.wasmPaths = {
  mjs: new URL("./ort-wasm-simd-threaded.asyncify.mjs", location.href).href,
  wasm: new URL("./ort-wasm-simd-threaded.asyncify.wasm", location.href).href,
};
env.backends.onnx.wasm.numThreads = Number(params.get("threads")) || 1;

const int64 = (values, dims) => new Tensor("int64", BigInt64Array.from(values.map(BigInt)), dims);

async function generate(model, sources, { maxNewTokens, minNewTokens = 0 }) {
  const eos = model.generation_config.eos_token_id, out = [];
  for (const src of sources) {
    const t0 = performance.now();
    const seq = await model.generate({ input_ids: int64(src, [1, src.length]),
      attention_mask: int64(src.map(() => 1), [1, src.length]), max_new_tokens: maxNewTokens,
      min_new_tokens: minNewTokens, do_sample: false, num_beams: 1 });
    const ms = performance.now() - t0;
    let ids = seq.tolist()[0].map(Number).slice(1);
    if (ids.length && ids[ids.length - 1] === eos) ids = ids.slice(0, -1);
    out.push({ ids, ms });
  }
  return out;
}

try {
  const model = await AutoModelForSeq2SeqLM.from_pretrained("marian", { dtype: params.get("dtype") || "fp32",
    device: "wasm" });
  window.peer = { generate: (sources, opts) => generate(model, sources, opts) };
  document.getElementById("status").textContent = "ready";
} catch (e) {
  document.getElementById("status").textContent = `error: ${e.message}`;
  window.peer = { error: String(e.message) };
}
