"""RMSNorm spelled out in elementary ops (T5's T5LayerNorm) -> SimplifiedLayerNormalization (onnxruntime's).

      x --> Pow(x, 2) | x * x --> ReduceMean(-1) = var
      x * Reciprocal(Sqrt(var + eps)) --> * gamma --> out          (Muls in either order)

No mean is subtracted and there is no shift. SkipSimplifiedLayerNormalization then absorbs the residual Add
before it (exporters/fusions/skip_layernorm, simplified rules).
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from exporters.fusions._common import require_dims, scalar
from exporters.fusions.layernorm import _reduced_axes


class RMSNormFusion(pattern.RewriteRuleClassBase):
    """x / sqrt(mean(x^2) + eps) * gamma over the last axis; gamma_first: the gain is the last Mul's first input."""

    def __init__(self, name: str, *, gamma_first: bool):
        super().__init__(name)
        self.gamma_first = gamma_first

    def pattern(self, op, x, epsilon, gamma, two):
        square = pattern.OrValue([op.Pow(x, two), op.Mul(x, x)], tag_var="uses_pow", tag_values=[True, False])
        var = op.ReduceMean(square, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["var"])
        inv = op.Reciprocal(op.Sqrt(op.Add(var, epsilon)))
        normed = pattern.OrValue([op.Mul(x, inv), op.Mul(inv, x)])
        return op.Mul(gamma, normed) if self.gamma_first else op.Mul(normed, gamma)

    def check(self, op, x, epsilon, gamma, two, var, uses_pow, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        b: dict = {}
        if x.shape is None or x.shape.rank() < 1:
            return result.fail("input rank unknown", x)
        last = x.shape.rank() - 1
        if not (require_dims(result, b, x, ["_"] * last + ["D"], "input")
                and require_dims(result, b, gamma, ["D"], "gamma")):
            return result
        node = var.producer()
        if _reduced_axes(node) not in ([-1], [last]) or node.attributes.get_int("keepdims", 1) != 1:
            return result.fail("ReduceMean must reduce the last axis only, keeping dims", node)
        if uses_pow and scalar(two) != 2.0:
            return result.fail("Pow exponent is not 2", two)
        eps = scalar(epsilon)
        if eps is None or not 0 <= eps < 1e-2:
            return result.fail(f"epsilon {eps} is not a small non-negative constant", epsilon)
        self._epsilon = eps
        return result

    def rewrite(self, op, x, gamma, **_):
        return op.SimplifiedLayerNormalization(x, gamma, axis=-1, epsilon=self._epsilon, stash_type=1)


def rms_norm_rules() -> list[pattern.RewriteRule]:
    """The gain's Mul in either order (PyTorch's T5LayerNorm and ours: weight * x)."""
    return [RMSNormFusion.rule("rms_norm", gamma_first=True), RMSNormFusion.rule("rms_norm_gain_last",
                                                                                gamma_first=False)]
