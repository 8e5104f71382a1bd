"""Precision passes, run once after fusion: fp16 for CUDA, int8 dynamic quantization and int4 weight-only for CPU.

fp16 (onnxruntime.transformers.float16): weights and activations in float16 inside the graph; graph inputs and
outputs stay float32 (keep_io_types adds Casts at the boundary), so the runtime and the manifest's interface do
not change. ORT's default block list keeps ops without float16 kernels (Range, CumSum, TopK, ...) in float32;
LayerNormalization / SkipLayerNormalization / Softmax / MultiHeadAttention accumulate in float32 inside their
CUDA kernels, so they need no blocking. Constants the fusion passes created (the attention bias fill and zero)
follow the graph's float type and are converted with it. T5's feed-forward output projections stay float32
(fp16_keep_float: their activations overflow float16).

int8 (onnxruntime.quantization.quantize_dynamic's graph, made a weight at a time by exporters/int8_weights): MatMul
weights only (op_types_to_quantize=["MatMul"]: quantizing the ONNX Attention op would turn it into QAttention,
which no longer loads), int8 weights with one scale per tensor or per output channel (optimize chooses: per tensor is faster, per channel follows
each output column's range; RESULTS.md, "int8 activation scales" and "int8 numerics"), activations quantized at run time: one range per MatMul input tensor (onnxruntime's
dynamic quantization, so a row's rounding depends on the rest of its batch), or, with activation_scales
"per-row", one per token row (exporters/row_activations; slower: RESULTS.md, "int8 activation scales"). Packed
weights (Q/K/V of a layer, the cross K/V of all decoder layers, exporters/fusions/pack_matmul) always get
per-channel scales: one scale for matrices of different ranges is the error per-channel scales exist for.
MatMuls between two activations (unfused attention scores) are left in float (MatMulConstBOnly).

7-bit weights (reduce_range): off by default, because on a VNNI CPU, where 8-bit products cannot saturate, they
raise the teacher-forced logits error on every variant measured (benchmarks/studies/int8_numerics.py, RESULTS.md
"int8 numerics"). On x86 CPUs without VNNI ONNX Runtime's u8 x s8 kernel adds product pairs in int16 and saturates
with 8-bit weights (runtime.session.int8_saturates; RESULTS.md "int8 on CPUs without VNNI": an earlier study under
qemu's Haswell emulation did not show it, real AVX2 hardware does); there optimize's --weight-bits auto chooses 7 bits
(exporters/int8_recipes.resolve_weight_bits), whose results are exact on every CPU.

The weights are symmetric, so their zero points are all 0: they are left out of the graph (the input is optional,
0 by default: the same bits; exporters/int8_weights.drop_zero_points).
"""

from __future__ import annotations

import onnx_ir as ir

from exporters.int8_weights import drop_zero_points, quantize_matmul_weights
from exporters.passes import ConvertInPlacePass, ConvertPass
from exporters.row_activations import per_row_activations


