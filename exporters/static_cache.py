"""Static KV cache: the decoder's self-attention cache becomes a preallocated buffer that is updated in place.

    dynamic (the export's contract)            static (this pass)
    past   [B, H, past_len, Dh]     in         past   [B, H, cache_len, Dh]   in  (the buffer)
    present [B, H, past_len+new, Dh] out       present [B, H, cache_len, Dh]  out (the same buffer, bound twice)
    input_ids [B, new_len]                     input_ids [B, 1], past_sequence_length int32 [1] in

With the dynamic contract onnxruntime's MultiHeadAttention concatenates past and new key/value into a new
tensor every step, so a step copies the whole cache and grows with past_len. This pass turns each decoder
self-attention into com.microsoft.DecoderMaskedMultiHeadAttention with past_present_share_buffer=1: it writes
the new key/value at row past_sequence_length of the buffer and attends over rows 0..past_sequence_length;
the runtime binds one buffer as both past and present, so nothing is copied (runtime/static_cache.py).

What changes besides the attention nodes:
- positions: the graph read past_len from the past's shape (Shape(past)[2]); that now comes from the new
  `past_sequence_length` input;
- the causal attention bias is dropped: with one new token every cached position is visible, which is what
  the bias said (DecoderMaskedMultiHeadAttention takes exactly one token a step);
- the caches' length axis becomes `cache_len`: the runtime sizes the buffer per request (the tokens it may
  generate, at most the model's max_len).
Parity with the dynamic graph is proved by optimize, as for every pass.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from exporters.passes import Pass, PassResult
from runtime.errors import OnnxformerError
from runtime.spec import CACHE_LEN, PAST, PAST_SEQUENCE_LENGTH, PRESENT, SELF, is_cache

MS = "com.microsoft"
# MultiHeadAttention inputs: query key value bias key_padding_mask attention_bias past_key past_value ...
_MHA_PAST_KEY, _MHA_PAST_VALUE = 6, 7


class StaticCacheError(OnnxformerError):
    """The decoder graph cannot take a static cache (e.g. its self-attention is not fused)."""


class StaticCachePass(Pass):
    """Decoder self-attention with past/present -> DecoderMaskedMultiHeadAttention over a shared buffer."""

    name = "static_kv_cache"

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        pasts = [v for v in graph.inputs if is_cache(v.name, PAST, SELF)]
        if not pasts or any(v.name == PAST_SEQUENCE_LENGTH for v in graph.inputs):
            return PassResult(model, False)                          # an encoder, or already static
        attention, shapes = _consumers(pasts)
        model.opset_imports.setdefault(MS, 1)

        psl = ir.Value(name=PAST_SEQUENCE_LENGTH, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([1]))
        graph.inputs.insert(2, psl)                                  # after input_ids, encoder_attention_mask
        cast = ir.node("Cast", [psl], attributes={"to": ir.DataType.INT64}, name="past_len_from_input")
        graph.insert_before(graph.node(0), cast)
        past_len = cast.outputs[0]                                   # int64 [1]
        past_len.name, past_len.shape, past_len.type = "past_len", ir.Shape([1]), ir.TensorType(ir.DataType.INT64)

        for node in shapes:
            _replace_shape(graph, node, past_len)
        for node in attention:
            _replace_attention(graph, node, psl)
        for v in pasts:
            v.shape = _with_len(v.shape, CACHE_LEN)
        for v in graph.outputs:
            if is_cache(v.name, PRESENT, SELF):
                v.shape = _with_len(v.shape, CACHE_LEN)
            elif v.name == "logits" and v.shape is not None:
                v.shape = ir.Shape([v.shape[0], 1, *list(v.shape)[2:]])
        ids = next(v for v in graph.inputs if v.name == "input_ids")
        if ids.shape is not None:
            ids.shape = ir.Shape([ids.shape[0], 1])
        RemoveUnusedNodesPass()(model)                               # the causal-bias subgraph is dead now
        TopologicalSortPass()(model)
        return PassResult(model, True, {"static_kv_cache": len(attention)})


def _consumers(pasts: list[ir.Value]) -> tuple[list[ir.Node], list[ir.Node]]:
    """The fused self-attention nodes and the Shape nodes reading the past caches; anything else is refused."""
    attention, shapes = {}, {}
    for v in pasts:
        for use in v.uses():
            node, index = use.node, use.idx
            if node.op_type == "MultiHeadAttention" and node.domain == MS and index in (_MHA_PAST_KEY, _MHA_PAST_VALUE):
                attention[id(node)] = node
            elif node.op_type == "Shape" and node.domain == "":
                shapes[id(node)] = node
            else:
                raise StaticCacheError(
                    f"{v.name} feeds a {node.op_type} node ({node.name}), not a fused attention: the static KV cache "
                    f"needs the decoder's self-attention fused into MultiHeadAttention; optimize with --attention ort "
                    f"(the default) and without --no-fuse, or pass --kv-cache dynamic")
    for node in attention.values():
        inputs = list(node.inputs)
        extra = (len(inputs) > 4 and inputs[4] is not None) or any(x is not None for x in inputs[_MHA_PAST_VALUE + 1:])
        if extra or len(node.outputs) > 3:
            raise StaticCacheError(f"self-attention {node.name} uses a key padding mask or extra MultiHeadAttention "
                                   f"inputs/outputs that the static cache does not carry; pass --kv-cache dynamic")
    return list(attention.values()), list(shapes.values())


def _replace_shape(graph: ir.Graph, node: ir.Node, past_len: ir.Value) -> None:
    """Shape(past)[start:end] -> the same dims with dim 2 (past_len) taken from past_sequence_length."""
    x = node.inputs[0]
    rank = 4
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", rank)
    start, end = (s + rank if s < 0 else s for s in (start, end))
    start, end = max(0, min(start, rank)), max(0, min(end, rank))
    parts: list[ir.Value] = []
    new_nodes: list[ir.Node] = []
    for lo, hi in ((start, min(end, 2)), (max(start, 3), end)):
        if lo < hi:
            piece = ir.node("Shape", [x], attributes={"start": lo, "end": hi})
            new_nodes.append(piece)
            parts.append((lo, piece.outputs[0]))
    if start <= 2 < end:
        parts.append((2, past_len))
    values = [v for _, v in sorted(parts, key=lambda p: p[0])]
    if len(values) == 1:
        result = values[0]
    else:
        concat = ir.node("Concat", values, attributes={"axis": 0})
        new_nodes.append(concat)
        result = concat.outputs[0]
    for n in new_nodes:
        graph.insert_before(node, n)
    ir.convenience.replace_all_uses_with(node.outputs[0], result)
    graph.remove(node, safe=True)


def _replace_attention(graph: ir.Graph, node: ir.Node, psl: ir.Value) -> None:
    """MultiHeadAttention(q, k, v, bias, -, causal bias, past k, past v) -> DecoderMaskedMultiHeadAttention."""
    q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
    bias = node.inputs[3] if len(node.inputs) > 3 else None
    inputs = [q, k, v, None, None, node.inputs[_MHA_PAST_KEY], node.inputs[_MHA_PAST_VALUE], psl, None, None, bias]
    while inputs[-1] is None:
        inputs.pop()
    attributes = {"num_heads": node.attributes.get_int("num_heads"), "past_present_share_buffer": 1}
    scale = node.attributes.get_float("scale", None)
    if scale is not None:
        attributes["scale"] = scale
    new = ir.node("DecoderMaskedMultiHeadAttention", inputs, attributes=attributes, domain=MS,
                  num_outputs=3, name=(node.name or "attention") + "_static")
    old = list(node.outputs)
    for out, was in zip(new.outputs, old):
        out.shape, out.type = was.shape, was.type
    ir.convenience.replace_nodes_and_values(graph, node, [node], [new], old, list(new.outputs)[:len(old)])


def _with_len(shape: ir.Shape | None, length: str) -> ir.Shape | None:
    """[B, H, any, Dh] -> [B, H, length, Dh]."""
    if shape is None:
        return None
    dims = list(shape)
    dims[2] = length
    return ir.Shape(dims)


__all__ = ["StaticCachePass", "StaticCacheError"]
