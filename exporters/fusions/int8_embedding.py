"""8-bit embedding tables (int8 bundles): the token lookup and the tied output projection read one int8 matrix.

      W [V,D] float32 --> Gather(input_ids) [--> Mul(c)]           Q^T [D,V] int8, s [V] float32 (one scale per row of W)
              \\--> (W^T) --> MatMul(x, .) --> logits       =>     Gather(Q^T, ids, axis=1) -> Transpose -> Cast * (c s)[ids]
                                                                   DynamicQuantizeMatMul(x, Q^T, 1) * s --> logits

Dynamic int8 quantization (onnxruntime.quantization) touches MatMul weights only, so the embedding stays float32:
8000 x 512 float32 in each graph of the base shape, a third of an int8 bundle. Here every row of the table gets a symmetric
int8 scale (max |row| / 127), which is per-column quantization of the projection's weight W^T, so the tied
projection reads the same int8 matrix and the same scales as the lookup: com.microsoft.DynamicQuantizeMatMul with a
scalar b_scale of 1, then one Mul by s [V] (the same numbers up to float rounding). DynamicQuantizeMatMul could take
s itself as a per-column b_scale [N], but onnxruntime's per-column path is slower at batch 1 (RESULTS.md, "Leaner
edge bundles"). Here the matrix is in the projection's [D, V] layout (a lookup reads one strided column per
token), the same tensor in both graphs; after quantization exporters/tied_table turns it into [V, D] rows, read
by the lookups and, through row slices of its own bytes, by the projection (so that onnxruntime holds the table
once), and exporters/shared_weights stores it once.

The token lookup is the Gather whose indices are the graph input `input_ids`; the positional table (read by position,
not by token) keeps float32. Untied models: the lookup is quantized, the separate projection is left to dynamic
quantization. Runs after fold_transposed_weights (which stores W^T as its own initializer) and before quantize_int8.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from exporters.int8_weights import row_slices
from exporters.passes import Reporting
from runtime.spec import INPUT_IDS

ORT_DOMAIN = "com.microsoft"


def quantize_rows(table: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row: (q int8 [V, D], scale float32 [V]) with table ~= q * scale[:, None]; bits 7: |q| <= 64
    (the range of onnxruntime's reduce_range, exact in int8 kernels that saturate: exporters/precision.py)."""
    top = 127 if bits == 8 else 64
    q, scale = np.empty(table.shape, np.int8), np.empty(table.shape[0], np.float32)
    for rows in row_slices(table):                  # a slice at a time: the NLLB-3.3B table is 2.1 GB of float32
        part = table[rows]
        peak = np.abs(part).max(axis=1)
        scale[rows] = np.where(peak > 0, peak / top, 1.0).astype(np.float32)
        q[rows] = np.clip(np.rint(part / scale[rows, None]), -top, top)
    return q, scale


def _same_transposed(weight: np.ndarray, table: np.ndarray) -> bool:
    """weight == table.T, compared a slice of table rows at a time."""
    return weight.shape == table.shape[::-1] and all(np.array_equal(weight[:, rows], table[rows].T)
                                                     for rows in row_slices(table))


def _const(value: ir.Value | None) -> np.ndarray | None:
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


