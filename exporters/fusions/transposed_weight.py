"""MatMul(x, Transpose(W)) with a constant W -> MatMul(x, W^T stored as its own initializer).

      embedding W [V,D] --> Gather (token lookup)
                    \\--> Transpose --> MatMul(x [B,T,D], W^T [D,V]) --> logits     (tied output projection)

The exporter keeps one copy of a tied embedding and transposes it at run time. ONNX Runtime folds that
Transpose when it loads the graph, but the int8 quantizer sees a MatMul whose weight is not an initializer
and leaves it in float32: for the base model that is the largest matrix (16 MB of ~40 MB read per step).
This rule runs before quantization only; fp32 bundles stay without the duplicate.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern


class TransposedWeightFold(pattern.RewriteRuleClassBase):
    """Store a transposed constant matrix feeding a MatMul as its own initializer."""

    def pattern(self, op, x, weight):
        return op.MatMul(x, op.Transpose(weight, _allow_other_attributes=True, _outputs=["transposed"]))

    def check(self, op, x, weight, transposed, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if weight.const_value is None or weight.shape is None or weight.shape.rank() != 2:
            return result.fail("the transposed operand is not a constant matrix", weight)
        perm = transposed.producer().attributes.get_ints("perm", [1, 0])
        if list(perm) != [1, 0]:
            return result.fail(f"Transpose perm {list(perm)} is not [1, 0]")
        return result

    def rewrite(self, op, x, weight, **_):
        array = np.ascontiguousarray(weight.const_value.numpy().T)
        return op.MatMul(x, op.initializer(ir.tensor(array), name=f"{weight.name}.T"))


def transposed_weight_rules() -> list[pattern.RewriteRule]:
    return [TransposedWeightFold.rule("transposed_weight")]
