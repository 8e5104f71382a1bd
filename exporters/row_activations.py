"""Per-row int8 activation scales: each token row of a quantized MatMul's input gets its own range, so a row's
result no longer depends on the other rows of its batch (the server batches requests).

Dynamic int8 quantization (onnxruntime.quantization, and com.microsoft.DynamicQuantizeMatMul) computes one
activation scale and zero point over the whole input tensor: a batch neighbour with larger activations changes
every row's rounding. onnxruntime's CPU kernels take only a scalar activation scale and zero point
(MatMulInteger, MatMulIntegerToFloat, DynamicQuantizeMatMul; a per-row zero point is refused), so each row is
first mapped onto [0, 1] by its own min and max:

    x [.., K] --> lo = ReduceMin(x), hi = ReduceMax(x) (per row), r = max(hi - lo, tiny)
              --> u = (x - lo) / r                       every row spans exactly [0, 1] (r / r == 1 in IEEE)
              --> DynamicQuantizeMatMul(u, Bq, Bs, Bzp)  its per-tensor range is then [0, 1] whatever the batch:
                                                         scale 1/255, zero point 0, the same for every row
              --> y = r * that + lo * colsum(B)          x = lo + r u row by row; colsum over K of the
                                                         dequantized weight (Bq - Bzp) * Bs, a constant [N]
                                                         that the graph computes from Bq and Bs and
                                                         onnxruntime folds at load (not stored)

That is asymmetric 8-bit quantization per row (each row uses all 256 levels of its own range, tighter than the
tensor's), done by the fused kernel onnxruntime already has. A constant row (r == 0) becomes u == 0, quantized
exactly, and gives lo * colsum(B). Integer accumulation is exact and the rest is elementwise per row, so a row's
result is the same in any batch (benchmarks/batch_neighbours.py; tests/test_row_activations.py).

Rewritten: quantize_dynamic's DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul(Mul(a_scale, b_scale)) chains
(onnxruntime fuses them into DynamicQuantizeMatMul at load), and DynamicQuantizeMatMul nodes (the 8-bit tied
output projection of exporters/fusions/int8_embedding, b_scale per column). The row range of one input is computed
once for all the MatMuls that read it. Cost: benchmarks/RESULTS.md, "int8 activation scales".
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from exporters.fusions.int8_embedding import Int8EmbeddingPass, _const
from exporters.passes import Reporting

ORT_DOMAIN = "com.microsoft"
ACTIVATION_SCALES = ("per-tensor", "per-row")
TINY = np.float32(1e-30)          # a constant row: (x - lo) / TINY == 0


def _only_use(value: ir.Value) -> ir.Node | None:
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 and not value.is_graph_output() else None


class RowActivationsPass(Reporting, ir.passes.InPlacePass):
    """Give every dynamically quantized MatMul per-row activation ranges (see the module docstring)."""

    name = "per_row_activations"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, self._rows, self._colsums, found = model.graph, {}, {}, 0
        for node in list(graph):
            match = self._match(node)
            if match is None:
                continue
            x, bq, bs, bzp, last, remove = match
            y = self._rewrite(graph, node, x, bq, bs, bzp)
            self._replace(last, y)
            for dead in remove:                              # a DynamicQuantizeLinear may feed other MatMuls
                if not any(out.is_graph_output() or any(True for _ in out.uses()) for out in dead.outputs):
                    graph.remove(dead, safe=True)
            found += 1
        if found and ORT_DOMAIN not in graph.opset_imports:
            graph.opset_imports[ORT_DOMAIN] = 1
        self.counts["per_row_activations"] += found
        return ir.passes.PassResult(model, found > 0)

    def _match(self, node: ir.Node):
        """(x, Bq, Bs, Bzp, node whose output is the float result, nodes to drop) or None."""
        if node.op_type == "DynamicQuantizeMatMul" and node.domain == ORT_DOMAIN:
            if len(node.inputs) > 4 and node.inputs[4] is not None:     # a bias would be row-scaled with the product
                return None
            bzp = node.inputs[3] if len(node.inputs) > 3 else None
            if _const(node.inputs[1]) is None or _const(node.inputs[2]) is None:
                return None
            return node.inputs[0], node.inputs[1], node.inputs[2], bzp, node, [node]
        if node.op_type != "MatMulInteger" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 3:
            return None
        dql = node.inputs[0].producer()
        if dql is None or dql.op_type != "DynamicQuantizeLinear" or node.inputs[2] is not dql.outputs[2]:
            return None
        bq, bzp = node.inputs[1], node.inputs[3] if len(node.inputs) > 3 else None
        cast = _only_use(node.outputs[0])
        if cast is None or cast.op_type != "Cast" or cast.attributes.get_int("to") != ir.DataType.FLOAT:
            return None
        mul = _only_use(cast.outputs[0])
        if mul is None or mul.op_type != "Mul":
            return None
        scale = mul.inputs[1] if mul.inputs[0] is cast.outputs[0] else mul.inputs[0]
        scales = scale.producer()
        if scales is None or scales.op_type != "Mul" or dql.outputs[1] not in scales.inputs:
            return None
        bs = scales.inputs[1] if scales.inputs[0] is dql.outputs[1] else scales.inputs[0]
        if _const(bq) is None or _const(bs) is None or (bzp is not None and _const(bzp) is None):
            return None
        return dql.inputs[0], bq, bs, bzp, mul, [mul, cast, scales, node, dql]

    def _rewrite(self, graph: ir.Graph, before: ir.Node, x: ir.Value, bq: ir.Value, bs: ir.Value,
                 bzp: ir.Value | None) -> ir.Value:
        u, lo, r = self._row_range(graph, before, x)
        inputs = [u, bq, bs] + ([bzp] if bzp is not None else [])
        nodes, colsum = self._colsum(graph, bq, bs, bzp)
        product = ir.node("DynamicQuantizeMatMul", inputs, domain=ORT_DOMAIN)
        scaled, offset = ir.node("Mul", [product.outputs[0], r]), ir.node("Mul", [lo, colsum])
        nodes += [product, scaled, offset, ir.node("Add", [scaled.outputs[0], offset.outputs[0]])]
        graph.insert_before(before, nodes)
        return nodes[-1].outputs[0]

    def _colsum(self, graph: ir.Graph, bq: ir.Value, bs: ir.Value,
                bzp: ir.Value | None) -> tuple[list[ir.Node], ir.Value]:
        """colsum(B) [1, N] as nodes over constants only: the integer column sums of (Bq - Bzp), exact in int32
        (MatMulInteger of a row of K ones, shared by the MatMuls of that K), times Bs. onnxruntime folds them into
        one [1, N] initializer when the session loads (constant folding, at every optimization level but
        "disabled"), so nothing runs per step and the bundle stores no [N] float vector per quantized MatMul (a
        megabyte at the flan-t5-base shape). The value is Bs * sum(Bq - Bzp) rounded once (exact: |sum| < 2^24)."""
        if id(bq) in self._colsums:                            # a weight read by several MatMuls: once
            return [], self._colsums[id(bq)]
        if any(use.node.op_type == "Gather" for use in bq.uses()):   # the 8-bit tied table: stored (below)
            self._colsums[id(bq)] = self._stored_colsum(graph, bq, bs, bzp)
            return [], self._colsums[id(bq)]
        k = bq.const_value.shape[0]
        ones = self._initializer(graph, f"row_activations.ones_{k}", np.ones((1, k), np.uint8), shared=True)
        nodes = [ir.node("MatMulInteger", [ones, bq] + ([None, bzp] if bzp is not None else []))]
        nodes.append(ir.node("Cast", [nodes[0].outputs[0]], attributes={"to": int(ir.DataType.FLOAT)}))
        nodes.append(ir.node("Mul", [nodes[1].outputs[0], bs]))
        for n in nodes:
            n.outputs[0].name = f"{bq.name}.colsum_{n.op_type.lower()}"
        self._colsums[id(bq)] = nodes[-1].outputs[0]
        return nodes, nodes[-1].outputs[0]

    def _stored_colsum(self, graph: ir.Graph, bq: ir.Value, bs: ir.Value, bzp: ir.Value | None) -> ir.Value:
        """colsum(B) [N] computed here (the same numbers as _colsum's) and stored: for the 8-bit tied table
        (exporters/fusions/int8_embedding), which exporters/tied_table turns into rows only when its lookups and its
        projection are all that read it."""
        q = _const(bq)
        zp = np.zeros(1, np.int64) if bzp is None else _const(bzp).astype(np.int64)
        sums = (q.sum(axis=0, dtype=np.int64) - q.shape[0] * zp).astype(np.float32)      # exact: |sum| < 2^24
        return self._initializer(graph, f"{bq.name}.colsum", (_const(bs).astype(np.float32) * sums).reshape(-1))

    def _row_range(self, graph: ir.Graph, before: ir.Node, x: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
        """(u, lo, r) for input x, made once per input and placed right after x is available."""
        if id(x) in self._rows:
            return self._rows[id(x)]
        tiny = self._initializer(graph, "row_activations.tiny", np.array(TINY, np.float32), shared=True)
        if graph.opset_imports.get("", 1) >= 18:              # axes became an input in opset 18
            axes = self._initializer(graph, "row_activations.axes", np.array([-1], np.int64), shared=True)
            reduce = dict(inputs=[x, axes], attributes={"keepdims": 1})
        else:
            reduce = dict(inputs=[x], attributes={"keepdims": 1, "axes": [-1]})
        nodes = [ir.node("ReduceMin", **reduce), ir.node("ReduceMax", **reduce)]
        lo, hi = nodes[0].outputs[0], nodes[1].outputs[0]
        nodes.append(ir.node("Sub", [hi, lo]))
        nodes.append(ir.node("Max", [nodes[-1].outputs[0], tiny]))
        r = nodes[-1].outputs[0]
        nodes.append(ir.node("Sub", [x, lo]))
        nodes.append(ir.node("Div", [nodes[-1].outputs[0], r]))
        producer = x.producer()
        if producer is not None:
            graph.insert_after(producer, nodes)
        else:                                         # a graph input: before the first use in the graph
            graph.insert_before(next(iter(graph)), nodes)
        for n in nodes:
            n.outputs[0].name = f"{x.name}.row_{n.op_type.lower()}_{len(self._rows)}_{nodes.index(n)}"
        self._rows[id(x)] = (nodes[-1].outputs[0], lo, r)
        return self._rows[id(x)]

    @staticmethod
    def _initializer(graph: ir.Graph, name: str, array: np.ndarray, shared: bool = False) -> ir.Value:
        if shared and name in graph.initializers:
            return graph.initializers[name]
        return Int8EmbeddingPass._initializer(graph, name, array)

    @staticmethod
    def _replace(old_node: ir.Node, new: ir.Value) -> None:
        old = old_node.outputs[0]
        name, new.shape, new.type = old.name, old.shape, old.type
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        old.name, new.name = f"{name}.per_tensor", name


def per_row_activations(model: ir.Model) -> ir.Model:
    """The model with per-row activation ranges in every dynamically quantized MatMul (in place; returned)."""
    RowActivationsPass()(model)
    return model


__all__ = ["RowActivationsPass", "per_row_activations", "ACTIVATION_SCALES"]
