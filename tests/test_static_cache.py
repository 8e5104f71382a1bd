"""The static KV cache: the graph rewrite (exporters/static_cache.py), the runtime path that binds one buffer as
past and present (runtime/static_cache.py), its parity with the dynamic cache, and the options that refuse it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from exporters.optimize import OptimizeError, optimize_bundle, resolve_kv_cache
from exporters.shared_weights import inline_external
from exporters.static_cache import OneTokenExpand, StaticCacheError, StaticCachePass
from runtime.bundle import load_bundle
from runtime.errors import BundleError, InputError
from runtime.feed import Feed
from runtime.generate import generate_ids
from runtime.manifest import read_manifest
from runtime.search import SearchOptions
from runtime.session import make_session
from runtime.spec import (DECODER_ATTENTION_MASK, PAST_SEQUENCE_LENGTH, POSITION_IDS, STATIC_PER_ROW, STATIC_SHARED,
                          default_row_inputs, graph_specs)
from toolkit.reference.checkpoint import load_checkpoint
from toolkit.apps.cli import main
from toolkit.parity.graphs import graph_parity

from conftest import copy_with_manifest

SEQS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46], [9], [12, 13, 14, 15]]


@pytest.fixture(scope="module")
def bundles(toy_exported, tmp_path_factory):
    """(model, exported, fused with the dynamic cache, fused with the static cache) of conftest's trained toy."""
    checkpoint, exported = toy_exported
    root = tmp_path_factory.mktemp("static")
    dynamic, _ = optimize_bundle(exported, root / "dynamic", kv_cache="dynamic")
    static, report = optimize_bundle(exported, root / "static")             # auto: static for the CPU target
    assert report.kv_cache == "static"
    return load_checkpoint(checkpoint).model, Path(exported), dynamic, static


LAYOUTS = {STATIC_PER_ROW: True, STATIC_SHARED: False}      # CPU bundles; CUDA bundles (exporters/static_cache.py)
ATTENTION = {True: "GroupQueryAttention", False: "DecoderMaskedMultiHeadAttention"}


def _static_graph(dynamic: Path, per_row: bool, folder: Path | None = None):
    """The dynamic decoder rewritten for one static layout (and saved into folder when given)."""
    graph = ir.load(dynamic / "decoder.onnx")
    inline_external(graph)                                           # its weights.data stays beside the source
    static = StaticCachePass(per_row)
    assert static(graph).modified
    if folder is not None:
        ir.save(graph, folder / "decoder.onnx")
    return graph, static


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rewrite_gives_the_static_interface(bundles, layout):
    model, _, dynamic, _ = bundles
    c, per_row = model.config, LAYOUTS[layout]
    graph, static = _static_graph(dynamic, per_row)
    # the cross-attention bias' Expand to new_len rows does nothing once a step takes one token: gone, with its Shape
    assert static.counts == {"static_kv_cache": c.n_decoder_layers, "one_token_expand": 1} and static.layout == layout
    assert not StaticCachePass(per_row)(graph).modified             # already static: a no-op
    ops = [n.op_type for n in graph.graph]
    assert ops.count(ATTENTION[per_row]) == ops.count("MultiHeadAttention") == c.n_decoder_layers
    assert ops.count(ATTENTION[not per_row]) == 0
    assert "Expand" in [n.op_type for n in ir.load(dynamic / "decoder.onnx").graph] and "Expand" not in ops
    spec = graph_specs(c.to_dict(), layout=layout)["decoder"]
    got = [(v.name, v.dtype.name, [d if isinstance(d, int) else "dyn" for d in v.shape]) for v in graph.graph.inputs]
    want = [(t.name, {"int64": "INT64", "int32": "INT32", "float32": "FLOAT"}[t.dtype],
             [d if isinstance(d, int) else "dyn" for d in t.shape]) for t in spec.inputs]
    assert got == want
    assert spec.inputs[2].name == PAST_SEQUENCE_LENGTH
    assert (DECODER_ATTENTION_MASK in spec.input_names) == (not per_row)     # per row: nothing to mask
    assert [v.name for v in graph.graph.outputs] == spec.output_names
    for v in list(graph.graph.inputs)[3:] + list(graph.graph.outputs)[1:]:
        if ".decoder." in v.name:
            assert str(list(v.shape)[2]) == "cache_len"


