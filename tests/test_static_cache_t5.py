"""The per-row static KV cache for T5 (exporters/static_cache.py carries its relative position bias).

On conftest's random tiny v1.1 (its greedy outputs vary with the input: asserted where tokens are compared): the
fused counts (one bias for every layer's GroupQueryAttention, gathered once per step from the bundle's table), the
static decoder against the dynamic one step by step with rows at different positions and every unfilled slot NaN
(both layouts: per row, and the shared slot), ids equal to the dynamic bundle's and the PyTorch reference's, graph
parity with PyTorch, and in-flight batching with rows joining at different steps. Slow: the trained t5 and v1.1
variants (toolkit/testing/tiny_t5.py) optimized by `onnxformer optimize` against transformers' generate, greedy,
beam 4 and in flight.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from exporters.optimize import optimize_bundle
from exporters.shared_weights import inline_external
from exporters.static_cache import RELATIVE_BIAS, StaticCachePass
from runtime.bundle import load_bundle
from runtime.feed import Feed
from runtime.generate import generate_ids
from runtime.inflight import InflightBatch
from runtime.manifest import read_manifest
from runtime.search import SearchOptions
from runtime.session import make_session
from runtime.spec import DECODER_ATTENTION_MASK, POSITION_IDS, STATIC_PER_ROW, STATIC_SHARED, default_row_inputs
from toolkit.parity.graphs import graph_parity
from toolkit.reference.checkpoint import load_checkpoint
from toolkit.reference.torch_engine import TorchEngine

LAYOUTS = {STATIC_PER_ROW: True, STATIC_SHARED: False}


@pytest.fixture(scope="module")
def t5_static(t5_exported, tmp_path_factory):
    """(reference model, dynamic bundle, static bundle, the static optimize's report) of conftest's tiny v1.1."""
    checkpoint, exported = t5_exported
    root = tmp_path_factory.mktemp("t5-static")
    dynamic, _ = optimize_bundle(exported, root / "dynamic", kv_cache="dynamic")
    static, report = optimize_bundle(exported, root / "static")                 # auto: static on the CPU
    return load_checkpoint(checkpoint).model, dynamic, static, report


def sources(config, n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, config.vocab_size, size=int(rng.integers(2, 14))).tolist() + [config.eos_id]
            for _ in range(n)]


def test_auto_gives_t5_the_per_row_cache_with_its_relative_bias(t5_static):
    model, _, static, report = t5_static
    c = model.config
    layers = c.n_decoder_layers
    assert report.kv_cache == "static" and report.decoder_layout == STATIC_PER_ROW
    assert report.fusions["decoder"]["static_kv_cache"] == report.fusions["decoder"][RELATIVE_BIAS] == layers
    assert read_manifest(static)["decoder_layout"] == STATIC_PER_ROW
    graph = onnx.load(str(static / "decoder.onnx"), load_external_data=False).graph
    ops = Counter(n.op_type for n in graph.node)
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == ops["MultiHeadAttention"] == layers                      # self: static; cross: as it was
    assert gqa[0].input[10] and len({n.input[10] for n in gqa}) == 1           # one attention_bias for all layers
    tables = {i.name for i in graph.initializer if list(i.dims) == [2 * c.max_len - 1, c.n_heads]}
    assert len(tables) == 1 and sum(n.op_type == "Gather" and n.input[0] in tables for n in graph.node) == 1
    assert not {"CumSum", "GatherND", "Softmax"} & set(ops), ops                # the key mask's positions are gone
    names = [i.name for i in graph.input]
    assert POSITION_IDS in names and DECODER_ATTENTION_MASK not in names


def _static_decoder(dynamic, per_row: bool, folder):
    graph = ir.load(dynamic / "decoder.onnx")
    inline_external(graph)
    static = StaticCachePass(per_row)
    assert static(graph).modified and static.counts[RELATIVE_BIAS] == static.counts["static_kv_cache"] > 0
    ir.save(graph, folder / "decoder.onnx")
    return make_session(folder / "decoder.onnx", "cpu")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_static_steps_equal_the_dynamic_graph_at_each_rows_own_position(t5_static, layout, tmp_path):
    """Rows at positions 3 and 9 (per row; 6 and 6 in the shared slot) of a 16-slot buffer whose unfilled slots are
    NaN, four steps: each row's logits and new keys/values equal the dynamic graph's for that row alone."""
    model, dynamic, _, _ = t5_static
    c, per_row = model.config, LAYOUTS[layout]
    dyn = make_session(dynamic / "decoder.onnx", "cpu")
    feed = Feed(None, _static_decoder(dynamic, per_row, tmp_path), c.to_dict(), layout)
    rng = np.random.default_rng(0)
    starts, heads, dh = ([3, 9] if per_row else [6, 6]), c.n_heads, c.head_dim
    cross = [rng.standard_normal((2, heads, 5, dh)).astype(np.float32) for _ in feed.cross_in_names]
    mask = np.ones((2, 5), np.int64)
    mask[1, 3:] = 0
    pasts = [[rng.standard_normal((1, heads, s, dh)).astype(np.float32) for _ in feed.past_names] for s in starts]
    buffers = [np.full((2, heads, 16, dh), np.nan, np.float32) for _ in feed.past_names]
    for b, s in enumerate(starts):
        for buf, past in zip(buffers, pasts[b]):
            buf[b, :, :s] = past[0]
    bound = feed.bind_static(mask, cross, buffers)
    names = feed.decoder_out_names
    for step in range(4):
        tokens = rng.integers(2, c.vocab_size, size=(2, 1))
        lengths = np.array(starts, np.int32) + step
        logits = bound.step(tokens, lengths).copy()
        for b in range(2):
            feeds = {"input_ids": tokens[b:b + 1], "encoder_attention_mask": mask[b:b + 1],
                     **default_row_inputs(1, int(lengths[b])), **dict(zip(feed.past_names, pasts[b])),
                     **{n: x[b:b + 1] for n, x in zip(feed.cross_in_names, cross)}}
            want, *presents = dyn.run(names, feeds)
            np.testing.assert_allclose(logits[b:b + 1], want, atol=1e-5, rtol=0)
            for buf, present in zip(buffers, presents):
                np.testing.assert_allclose(buf[b:b + 1, :, :lengths[b] + 1], present, atol=1e-5, rtol=0)
                assert np.isnan(buf[b, :, lengths[b] + 1:]).all()
            pasts[b] = presents


def test_static_ids_equal_the_dynamic_bundles_and_pytorchs(t5_static):
    model, dynamic, static, _ = t5_static
    seqs = sources(model.config, 24)
    engines = [load_bundle(static, "cpu").engine, load_bundle(dynamic, "cpu").engine, TorchEngine(model)]
    assert engines[0].name == "ort-cpu-static-cache"
    for beam in (1, 3):
        opts = SearchOptions(max_new_tokens=20, beam=beam)
        got, dyn, ref = ([h[0].tokens for h in generate_ids(e, seqs, opts)] for e in engines)
        assert len({tuple(r) for r in ref}) >= 12, ref                         # outputs that vary
        assert got == dyn == ref, beam


def test_static_bundle_parity_with_pytorch(t5_static):
    model, _, static, _ = t5_static
    record = graph_parity(model, static, provider="cpu", precision="fp32")
    assert record.ok, record.summary()


def drive(batch: InflightBatch, seqs, limits, poison: bool = True) -> tuple[dict, int]:
    """Join one waiting row every other step while slots are free (rows then sit at different positions), NaN in
    every slot no live row has filled before each step; {row index: hypothesis}, and the largest position spread."""
    waiting, done, step, spread = list(range(len(seqs))), {}, 0, 0
    while waiting or batch.live:
        if waiting and step % 2 == 0 and batch.free:
            for row in batch.join([seqs[waiting[0]]], [limits[waiting[0]]], keys=[waiting[0]]):
                if row.limit == 0:
                    done[row.key] = row.hypothesis()
            waiting = waiting[1:]
        for buf in batch.buffers if poison else ():
            for i, row in enumerate(batch.rows):
                buf[i, :, row.length:] = np.nan
            buf[batch.live:] = np.nan
        lengths = [r.length for r in batch.rows]
        spread = max(spread, max(lengths) - min(lengths)) if lengths else spread
        for row in batch.step():
            done[row.key] = row.hypothesis()
        step += 1
    return done, spread


def test_in_flight_rows_at_different_positions_get_their_own_outputs(t5_static):
    model, dynamic, static, _ = t5_static
    seqs = sources(model.config, 16, seed=1)
    limits = np.random.default_rng(2).integers(4, 17, size=len(seqs))
    got, spread = drive(InflightBatch(load_bundle(static, "cpu").engine, slots=4), seqs, limits)
    assert spread >= 4
    reference, dyn = TorchEngine(model), load_bundle(dynamic, "cpu").engine
    want = [generate_ids(reference, [s], SearchOptions(max_new_tokens=int(n)))[0][0].tokens
            for s, n in zip(seqs, limits)]
    assert len({tuple(w) for w in want}) >= 8, want
    assert [got[i].tokens for i in range(len(seqs))] == want
    assert [generate_ids(dyn, [s], SearchOptions(max_new_tokens=int(n)))[0][0].tokens
            for s, n in zip(seqs, limits)] == want


@pytest.fixture(scope="module", params=["t5", "v1.1"])
def trained(request, tmp_path_factory):
    """(name, transformers model, its tokenizer, the fp32 bundle that `onnxformer optimize` wrote: auto, static)."""
    from toolkit.apps.cli import main
    from toolkit.testing.tiny_t5 import trained_t5

    name = request.param
    root = tmp_path_factory.mktemp(f"t5-static-{name}")
    model, tok = trained_t5(name, root / name, steps=200)
    for args in (["import", str(root / name), "--out", str(root / "ckpt")],
                 ["export", str(root / "ckpt"), "--out", str(root / "bundle")],
                 ["optimize", str(root / "bundle"), "--out", str(root / "static")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    assert read_manifest(root / "static")["decoder_layout"] == STATIC_PER_ROW
    return name, model, tok, root / "static"


@pytest.mark.slow
@pytest.mark.parametrize("beam", [1, 4])
def test_trained_variants_static_ids_equal_generate(trained, beam):
    from toolkit.parity.original import hf_generate
    from toolkit.testing.tiny_families import held_out

    name, model, tok, static = trained
    seqs = [tok(t)["input_ids"] for t in held_out(64)]
    want = hf_generate(model, seqs, beam, 12)
    assert len({tuple(w) for w in want}) >= 32, want
    got = [h[0].tokens for h in generate_ids(load_bundle(static, "cpu").engine, seqs,
                                             SearchOptions(max_new_tokens=12, beam=beam))]
    assert got == want, name


@pytest.mark.slow
def test_trained_variants_in_flight_equal_generate(trained):
    from toolkit.parity.original import hf_generate
    from toolkit.testing.tiny_families import held_out

    name, model, tok, static = trained
    seqs = [tok(t)["input_ids"] for t in held_out(24)]
    got, spread = drive(InflightBatch(load_bundle(static, "cpu").engine, slots=6), seqs, [12] * len(seqs))
    want = hf_generate(model, seqs, 1, 12)
    assert spread >= 4 and len({tuple(w) for w in want}) >= 12, want
    assert [got[i].tokens for i in range(len(seqs))] == want, name
