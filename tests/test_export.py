"""Export: both graphs, validated and checked against PyTorch step by step; the bundle is all or nothing.

Exports are slow (~8 s per graph on tiny), so the fast suite makes two real exports (the trained toy
model through the library, a pre-norm/GELU/untied/head_dim-6 model through the command line) and shares
them; error paths that need graphs reuse the first bundle's files. The full config grid is @slow.
"""

from __future__ import annotations

import copy
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

import exporters.export as E
from exporters.bundle import tensor_specs
from runtime.errors import BundleError, ProviderError
from toolkit.reference.errors import ConfigError
from runtime.manifest import read_manifest, verify_hashes
from runtime.spec import DECODER_ATTENTION_MASK, POSITION_IDS, default_row_inputs, graph_specs
from runtime.tokenizer import CharTokenizer
from toolkit.reference.checkpoint import load_checkpoint, save_checkpoint
from toolkit.apps.cli import main
from toolkit.reference.config import preset
from toolkit.reference.model import Transformer
from runtime.session import make_session
from toolkit.parity.graphs import graph_parity
from toolkit.parity.tolerances import MIN_REFERENCE_STD, TOLERANCES, tolerance

ROOT = Path(__file__).resolve().parents[1]
DATES = ROOT / "examples" / "dates" / "checkpoint"


def leftovers(parent: Path) -> list[str]:
    """Temporary directories the bundle writer left behind."""
    return sorted(p.name for p in parent.iterdir() if ".onnxformer-" in p.name)


@pytest.fixture(scope="module")
def tiny_bundle(toy_model, tmp_path_factory) -> Path:
    """The trained toy model (tiny, post-norm, ReLU, tied, 4 heads of 8) exported once."""
    out = tmp_path_factory.mktemp("export") / "tiny"
    E.export_model(toy_model, out)
    return out


@pytest.fixture(scope="module")
def cli_variant(tmp_path_factory) -> tuple[Path, Path, str]:
    """A pre-norm, GELU, untied model with head_dim 6 (d_model 24, 4 heads), made and exported by the CLI."""
    root = tmp_path_factory.mktemp("cli")
    ckpt, out = root / "ckpt", root / "bundle"
    runner = CliRunner()
    made = runner.invoke(main, ["init", "--preset", "tiny", "--d-model", "24", "--heads", "4", "--norm", "pre",
                                "--activation", "gelu", "--untied", "--seed", "5", "--out", str(ckpt)])
    assert made.exit_code == 0, made.output
    result = runner.invoke(main, ["export", str(ckpt), "--out", str(out)])
    return ckpt, out, result


@pytest.fixture
def copy_tiny_graphs(tiny_bundle, monkeypatch):
    """Replace the (slow) graph export by a copy of tiny_bundle's graphs; parity still runs for real."""
    def fake_export_graphs(model, out_dir, opset=20, progress=None):
        shutil.copy(tiny_bundle / "weights.data", Path(out_dir) / "weights.data")    # the graphs' external data
        paths = {name: Path(shutil.copy(tiny_bundle / f"{name}.onnx", Path(out_dir) / f"{name}.onnx"))
                 for name in ("encoder", "decoder")}
        return {name: (path, onnx.load(str(path))) for name, path in paths.items()}

    monkeypatch.setattr(E, "export_graphs", fake_export_graphs)


# ------------------------------------------------------------------------------------------ tolerances

def test_tolerance_limits_logits_absolutely_and_states_by_their_magnitude():
    """Logits get the table's number as is; hidden states and caches get it times their magnitude above 1."""
    for (precision, provider), tol in TOLERANCES.items():
        if tol.atol is None:                                # int8: numbers are reported, never judged
            assert tol.limit("logits", 5.0) is None and tol.limit("present.0.decoder.key", 9.0) is None
            assert not tol.judged
            continue
        assert tol.judged and tol.limit("logits", 50.0) == tol.atol
        assert tol.limit("present.0.decoder.key", 10.0) == pytest.approx(10 * tol.atol)
        assert tol.limit("encoder_hidden_states", 0.25) == tol.atol          # magnitudes below 1 do not shrink it
    with pytest.raises(ProviderError, match="no tolerance"):
        tolerance("fp16", "cpu")


# ------------------------------------------------------------------------------------------ the bundle