def test_cpu_bundles_get_the_per_row_layout(bundles):
    _, _, _, static = bundles
    manifest = read_manifest(static)
    inputs = {i["name"]: i for i in manifest["graphs"]["decoder"]["inputs"]}
    assert inputs[PAST_SEQUENCE_LENGTH]["shape"] == ["batch"] and DECODER_ATTENTION_MASK not in inputs
    assert manifest["decoder_layout"] == STATIC_PER_ROW and manifest["kv_cache"] == "static"
    assert load_bundle(static, provider="cpu").engine.layout == STATIC_PER_ROW


def test_per_row_attention_takes_the_packed_projection(bundles):
    """GroupQueryAttention reads the packed Q/K/V projection whole (key and value left out), so the packing's Split
    is gone; the shared-slot op still takes three inputs. The packed parts must be Q, K, V in that order."""
    model, _, dynamic, _ = bundles
    before = ir.load(dynamic / "decoder.onnx")
    assert sum(n.op_type == "Split" for n in before.graph) == model.config.n_decoder_layers   # one per self-attention
    for per_row in (True, False):
        graph, _ = _static_graph(dynamic, per_row)
        attention = [n for n in graph.graph if n.op_type == ATTENTION[per_row]]
        splits = sum(n.op_type == "Split" for n in graph.graph)
        if per_row:
            assert splits == 0 and all(n.inputs[1] is None and n.inputs[2] is None for n in attention)
            assert all(n.inputs[0].producer().op_type in ("Add", "MatMul") for n in attention)
        else:
            assert splits == model.config.n_decoder_layers and all(n.inputs[1] is not None for n in attention)


def test_rewrite_refuses_unfused_self_attention(bundles):
    _, exported, _, _ = bundles
    graph = ir.load(exported / "decoder.onnx")
    with pytest.raises(StaticCacheError, match="needs the decoder's self-attention fused.*--kv-cache dynamic"):
        StaticCachePass()(graph)


def _decoder_feeds(session, c, rng, batch=2, src=5):
    cross = {i.name: rng.standard_normal((batch, c.n_heads, src, c.head_dim)).astype(np.float32)
             for i in session.get_inputs() if ".encoder." in i.name}
    mask = np.ones((batch, src), np.int64)
    mask[1, 3:] = 0
    return cross, mask


@pytest.mark.parametrize("layout", LAYOUTS)
def test_static_step_writes_in_place_and_reads_only_filled_rows(bundles, layout, tmp_path):
    """Unfilled buffer rows hold NaN: the logits still equal the dynamic graph's, and the new keys land in the
    very numpy buffer that was bound (no copy)."""
    model, _, dynamic, _ = bundles
    c, per_row = model.config, LAYOUTS[layout]
    _static_graph(dynamic, per_row, tmp_path)
    dyn, sta = make_session(dynamic / "decoder.onnx", "cpu"), make_session(tmp_path / "decoder.onnx", "cpu")
    rng = np.random.default_rng(0)
    cross, mask = _decoder_feeds(dyn, c, rng)
    past_names = [i.name for i in dyn.get_inputs() if ".decoder." in i.name]
    out_names = [o.name for o in dyn.get_outputs()]
    past = {n: np.zeros((2, c.n_heads, 0, c.head_dim), np.float32) for n in past_names}
    buffers = {n: np.full((2, c.n_heads, c.max_len, c.head_dim), np.nan, np.float32) for n in past_names}
    values = {n: ort.OrtValue.ortvalue_from_numpy(b) for n, b in buffers.items()}
    for step, token in enumerate([1, 17, 23, 5, 40, 8]):
        ids = np.full((2, 1), token, np.int64)
        rows = default_row_inputs(2, step)                                  # one request: position step, all real
        want = dict(zip(out_names, dyn.run(out_names, {"input_ids": ids, "encoder_attention_mask": mask,
                                                       **rows, **cross, **past})))
        binding = sta.io_binding()
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("encoder_attention_mask", mask)
        binding.bind_cpu_input(PAST_SEQUENCE_LENGTH, np.array([step] * (2 if per_row else 1), np.int32))
        binding.bind_cpu_input(POSITION_IDS, rows[POSITION_IDS])
        if not per_row:
            binding.bind_cpu_input(DECODER_ATTENTION_MASK, np.ones((2, c.max_len), np.int64))
        for name, value in cross.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("logits", "cpu")
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), value)
        sta.run_with_iobinding(binding)
        logits = binding.get_outputs()[0].numpy()
        np.testing.assert_allclose(logits, want["logits"], atol=1e-5, rtol=0)
        for name in past_names:
            present = want[name.replace("past_key_values.", "present.")]
            np.testing.assert_allclose(buffers[name][:, :, :step + 1], present, atol=1e-5, rtol=0)
            assert np.isnan(buffers[name][:, :, step + 1:]).all()               # untouched beyond the filled rows
            past[name] = present


