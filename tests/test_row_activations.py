"""Per-row int8 activation scales (exporters/row_activations, optimize --activation-scales per-row): a row's result
does not depend on its batch neighbours, the numbers stay close to float, the gate passes on the dates model.

The per-tensor graphs are the control: the same comparisons on them must show the dependence, so a test that
could not fail would show up here.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from exporters.export import export_model
from exporters.fusions.int8_embedding import quantize_rows
from exporters.optimize import OptimizeError, optimize_bundle
from exporters.precision import to_int8
from exporters.row_activations import per_row_activations
from runtime.bundle import load_bundle
from runtime.generate import generate_ids
from runtime.manifest import read_manifest
from runtime.search import SearchOptions
from toolkit.apps.cli import main

from conftest import auto_weight_bits

K, H, V = 48, 96, 40
BITS = auto_weight_bits()     # what optimize uses here: 7 where 8-bit products saturate (x86 without VNNI)


def _float_graph(rng) -> tuple[ir.Model, dict]:
    """x -> MatMul(W1) + b1 -> Relu -> MatMul(W2) -> y ; x -> DynamicQuantizeMatMul(Q^T, per-column s) -> z
    (the second form is the int8 tied projection's)."""
    w1 = rng.standard_normal((K, H)).astype(np.float32) * 0.2
    b1 = rng.standard_normal(H).astype(np.float32) * 0.1
    w2 = rng.standard_normal((H, K)).astype(np.float32) * 0.2
    table = rng.standard_normal((V, K)).astype(np.float32)
    q, s = quantize_rows(table, BITS)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"]),
             helper.make_node("DynamicQuantizeMatMul", ["x", "qt", "s"], ["z"], domain="com.microsoft")]
    inits = [numpy_helper.from_array(a, n) for a, n in
             [(w1, "w1"), (b1, "b1"), (w2, "w2"), (np.ascontiguousarray(q.T), "qt"), (s, "s")]]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "l", K])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y", "z")], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    reference = {"w1": w1, "b1": b1, "w2": w2, "table": (q.astype(np.float32) * s[:, None])}
    return ir.from_proto(proto), reference


def _session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])


def _float_result(x: np.ndarray, ref: dict) -> tuple[np.ndarray, np.ndarray]:
    h = np.maximum(x @ ref["w1"] + ref["b1"], 0)
    return h @ ref["w2"], x @ ref["table"].T


@pytest.fixture(scope="module")
def graphs():
    rng = np.random.default_rng(0)
    per_tensor, ref = _float_graph(rng)
    per_tensor = to_int8(per_tensor, per_channel=False, reduce_range=BITS == 7)
    per_row = per_row_activations(ir.from_proto(ir.to_proto(per_tensor)))
    return _session(per_tensor), _session(per_row), per_row, ref


def test_per_row_rewrites_every_quantized_matmul_and_its_rows_ignore_their_neighbours(graphs):
    per_tensor, per_row, model, ref = graphs
    ops = [n.op_type for n in model.graph]
    assert "DynamicQuantizeLinear" not in ops and ops.count("MatMulInteger") == 3    # these: the colsums only
    assert all(all(v is None or v.is_initializer() for v in n.inputs) for n in model.graph
               if n.op_type == "MatMulInteger")
    assert ops.count("DynamicQuantizeMatMul") == 3 and ops.count("ReduceMax") == 2   # x's range is made once
    rng = np.random.default_rng(1)
    row = rng.standard_normal((1, 3, K)).astype(np.float32)
    loud = 40 * rng.standard_normal((5, 3, K)).astype(np.float32)         # neighbours with much larger activations
    batch = np.concatenate([row, loud])
    for name, sess in (("per-tensor", per_tensor), ("per-row", per_row)):
        alone, batched = sess.run(None, {"x": row}), sess.run(None, {"x": batch})
        moved = max(float(np.abs(a[0] - b[0]).max()) for a, b in zip(alone, batched))
        if name == "per-row":
            assert moved == 0.0, f"per-row: a row moved by {moved} with its neighbours"
        else:                                      # the control: the dependence per-row removes is there
            assert moved > 1e-2, f"per-tensor rows moved only {moved}: the comparison cannot tell"
    # close to float, row by row, and closer than per tensor for the quiet row batched with loud ones
    want = _float_result(batch, ref)
    got_row, got_tensor = per_row.run(None, {"x": batch}), per_tensor.run(None, {"x": batch})
    for w, r, t in zip(want, got_row, got_tensor):
        scale = np.abs(w).max(axis=-1, keepdims=True)
        err_row = float((np.abs(r - w) / scale).max())
        assert err_row < 0.05, err_row
        assert np.abs(r[0] - w[0]).max() < np.abs(t[0] - w[0]).max() / 4


