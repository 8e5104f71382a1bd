"""optimize end to end on exported tiny models: fused op counts, parity with PyTorch at fp32 tolerance (ORT graph
optimizations on, as users run bundles), int8 token agreement, the manifest record, and bad input.

Exports are the slow part, so the fast suite shares two: the trained toy model (conftest's toy_exported:
post-norm, ReLU, tied, 4 heads of 8) and a pre-norm / GELU / untied / head_dim 6 model. The full grid is @slow.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner

import exporters.optimize as O
from exporters.debug_records import GRAPH_DEBUG, NODE_DEBUG
from exporters.export import export_model
from exporters.optimize import OptimizeError, optimize_bundle
from runtime.bundle import load_bundle
from runtime.errors import BundleError
from toolkit.parity import ParityError
from runtime.generate import generate_ids
from runtime.manifest import read_manifest, verify_hashes
from runtime.search import SearchOptions
from toolkit.reference.checkpoint import load_checkpoint
from toolkit.apps.cli import main
from toolkit.reference.config import preset
from toolkit.reference.model import Transformer
from toolkit.reference.outdir import OutputError
from toolkit.parity.graphs import graph_parity
from toolkit.parity.tolerances import tolerance

from conftest import copy_with_manifest


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".onnxformer-" in p.name)


def ops(bundle: Path, graph: str) -> dict:
    return read_manifest(bundle)["graphs"][graph]["op_counts"]


def assert_fused(bundle: Path, config, fusions: dict) -> None:
    """One fused attention per encoder layer, two per decoder layer, no decomposed attention left.

    With the static KV cache (the CPU default) the decoder's self-attention is GroupQueryAttention (the per-row
    layout; DecoderMaskedMultiHeadAttention for CUDA) and the causal bias is gone; cross-attention stays
    MultiHeadAttention.
    """
    enc, dec = ops(bundle, "encoder"), ops(bundle, "decoder")
    layout = read_manifest(bundle)["decoder_layout"]
    static = layout != "dynamic"
    assert enc.get("com.microsoft.MultiHeadAttention") == config.n_encoder_layers
    assert dec.get("com.microsoft.MultiHeadAttention") == (1 if static else 2) * config.n_decoder_layers
    inputs = {i["name"]: i for i in read_manifest(bundle)["graphs"]["decoder"]["inputs"]}
    per_row = inputs.get("past_sequence_length", {}).get("shape") == ["batch"]
    assert per_row == (layout == "static-per-row")                       # the layout declared is the graph's
    self_op = "com.microsoft." + ("GroupQueryAttention" if per_row else "DecoderMaskedMultiHeadAttention")
    assert dec.get(self_op, 0) == (config.n_decoder_layers if static else 0)
    assert fusions.get("static_kv_cache", 0) == (config.n_decoder_layers if static else 0)
    assert "Softmax" not in enc and "Softmax" not in dec
    # projections only, Q/K/V packed into one MatMul per layer and the cross K/V of all decoder layers into one
    assert enc["MatMul"] == 4 * config.n_encoder_layers + 1 and dec["MatMul"] == 6 * config.n_decoder_layers + 1
    assert fusions["packed_matmul"] == config.n_encoder_layers + 1 + config.n_decoder_layers
    assert fusions["attention_self"] == config.n_encoder_layers
    assert fusions["attention_past"] == fusions["attention_cross"] == config.n_decoder_layers
    # the mask -> additive bias conversion is computed once per mask and shared by all layers
    assert enc["Where"] == 1 and dec["Where"] == (1 if static else 2)
    # (a static decoder takes one token a step: its cross bias needs no Expand to new_len rows)
    assert enc.get("Expand", 0) == 1 and dec.get("Expand", 0) == (0 if static else 1)
    assert fusions.get("one_token_expand", 0) == (1 if static else 0)


@pytest.fixture(scope="module")
def toy(toy_exported, tmp_path_factory):
    """(model, exported bundle, fused bundle, report) for conftest's trained toy model (loaded from its checkpoint)."""
    checkpoint, bundle = toy_exported
    out, report = optimize_bundle(bundle, tmp_path_factory.mktemp("opt") / "fused")
    return load_checkpoint(checkpoint).model, Path(bundle), out, report


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """(model, exported bundle, fused bundle, report): pre-norm, GELU, untied, d_model 24 / 4 heads (head_dim 6)."""
    config = preset("tiny", d_model=24, n_heads=4, norm="pre", activation="gelu", tie_embeddings=False, dropout=0.0)
    model = Transformer(config, seed=5).eval()
    root = tmp_path_factory.mktemp("variant")
    bundle = export_model(model, root / "bundle")
    out, report = optimize_bundle(bundle, root / "fused")
    return model, bundle, out, report


