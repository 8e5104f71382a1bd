"""Fusion rules, one file each, written as onnxscript rewriter rules; `fusion_passes` orders them for a target.

    attention.py        split-head attention -> com.microsoft.MultiHeadAttention | ONNX Attention (opset 23)
    layernorm.py        decomposed LayerNorm -> LayerNormalization
    rms_norm.py         decomposed RMSNorm (T5) -> SimplifiedLayerNormalization
    skip_layernorm.py   residual Add + (Simplified)LayerNormalization -> com.microsoft.Skip(Simplified)LayerNormalization
    gelu.py             Erf-spelled GELU -> Gelu; bias Add + Gelu -> com.microsoft.BiasGelu / FastGelu
    silu.py             x * Sigmoid(x) -> com.microsoft.QuickGelu(alpha=1.0) (SiLU / swish, Marian's activation)
    pack_matmul.py      constant-weight MatMuls sharing an input (Q/K/V, cross K/V) -> one MatMul + Split
    transposed_weight.py  MatMul(x, Transpose(W)) -> MatMul(x, W^T): run before int8 quantization only

Target "ort" (onnxruntime) gets every rule; target "onnx" (other runtimes) only rules that emit standard ops.
"""

from __future__ import annotations

from exporters.fusions.attention import TARGETS as ATTENTION_TARGETS
from exporters.fusions.attention import AttentionFusion, attention_rules
from exporters.fusions.gelu import bias_gelu_rules, erf_gelu_rules
from exporters.fusions.layernorm import layernorm_rules
from exporters.fusions.pack_matmul import PackMatMulsPass
from exporters.fusions.int8_embedding import Int8EmbeddingPass
from exporters.fusions.rms_norm import rms_norm_rules
from exporters.fusions.silu import silu_rules
from exporters.fusions.skip_layernorm import skip_layernorm_rules
from exporters.fusions.transposed_weight import transposed_weight_rules
from exporters.passes import CleanupPass, OpsetPass, Reporting, RewritePass

ONNX_ATTENTION_OPSET = 23


def fusion_passes(attention: str = "ort", opset: int = 20) -> list[Reporting]:
    """The fusion passes for one attention target, in order; the manager repeats them until nothing changes."""
    if attention not in ATTENTION_TARGETS:
        raise ValueError(f"unknown attention target {attention!r}")
    passes: list[Reporting] = []
    if attention == "onnx":
        passes.append(OpsetPass(ONNX_ATTENTION_OPSET))
        opset = max(opset, ONNX_ATTENTION_OPSET)
    passes.append(RewritePass("fuse_attention", attention_rules(attention)))
    passes.append(RewritePass("fuse_layer_norm", layernorm_rules()))
    if attention == "ort":                          # SimplifiedLayerNormalization is onnxruntime's
        passes.append(RewritePass("fuse_rms_norm", rms_norm_rules()))
    # the ONNX Gelu op needs opset 20 (the onnx target is 23); below it, onnxruntime's own Gelu
    passes.append(RewritePass("fuse_erf_gelu", erf_gelu_rules("" if opset >= 20 else "com.microsoft")))
    if attention == "ort":
        passes.append(RewritePass("fuse_skip_layer_norm", skip_layernorm_rules()))
        passes.append(RewritePass("fuse_bias_gelu", bias_gelu_rules()))
        passes.append(RewritePass("fuse_silu", silu_rules()))
    passes.append(PackMatMulsPass())
    passes.append(CleanupPass())
    return passes


def quantization_prepasses(tied_projection: bool = True, weight_bits: int = 8) -> list[Reporting]:
    """Before int8/int4 quantization: give every constant MatMul weight an initializer of its own, then 8-bit
    embedding tables (the tied projection reads the same int8 matrix, unless tied_projection is False; weight_bits
    7: values within the 7-bit range)."""
    return [RewritePass("fold_transposed_weights", transposed_weight_rules()),
            Int8EmbeddingPass(tied_projection, weight_bits), CleanupPass()]


__all__ = ["AttentionFusion", "PackMatMulsPass", "attention_rules", "layernorm_rules", "skip_layernorm_rules", "rms_norm_rules",
           "erf_gelu_rules", "bias_gelu_rules", "silu_rules", "transposed_weight_rules", "fusion_passes", "quantization_prepasses",
           "ATTENTION_TARGETS"]
