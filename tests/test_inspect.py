"""The manifest (runtime/manifest.py) and `onnxformer inspect`: reading, validation, hashes, the report.

Bundles here are built from small hand-made graphs through the real writer (exporters/bundle.py), so
these tests need no export; test_export.py inspects a really exported bundle.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from exporters.bundle import build_manifest, graph_entry, op_counts, stage_bundle, write_manifest
from runtime.errors import BundleError
from runtime.manifest import FORMAT_VERSION, format_inspect, inspect_report, read_manifest, verify_hashes
from toolkit.apps.cli import main
from toolkit.reference.config import preset

ROOT = Path(__file__).resolve().parents[1]


def small_graph(fused: bool) -> onnx.ModelProto:
    """x [batch, n] -> Relu -> Add(x) -> y; with fused=True one com.microsoft node as well."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "x"], ["y"])]
    if fused:
        nodes.append(helper.make_node("MultiHeadAttention", ["y", "y", "y"], ["z"], domain="com.microsoft", num_heads=1))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("z" if fused else "y", TensorProto.FLOAT, ["batch", 4])])
    opsets = [helper.make_opsetid("", 20)] + ([helper.make_opsetid("com.microsoft", 1)] if fused else [])
    return helper.make_model(graph, opset_imports=opsets)


@pytest.fixture
def bundle(tmp_path) -> Path:
    """A bundle written by the real writer: fp16/cuda, with fusions, passes and a parity record."""
    out = tmp_path / "bundle"
    with stage_bundle(out) as tmp:
        entries = {}
        for name, fused in (("encoder", False), ("decoder", True)):
            onnx.save(small_graph(fused), str(tmp / f"{name}.onnx"))
            entries[name] = graph_entry(tmp / f"{name}.onnx")
        parity = {"verified": True, "provider": "cuda", "precision": "fp16", "tolerance": 5e-2, "max_abs": 0.01,
                  "encoder": {"max_abs": 0.004, "max_rel": 0.001, "ok": True, "worst_output": "encoder_hidden_states"},
                  "decoder": {"max_abs": 0.01, "max_rel": 0.002, "ok": True, "worst_output": "logits"},
                  "outputs": [{"graph": "decoder", "output": "logits"}]}
        manifest = build_manifest(preset("tiny").to_dict(), entries, precision="fp16", target="cuda",
                                  fusions={"mha_self_past": 2, "skip_layer_norm": 6}, passes=["fuse", "fp16"],
                                  parity=parity, decoder_layout="static-shared")
        write_manifest(tmp, manifest)
    return out


def test_inspect_report_reads_only_the_manifest(bundle):
    report = inspect_report(bundle)
    assert report["precision"] == "fp16" and report["target"] == "cuda" and report["opset"] == 20
    assert report["decoder_layout"] == "static-shared" and report["kv_cache"] == "static"
    assert report["fusions"] == {"mha_self_past": 2, "skip_layer_norm": 6} and report["passes"] == ["fuse", "fp16"]
    dec = report["graphs"]["decoder"]
    assert dec["op_counts"] == {"Add": 1, "Relu": 1, "com.microsoft.MultiHeadAttention": 1} and dec["nodes"] == 3
    assert dec["bytes"] == (bundle / "decoder.onnx").stat().st_size
    assert dec["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]
    assert report["parity"]["verified"] and "outputs" not in report["parity"]       # summary only
    assert {"onnx", "onnxruntime"} <= set(report["producer"])
    text = format_inspect(report)
    for expected in ("precision fp16, target cuda", "KV cache static (decoder layout static-shared)", "com.microsoft.MultiHeadAttention 1", "mha_self_past 2",
                     "x ", "[batch, 4]", "parity: verified on cuda fp16", "decoder max abs 1.00e-02"):
        assert expected in text, (expected, text)


def test_cli_inspect_text_and_json(bundle):
    runner = CliRunner()
    result = runner.invoke(main, ["inspect", str(bundle)])
    assert result.exit_code == 0, result.output
    assert "decoder: decoder.onnx" in result.output
    data = json.loads(runner.invoke(main, ["inspect", str(bundle), "--json"]).output)
    assert data["graphs"]["encoder"]["op_counts"] == {"Add": 1, "Relu": 1}
    missing = runner.invoke(main, ["inspect", str(bundle.parent / "nope")])
    assert missing.exit_code == 2 and "does not exist" in missing.output and "Traceback" not in missing.output


def test_inspect_works_without_torch_or_onnx(bundle):
    """Only onnxruntime, numpy and click are needed: torch, onnx and onnxscript are made unimportable."""
    code = ("import sys; sys.modules.update(torch=None, onnx=None, onnxscript=None); "
            "from toolkit.apps.cli import main; main(['inspect', sys.argv[1]])")
    run = subprocess.run([sys.executable, "-c", code, str(bundle)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "mha_self_past 2" in run.stdout


def test_op_counts_include_subgraphs():
    then = helper.make_graph([helper.make_node("Relu", ["a"], ["b"])], "then", [],
                             [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])])
    node = helper.make_node("If", ["c"], ["o"], then_branch=then, else_branch=then)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT, [1])])
    assert op_counts(graph) == {"If": 1, "Relu": 2}


