"""The page's decoder layouts (issue 41): every layout a bundle may declare (runtime.spec.DECODER_LAYOUTS: dynamic,
static-per-row, static-shared) on every execution provider the page offers (WASM, WebGPU).

Fast (Node, no model): the page's own DecodeState feeds, step by step and with beam reordering, exactly the decoder
inputs runtime/spec.py gives for the layout (names, dtypes, shapes, values). Slow (headless Chromium): the dates
bundle in each layout gives runtime.Translator's ids, greedy and beam 4, on WASM and WebGPU. Where the layouts come
from on a CPU-only machine: the export (dynamic), optimize --target cpu/wasm (static-per-row), optimize --target cuda
--kv-cache static (static-shared, DecoderMaskedMultiHeadAttention; also what a CPU target gets for a head size not a
multiple of 8)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from runtime.spec import (BATCH, CACHE_LEN, DECODER_ATTENTION_MASK, DECODER_LAYOUTS, NEW_LEN, PAST_LEN,
                          PAST_SEQUENCE_LENGTH, POSITION_IDS, SRC_LEN, STATIC_PER_ROW, STATIC_SHARED, graph_specs)
from toolkit.apps.web import site as web

from test_web import MAX_NEW, _inputs, _page_answers, _webgpu_adapter, browser  # noqa: F401  (fixture)

CONFIG = {"n_decoder_layers": 2, "n_heads": 2, "d_model": 8, "vocab_size": 11, "max_len": 16, "pad_id": 0,
          "bos_id": 1, "eos_id": 2}
# a beam of 3 rows: the first step, then two steps whose rows are reordered (keep) before they run
STEPS = [{"tokens": [1, 1, 1], "keep": None}, {"tokens": [5, 6, 7], "keep": [2, 0, 1]},
         {"tokens": [8, 3, 9], "keep": [1, 1, 0]}]
SRC, CAPACITY = [4, 5, 6, 2], 6

# the page's onnxruntime-web stood in for: tensors as plain records, no sessions (the test gives the model its own)
FAKE_ORT = """export class Tensor { constructor(type, data, dims) { Object.assign(this, { type, data, dims }); } }
export const env = { wasm: {} };
export const InferenceSession = { create() { throw new Error("no sessions in this test"); } };"""

RECORD = """import { readFileSync } from "node:fs";
import { Model, LAYOUTS } from "./onnxformer.js";
import { Tensor } from "./ort.wasm.min.mjs";
const io = JSON.parse(readFileSync("io.json", "utf8")), c = io.manifest.model;
const H = c.n_heads, Dh = c.d_model / H, show = (f) => Object.fromEntries(Object.entries(f).map(([k, t]) =>
  [k, { type: t.type, dims: t.dims, data: t.type === "float32" ? null : Array.from(t.data, Number) }]));
const zeros = (dims) => new Tensor("float32", new Float32Array(dims.reduce((a, b) => a * b, 1)), dims);
const model = new Model(io.manifest, io.manifest.decoder_layout, null, null, null), encoder = [], decoder = [];
model.encoder = { run: async (f) => { encoder.push(show(f));
  return Object.fromEntries(model.cross.map((n) => [n, zeros([1, H, io.src.length, Dh])])); } };
model.decoder = { run: async (f) => {          // a static layout's present is its past, written in place
  decoder.push(show(f));
  const rows = f.input_ids.dims[0], out = { logits: zeros([rows, 1, c.vocab_size]) };
  model.present.forEach((n, i) => { const past = f[model.past[i]];
    out[n] = io.manifest.decoder_layout === "dynamic" ? zeros([rows, H, past.dims[2] + 1, Dh]) : past; });
  return out; } };
const state = await model.start(io.src, io.steps[0].tokens.length, io.capacity);
for (const s of io.steps) await state.step(s.tokens, s.keep);
process.stdout.write(JSON.stringify({ layouts: LAYOUTS, encoder, decoder }));"""


@pytest.fixture(scope="module")
def page_src(tmp_path_factory):
    """A folder with the page's onnxformer.js and text.js beside a stand-in onnxruntime-web (Node, npm needed for
    the tokenizers module text.js imports)."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: the page's code cannot run here")
    web.ensure_built()
    folder = tmp_path_factory.mktemp("page_src")
    for path in (web.SRC / "onnxformer.js", web.SRC / "text.js", web.TOKENIZERS_JS):
        shutil.copy2(path, folder / path.name)
    (folder / "ort.wasm.min.mjs").write_text(FAKE_ORT)
    (folder / "record.mjs").write_text(RECORD)
    return folder


