"""Dynamic int8 quantization of MatMul weights, in place and one weight at a time.

The graph onnxruntime.quantization.quantize_dynamic makes with op_types_to_quantize=["MatMul"], QInt8 weights and
MatMulConstBOnly, made here on the onnx_ir model:

    MatMul(A, W) => DynamicQuantizeLinear(A) -> A_quantized, A_scale, A_zero_point    (one per activation tensor)
                    MatMulInteger(A_quantized, W_quantized, A_zero_point, W_zero_point) -> Cast(float)
                    -> Mul(., Mul(A_scale, W_scale))                                       (onnxruntime fuses the
                                                                                            chain at load)

with onnxruntime's node and value names and its numbers: symmetric int8 weights, one scale per tensor or per output
column, scale = 2 max|w| / (qmax - qmin) computed in float64 and stored in float32 (qmin, qmax = -127, 127, or -64,
64 with reduce_range), q = clip(round(w / scale), -128, 127), a zero range given scale 1
(onnxruntime.quantization.quant_utils.quantize_data). tests/test_int8_weights.py compares the two graphs node for
node and their weights byte for byte.

Why not call quantize_dynamic: it loads every float weight of the graph into protobuf messages and keeps their int8
copies beside them until it saves (about twice the float32 weights, all anonymous memory; the NLLB-200-3.3B
shape's optimize was killed at 23 GiB there: benchmarks/RESULTS.md). Here a weight is read through its mapping
(weights.data) a slice of rows at a time, its int8 copy is made, and the float initializer leaves the graph, so
the float weights the fusion passes made in memory (packed Q/K/V) are freed one by one as they are quantized.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

SLICE = 1 << 24                         # float values read at a time (64 MB)
QUANTIZED, SCALE, ZERO_POINT = "_quantized", "_scale", "_zero_point"       # onnxruntime's suffixes


def row_slices(table: np.ndarray, values: int | None = None):
    """Row slices of a [R, C] array of at most `values` values each (default SLICE): what large weights are read
    by, so no temporary is the size of a whole weight."""
    step = max(1, (values or SLICE) // max(1, table.shape[1]))
    for start in range(0, table.shape[0], step):
        yield slice(start, start + step)


def weight_scale(weight: np.ndarray, per_channel: bool, reduce_range: bool) -> np.ndarray:
    """The float32 scale of a symmetric int8 weight: [] per tensor, [N] per output column (last axis)."""
    flat = weight.reshape(-1, weight.shape[-1])
    axis = 0 if per_channel else None
    lo = hi = None
    for rows in row_slices(flat):
        part = flat[rows]
        lo = part.min(axis=axis) if lo is None else np.minimum(lo, part.min(axis=axis))
        hi = part.max(axis=axis) if hi is None else np.maximum(hi, part.max(axis=axis))
    zero = np.float32(0)
    top = np.maximum(np.abs(np.minimum(lo, zero)), np.abs(np.maximum(hi, zero))).astype(np.float32)
    qmin, qmax = (-64, 64) if reduce_range else (-127, 127)
    scale = (top.astype(np.float64) - (-top).astype(np.float64)) / np.float64(qmax - qmin)
    return np.where(scale < np.finfo(np.float32).tiny, np.float64(1.0), scale).astype(np.float32)


def quantize_weight(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 q = clip(round(w / scale), -128, 127) (numpy's round: halves to even), a slice of rows at a time."""
    flat = weight.reshape(-1, weight.shape[-1])
    out = np.empty(flat.shape, np.int8)
    for rows in row_slices(flat):
        part = (flat[rows].astype(np.float32) / scale).round()
        np.clip(part, -128, 127, out=part)
        out[rows] = part
    return out.reshape(weight.shape)


def _value(name: str, dtype: ir.DataType, shape=None) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=None if shape is None else ir.Shape(shape))


