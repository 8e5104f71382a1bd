"""Each fusion rule on a small graph of its own: it fires the expected number of times, and the numbers
before and after agree on ONNX Runtime with ORT's own graph optimizations turned off."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from exporters.fusions import (PackMatMulsPass, attention_rules, bias_gelu_rules, erf_gelu_rules, fusion_passes,
                               layernorm_rules, quantization_prepasses, silu_rules, skip_layernorm_rules)
from exporters.passes import CleanupPass, OpsetPass, Reporting, RewritePass, explain_misses, run_passes

FILL = float(np.finfo(np.float32).min)   # what torch's masked_fill writes
ATOL = 1e-5                              # fused kernels reorder float sums; values are O(1)


class Builder:
    """A tiny onnx.helper graph builder: every op call returns its output name(s)."""

    def __init__(self, seed: int = 0):
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self.rng = np.random.default_rng(seed)
        self.count = 0

    def name(self, prefix: str = "t") -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def input(self, name, shape, dtype=TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def output(self, name, shape=None, dtype=TensorProto.FLOAT) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, dtype, shape))

    def const(self, array) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, *shape, scale: float = 0.5) -> str:
        return self.const((self.rng.standard_normal(shape) * scale).astype(np.float32))

    def op(self, op_type, *inputs, outputs=1, out=None, domain="", **attrs):
        names = [out] if out else [self.name() for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, domain=domain, **attrs))
        return names[0] if outputs == 1 else names

    def model(self, opset: int = 20) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "test", self.inputs, self.outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """Run with ORT's own graph optimizations off, so only our rewrite differs."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def fuse(model: onnx.ModelProto, passes: list[Reporting]) -> tuple[onnx.ModelProto, dict, Counter]:
    result = run_passes(passes, ir.from_proto(model))
    proto = ir.to_proto(result.model)
    onnx.checker.check_model(proto)
    ops = Counter(n.op_type for n in proto.graph.node)
    return proto, result.counts, ops


def assert_same(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict) -> None:
    expected, got = run(before, feeds), run(after, feeds)
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert e.shape == g.shape
        np.testing.assert_allclose(g, e, rtol=0, atol=ATOL)
    assert any(np.std(e) > 1e-3 for e in expected), "reference outputs do not vary"


# ------------------------------------------------------------------------------------------ attention

H, DH = 2, 4
D = H * DH


def attention_model(kind: str, layers: int = 2, mask: str = "where", scale_op: str = "Div",
                    cond_masks_out: bool = True) -> onnx.ModelProto:
    """`layers` attention blocks as the dynamo exporter writes them, sharing one mask (and its Not) across layers."""
    g = Builder()
    x = g.input("x", ["batch", "seq", D])
    kv_len = {"self": "seq", "past": "total", "cross": "src"}[kind]
    if mask == "add":
        shared = g.input("bias", ["batch", 1, 1, kv_len])
    elif kind == "past":          # causal mask [1, 1, seq, past + seq], True = may attend
        causal = g.input("causal", [1, 1, "seq", "total"], TensorProto.BOOL)
        shared = g.op("Not", causal) if cond_masks_out else causal
    else:                         # padding mask [batch, kv_len] of 1/0 -> [batch, 1, 1, kv_len]
        keep = g.op("Unsqueeze", g.op("Cast", g.input("mask", ["batch", kv_len], TensorProto.INT64),
                                      to=TensorProto.BOOL), g.const(np.array([1, 2], np.int64)))
        shared = g.op("Not", keep) if cond_masks_out else keep
    split, merge = g.const(np.array([0, 0, H, DH], np.int64)), g.const(np.array([0, 0, D], np.int64))
    scale = g.const(np.float32(np.sqrt(DH) if scale_op == "Div" else 1 / np.sqrt(DH)))
    fill = g.const(np.float32(FILL))

    def project(h):
        return g.op("Add", g.op("MatMul", h, g.weight(D, D)), g.weight(D, scale=0.1))

    def heads(h, perm=(0, 2, 1, 3)):
        return g.op("Transpose", g.op("Reshape", h, split), perm=list(perm))

    for i in range(layers):
        q = heads(project(x))
        if kind == "self":
            k_t, v = heads(project(x), (0, 2, 3, 1)), heads(project(x))
        elif kind == "past":
            past_k = g.input(f"past_key.{i}", ["batch", H, "past", DH])
            past_v = g.input(f"past_value.{i}", ["batch", H, "past", DH])
            k = g.op("Concat", past_k, heads(project(x)), axis=2, out=f"present_key.{i}")
            v = g.op("Concat", past_v, heads(project(x)), axis=2, out=f"present_value.{i}")
            g.output(k), g.output(v)
            k_t = g.op("Transpose", k, perm=[0, 1, 3, 2])
        else:
            k_t = g.op("Transpose", g.input(f"key.{i}", ["batch", H, "src", DH]), perm=[0, 1, 3, 2])
            v = g.input(f"value.{i}", ["batch", H, "src", DH])
        scores = g.op(scale_op, g.op("MatMul", q, k_t), scale)
        if mask == "add":
            masked = g.op("Add", scores, shared)
        else:
            masked = g.op("Where", shared, fill, scores) if cond_masks_out else g.op("Where", shared, scores, fill)
        context = g.op("MatMul", g.op("Softmax", masked, axis=-1), v)
        merged = g.op("Reshape", g.op("Transpose", context, perm=[0, 2, 1, 3]), merge)
        x = g.op("Add", g.op("MatMul", merged, g.weight(D, D)), x)
    g.output(g.op("Identity", x, out="y"))
    return g.model()


