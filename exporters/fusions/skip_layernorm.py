"""Residual Add + LayerNormalization -> com.microsoft.SkipLayerNormalization.

      input [B,S,D] --(Add bias [D])--\
                                       Add (either order) = sum --> LayerNormalization(gamma, beta) --> out
      skip  [B,S,D] ------------------/       \
                                               \--> (pre-norm only) the next residual Add

Post-norm layers (LN(x + f(x))) use the sum only inside the LayerNorm: the fused node has one output.
Pre-norm layers (x + f(LN(x))) carry the sum on to the next residual: the fused node also returns it
(output 3, input_skip_bias_sum). The bias variant also absorbs the projection's bias Add. The simplified
variants do the same for RMSNorm (SimplifiedLayerNormalization, no beta) -> SkipSimplifiedLayerNormalization.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from exporters.fusions._common import require_dims


class SkipLayerNormFusion(pattern.RewriteRuleClassBase):
    """Add (+ optional projection bias) + LayerNormalization; `keep_sum` when the sum has other users."""

    def __init__(self, name: str, *, has_bias: bool, keep_sum: bool, simplified: bool = False):
        super().__init__(name)
        self.has_bias, self.keep_sum, self.simplified = has_bias, keep_sum, simplified

    def pattern(self, op, input, skip, gamma, beta, bias):
        if self.has_bias:
            input = op.Add(input, bias)
        total = pattern.OrValue([op.Add(skip, input), op.Add(input, skip)], name="total")
        if self.simplified:
            normed = op.SimplifiedLayerNormalization(total, gamma, _allow_other_attributes=True, _outputs=["normed"])
        else:
            normed = op.LayerNormalization(total, gamma, beta, _allow_other_attributes=True, _outputs=["normed"])
        return (normed, total) if self.keep_sum else normed

    def check(self, op, input, skip, gamma, beta, bias, normed, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        b: dict = {}
        if not (require_dims(result, b, input, ["B", "S", "D"], "input")
                and require_dims(result, b, skip, ["B", "S", "D"], "skip")
                and require_dims(result, b, gamma, ["D"], "gamma")
                and (self.simplified or require_dims(result, b, beta, ["D"], "beta"))
                and (not self.has_bias or require_dims(result, b, bias, ["D"], "bias"))):
            return result
        ln = normed.producer()
        if ln.attributes.get_int("axis", -1) not in (-1, 2):
            return result.fail("LayerNormalization must normalize the last axis only")
        if ln.attributes.get_int("stash_type", 1) != 1:
            return result.fail("LayerNormalization must compute its statistics in float32 (stash_type 1)")
        return result

    def rewrite(self, op, input, skip, gamma, beta, bias, normed, **_):
        epsilon = normed.producer().attributes.get_float("epsilon", 1e-5)
        fused = op.SkipSimplifiedLayerNormalization if self.simplified else op.SkipLayerNormalization
        inputs = (input, skip, gamma) + (() if self.simplified else (beta,)) + ((bias,) if self.has_bias else ())
        if not self.keep_sum:
            return fused(*inputs, epsilon=epsilon, _domain="com.microsoft")
        out, _mean, _inv_std, total = fused(*inputs, epsilon=epsilon, _domain="com.microsoft", _outputs=4)
        return out, total


def skip_layernorm_rules() -> list[pattern.RewriteRule]:
    """Bias variants before plain ones (they remove one more Add); post-norm (no sum output) before pre-norm;
    LayerNorm, then RMSNorm (simplified)."""
    return [SkipLayerNormFusion.rule(f"skip_{'simplified_' if simple else ''}layer_norm{'_bias' if bias else ''}"
                                     f"{'_sum' if keep else ''}", has_bias=bias, keep_sum=keep, simplified=simple)
            for simple in (False, True) for bias in (True, False) for keep in (False, True)]
