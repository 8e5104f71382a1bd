"""Static KV cache: the decoder's self-attention cache becomes a preallocated buffer that is updated in place.

    dynamic (the export's contract)            static (this pass)
    past   [B, H, past_len, Dh]     in         past   [B, H, cache_len, Dh]   in  (the buffer)
    present [B, H, past_len+new, Dh] out       present [B, H, cache_len, Dh]  out (the same buffer, bound twice)
    input_ids [B, new_len]                     input_ids [B, 1], past_sequence_length int32 in

With the dynamic contract onnxruntime's MultiHeadAttention concatenates past and new key/value into a new
tensor every step, so a step copies the whole cache and grows with past_len. This pass turns each decoder
self-attention into an attention op that writes the new key/value into the buffer in place and attends over
its filled part; the runtime binds one buffer as both past and present, so nothing is copied
(runtime/static_cache.py). Two layouts, by target, declared in the manifest's decoder_layout (the runtime feeds the
decoder by it, runtime/feed.py):

- per row ("static-per-row"; CPU, the default): com.microsoft.GroupQueryAttention (kv_num_heads = num_heads).
  past_sequence_length is int32 [B], each row's own filled length: row b writes its new key/value at slot
  past_sequence_length[b] of its buffer row and attends over slots 0..past_sequence_length[b]. Every slot a row
  attends holds its own token, so there is no key mask (`decoder_attention_mask` leaves the interface), rows of
  one batch may sit at different positions (in-flight batching, runtime/inflight.py), and each row pays only for
  its own length. It reads the packed Q/K/V projection (fusions/pack_matmul.py) whole, key and value left out, so
  the packing's Split goes (a node less a layer: a step's per-node cost counts on onnxruntime-web, RESULTS.md).
  onnxruntime's GroupQueryAttention takes head sizes that are multiples of 8 only: other models get the shared
  slot on CPU too (optimize says so in its notes).
- shared slot ("static-shared"; CUDA): com.microsoft.DecoderMaskedMultiHeadAttention with
  past_present_share_buffer=1 (CUDA's GroupQueryAttention takes float16/bfloat16 only, and static caches are
  float32). past_sequence_length is one int32 [1] for all rows; the per-row key mask reaches its mask_index.

Two rewriter rules, like the fusions (pattern, check, replacement, count), and a third once input_ids is [B, 1]
(OneTokenExpand, below):

    query key value causal_bias past_key past_value                 query key value past_key past_value
           \\          |         |         |        |                  \\      |       |      |       /
            MultiHeadAttention (com.microsoft, 3 outputs)     =>   DecoderMaskedMultiHeadAttention(past_sequence_length,
                 -> attention, present_key, present_value               past_present_share_buffer=1)

    past (a decoder self-attention past) -> Shape[start:end]   =>   the same dims, dim 2 = past_sequence_length

- positions: the graph read past_len from the past's shape (Shape(past)[2]); that now comes from the new
  `past_sequence_length` input (per row: its largest entry);
- the causal attention bias is dropped: with one new token every cached position is visible, which is what
  the bias said (the static graph takes exactly one token a step); shared slot: the per-row key mask
  (`decoder_attention_mask` [B, cache_len], 1 where a slot holds a real token of the row) goes to
  DecoderMaskedMultiHeadAttention's mask_index instead, cut to the filled slots plus this step's (int32
  [B, past_sequence_length + 1], as onnxruntime wants); per row: the mask is dropped (nothing to mask); the
  cross-attention bias [B, 1, 1, S] is no longer expanded to new_len rows (OneTokenExpand: new_len is 1 now);
  the per-row `position_ids` [B, 1] stay as exported (the positional table is read at them);
- T5's relative position bias (the fused attention_bias = the mask's bias + Transpose(Gather(table, k - q)),
  exporters/fusions/attention.py) is carried, not dropped: the step's bias row for each row's own position,
  table[slot - position_ids[b] + max_len - 1] over slots 0..total-1, [B, H, 1, total], gathered once per step
  from the [2 * max_len - 1, H] table the bundle carries and given to every layer's attention_bias (total: the
  longest row + 1 per row, past_sequence_length + 1 in the shared slot; slots past a row's own length are never
  attended, so nothing else is masked). Every slot holds its own row's token at its own position, so a key's
  position is its slot (the dynamic graph counted real keys in the mask for that). Counted as
  "static_relative_bias"; a relative bias not carried is refused;
- the caches' length axis becomes `cache_len`: the runtime sizes the buffer per request (the tokens it may
  generate, at most the model's max_len).
Parity with the dynamic graph is proved by optimize, as for every pass.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import (CommonSubexpressionEliminationPass, IdentityEliminationPass, RemoveUnusedNodesPass,
                                   TopologicalSortPass)
from onnxscript.rewriter import pattern

from exporters.passes import Reporting, RewritePass
from exporters.static_relative_bias import relative_table, step_bias
from runtime.errors import OnnxformerError
from runtime.spec import (BATCH, CACHE_LEN, DECODER_ATTENTION_MASK, INPUT_IDS, PAST, PAST_SEQUENCE_LENGTH, POSITION_IDS,
                          PRESENT, SELF, STATIC_PER_ROW, STATIC_SHARED, is_cache)

MS = "com.microsoft"
RANK = 4                                              # caches are [B, H, len, Dh]; dim 2 is the length


class StaticCacheError(OnnxformerError):
    """The decoder graph cannot take a static cache (e.g. its self-attention is not fused)."""


def _is_self_past(value: ir.Value | None) -> bool:
    return value is not None and value.is_graph_input() and is_cache(value.name, PAST, SELF)


def _past_sequence_length(value: ir.Value) -> ir.Value | None:
    """The graph's past_sequence_length input (StaticCachePass adds it before the rules run)."""
    return next((v for v in value.graph.inputs if v.name == PAST_SEQUENCE_LENGTH), None)