def attention_feeds(kind: str, mask: str = "where", past: int = 3, batch: int = 3, seq: int = 4, src: int = 5,
                    layers: int = 2, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((batch, seq, D)).astype(np.float32)}
    kv_len = {"self": seq, "past": past + seq, "cross": src}[kind]
    keep = np.ones((batch, kv_len), bool)
    if kind == "past":
        keep = np.arange(kv_len)[None, :] <= past + np.arange(seq)[:, None]      # [seq, kv_len]
        feeds["causal"] = keep[None, None]
    else:
        keep[1, -2:] = False                                                    # padded rows
        keep[2, 1:] = False
        feeds["mask"] = keep.astype(np.int64)
    if mask == "add":          # the same mask as an additive float bias [batch, 1, 1, kv_len] (self/cross only)
        feeds.pop("mask")
        feeds["bias"] = np.where(keep, 0.0, -1e9).astype(np.float32)[:, None, None, :]
    for i in range(layers):
        if kind == "past":
            feeds[f"past_key.{i}"] = rng.standard_normal((batch, H, past, DH)).astype(np.float32)
            feeds[f"past_value.{i}"] = rng.standard_normal((batch, H, past, DH)).astype(np.float32)
        if kind == "cross":
            feeds[f"key.{i}"] = rng.standard_normal((batch, H, src, DH)).astype(np.float32)
            feeds[f"value.{i}"] = rng.standard_normal((batch, H, src, DH)).astype(np.float32)
    return feeds


def attention_passes(target: str = "ort") -> list[Pass]:
    opset = [OpsetPass(23)] if target == "onnx" else []
    return opset + [RewritePass("fuse_attention", attention_rules(target)), CleanupPass()]


@pytest.mark.parametrize("kind", ["self", "past", "cross"])
def test_attention_fuses_into_multihead_attention(kind):
    model = attention_model(kind, layers=2)
    fused, counts, ops = fuse(model, attention_passes())
    assert counts[f"attention_{kind}"] == 2 and sum(counts.values()) == 2
    assert ops["MultiHeadAttention"] == 2
    assert "Softmax" not in ops and ops["Transpose"] == 0
    assert ops["MatMul"] == 2 * (2 if kind == "cross" else 4)      # projections only: scores and context are fused
    assert ops["Where"] == 1, "the mask -> bias conversion must be computed once and shared by the layers"
    assert ops["Expand"] <= 1
    for past in ([0, 3] if kind == "past" else [0]):
        assert_same(model, fused, attention_feeds(kind, past=past))


@pytest.mark.parametrize("kind", ["self", "past", "cross"])
def test_attention_fuses_into_onnx_attention(kind):
    model = attention_model(kind, layers=2)
    fused, counts, ops = fuse(model, attention_passes("onnx"))
    assert counts[f"attention_{kind}"] == 2
    assert ops["Attention"] == 2 and "Softmax" not in ops and "MultiHeadAttention" not in ops
    assert {o.domain for o in fused.opset_import} == {""} and fused.opset_import[0].version == 23
    for past in ([0, 3] if kind == "past" else [0]):
        assert_same(model, fused, attention_feeds(kind, past=past))


def test_present_outputs_come_from_the_fused_node():
    fused, _, _ = fuse(attention_model("past", layers=2), attention_passes())
    producers = {o: n for n in fused.graph.node for o in n.output}
    for i in range(2):
        for j, kv in ((1, "key"), (2, "value")):
            node = producers[f"present_{kv}.{i}"]
            assert node.op_type == "MultiHeadAttention" and list(node.output).index(f"present_{kv}.{i}") == j