def test_bundle_is_complete_and_verified(tiny_bundle, toy_model):
    manifest = read_manifest(tiny_bundle)
    assert sorted(p.name for p in tiny_bundle.iterdir()) == ["decoder.onnx", "encoder.onnx", "manifest.json",
                                                             "weights.data"]
    shared = {t["name"]: t for t in manifest["shared_weights"]["tensors"]}     # the embedding once, for both graphs
    assert shared["model.embed.lut.weight"]["graphs"] == ["encoder", "decoder"]
    assert manifest["precision"] == "fp32" and manifest["opset"] == 20 and manifest["tokenizer"] is None
    assert manifest["model"] == toy_model.config.to_dict()
    assert manifest["parity"]["verified"] is True and manifest["parity"]["max_abs"] <= 1e-4
    assert {"torch", "onnx", "onnxruntime", "onnxscript"} <= set(manifest["producer"])
    assert leftovers(tiny_bundle.parent) == []


def test_manifest_specs_match_graphs_and_hashes(tiny_bundle, tmp_path):
    manifest = read_manifest(tiny_bundle)
    specs = graph_specs(manifest["model"])
    for name, entry in manifest["graphs"].items():
        model = onnx.load(str(tiny_bundle / entry["file"]))
        assert tensor_specs(model.graph.input) == entry["inputs"] == specs[name].to_dict()["inputs"]
        assert tensor_specs(model.graph.output) == entry["outputs"] == specs[name].to_dict()["outputs"]
        assert entry["nodes"] == len(model.graph.node) == sum(entry["op_counts"].values())
        assert entry["opset"] == 20 and entry["bytes"] == (tiny_bundle / entry["file"]).stat().st_size
        sess = make_session(tiny_bundle / entry["file"], "cpu")           # onnxruntime sees the same symbolic dims
        assert [(i.name, i.shape) for i in sess.get_inputs()] == [(t["name"], t["shape"]) for t in entry["inputs"]]
        assert [(o.name, o.shape) for o in sess.get_outputs()] == [(t["name"], t["shape"]) for t in entry["outputs"]]
    verify_hashes(tiny_bundle, manifest)
    tampered = tmp_path / "tampered"
    shutil.copytree(tiny_bundle, tampered)
    data = bytearray((tampered / "decoder.onnx").read_bytes())
    data[-1] ^= 1
    (tampered / "decoder.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256"):
        verify_hashes(tampered, manifest)


def test_validation_catches_spec_mismatch_and_broken_graphs(tiny_bundle, tmp_path):
    from exporters.validate import GraphCheckError, check_graph, interface_problems

    specs = graph_specs(read_manifest(tiny_bundle)["model"])
    check_graph(tiny_bundle / "decoder.onnx", specs["decoder"])
    encoder = onnx.load(str(tiny_bundle / "encoder.onnx"))
    assert interface_problems(encoder, specs["decoder"])                      # wrong graph for the spec
    encoder.graph.output[1].type.tensor_type.shape.dim[2].dim_param = "seq"    # a renamed symbolic dim
    assert interface_problems(encoder, specs["encoder"]) == [
        "output present.0.encoder.key has shape ['batch', 4, 'seq', 8], spec says ['batch', 4, 'src_len', 8]"]
    with pytest.raises(GraphCheckError, match="does not match its graph spec"):
        check_graph(tiny_bundle / "encoder.onnx", specs["decoder"])
    broken = onnx.load(str(tiny_bundle / "encoder.onnx"))
    broken.graph.node[0].input[0] = "no_such_tensor"
    onnx.save(broken, str(tmp_path / "broken.onnx"))
    with pytest.raises(GraphCheckError, match="fails the onnx checker"):
        check_graph(tmp_path / "broken.onnx")


# ------------------------------------------------------------------------------------------ parity

@pytest.mark.parametrize("batch, src_lens", [(1, [1]), (1, [37]), (3, [37, 1, 20])])
def test_graph_parity_batches_and_lengths(tiny_bundle, toy_model, batch, src_lens):
    report = graph_parity(toy_model, tiny_bundle, batch=batch, src_lens=src_lens, steps=16)
    assert report.ok, str(report)
    assert {c.graph for c in report.checks} == {"encoder", "decoder"}
    logits = next(c for c in report.checks if c.output == "logits")
    assert logits.steps == 17                                   # first step (past 0) + 16 cached steps


def test_graphs_accept_shapes_never_seen_at_export(tiny_bundle, toy_model):
    """Traced at batch 3, src 7, new 2, past 5; run at batch 5, src 50, a 3-token first step and 30 cached steps."""
    report = graph_parity(toy_model, tiny_bundle, batch=5, src_lens=[50, 3, 17, 1, 42], steps=30, first_len=3)
    assert report.ok, str(report)
    assert next(c for c in report.checks if c.output == "logits").steps == 31