@pytest.mark.parametrize("layout", LAYOUTS)
def test_static_layouts_are_fed_several_tokens_one_at_a_time(bundles, layout, tmp_path):
    """runtime.feed runs a static decoder in the dynamic contract (as parity does): the dynamic graph's outputs."""
    model, _, dynamic, _ = bundles
    c = model.config
    _static_graph(dynamic, LAYOUTS[layout], tmp_path)
    dyn = make_session(dynamic / "decoder.onnx", "cpu")
    feed = Feed(None, make_session(tmp_path / "decoder.onnx", "cpu"), c.to_dict(), layout)
    rng = np.random.default_rng(1)
    cross, mask = _decoder_feeds(dyn, c, rng)
    names = [o.name for o in dyn.get_outputs()]
    past = {name: rng.standard_normal((2, c.n_heads, 3, c.head_dim)).astype(np.float32) for name in feed.past_names}
    tokens = np.array([[7, 8], [9, 10]], np.int64)
    want = dyn.run(names, {"input_ids": tokens, "encoder_attention_mask": mask, **cross, **past,
                           **default_row_inputs(2, 3, 2)})
    logits, presents = feed.decode(tokens, mask, list(past.values()), [cross[n] for n in feed.cross_in_names])
    for w, got in zip(want, [logits, *presents]):
        assert w.shape == got.shape
        np.testing.assert_allclose(got, w, atol=1e-5, rtol=0)


def test_static_bundle_generates_the_tokens_of_the_dynamic_one(bundles):
    """Greedy and beam search (beams reorder the buffers in place; finished rows leave the batch)."""
    model, _, dynamic, static = bundles
    b_dyn, b_sta = load_bundle(dynamic, "cpu"), load_bundle(static, "cpu")
    assert b_sta.engine.static_cache and b_sta.engine.name == "ort-cpu-static-cache"
    assert not b_dyn.engine.static_cache
    for beam in (1, 3):
        opts = SearchOptions(max_new_tokens=20, beam=beam, num_return=beam)
        want = [[h.tokens for h in hyps] for hyps in generate_ids(b_dyn.engine, SEQS, opts)]
        got = [[h.tokens for h in hyps] for hyps in generate_ids(b_sta.engine, SEQS, opts)]
        assert got == want
    lengths = {len(h[0].tokens) for h in generate_ids(b_sta.engine, SEQS, SearchOptions(max_new_tokens=20))}
    assert len(lengths) > 1                                                  # rows did finish at different steps


def test_static_bundle_parity_with_pytorch(bundles):
    model, _, _, static = bundles
    record = graph_parity(model, static, provider="cpu", precision="fp32")   # first step of 2 tokens, one at a time
    assert record.ok, record.summary()