@pytest.mark.parametrize("scale_op,cond_masks_out", [("Mul", True), ("Div", False)])
def test_attention_variants_scale_and_mask_polarity(scale_op, cond_masks_out):
    model = attention_model("self", layers=3, scale_op=scale_op, cond_masks_out=cond_masks_out)
    fused, counts, ops = fuse(model, attention_passes())
    assert counts["attention_self"] == 3 and ops["MultiHeadAttention"] == 3
    assert_same(model, fused, attention_feeds("self", layers=3))


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_attention_with_additive_mask(kind):
    model = attention_model(kind, layers=2, mask="add")
    fused, counts, ops = fuse(model, attention_passes())
    assert counts[f"attention_{kind}_additive_mask"] == 2 and ops["MultiHeadAttention"] == 2
    assert_same(model, fused, attention_feeds(kind, mask="add"))


def test_attention_not_fused_when_fill_does_not_mask_and_the_tracer_says_why():
    model = attention_model("self", layers=1)
    for init in model.graph.initializer:            # masked_fill with 0.0 is not masking: must not fuse
        if init.dims == [] and numpy_helper.to_array(init) == np.float32(FILL):
            init.CopyFrom(numpy_helper.from_array(np.float32(0.0), init.name))
    fused, counts, ops = fuse(model, attention_passes())
    assert sum(counts.values()) == 0 and "MultiHeadAttention" not in ops and ops["Softmax"] == 1
    reasons = explain_misses(ir.from_proto(model), attention_rules("ort"))
    assert "fill value" in reasons["attention_self"]


def test_attention_not_fused_with_non_constant_scale():
    model = attention_model("self", layers=1)
    model.graph.input.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, []))
    for node in model.graph.node:
        if node.op_type == "Div":
            node.input[1] = "s"                        # the score scale becomes a graph input
    _, counts, ops = fuse(model, attention_passes())
    assert sum(counts.values()) == 0 and ops["Softmax"] == 1
    assert "scale is not a constant" in explain_misses(ir.from_proto(model), attention_rules("ort"))["attention_self"]


# ------------------------------------------------------------------------------------------ layer norms

def residual_model(norm: str, layers: int = 2, bias: bool = True) -> onnx.ModelProto:
    """Residual sublayers: post-norm LN(x + f(x)) or pre-norm x + f(LN(x)) (then a final LN)."""
    g = Builder()
    x = g.input("x", ["batch", "seq", D])

    def f(h):
        out = g.op("MatMul", h, g.weight(D, D))
        return g.op("Add", out, g.weight(D, scale=0.1)) if bias else out

    def ln(h):
        return g.op("LayerNormalization", h, g.weight(D, scale=1.0), g.weight(D, scale=0.1), axis=-1, epsilon=1e-5)

    for _ in range(layers):
        x = ln(g.op("Add", x, f(x))) if norm == "post" else g.op("Add", x, f(ln(x)))
    if norm == "pre":
        x = ln(x)
    g.output(g.op("Identity", x, out="y"))
    return g.model()


def residual_feeds(seed: int = 2) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((2, 3, D)).astype(np.float32)}


@pytest.mark.parametrize("bias", [True, False])
def test_skip_layernorm_post_norm(bias):
    model = residual_model("post", layers=3, bias=bias)
    fused, counts, ops = fuse(model, [RewritePass("skip", skip_layernorm_rules()), CleanupPass()])
    assert counts["skip_layer_norm_bias" if bias else "skip_layer_norm"] == 3 and sum(counts.values()) == 3
    assert ops["SkipLayerNormalization"] == 3 and "LayerNormalization" not in ops and "Add" not in ops
    assert all(len(n.output) == 1 for n in fused.graph.node if n.op_type == "SkipLayerNormalization")
    assert_same(model, fused, residual_feeds())


def test_skip_layernorm_pre_norm_keeps_the_residual_sum():
    model = residual_model("pre", layers=3)
    fused, counts, ops = fuse(model, [RewritePass("skip", skip_layernorm_rules()), CleanupPass()])
    # the residual of layers 0 and 1 feeds the next LN and the next residual (sum output); the last feeds the
    # final LN only; layer 0's own LN normalizes the graph input (no Add before it) and stays
    assert counts["skip_layer_norm_bias_sum"] == 2 and counts["skip_layer_norm_bias"] == 1
    assert ops["SkipLayerNormalization"] == 3 and ops["LayerNormalization"] == 1
    assert_same(model, fused, residual_feeds())