def _needs_static_input(result: pattern.MatchResult, past_key: ir.Value, past_value: ir.Value):
    if not (_is_self_past(past_key) and _is_self_past(past_value)):
        return result.fail("the past key/value are not the decoder's self-attention cache inputs", past_key)
    if _past_sequence_length(past_key) is None:
        return result.fail(f"the graph has no {PAST_SEQUENCE_LENGTH} input: run StaticCachePass, not the rules alone")
    return result


class StaticAttention(pattern.RewriteRuleClassBase):
    """Fused decoder self-attention with past/present -> DecoderMaskedMultiHeadAttention over a shared buffer."""

    def __init__(self):
        super().__init__("static_kv_cache")

    def pattern(self, op, query, key, value, causal_bias, past_key, past_value):
        # no projection bias, no key padding mask (our attention fusion emits neither; with one, nothing matches)
        return op.MultiHeadAttention(query, key, value, None, None, causal_bias, past_key, past_value, _domain=MS,
                                     _allow_other_attributes=True, _outputs=["attention", "present_key",
                                                                             "present_value"])

    def check(self, context, past_key, past_value, **_) -> pattern.MatchResult:
        return _needs_static_input(pattern.MatchResult(), past_key, past_value)

    def rewrite(self, op, query, key, value, causal_bias, past_key, past_value, attention, **_):
        fused = attention.producer()
        attributes = {"num_heads": fused.attributes.get_int("num_heads"), "past_present_share_buffer": 1}
        scale = fused.attributes.get_float("scale", None)
        if scale is not None:
            attributes["scale"] = scale
        filled = _past_sequence_length(past_key)
        one = op.Constant(value=ir.tensor(np.array([1], dtype=np.int32)))
        bias = step_bias(op, causal_bias, op.Add(filled, one))         # T5's; None for other models
        return op.DecoderMaskedMultiHeadAttention(query, key, value, _key_mask(op, past_key.graph, filled), bias,
                                                  past_key, past_value, filled, **attributes, _domain=MS, _outputs=3)