def rewrite(bundle: Path, **changes) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest.update(changes)
    (bundle / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("change, message", [
    (dict(format="something-else"), "not an onnxformer bundle"),
    (dict(format_version=FORMAT_VERSION + 1), "newer than this onnxformer reads"),
    (dict(format_version="1"), "bad format_version"),
    (dict(format_version=1), "older than this onnxformer reads.*re-export"),
    (dict(format_version=2), "older than this onnxformer reads.*declare the decoder layout.*re-export"),
    (dict(decoder_layout="paged"), "unknown decoder_layout 'paged'"),
    (dict(files=[]), "'files' must map"),
    (dict(files={"encoder.onnx": {"sha256": "ab", "bytes": 1}}), "64 hex digits"),
    (dict(files={"../x": {"sha256": "a" * 64, "bytes": 1}}), "inside the bundle"),
    (dict(ort_graphs=["encoder.ort"]), "'ort_graphs' must be an object"),
    (dict(precision="fp8"), "unknown precision"),
    (dict(graphs={"encoder": {}}), "must list graphs"),
])
def test_read_manifest_rejects_bad_manifests(bundle, change, message):
    rewrite(bundle, **change)
    with pytest.raises(BundleError, match=message):
        read_manifest(bundle)


def test_read_manifest_rejects_missing_and_broken_files(bundle, tmp_path):
    with pytest.raises(BundleError, match="does not exist"):
        read_manifest(tmp_path / "nope")
    (tmp_path / "plain").mkdir()
    with pytest.raises(BundleError, match="no manifest.json"):
        read_manifest(tmp_path / "plain")
    manifest = json.loads((bundle / "manifest.json").read_text())
    del manifest["model"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="lacks field"):
        read_manifest(bundle)
    (bundle / "manifest.json").write_text("{broken")
    with pytest.raises(BundleError, match="not valid JSON"):
        read_manifest(bundle)


def test_graph_files_must_stay_inside_the_bundle(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["graphs"]["encoder"]["file"] = "../elsewhere.onnx"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="inside the bundle"):
        read_manifest(bundle)


def test_verify_hashes_catches_missing_truncated_and_changed_files(bundle):
    manifest = read_manifest(bundle)
    verify_hashes(bundle, manifest)
    data = (bundle / "decoder.onnx").read_bytes()
    (bundle / "decoder.onnx").write_bytes(data[:-1])
    with pytest.raises(BundleError, match="truncated"):
        verify_hashes(bundle, manifest)
    (bundle / "decoder.onnx").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(BundleError, match="sha256"):
        verify_hashes(bundle, manifest)
    (bundle / "decoder.onnx").unlink()
    with pytest.raises(BundleError, match="missing decoder.onnx"):
        verify_hashes(bundle, manifest)


def test_writer_refuses_a_manifest_whose_files_differ(tmp_path):
    with pytest.raises(BundleError, match="two different sha256 for decoder.onnx"):
        with stage_bundle(tmp_path / "b") as tmp:
            onnx.save(small_graph(False), str(tmp / "encoder.onnx"))
            onnx.save(small_graph(False), str(tmp / "decoder.onnx"))
            entries = {n: graph_entry(tmp / f"{n}.onnx") for n in ("encoder", "decoder")}
            onnx.save(small_graph(True), str(tmp / "decoder.onnx"))      # changed after it was recorded
            write_manifest(tmp, build_manifest(preset("tiny").to_dict(), entries))
    assert list(tmp_path.iterdir()) == []
