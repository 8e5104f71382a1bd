"""The shortlist decoder: the bundle's decoder graph projecting onto a request's candidate tokens only.

    path, weight = write_shortlist_decoder(bundle / "decoder.onnx", tmp / "decoder.shortlist.onnx", bundle)

The output projection of the decoder (its last MatMul, then elementwise Mul/Add by constants: the logits bias, an
int8 bundle's column scales)

    hidden [B,T,D] --> MatMul(., W [D,V]) --> (+ bias [V]) --> logits [B,T,V]

becomes, with two more graph inputs (runtime/spec.py's shortlist_decoder_spec) `vocab_ids` int64 [V'] and
`shortlist_weight`, the projection's weights for those ids, and each constant of one value per vocabulary id
gathered for vocab_ids (fp32):

    shortlist_weight [V',D] -------------------------------------------------------+
    hidden [B,T,D] --> Reshape [B*T,D] --> Concat(a zero row) [B*T+1,D] --> Gemm(transB) --> Slice [B*T,V']
        --> Reshape [B,T,V'] --> (+ Gather(bias, vocab_ids)) --> logits [B,T,V']

int8 (DynamicQuantizeMatMul by W [D,V] int8, or exporters/tied_table's QGemms by row slices of the tied table
[V,D], made one DynamicQuantizeMatMul again; a tied fp32 table's Gemm slices likewise become one MatMul): shortlist_weight is [D,V'] int8, its scale and zero point gathered
where they are per column; integer sums need no padding. The tied table's rows already lie in weights.data.

shortlist_weight is gathered by the runtime once per request (runtime/shortlist.py ShortlistWeight) from the table
W^T [V,D], rows contiguous, that `weight` describes for the manifest (file, offset, length, shape, dtype, feed): a
tied fp32 model's embedding table where it already lies in the bundle's weights file (no copy), else a new file
(WEIGHT_FILE) holding W^T. A gather inside the graph each step cost more than the product at batch 1 (RESULTS.md).
Every other tensor stays where it was (external data in weights.data keeps its references), so the graph file
adds only the new nodes.

The zero row: ONNX Runtime multiplies a single row by a non-constant matrix with another kernel than two or more
rows, whose sums round differently, so a request alone (batch 1, one row) would get other logits than the same
row in a batch. With the row added the product always has two rows or more: a row's logits do not depend on its
batch (it costs one more row of a product that is bound by reading the weight rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from runtime.spec import SHORTLIST, SHORTLIST_WEIGHT, VOCAB_IDS

WEIGHT_FILE = "shortlist.weight.bin"


@dataclass
class ShortlistTable:
    """The table [V, D] shortlist_weight is gathered from: an initializer's external data in the bundle (`source`:
    file, offset, length) or an array to write (`array`), fed as rows (fp32) or columns (int8)."""

    shape: tuple[int, int]
    dtype: str
    feed: str
    source: dict | None = None
    array: np.ndarray | None = None

    def record(self, folder: Path) -> dict:
        """The manifest's shortlist "weight" record, writing WEIGHT_FILE into `folder` where the table is new."""
        where = self.source
        if where is None:
            data = np.ascontiguousarray(self.array)
            (folder / WEIGHT_FILE).write_bytes(data.tobytes())
            where = {"file": WEIGHT_FILE, "offset": 0, "length": data.nbytes}
        return {**where, "shape": list(self.shape), "dtype": self.dtype, "feed": self.feed}


class ShortlistGraphError(ValueError):
    """The decoder's output projection is not a form the shortlist decoder can be built from."""


PRODUCTS = ("MatMul", "DynamicQuantizeMatMul")       # fp32; int8 (optimize --precision int8)


