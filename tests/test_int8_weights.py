"""exporters/int8_weights makes the graph onnxruntime's quantize_dynamic makes, node for node and byte for byte,
on the fused toy graphs (every recipe's weight options) and on a weight built to hit the rounding's edge cases."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

from exporters.int8_weights import quantize_matmul_weights
from exporters.optimize import _fuse_graph
from exporters.precision import PACKED, to_int8
from exporters.shared_weights import save_graph


def reference(model: ir.Model, per_channel: bool, reduce_range: bool, packed_per_channel: bool = True,
              keep_float: tuple[str, ...] = ()) -> onnx.ModelProto:
    """onnxruntime.quantization.quantize_dynamic on the model, as exporters/precision called it before."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    packed = [n.name for n in model.graph if n.op_type == "MatMul"
              and (n.inputs[1].name or "").endswith(PACKED)] if packed_per_channel else []
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "float.onnx", Path(tmp) / "int8.onnx"
        save_graph(model, src)
        common = dict(op_types_to_quantize=["MatMul"], reduce_range=reduce_range, weight_type=QuantType.QInt8,
                      extra_options={"MatMulConstBOnly": True}, use_external_data_format=True)
        if per_channel or not packed:
            quantize_dynamic(src, dst, per_channel=per_channel, nodes_to_exclude=list(keep_float), **common)
        else:
            mid = Path(tmp) / "packed.onnx"
            quantize_dynamic(src, mid, per_channel=True, nodes_to_quantize=packed, **common)
            quantize_dynamic(mid, dst, per_channel=False, nodes_to_exclude=packed + list(keep_float), **common)
        return onnx.load(str(dst))


def nodes(graph: onnx.GraphProto) -> dict[str, tuple]:
    return {n.name or n.output[0]: (n.op_type, n.domain or "", tuple(n.input), tuple(n.output),
                                    tuple(sorted((a.name, str(helper.get_attribute_value(a))) for a in n.attribute)))
            for n in graph.node}


def weights(graph: onnx.GraphProto) -> dict[str, tuple]:
    return {i.name: (i.data_type, tuple(i.dims), numpy_helper.to_array(i).tobytes()) for i in graph.initializer}


def assert_same_graph(ours: ir.Model, theirs: onnx.ModelProto) -> None:
    mine = ir.to_proto(ours).graph
    a, b = nodes(mine), nodes(theirs.graph)
    assert a.keys() == b.keys(), (sorted(a.keys() - b.keys())[:5], sorted(b.keys() - a.keys())[:5])
    assert {k: v for k, v in a.items() if v != b[k]} == {}
    wa, wb = weights(mine), weights(theirs.graph)
    assert wa.keys() == wb.keys(), (sorted(wa.keys() - wb.keys())[:5], sorted(wb.keys() - wa.keys())[:5])
    differ = [k for k in wa if wa[k] != wb[k]]
    assert differ == [], f"{len(differ)} weights differ, e.g. {differ[:3]}"
    assert [o.name for o in mine.output] == [o.name for o in theirs.graph.output]


@pytest.fixture(scope="module")
def fused(toy_exported):
    """The toy bundle's graphs after the fusion passes (packed Q/K/V and cross K/V), float32."""
    _, bundle = toy_exported
    return {g: _fuse_graph(bundle / f"{g}.onnx", True, "ort", "int8", None)[0] for g in ("encoder", "decoder")}


@pytest.mark.parametrize("per_channel, reduce_range, packed_per_channel",
                         [(True, False, True), (False, False, True), (False, True, True), (False, False, False)])
def test_the_fused_graphs_quantize_as_onnxruntime_does(fused, per_channel, reduce_range, packed_per_channel):
    for g, model in fused.items():
        theirs = reference(model, per_channel, reduce_range, packed_per_channel)
        ours = to_int8(model.clone(), per_channel, reduce_range, packed_per_channel)
        kinds = {n.op_type for n in ours.graph}
        assert "MatMulInteger" in kinds and "DynamicQuantizeLinear" in kinds, (g, kinds)
        assert_same_graph(ours, theirs)


def test_a_matmul_kept_float_stays_float(fused):
    model = fused["decoder"].clone()
    for i, node in enumerate(model.graph):
        if node.op_type == "MatMul" and not node.name:
            node.name = f"MatMul_{i}"
    keep = next(n.name for n in reversed(list(model.graph)) if n.op_type == "MatMul")
    theirs = reference(model, False, False, keep_float=(keep,))
    ours = to_int8(model.clone(), False, False, keep_float=(keep,))
    assert keep in {n.name for n in ours.graph if n.op_type == "MatMul"}
    assert_same_graph(ours, theirs)


def edge_model() -> ir.Model:
    """Two MatMuls sharing one input and one weight, another weight: columns of zeros, of one value, exact halves
    of a step, negative-only and positive-only columns, a tiny column (scale under float32's tiny)."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(16, 9)).astype(np.float32)
    w[:, 0] = 0.0
    w[:, 1] = 0.25
    w[:, 2] = np.linspace(-127, 127, 16).astype(np.float32) / 127 * 2.5      # steps of 2.5 / 127: many ties
    w[:, 2] = np.round(w[:, 2] * 127 / 2.5 * 2) / 2 * 2.5 / 127
    w[:, 3] = -np.abs(w[:, 3])
    w[:, 4] = np.abs(w[:, 4])
    w[:, 5] = 1e-39
    v = rng.normal(size=(9, 5)).astype(np.float32) * 3
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y1"], name="first"),
         helper.make_node("MatMul", ["x", "w"], ["y2"], name="second"),
         helper.make_node("Add", ["y1", "y2"], ["s"], name="add"),
         helper.make_node("MatMul", ["s", "v"], ["out"], name="third")],
        "edge", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [2, 5])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(v, "v")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ir.from_proto(onnx.shape_inference.infer_shapes(model))


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("reduce_range", [False, True])
def test_edge_weights_quantize_as_onnxruntime_does(per_channel, reduce_range):
    model = edge_model()
    theirs = reference(model, per_channel, reduce_range, packed_per_channel=False)
    ours = edge_model()
    assert quantize_matmul_weights(ours, lambda node: per_channel, reduce_range) == 3
    assert_same_graph(ours, theirs)
    assert sum(n.op_type == "DynamicQuantizeLinear" for n in ours.graph) == 2     # x once for both, s once


def test_quantized_slices_match_a_whole_weight(monkeypatch):
    """A weight read a slice of rows at a time gets the scale and values of the whole (the slicing is memory's)."""
    import exporters.int8_weights as W

    rng = np.random.default_rng(0)
    w = rng.normal(size=(37, 11)).astype(np.float32) * np.linspace(0.1, 4, 11, dtype=np.float32)
    whole = {pc: (W.weight_scale(w, pc, False), W.quantize_weight(w, W.weight_scale(w, pc, False))) for pc in (1, 0)}
    monkeypatch.setattr(W, "SLICE", 20)                  # one row (11 values) a slice
    for pc, (scale, q) in whole.items():
        sliced = W.weight_scale(w, pc, False)
        assert np.array_equal(sliced, scale) and np.array_equal(W.quantize_weight(w, sliced), q)
