"""T5's relative position bias in a static decoder step (exporters/static_cache.py carries it): find the offset
table a fused self-attention's attention_bias reads, and build the step's bias row for each row's own position.

    dynamic:  attention_bias = mask bias + Transpose(Gather(table, k - q))      [B, H, S, T]
    static:   attention_bias = Gather(table, slot - position_ids[b] + max_len - 1)   [B, H, 1, total]
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from runtime.spec import POSITION_IDS


def relative_table(bias: ir.Value | None) -> ir.Value | None:
    """T5's offset table [2 * max_len - 1, H] (an initializer) when a fused self-attention's attention_bias is the
    mask's bias plus the relative position bias, Add(mask bias, Transpose(Gather(table, offsets), 0 3 1 2)), as
    exporters/fusions/attention.py builds it; else None."""
    node = None if bias is None else bias.producer()
    if node is None or node.op_type != "Add":
        return None
    for side in node.inputs:
        permute = None if side is None else side.producer()
        if permute is None or permute.op_type != "Transpose" or \
                tuple(permute.attributes.get_ints("perm", ())) != (0, 3, 1, 2):
            continue
        gather = permute.inputs[0].producer()
        table = None if gather is None or gather.op_type not in ("Gather", "GatherND") else gather.inputs[0]
        if table is not None and table.const_value is not None and len(table.const_value.shape) == 2 \
                and table.const_value.shape[0] % 2 == 1:
            return table
    return None


def step_bias(op, causal_bias: ir.Value, total: ir.Value) -> ir.Value | None:
    """The static attention's attention_bias: None where the fused one was the causal/key mask alone (dropped, see
    the module doc); T5's relative position bias [B, H, 1, total] for one new token a row, row b's query at
    position_ids[b] over key slots 0..total-1 (total int32 [1]). In a static cache slot j holds the row's token at
    position j, so the offset k - q is j - position_ids[b]: row j - q + max_len - 1 of the table (clipped; the slots
    past a row's own length lie beyond its seqlens_k, never attended). Built once per step: every layer's rewrite
    builds the same nodes, and StaticCachePass's common-subexpression elimination keeps one copy."""
    table = relative_table(causal_bias)
    if table is None:
        return None
    positions = next(v for v in causal_bias.graph.inputs if v.name == POSITION_IDS)          # int64 [B, 1]
    reach = (table.const_value.shape[0] - 1) // 2                                             # max_len - 1

    def int64(x):
        return op.Constant(value=ir.tensor(np.array(x, dtype=np.int64)))
    keys = op.Range(int64(0), op.Squeeze(op.Cast(total, to=ir.DataType.INT64), int64([0])), int64(1))  # [total]
    offsets = op.Sub(op.Unsqueeze(keys, int64([0])), positions)                              # [B, total]: k - q
    rows = op.Clip(op.Add(offsets, int64(reach)), int64(0), int64(2 * reach))
    bias = op.Gather(table, rows, axis=0)                                                     # [B, total, H]
    return op.Unsqueeze(op.Transpose(bias, perm=[0, 2, 1]), int64([2]))                      # [B, H, 1, total]