class Int8EmbeddingPass(Reporting, ir.passes.InPlacePass):
    """Quantize token-embedding Gathers (and the tied projection that reads the same matrix) to int8 per row."""

    name = "int8_embedding"

    def __init__(self, tied_projection: bool = True, weight_bits: int = 8):
        super().__init__()
        self.tied_projection = tied_projection          # False: the projection stays float (an int8 recipe)
        self.weight_bits = weight_bits                  # 7: exporters/int8_recipes.resolve_weight_bits

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        ids = next((v for v in graph.inputs if v.name == INPUT_IDS), None)
        lookups, projections = 0, 0
        for node in list(graph):
            if ids is None or node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or node.inputs[1] is not ids:
                continue
            table = _const(node.inputs[0])
            if (table is None or table.ndim != 2 or table.shape[1] < 2 or table.dtype != np.float32
                    or node.attributes.get_int("axis", 0) != 0):                    # [V, 1]: our own row scales
                continue
            q, scale = quantize_rows(table, self.weight_bits)
            base = node.inputs[0].name or "embedding"
            qt = self._initializer(graph, f"{base}.int8_t", np.ascontiguousarray(q.T))
            s = self._initializer(graph, f"{base}.int8_scale", scale)
            after, factor = self._scalar_mul(node)                   # the sqrt(d_model) scaling, folded in
            rows = self._initializer(graph, f"{base}.int8_row_scale", (scale * factor)[:, None].astype(np.float32))
            nodes = [ir.node("Gather", [qt, ids], attributes={"axis": 1})]                     # [D, batch, len]
            nodes.append(ir.node("Transpose", [nodes[-1].outputs[0]], attributes={"perm": [1, 2, 0]}))
            nodes.append(ir.node("Cast", [nodes[-1].outputs[0]], attributes={"to": ir.DataType.FLOAT}))
            nodes.append(ir.node("Gather", [rows, ids], attributes={"axis": 0}))                # [batch, len, 1]
            nodes.append(ir.node("Mul", [nodes[2].outputs[0], nodes[3].outputs[0]]))
            graph.insert_before(node, nodes)
            self._replace(graph, after or node, nodes[-1].outputs[0])
            if after is not None:
                graph.remove(node, safe=True)
            lookups += 1
            projections += self._tied_projections(graph, table, qt, s) if self.tied_projection else 0
        self.counts.update({"int8_embedding": lookups, "int8_tied_projection": projections})
        return ir.passes.PassResult(model, lookups > 0)

    def _tied_projections(self, graph: ir.Graph, table: np.ndarray, qt: ir.Value, s: ir.Value) -> int:
        """MatMul(x, W^T) with W this table -> DynamicQuantizeMatMul(x, Q^T, 1) * s: the same int8 matrix and scales."""
        found, unit = 0, None
        for node in list(graph):
            if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
                continue
            weight = _const(node.inputs[1])
            if weight is None or not _same_transposed(weight, table):
                continue
            if unit is None:
                unit = self._initializer(graph, f"{qt.name}.unit_scale", np.array(1.0, np.float32))
            new = ir.node("DynamicQuantizeMatMul", [node.inputs[0], qt, unit], domain=ORT_DOMAIN)
            scaled = ir.node("Mul", [new.outputs[0], s])
            new.outputs[0].shape, new.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
            graph.insert_before(node, [new, scaled])
            self._replace(graph, node, scaled.outputs[0])
            found += 1
        if found and ORT_DOMAIN not in graph.opset_imports:
            graph.opset_imports[ORT_DOMAIN] = 1
        return found

    @staticmethod
    def _scalar_mul(node: ir.Node) -> tuple[ir.Node | None, float]:
        """The Mul by a constant scalar that is the lookup's only consumer (the embedding scale), and its factor."""
        uses = list(node.outputs[0].uses())
        if len(uses) != 1 or node.outputs[0].is_graph_output():
            return None, 1.0
        mul = uses[0].node
        if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx"):
            return None, 1.0
        factor = _const(mul.inputs[1 - uses[0].idx])
        if factor is None or factor.size != 1 or factor.dtype != np.float32:
            return None, 1.0
        return mul, float(factor.reshape(()))

    @staticmethod
    def _initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
        while name in graph.initializers:
            name += "_"
        value = ir.Value(name=name, const_value=ir.tensor(array))
        graph.register_initializer(value)
        return value

    @staticmethod
    def _replace(graph: ir.Graph, old_node: ir.Node, new: ir.Value) -> None:
        old = old_node.outputs[0]
        name, new.shape, new.type = old.name, old.shape, old.type
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        graph.remove(old_node, safe=True)
        new.name = name


__all__ = ["Int8EmbeddingPass", "quantize_rows"]
