"""`onnxformer parity CHECKPOINT BUNDLE`: graph and generation parity, exit 0 / 1 / 2, and the token comparison."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from runtime.manifest import file_entries, sha256_file
from runtime.tokenizer import CharTokenizer
from toolkit.reference.checkpoint import save_checkpoint
from toolkit.apps.cli import main
from toolkit.reference.config import preset
from toolkit.reference.model import Transformer
from toolkit.parity.generation import compare_tokens, generation_parity, parity_inputs
from toolkit.parity.tolerances import tolerance
from toolkit.reference.torch_engine import TorchEngine

HAS_CUDA = "CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers()
FAST = ["--samples", "16", "--max-new-tokens", "12"]


def parity(*args: str):
    return CliRunner().invoke(main, ["parity", *map(str, args)])


def test_parity_passes_with_tables(toy_exported):
    checkpoint, bundle = toy_exported
    threads = torch.get_num_threads()
    result = parity(checkpoint, bundle, "--provider", "cpu", *FAST)
    assert result.exit_code == 0, result.output
    assert torch.get_num_threads() == threads                     # --threads 1 held for the run only
    assert "parity ok on cpu fp32" in result.output
    assert "generation parity ok on cpu fp32 (tokens equal >= 100%)" in result.output
    assert "greedy" in result.output and "beam 4" in result.output and "16 random id sequences" in result.output


def test_parity_json_is_one_report(toy_exported):
    checkpoint, bundle = toy_exported
    result = parity(checkpoint, bundle, "--json", "--beam", "3", *FAST)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)                                # stdout holds the report alone (click >= 8.2)
    assert report["ok"] is True and report["precision"] == "fp32" and report["graphs"]["verified"] is True
    checks = report["generation"]["checks"]
    assert [c["search"] for c in checks] == ["greedy", "beam 3"]
    for c in checks:
        assert c["tokens_equal"] == 1.0 and c["sequences_equal"] == 1.0 and c["samples"] == 16
        assert c["distinct_outputs"] > 8 and c["first_mismatch"] is None


@pytest.fixture(scope="module")
def perturbed_bundle(toy_exported, tmp_path_factory) -> Path:
    """The toy bundle with noise added to the decoder's output projection (hashes updated: a well-formed bundle)."""
    import onnx
    from onnx import numpy_helper

    out = Path(shutil.copytree(toy_exported[1], tmp_path_factory.mktemp("perturbed") / "bundle"))
    graph = onnx.load(str(out / "decoder.onnx"))
    vocab_matrices = [t for t in graph.graph.initializer if list(t.dims) == [64, 32]]
    assert vocab_matrices, "no [vocab, d_model] initializer in decoder.onnx"
    rng = np.random.default_rng(0)
    for t in vocab_matrices:
        w = numpy_helper.to_array(t)
        t.CopyFrom(numpy_helper.from_array((w + rng.normal(0, 0.5, w.shape)).astype(np.float32), t.name))
    onnx.save(graph, str(out / "decoder.onnx"))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["graphs"]["decoder"].update(sha256=sha256_file(out / "decoder.onnx"),
                                         bytes=(out / "decoder.onnx").stat().st_size)
    manifest["files"] = file_entries(out)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_parity_outside_tolerance_exits_1(toy_exported, perturbed_bundle):
    result = parity(toy_exported[0], perturbed_bundle, *FAST)
    assert result.exit_code == 1, result.output
    assert "parity FAILED on cpu fp32" in result.output and "decoder output" in result.output
    assert "generation parity FAILED" in result.output and "first mismatch" in result.output
    as_json = parity(toy_exported[0], perturbed_bundle, "--json", *FAST)
    assert as_json.exit_code == 1
    report = json.loads(as_json.stdout)
    assert report["ok"] is False and report["generation"]["ok"] is False
    assert report["generation"]["checks"][0]["first_mismatch"]["position"] >= 0


@pytest.fixture
def other_checkpoint(tmp_path) -> Path:
    return save_checkpoint(tmp_path / "other", Transformer(preset("tiny", d_model=16), seed=3))


