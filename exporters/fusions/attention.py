"""Attention fusion: split heads, scaled scores, mask, softmax, weighted values, merged heads -> one node.

The matched subgraph (kind "self": encoder self-attention; "past": decoder self-attention with a KV cache;
"cross": decoder cross-attention over keys/values the encoder already split into heads):

      query [B,S,D]        key [B,Skv,D]              value [B,Skv,D]
         |                    |                          |
      Reshape              Reshape                    Reshape
         |                    |                          |
      Transpose(0213)      Transpose(0231)  "past":   Transpose(0213)
         |                    |           Transpose(0213)   |
         |                    |     past_key -> Concat(2) -> present_key / present_value
         |                    |                Transpose(0132)  |
         |                    |   "cross": key [B,H,Skv,Dh] -> Transpose(0132), value [B,H,Skv,Dh]
          \------ MatMul -----/                                 |
                    |                                           |
              Div (sqrt(Dh)) | Mul (1/sqrt(Dh))                  |
           ("unscaled": none; "biased": Add(., position_bias), T5)  |
                    |                                           |
      Where(not_mask, fill, .) | Add(., mask_bias) | none (Whisper's encoder)
                    |                                           |
                 Softmax(-1)                                    |
                    \--------------- MatMul --------------------/
                                       |
                               Transpose(0213), Reshape -> attention [B,S,D]

target "ort" replaces it with com.microsoft.MultiHeadAttention (3-D query/key/value, or 4-D precomputed
key/value for "cross"; past_key/past_value in, present_key/present_value out, so the graph's present outputs
come from the fused node). target "onnx" uses the standard ONNX Attention op (opset 23).
Both get an additive attention_bias [B or 1, 1, S, Skv] built from the shared mask: the mask variable is a
pattern input (the Not node feeds every layer and is never part of one match), and the bias nodes are the
same in every layer, so common-subexpression elimination keeps one copy per graph. T5's scores are not scaled
(scale 1.0) and its relative position bias [B or 1, H, S, Skv] (a pattern input, shared by every layer) is added to
the mask's bias: attention_bias [B, H, S, Skv].
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from exporters.fusions._common import MASK_FILL_LIMIT, constant, float_dtype, length_of, require_dims, scalar

KINDS = ("self", "past", "cross")
TARGETS = ("ort", "onnx")
MASKS = ("where", "add", "none")              # "none": no mask at all (Whisper's encoder attends to every frame)
SCORES = ("scaled", "unscaled", "biased")       # Div/Mul by a constant; neither (scale 1); T5's bias added, scale 1


class AttentionFusion(pattern.RewriteRuleClassBase):
    """One attention kind and mask form, fused for one target runtime."""

    def __init__(self, name: str, *, kind: str, target: str = "ort", mask: str = "where", scores: str = "scaled"):
        super().__init__(name)
        assert kind in KINDS and target in TARGETS and mask in MASKS and scores in SCORES
        self.kind, self.target, self.mask, self.scores = kind, target, mask, scores

    def pattern(self, op, query, key, value, past_key, past_value, q_shape, k_shape, v_shape, out_shape,
                scale, mask_cond, fill, mask_bias, position_bias):
        q = op.Transpose(op.Reshape(query, q_shape, _outputs=["q_heads"]), perm=[0, 2, 1, 3])  # [B,H,S,Dh]
        outputs = []
        if self.kind == "self":
            k_t = op.Transpose(op.Reshape(key, k_shape, _outputs=["k_heads"]), perm=[0, 2, 3, 1])  # [B,H,Dh,Skv]
            v = op.Transpose(op.Reshape(value, v_shape, _outputs=["v_heads"]), perm=[0, 2, 1, 3])
        elif self.kind == "past":
            k_new = op.Transpose(op.Reshape(key, k_shape, _outputs=["k_heads"]), perm=[0, 2, 1, 3])
            v_new = op.Transpose(op.Reshape(value, v_shape, _outputs=["v_heads"]), perm=[0, 2, 1, 3])
            present_key = op.Concat(past_key, k_new, _allow_other_attributes=True, _outputs=["present_key"])
            v = op.Concat(past_value, v_new, _allow_other_attributes=True, _outputs=["present_value"])
            k_t = op.Transpose(present_key, perm=[0, 1, 3, 2])
            outputs = [present_key, v]
        else:  # cross: key/value arrive split into heads, [B,H,Skv,Dh]
            k_t = op.Transpose(key, perm=[0, 1, 3, 2])
            v = value
        scores = op.MatMul(q, k_t)  # [B,H,S,Skv]
        if self.scores == "scaled":
            scaled = pattern.OrValue([op.Div(scores, scale), op.Mul(scores, scale)],
                                     tag_var="divide", tag_values=[True, False])
        else:
            scaled = scores if self.scores == "unscaled" else op.Add(scores, position_bias)
        if self.mask == "where":
            masked = pattern.OrValue([op.Where(mask_cond, fill, scaled), op.Where(mask_cond, scaled, fill)],
                                     tag_var="cond_masks_out", tag_values=[True, False])
        elif self.mask == "add":
            masked = op.Add(scaled, mask_bias)
        else:
            masked = scaled
        probs = op.Softmax(masked, _allow_other_attributes=True, _outputs=["probs"])
        context = op.MatMul(probs, v)  # [B,H,S,Dh]
        attention = op.Reshape(op.Transpose(context, perm=[0, 2, 1, 3]), out_shape, _outputs=["attention"])
        return (attention, *outputs) if outputs else attention

    def check(self, op, query, key, value, past_key, past_value, q_heads, attention, probs, scale=None, divide=None,
              position_bias=None, mask_cond=None, fill=None, mask_bias=None, present_key=None, present_value=None, k_heads=None,
              v_heads=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        b: dict = {}
        if not (require_dims(result, b, query, ["B", "S", "D"], "query")
                and require_dims(result, b, q_heads, ["B", "S", "H", "Dh"], "query heads")
                and require_dims(result, b, attention, ["B", "S", "D"], "attention output")):
            return result
        if not all(isinstance(b[d], int) for d in ("H", "Dh", "D")) or b["H"] * b["Dh"] != b["D"]:
            return result.fail(f"heads {b['H']} x head size {b['Dh']} must be fixed and equal width {b['D']}")
        if self.kind == "cross":
            if not (require_dims(result, b, key, ["B", "H", "Skv", "Dh"], "key")
                    and require_dims(result, b, value, ["B", "H", "Skv", "Dh"], "value")):
                return result
        else:
            if not (require_dims(result, b, k_heads, ["B", "Skv", "H", "Dh"], "key heads")
                    and require_dims(result, b, v_heads, ["B", "Skv", "H", "Dh"], "value heads")):
                return result
        if self.kind == "past":
            if not (require_dims(result, b, past_key, ["B", "H", "P", "Dh"], "past key")
                    and require_dims(result, b, past_value, ["B", "H", "P", "Dh"], "past value")):
                return result
            axes = {v.producer().attributes.get_int("axis") for v in (present_key, present_value)}
            if not axes <= {2, -2}:
                return result.fail(f"cache Concat must join on the sequence axis 2, not {sorted(axes)}")
        if probs.producer().attributes.get_int("axis", -1) not in (-1, 3):
            return result.fail("Softmax must run over the last (key) axis")
        if self.scores == "biased" and not require_dims(result, b, position_bias, ["_", "H", "_", "_"],
                                                         "position bias"):
            return result
        s = scalar(scale) if self.scores == "scaled" else 1.0
        if s is None or s == 0:
            return result.fail("the score scale is not a constant scalar", scale)
        self._scale = 1.0 / s if divide else s
        if float_dtype(query) is None:
            return result.fail("query has no known float type", query)
        if self.mask == "where":
            f = scalar(fill)
            if f is None or not f <= MASK_FILL_LIMIT:
                return result.fail(f"the masked fill value {f} is not a large negative constant", fill)
            if mask_cond.shape is None or mask_cond.shape.rank() > 4:
                return result.fail("the mask must have a known rank of at most 4", mask_cond)
        elif self.mask == "add" and not require_dims(result, b, mask_bias, ["_", "_", "_", "_"], "mask bias"):
            return result
        self._heads = b["H"]
        return result

    def rewrite(self, op, query, key, value, past_key, past_value, q_shape, out_shape, mask_cond=None,
                fill=None, mask_bias=None, cond_masks_out=True, position_bias=None, **_):
        bias = None if self.mask == "none" else self._bias(op, query, mask_cond, fill, mask_bias, cond_masks_out)
        if self.scores == "biased":                 # [B,1,S,Skv] + [B or 1,H,S,Skv]: one bias per head
            bias = position_bias if bias is None else op.Add(bias, position_bias)
        if self.target == "ort":
            return self._ort(op, query, key, value, past_key, past_value, bias)
        return self._onnx(op, query, key, value, past_key, past_value, bias, q_shape, out_shape)

    def _bias(self, op, query, mask_cond, fill, mask_bias, cond_masks_out) -> ir.Value:
        """Additive attention bias [B or 1, 1, S, Skv] in the graph's float type, expanded to the query length."""
        if self.mask == "where":
            zero = constant(op, np.zeros((), dtype=float_dtype(query)))      # the graph's float type
            bias = op.Where(mask_cond, fill, zero) if cond_masks_out else op.Where(mask_cond, zero, fill)
            source = mask_cond
        else:
            bias = source = mask_bias
        if source.shape is not None and source.shape.rank() == 4 and query.shape is not None \
                and source.shape[2] == query.shape[1] and source.shape[2] != 1:
            return bias  # already one row per query
        one = constant(op, np.array([1], dtype=np.int64))
        return op.Expand(bias, op.Concat(one, one, length_of(op, query, 1), one, axis=0))

    def _ort(self, op, query, key, value, past_key, past_value, bias):
        """com.microsoft.MultiHeadAttention: 3-D projections in (4-D precomputed K/V for cross-attention)."""
        past = self.kind == "past"
        return op.MultiHeadAttention(
            query, key, value, None, None, bias, past_key if past else None, past_value if past else None,
            num_heads=self._heads, scale=self._scale, _domain="com.microsoft", _outputs=3 if past else 1)

    def _onnx(self, op, query, key, value, past_key, past_value, bias, q_shape, out_shape):
        """ONNX Attention (opset 23): 3-D inputs for self-attention, 4-D for cross (3-D and 4-D cannot mix)."""
        if self.kind != "cross":
            past = self.kind == "past"
            return op.Attention(query, key, value, bias, past_key if past else None, past_value if past else None,
                                q_num_heads=self._heads, kv_num_heads=self._heads, scale=self._scale,
                                _outputs=3 if past else 1)
        q = op.Transpose(op.Reshape(query, q_shape), perm=[0, 2, 1, 3])
        context = op.Attention(q, key, value, bias, scale=self._scale)
        return op.Reshape(op.Transpose(context, perm=[0, 2, 1, 3]), out_shape)


def attention_rules(target: str = "ort") -> list[pattern.RewriteRule]:
    """All attention variants for one target: past (tried first), cross, then plain self-attention; scaled scores
    first, then T5's (unscaled, its relative position bias added)."""
    return [AttentionFusion.rule(f"attention_{kind}" + {"where": "", "add": "_additive_mask", "none": "_unmasked"}[mask]
                                 + ("" if scores == "scaled" else f"_{scores}"),
                                 kind=kind, target=target, mask=mask, scores=scores)
            for scores in SCORES for kind in ("past", "cross", "self") for mask in MASKS]