def _tail(graph: onnx.GraphProto, table: str | None = None) -> tuple[onnx.NodeProto, list[onnx.NodeProto]]:
    """(the projection's product node, the elementwise Mul/Add nodes by constants between it and `logits`, in
    graph order): the int8 column scales, the logits bias. `table`: the weight _unslice left (not an initializer)."""
    producer = {o: n for n in graph.node for o in n.output}
    inits = {t.name for t in graph.initializer} | ({table} if table else set())
    node, tail = producer.get("logits"), []
    while node is not None and node.op_type in ("Mul", "Add") and sum(i in inits for i in node.input) == 1:
        tail.insert(0, node)
        node = producer.get(next(i for i in node.input if i not in inits))
    if node is None or node.op_type not in PRODUCTS or (node.input[1] not in inits and _transposed(graph, node) is None):
        found = "nothing" if node is None else f"{node.op_type} {node.name!r}"
        raise ShortlistGraphError(f"the decoder's logits come from {found}, not a MatMul (fp32) or "
                                  f"DynamicQuantizeMatMul (int8) by a constant weight; build the shortlist on an "
                                  f"fp32 bundle, or an int8 one made with `optimize --precision int8 --recipe "
                                  f"default` (or per-channel, fp32-projection, blocks; not the per-row recipes)")
    return node, tail


def _transposed(graph: onnx.GraphProto, product: onnx.NodeProto) -> onnx.NodeProto | None:
    """The Transpose(perm [1, 0]) of a constant [V, D] matrix that is the product's weight (a tied fp32 decoder's
    embedding table, transposed at run time), or None."""
    t = next((n for n in graph.node if product.input[1] in n.output), None)
    inits = {i.name for i in graph.initializer}
    if t is None or t.op_type != "Transpose" or t.input[0] not in inits:
        return None
    perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), [1, 0])
    return t if perm == [1, 0] else None


def _array(graph: onnx.GraphProto, name: str, base: Path) -> np.ndarray:
    tensor = next(t for t in graph.initializer if t.name == name)
    return numpy_helper.to_array(tensor, base_dir=str(base))


def _external(graph: onnx.GraphProto, name: str) -> dict | None:
    """Where initializer `name` lies in an external data file ({file, offset, length}), or None (inline)."""
    tensor = next(t for t in graph.initializer if t.name == name)
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in tensor.external_data}
    if "location" not in info or "length" not in info:
        return None
    return {"file": info["location"], "offset": int(info.get("offset", 0)), "length": int(info["length"])}


def _table(graph: onnx.GraphProto, weight: np.ndarray, base: Path) -> dict | None:
    """The external data location of an initializer equal to weight^T ([V, D]: a tied embedding table), or None."""
    shape = [weight.shape[1], weight.shape[0]]
    for t in graph.initializer:
        if list(t.dims) == shape and helper.tensor_dtype_to_np_dtype(t.data_type) == weight.dtype:
            where = _external(graph, t.name)
            if where and np.array_equal(numpy_helper.to_array(t, base_dir=str(base)), weight.T):
                return where
    return None


def _per_column(graph: onnx.GraphProto, name: str, vocab: int) -> str:
    """`name`, or where it holds one value per vocabulary id ([V]), its values for vocab_ids (a Gather node)."""
    dims = list(next(t for t in graph.initializer if t.name == name).dims)
    if dims != [vocab]:
        return name
    graph.node.append(helper.make_node("Gather", [name, VOCAB_IDS], [f"shortlist.{name}"], f"shortlist.gather.{name}",
                                       axis=0))
    return f"shortlist.{name}"


