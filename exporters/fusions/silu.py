"""SiLU (swish) fusion, for onnxruntime.

silu:   Mul(x, Sigmoid(x)) -> com.microsoft.QuickGelu(x, alpha=1.0)

QuickGelu computes x * Sigmoid(alpha * x), so alpha 1.0 is exactly SiLU (Marian's "swish"): one kernel instead of
two element-wise passes over the feed-forward's widest tensor. The standard ONNX target keeps Sigmoid and Mul
(opset 22's HardSwish is a different function).
"""

from __future__ import annotations

from onnxscript.rewriter import pattern


class SiluFusion(pattern.RewriteRuleClassBase):
    """x * Sigmoid(x) (either operand order) -> com.microsoft.QuickGelu(x, alpha=1.0)."""

    def pattern(self, op, x):
        return op.Mul(x, op.Sigmoid(x))

    def rewrite(self, op, x, **_):
        return op.QuickGelu(x, alpha=1.0, _domain="com.microsoft")


def silu_rules() -> list[pattern.RewriteRule]:
    return SiluFusion.rule("silu").commute()