def _recorded_feeds(folder: Path, layout: str) -> dict:
    manifest = {"decoder_layout": layout, "model": CONFIG}
    (folder / "io.json").write_text(json.dumps({"manifest": manifest, "src": SRC, "capacity": CAPACITY,
                                                "steps": STEPS}))
    done = subprocess.run(["node", "record.mjs"], cwd=folder, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("layout", DECODER_LAYOUTS)
def test_page_feeds_each_layout_as_the_spec_says(page_src, layout):
    """Each step's feeds: the spec's input names, dtypes and shapes for the layout (batch = the beam's rows, cache_len
    = the capacity, past_len = the step), and the values one unpadded input has (runtime/feed.py's)."""
    got = _recorded_feeds(page_src, layout)
    assert got["layouts"] == list(DECODER_LAYOUTS)                   # the page knows every layout, no other
    specs = graph_specs(CONFIG, layout=layout)
    assert [set(f) for f in got["encoder"]] == [set(specs["encoder"].input_names)]
    assert len(got["decoder"]) == len(STEPS)
    for p, (feeds, step) in enumerate(zip(got["decoder"], STEPS)):
        rows = len(step["tokens"])
        sizes = {BATCH: rows, CACHE_LEN: CAPACITY, PAST_LEN: p, SRC_LEN: len(SRC), NEW_LEN: 1}
        assert set(feeds) == set(specs["decoder"].input_names), (layout, p)
        for t in specs["decoder"].inputs:
            want = [d if isinstance(d, int) else sizes[d] for d in t.shape]
            assert (feeds[t.name]["type"], feeds[t.name]["dims"]) == (t.dtype, want), (layout, p, t.name)
        assert feeds["input_ids"]["data"] == step["tokens"]
        assert feeds["encoder_attention_mask"]["data"] == [1] * rows * len(SRC)
        assert feeds[POSITION_IDS]["data"] == [p] * rows
        if layout != "dynamic":
            assert feeds[PAST_SEQUENCE_LENGTH]["data"] == [p] * (rows if layout == STATIC_PER_ROW else 1)
        if DECODER_ATTENTION_MASK in feeds:                          # every slot real: one input, no padding
            assert set(feeds[DECODER_ATTENTION_MASK]["data"]) <= {1}


# --- slow: the dates bundle in each layout, in Chromium, on each execution provider ---

@pytest.fixture(scope="module")
def layout_bundles(dates_bundle, tmp_path_factory):
    """{layout: the dates bundle (fp32) in it}: the export, optimize --target cpu, optimize --target cuda
    --kv-cache static (written on a machine without CUDA: its gate is not run on CUDA, the graphs are the same)."""
    from exporters.optimize import optimize_bundle
    from runtime.manifest import read_manifest

    root = tmp_path_factory.mktemp("web_layouts")
    bundles = {"dynamic": dates_bundle,
               STATIC_PER_ROW: optimize_bundle(dates_bundle, root / "per-row", target="cpu")[0],
               STATIC_SHARED: optimize_bundle(dates_bundle, root / "shared", target="cuda", kv_cache="static")[0]}
    for layout, bundle in bundles.items():
        assert read_manifest(bundle).get("decoder_layout", "dynamic") == layout
    ops = read_manifest(bundles[STATIC_SHARED])["graphs"]["decoder"]["op_counts"]
    assert ops.get("com.microsoft.DecoderMaskedMultiHeadAttention") == CONFIG["n_decoder_layers"]
    return bundles


# dynamic on WASM: test_web.py's test_page_ids_equal_the_runtime[fp32]
PAIRS = [(STATIC_PER_ROW, "wasm"), (STATIC_SHARED, "wasm"), ("dynamic", "webgpu"), (STATIC_PER_ROW, "webgpu"),
         (STATIC_SHARED, "webgpu")]


@pytest.mark.slow
@pytest.mark.parametrize("layout,ep", PAIRS)
def test_page_layout_ids_equal_the_runtime(browser, layout_bundles, layout, ep, tmp_path, monkeypatch):  # noqa: F811
    """`onnxformer web` accepts the bundle, and the page gives the runtime's ids on 32 inputs, greedy and beam 4."""
    from runtime.api import Translator

    bundle, gpu = layout_bundles[layout], ep == "webgpu"
    site = web.write_site(bundle, tmp_path / "site", webgpu=gpu)
    if gpu:
        why = _webgpu_adapter(site)
        if why:
            pytest.skip(f"headless Chromium offers no WebGPU adapter here: {why}")
        monkeypatch.setenv("WEBGPU", "1")
    texts, beams = _inputs(), (1, 4)
    requests = [{"texts": texts, "beam": b, "maxNewTokens": MAX_NEW} for b in beams]
    page = _page_answers(site, requests, tmp_path, "?ep=webgpu" if gpu else "")
    translator = Translator(bundle, provider="cpu")
    for beam, answers in zip(beams, page["answers"]):
        expected = [r.hypotheses[0] for r in translator.generate(texts, batch_size=1, beam=beam,
                                                                    max_new_tokens=MAX_NEW)]
        assert len({tuple(h.ids) for h in expected}) >= 8               # outputs that vary
        assert [a["ids"] for a in answers] == [h.ids for h in expected], (layout, ep, beam)
