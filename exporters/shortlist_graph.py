"""The shortlist decoder: the bundle's decoder graph projecting onto a request's candidate tokens only.

    write_shortlist_decoder(bundle / "decoder.onnx", tmp / "decoder.shortlist.onnx", bundle)

The output projection of the decoder (its last MatMul, and the logits bias where the model has one)

    hidden [B,T,D] --> MatMul(., W [D,V]) --> (+ bias [V]) --> logits [B,T,V]

becomes, with one more graph input `vocab_ids` int64 [V'] (runtime/spec.py's shortlist_decoder_spec):

    table [V,D] --> Gather(., vocab_ids) --> [V',D] -----------------------+
    hidden [B,T,D] --> Reshape [B*T,D] --> Concat(a zero row) [B*T+1,D] --> Gemm(transB) --> Slice [B*T,V']
        --> Reshape [B,T,V'] --> (+ Gather(bias, vocab_ids)) --> logits [B,T,V']

`table` is W's transpose, rows contiguous, so the gather reads V' rows of D values each step (a gather of W's
columns would touch a cache line per value). A tied model's embedding table is that transpose already and is
reused by name (no copy); otherwise W^T is stored in the new graph. Every other tensor stays where it was
(external data in weights.data keeps its references), so the file adds only the new nodes and, untied, W^T.

The zero row: ONNX Runtime multiplies a single row by a non-constant matrix with another kernel than two or more
rows, whose sums round differently, so a request alone (batch 1, one row) would get other logits than the same
row in a batch. With the row added the product always has two rows or more: a row's logits do not depend on its
batch (it costs one more row of a product that is bound by reading the gathered rows).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from runtime.spec import SHORTLIST, VOCAB_IDS

TABLE = "shortlist.table"


class ShortlistGraphError(ValueError):
    """The decoder's output projection is not a form the shortlist decoder can be built from."""


def _projection(graph: onnx.GraphProto) -> tuple[onnx.NodeProto, onnx.NodeProto | None]:
    """(the projection MatMul, the bias Add or None) producing the graph's `logits`."""
    producer = {o: n for n in graph.node for o in n.output}
    inits = {t.name for t in graph.initializer}
    node, bias = producer.get("logits"), None
    if node is not None and node.op_type == "Add" and any(i in inits for i in node.input):
        bias, node = node, producer.get(next(i for i in node.input if i not in inits))
    if node is None or node.op_type != "MatMul" or node.input[1] not in inits:
        found = "nothing" if node is None else f"{node.op_type} {node.name!r}"
        raise ShortlistGraphError(f"the decoder's logits come from {found}, not a MatMul by a weight (and a bias); "
                                  f"the shortlist needs an fp32 decoder whose output projection is one MatMul")
    return node, bias


def _array(graph: onnx.GraphProto, name: str, base: Path) -> np.ndarray:
    tensor = next(t for t in graph.initializer if t.name == name)
    return numpy_helper.to_array(tensor, base_dir=str(base))


def _table(graph: onnx.GraphProto, weight: np.ndarray, base: Path) -> str | None:
    """The name of an initializer equal to weight^T ([V, D]: a tied embedding table), or None."""
    shape = [weight.shape[1], weight.shape[0]]
    for t in graph.initializer:
        if list(t.dims) == shape and t.data_type == onnx.TensorProto.FLOAT:
            if np.array_equal(numpy_helper.to_array(t, base_dir=str(base)), weight.T):
                return t.name
    return None


def _projection_nodes(graph: onnx.GraphProto, table: str, hidden: str, width: int, out: str) -> list:
    """hidden [B,T,D] @ Gather(table, vocab_ids)^T -> out [B,T,V'], as drawn in the module docstring."""
    consts = {"shortlist.flat": np.array([-1, width], np.int64), "shortlist.zero_row": np.zeros((1, width), np.float32),
              "shortlist.start": np.array([0], np.int64), "shortlist.stop": np.array([-1], np.int64)}
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    node = helper.make_node
    return [node("Gather", [table, VOCAB_IDS], ["shortlist.rows"], "shortlist.gather", axis=0),
            node("Reshape", [hidden, "shortlist.flat"], ["shortlist.hidden"], "shortlist.flatten"),
            node("Concat", ["shortlist.hidden", "shortlist.zero_row"], ["shortlist.padded"], "shortlist.pad", axis=0),
            node("Gemm", ["shortlist.padded", "shortlist.rows"], ["shortlist.product"], "shortlist.projection",
                 transB=1),
            node("Slice", ["shortlist.product", "shortlist.start", "shortlist.stop", "shortlist.start"],
                 ["shortlist.sliced"], "shortlist.unpad"),
            node("Shape", [hidden], ["shortlist.lead"], "shortlist.lead_shape", end=2),
            node("Shape", [VOCAB_IDS], ["shortlist.count"], "shortlist.count_shape"),
            node("Concat", ["shortlist.lead", "shortlist.count"], ["shortlist.shape"], "shortlist.out_shape", axis=0),
            node("Reshape", ["shortlist.sliced", "shortlist.shape"], [out], "shortlist.unflatten")]


def shortlist_decoder(model: onnx.ModelProto, base: Path) -> onnx.ModelProto:
    """The decoder model rewritten in place as its shortlist variant (module docstring); `base`: the folder its
    external data lives in."""
    graph = model.graph
    matmul, bias = _projection(graph)
    hidden, weight_name = matmul.input
    weight = _array(graph, weight_name, base)
    if weight.ndim != 2 or weight.dtype != np.float32:
        raise ShortlistGraphError(f"the output projection's weight is {weight.dtype} {list(weight.shape)}, not a "
                                  f"float32 matrix; build the shortlist on the fp32 bundle")
    table = _table(graph, weight, base)
    if table is None:
        table = TABLE
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight.T), TABLE))
    nodes = _projection_nodes(graph, table, hidden, weight.shape[0], "shortlist.logits" if bias else "logits")
    if bias is not None:
        bias_name = next(i for i in bias.input if i != matmul.output[0])
        nodes += [helper.make_node("Gather", [bias_name, VOCAB_IDS], ["shortlist.bias"], "shortlist.gather_bias",
                                   axis=0),
                  helper.make_node("Add", ["shortlist.logits", "shortlist.bias"], ["logits"], "shortlist.add_bias")]
    at = list(graph.node).index(matmul)
    kept = [n for n in graph.node if n is not matmul and n is not bias]
    del graph.node[:]
    graph.node.extend(kept[:at] + nodes + kept[at:])
    if not any(n.input and weight_name in n.input for n in graph.node):        # W itself is no longer read
        graph.initializer.remove(next(t for t in graph.initializer if t.name == weight_name))
    graph.input.append(helper.make_tensor_value_info(VOCAB_IDS, onnx.TensorProto.INT64, [SHORTLIST]))
    logits = next(o for o in graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[-1].Clear()
    logits.type.tensor_type.shape.dim[-1].dim_param = SHORTLIST
    return model


def write_shortlist_decoder(decoder: Path, out: Path, base: Path) -> Path:
    """Write the shortlist variant of the decoder graph file `decoder` (its external data in `base`) to `out`,
    which must sit in a folder holding the same external data files."""
    model = onnx.load(str(decoder), load_external_data=False)
    onnx.save(shortlist_decoder(model, base), str(out))
    return out


__all__ = ["shortlist_decoder", "write_shortlist_decoder", "ShortlistGraphError"]