def _random_step(model, past_len: int, new_len: int):
    """(new ids [2, new_len], source mask, random past [2, H, past_len, Dh] per layer, cross K/V) of two rows."""
    c = model.config
    ids = torch.randint(3, c.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    _, cross = model.encode(ids, mask)
    shape = (2, c.n_heads, past_len, c.head_dim)
    past = [(torch.randn(shape), torch.randn(shape)) for _ in cross]
    return torch.randint(3, c.vocab_size, (2, new_len)), mask, past, cross


def _decoder_feeds(new, mask, past, cross) -> dict:
    feeds = {"input_ids": new.numpy(), "encoder_attention_mask": mask.numpy()}
    for i, ((pk, pv), (ck, cv)) in enumerate(zip(past, cross)):
        feeds.update({f"past_key_values.{i}.decoder.key": pk.numpy(), f"past_key_values.{i}.decoder.value": pv.numpy(),
                      f"past_key_values.{i}.encoder.key": ck.numpy(), f"past_key_values.{i}.encoder.value": cv.numpy()})
    return feeds


@torch.no_grad()
def test_cached_step_with_several_new_tokens(tiny_bundle, toy_model):
    """new_len > 1 with a non-empty past (speculative/chunked decoding) is served by the same graph."""
    c = toy_model.config
    new, mask, past, cross = _random_step(toy_model, 4, 3)
    logits, presents = toy_model.decode_step(new, mask, past, cross)
    feeds = {**_decoder_feeds(new, mask, past, cross), **default_row_inputs(2, 4, 3)}
    sess = make_session(tiny_bundle / "decoder.onnx", "cpu")
    out = sess.run(["logits", "present.1.decoder.value"], feeds)
    assert out[0].shape == (2, 3, c.vocab_size) and out[1].shape == (2, c.n_heads, 7, c.head_dim)
    np.testing.assert_allclose(out[0], logits.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(out[1], presents[1][1].numpy(), atol=1e-4, rtol=0)


@torch.no_grad()
def test_rows_at_their_own_positions_equal_the_rows_alone(tiny_bundle, toy_model):
    """The per-row contract: row 1 joined 3 slots late (its first 3 cached slots are garbage, masked out, and its
    positions start 3 lower); the graph's output for it equals the row decoded alone with only its own past."""
    new, mask, past, cross = _random_step(toy_model, 6, 2)
    positions = torch.tensor([[6, 7], [3, 4]])
    key_mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    logits, presents = toy_model.decode_step(new, mask, past, cross, positions, key_mask)
    alone, _ = toy_model.decode_step(new[1:], mask[1:], [(k[1:, :, 3:], v[1:, :, 3:]) for k, v in past],
                                     [(k[1:], v[1:]) for k, v in cross])
    np.testing.assert_allclose(logits[1:].numpy(), alone.numpy(), atol=1e-5, rtol=0)
    default, _ = toy_model.decode_step(new, mask, past, cross)
    assert not np.allclose(logits[1].numpy(), default[1].numpy(), atol=1e-3)    # the mask and positions matter
    feeds = {**_decoder_feeds(new, mask, past, cross), POSITION_IDS: positions.numpy(),
             DECODER_ATTENTION_MASK: key_mask.numpy()}
    for path in (tiny_bundle / "decoder.onnx",):
        out = make_session(path, "cpu").run(["logits", "present.1.decoder.key"], feeds)
        np.testing.assert_allclose(out[0], logits.numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(out[1], presents[1][0].numpy(), atol=1e-4, rtol=0)


def test_reference_outputs_vary_and_constant_models_fail(tiny_bundle, toy_model):
    report = graph_parity(toy_model, tiny_bundle, batch=2, src_lens=[9, 4], steps=4)
    assert set(report.reference_std) == {"encoder_hidden_states", "logits"}
    assert all(std > MIN_REFERENCE_STD for std in report.reference_std.values()), report.reference_std
    dead = copy.deepcopy(toy_model)
    with torch.no_grad():
        for p in dead.parameters():
            p.zero_()
    dead_report = graph_parity(dead, {n: tiny_bundle / f"{n}.onnx" for n in ("encoder", "decoder")}, steps=2)
    assert not dead_report.ok
    assert set(dead_report.vacuous) == {"encoder_hidden_states", "logits"}
    assert "vacuously" in dead_report.summary()


def test_failure_names_graph_output_step_index_and_values(tiny_bundle, toy_model):
    changed = copy.deepcopy(toy_model)
    with torch.no_grad():
        changed.decoder.layers[-1].ffn.w_2.weight[0].add_(0.05)  # one feature (LayerNorm cancels uniform shifts)
    report = graph_parity(changed, tiny_bundle, steps=3)
    assert not report.ok
    assert all(c.ok for c in report.checks if c.graph == "encoder")
    failed = {c.output for c in report.failures}
    assert "logits" in failed and all(name.startswith(("logits", "present.")) for name in failed)
    logits = next(c for c in report.failures if c.output == "logits")
    assert logits.step is not None and len(logits.index) == 3 and logits.max_abs > 1e-4
    assert abs(logits.got - logits.expected) == pytest.approx(logits.max_abs, rel=1e-5)
    text = str(report)
    assert "parity FAILED" in text and "decoder output logits step" in text and "at index [" in text
    assert report.to_dict()["verified"] is False


def test_graphs_with_non_finite_weights_are_refused(tiny_bundle, toy_model, tmp_path, monkeypatch):
    """An exported graph whose initializers hold NaN/Inf is refused naming the tensor (exit 2), nothing written.
    The trace is replaced by the exported encoder with one NaN (the checks after it are the real ones)."""
    from exporters.validate import NonFiniteWeightsError

    proto = onnx.load(str(tiny_bundle / "encoder.onnx"))              # its weights.data read in
    init = next(i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and i.dims)
    array = onnx.numpy_helper.to_array(init).copy()
    array.flat[3] = np.nan
    init.CopyFrom(onnx.numpy_helper.from_array(array, init.name))
    traced = []

    def fake_export(module, spec, config, path, opset):
        traced.append(spec.name)
        onnx.save(proto, str(path))

    monkeypatch.setattr(E, "_export", fake_export)
    with pytest.raises(NonFiniteWeightsError, match=r"encoder\.onnx: weight \S+ holds 1 NaN/Inf") as err:
        E.export_model(toy_model, tmp_path / "out", check_parity=False)
    assert f"weight {init.name} holds" in str(err.value) and err.value.exit_code == 2 and "\n" not in str(err.value)
    assert traced == ["encoder"]
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


# ------------------------------------------------------------------------------------------ command line

def test_cli_export_pre_norm_gelu_untied_head_dim_6(cli_variant):
    ckpt, out, result = cli_variant
    assert result.exit_code == 0, result.output
    assert "exported encoder.onnx" in result.output and "exported decoder.onnx" in result.output
    assert "max abs" in result.output and "parity ok on cpu fp32" in result.output
    manifest = read_manifest(out)
    assert manifest["model"]["norm"] == "pre" and manifest["model"]["activation"] == "gelu"
    assert manifest["model"]["tie_embeddings"] is False and manifest["model"]["d_model"] // manifest["model"]["n_heads"] == 6
    model = load_checkpoint(ckpt).model
    for batch, lens in ((1, [1]), (3, [37, 1, 20])):
        report = graph_parity(model, out, batch=batch, src_lens=lens)
        assert report.ok, str(report)


def test_cli_inspect_exported_bundle(tiny_bundle):
    runner = CliRunner()
    text = runner.invoke(main, ["inspect", str(tiny_bundle)])
    assert text.exit_code == 0, text.output
    assert "decoder.onnx" in text.output and "MatMul" in text.output and "parity: verified" in text.output
    data = runner.invoke(main, ["inspect", str(tiny_bundle), "--json"])
    report = json.loads(data.output)
    assert report["graphs"]["decoder"]["op_counts"] == read_manifest(tiny_bundle)["graphs"]["decoder"]["op_counts"]


def test_cli_unloadable_checkpoint(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    for ckpt in (broken, tmp_path / "missing"):
        result = CliRunner().invoke(main, ["export", str(ckpt), "--out", str(tmp_path / "b")])
        assert result.exit_code == 2 and "error:" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "b").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("opset", ["17", "24"])
def test_cli_unsupported_opset(tmp_path, opset):
    result = CliRunner().invoke(main, ["export", str(tmp_path), "--out", str(tmp_path / "b"), "--opset", opset])
    assert result.exit_code == 2 and "18..23" in result.output
    assert not (tmp_path / "b").exists()


def test_cli_existing_and_unwritable_out(tmp_path, toy_model):
    ckpt = save_checkpoint(tmp_path / "ckpt", toy_model)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    for force in ([], ["--force"]):                                        # --force replaces bundles only
        result = CliRunner().invoke(main, ["export", str(ckpt), "--out", str(existing), *force])
        assert result.exit_code == 2 and "not an onnxformer bundle" in result.output and "even with --force" in result.output
    assert (existing / "keep.txt").read_text() == "mine"
    (tmp_path / "afile").write_text("x")
    result = CliRunner().invoke(main, ["export", str(ckpt), "--out", str(tmp_path / "afile" / "bundle")])
    assert result.exit_code == 2 and "not a directory" in result.output
    assert leftovers(tmp_path) == []


def test_cli_parity_failure_writes_nothing(tmp_path, copy_tiny_graphs):
    """Graphs of the trained toy model, checked against another model's weights: a real parity failure."""
    ckpt = save_checkpoint(tmp_path / "other", Transformer(preset("tiny"), seed=11))
    result = CliRunner().invoke(main, ["export", str(ckpt), "--out", str(tmp_path / "bundle")])
    assert result.exit_code == 1, result.output
    assert "parity FAILED" in result.output and "out of tolerance" in result.output and "NO" in result.output
    assert not (tmp_path / "bundle").exists() and leftovers(tmp_path) == []


def test_cli_force_replaces_a_bundle_and_copies_tokenizer(tmp_path, toy_model, copy_tiny_graphs):
    ckpt = save_checkpoint(tmp_path / "ckpt", toy_model, tokenizer=CharTokenizer("abcdefghij"))
    out = tmp_path / "bundle"
    first = CliRunner().invoke(main, ["export", str(ckpt), "--out", str(out)])
    assert first.exit_code == 0, first.output
    assert read_manifest(out)["tokenizer"] == "tokenizer.json"
    assert (out / "tokenizer.json").read_text() == (ckpt / "tokenizer.json").read_text()
    (out / "notes.txt").write_text("the user's, not ours")
    for force in ([], ["--force"]):                 # a bundle holding a file we did not write is never replaced
        again = CliRunner().invoke(main, ["export", str(ckpt), "--out", str(out), *force])
        assert again.exit_code == 2 and "notes.txt, which onnxformer did not write" in again.output
        assert (out / "notes.txt").read_text() == "the user's, not ours"
    (out / "notes.txt").unlink()
    again = CliRunner().invoke(main, ["export", str(ckpt), "--out", str(out)])
    assert again.exit_code == 2 and "already exists" in again.output
    forced = CliRunner().invoke(main, ["export", str(ckpt), "--out", str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    assert read_manifest(out)["parity"]["verified"] and sorted(p.name for p in out.iterdir()) == [
        "decoder.onnx", "encoder.onnx", "manifest.json", "tokenizer.json", "weights.data"]
    assert leftovers(tmp_path) == []


def test_interrupted_export_leaves_nothing(tmp_path, toy_model, monkeypatch):
    def interrupted(module, spec, config, path, opset):
        Path(path).write_bytes(b"half a graph")
        raise KeyboardInterrupt

    monkeypatch.setattr(E, "_export", interrupted)
    with pytest.raises(KeyboardInterrupt):
        E.export_model(toy_model, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists() and leftovers(tmp_path) == []
    with pytest.raises(ConfigError, match="18..23"):            # bad opset: refused before any work
        E.export_model(toy_model, tmp_path / "bundle", opset=12)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ the example model

def test_export_dates_example(tmp_path):
    if not (DATES / "config.json").exists():
        pytest.skip(f"{DATES} has not been trained yet (examples/dates/README.md says how); nothing to export")
    out = E.export_checkpoint(DATES, tmp_path / "dates")
    manifest = read_manifest(out)
    assert manifest["parity"]["verified"] and manifest["parity"]["max_abs"] <= tolerance("fp32", "cpu").atol
    assert manifest["tokenizer"] == "tokenizer.json" and (out / "tokenizer.json").exists()


# ------------------------------------------------------------------------------------------ the full grid (slow)

HEADS = [(32, 4), (24, 4), (36, 3), (32, 1), (32, 8), (24, 4), (36, 3), (32, 2)]   # head_dim 8, 6, 12, 32, 4, 6, 12, 16
GRID = [dict(norm=n, activation=a, tie_embeddings=t, d_model=d, n_heads=h)
        for (n, a, t), (d, h) in zip(itertools.product(("post", "pre"), ("relu", "gelu"), (True, False)), HEADS)]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", GRID, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_export_grid(tmp_path, overrides):
    model = Transformer(preset("tiny", **overrides), seed=3)
    out = E.export_model(model, tmp_path / "bundle")
    assert read_manifest(out)["parity"]["verified"]
    for batch, lens, steps in ((1, [1], 16), (3, [37, 1, 20], 16), (5, [50, 3, 17, 1, 42], 30)):
        report = graph_parity(model, out, batch=batch, src_lens=lens, steps=steps)
        assert report.ok, str(report)