def layernorm_model(square: str = "Pow", beta: bool = True, opset: int = 20) -> onnx.ModelProto:
    g = Builder()
    x = g.input("x", ["batch", "seq", D])
    axes = g.const(np.array([-1], np.int64))
    mean = g.op("ReduceMean", x, axes)
    d = g.op("Sub", x, mean)
    sq = g.op("Pow", d, g.const(np.float32(2.0))) if square == "Pow" else g.op("Mul", d, d)
    var = g.op("ReduceMean", sq, axes)
    normed = g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.const(np.float32(1e-5)))))
    out = g.op("Mul", normed, g.weight(D, scale=1.0))
    if beta:
        out = g.op("Add", out, g.weight(D, scale=0.1))
    g.output(g.op("Relu", out, out="y"))
    return g.model(opset)


@pytest.mark.parametrize("square,beta", [("Pow", True), ("Mul", True), ("Pow", False)])
def test_layernorm_from_elementary_ops(square, beta):
    model = layernorm_model(square, beta)
    fused, counts, ops = fuse(model, [RewritePass("ln", layernorm_rules()), CleanupPass()])
    assert counts["layer_norm" if beta else "layer_norm_no_beta"] == 1
    assert ops == Counter({"LayerNormalization": 1, "Relu": 1})
    assert_same(model, fused, residual_feeds())


# ------------------------------------------------------------------------------------------ GELU

def ffn_model(gelu: str, layers: int = 2, opset: int = 20) -> onnx.ModelProto:
    """Feed-forward blocks: MatMul + bias, then GELU as the Gelu op ('none'/'tanh') or spelled with Erf:
    'erf' (x * 0.5) * cdf, or 'erf_torch' x * (0.5 * cdf) as torch writes it below opset 20."""
    g = Builder()
    x = g.input("x", ["batch", "seq", D])
    for _ in range(layers):
        h = g.op("Add", g.op("MatMul", x, g.weight(D, 2 * D)), g.weight(2 * D, scale=0.3))
        if gelu.startswith("erf"):
            cdf = g.op("Add", g.op("Erf", g.op("Div", h, g.const(np.float32(np.sqrt(2))))), g.const(np.float32(1)))
            if gelu == "erf":
                h = g.op("Mul", g.op("Mul", h, g.const(np.float32(0.5))), cdf)
            else:
                h = g.op("Mul", h, g.op("Mul", g.const(np.float32(0.5)), cdf))
        else:
            h = g.op("Gelu", h, approximate=gelu)
        x = g.op("MatMul", h, g.weight(2 * D, D))
    g.output(g.op("Identity", x, out="y"))
    return g.model(opset)


@pytest.mark.parametrize("gelu,rule,fused_op", [("none", "bias_gelu", "BiasGelu"), ("tanh", "fast_gelu", "FastGelu")])
def test_bias_gelu(gelu, rule, fused_op):
    model = ffn_model(gelu)
    fused, counts, ops = fuse(model, [RewritePass("gelu", bias_gelu_rules()), CleanupPass()])
    assert counts[rule] == 2 and sum(counts.values()) == 2
    assert ops[fused_op] == 2 and "Gelu" not in ops and "Add" not in ops
    assert_same(model, fused, residual_feeds())


@pytest.mark.parametrize("form,opset,domain", [("erf", 20, ""), ("erf_torch", 20, ""),
                                               ("erf_torch", 18, "com.microsoft")])
def test_erf_gelu_then_bias_gelu(form, opset, domain):
    model = ffn_model(form, opset=opset)
    erf_only, counts, ops = fuse(model, [RewritePass("erf", erf_gelu_rules(domain)), CleanupPass()])
    assert counts["erf_gelu"] == 2 and ops["Gelu"] == 2 and "Erf" not in ops
    assert {n.domain for n in erf_only.graph.node if n.op_type == "Gelu"} == {domain}
    assert_same(model, erf_only, residual_feeds())
    fused, counts, ops = fuse(model, [RewritePass("erf", erf_gelu_rules(domain)),
                                      RewritePass("gelu", bias_gelu_rules()), CleanupPass()])
    assert counts["erf_gelu"] == 2 and counts["bias_gelu"] == 2
    assert ops["BiasGelu"] == 2 and "Erf" not in ops and "Gelu" not in ops
    assert_same(model, fused, residual_feeds())


# ------------------------------------------------------------------------------------------ packed projections