def _initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def quantize_matmul_weights(model: ir.Model, per_channel: Callable[[ir.Node], bool | None],
                            reduce_range: bool = False) -> int:
    """Quantize, in place, every MatMul whose B is a float32 initializer and for which per_channel(node) is not
    None (True: one scale per output column, False: one per tensor; None: the MatMul stays float). Returns how
    many MatMuls were rewritten."""
    graph, done = model.graph, 0
    activations: dict[str, tuple[ir.Value, ir.Value, ir.Value]] = {}
    weights: dict[str, tuple[ir.Value, ir.Value, ir.Value]] = {}
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        a, w = node.inputs
        if a is None or w is None or a.is_initializer() or not w.is_initializer() or w.const_value is None:
            continue
        if w.const_value.dtype != ir.DataType.FLOAT:
            continue
        channels = per_channel(node)
        if channels is None:
            continue
        for role, value in (("input", a), ("weight", w), ("output", node.outputs[0])):
            if not value.name:                    # the new values are named after these (a rewrite may leave none)
                value.name = f"{node.name or 'MatMul'}_{role}"
        new: list[ir.Node] = []
        if a.name not in activations:
            dql = ir.Node("", "DynamicQuantizeLinear", [a], name=a.name + "_QuantizeLinear", outputs=[
                _value(a.name + QUANTIZED, ir.DataType.UINT8, a.shape), _value(a.name + SCALE, ir.DataType.FLOAT, []),
                _value(a.name + ZERO_POINT, ir.DataType.UINT8, [])])
            activations[a.name] = tuple(dql.outputs)
            new.append(dql)
        a_q, a_scale, a_zp = activations[a.name]
        if w.name not in weights:
            weights[w.name] = _quantized(graph, w, channels, reduce_range)
        w_q, w_scale, w_zp = weights[w.name]
        base = node.name + "_quant"
        out = node.outputs[0]
        product = ir.Node("", "MatMulInteger", [a_q, w_q, a_zp, w_zp], name=base,
                          outputs=[_value(out.name + "_output_quantized", ir.DataType.INT32, out.shape)])
        to = out.type.dtype if out.type is not None else ir.DataType.FLOAT
        cast = ir.Node("", "Cast", product.outputs, attributes=[ir.AttrInt64("to", to)],
                       name=product.outputs[0].name + "_cast",
                       outputs=[_value(product.outputs[0].name + "_cast_output", to, out.shape)])
        scales = ir.Node("", "Mul", [a_scale, w_scale], name=base + "_scales_mul",
                         outputs=[_value(base + "_scales_mul:0", ir.DataType.FLOAT)])
        result = ir.Node("", "Mul", [cast.outputs[0], scales.outputs[0]], name=base + "_output_scale_mul",
                         outputs=[_value(out.name + ".int8", to, out.shape)])
        new += [product, cast, scales, result]
        graph.insert_before(node, new)
        name = out.name
        ir.convenience.replace_all_uses_with(out, result.outputs[0], replace_graph_outputs=True)
        graph.remove(node, safe=True)
        result.outputs[0].name = name
        if not w.uses() and not w.is_graph_output():         # the float weight goes (and its memory, if it owned it)
            graph.initializers.pop(w.name)
            w.const_value = None
        done += 1
    return done


def _quantized(graph: ir.Graph, weight: ir.Value, per_channel: bool,
               reduce_range: bool) -> tuple[ir.Value, ir.Value, ir.Value]:
    data = weight.const_value.numpy()
    scale = weight_scale(data, per_channel, reduce_range)
    q = quantize_weight(data, scale)
    return (_initializer(graph, weight.name + QUANTIZED, q), _initializer(graph, weight.name + SCALE, scale),
            _initializer(graph, weight.name + ZERO_POINT, np.zeros(scale.shape, np.int8)))


ZERO_POINT_INPUT = {"MatMulInteger": 3, "DynamicQuantizeMatMul": 3}     # where each op reads its weight's zero point


def drop_zero_points(model: ir.Model) -> int:
    """Leave out every weight zero point that is all zeros (the symmetric weights above have only those): the
    input is optional and 0 by default, so the results are the same bits, and the bundle stores no int8 [N]
    vector per per-channel MatMul (174 KB at the flan-t5-base shape). In place; returns how many inputs went."""
    dropped = 0
    for node in model.graph:
        slot = ZERO_POINT_INPUT.get(node.op_type)
        if slot is None or len(node.inputs) <= slot or node.inputs[slot] is None:
            continue
        zero = node.inputs[slot]
        if zero.const_value is None or zero.const_value.dtype not in (ir.DataType.INT8, ir.DataType.UINT8) or \
                np.any(zero.const_value.numpy() != 0):
            continue
        node.replace_input_with(slot, None)
        size = len(node.inputs)
        while size and node.inputs[size - 1] is None:          # trailing optional inputs: gone, not empty
            size -= 1
        node.resize_inputs(size)
        dropped += 1
        if not zero.uses() and zero.is_initializer() and not zero.is_graph_output():
            model.graph.initializers.pop(zero.name)
    return dropped


__all__ = ["quantize_matmul_weights", "quantize_weight", "weight_scale", "row_slices", "drop_zero_points"]
