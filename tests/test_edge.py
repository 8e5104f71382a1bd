"""Edge deployment: ORT-format bundles, what the graphs store, the numpy-only example, and a torch-free install.

- ORT-format graphs (exporters/ort_format.py) are recorded in the manifest, loaded by the runtime on the CPU, and
  give the tokens of the .onnx graphs and of PyTorch (fp32), and of the int8 .onnx graphs (int8).
- The exported and int8 graphs hold no unused initializers.
- examples/edge/greedy_numpy.py (numpy + onnxruntime only) prints what `onnxformer generate` prints.
- A fresh virtual environment with only `onnxformer[cpu]` (no torch, onnx, onnxscript) generates from a bundle,
  and the commands that need PyTorch name the extra to install.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from runtime.bundle import load_bundle
from runtime.generate import generate_ids
from runtime.manifest import sha256_file
from runtime.search import SearchOptions
from toolkit.testing.toy import toy_inputs
from toolkit.reference.torch_engine import TorchEngine

from conftest import with_ort_graphs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "edge" / "greedy_numpy.py"
DATES = ROOT / "examples" / "dates" / "checkpoint"
TEXTS = ["hello", "Ab3", "xyzXYZ012", "q"]
TORCH_COMMANDS = {"export": ["export", "CKPT", "--out", "x"], "init": ["init", "--preset", "tiny", "--out", "x"],
                  "train": ["train", "--out", "x"], "optimize": ["optimize", "BUNDLE", "--out", "x"],
                  "parity": ["parity", "CKPT", "BUNDLE"], "generate (checkpoint)": ["generate", "CKPT", "hello"]}


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    """Run a command; on failure show its output."""
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, (f"{cmd} failed ({result.returncode}):\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def tokens(hyps) -> list[list[list[int]]]:
    return [[h.tokens for h in per_input] for per_input in hyps]


@pytest.fixture(scope="module")
def bundles(toy_exported, tmp_path_factory):
    """fp32 and int8 bundles of the shared toy model, each without and with ORT-format graphs."""
    from exporters.optimize import optimize_bundle

    root = tmp_path_factory.mktemp("edge")
    fp32 = toy_exported[1]
    int8, _ = optimize_bundle(fp32, root / "int8", target="cpu", precision="int8", samples=8,  # toy: below the
                              recipe="per-channel", allow_unverified=True)                    # int8 token row
    int8_ort, _ = optimize_bundle(fp32, root / "int8-ort", target="cpu", precision="int8", samples=8, ort_format=True,
                                  recipe="per-channel", allow_unverified=True)
    return {"fp32": fp32, "int8": int8, "fp32-ort": with_ort_graphs(fp32, root / "fp32-ort"), "int8-ort": int8_ort}


@pytest.fixture(scope="module")
def seqs(toy_model_factory):
    return toy_inputs(toy_model_factory().config, 12, seed=5)


# ------------------------------------------------------------------------------------------ ORT format

def test_ort_graphs_are_recorded_and_loaded(bundles):
    path = bundles["fp32-ort"]
    manifest = json.loads((path / "manifest.json").read_text())
    source = json.loads((bundles["fp32"] / "manifest.json").read_text())
    for g in ("encoder", "decoder"):
        entry = manifest["ort_graphs"][g]
        assert entry["file"] == f"{g}.ort" and entry["bytes"] == (path / entry["file"]).stat().st_size
        assert entry["sha256"] == sha256_file(path / entry["file"])
        assert entry["source_sha256"] == manifest["graphs"][g]["sha256"] == source["graphs"][g]["sha256"]
    record = manifest["ort_format"]
    assert record["style"] == "fixed" and record["optimization_level"] == "all" and record["parity"]["verified"]
    config = path / record["required_operators"]["file"]
    assert record["required_operators"]["sha256"] == sha256_file(config)
    lines = config.read_text().splitlines()
    assert "# - decoder.ort" in lines and "# - encoder.ort" in lines          # names only, no build paths
    ops = {op for line in lines if not line.startswith("#") for op in line.split(";")[2].split(",")}
    assert {"Gather", "MatMul", "Softmax"} <= ops
    loaded = load_bundle(path, provider="cpu")
    assert loaded.files == {"encoder": "encoder.ort", "decoder": "decoder.ort"}
    int8 = json.loads((bundles["int8-ort"] / "manifest.json").read_text())
    config = (bundles["int8-ort"] / "required_operators.config").read_text()
    assert int8["precision"] == "int8" and "com.microsoft;1;" in config and "DynamicQuantize" in config


def test_fp32_ort_tokens_equal_onnx_and_pytorch(bundles, seqs, toy_model_factory):
    reference = TorchEngine(toy_model_factory())
    engines = {name: load_bundle(bundles[name], provider="cpu").engine for name in ("fp32", "fp32-ort")}
    for beam in (1, 3):
        opts = SearchOptions(max_new_tokens=16, beam=beam)
        want = tokens(generate_ids(reference, seqs, opts))
        assert len({tuple(h[0]) for h in want}) >= len(seqs) // 2, "the toy model's outputs do not vary"
        assert tokens(generate_ids(engines["fp32"], seqs, opts)) == want
        assert tokens(generate_ids(engines["fp32-ort"], seqs, opts)) == want


def test_int8_ort_tokens_equal_int8_onnx(bundles, seqs):
    """The same quantized graph: identical tokens. (int8 against PyTorch is judged on the example task, below.)"""
    for beam in (1, 3):
        opts = SearchOptions(max_new_tokens=16, beam=beam)
        onnx_int8 = tokens(generate_ids(load_bundle(bundles["int8"], provider="cpu").engine, seqs, opts))
        assert len({tuple(h[0]) for h in onnx_int8}) >= len(seqs) // 2
        assert tokens(generate_ids(load_bundle(bundles["int8-ort"], provider="cpu").engine, seqs, opts)) == onnx_int8


def test_ort_parity_gate_catches_other_graphs(bundles, tmp_path):
    """Other graphs of the same decoder layout (the exported decoder, its weights 1% larger) fail the gate."""
    import numpy as np
    import onnx

    from exporters.ort_format import check_ort_parity
    from toolkit.parity import ParityError

    onnx_paths = {g: bundles["fp32"] / f"{g}.onnx" for g in ("encoder", "decoder")}
    manifest = json.loads((bundles["fp32"] / "manifest.json").read_text())
    config, layout = manifest["model"], manifest["decoder_layout"]
    ort = {g: bundles["fp32-ort"] / f"{g}.ort" for g in onnx_paths}
    assert check_ort_parity(onnx_paths, ort, config, layout)["max_abs"] <= 1e-4
    proto = onnx.load(str(onnx_paths["decoder"]))                    # its weights.data read in
    for init in proto.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT and len(init.dims) == 2:
            scaled = onnx.numpy_helper.to_array(init) * np.float32(1.01)
            init.CopyFrom(onnx.numpy_helper.from_array(scaled.astype(np.float32), init.name))
    onnx.save(proto, str(tmp_path / "decoder.onnx"))
    other = {"encoder": onnx_paths["encoder"], "decoder": tmp_path / "decoder.onnx"}
    with pytest.raises(ParityError, match="ORT-format graphs differ"):
        check_ort_parity(onnx_paths, other, config, layout)


def test_ort_conversion_refusals_leave_nothing_behind(bundles, tmp_path, monkeypatch):
    import exporters.ort_format as of

    manifest = json.loads((bundles["fp32"] / "manifest.json").read_text())
    with pytest.raises(of.OrtFormatError, match="CPU provider"):
        of.check_convertible({**manifest, "precision": "fp16", "target": "cuda"})
    with pytest.raises(of.OrtFormatError, match="target platform"):
        of.check_convertible(manifest, "riscv")
    with pytest.raises(of.OrtFormatError, match="already holds encoder.ort, decoder.ort"):
        with_ort_graphs(bundles["fp32-ort"], tmp_path / "again")
    monkeypatch.setenv(of.LEVEL_VARIABLE, "basic")
    with pytest.raises(of.OrtFormatError, match="unset it"):
        with_ort_graphs(bundles["fp32"], tmp_path / "basic")
    monkeypatch.delenv(of.LEVEL_VARIABLE)

    def broken(*args):
        raise of.OrtFormatError("conversion failed")

    monkeypatch.setattr(of, "_convert", broken)
    with pytest.raises(of.OrtFormatError, match="conversion failed"):
        with_ort_graphs(bundles["fp32"], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []                # no bundle, no staging directory


def test_add_ort_format_inside_a_bundle_writer(bundles, tmp_path):
    """The call optimize makes: convert inside the staging directory, then write the manifest."""
    from exporters.bundle import stage_bundle, write_manifest
    from exporters.ort_format import add_ort_format

    manifest = json.loads((bundles["int8"] / "manifest.json").read_text())
    with stage_bundle(tmp_path / "b") as tmp:
        for name in ("encoder.onnx", "decoder.onnx", "weights.data", "tokenizer.json"):
            shutil.copyfile(bundles["int8"] / name, tmp / name)
        record = add_ort_format(tmp, manifest)
        write_manifest(tmp, manifest)
    assert record["parity"]["max_abs"] == 0.0
    assert load_bundle(tmp_path / "b", provider="cpu").files["decoder"] == "decoder.ort"


# ------------------------------------------------------------------------------------------ what the graphs store

def test_graphs_hold_no_unused_initializers(bundles):
    """Every stored weight is read by some node (a graph input or output counts as a use)."""
    import onnx

    for name in ("fp32", "int8"):
        for g in ("encoder", "decoder"):
            graph = onnx.load(str(bundles[name] / f"{g}.onnx")).graph
            used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
            unused = [i.name for i in graph.initializer if i.name not in used]
            assert unused == [], f"{name} {g}: unused initializers {unused}"
            assert len(graph.initializer) > 0


# ------------------------------------------------------------------------------------------ leaner bundles

def test_quantize_rows_bounds_the_error_per_row():
    import numpy as np

    from exporters.fusions.int8_embedding import quantize_rows

    table = np.random.default_rng(0).normal(size=(50, 16)).astype(np.float32) * np.geomspace(1e-3, 10, 50)[:, None]
    table[7] = 0.0                                                    # an all-zero row (padding) stays exact
    q, scale = quantize_rows(table)
    assert q.dtype == np.int8 and scale.shape == (50,) and np.abs(q).max() <= 127
    assert np.all(np.abs(q * scale[:, None] - table) <= scale[:, None] / 2 + 1e-7)   # half a step, row by row
    assert np.all(q[7] == 0) and np.all(np.abs(q).max(axis=1)[np.arange(50) != 7] == 127)


def test_int8_bundle_stores_one_int8_embedding_both_graphs_read(bundles, toy_exported):
    import numpy as np
    import onnx

    path = bundles["int8"]
    manifest = json.loads((path / "manifest.json").read_text())
    config = manifest["model"]
    record = manifest["shared_weights"]
    assert record["file"] == "weights.data" and record["sha256"] == sha256_file(path / "weights.data")
    tables = [t for t in record["tensors"] if t["dtype"] == "int8"]
    assert [t["shape"] for t in tables] == [[config["vocab_size"], config["d_model"]]]     # one table, [V, D]
    assert tables[0]["graphs"] == ["encoder", "decoder"]
    for g in ("encoder", "decoder"):
        model = onnx.load(str(path / f"{g}.onnx"), load_external_data=False)
        by_name = {t.name: t for t in model.graph.initializer}
        table = by_name[tables[0]["name"]]
        assert table.data_location == onnx.TensorProto.EXTERNAL
        assert {e.key: e.value for e in table.external_data}["location"] == "weights.data"
        assert "model.embed.lut.weight" not in by_name and "model.embed.lut.weight.T" not in by_name, g
    ops = {g: manifest["graphs"][g]["op_counts"] for g in ("encoder", "decoder")}
    assert ops["decoder"]["com.microsoft.QGemm"] >= 1                                      # the tied projection
    assert "com.microsoft.QGemm" not in ops["encoder"]
    assert "com.microsoft.DynamicQuantizeMatMul" not in ops["encoder"]
    source = sum(f.stat().st_size for f in toy_exported[1].iterdir() if f.name != "manifest.json")
    stored = sum((path / f).stat().st_size for f in ("encoder.onnx", "decoder.onnx", "weights.data"))
    embedding = config["vocab_size"] * config["d_model"]
    exported = json.loads((toy_exported[1] / "manifest.json").read_text()).get("shared_weights") or {"tensors": []}
    copies = 1 if any(t["name"] == "model.embed.lut.weight" for t in exported["tensors"]) else 2   # fp32, in the export
    assert stored < (source - copies * 4 * embedding) / 3.0 + embedding + 4096 * 8             # int8, once
    # the int8 lookup reproduces the float table to half a quantization step, row by row
    decoder = onnx.load(str(path / "decoder.onnx"))                       # the projection's scales: one per row
    values = {t.name: onnx.numpy_helper.to_array(t) for t in decoder.graph.initializer}
    q = values[tables[0]["name"]]
    scale = next(v for k, v in values.items() if k.endswith(".int8_scale"))
    exported = onnx.load(str(toy_exported[1] / "encoder.onnx"))
    table = next(onnx.numpy_helper.to_array(t) for t in exported.graph.initializer if t.name == "model.embed.lut.weight")
    assert np.all(np.abs(q * scale[:, None] - table) <= scale[:, None] / 2 + 1e-6)
    # the tied projection: QGemm by slices of the table's rows, each read from the table's own bytes in
    # weights.data (stored once), a scalar b_scale of 1, then one Mul of the logits by the row scales
    raw = onnx.load(str(path / "decoder.onnx"), load_external_data=False)
    where = {t.name: {e.key: e.value for e in t.external_data} for t in raw.graph.initializer}
    start = tables[0]["offset"]
    rows = 0
    for gemm in [n for n in decoder.graph.node if n.op_type == "QGemm"]:
        part = values[gemm.input[3]]
        assert np.array_equal(part, q[rows:rows + len(part)]) and values[gemm.input[4]] == 1.0
        assert where[gemm.input[3]]["location"] == "weights.data"
        assert int(where[gemm.input[3]]["offset"]) == start + rows * q.shape[1]             # the table's bytes
        rows += len(part)
    assert rows == len(q)
    (mul,) = [n for n in decoder.graph.node if n.output[0] == "logits"]
    assert mul.op_type == "Mul" and next(k for k in mul.input if k in values).endswith(".int8_scale")


def test_int8_tokens_with_8bit_embeddings_stay_near_pytorch(bundles, seqs, toy_model_factory):
    """The optimize gate compared with the fp32 bundle; here against PyTorch, on inputs whose outputs vary."""
    reference = TorchEngine(toy_model_factory())
    opts = SearchOptions(max_new_tokens=16)
    want = tokens(generate_ids(reference, seqs, opts))
    assert len({tuple(h[0]) for h in want}) >= len(seqs) // 2, "the toy model's outputs do not vary"
    got = tokens(generate_ids(load_bundle(bundles["int8"], provider="cpu").engine, seqs, opts))
    pairs = [(a, b) for w, g in zip(want, got) for a, b in zip(w[0], g[0])]
    total = sum(max(len(w[0]), len(g[0])) for w, g in zip(want, got))
    assert sum(a == b for a, b in pairs) / total >= 0.9


def test_weights_file_is_checked_like_a_graph(bundles, tmp_path):
    from runtime.errors import BundleError

    broken = tmp_path / "broken"
    shutil.copytree(bundles["int8"], broken)
    data = bytearray((broken / "weights.data").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (broken / "weights.data").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="weights.data does not match its sha256"):
        load_bundle(broken, provider="cpu")
    (broken / "weights.data").unlink()
    with pytest.raises(BundleError, match="missing weights.data"):
        load_bundle(broken, provider="cpu")
    result = CliRunner().invoke(__import__("toolkit.apps.cli", fromlist=["main"]).main,
                                ["generate", str(broken), "hello"])
    assert result.exit_code == 2 and "weights.data" in result.output and "Traceback" not in result.output


def test_both_sessions_read_the_shared_tensors_from_one_buffer(bundles, seqs, monkeypatch):
    """The tensors both graphs read from weights.data are handed to both sessions as one OrtValue each, over one
    mapping (resident once, not once per session), at the offsets the graphs record; tokens are those of sessions
    that map the file themselves. ORT-format graphs embed their weights and get none."""
    import numpy as np
    import onnx

    import runtime.bundle as bundle_module

    path = bundles["int8"]
    record = json.loads((path / "manifest.json").read_text())["shared_weights"]
    for g in ("encoder", "decoder"):                                   # the record is where the graphs read
        model = onnx.load(str(path / f"{g}.onnx"), load_external_data=False)
        external = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer
                    if t.data_location == onnx.TensorProto.EXTERNAL}
        for t in record["tensors"]:
            if g in t["graphs"]:
                assert (int(external[t["name"]]["offset"]), int(external[t["name"]]["length"])) == \
                       (t["offset"], t["length"]), (g, t["name"])
    loaded = load_bundle(path, provider="cpu")
    given = loaded.engine.encoder.onnxformer_initializers
    assert given is loaded.engine.decoder.onnxformer_initializers
    table = next(t for t in record["tensors"] if t["dtype"] == "int8")
    data = (path / "weights.data").read_bytes()[table["offset"]:table["offset"] + table["length"]]
    assert given[table["name"]].numpy().tobytes() == data and list(given[table["name"]].shape()) == table["shape"]
    opts = SearchOptions(max_new_tokens=12)
    got = tokens(generate_ids(loaded.engine, seqs, opts))
    monkeypatch.setattr(bundle_module, "shared_tables", lambda *args: ({}, None))
    own = load_bundle(path, provider="cpu")
    assert not own.engine.encoder.onnxformer_initializers
    assert got == tokens(generate_ids(own.engine, seqs, opts))
    monkeypatch.undo()
    assert load_bundle(bundles["int8-ort"], provider="cpu").engine.encoder.onnxformer_initializers is None


def test_large_lookup_tables_give_their_pages_back_after_each_run(bundles, seqs, monkeypatch):
    """runtime/bundle.LookupPages: a shared table with a row per token of RETURNED_BYTES or more gets its mapped
    pages back after every run of either session (the toy's is small: the threshold is lowered); tokens unchanged.
    A [D, V] table (bundles made before exporters/tied_table) never does: each lookup reads a byte of every row."""
    import runtime.bundle as bundle_module

    opts = SearchOptions(max_new_tokens=12)
    plain = load_bundle(bundles["int8"], provider="cpu")
    assert not isinstance(plain.engine.decoder, bundle_module.PagesReturned)          # the toy's table is small
    calls = []
    monkeypatch.setattr(bundle_module, "RETURNED_BYTES", 0)
    monkeypatch.setattr(bundle_module.LookupPages, "give_back",
                        lambda self, real=bundle_module.LookupPages.give_back: (calls.append(self.spans), real(self)))
    paged = load_bundle(bundles["int8"], provider="cpu")
    assert isinstance(paged.engine.encoder, bundle_module.PagesReturned)
    assert isinstance(paged.engine.decoder, bundle_module.PagesReturned)
    table = next(t for t in paged.manifest["shared_weights"]["tensors"] if t["dtype"] == "int8")
    got = tokens(generate_ids(paged.engine, seqs, opts))
    assert got == tokens(generate_ids(plain.engine, seqs, opts))
    assert len(calls) >= 1 + 2 and all((table["offset"], table["length"]) in spans for spans in calls)  # each run
    old = json.loads(json.dumps(paged.manifest))
    for t in old["shared_weights"]["tensors"]:
        t["shape"] = t["shape"][::-1]                                      # as a [D, V] table would be
    assert bundle_module.shared_tables(bundles["int8"], old)[1] is None


def test_a_shared_weights_record_that_does_not_fit_the_file_is_refused(bundles, tmp_path):
    from runtime.errors import BundleError

    broken = tmp_path / "broken"
    shutil.copytree(bundles["int8"], broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    table = next(t for t in manifest["shared_weights"]["tensors"] if t["dtype"] == "int8")
    table["offset"] = manifest["shared_weights"]["bytes"]                   # past the end of weights.data
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="shared_weights entry .* does not describe a tensor of weights.data"):
        load_bundle(broken, provider="cpu")
    result = CliRunner().invoke(__import__("toolkit.apps.cli", fromlist=["main"]).main,
                                ["generate", str(broken), "hello", "--provider", "cpu"])
    assert result.exit_code == 2 and "re-export or re-optimize" in result.output and "Traceback" not in result.output


def test_one_graph_at_a_time_gives_the_same_tokens_and_holds_one_session(bundles, seqs):
    """load_bundle(one_graph_at_a_time=True), what `onnxformer generate` uses: the encoder session is made for
    start() and released when the decoder's is made; tokens equal those of both sessions held (greedy and beam,
    dynamic and static cache, .onnx and .ort graphs), also on a second request (the encoder is made again)."""
    for name in ("fp32", "int8", "int8-ort"):
        normal = load_bundle(bundles[name], provider="cpu")
        lean = load_bundle(bundles[name], provider="cpu", one_graph_at_a_time=True)
        encoder, decoder = lean.engine.encoder, lean.engine.decoder
        assert not encoder.loaded and not decoder.loaded and lean.engine.static_cache == normal.engine.static_cache
        for opts in (SearchOptions(max_new_tokens=12), SearchOptions(max_new_tokens=8, beam=3, num_return=2)):
            want = tokens(generate_ids(normal.engine, seqs, opts))
            assert tokens(generate_ids(lean.engine, seqs, opts)) == want, (name, opts)
            assert decoder.loaded and not encoder.loaded
    bound = load_bundle(bundles["int8"], provider="cpu", one_graph_at_a_time=True, io_binding=True).engine.encoder
    assert type(bound).__name__ == "InferenceSession"               # bound outputs must not outlive their session


def test_a_dropped_one_graph_engine_frees_its_session_without_the_cyclic_collector(bundles, seqs):
    """The two on-demand sessions release each other through weak references: a dropped engine's session goes
    with its last reference (the optimize gate drops an engine per check), not when Python's cyclic collector
    next runs."""
    import gc
    import weakref

    gc.disable()
    try:
        lean = load_bundle(bundles["int8"], provider="cpu", one_graph_at_a_time=True)
        generate_ids(lean.engine, seqs, SearchOptions(max_new_tokens=4))
        session = weakref.ref(lean.engine.decoder.session())
        del lean
        assert session() is None
    finally:
        gc.enable()


def test_generate_checks_each_graph_against_the_manifest_when_it_is_made(bundles, tmp_path):
    """generate makes each session on first use: a graph whose interface differs from the manifest is still a
    one-line error (exit 2), before any output."""
    swapped = tmp_path / "swapped"
    shutil.copytree(bundles["int8"], swapped)
    manifest = json.loads((swapped / "manifest.json").read_text())
    graphs = manifest["graphs"]
    for key in ("file", "sha256"):
        graphs["encoder"][key], graphs["decoder"][key] = graphs["decoder"][key], graphs["encoder"][key]
    for g in graphs.values():
        g.pop("bytes", None)
    (swapped / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(__import__("toolkit.apps.cli", fromlist=["main"]).main,
                                ["generate", str(swapped), "hello", "--provider", "cpu"])
    assert result.exit_code == 2 and "do not match the manifest" in result.output, result.output
    assert "Traceback" not in result.output and result.stdout == ""


def test_optimize_replaces_a_bundle_with_weights_and_reoptimizes_from_one(bundles, toy_exported, tmp_path, seqs):
    """--force recognises weights.data as the bundle's own; a bundle with external weights can be a source."""
    from exporters.optimize import optimize_bundle

    out = tmp_path / "fused"
    optimize_bundle(toy_exported[1], out, precision="fp32", samples=4)
    assert (out / "weights.data").is_file()
    optimize_bundle(toy_exported[1], out, precision="fp32", samples=4, force=True)       # replaced, not refused
    again, report = optimize_bundle(out, tmp_path / "int8", precision="int8", fuse=False, samples=8,
                                      recipe="default", allow_unverified=True)          # toy: below the int8 token row
    shutil.rmtree(out)                                                # nothing may still point into the source
    manifest = json.loads((again / "manifest.json").read_text())
    assert manifest["shared_weights"]["file"] == "weights.data" and report.totals["int8_embedding"] == 2
    hyps = generate_ids(load_bundle(again, provider="cpu").engine, seqs, SearchOptions(max_new_tokens=16))
    assert len({tuple(h[0].tokens) for h in hyps}) >= len(seqs) // 2