@pytest.mark.parametrize("order", ["x_first", "sigmoid_first"])
def test_silu_becomes_quick_gelu_with_alpha_one(order):
    """x * Sigmoid(x) (Marian's swish) -> com.microsoft.QuickGelu(alpha=1.0), which computes x * Sigmoid(alpha x)."""
    g = Builder()
    x = g.input("x", ["batch", "seq", D])
    h = x
    for _ in range(2):
        h = g.op("Add", g.op("MatMul", h, g.weight(D, 2 * D)), g.weight(2 * D, scale=0.1))
        s = g.op("Sigmoid", h)
        h = g.op("Mul", *((h, s) if order == "x_first" else (s, h)))
        h = g.op("MatMul", h, g.weight(2 * D, D))
    g.op("Identity", h, out="y")
    g.output("y")
    model = g.model()
    fused, counts, ops = fuse(model, [RewritePass("fuse_silu", silu_rules())])
    assert counts["silu"] == 2 and ops["QuickGelu"] == 2 and "Sigmoid" not in ops
    assert all(a.f == 1.0 for n in fused.graph.node if n.op_type == "QuickGelu" for a in n.attribute if a.name == "alpha")
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, D)).astype(np.float32) * 3}
    assert_same(model, fused, feeds)


def test_projections_sharing_an_input_are_packed():
    """Q/K/V with biases (packed with their Adds), two bias-free projections of another input, one lone MatMul."""
    g = Builder()
    x, y = g.input("x", ["batch", "seq", D]), g.input("y", ["batch", "seq", D])
    qkv = [g.op("Add", g.op("MatMul", x, g.weight(D, D)), g.weight(D, scale=0.1)) for _ in range(3)]
    kv = [g.op("MatMul", y, g.weight(D, 2 * D)) for _ in range(2)]
    lone = g.op("MatMul", g.op("Relu", x), g.weight(D, D))
    for i, v in enumerate(qkv + kv + [lone]):
        g.output(g.op("Identity", v, out=f"out{i}"))
    g.output(g.op("Add", qkv[0], qkv[1], out="sum"))         # a packed output with two users
    model = g.model()
    fused, counts, ops = fuse(model, [PackMatMulsPass(), CleanupPass()])
    assert counts["packed_matmul"] == 2
    assert ops["MatMul"] == 3 and ops["Split"] == 2 and ops["Add"] == 2      # one packed bias Add + "sum"
    assert_same(model, fused, {"x": np.random.default_rng(3).standard_normal((2, 3, D)).astype(np.float32),
                               "y": np.random.default_rng(4).standard_normal((2, 3, D)).astype(np.float32)})


# ------------------------------------------------------------------------------------------ tied weights

def test_transposed_tied_weight_gets_its_own_initializer():
    """Tied output projection: the embedding feeds a Gather and, transposed, the logits MatMul."""
    g = Builder()
    ids = g.input("ids", ["batch", "seq"], TensorProto.INT64)
    table = g.weight(11, D)
    h = g.op("Gather", table, ids)
    g.output(g.op("MatMul", h, g.op("Transpose", table, perm=[1, 0]), out="logits"))
    model = g.model()
    fused, counts, ops = fuse(model, quantization_prepasses())
    assert counts["transposed_weight"] == 1 and ops == Counter({"Gather": 1, "MatMul": 1})
    inits = {i.name: i for i in fused.graph.initializer}
    matmul = next(n for n in fused.graph.node if n.op_type == "MatMul")
    assert list(inits[matmul.input[1]].dims) == [D, 11]
    assert_same(model, fused, {"ids": np.array([[1, 5, 10], [0, 2, 3]], np.int64)})


# ------------------------------------------------------------------------------------------ passes

def test_pass_manager_repeats_until_nothing_changes_and_sums_counts():
    model = ir.from_proto(residual_model("post", layers=2))
    passes = fusion_passes("ort")
    rounds = Counter()
    for p in passes:                         # count how often the manager calls each pass
        p.call = (lambda call, name: lambda m: (rounds.update([name]), call(m))[1])(p.call, p.name)
    result = run_passes(passes, model)
    assert result.counts["skip_layer_norm_bias"] == 2
    assert set(rounds.values()) == {2}       # one round that changed something, one that confirmed nothing left
    assert result.applied == ["fuse_skip_layer_norm"]
    again = run_passes(passes, result.model)  # the same pass objects: their report starts afresh
    assert not again.modified and sum(again.counts.values()) == 0 and again.applied == []
    assert set(rounds.values()) == {3}


def test_passes_declare_in_place():
    class Copying(Reporting, ir.passes.InPlacePass):
        name = "copying"

        def call(self, model):
            return ir.passes.PassResult(ir.from_proto(ir.to_proto(model)), True)

    with pytest.raises(ir.passes.PassError, match="in_place"):
        Copying()(ir.from_proto(residual_model("post", layers=1)))
    assert RewritePass("x", skip_layernorm_rules()).in_place and CleanupPass().in_place