def test_colsums_are_exact_and_folded_at_load(graphs, tmp_path):
    """No colsum is stored: each is MatMulInteger(a row of ones, Bq) * Bs over constants, which onnxruntime folds
    into one initializer when the session loads; its value is Bs * the integer column sums, rounded once."""
    _, _, model, _ = graphs
    floats = [n for n, v in model.graph.initializers.items() if v.const_value.dtype == ir.DataType.FLOAT]
    assert sorted(floats) == sorted(["b1", "s", "row_activations.tiny", "w1_scale", "w2_scale"]), floats
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "loaded.onnx")
    ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    loaded = ir.load(tmp_path / "loaded.onnx")
    assert "MatMulInteger" not in [n.op_type for n in loaded.graph]             # folded
    for node in (n for n in model.graph if n.op_type == "MatMulInteger"):
        bq = node.inputs[1].const_value.numpy()
        scale = next(u.node for u in next(iter(node.outputs[0].uses())).node.outputs[0].uses()).inputs[1]
        want = scale.const_value.numpy().astype(np.float32) * bq.sum(axis=0, dtype=np.int64).astype(np.float32)
        folded = next(v for name, v in loaded.graph.initializers.items() if name.startswith(node.inputs[1].name)
                      and name.endswith("colsum_mul"))
        assert np.array_equal(folded.const_value.numpy().reshape(-1), want.reshape(-1))


def test_constant_and_zero_rows_are_exact(graphs):
    _, per_row, _, ref = graphs
    x = np.zeros((3, 2, K), np.float32)
    x[1] = 0.75                                              # a constant row: its range is 0
    x[2] = np.random.default_rng(2).standard_normal((2, K))
    y, z = per_row.run(None, {"x": x})
    assert np.isfinite(y).all() and np.isfinite(z).all()
    # the projection reads x directly: a zero or constant row has no rounding error (x = lo exactly), so it equals
    # the product with the dequantized int8 table up to float sums
    np.testing.assert_allclose(z[:2], (x @ ref["table"].T)[:2], rtol=0, atol=1e-5)
    assert np.abs(z[2] - (x @ ref["table"].T)[2]).max() > 1e-5            # a varied row does round


