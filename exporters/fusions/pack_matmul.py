"""MatMuls reading the same input with constant weights -> one MatMul over the joined weights, then Split.

      x --> MatMul(Wq) --> Add(bq) --> q             x --> MatMul([Wq|Wk|Wv]) --> Add([bq|bk|bv]) --> Split --> q
        \\-> MatMul(Wk) --> Add(bk) --> k      =>                                                          \\--> k
         \\-> MatMul(Wv) --> Add(bv) --> v                                                                  \\--> v

Self-attention's Q/K/V projections share their input, and so do the encoder's cross-attention K/V projections
of every decoder layer. One wide MatMul reads the same weights as the narrow ones but costs one kernel launch
(and, once quantized, one dynamic quantization) instead of several: what dominates an int8 decoder step at
batch 1. A graph pass rather than a pattern rule: the group has any size, found from the shared input's users.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from exporters.passes import Reporting


def _const(value: ir.Value | None) -> np.ndarray | None:
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def _projection(node: ir.Node) -> tuple[np.ndarray, ir.Node | None, np.ndarray | None] | None:
    """(weight [K, N], bias Add node or None, bias [N] or None) of a MatMul by a constant matrix."""
    weight = _const(node.inputs[1])
    if weight is None or weight.ndim != 2:
        return None
    users = list(node.outputs[0].uses())
    if len(users) == 1 and users[0].node.op_type == "Add" and not node.outputs[0].is_graph_output():
        add = users[0].node
        other = add.inputs[1 - users[0].idx]
        bias = _const(other)
        if bias is not None and bias.shape == (weight.shape[1],) and bias.dtype == weight.dtype:
            return weight, add, bias
    return weight, None, None


class PackMatMulsPass(Reporting, ir.passes.InPlacePass):
    """Join every group of >= 2 constant-weight MatMuls (with or without bias Adds) that share an input."""

    name = "pack_matmuls"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph, packed = model.graph, 0
        shared = {}
        for node in graph:
            if node.op_type == "MatMul" and node.domain == "" and node.inputs[0] is not None:
                shared.setdefault(node.inputs[0], []).append(node)
        for x, nodes in shared.items():
            groups: dict[tuple, list] = {}
            for node in nodes:
                found = _projection(node)
                if found is not None:
                    weight, add, bias = found
                    groups.setdefault((weight.shape[0], str(weight.dtype), add is not None), []).append((node, *found))
            for members in groups.values():
                if len(members) >= 2:
                    self._pack(graph, x, members)
                    packed += 1
        self.counts["packed_matmul"] += packed
        return ir.passes.PassResult(model, packed > 0)

    @staticmethod
    def _pack(graph: ir.Graph, x: ir.Value, members: list) -> None:
        first = members[0][0]
        weight = np.concatenate([w for _, w, _, _ in members], axis=1)
        widths = [w.shape[1] for _, w, _, _ in members]
        name = f"{x.name or 'input'}.packed"
        while f"{name}.weight" in graph.initializers:
            name += "_"
        w_init = ir.Value(name=f"{name}.weight", const_value=ir.tensor(weight))
        graph.register_initializer(w_init)
        new_nodes = [ir.node("MatMul", [x, w_init])]
        out = new_nodes[-1].outputs[0]
        if members[0][2] is not None:                                  # bias Adds joined too
            bias = np.concatenate([b for _, _, _, b in members])
            b_init = ir.Value(name=f"{name}.bias", const_value=ir.tensor(bias))
            graph.register_initializer(b_init)
            new_nodes.append(ir.node("Add", [out, b_init]))
            out = new_nodes[-1].outputs[0]
        sizes = ir.Value(name=f"{name}.split", const_value=ir.tensor(np.array(widths, dtype=np.int64)))
        graph.register_initializer(sizes)
        split = ir.node("Split", [out, sizes], attributes={"axis": -1}, num_outputs=len(members))
        new_nodes.append(split)
        graph.insert_before(first, new_nodes)
        for (matmul, _, add, _), new in zip(members, split.outputs):
            old = (add or matmul).outputs[0]
            name, new.shape, new.type = old.name, old.shape, old.type
            ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
            graph.remove([n for n in (matmul, add) if n is not None], safe=True)
            new.name = name