class PerRowStaticAttention(StaticAttention):
    """Fused decoder self-attention with past/present -> GroupQueryAttention: each row writes and attends at its own
    length (past_sequence_length [B]; GroupQueryAttention's seqlens_k is that length, the new token's slot)."""

    def rewrite(self, op, query, key, value, causal_bias, past_key, past_value, attention, **_):
        fused = attention.producer()
        heads = fused.attributes.get_int("num_heads")
        attributes = {"num_heads": heads, "kv_num_heads": heads}
        scale = fused.attributes.get_float("scale", None)
        if scale is not None:
            attributes["scale"] = scale
        lengths = _past_sequence_length(past_key)                                   # int32 [B]
        one = op.Constant(value=ir.tensor(np.array([1], dtype=np.int32)))
        total = op.Add(op.ReduceMax(lengths, keepdims=1), one)                     # the longest row + this step
        bias = step_bias(op, causal_bias, total)                         # T5's; None for other models
        packed = _packed_qkv(query, key, value)
        if packed is not None:             # the joined projection itself: its Split goes (one node less a layer)
            query, key, value = packed, None, None
        return op.GroupQueryAttention(query, key, value, past_key, past_value, lengths, total, None, None, None, bias,
                                      **attributes, _domain=MS, _outputs=3)


def _packed_qkv(query: ir.Value, key: ir.Value, value: ir.Value) -> ir.Value | None:
    """The packed Q/K/V projection (fusions/pack_matmul.py) that query, key and value are the three equal parts of,
    split on the last axis in that order and used by nothing else; GroupQueryAttention takes it whole as its query
    (packed QKV: key and value left out). None when they are anything else."""
    split = query.producer()
    if split is None or split.op_type != "Split" or split.domain != "" or len(split.outputs) != 3 \
            or list(split.outputs) != [query, key, value] or split.attributes.get_int("axis", 0) not in (-1, 2):
        return None
    sizes = split.inputs[1].const_value if len(split.inputs) > 1 and split.inputs[1] is not None else None
    if sizes is None or len(set(sizes.numpy().tolist())) != 1 or any(len(v.uses()) != 1 for v in split.outputs):
        return None
    return split.inputs[0]


def _key_mask(op, graph: ir.Graph, filled: ir.Value) -> ir.Value:
    """DecoderMaskedMultiHeadAttention's mask_index, int32 [B, past_sequence_length + 1]: the decoder_attention_mask's
    filled slots, then 1 for this step's token (onnxruntime checks that length; a mask over the whole buffer is
    refused). StaticCachePass checked that the graph takes the mask."""
    mask = next(v for v in graph.inputs if v.name == DECODER_ATTENTION_MASK)
    zero, one = (op.Constant(value=ir.tensor(np.array([i], dtype=np.int32))) for i in (0, 1))
    filled_part = op.Slice(op.Cast(mask, to=ir.DataType.INT32), zero, filled, one)               # [B, filled]
    end_pad = op.Constant(value=ir.tensor(np.array([0, 0, 0, 1], dtype=np.int64)))             # one slot at the end
    return op.Pad(filled_part, end_pad, op.Constant(value=ir.tensor(np.array(1, dtype=np.int32))))  # ... set to 1


class PastLengthFromInput(pattern.RewriteRuleClassBase):
    """Shape(past)[start:end] -> the same dims, with dim 2 (the filled length) read from past_sequence_length."""

    def __init__(self):
        super().__init__("past_len_from_input")

    def pattern(self, op, past):
        return op.Shape(past, _allow_other_attributes=True, _outputs=["dims"])

    def check(self, context, past, **_) -> pattern.MatchResult:
        return _needs_static_input(pattern.MatchResult(), past, past)

    def rewrite(self, op, past, dims, **_):
        node = dims.producer()
        start, end = (node.attributes.get_int(k, default) for k, default in (("start", 0), ("end", RANK)))
        start, end = (max(0, min(s + RANK if s < 0 else s, RANK)) for s in (start, end))
        parts = []
        if start < min(end, 2):
            parts.append(op.Shape(past, start=start, end=min(end, 2)))
        if start <= 2 < end:
            filled = _past_sequence_length(past)
            if filled.shape is not None and filled.shape[0] != 1:                 # per row: the longest row
                filled = op.ReduceMax(filled, keepdims=1)
            parts.append(op.Cast(filled, to=ir.DataType.INT64))
        if max(start, 3) < end:
            parts.append(op.Shape(past, start=max(start, 3), end=end))
        return parts[0] if len(parts) == 1 else op.Concat(*parts, axis=0)