def test_toy_fused_counts_and_parity_with_pytorch(toy):
    model, _, fused, report = toy
    assert_fused(fused, model.config, report.totals)
    c = model.config
    assert report.totals["skip_layer_norm_bias"] == 2 * c.n_encoder_layers + 3 * c.n_decoder_layers
    record = graph_parity(model, fused, provider="cpu", precision="fp32")      # ORT_ENABLE_ALL sessions
    assert record.ok, record.summary()
    assert record.tolerance.atol == 1e-4


def test_toy_manifest_records_what_was_done(toy):
    _, source, fused, report = toy
    manifest = read_manifest(fused)
    verify_hashes(fused, manifest)
    assert manifest["precision"] == "fp32" and manifest["target"] == "cpu"
    assert manifest["fusions"] == {k: v for k, v in report.totals.items() if v}
    assert manifest["passes"] == ["fuse_attention", "fuse_skip_layer_norm", "pack_matmuls", "cleanup", "static_kv_cache"]
    assert manifest["kv_cache"] == "static" and manifest["source"]["options"]["kv_cache"] == "static"
    src = read_manifest(source)
    for g in ("encoder", "decoder"):
        before = manifest["source"]["graphs"][g]
        assert before["nodes"] == src["graphs"][g]["nodes"] > manifest["graphs"][g]["nodes"]
        assert before["op_counts"] == src["graphs"][g]["op_counts"]
    parity = manifest["parity"]
    assert parity["verified"] and parity["provider"] == "cpu" and parity["tolerance"] == 1e-4
    assert parity["generation"]["tokens_equal"] == 1.0
    assert manifest["tokenizer"] == "tokenizer.json" and (fused / "tokenizer.json").is_file()
    assert not leftovers(fused.parent)


def test_optimized_graphs_carry_no_exporter_debug_records(toy):
    """The exported graphs' stack traces, FX node texts, class paths and ExportedProgram signature stay in the
    exported bundle; the optimized graphs keep only the module names ('namespace', the name scopes)."""
    _, source, out, _ = toy
    exported = onnx.load(str(source / "decoder.onnx"), load_external_data=False)
    keys = {p.key for n in exported.graph.node for p in n.metadata_props} | {p.key for p in exported.graph.metadata_props}
    assert set(NODE_DEBUG) | {GRAPH_DEBUG[0], "namespace"} <= keys      # what there is to drop, and to keep
    for g in ("encoder", "decoder"):
        model = onnx.load(str(out / f"{g}.onnx"), load_external_data=False)
        kept = {p.key for n in model.graph.node for p in n.metadata_props}
        assert not kept & set(NODE_DEBUG) and "namespace" in kept and "pkg.torch.onnx.name_scopes" in kept
        assert not {p.key for p in model.graph.metadata_props} & set(GRAPH_DEBUG)


def test_fused_bundle_generates_the_same_tokens(toy):
    model, source, fused, _ = toy
    seqs = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46], [9]]
    for beam in (1, 3):
        opts = SearchOptions(max_new_tokens=12, beam=beam)
        want = [h[0].tokens for h in generate_ids(load_bundle(source, "cpu").engine, seqs, opts)]
        got = [h[0].tokens for h in generate_ids(load_bundle(fused, "cpu").engine, seqs, opts)]
        assert got == want


