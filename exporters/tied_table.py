"""The tied table held once in memory: token lookups read rows of the table [V, D], and the output projection reads
the same bytes through row slices of its own (int8 bundles after quantization; fp32 bundles for the CPU).

    before (exporters/fusions/int8_embedding, then quantization and per-row activations):
        Gather(Q^T [D,V], ids, axis=1) -> Transpose(1, 2, 0) -> ...
        DynamicQuantizeMatMul(x, Q^T, b_scale) -> ...
    after:
        Gather(Q [V,D], ids) -> ...
        x -> Reshape [M,D] -> DynamicQuantizeLinear -> QGemm(., Q[a:b], b_scale, transB=1) for each slice a:b of rows
          -> Concat -> Reshape [..., V] -> ...

Why: onnxruntime packs the constant weight of a quantized product into memory of its own when a session is made,
and releases the initializer only when no other node reads it. The lookup read Q^T too, so the table stayed
mapped beside its packed copy, and a column lookup (one byte in every row of [D, V]) brought all of it into
memory: the NLLB-600M int8 process held its 250 MiB table twice (benchmarks/RESULTS.md, "The tied table held
once"). Now each slice is an initializer of its own whose bytes are the table's own bytes in weights.data
(the model's metadata VIEWS says so, and exporters/shared_weights stores the slice as a part of the table); onnxruntime maps a slice,
packs it (transposing it: QGemm's transB) and releases it before the next, so the packed copy is the one resident
copy of the projection, and loading holds one slice beside it, not the table. A lookup reads one row of Q per
token; runtime/bundle.LookupPages gives those pages back after each run.

fp32 (a tied float table T [V, D], looked up by rows already, projected by MatMul(x, Transpose(T))):
        x -> Reshape [M,D] -> Gemm(., T[a:b], transB=1) for each slice a:b of rows -> Concat -> Reshape [..., V]
onnxruntime folded the Transpose when a session was made: a transposed copy of the whole table beside the mapped
one and the packed one, 1 GiB each at the NLLB-600M shape (the fp32 `generate` peaked 1 GiB above what it then
held). Gemm packs each slice straight from its mapping (MLAS packs B transposed or not into the same layout).
The slices are larger (FLOAT_SLICE_BYTES): what a slice costs is one more node a step, and loading holds one.

Same numbers: DynamicQuantizeLinear gives the activation scale and zero point that DynamicQuantizeMatMul computes
inside, QGemm scales the exact integer sums by a_scale * b_scale as DynamicQuantizeMatMul does, and a slice's sums
are those of its columns: the logits are bit-identical (tests/test_tied_table.py). fp32: MLAS's product by a
packed B, from MatMul or from Gemm, the same packed layout; a slice's columns are its own dot products.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx_ir as ir

from exporters.fusions.int8_embedding import _const
from exporters.passes import Reporting

ORT_DOMAIN = "com.microsoft"
VIEWS = "onnxformer.views"              # the model's metadata: {initializer: {"tensor": name, "offset": bytes}} of
                                        # the initializers whose bytes are a part of another one's
SLICE_BYTES = 16 * 1024 * 1024          # a slice of the projection's rows: what loading holds beside the packed copy
FLOAT_SLICE_BYTES = 64 * 1024 * 1024    # fp32: 4x the bytes per row, the same number of nodes as int8's 16 MiB
PAGE = 4096                             # slices start on a page of the table: onnxruntime maps them


def slice_rows(rows: int, row_bytes: int, slice_bytes: int = SLICE_BYTES) -> list[tuple[int, int]]:
    """[(start, stop)] row slices of a [rows, ...] table of about slice_bytes each, each starting on a page."""
    align = PAGE // math.gcd(row_bytes, PAGE)
    step = max(align, slice_bytes // max(row_bytes, 1) // align * align)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


class TiedTablePass(Reporting, ir.passes.InPlacePass):
    """Token lookups of an 8-bit [D, V] table read a [V, D] one; its DynamicQuantizeMatMuls become sliced QGemms.
    With `floats`, a float [V, D] table's MatMul(x, Transpose(T)) projections become sliced Gemms."""

    name = "tied_table_rows"

    def __init__(self, slice_bytes: int = SLICE_BYTES, floats: bool = False, float_slice_bytes: int = FLOAT_SLICE_BYTES):
        super().__init__()
        self.slice_bytes, self.floats, self.float_slice_bytes = slice_bytes, floats, float_slice_bytes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, lookups, projections = model.graph, 0, 0
        self._views = json.loads(model.metadata_props.get(VIEWS, "{}"))
        if graph.opset_imports.get("", 1) < 15:                  # Shape(start, end) below
            return ir.passes.PassResult(model, False)
        for table in [v for v in graph.initializers.values() if self._int8_matrix(v)]:
            gathers = [u.node for u in table.uses() if self._lookup(u.node, u.idx)]
            products = [u.node for u in table.uses() if self._product(u.node, u.idx)]
            if not gathers or len(gathers) + len(products) != len(list(table.uses())) or table.is_graph_output():
                continue                                         # not (only) our lookup and projection
            rows = self._register(graph, f"{table.name}.rows", np.ascontiguousarray(_const(table).T))
            for gather in gathers:
                lookups += self._rewrite_lookup(graph, gather, rows)
            for product in products:
                projections += self._rewrite_product(graph, product, rows)
            graph.initializers.pop(table.name)
        floats = 0
        for table in [v for v in graph.initializers.values() if self.floats and self._float_matrix(v)]:
            uses = list(table.uses())
            transposes = [u.node for u in uses if self._float_transpose(u.node, u.idx)]
            if (not transposes or len(transposes) == len(uses) or table.is_graph_output()
                    or any(u.node not in transposes and not self._row_lookup(u.node, u.idx) for u in uses)):
                continue                                         # not (only) row lookups and tied projections
            for transpose in transposes:
                floats += self._rewrite_float(graph, transpose, table)
        if projections and ORT_DOMAIN not in graph.opset_imports:
            graph.opset_imports[ORT_DOMAIN] = 1
        if self._views:
            model.metadata_props[VIEWS] = json.dumps(self._views)
        self.counts.update({"tied_table_lookup": lookups, "tied_table_projection": projections,
                            "tied_table_float_projection": floats})
        return ir.passes.PassResult(model, lookups > 0 or floats > 0)

    @staticmethod
    def _int8_matrix(value: ir.Value) -> bool:
        tensor = value.const_value
        return tensor is not None and tensor.dtype == ir.DataType.INT8 and len(tensor.shape) == 2

    @staticmethod
    def _float_matrix(value: ir.Value) -> bool:
        tensor = value.const_value
        return tensor is not None and tensor.dtype == ir.DataType.FLOAT and len(tensor.shape) == 2

    @staticmethod
    def _row_lookup(node: ir.Node, idx: int) -> bool:
        """Gather(table, ids) along axis 0: a float table's token lookup."""
        return (node.op_type == "Gather" and node.domain in ("", "ai.onnx") and idx == 0
                and node.attributes.get_int("axis", 0) == 0)

    @staticmethod
    def _float_transpose(node: ir.Node, idx: int) -> bool:
        """Transpose(table, perm [1, 0]) read only as the weight (input 1) of MatMuls: the tied fp32 projection."""
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or idx != 0:
            return False
        if list(node.attributes.get_ints("perm", [1, 0])) != [1, 0] or node.outputs[0].is_graph_output():
            return False
        uses = list(node.outputs[0].uses())
        return bool(uses) and all(u.node.op_type == "MatMul" and u.node.domain in ("", "ai.onnx") and u.idx == 1
                                  for u in uses)

    @staticmethod
    def _lookup(node: ir.Node, idx: int) -> bool:
        """Gather(table, ids, axis=1) whose only use is Transpose(perm [1, 2, 0]): int8_embedding's column lookup."""
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or idx != 0:
            return False
        if node.attributes.get_int("axis", 0) != 1 or node.outputs[0].is_graph_output():
            return False
        uses = list(node.outputs[0].uses())
        return (len(uses) == 1 and uses[0].node.op_type == "Transpose"
                and list(uses[0].node.attributes.get_ints("perm", [])) == [1, 2, 0])

    @staticmethod
    def _product(node: ir.Node, idx: int) -> bool:
        """DynamicQuantizeMatMul(x, table, constant b_scale[, constant b_zero_point]) without a bias."""
        if node.op_type != "DynamicQuantizeMatMul" or node.domain != ORT_DOMAIN or idx != 1:
            return False
        extra = list(node.inputs[2:]) + [None] * (3 - len(node.inputs[2:]))
        scale, zero, bias = extra[:3]
        return (scale is not None and _const(scale) is not None and bias is None
                and (zero is None or _const(zero) is not None))

    def _rewrite_lookup(self, graph: ir.Graph, gather: ir.Node, rows: ir.Value) -> int:
        transpose = next(iter(gather.outputs[0].uses())).node
        new = ir.node("Gather", [rows, gather.inputs[1]], attributes={"axis": 0})
        graph.insert_before(gather, [new])
        old = transpose.outputs[0]
        name, new.outputs[0].shape, new.outputs[0].type = old.name, old.shape, old.type
        ir.convenience.replace_all_uses_with(old, new.outputs[0], replace_graph_outputs=True)
        graph.remove([transpose, gather], safe=True)
        new.outputs[0].name = name
        return 1

    def _rewrite_product(self, graph: ir.Graph, product: ir.Node, rows: ir.Value) -> int:
        scale = _const(product.inputs[2]).astype(np.float32)
        zero = product.inputs[3] if len(product.inputs) > 3 else None
        zero = np.zeros((), np.int8) if zero is None else _const(zero).astype(np.int8)
        vocab = rows.const_value.shape[0]
        if scale.size > 1 or zero.size > 1:                  # per column: both [V] (QGemm wants the same shapes)
            scale, zero = (np.broadcast_to(a.reshape(-1), (vocab,)) for a in (scale, zero))
        else:
            scale, zero = scale.reshape(()), zero.reshape(())
        consts = [v for v in product.inputs[2:] if v is not None]

        def parts(flat: ir.Value) -> tuple[list[ir.Node], list[ir.Value]]:
            quantize = ir.node("DynamicQuantizeLinear", [flat], num_outputs=3)
            gemms = []
            for (a, b), weight in self._slices(graph, rows, self.slice_bytes):
                s = self._register(graph, f"{weight.name}.scale", scale[a:b] if scale.ndim else scale)
                z = self._register(graph, f"{weight.name}.zero_point", zero[a:b] if zero.ndim else zero)
                gemms.append(ir.node("QGemm", [*quantize.outputs, weight, s, z], attributes={"transB": 1},
                                     domain=ORT_DOMAIN))
            return [quantize, *gemms], [g.outputs[0] for g in gemms]

        self._splice(graph, product, rows.name, rows.const_value.shape, parts)
        for value in consts:                               # its b_scale (and zero point), unless read elsewhere
            if value.name in graph.initializers and not list(value.uses()) and not value.is_graph_output():
                graph.initializers.pop(value.name)
        return 1

    def _rewrite_float(self, graph: ir.Graph, transpose: ir.Node, table: ir.Value) -> int:
        slices = [weight for _, weight in self._slices(graph, table, self.float_slice_bytes)]

        def parts(flat: ir.Value) -> tuple[list[ir.Node], list[ir.Value]]:
            gemms = [ir.node("Gemm", [flat, weight], attributes={"transB": 1}) for weight in slices]
            return gemms, [g.outputs[0] for g in gemms]

        products = [u.node for u in transpose.outputs[0].uses()]
        for product in products:
            self._splice(graph, product, table.name, table.const_value.shape, parts)
        graph.remove(transpose, safe=True)
        return len(products)

    def _slices(self, graph: ir.Graph, table: ir.Value, slice_bytes: int) -> list[tuple[tuple[int, int], ir.Value]]:
        """Initializers over row slices a:b of the [V, D] table, each recorded in VIEWS as a part of its bytes."""
        array = table.const_value.numpy()
        row = array.shape[1] * array.itemsize
        out = []
        for a, b in slice_rows(array.shape[0], row, slice_bytes):
            weight = self._register(graph, f"{table.name}.{a}_{b}", array[a:b])
            self._views[weight.name] = {"tensor": table.name, "offset": a * row}
            out.append(((a, b), weight))
        return out

    def _splice(self, graph: ir.Graph, product: ir.Node, base: str, shape, parts) -> None:
        """Put in place of `product` (x [..., D] -> [..., V]): x -> Reshape [M, D] -> parts(it) (the nodes, and the
        slices' outputs in order) -> Concat -> Reshape [..., V]."""
        vocab, width = (int(d) for d in shape)
        x = product.inputs[0]
        flat = self._register(graph, f"{base}.flat_shape", np.array([-1, width], np.int64))
        last = self._register(graph, f"{base}.vocab", np.array([vocab], np.int64))
        nodes = [ir.node("Reshape", [x, flat]), ir.node("Shape", [x], attributes={"start": 0, "end": -1})]
        made, outputs = parts(nodes[0].outputs[0])
        nodes += made
        if len(outputs) > 1:
            nodes.append(ir.node("Concat", outputs, attributes={"axis": 1}))
        joined = nodes[-1].outputs[0] if len(outputs) > 1 else outputs[0]
        nodes.append(ir.node("Concat", [nodes[1].outputs[0], last], attributes={"axis": 0}))
        nodes.append(ir.node("Reshape", [joined, nodes[-1].outputs[0]]))
        graph.insert_before(product, nodes)
        old, new = product.outputs[0], nodes[-1].outputs[0]
        name, new.shape, new.type = old.name, old.shape, old.type
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        graph.remove(product, safe=True)
        new.name = name

    @staticmethod
    def _free_name(graph: ir.Graph, name: str) -> str:
        while name in graph.initializers:
            name += "_"
        return name

    def _register(self, graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=self._free_name(graph, name), const_value=ir.tensor(array))
        graph.register_initializer(value)
        return value


def tied_table_rows(model: ir.Model, floats: bool = False) -> ir.Model:
    """The model with its 8-bit tied table read by rows (and with `floats` its float one's projection by row slices;
    in place; returned): see the module docstring."""
    TiedTablePass(floats=floats)(model)
    return model


__all__ = ["TiedTablePass", "tied_table_rows", "slice_rows", "VIEWS", "FLOAT_SLICE_BYTES"]