def test_logits_of_a_step_survive_the_next_step(bundles):
    """The binding persists across steps and ORT reuses its output memory: each step must hand out its own array."""
    _, _, _, static = bundles
    engine = load_bundle(static, "cpu").engine
    state = engine.start(np.array([[5, 6, 7, 8]], np.int64), np.ones((1, 4), np.int64), 1)
    first = state.step(np.array([1]), None)
    kept = first.copy()
    second = state.step(np.array([20]), None)
    assert np.array_equal(first, kept) and not np.array_equal(first, second)


def test_full_cache_is_a_clear_error(bundles):
    model, _, _, static = bundles
    engine = load_bundle(static, "cpu").engine
    state = engine.start(np.array([[5, 6, 7]], np.int64), np.ones((1, 3), np.int64), 1, max_steps=3)
    assert state.past.buffers[0].shape == (1, model.config.n_heads, 3, model.config.head_dim)   # sized per request
    for token in (1, 9, 10):
        state.step(np.array([token]), None)
    with pytest.raises(InputError, match="static KV cache holds 3 positions and is full"):
        state.step(np.array([11]), None)
    assert engine.start(np.array([[5]]), np.ones((1, 1), np.int64), 1).past.buffers[0].shape[2] == model.config.max_len


def test_cache_full_generation_fits_exactly(bundles):
    """The longest request the runtime accepts (max_new_tokens = max_len) fills the buffer and no more."""
    model, _, dynamic, static = bundles
    opts = SearchOptions(max_new_tokens=model.config.max_len, ignore_eos=True)
    got = generate_ids(load_bundle(static, "cpu").engine, [[5, 6]], opts)[0][0].tokens
    assert len(got) == model.config.max_len
    assert got == generate_ids(load_bundle(dynamic, "cpu").engine, [[5, 6]], opts)[0][0].tokens


def test_kv_cache_choices():
    unfused = {"graphs": {"encoder": {"op_counts": {}}, "decoder": {"op_counts": {}}}}
    fused = {"graphs": {"encoder": {"op_counts": {"com.microsoft.MultiHeadAttention": 2}},
                        "decoder": {"op_counts": {"com.microsoft.MultiHeadAttention": 4}}}}
    static = {**fused, "kv_cache": "static"}
    assert resolve_kv_cache("auto", "cpu", True, "ort", unfused) == "static"
    assert resolve_kv_cache("auto", "cuda", True, "ort", unfused) == "dynamic"
    assert resolve_kv_cache("auto", "cpu", True, "onnx", unfused) == "dynamic"
    assert resolve_kv_cache("auto", "cpu", False, "ort", unfused) == "dynamic"
    assert resolve_kv_cache("auto", "cpu", False, "ort", fused) == "static"      # int8 of a fused bundle
    assert resolve_kv_cache("auto", "cpu", False, "ort", static) == "static"
    assert resolve_kv_cache("static", "cuda", True, "ort", unfused) == "static"
    with pytest.raises(OptimizeError, match="needs the decoder's self-attention fused"):
        resolve_kv_cache("static", "cpu", True, "onnx", unfused)
    with pytest.raises(OptimizeError, match="needs the decoder's self-attention fused"):
        resolve_kv_cache("static", "cpu", False, "ort", unfused)
    with pytest.raises(OptimizeError, match="already has a static KV cache"):
        resolve_kv_cache("dynamic", "cpu", False, "ort", static)
    with pytest.raises(OptimizeError, match="not available with --precision fp16"):
        resolve_kv_cache("static", "cuda", True, "ort", unfused, "fp16")
    with pytest.raises(OptimizeError, match="unknown KV cache"):
        resolve_kv_cache("paged", "cpu", True, "ort", unfused)