@pytest.mark.parametrize("case, message", [
    ("no bundle", "does not exist"),
    ("other model", "exported from another model"),
    ("samples 0", "--samples must be at least 1"),
    ("beam 0", "--beam must be at least 1"),
    ("threads 0", "--threads must be at least 1"),
])
def test_bad_input_exits_2(toy_exported, other_checkpoint, tmp_path, case, message):
    checkpoint, bundle = toy_exported
    args = {"no bundle": [checkpoint, tmp_path / "nothing"], "other model": [other_checkpoint, bundle],
            "samples 0": [checkpoint, bundle, "--samples", "0"], "beam 0": [checkpoint, bundle, "--beam", "0"],
            "threads 0": [checkpoint, bundle, "--threads", "0"]}[case]
    result = parity(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has CUDA")
def test_cuda_without_cuda_exits_2(toy_exported):
    result = parity(*toy_exported, "--provider", "cuda")
    assert result.exit_code == 2 and "CUDAExecutionProvider is not available" in result.output


# ------------------------------------------------------------------------------------------ the comparison

def test_compare_tokens_counts_positions_and_lengths():
    same, tokens, first = compare_tokens([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9, 7], [6]])
    assert same == pytest.approx(2 / 3)
    assert tokens == pytest.approx((3 + 1 + 1) / (3 + 3 + 1))          # the longer output counts
    assert first == {"index": 1, "position": 1, "pytorch": [4, 5], "onnxruntime": [4, 9, 7]}
    assert compare_tokens([[]], [[]]) == (1.0, 1.0, None)


def test_generation_parity_detects_a_different_model(toy_model_factory):
    model = toy_model_factory()
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.embed.lut.weight.add_(torch.randn(other.embed.lut.weight.shape, generator=torch.Generator().manual_seed(0)))
    seqs, source = parity_inputs(model.config, None, 12)
    same = generation_parity(TorchEngine(model), TorchEngine(model), seqs, tolerance("fp32", "cpu"), "cpu", "fp32",
                             beams=(1, 2), max_new_tokens=10, source=source)
    assert same.ok and [c.tokens_equal for c in same.checks] == [1.0, 1.0]
    differ = generation_parity(TorchEngine(model), TorchEngine(other), seqs, tolerance("fp32", "cpu"), "cpu", "fp32",
                               beams=(1,), max_new_tokens=10, source=source)
    assert not differ.ok and differ.checks[0].tokens_equal < 1.0
    assert "generation parity FAILED" in differ.summary() and differ.checks[0].first_mismatch["input"] in seqs


def test_the_token_verdict_turns_at_the_tables_threshold():
    """A report whose tokens equal 98.5% passes the int8 row (98%) and fails the fp16 row (99%) and fp32 (100%)."""
    from toolkit.parity.generation import GenerationCheck, GenerationReport

    def report(precision, provider, tokens_equal):
        tol = tolerance(precision, provider)
        check = GenerationCheck("greedy", 1, 200, 16, 0.9, tokens_equal, tol.token_match, 150)
        return GenerationReport(provider, precision, tol, "given inputs", [check])

    assert report("int8", "cpu", 0.985).ok and report("int8", "cpu", 0.98).ok
    assert not report("int8", "cpu", 0.979).ok
    assert not report("fp16", "cuda", 0.985).ok and report("fp16", "cuda", 0.99).ok
    assert not report("fp32", "cpu", 0.999).ok and report("fp32", "cpu", 1.0).ok
    assert "FAILED" in report("fp16", "cuda", 0.985).summary() and ">= 99%" in report("fp16", "cuda", 0.985).summary()


def test_inputs_are_dates_examples_for_a_dates_model_else_random():
    dates = pytest.importorskip("toolkit.reference.tasks.dates")
    tok = dates.make_tokenizer()
    config = preset("tiny", vocab_size=tok.vocab_size, max_len=dates.MAX_SOURCE_LEN)
    seqs, source = parity_inputs(config, tok, 30)
    assert source == "30 dates held-out examples"
    assert [tok.decode(s) for s in seqs] == [s for s, _ in dates.held_out_examples()[:30]]
    random_seqs, source = parity_inputs(config, CharTokenizer("abc"), 30)
    assert "random id sequences" in source and len({len(s) for s in random_seqs}) > 5
    assert all(3 <= t < config.vocab_size for s in random_seqs for t in s)


def test_the_comparator_raises_our_error_on_a_shape_mismatch():
    """A graph whose output has the wrong shape is a failed check (ParityError, exit 1), never an AssertionError."""
    from toolkit.parity import ParityError
    from toolkit.parity.graphs import OutputCheck
    from toolkit.parity.tolerances import tolerance

    check = OutputCheck("decoder", "logits", sides=("optimized", "source bundle"))
    check.fold(np.zeros((2, 3)), np.full((2, 3), 1e-5), tolerance("fp32", "cpu"), step=0)
    assert check.ok and check.max_abs == pytest.approx(1e-5) and check.steps == 1
    check.fold(np.zeros((2, 3)), np.array([[0, 0, 0], [0, 1, 0]]), tolerance("fp32", "cpu"), step=1)
    assert not check.ok and check.step == 1 and check.index == (1, 1) and "optimized 1 vs source bundle 0" in check.where()
    with pytest.raises(ParityError, match="decoder output logits step 2: optimized shape \\(2, 4\\), source bundle shape"):
        check.fold(np.zeros((2, 3)), np.zeros((2, 4)), tolerance("fp32", "cpu"), step=2)