def _static_ints(value: ir.Value | None) -> list[int] | None:
    """The ints a shape-valued tensor holds where the graph fixes them (a constant, a Shape over static dims, a
    Concat of those), else None."""
    if value is None:
        return None
    const = ir.convenience.get_const_tensor(value)
    if const is not None:
        return [int(x) for x in const.numpy().reshape(-1)]
    node = value.producer()
    if node is None or node.domain != "":
        return None
    if node.op_type == "Shape" and node.inputs[0].shape is not None:
        dims = list(node.inputs[0].shape)
        start, end = (node.attributes.get_int(k, default) for k, default in (("start", 0), ("end", len(dims))))
        part = dims[slice(start, end)]
        return part if all(isinstance(d, int) for d in part) else None
    if node.op_type == "Concat":
        parts = [_static_ints(v) for v in node.inputs]
        return None if any(p is None for p in parts) else [d for p in parts for d in p]
    return None


_SAME_RANK = {"Cast", "Not", "Neg", "Relu", "Sigmoid", "Identity"}
_BROADCAST = {"Where", "Add", "Sub", "Mul", "Div", "And", "Or", "Equal", "Less", "Greater", "LessOrEqual",
              "GreaterOrEqual"}


def _rank(value: ir.Value, depth: int = 8) -> int | None:
    """A value's rank: its shape's, else walked back through elementwise ops and Unsqueeze (the exporter leaves
    the mask's chain without shapes); None where unknown."""
    if value.shape is not None:
        return len(value.shape)
    const, node = ir.convenience.get_const_tensor(value), value.producer()
    if const is not None:
        return len(const.shape)
    if node is None or node.domain != "" or depth == 0:
        return None
    ranks = [_rank(v, depth - 1) if v is not None else None for v in node.inputs]
    if node.op_type in _SAME_RANK:
        return ranks[0]
    if node.op_type in _BROADCAST:
        return None if None in ranks else max(ranks)
    axes = _static_ints(node.inputs[1]) if node.op_type == "Unsqueeze" and len(node.inputs) > 1 else None
    return ranks[0] + len(axes) if axes is not None and ranks[0] is not None else None


class OneTokenExpand(pattern.RewriteRuleClassBase):
    """Expand(x, shape) by a shape of ones, no longer than x's rank -> x. The cross-attention bias [B, 1, 1, S] was
    expanded to [B, 1, new_len, S] with new_len read from input_ids; a static graph takes one token, so the shape
    is [1, 1, 1, 1] and the Expand (with its Shape and Concat) does nothing but cost a step three nodes."""

    def __init__(self):
        super().__init__("one_token_expand")

    def pattern(self, op, x, shape):
        return op.Expand(x, shape)

    def check(self, context, x, shape, **_) -> pattern.MatchResult:
        result, ones = pattern.MatchResult(), _static_ints(shape)
        if ones is None or any(d != 1 for d in ones):
            return result.fail("the Expand's shape is not all ones where the graph fixes it", shape)
        rank = _rank(x)
        if rank is None or rank < len(ones):
            return result.fail("the expanded value's rank is unknown or below the shape's length", x)
        return result

    def rewrite(self, op, x, **_):
        return op.Identity(x)


def static_cache_rules(per_row: bool = True) -> list[pattern.RewriteRule]:
    attention = PerRowStaticAttention() if per_row else StaticAttention()
    return [attention.rule(), PastLengthFromInput().rule()]