def test_variant_prenorm_gelu_untied_odd_head_dim(variant):
    model, _, fused, report = variant
    c = model.config
    assert_fused(fused, c, report.totals)
    assert report.totals["bias_gelu"] == c.n_encoder_layers + c.n_decoder_layers
    # pre-norm: every residual sum but the last of each stack also feeds the next residual (the sum output)
    assert report.totals["skip_layer_norm_bias_sum"] == (2 * c.n_encoder_layers - 1) + (3 * c.n_decoder_layers - 1)
    assert report.totals["skip_layer_norm_bias"] == 2
    assert ops(fused, "encoder")["com.microsoft.BiasGelu"] == c.n_encoder_layers
    # head size 6: GroupQueryAttention takes multiples of 8 only, so the CPU static cache keeps the shared slot
    assert c.head_dim % 8 and ops(fused, "decoder")["com.microsoft.DecoderMaskedMultiHeadAttention"] == c.n_decoder_layers
    assert any("not a multiple of 8" in note and "request-level" in note for note in report.notes)
    record = graph_parity(model, fused, provider="cpu", precision="fp32")
    assert record.ok, record.summary()


def test_onnx_attention_target(toy, tmp_path):
    model, source, _, _ = toy
    out, report = optimize_bundle(source, tmp_path / "onnx", attention="onnx")
    c = model.config
    enc, dec = ops(out, "encoder"), ops(out, "decoder")
    assert enc["Attention"] == c.n_encoder_layers and dec["Attention"] == 2 * c.n_decoder_layers
    assert not [op for op in {**enc, **dec} if op.startswith("com.microsoft")]
    assert read_manifest(out)["opset"] == 23 and report.passes[0] == "opset_23"
    assert onnx.load(str(out / "decoder.onnx")).opset_import[0].version == 23
    record = graph_parity(model, out, provider="cpu", precision="fp32")
    assert record.ok, record.summary()


def test_int8_on_fused_bundle_is_allowed_and_reports_token_agreement(toy, tmp_path):
    model, _, fused, _ = toy                         # the toy model misses the int8 token row: written only if allowed
    out, report = optimize_bundle(fused, tmp_path / "int8", precision="int8", recipe="default",
                                  allow_unverified=True)
    embedding = {"int8_embedding": 2, "int8_tied_projection": 1}       # the lookups of both graphs, the tied logits
    assert {k: v for k, v in report.totals.items() if v} == embedding
    assert report.passes == ["cleanup", "int8_embedding", "quantize_int8", "tied_table_rows"]
    manifest = read_manifest(out)
    assert manifest["precision"] == "int8" and manifest["passes"][-2:] == ["quantize_int8", "tied_table_rows"]
    assert manifest["fusions"] == {**read_manifest(fused)["fusions"], **embedding}   # the fusions carried over
    dec = manifest["graphs"]["decoder"]["op_counts"]
    # every weight MatMul quantized: per decoder layer packed q/k/v, self out, cross q/out, two FFN; the logits read
    # the int8 embedding (one matrix [V, D], shared with the encoder's lookup) by row slices (exporters/tied_table)
    assert "MatMul" not in dec and dec["MatMulInteger"] == 6 * model.config.n_decoder_layers
    assert dec["com.microsoft.QGemm"] >= 1 and "com.microsoft.DynamicQuantizeMatMul" not in dec
    shared = {t["name"]: t for t in manifest["shared_weights"]["tensors"]}
    table = next(t for name, t in shared.items() if name.endswith(".int8_t.rows"))
    assert table["dtype"] == "int8" and table["shape"] == [model.config.vocab_size, model.config.d_model]
    assert dec["com.microsoft.MultiHeadAttention"] == model.config.n_decoder_layers             # cross
    assert dec["com.microsoft.GroupQueryAttention"] == model.config.n_decoder_layers  # self, static (per row)
    assert manifest["kv_cache"] == "static"
    parity = manifest["parity"]
    assert parity["precision"] == "int8" and parity["tolerance"] is None     # logits: report only
    gen = parity["generation"]
    assert gen["token_match"] == tolerance("int8", "cpu").token_match == 0.98
    assert 0.0 <= gen["tokens_equal"] <= 1.0 and parity["verified"] == (gen["tokens_equal"] >= 0.98)
    assert parity["verdict"] == ("ok" if parity["verified"] else "failed") and parity["allowed_unverified"]
    print(f"int8 toy: greedy tokens equal {gen['tokens_equal']:.2%}, logits max abs {parity['max_abs']:.3g}")
    assert load_bundle(out, "cpu").engine is not None