# ------------------------------------------------------------------------------------------ the inputs judged

def test_parity_takes_source_texts_for_any_model_with_a_tokenizer(toy_exported, tmp_path):
    """--input texts go through the model's tokenizer (not only for a Marian reference); without them a text
    model's random-id verdict says plainly, in the table and the JSON, that it is not representative."""
    texts = tmp_path / "texts.txt"
    lines = ["abcdefgh", "Hello42", "zyxwvu", "QRSTab01", "mnopqrst", "AbCdEf", "xyz", "k5l6m7n8"]
    texts.write_text("\n".join(lines) + "\n")
    given = parity(*toy_exported, "--input", texts, "--json", *FAST)
    assert given.exit_code == 0, given.output
    gen = json.loads(given.stdout)["generation"]
    assert gen["source"] == "8 given source texts" and gen["representative"] is True
    assert [c["samples"] for c in gen["checks"]] == [8, 8]
    random_ids = parity(*toy_exported, "--json", *FAST)
    gen = json.loads(random_ids.stdout)["generation"]
    assert "random id sequences" in gen["source"] and gen["representative"] is False
    assert "not representative" in gen["summary"] and "--input" in gen["summary"]
    table = parity(*toy_exported, *FAST)
    assert "(NOT representative: this model reads text)" in table.output


def test_parity_refuses_texts_for_a_model_without_a_tokenizer(toy_model_factory, tmp_path):
    from toolkit.parity.inputs import choose_inputs
    from runtime.errors import InputError

    with pytest.raises(InputError, match="--input texts need a model with a tokenizer"):
        choose_inputs(toy_model_factory().config, None, 8, ["abc"])
    ids = choose_inputs(toy_model_factory().config, None, 8)
    assert ids.representative and ids.note is None               # ids are what an ids model reads


def test_optimize_gate_and_parity_judge_the_same_inputs_by_default(toy_exported):
    """The gate's token check and `onnxformer parity` draw the same inputs, as many, by one rule."""
    from runtime.manifest import read_manifest
    from toolkit.parity.gate import bundle_gate
    from toolkit.parity.inputs import DEFAULT_SAMPLES

    bundle = toy_exported[1]
    manifest = read_manifest(bundle)
    paths = {g: bundle / manifest["graphs"][g]["file"] for g in ("encoder", "decoder")}
    gate = bundle_gate(paths, paths, manifest, bundle, "cpu", "fp32")["generation"]
    report = json.loads(parity(*toy_exported, "--json", "--beam", "1", "--max-new-tokens", "4").stdout)
    assert gate["samples"] == report["generation"]["checks"][0]["samples"] == DEFAULT_SAMPLES
    assert gate["source"] == report["generation"]["source"] and gate["representative"] is False


# ------------------------------------------------------------------------------------------ the first mismatch

def test_the_first_mismatch_shows_the_tokens_around_it():
    """Outputs equal for their first 14 tokens: the line shows positions 10..22, the differing token marked."""
    from toolkit.parity.report import mismatch_window

    ref = list(range(10, 40))
    got = ref[:14] + [99] + ref[15:20]
    _, _, first = compare_tokens([ref], [got])
    line = mismatch_window(first, "onnxruntime", "pytorch")
    assert line == ("input 0 at position 14 (tokens 10..22): onnxruntime ... 20 21 22 23 >99< 25 26 27 28 29 "
                    "vs pytorch ... 20 21 22 23 >24< 25 26 27 28 29 30 31 32 ...")
    _, _, first = compare_tokens([[5, 6, 7]], [[5, 6]])
    assert mismatch_window(first, "onnxruntime", "pytorch") == ("input 0 at position 2 (tokens 0..10): "
                                                               "onnxruntime 5 6 >end< vs pytorch 5 6 >7<")


def test_a_failed_parity_names_the_differing_tokens(toy_exported, perturbed_bundle):
    result = parity(toy_exported[0], perturbed_bundle, "--json", *FAST)
    gen = json.loads(result.stdout)["generation"]
    failed = next(c for c in gen["checks"] if c["verdict"] == "failed")
    m = failed["first_mismatch"]
    pos = m["position"]
    ours, theirs = (m[side][pos] if pos < len(m[side]) else "end" for side in ("pytorch", "onnxruntime"))
    assert ours != theirs and f">{ours}<" in gen["summary"] and f">{theirs}<" in gen["summary"]