def test_optimize_per_row_records_the_option_and_rows_ignore_neighbours(toy_exported, tmp_path):
    """On a bundle: per-row is in the manifest, and an input's tokens and score are the same alone and batched."""
    _, bundle = toy_exported
    out, report = optimize_bundle(bundle, tmp_path / "row", precision="int8", activation_scales="per-row",
                                  allow_unverified=True)
    manifest = read_manifest(out)
    assert manifest["passes"][-3:] == ["quantize_int8", "per_row_activations", "tied_table_rows"]
    assert manifest["source"]["options"]["activation_scales"] == "per-row"
    for g in ("encoder", "decoder"):
        counts = manifest["graphs"][g]["op_counts"]
        tied = counts.get("com.microsoft.QGemm", 0)                      # exporters/tied_table's projection
        assert counts.get("DynamicQuantizeLinear", 0) == (1 if tied else 0) == (1 if g == "decoder" else 0)
        assert counts.get("com.microsoft.DynamicQuantizeMatMul", 0) > 0
    tensor, _ = optimize_bundle(bundle, tmp_path / "tensor", precision="int8", recipe="default",
                                allow_unverified=True)
    assert read_manifest(tensor)["source"]["options"]["activation_scales"] == "per-tensor"

    rng = np.random.default_rng(3)
    length = 9                                               # same-length neighbours: no padding in the batch
    inputs = [[int(t) for t in rng.integers(3, 64, length)] for _ in range(12)]
    opts = SearchOptions(max_new_tokens=12, ignore_eos=True)
    moved = {}
    for name, path in (("per-row", out), ("per-tensor", tensor)):
        engine = load_bundle(path, "cpu").engine
        alone = [generate_ids(engine, [ids], opts)[0][0] for ids in inputs[:4]]
        batched = generate_ids(engine, inputs, opts)[:4]
        assert len({tuple(h.tokens) for h in alone}) >= 3               # outputs vary
        if name == "per-row":
            assert [h.tokens for h in alone] == [b[0].tokens for b in batched]
        moved[name] = max(abs(a.score - b[0].score) for a, b in zip(alone, batched) if a.tokens == b[0].tokens)
    assert moved["per-row"] == 0.0, moved                      # no padding in the batch: identical, as fp32 is
    assert moved["per-tensor"] > 1e-4, moved


def test_activation_scales_is_for_int8_only(toy_exported, tmp_path):
    _, bundle = toy_exported
    with pytest.raises(OptimizeError, match="is for --precision int8"):
        optimize_bundle(bundle, tmp_path / "x", precision="fp32", activation_scales="per-row")
    result = CliRunner().invoke(main, ["optimize", str(bundle), "--out", str(tmp_path / "y"), "--precision", "int4",
                                       "--activation-scales", "per-row"])
    assert result.exit_code == 2 and "is for --precision int8" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "y").exists()
    result = CliRunner().invoke(main, ["optimize", str(bundle), "--out", str(tmp_path / "z"), "--precision", "int8",
                                       "--activation-scales", "per-column"])
    assert result.exit_code == 2 and "per-column" in result.output


@pytest.mark.slow
def test_dates_per_row_passes_the_int8_gate_and_its_rows_ignore_neighbours(dates_checkpoint, tmp_path):
    """The gate (>= 98% greedy tokens, held-out accuracy within 1 point) on the dates model, per-row scales; and
    held-out dates give the same tokens and scores alone and in a batch of mixed-length neighbours."""
    from toolkit.reference.tasks.dates import TARGET_LEN, held_out_examples

    ckpt = dates_checkpoint
    bundle = export_model(ckpt.model, tmp_path / "bundle", tokenizer=ckpt.path / "tokenizer.json")
    out, report = optimize_bundle(bundle, tmp_path / "int8", precision="int8", activation_scales="per-row")
    gate = report.parity
    assert gate["verdict"] == "ok" and gate["verdicts"] == {"tokens": "ok", "accuracy": "ok"}, gate["summary"]
    loaded = load_bundle(out, "cpu")
    examples = held_out_examples()[:64]
    seqs = [loaded.tokenizer.encode(src) for src, _ in examples]
    assert len({len(s) for s in seqs}) > 1                    # mixed lengths: the batch pads
    opts = SearchOptions(max_new_tokens=TARGET_LEN + 1)
    alone = [generate_ids(loaded.engine, [s], opts)[0][0] for s in seqs]
    batched = [h[0] for start in range(0, len(seqs), 32) for h in generate_ids(loaded.engine, seqs[start:start + 32], opts)]
    assert [a.tokens for a in alone] == [b.tokens for b in batched]
    assert len({tuple(a.tokens) for a in alone}) > 32
    moved = max(abs(a.score - b.score) for a, b in zip(alone, batched))
    assert moved < 1e-4, moved                                # per tensor: up to 3e-2 (benchmarks/RESULTS.md)
    assert json.loads((out / "manifest.json").read_text())["source"]["options"]["activation_scales"] == "per-row"
