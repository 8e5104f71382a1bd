"""int8 recipes (exporters/int8_recipes): the order auto tries them in, --recipe and the flags that narrow or
contradict it, a recipe recorded in the manifest, and the float32 output projection."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from exporters.int8_recipes import NAMES, RECIPES, cross_kv_projections, output_projections, recipes_for
from exporters.optimize import optimize_bundle
from exporters.optimize_options import OptimizeError
from runtime.manifest import read_manifest
from toolkit.apps.cli import main


def test_auto_tries_every_recipe_cheapest_first_and_flags_narrow_it():
    assert NAMES[0] == "default" and [r.name for r in recipes_for("auto", None, None)] == list(NAMES)
    assert (RECIPES[0].per_channel, RECIPES[0].activation_scales, RECIPES[0].float_projection) == (
        False, "per-tensor", False)
    assert [r.name for r in recipes_for("auto", True, None)] == ["per-channel", "per-channel-per-row"]
    assert [r.name for r in recipes_for("auto", None, "per-row")] == ["per-row", "per-channel-per-row"]
    assert [r.name for r in recipes_for("auto", False, "per-tensor")] == ["default", "fp32-projection"]
    assert [r.name for r in recipes_for("per-row", None, "per-row")] == ["per-row"]
    assert "blocks" not in NAMES and [r.name for r in recipes_for("blocks", None, None)] == ["blocks"]
    assert "fp32-cross-kv" not in NAMES and [r.name for r in recipes_for("fp32-cross-kv", None, None)] == [
        "fp32-cross-kv"]


def test_the_blocks_recipe_puts_the_decoder_in_8_bit_blocks_and_the_encoder_as_default(toy_exported, tmp_path):
    """--recipe blocks: the decoder's MatMuls become 8-bit MatMulNBits (the tied projection stays the 8-bit
    embedding's, exporters/tied_table), the encoder is quantized as default; recorded in the manifest."""
    _, bundle = toy_exported
    out, report = optimize_bundle(bundle, tmp_path / "blocks", precision="int8", recipe="blocks",
                                  allow_unverified=True)
    manifest = read_manifest(out)
    assert manifest["source"]["options"]["recipe"] == "blocks" and manifest["source"]["options"]["blocks"]
    decoder, encoder = (manifest["graphs"][g]["op_counts"] for g in ("decoder", "encoder"))
    assert decoder.get("com.microsoft.MatMulNBits", 0) >= 4 and not decoder.get("MatMul")
    assert decoder.get("com.microsoft.QGemm", 0) >= 1                                   # the tied projection
    assert encoder.get("MatMulInteger", 0) >= 4 and not encoder.get("com.microsoft.MatMulNBits")
    assert {"quantize_int8", "quantize_int8_blocks"} <= set(manifest["passes"])
    nbits = next(n for n in ir.load(out / "decoder.onnx").graph if n.op_type == "MatMulNBits")
    assert (nbits.attributes["bits"].value, nbits.attributes["block_size"].value) == (8, 128)


def test_the_fp32_cross_kv_recipe_keeps_the_encoders_cross_kv_matmuls_float(toy_exported, tmp_path):
    """--recipe fp32-cross-kv: the encoder's MatMuls behind present.N.encoder.key/value stay float32 MatMuls, its
    others are int8 as default's, the decoder is default's byte for byte; recorded in the manifest (and the other
    recipes' options have no such key, as before)."""
    _, bundle = toy_exported
    out, _ = optimize_bundle(bundle, tmp_path / "cross", precision="int8", recipe="fp32-cross-kv",
                             allow_unverified=True)
    default, _ = optimize_bundle(bundle, tmp_path / "default", precision="int8", recipe="default",
                                 allow_unverified=True)
    options = read_manifest(out)["source"]["options"]
    assert (options["recipe"], options["float_cross_kv"]) == ("fp32-cross-kv", True)
    assert "float_cross_kv" not in read_manifest(default)["source"]["options"]
    encoder = ir.load(out / "encoder.onnx")
    floats = [n for n in encoder.graph if n.op_type == "MatMul"]
    layers = read_manifest(out)["model"]["n_decoder_layers"]
    assert floats and floats == cross_kv_projections(encoder) and len(floats) <= 2 * layers
    assert all(ir.convenience.get_const_tensor(n.inputs[1]).numpy().dtype == np.float32 for n in floats)
    ops = read_manifest(out)["graphs"]["encoder"]["op_counts"]
    assert ops.get("MatMulInteger", 0) + ops.get("com.microsoft.DynamicQuantizeMatMul", 0) >= 4
    assert not cross_kv_projections(ir.load(default / "encoder.onnx"))             # default quantizes them
    assert (out / "decoder.onnx").read_bytes() == (default / "decoder.onnx").read_bytes()