def to_fp16(model: ir.Model, keep_float: tuple[str, ...] = ()) -> ir.Model:
    """A float16 copy of the model with float32 graph inputs and outputs; keep_float: nodes (by name) left in
    float32, Casts around them."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    proto = ir.to_proto(model)
    converted = convert_float_to_float16(proto, keep_io_types=True, op_block_list=list(DEFAULT_OP_BLOCK_LIST),
                                         node_block_list=list(keep_float))
    return ir.from_proto(converted)


FFN_OUTPUT = ".ffn.w_2"             # the feed-forward output projection's module (T5's `wo`)
NAME_SCOPES = "pkg.torch.onnx.name_scopes"


def fp16_keep_float(config: dict, model: ir.Model) -> tuple[str, ...]:
    """The MatMuls an fp16 graph keeps in float32: for T5 (a relative position bias) the feed-forward output
    projections, whose activations overflow float16 (transformers keeps T5's `wo` in float32 for the same reason);
    found by the exporter's module scope. None for other models."""
    if not config.get("relative_buckets"):
        return ()
    return tuple(n.name for n in model.graph if n.op_type == "MatMul" and n.name
                 and f"{FFN_OUTPUT}'" in n.metadata_props.get(NAME_SCOPES, ""))


PACKED = ".packed.weight"           # the joined weights of exporters/fusions/pack_matmul (Q/K/V, cross K/V of all layers)


def to_int8(model: ir.Model, per_channel: bool = True, reduce_range: bool = False,
            packed_per_channel: bool = True, keep_float: tuple[str, ...] = ()) -> ir.Model:
    """The model with its MatMul weights quantized to int8 (dynamic quantization of activations), in place
    (exporters/int8_weights: onnxruntime's quantize_dynamic graph, a weight at a time).

    per_channel False still gives packed weights one scale per output channel (packed_per_channel): Q, K and V
    of a layer, and the cross-attention K/V of every decoder layer, joined into one matrix have different
    ranges, and one scale for all of them rounds the narrow ones away. The other weights keep one scale per
    tensor (faster). reduce_range: 7-bit weights (see the module docstring for why it is off). keep_float: names
    of MatMuls left in float32."""
    keep = set(keep_float)

    def scales(node: ir.Node) -> bool | None:
        if node.name in keep:
            return None
        packed = (node.inputs[1].name or "").endswith(PACKED)
        return True if per_channel or (packed and packed_per_channel) else False

    for i, node in enumerate(model.graph):                       # names the new nodes are named after
        if node.op_type == "MatMul" and not node.name:
            node.name = f"MatMul_{i}"
    quantize_matmul_weights(model, scales, reduce_range)
    return model


INT4_BLOCK = 32          # weights per scale along K (the quantizer's default)
INT8_BLOCK = 128         # 8-bit blocks: faster than 32 at batch 1 (RESULTS.md, "The NLLB-600M and BART-base shapes")


def to_int4(model: ir.Model, block_size: int = INT4_BLOCK) -> ir.Model:
    """A copy with MatMul weights in 4-bit blocks (com.microsoft.MatMulNBits): to_blocks with 4 bits."""
    return to_blocks(model, 4, block_size)


def to_blocks(model: ir.Model, bits: int, block_size: int) -> ir.Model:
    """A copy with MatMul weights in `bits`-bit blocks (com.microsoft.MatMulNBits), made by onnxruntime's own
    quantizer.

    Weight-only: symmetric blocks of `block_size` weights along K with one float scale each; accuracy_level 4 lets
    MLAS quantize activations to int8 inside the kernel, each row's blocks on their own (its fast path on x86 and
    ARM): a row's result does not depend on its batch neighbours. The int8 embedding pass ran before, so the token
    lookups and the tied projection stay 8-bit (DynamicQuantizeMatMul is not a MatMul)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(ir.to_proto(model), bits=bits, block_size=block_size, is_symmetric=True,
                                     accuracy_level=4, op_types_to_quantize=("MatMul",))
    quantizer.process()
    return ir.from_proto(quantizer.model.model)


def _without_zero_points(model: ir.Model) -> ir.Model:
    drop_zero_points(model)
    return model


def precision_pass(precision: str, per_channel: bool = True, activation_scales: str = "per-tensor",
                   keep_float: tuple[str, ...] = (),
                   reduce_range: bool = False) -> ConvertPass | ConvertInPlacePass | None:
    """The pass for a precision (None for fp32). int8 activation_scales "per-row": each token row gets its own
    activation range (exporters/row_activations), so a row's result does not depend on its batch neighbours;
    keep_float: MatMuls (by name) left in float32 (fp16: exporters.precision.fp16_keep_float)."""
    if precision == "fp16":
        return ConvertPass("float16", lambda model: to_fp16(model, keep_float))
    if precision == "int8":
        rows = per_row_activations if activation_scales == "per-row" else (lambda model: model)
        return ConvertInPlacePass("quantize_int8", lambda model: _without_zero_points(rows(
            to_int8(model, per_channel, reduce_range, keep_float=keep_float))))
    if precision == "int4":
        return ConvertPass("quantize_int4", to_int4)
    if precision == "fp32":
        return None
    raise ValueError(f"unknown precision {precision!r}")