def test_cli_dynamic_option_and_inspect(bundles, tmp_path):
    model, exported, _, static = bundles
    result = CliRunner().invoke(main, ["optimize", str(exported), "--out", str(tmp_path / "d"), "--kv-cache", "dynamic"])
    assert result.exit_code == 0, result.output
    assert "KV cache dynamic" in result.output
    manifest = read_manifest(tmp_path / "d")
    assert manifest["kv_cache"] == "dynamic"
    assert manifest["graphs"]["decoder"]["op_counts"]["com.microsoft.MultiHeadAttention"] == 2 * model.config.n_decoder_layers
    result = CliRunner().invoke(main, ["inspect", str(static)])
    assert result.exit_code == 0 and "KV cache static" in result.output and PAST_SEQUENCE_LENGTH in result.output
    result = CliRunner().invoke(main, ["optimize", str(exported), "--out", str(tmp_path / "x"), "--attention", "onnx",
                                       "--kv-cache", "static"])
    assert result.exit_code == 2 and "--kv-cache dynamic" in result.output and not (tmp_path / "x").exists()


def test_manifest_with_unknown_or_wrong_decoder_layout_is_refused(bundles, tmp_path):
    _, _, _, static = bundles
    copy = copy_with_manifest(static, tmp_path / "copy", decoder_layout="paged")
    with pytest.raises(BundleError, match="unknown decoder_layout 'paged'.*re-export"):
        load_bundle(copy, "cpu")
    copy_with_manifest(static, copy, decoder_layout=STATIC_PER_ROW, kv_cache="dynamic")
    with pytest.raises(BundleError, match="kv_cache 'dynamic' but decoder_layout 'static-per-row'"):
        load_bundle(copy, "cpu")
    for layout, kv_cache in ((STATIC_SHARED, "static"), ("dynamic", "dynamic")):   # says so, the graph is per row
        copy_with_manifest(static, copy, decoder_layout=layout, kv_cache=kv_cache)
        with pytest.raises(BundleError, match="interface differs from the model config and decoder_layout"):
            load_bundle(copy, "cpu")


def test_static_rules_say_why_they_do_not_fire(bundles):
    """The rules alone (without StaticCachePass's new input) match but refuse, and the tracer says why."""
    from exporters.passes import explain_misses
    from exporters.static_cache import static_cache_rules

    _, _, dynamic, _ = bundles
    graph = ir.load(dynamic / "decoder.onnx")
    reasons = explain_misses(graph, static_cache_rules())
    assert set(reasons) == {"static_kv_cache", "past_len_from_input"}
    assert f"no {PAST_SEQUENCE_LENGTH} input" in reasons["static_kv_cache"], reasons
    assert reasons["past_len_from_input"].startswith("condition_failed"), reasons
    # the dynamic graph's bias Expand reads new_len from input_ids [B, new_len]: not ones, so it stays
    expand = explain_misses(graph, [OneTokenExpand().rule()])
    assert "not all ones" in expand["one_token_expand"], expand


@pytest.mark.parametrize("which,io_binding", [("dynamic", False), ("dynamic", True), ("static", None)])
def test_an_engine_is_freed_with_its_last_reference(bundles, which, io_binding):
    """An engine (its sessions and their weights) goes when its last reference does, without waiting for Python's
    cyclic collector: nothing it owns points back at it. A state still held keeps the sessions it reads, and
    only them."""
    import gc
    import weakref

    from runtime.bundle import load_bundle
    from runtime.generate import generate_ids
    from runtime.search import SearchOptions

    path = {"dynamic": bundles[2], "static": bundles[3]}[which]
    gc.disable()
    try:
        engine = load_bundle(path, "cpu", io_binding=io_binding).engine
        generate_ids(engine, [[5, 6, 7]], SearchOptions(max_new_tokens=3))
        state = engine.start(np.array([[5, 6, 7]]), np.ones((1, 3), dtype=np.int64), 1, 4)
        state.step(np.array([engine.bos_id]), None)
        ref, sessions = weakref.ref(engine), weakref.ref(engine.feed)
        del engine
        assert ref() is None and sessions() is not None               # the state still reads the sessions
        state.step(np.array([5]), None)
        del state
        assert sessions() is None
    finally:
        gc.enable()