def _fp32_product(graph: onnx.GraphProto, hidden: str, width: int, out: str) -> list:
    """hidden [B,T,D] @ shortlist_weight^T -> out [B,T,V'], padded to two rows (module docstring)."""
    consts = {"shortlist.flat": np.array([-1, width], np.int64), "shortlist.zero_row": np.zeros((1, width), np.float32),
              "shortlist.start": np.array([0], np.int64), "shortlist.stop": np.array([-1], np.int64)}
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    node = helper.make_node
    return [node("Reshape", [hidden, "shortlist.flat"], ["shortlist.hidden"], "shortlist.flatten"),
            node("Concat", ["shortlist.hidden", "shortlist.zero_row"], ["shortlist.padded"], "shortlist.pad", axis=0),
            node("Gemm", ["shortlist.padded", SHORTLIST_WEIGHT], ["shortlist.gemm"], "shortlist.projection",
                 transB=1),
            node("Slice", ["shortlist.gemm", "shortlist.start", "shortlist.stop", "shortlist.start"],
                 ["shortlist.sliced"], "shortlist.unpad"),
            node("Shape", [hidden], ["shortlist.lead"], "shortlist.lead_shape", end=2),
            node("Shape", [VOCAB_IDS], ["shortlist.count"], "shortlist.count_shape"),
            node("Concat", ["shortlist.lead", "shortlist.count"], ["shortlist.shape"], "shortlist.out_shape", axis=0),
            node("Reshape", ["shortlist.sliced", "shortlist.shape"], [out], "shortlist.unflatten")]


def _int8_product(graph: onnx.GraphProto, product: onnx.NodeProto, vocab: int, out: str) -> list:
    """DynamicQuantizeMatMul(hidden, shortlist_weight [D,V'], its scale, zero point and bias, each gathered where it
    is per column): integer sums, the same whatever the rows."""
    inputs = [product.input[0], SHORTLIST_WEIGHT] + [_per_column(graph, name, vocab) if name else name
                                                     for name in product.input[2:]]
    return [helper.make_node("DynamicQuantizeMatMul", inputs, [out], "shortlist.projection", domain=product.domain)]


def _unslice(graph: onnx.GraphProto, base: Path) -> tuple[str, dict, np.ndarray] | None:
    """exporters/tied_table's projection, x -> Reshape -> DynamicQuantizeLinear -> QGemm(transB) by row slices of
    the table [V, D] -> Concat -> Reshape, made one DynamicQuantizeMatMul(x, TABLE, b_scale, b_zero_point) node
    again, where it is the logits' projection: (its weight's name, where the table lies in the bundle's weights
    file, the table [D, V] as a view of that file), or None. The slices' initializers are removed."""
    producer = {o: n for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}
    node = producer.get("logits")
    while node is not None and node.op_type in ("Mul", "Add") and sum(i in inits for i in node.input) == 1:
        node = producer.get(next(i for i in node.input if i not in inits))
    if node is None or node.op_type != "Reshape":
        return None
    joined = producer.get(node.input[0])
    gemms = [producer.get(i) for i in joined.input] if joined is not None and joined.op_type == "Concat" else [joined]
    if gemms and all(g is not None and g.op_type == "Gemm" and len(g.input) == 2 for g in gemms):
        return _unslice_float(graph, base, node, joined, gemms, producer, inits)
    if not gemms or any(g is None or g.op_type != "QGemm" or len(g.input) != 6 for g in gemms):
        return None
    quantize = producer.get(gemms[0].input[0])
    flat = producer.get(quantize.input[0]) if quantize is not None else None
    if (quantize is None or quantize.op_type != "DynamicQuantizeLinear" or flat is None or flat.op_type != "Reshape"
            or any(list(g.input[:3]) != list(quantize.output) or g.input[3] not in inits for g in gemms)):
        return None
    where = _contiguous(graph, [g.input[3] for g in gemms])
    if where is None:
        return None
    parts = [inits[g.input[3]] for g in gemms]
    width = parts[0].dims[1]
    rows = sum(p.dims[0] for p in parts)
    weight = np.memmap(base / where["file"], np.int8, "r", where["offset"], (rows, width)).T
    scales = [[_array(graph, g.input[k], base) for g in gemms] for k in (4, 5)]
    inputs = [flat.input[0], "shortlist.table"]
    for k, (values, name) in enumerate(zip(scales, ("scale", "zero_point"))):
        if all(v.ndim == 0 for v in values) and all(v == values[0] for v in values):
            inputs.append(gemms[0].input[4 + k])                       # one scalar for every slice
        else:
            graph.initializer.append(numpy_helper.from_array(np.concatenate([np.broadcast_to(v, (p.dims[0],)) for v, p
                                                                             in zip(values, parts)]), f"shortlist.table_{name}"))
            inputs.append(f"shortlist.table_{name}")
    product = helper.make_node("DynamicQuantizeMatMul", inputs, [node.output[0]], "shortlist.unsliced",
                               domain="com.microsoft")
    _replace(graph, node, [flat, quantize, joined, *gemms], product)
    return "shortlist.table", where, weight