@pytest.mark.parametrize("recipe, per_channel, scales, message", [
    ("per-row", None, "per-tensor", "--recipe per-row conflicts with --activation-scales per-tensor"),
    ("per-channel", False, None, "--recipe per-channel conflicts with --per-tensor"),
    ("per-column", None, None, "unknown int8 recipe 'per-column'; choose auto or one of: default, per-channel"),
])
def test_a_recipe_contradicted_or_unknown_is_refused(recipe, per_channel, scales, message):
    with pytest.raises(OptimizeError, match=message):
        recipes_for(recipe, per_channel, scales)


def test_cli_refuses_conflicting_recipe_flags_before_any_work(toy_exported, tmp_path):
    _, bundle = toy_exported
    for args, message in ((["--precision", "int8", "--recipe", "per-row", "--per-channel"],
                           "--recipe per-row conflicts with --per-channel"),
                          (["--precision", "fp32", "--recipe", "per-row"], "--recipe per-row is for --precision int8")):
        result = CliRunner().invoke(main, ["optimize", str(bundle), "--out", str(tmp_path / "x"), *args])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output
        assert not (tmp_path / "x").exists()


def test_fp32_projection_recipe_keeps_the_logits_matmul_float_and_is_recorded(toy_exported, tmp_path):
    """--recipe fp32-projection: the 8-bit embedding lookup stays, the tied projection is a float32 MatMul; the
    manifest records the recipe and only its graphs are in the bundle (no staging folder left)."""
    _, bundle = toy_exported
    out, report = optimize_bundle(bundle, tmp_path / "proj", precision="int8", recipe="fp32-projection",
                                  allow_unverified=True)
    manifest = read_manifest(out)
    options = manifest["source"]["options"]
    assert (options["recipe"], options["float_projection"], options["per_channel"]) == ("fp32-projection", True, False)
    assert report.recipe["recipe"] == "fp32-projection" and [t["recipe"] for t in report.recipe["tried"]] == [
        "fp32-projection"]
    assert manifest["fusions"].get("int8_embedding") and not manifest["fusions"].get("int8_tied_projection")
    decoder = ir.load(out / "decoder.onnx")
    [projection] = output_projections(decoder)
    weight = ir.convenience.get_const_tensor(projection.inputs[1])
    assert weight is not None and weight.numpy().dtype == np.float32 and weight.numpy().ndim == 2
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    default, _ = optimize_bundle(bundle, tmp_path / "default", precision="int8", recipe="default",
                                 allow_unverified=True)
    assert read_manifest(default)["source"]["options"]["recipe"] == "default"
    assert read_manifest(default)["fusions"].get("int8_tied_projection")
    assert not output_projections(ir.load(default / "decoder.onnx"))      # a DynamicQuantizeMatMul, then * s


def _dqmm(weights: np.ndarray):
    """An onnxruntime session of one DynamicQuantizeMatMul over these int8 weights (a constant, prepacked)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = weights.shape
    graph = helper.make_graph(
        [helper.make_node("DynamicQuantizeMatMul", ["x", "w", "s"], ["y"], domain="com.microsoft")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(np.array(1.0, np.float32), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _int8_error(weights: np.ndarray, x: np.ndarray) -> float:
    """The kernel's largest error against exact integer arithmetic on the same quantized activations, relative to
    the result's magnitude."""
    y = _dqmm(weights).run(None, {"x": x})[0]
    lo, hi = min(0.0, float(x.min())), max(0.0, float(x.max()))
    scale = (hi - lo) / 255
    zero = np.clip(np.round(-lo / scale), 0, 255)
    q = np.clip(np.round(x / scale) + zero, 0, 255)
    exact = ((q - zero) @ weights.astype(np.float64)) * scale
    return float(np.abs(y - exact).max() / np.abs(exact).max())


