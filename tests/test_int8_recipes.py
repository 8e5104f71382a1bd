"""int8 recipes (exporters/int8_recipes): the order auto tries them in, --recipe and the flags that narrow or
contradict it, a recipe recorded in the manifest, and the float32 output projection."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from exporters.int8_recipes import NAMES, RECIPES, output_projections, recipes_for
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


def test_the_blocks_recipe_puts_the_decoder_in_8_bit_blocks_and_the_encoder_as_default(toy_exported, tmp_path):
    """--recipe blocks: the decoder's MatMuls become 8-bit MatMulNBits (the tied projection stays the 8-bit
    embedding's DynamicQuantizeMatMul), the encoder is quantized as default; recorded in the manifest."""
    _, bundle = toy_exported
    out, report = optimize_bundle(bundle, tmp_path / "blocks", precision="int8", recipe="blocks",
                                  allow_unverified=True)
    manifest = read_manifest(out)
    assert manifest["source"]["options"]["recipe"] == "blocks" and manifest["source"]["options"]["blocks"]
    decoder, encoder = (manifest["graphs"][g]["op_counts"] for g in ("decoder", "encoder"))
    assert decoder.get("com.microsoft.MatMulNBits", 0) >= 4 and not decoder.get("MatMul")
    assert decoder.get("com.microsoft.DynamicQuantizeMatMul") == 1                      # the tied projection
    assert encoder.get("MatMulInteger", 0) >= 4 and not encoder.get("com.microsoft.MatMulNBits")
    assert {"quantize_int8", "quantize_int8_blocks"} <= set(manifest["passes"])
    nbits = next(n for n in ir.load(out / "decoder.onnx").graph if n.op_type == "MatMulNBits")
    assert (nbits.attributes["bits"].value, nbits.attributes["block_size"].value) == (8, 128)


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