def _contiguous(graph: onnx.GraphProto, names: list[str]) -> dict | None:
    """Where initializers `names` lie, one after the other, in one external data file ({file, offset, length}: one
    table's rows), or None."""
    places = [_external(graph, name) for name in names]
    if any(p is None or p["file"] != places[0]["file"] for p in places) or any(
            b["offset"] != a["offset"] + a["length"] for a, b in zip(places, places[1:])):
        return None
    return {"file": places[0]["file"], "offset": places[0]["offset"], "length": sum(p["length"] for p in places)}


def _unslice_float(graph: onnx.GraphProto, base: Path, node: onnx.NodeProto, joined: onnx.NodeProto,
                   gemms: list[onnx.NodeProto], producer: dict, inits: dict) -> tuple[str, dict, np.ndarray] | None:
    """exporters/tied_table's fp32 projection, x -> Reshape -> Gemm(transB) by row slices of the table [V, D] ->
    Concat -> Reshape, made one MatMul(x, TABLE) node again: as _unslice."""
    flat = producer.get(gemms[0].input[0])
    if (flat is None or flat.op_type != "Reshape"
            or any([(a.name, a.i) for a in g.attribute] != [("transB", 1)] for g in gemms)
            or any(g.input[0] != flat.output[0] or g.input[1] not in inits for g in gemms)):
        return None
    where = _contiguous(graph, [g.input[1] for g in gemms])
    if where is None:                                                 # slices kept inside the graph (a small table)
        weight = np.concatenate([_array(graph, g.input[1], base) for g in gemms]).T
        where = _table(graph, weight, base)
    else:
        parts = [inits[g.input[1]] for g in gemms]
        width, rows = parts[0].dims[1], sum(p.dims[0] for p in parts)
        weight = np.memmap(base / where["file"], np.float32, "r", where["offset"], (rows, width)).T
    product = helper.make_node("MatMul", [flat.input[0], "shortlist.table"], [node.output[0]], "shortlist.unsliced")
    _replace(graph, node, [flat, joined, *gemms], product)
    return "shortlist.table", where, weight


def _replace(graph: onnx.GraphProto, node: onnx.NodeProto, sliced: list, product: onnx.NodeProto) -> None:
    """Put `product` where `node` (the Reshape back to [..., V]) was; the sliced projection's nodes, the shape they
    made and the initializers only they read go."""
    producer = {o: n for n in graph.node for o in n.output}
    shape = producer.get(node.input[1])
    gone = [n for n in [*sliced, shape, node] if n is not None]
    gone += [producer[i] for i in (shape.input if shape is not None else []) if i in producer]
    kept = [product if n is node else n for n in graph.node if n is node or all(n is not g for g in gone)]
    del graph.node[:]
    graph.node.extend(kept)
    used = {i for n in graph.node for i in n.input}
    read = {i for n in gone for i in n.input}
    for t in [t for t in graph.initializer if t.name in read and t.name not in used]:
        graph.initializer.remove(t)                                   # the slices, their scales, the shapes