def test_reoptimizing_a_fused_bundle_is_a_no_op(toy, tmp_path):
    _, _, fused, _ = toy
    out, report = optimize_bundle(fused, tmp_path / "again")
    assert sum(report.totals.values()) == 0 and report.passes == []
    for g in ("encoder", "decoder"):
        assert report.after[g]["op_counts"] == report.before[g]["op_counts"]
    assert "no fusion fired" in report.format()


def test_fp16_for_cuda_without_a_gpu_is_written_unverified(toy, tmp_path):
    _, source, _, _ = toy
    out, report = optimize_bundle(source, tmp_path / "fp16", target="cuda", precision="fp16")
    manifest = read_manifest(out)
    assert manifest["precision"] == "fp16" and manifest["target"] == "cuda"
    model = onnx.load(str(out / "decoder.onnx"))
    assert {i.type.tensor_type.elem_type for i in model.graph.input if i.name.startswith("past")} == {1}
    assert {o.type.tensor_type.elem_type for o in model.graph.output} == {1}          # float32 at the boundary
    floats = [i.data_type for i in model.graph.initializer if i.data_type in (1, 10)]
    assert floats and set(floats) == {10}                                             # float16 inside
    if "CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers():
        parity = manifest["parity"]
        assert parity["verified"] is False and "CUDA not available" in parity["reason"]
        assert "cpu_check" in parity


