"""Every file of a bundle is listed in its manifest with size and sha256 and verified when it is loaded: graphs,
ORT-format graphs, the operator config, the tokenizer and any file a later feature adds (one mechanism:
exporters.bundle.write_manifest lists whatever the writer put in the directory)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from exporters.bundle import readable_json, stage_bundle, write_manifest
from runtime.bundle import load_bundle
from runtime.errors import BundleError
from runtime.manifest import read_manifest, sha256_file, verify_hashes
from toolkit.apps.cli import main

from conftest import with_ort_graphs

FUTURE = "spiece.model"          # stands for any file a later feature writes (SentencePiece model, shared weights)


@pytest.fixture(scope="module")
def bundles(toy_exported, tmp_path_factory) -> dict[str, Path]:
    """The toy fp32 bundle, its ORT-format copy, and a copy holding one more file written by a bundle writer."""
    _, bundle = toy_exported
    root = tmp_path_factory.mktemp("bundle_files")
    future = root / "future"
    manifest = read_manifest(bundle)
    with stage_bundle(future) as tmp:
        for name in manifest["files"]:
            shutil.copyfile(bundle / name, tmp / name)
        (tmp / FUTURE).write_bytes(bytes(range(256)) * 4)
        write_manifest(tmp, manifest)
    return {"fp32": bundle, "ort": with_ort_graphs(bundle, root / "ort"), "future": future}


KINDS = [("fp32", "encoder.onnx"), ("fp32", "decoder.onnx"), ("fp32", "tokenizer.json"), ("ort", "encoder.ort"),
         ("ort", "decoder.ort"), ("ort", "required_operators.config"), ("future", FUTURE)]


def test_every_file_is_listed_with_its_size_and_hash(bundles):
    for key, bundle in bundles.items():
        manifest = read_manifest(bundle)
        on_disk = sorted(p.name for p in bundle.iterdir() if p.name != "manifest.json")
        assert sorted(manifest["files"]) == on_disk, key
        for name, entry in manifest["files"].items():
            assert entry == {"sha256": sha256_file(bundle / name), "bytes": (bundle / name).stat().st_size}
    assert {n for _, n in KINDS} <= {n for b in bundles.values() for n in read_manifest(b)["files"]}


def tamper(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":                                       # same size, one byte changed
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[:-1]))
    else:                                                   # swapped for another file
        path.write_bytes(b'{"type": "char", "chars": "abc"}' if path.suffix == ".json" else b"other")


@pytest.mark.parametrize("how", ["flip", "truncate", "swap"])
@pytest.mark.parametrize("key, name", KINDS)
def test_tampering_with_any_file_is_refused_at_load_and_by_the_cli(bundles, tmp_path, key, name, how):
    copy = Path(shutil.copytree(bundles[key], tmp_path / "b"))
    load_bundle(copy, provider="cpu")                        # loads before
    tamper(copy / name, how)
    with pytest.raises(BundleError, match=rf"{name.replace('.', '[.]')} (does not match its sha256|is \d+ bytes)"):
        load_bundle(copy, provider="cpu")
    for args in (["generate", str(copy), "--ids", "5 6 7"], ["inspect", str(copy)]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert name in result.stderr and result.stderr.startswith("error:")


@pytest.mark.parametrize("key, name", KINDS)
def test_a_missing_or_unlisted_file_is_refused(bundles, tmp_path, key, name):
    copy = Path(shutil.copytree(bundles[key], tmp_path / "b"))
    (copy / name).unlink()
    with pytest.raises(BundleError, match=f"missing {name}"):
        load_bundle(copy, provider="cpu")
    shutil.copyfile(bundles[key] / name, copy / name)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["files"][name]                              # the file is there but the manifest no longer vouches
    (copy / "manifest.json").write_text(json.dumps(manifest))
    if name == FUTURE:                                       # nothing names it elsewhere: it is simply not read
        verify_hashes(copy, read_manifest(copy))
        return
    with pytest.raises(BundleError, match=f"names {name} but does not list it"):
        load_bundle(copy, provider="cpu")


def test_parity_and_optimize_refuse_a_tampered_source(bundles, toy_exported, tmp_path):
    checkpoint, _ = toy_exported
    copy = Path(shutil.copytree(bundles["fp32"], tmp_path / "b"))
    tamper(copy / "tokenizer.json", "swap")
    for args in (["parity", str(checkpoint), str(copy)], ["optimize", str(copy), "--out", str(tmp_path / "o")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "tokenizer.json" in result.stderr, result.output
    assert not (tmp_path / "o").exists()


def test_the_manifest_is_written_readable_and_compact(bundles):
    """write_manifest's JSON reads back equal, keeps what fits in 120 columns on one line (a graph input, a shape)
    and breaks the rest one item a line, two spaces a level."""
    text = (bundles["fp32"] / "manifest.json").read_text()
    manifest = json.loads(text)
    assert readable_json(manifest) + "\n" == text and len(text) < len(json.dumps(manifest, indent=2))
    lines = text.splitlines()
    spec = manifest["graphs"]["encoder"]["inputs"][0]
    assert any(line.strip().rstrip(",") == json.dumps(spec) for line in lines)
    assert all(len(line) <= 120 or not line.rstrip(",").endswith(("]", "}")) for line in lines)   # only a long scalar
    value = {"short": [1, 2, 3], "long": [f"item {i}" for i in range(40)], "nested": {"a": {"b": [None, True, 1.5]}}}
    out = readable_json(value, width=40)
    assert json.loads(out) == value and '  "short": [1, 2, 3],' in out and '    "item 0",' in out
    assert '  "nested": {\n    "a": {"b": [null, true, 1.5]}\n  }' in out      # 44 columns broken, 37 kept
