"""A LayerNorm spelled out in elementary ops -> ONNX LayerNormalization (opset 17+).

      x --> ReduceMean(-1) = mean
      x - mean = d --> Pow(d, 2) | d * d --> ReduceMean(-1) = var
      d / Sqrt(var + eps) --> * gamma --> (+ beta) --> out

The dynamo exporter already emits LayerNormalization for nn.LayerNorm; this rule serves graphs from
other exporters (and older opsets) so that SkipLayerNormalization can fuse after it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from exporters.fusions._common import require_dims, scalar


def _reduced_axes(node) -> list[int] | None:
    """The axes a ReduceMean reduces: its `axes` input (opset 18+) or attribute (older opsets)."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        const = ir.convenience.get_const_tensor(node.inputs[1])
        return None if const is None else [int(a) for a in np.asarray(const.numpy()).reshape(-1)]
    attr = node.attributes.get_ints("axes")
    return None if attr is None else list(attr)


class LayerNormFusion(pattern.RewriteRuleClassBase):
    """The decomposed LayerNorm over the last axis, with or without the shift `beta`."""

    def __init__(self, name: str, *, has_beta: bool):
        super().__init__(name)
        self.has_beta = has_beta

    def pattern(self, op, x, epsilon, gamma, beta, two):
        mean = op.ReduceMean(x, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["mean"])
        d = op.Sub(x, mean)
        square = pattern.OrValue([op.Pow(d, two), op.Mul(d, d)], tag_var="uses_pow", tag_values=[True, False])
        var = op.ReduceMean(square, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["var"])
        normed = op.Div(d, op.Sqrt(op.Add(var, epsilon)))
        out = op.Mul(normed, gamma)
        return op.Add(out, beta) if self.has_beta else out

    def check(self, op, x, epsilon, gamma, beta, two, mean, var, uses_pow, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        b: dict = {}
        if x.shape is None or x.shape.rank() < 1:
            return result.fail("input rank unknown", x)
        last = x.shape.rank() - 1
        if not (require_dims(result, b, x, ["_"] * last + ["D"], "input")
                and require_dims(result, b, gamma, ["D"], "gamma")
                and (not self.has_beta or require_dims(result, b, beta, ["D"], "beta"))):
            return result
        for node in (mean.producer(), var.producer()):
            if _reduced_axes(node) not in ([-1], [last]):
                return result.fail(f"ReduceMean must reduce the last axis only, not {_reduced_axes(node)}", node)
            if node.attributes.get_int("keepdims", 1) != 1:
                return result.fail("ReduceMean must keep dims", node)
        if uses_pow and scalar(two) != 2.0:
            return result.fail("Pow exponent is not 2", two)
        eps = scalar(epsilon)
        if eps is None or not 0 <= eps < 1e-2:
            return result.fail(f"epsilon {eps} is not a small non-negative constant", epsilon)
        self._epsilon = eps
        return result

    def rewrite(self, op, x, gamma, beta, **_):
        inputs = (x, gamma, beta) if self.has_beta else (x, gamma)
        return op.LayerNormalization(*inputs, axis=-1, epsilon=self._epsilon, stash_type=1)


def layernorm_rules() -> list[pattern.RewriteRule]:
    """With beta first (it removes one more node), then without."""
    return [LayerNormFusion.rule("layer_norm", has_beta=True),
            LayerNormFusion.rule("layer_norm_no_beta", has_beta=False)]