def shortlist_decoder(model: onnx.ModelProto, base: Path) -> tuple[onnx.ModelProto, ShortlistTable]:
    """The decoder model rewritten in place as its shortlist variant, and the table its shortlist_weight input is
    gathered from (module docstring); `base`: the folder its external data lives in."""
    graph = model.graph
    sliced = _unslice(graph, base)
    if sliced is not None:                                             # the table's rows lie in the weights file
        product, tail = _tail(graph, sliced[0])
        return _rewrite(model, product, tail, sliced[2], sliced[0], sliced[1])
    product, tail = _tail(graph)
    weight_name = product.input[1]
    transpose = _transposed(graph, product) if weight_name not in {t.name for t in graph.initializer} else None
    if transpose is not None:                                         # the table itself: no copy, nothing to compare
        if sum(weight_name in n.input for n in graph.node) == 1:
            graph.node.remove(transpose)
        table = transpose.input[0]
        return _rewrite(model, product, tail, _array(graph, table, base).T, weight_name, _external(graph, table))
    weight = _array(graph, weight_name, base)
    where = _table(graph, weight, base) if product.op_type == "MatMul" and weight.ndim == 2 else None
    return _rewrite(model, product, tail, weight, weight_name, where)


def _rewrite(model: onnx.ModelProto, product: onnx.NodeProto, tail: list, weight: np.ndarray, weight_name: str,
             where: dict | None) -> tuple[onnx.ModelProto, ShortlistTable]:
    """shortlist_decoder's rewrite, the weight [D, V] given (and where its [V, D] table lies, where it does)."""
    graph, hidden = model.graph, product.input[0]
    fp32 = product.op_type == "MatMul"
    if weight.ndim != 2 or weight.dtype != (np.float32 if fp32 else weight.dtype) or weight.dtype.kind not in "fiu":
        raise ShortlistGraphError(f"the output projection's weight is {weight.dtype} {list(weight.shape)}, not a "
                                  f"matrix; build the shortlist on an fp32 or int8 bundle")
    width, vocab = weight.shape
    at = list(graph.node).index(product)
    kept = [n for n in graph.node if n is not product and not any(n is t for t in tail)]
    del graph.node[:]
    out = "shortlist.product"
    nodes = _fp32_product(graph, hidden, width, out) if fp32 else _int8_product(graph, product, vocab, out)
    inits = {t.name for t in graph.initializer}
    for i, t in enumerate(tail):                                      # the scales and bias, on the gathered columns
        const = _per_column(graph, next(n for n in t.input if n in inits), vocab)
        nodes.append(helper.make_node(t.op_type, [f"shortlist.tail{i}" if i else out, const],
                                      [f"shortlist.tail{i + 1}"], f"shortlist.{t.op_type.lower()}{i}"))
    nodes[-1].output[0] = "logits"
    gathers = list(graph.node)                                        # the per-column Gathers _per_column added
    del graph.node[:]
    graph.node.extend(kept[:at] + gathers + nodes + kept[at:])
    used = {i for n in graph.node for i in n.input}
    for t in [t for t in graph.initializer if t.name == weight_name and t.name not in used]:
        graph.initializer.remove(t)                                   # W itself is no longer read
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(weight.dtype))
    shape = [SHORTLIST, width] if fp32 else [width, SHORTLIST]
    graph.input.append(helper.make_tensor_value_info(VOCAB_IDS, onnx.TensorProto.INT64, [SHORTLIST]))
    graph.input.append(helper.make_tensor_value_info(SHORTLIST_WEIGHT, elem, shape))
    logits = next(o for o in graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[-1].Clear()
    logits.type.tensor_type.shape.dim[-1].dim_param = SHORTLIST
    table = ShortlistTable((vocab, width), np.dtype(weight.dtype).name, "rows" if fp32 else "columns", where,
                           None if where else np.ascontiguousarray(weight.T))
    return model, table


def write_shortlist_decoder(decoder: Path, out: Path, base: Path) -> tuple[Path, dict]:
    """Write the shortlist variant of the decoder graph file `decoder` (its external data in `base`) to `out`,
    which must sit in a folder holding the same external data files, and its weight table where needed (beside
    it): (out, the manifest's shortlist "weight" record)."""
    model = onnx.load(str(decoder), load_external_data=False)
    model, table = shortlist_decoder(model, base)
    onnx.save(model, str(out))
    return out, table.record(out.parent)


__all__ = ["shortlist_decoder", "write_shortlist_decoder", "ShortlistGraphError", "ShortlistTable", "WEIGHT_FILE"]