def test_int4_bundle_is_weight_only_4bit_and_gated_on_its_row(bundles, toy_exported, tmp_path, seqs):
    from exporters.optimize import optimize_bundle
    from toolkit.parity.tolerances import tolerance

    out, report = optimize_bundle(toy_exported[1], tmp_path / "int4", precision="int4", samples=16,
                                  allow_unverified=True)             # the toy model may miss the row: the same gate
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == "int4" and manifest["passes"][-2:] == ["quantize_int4", "tied_table_rows"]
    for g in ("encoder", "decoder"):
        ops = manifest["graphs"][g]["op_counts"]
        assert ops.get("com.microsoft.MatMulNBits", 0) > 0 and "MatMul" not in ops and "MatMulInteger" not in ops
    assert manifest["graphs"]["decoder"]["op_counts"]["com.microsoft.QGemm"] >= 1        # tied, 8-bit
    row = tolerance("int4", "cpu")
    gen = manifest["parity"]["generation"]
    assert gen["token_match"] == row.token_match and manifest["parity"]["tolerance"] is None     # logits: reported
    assert manifest["parity"]["verified"] == (gen["tokens_equal"] >= row.token_match)
    int8_bytes = sum(p.stat().st_size for p in bundles["int8"].iterdir() if p.suffix in (".onnx", ".data"))
    int4_bytes = sum(p.stat().st_size for p in out.iterdir() if p.suffix in (".onnx", ".data"))
    assert int4_bytes < int8_bytes
    hyps = generate_ids(load_bundle(out, provider="cpu").engine, seqs, SearchOptions(max_new_tokens=8))
    assert len({tuple(h[0].tokens) for h in hyps}) >= len(seqs) // 2
    result = CliRunner().invoke(__import__("toolkit.apps.cli", fromlist=["main"]).main,
                                ["optimize", str(toy_exported[1]), "--out", str(tmp_path / "cli4"), "--precision",
                                 "int4", "--json", "--allow-unverified"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["precision"] == "int4"


# ------------------------------------------------------------------------------------------ the numpy-only example

def test_greedy_numpy_imports_only_numpy_and_onnxruntime():
    tree = ast.parse(SCRIPT.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported - set(sys.stdlib_module_names) == {"numpy", "onnxruntime"}


@pytest.mark.parametrize("name", ["fp32", "fp32-ort", "int8", "int8-ort"])
def test_greedy_numpy_prints_what_generate_prints(bundles, name):
    args = [*TEXTS, "--ids", "5 6 7", "--ids", "40 41 42 43 44 45 46", "--max-new-tokens", "20"]
    script = run([sys.executable, SCRIPT, bundles[name], *args]).stdout
    cli = CliRunner().invoke(__import__("toolkit.apps.cli", fromlist=["main"]).main,
                             ["generate", str(bundles[name]), "--provider", "cpu", *args])
    assert cli.exit_code == 0, cli.output
    assert script == cli.output
    assert len(set(script.splitlines())) >= 4 and any(script.splitlines())


# ------------------------------------------------------------------------------------------ a torch-free install

@pytest.fixture(scope="module")
def cpu_env(tmp_path_factory):
    """A plain venv holding only `onnxformer[cpu]`, installed from a wheel built from this source tree."""
    start = time.perf_counter()
    root = tmp_path_factory.mktemp("cpu_env")
    src = root / "src"                                   # a copy, so the build leaves nothing in the repository
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in ("toolkit", "runtime", "exporters"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    isolation = ["--no-build-isolation"] if _setuptools_major() >= 68 else []     # saves fetching setuptools
    run([*pip, "wheel", "-q", "--no-deps", *isolation, "-w", root / "wheel", src])
    wheel = next((root / "wheel").glob("onnxformer-*.whl"))
    run([sys.executable, "-m", "venv", "--without-pip", root / "venv"])    # plain: no system site-packages
    python = root / "venv" / "bin" / "python"
    run([*pip, "--python", python, "install", "-q", "--no-compile", f"{wheel}[cpu]"])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    print(f"fresh onnxformer[cpu] environment in {time.perf_counter() - start:.1f} s")
    return root, python, env


def _setuptools_major() -> int:
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return 0


def test_cpu_install_generates_without_torch(cpu_env, bundles, toy_exported, seqs, toy_model_factory):
    root, python, env = cpu_env
    onnxformer = python.parent / "onnxformer"
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True, env=env, cwd=root)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    for module in ("onnx", "onnxscript"):
        assert subprocess.run([python, "-c", f"import {module}"], capture_output=True, env=env, cwd=root).returncode
    bundle = Path(shutil.copytree(bundles["int8-ort"], root / "device" / "bundle"))
    fp32 = Path(shutil.copytree(bundles["fp32"], root / "device" / "fp32"))
    ids = [["--ids", " ".join(map(str, s))] for s in seqs]
    out = run([onnxformer, "generate", fp32, *sum(ids, []), "--max-new-tokens", "16"], env=env, cwd=root).stdout
    want = tokens(generate_ids(TorchEngine(toy_model_factory()), seqs, SearchOptions(max_new_tokens=16)))
    tokenizer = load_bundle(fp32, provider="cpu").tokenizer
    assert out.splitlines() == [tokenizer.decode(t[0]) for t in want]          # PyTorch's tokens, as text
    here = CliRunner().invoke(__import__("toolkit.apps.cli", fromlist=["main"]).main, ["generate", str(bundle), *TEXTS])
    there = run([onnxformer, "generate", bundle, *TEXTS], env=env, cwd=root).stdout
    assert there == here.stdout and len(set(there.splitlines())) > 1
    assert run([python, SCRIPT, bundle, *TEXTS], env=env, cwd=root).stdout == there
    assert "precision int8" in run([onnxformer, "inspect", bundle], env=env, cwd=root).stdout
    bench = run([onnxformer, "bench", bundle, "--batch-sizes", "1", "--src-len", "4", "--new-tokens", "4",
                 "--repeat", "1", "--warmup", "0"], env=env, cwd=root).stdout
    assert "int8" in bench and "tok/s" in bench
    checkpoint = str(toy_exported[0])
    for name, args in TORCH_COMMANDS.items():
        args = [a.replace("CKPT", checkpoint).replace("BUNDLE", str(bundle)) for a in args]
        result = subprocess.run([onnxformer, *args], capture_output=True, text=True, env=env, cwd=root)
        assert result.returncode == 2, f"{name}: {result.stdout}{result.stderr}"
        assert "pip install 'onnxformer[export]'" in result.stderr and "Traceback" not in result.stderr, name


@pytest.mark.slow
def test_example_model_int8_ort_bundle_on_a_cpu_install(cpu_env, tmp_path):
    """The example model: export, int8, ORT format; the fresh install prints the right dates."""
    if not (DATES / "config.json").exists():
        pytest.fail(f"the example checkpoint {DATES} is missing; see examples/dates/README.md to train it")
    from exporters.export import export_checkpoint
    from exporters.optimize import optimize_bundle

    fp32 = export_checkpoint(DATES, tmp_path / "fp32")
    int8, _ = optimize_bundle(fp32, tmp_path / "int8", target="cpu", precision="int8")
    edge, _ = optimize_bundle(fp32, tmp_path / "edge", target="cpu", precision="int8", ort_format=True)
    texts = ["Monday, 30 November 2026", "11/30/26", "30.11.2026", "Nov 30th 2026", "1999-02-03"]
    opts = SearchOptions(max_new_tokens=12)
    enc = load_bundle(edge, provider="cpu").tokenizer.encode
    assert tokens(generate_ids(load_bundle(edge, provider="cpu").engine, [enc(t) for t in texts], opts)) == \
        tokens(generate_ids(load_bundle(int8, provider="cpu").engine, [enc(t) for t in texts], opts))
    root, python, env = cpu_env
    device = Path(shutil.copytree(edge, root / "device" / "dates"))
    out = run([python.parent / "onnxformer", "generate", device, *texts], env=env, cwd=root).stdout
    assert out.splitlines() == ["2026-11-30"] * 4 + ["1999-02-03"]
    assert run([python, SCRIPT, device, *texts], env=env, cwd=root).stdout == out