STATIC_ATTENTION_OPS = {True: "GroupQueryAttention", False: "DecoderMaskedMultiHeadAttention"}   # by per_row
RELATIVE_BIAS = "static_relative_bias"     # the count of static attentions carrying T5's relative position bias
GQA_HEAD_MULTIPLE = 8                                 # onnxruntime's GroupQueryAttention takes head sizes of 8k only


def per_row_for(target: str) -> bool:
    """Which layout a target's static cache gets: per row on CPU, the shared slot on CUDA (see the module doc)."""
    return target != "cuda"


class StaticCachePass(Reporting, ir.passes.InPlacePass):
    """The static-cache interface (past_sequence_length in, cache_len axes, one-token input_ids) and its rules.
    per_row: GroupQueryAttention with past_sequence_length [B] and no key mask; else the shared slot."""

    name = "static_kv_cache"

    def __init__(self, per_row: bool = True):
        super().__init__()
        self.asked_per_row = self.per_row = per_row                   # per_row: the layout the last model got
        self.note = None                                               # why the layout asked for was not given

    @property
    def layout(self) -> str:
        """The decoder layout the last model got (the manifest's decoder_layout)."""
        return STATIC_PER_ROW if self.per_row else STATIC_SHARED

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        pasts = [v for v in graph.inputs if is_cache(v.name, PAST, SELF)]
        if not pasts or any(v.name == PAST_SEQUENCE_LENGTH for v in graph.inputs):
            return ir.passes.PassResult(model, False)                  # an encoder, or already static
        missing = {POSITION_IDS, DECODER_ATTENTION_MASK} - {v.name for v in graph.inputs}
        if missing:
            raise StaticCacheError(f"the decoder takes no {', '.join(sorted(missing))}: it is not an onnxformer "
                                   f"export of this version; re-export the model (onnxformer export)")
        _refuse_unfused(pasts)
        head_size = pasts[0].shape[3] if pasts[0].shape is not None else None
        self.per_row = self.asked_per_row
        if self.per_row and not (isinstance(head_size, int) and head_size % GQA_HEAD_MULTIPLE == 0):
            self.per_row = False                                       # GroupQueryAttention refuses the head size
            self.note = (f"static KV cache: head size {head_size} is not a multiple of {GQA_HEAD_MULTIPLE} "
                         f"(GroupQueryAttention's requirement), so the cache keeps one shared length for all rows "
                         f"(DecoderMaskedMultiHeadAttention): requests batch request-level, not in-flight")
        model.opset_imports.setdefault(MS, 1)
        batch = pasts[0].shape[0] if pasts[0].shape is not None else BATCH
        graph.inputs.insert(2, ir.Value(name=PAST_SEQUENCE_LENGTH, type=ir.TensorType(ir.DataType.INT32),
                                        shape=ir.Shape([batch if self.per_row else 1])))  # after input_ids, the mask
        relative = _relative_biases(pasts)                             # T5: each layer's, to be carried
        rules = RewritePass(self.name, static_cache_rules(self.per_row))
        rules(model)
        self.counts[self.name] += rules.counts["static_kv_cache"]
        _refuse_leftovers(pasts)
        if relative:                                                   # counted where there is one (T5)
            self.counts[RELATIVE_BIAS] += _carried_biases(graph, relative)
        _static_shapes(graph, pasts)
        expand = RewritePass(self.name, [OneTokenExpand().rule()])     # input_ids is [B, 1] now
        expand(model)
        self.counts["one_token_expand"] += expand.counts["one_token_expand"]
        if expand.counts["one_token_expand"]:
            IdentityEliminationPass()(model)                           # the Identity that rule left
        CommonSubexpressionEliminationPass()(model)                    # one Cast of past_sequence_length
        RemoveUnusedNodesPass()(model)                                 # the causal-bias subgraph is dead now
        if self.per_row:                                               # nothing reads the key mask any more
            mask = next((v for v in graph.inputs if v.name == DECODER_ATTENTION_MASK), None)
            if mask is not None and not mask.uses():
                graph.inputs.remove(mask)
        TopologicalSortPass()(model)
        return ir.passes.PassResult(model, True)