@pytest.mark.parametrize("args,message", [
    (["--precision", "fp16"], "fp16 is for the CUDA provider"),
    (["--precision", "fp8"], "unknown precision 'fp8'"),
    (["--attention", "trt"], "unknown attention target 'trt'"),
    (["--target", "tpu"], "unknown target 'tpu'"),
    (["--precision", "int8", "--target", "cuda"], "int8 quantization is made for the CPU provider"),
    (["--precision", "int4", "--target", "cuda"], "int4 quantization is made for the CPU provider"),
    (["--precision", "fp16", "--target", "wasm"], "fp16 is for the CUDA provider"),
    (["--no-fuse"], "nothing to do"),
])
def test_bad_options_exit_2_and_write_nothing(toy, tmp_path, args, message):
    _, source, _, _ = toy
    result = CliRunner().invoke(main, ["optimize", str(source), "--out", str(tmp_path / "x"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x").exists() and not leftovers(tmp_path)


def test_already_converted_or_differently_fused_bundles_are_refused(toy, tmp_path):
    _, source, fused, _ = toy
    with pytest.raises(OptimizeError, match="already holds com.microsoft.MultiHeadAttention.*--attention ort"):
        optimize_bundle(fused, tmp_path / "x", attention="onnx")
    fake = copy_with_manifest(fused, tmp_path / "int8", precision="int8")
    with pytest.raises(OptimizeError, match="already int8"):
        optimize_bundle(fake, tmp_path / "y", precision="int8")
    with pytest.raises(OptimizeError, match="is the source bundle"):
        optimize_bundle(source, source, force=True)
    with pytest.raises(OutputError, match="already exists"):
        optimize_bundle(source, fused)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_parity_failure_writes_nothing(toy, tmp_path, monkeypatch):
    import toolkit.parity.gate as G

    _, source, _, _ = toy
    real = G.bundle_parity

    def broken(reference, candidate, *args, **kwargs):          # swap the candidate for a different model
        other = {g: p.parent / f"other_{g}.onnx" for g, p in candidate.items()}
        for g, p in candidate.items():
            proto = onnx.load(str(p))
            for init in proto.graph.initializer:
                if init.data_type == 1 and len(init.dims) == 2:
                    arr = onnx.numpy_helper.to_array(init) * 1.01
                    init.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), init.name))
            onnx.save(proto, str(other[g]))
        return real(reference, other, *args, **kwargs)

    monkeypatch.setattr(G, "bundle_parity", broken)
    with pytest.raises(ParityError, match="did not pass the gate: verdict FAILED.*graphs failed"):
        optimize_bundle(source, tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not leftovers(tmp_path)


def test_non_finite_weights_in_the_output_write_nothing(toy, tmp_path, monkeypatch):
    """A converted graph whose weights hold NaN/Inf (as fp16 gives weights beyond its range) is refused before
    parity, naming the tensor; exit code 2 on the command line."""
    from exporters.validate import NonFiniteWeightsError

    _, source, _, _ = toy
    real = O.drop_export_debug

    def poisoned(model):
        real(model)
        if any(v.name == "logits" for v in model.graph.outputs):        # the decoder
            name, value = next((n, v) for n, v in model.graph.initializers.items()
                               if v.const_value is not None and v.const_value.dtype.is_floating_point())
            array = value.const_value.numpy().copy()
            array.flat[0] = np.inf
            value.const_value = ir.tensor(array, name=name)
            poisoned.name = name

    monkeypatch.setattr(O, "drop_export_debug", poisoned)
    with pytest.raises(NonFiniteWeightsError, match=r"decoder\.onnx: weight (\S+) holds 1 NaN/Inf value") as err:
        optimize_bundle(source, tmp_path / "bad", kv_cache="dynamic")
    assert poisoned.name in str(err.value) and err.value.exit_code == 2 and "\n" not in str(err.value)
    assert not (tmp_path / "bad").exists() and not leftovers(tmp_path)


def test_force_replaces_an_existing_bundle_and_cli_prints_the_report(toy, tmp_path):
    _, source, _, _ = toy
    out = tmp_path / "fused"
    shutil.copytree(source, out)                                 # an older bundle in the way
    result = CliRunner().invoke(main, ["optimize", str(source), "--out", str(out), "--force"])
    assert result.exit_code == 0, result.output
    for text in ("attention_self", "attention_past", "attention_cross", "skip_layer_norm_bias", "nodes",
                 "com.microsoft.MultiHeadAttention", "MB", "parity: verified on cpu fp32", "greedy tokens equal"):
        assert text in result.output
    assert read_manifest(out)["passes"] and not leftovers(tmp_path)


CONFIGS = [dict(norm=n, activation=a, tie_embeddings=t, d_model=d)
           for n, a, t, d in itertools.product(("post", "pre"), ("relu", "gelu"), (True, False), (32, 24))]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_config_grid(overrides, tmp_path):
    config = preset("tiny", n_heads=4, dropout=0.0, **overrides)
    model = Transformer(config, seed=7).eval()
    bundle = export_model(model, tmp_path / "bundle")
    for attention in ("ort", "onnx"):
        out, report = optimize_bundle(bundle, tmp_path / attention, attention=attention)
        if attention == "ort":
            assert_fused(out, config, report.totals)
        record = graph_parity(model, out, provider="cpu", precision="fp32")
        assert record.ok, f"{attention}: {record.summary()}"
    out, report = optimize_bundle(tmp_path / "ort", tmp_path / "int8", precision="int8", recipe="default",
                                  allow_unverified=True)
    assert report.parity["generation"]["samples"] > 0


@pytest.mark.slow
def test_int8_on_the_dates_example(dates_checkpoint, tmp_path):
    """The int8 row of the tolerance table: >= 98% greedy tokens and task accuracy within 1 point."""
    from runtime.bundle import load_bundle as load
    from toolkit.reference.tasks import dates

    ckpt = dates_checkpoint
    bundle = export_model(ckpt.model, tmp_path / "bundle", tokenizer=ckpt.path / "tokenizer.json")
    fused, _ = optimize_bundle(bundle, tmp_path / "fused")
    out, report = optimize_bundle(fused, tmp_path / "int8", precision="int8", samples=200)
    gen = report.parity["generation"]
    tol = tolerance("int8", "cpu")
    assert "dates" in gen["source"] and gen["tokens_equal"] >= tol.token_match, gen
    examples = dates.held_out_examples()
    fp32 = dates.dates_accuracy(load(fused, "cpu").engine, ckpt.tokenizer, examples)
    int8 = dates.dates_accuracy(load(out, "cpu").engine, ckpt.tokenizer, examples)
    print(f"dates held-out exact match: fp32 {fp32:.2%}, int8 {int8:.2%}; int8 greedy tokens {gen['tokens_equal']:.2%}")
    assert (fp32 - int8) * 100 <= tol.accuracy_drop
    gate = report.parity                             # the gate measured the same on its own, and passed
    assert gate["verdict"] == "ok" and gate["verdicts"] == {"tokens": "ok", "accuracy": "ok"}
    assert gate["accuracy"]["source"] == pytest.approx(fp32) and gate["accuracy"]["candidate"] == pytest.approx(int8)
