"""GELU fusions.

erf_gelu:   x * 0.5 * (1 + Erf(x / sqrt(2)))  -> Gelu (opset 20+), or com.microsoft.Gelu for onnxruntime at opset < 20
bias_gelu (onnxruntime):   Add(x, bias [D]) -> Gelu(approximate="none") -> com.microsoft.BiasGelu(x, bias)
fast_gelu (onnxruntime):   Add(x, bias [D]) -> Gelu(approximate="tanh") -> com.microsoft.FastGelu(x, bias)

The feed-forward's first projection ends in a bias Add, so with GELU models every layer fuses once.
"""

from __future__ import annotations

import math

from onnxscript.rewriter import pattern

from exporters.fusions._common import require_dims, scalar


class ErfGeluFusion(pattern.RewriteRuleClassBase):
    """The exact GELU written with Erf -> Gelu: the ONNX op (opset 20+) or, for onnxruntime, com.microsoft.Gelu.

    grouping: "x_half" (x * 0.5) * cdf, "x_cdf" (x * cdf) * 0.5, "half_cdf" x * (0.5 * cdf) (torch's opset 18 form).
    """

    def __init__(self, name: str, *, grouping: str, domain: str = ""):
        super().__init__(name)
        self.grouping, self.domain = grouping, domain

    def pattern(self, op, x, root2, half, one):
        cdf = op.Add(op.Erf(op.Div(x, root2)), one)
        if self.grouping == "x_half":
            return op.Mul(op.Mul(x, half), cdf)
        if self.grouping == "x_cdf":
            return op.Mul(op.Mul(x, cdf), half)
        return op.Mul(x, op.Mul(half, cdf))

    def check(self, op, x, root2, half, one, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        values = {"sqrt(2)": (scalar(root2), math.sqrt(2)), "0.5": (scalar(half), 0.5), "1": (scalar(one), 1.0)}
        for what, (got, want) in values.items():
            if got is None or abs(got - want) > 1e-6 * want:
                return result.fail(f"constant {what} is {got}")
        return result

    def rewrite(self, op, x, **_):
        if self.domain:
            return op.Gelu(x, _domain=self.domain)
        return op.Gelu(x, approximate="none")


class BiasGeluFusion(pattern.RewriteRuleClassBase):
    """Projection bias + ONNX Gelu -> BiasGelu (exact) or FastGelu (tanh approximation), onnxruntime contrib ops."""

    def __init__(self, name: str, *, approximate: str, domain: str = ""):
        super().__init__(name)
        self.approximate, self.domain = approximate, domain

    def pattern(self, op, x, bias):
        summed = pattern.OrValue([op.Add(x, bias), op.Add(bias, x)], name="summed")
        return op.Gelu(summed, _domain=self.domain, _allow_other_attributes=True, _outputs=["gelu"])

    def check(self, op, x, bias, gelu, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        approximate = gelu.producer().attributes.get_string("approximate", "none")
        if approximate != self.approximate:
            return result.fail(f"Gelu approximate={approximate!r}, this rule fuses {self.approximate!r}")
        b: dict = {}
        if x.shape is None or x.shape.rank() < 1:
            return result.fail("input rank unknown", x)
        if not (require_dims(result, b, x, ["_"] * (x.shape.rank() - 1) + ["D"], "input")
                and require_dims(result, b, bias, ["D"], "bias")):
            return result
        if bias.const_value is None:
            return result.fail("bias is not a constant", bias)
        return result

    def rewrite(self, op, x, bias, **_):
        fused = "FastGelu" if self.approximate == "tanh" else "BiasGelu"
        return getattr(op, fused)(x, bias, _domain="com.microsoft")


def erf_gelu_rules(domain: str = "") -> list[pattern.RewriteRule]:
    """Every grouping, each with every operand order of its Add and Muls (RewriteRule.commute)."""
    return [variant for grouping in ("x_half", "x_cdf", "half_cdf")
            for variant in ErfGeluFusion.rule("erf_gelu", grouping=grouping, domain=domain).commute()]


def bias_gelu_rules() -> list[pattern.RewriteRule]:
    """Bias + exact GELU (the ONNX op or com.microsoft.Gelu) -> BiasGelu; bias + tanh GELU -> FastGelu."""
    return [BiasGeluFusion.rule("bias_gelu", approximate="none"),
            BiasGeluFusion.rule("bias_gelu", approximate="none", domain="com.microsoft"),
            BiasGeluFusion.rule("fast_gelu", approximate="tanh")]