_UNFUSED = ("the static KV cache needs the decoder's self-attention fused into MultiHeadAttention; optimize with "
            "--attention ort (the default) and without --no-fuse, or pass --kv-cache dynamic")


def _refuse_unfused(pasts: list[ir.Value]) -> None:
    """Before any change: the pasts may feed only fused attention and Shape nodes."""
    for v in pasts:
        for use in v.uses():
            node = use.node
            if not ((node.op_type == "MultiHeadAttention" and node.domain == MS) or
                    (node.op_type == "Shape" and node.domain == "")):
                raise StaticCacheError(f"{v.name} feeds a {node.op_type} node ({node.name}), not a fused "
                                       f"attention: {_UNFUSED}")


def _refuse_leftovers(pasts: list[ir.Value]) -> None:
    """After the rules: a past still read by anything but the new attention did not match (extra inputs)."""
    for v in pasts:
        for use in v.uses():
            if use.node.op_type not in STATIC_ATTENTION_OPS.values():
                raise StaticCacheError(f"self-attention {use.node.name} ({use.node.op_type}) uses a projection bias, "
                                       f"a key padding mask or extra inputs/outputs that the static cache does not "
                                       f"carry; pass --kv-cache dynamic")


def _relative_biases(pasts: list[ir.Value]) -> int:
    """How many fused self-attentions add a relative position bias (T5's) to their scores."""
    nodes = {use.node for v in pasts for use in v.uses() if use.node.op_type == "MultiHeadAttention"}
    return sum(relative_table(n.inputs[5] if len(n.inputs) > 5 else None) is not None for n in nodes)


def _carried_biases(graph: ir.Graph, expected: int) -> int:
    """After the rules: the static attentions given an attention_bias; every relative bias must be carried."""
    slot = {"GroupQueryAttention": 10, "DecoderMaskedMultiHeadAttention": 4}
    carried = sum(1 for n in graph if n.op_type in slot and len(n.inputs) > slot[n.op_type]
                  and n.inputs[slot[n.op_type]] is not None)
    if carried != expected:
        raise StaticCacheError(f"{expected} self-attentions add a relative position bias but the static cache "
                               f"carried {carried}: the bias is not built as exporters/fusions/attention.py builds "
                               f"it; re-export the model, or pass --kv-cache dynamic")
    return carried


def _static_shapes(graph: ir.Graph, pasts: list[ir.Value]) -> None:
    """The interface's new shapes: cache_len on the buffers (and the key mask), one token a step."""
    for v in pasts:
        v.shape = _with_len(v.shape, CACHE_LEN)
    for v in graph.inputs:                                         # the key mask covers the whole buffer
        if v.name == DECODER_ATTENTION_MASK and v.shape is not None:
            v.shape = ir.Shape([v.shape[0], CACHE_LEN])
    for v in graph.outputs:
        if is_cache(v.name, PRESENT, SELF):
            v.shape = _with_len(v.shape, CACHE_LEN)
        elif v.name == "logits" and v.shape is not None:
            v.shape = ir.Shape([v.shape[0], 1, *list(v.shape)[2:]])
    for ids in (v for v in graph.inputs if v.name in (INPUT_IDS, POSITION_IDS)):   # one token a step
        if ids.shape is not None:
            ids.shape = ir.Shape([ids.shape[0], 1])


def _with_len(shape: ir.Shape | None, length: str) -> ir.Shape | None:
    """[B, H, any, Dh] -> [B, H, length, Dh]."""
    if shape is None:
        return None
    dims = list(shape)
    dims[2] = length
    return ir.Shape(dims)


__all__ = ["StaticCachePass", "StaticCacheError", "StaticAttention", "PerRowStaticAttention", "PastLengthFromInput",
           "static_cache_rules", "STATIC_ATTENTION_OPS", "per_row_for"]