def test_the_saturation_probe_agrees_with_the_kernel_and_7_bit_weights_are_exact():
    """runtime.session.int8_saturates says what a full-range matrix measures on this CPU (x86 without VNNI: True,
    errors of a quarter of the result; VNNI and ARM: False), and 7-bit weights are exact on every CPU."""
    from runtime.session import int8_saturates

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    full = _int8_error(rng.integers(-127, 128, (512, 256)).astype(np.int8), x)
    seven = _int8_error(rng.integers(-64, 65, (512, 256)).astype(np.int8), x)
    assert seven < 1e-6
    assert int8_saturates() == (full > 1e-3), full
    assert full < 1e-6 or full > 1e-2                      # exact, or clearly wrong: nothing in between


def test_weight_bits_auto_is_7_where_the_kernel_saturates_and_every_recipe_takes_it():
    from exporters.int8_recipes import resolve_weight_bits

    assert resolve_weight_bits("auto", lambda: True) == 7 and resolve_weight_bits("auto", lambda: False) == 8
    assert resolve_weight_bits("8", lambda: True) == 8 and resolve_weight_bits(7, lambda: False) == 7
    with pytest.raises(OptimizeError, match="--weight-bits 6 is not one of auto, 8, 7"):
        resolve_weight_bits("6", lambda: False)
    seven = recipes_for("auto", None, None, 7)
    assert [r.name for r in seven] == list(NAMES) and {r.weight_bits for r in seven} == {7}
    assert {r.weight_bits for r in recipes_for("auto", None, None)} == {8}
    assert recipes_for("per-channel", None, None, 7)[0].options()["weight_bits"] == 7


def test_weight_bits_is_refused_for_other_precisions_before_any_work(toy_exported, tmp_path):
    result = CliRunner().invoke(main, ["optimize", str(toy_exported[1]), "--out", str(tmp_path / "x"),
                                       "--weight-bits", "7"])
    assert result.exit_code == 2 and "--weight-bits 7 is for --precision int8" in result.output
    assert not (tmp_path / "x").exists() and "Traceback" not in result.output


def test_a_7_bit_bundle_has_weights_within_7_bits_and_an_8_bit_one_warns_where_it_saturates(toy_exported, tmp_path,
                                                                                           monkeypatch):
    """--weight-bits auto on a saturating CPU (the probe forced either way) quantizes to 7 bits: every int8 weight of
    the bundle is then within +-64 (the 8-bit embedding and its tied projection included), the manifest says 7 bits,
    and loading it warns nowhere. An 8-bit bundle loaded where the kernel saturates warns, naming the fix."""
    import warnings

    import exporters.optimize
    import runtime.bundle
    from runtime.bundle import load_bundle

    _, bundle = toy_exported
    monkeypatch.setattr(exporters.optimize, "int8_saturates", lambda: True)
    out, report = optimize_bundle(bundle, tmp_path / "seven", precision="int8", allow_unverified=True)
    options = read_manifest(out)["source"]["options"]
    assert options["weight_bits"] == 7
    assert any("saturates" in note and "7 bits" in note for note in report.notes)
    model = ir.load(out / "decoder.onnx")
    int8 = [v.const_value.numpy() for v in model.graph.initializers.values()
            if v.const_value is not None and v.const_value.dtype == ir.DataType.INT8]
    assert len(int8) >= 4 and max(int(np.abs(w.astype(np.int32)).max()) for w in int8) <= 64
    eight, _ = optimize_bundle(bundle, tmp_path / "eight", precision="int8", recipe="default", weight_bits=8,
                               allow_unverified=True)
    assert read_manifest(eight)["source"]["options"]["weight_bits"] == 8
    for saturates, path, warned in ((True, eight, True), (False, eight, False), (True, out, False)):
        monkeypatch.setattr(runtime.bundle, "int8_saturates", lambda saturates=saturates: saturates)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_bundle(path, "cpu")
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert bool(messages) == warned, (saturates, path, messages)
        assert not warned or "--weight-bits 7" in messages[0]
