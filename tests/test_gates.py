"""Gates that gate: a token verdict needs reference outputs that vary (else "inconclusive", then teacher-forced
logits), and optimize refuses a bundle whose gate is not "ok" (exit 1, nothing at --out) unless
--allow-unverified writes it marked unverified. Generic over precisions: the tolerance table's row decides."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from exporters.int8_recipes import NAMES
from runtime.manifest import read_manifest
from toolkit.reference.checkpoint import load_checkpoint, save_checkpoint
from toolkit.apps.cli import main
from toolkit.reference.config import preset
from toolkit.reference.model import Transformer
from toolkit.parity.generation import GenerationCheck
from toolkit.parity.report import combine, needed_distinct

FAST = ("--samples", "16", "--beam", "1", "--max-new-tokens", "8")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def check(distinct, tokens_equal=1.0, samples=32, teacher=None):
    return GenerationCheck("greedy", 1, samples, 8, tokens_equal, tokens_equal, 0.98, distinct, None, teacher)


def test_a_token_verdict_needs_varied_reference_outputs():
    assert needed_distinct(8) == 4 and needed_distinct(100) == 25
    assert check(8).verdict == "ok" and check(8).basis == "tokens"
    assert check(7).verdict == "inconclusive" and check(7).basis == "teacher-forced logits"   # 7 < 32 / 4
    assert check(3, samples=8).verdict == "inconclusive"                                     # 3 < 4
    assert check(1, tokens_equal=0.5).verdict == "failed"          # disagreement fails whatever the variety
    assert check(2, teacher={"verdict": "ok"}).verdict == "ok"
    assert check(2, teacher={"verdict": "failed"}).verdict == "failed"
    assert check(2, teacher={"verdict": "inconclusive"}).verdict == "inconclusive"
    assert combine(["ok", "inconclusive"]) == "inconclusive" and combine(["inconclusive", "failed"]) == "failed"
    assert combine([]) == "inconclusive" and combine(["ok", "ok"]) == "ok"


def test_every_report_composes_its_verdict_by_the_same_rule():
    """Generation, original-framework and combined reports: one verdict vocabulary, one combination, the same
    JSON keys; "not judged" (a report-only row) counts for nothing."""
    from toolkit.parity.generation import GenerationReport
    from toolkit.parity.original import OriginalCheck, OriginalReport
    from toolkit.parity.report import Combined
    from toolkit.parity.tolerances import tolerance

    def original(*verdicts):
        return OriginalReport("marian/", "bundle/", 32, "32 texts",
                              [OriginalCheck(f"check {i}", v, v) for i, v in enumerate(verdicts)])

    def generation(*checks):
        return GenerationReport("cpu", "int8", tolerance("int8", "cpu"), "32 texts", list(checks))

    assert original("ok", "ok").verdict == "ok" and original("ok", "inconclusive").verdict == "inconclusive"
    assert original("inconclusive", "failed").verdict == "failed" and not original("failed").ok
    assert generation(check(8), check(1, tokens_equal=0.5)).verdict == "failed"
    both = Combined({"original": original("ok"), "generation": generation(check(7))})
    assert both.verdict == "inconclusive" and not both.ok and "generation inconclusive" in both.summary()
    assert combine(["not judged", "ok"]) == "ok" and combine(["not judged"]) == "inconclusive"
    for report in (original("failed"), generation(check(8)), both):
        record = report.to_dict()
        assert {"ok", "verdict", "summary"} <= set(record) and record["verdict"] in ("ok", "failed", "inconclusive")


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    """A random-weight tiny checkpoint (it emits nearly the same output for every input) and its fp32 bundle."""
    root = tmp_path_factory.mktemp("random")
    assert run("init", "--preset", "tiny", "--out", root / "ckpt", "--seed", "2").exit_code == 0
    result = run("export", root / "ckpt", "--out", root / "fp32")
    assert result.exit_code == 0, result.output
    return root / "ckpt", root / "fp32"


def test_parity_on_uniform_outputs_says_inconclusive_tokens_and_judges_teacher_forced_logits(random_model):
    ckpt, bundle = random_model
    result = run("parity", ckpt, bundle, *FAST, "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    gen = record["generation"]["checks"][0]
    assert gen["distinct_outputs"] < gen["needed_distinct"], gen                # the outputs do not vary
    assert gen["basis"] == "teacher-forced logits" and gen["verdict"] == "ok" and record["verdict"] == "ok"
    tf = gen["teacher_forced"]
    assert tf["positions"] >= 16 and tf["max_abs"] <= tf["limit"] == 1e-4 and tf["reference_std"] > 1e-3
    text = run("parity", ckpt, bundle, *FAST)
    assert "teacher-forced logits" in text.stdout and "verdict: ok" in text.stdout
    assert read_manifest(bundle)["parity"]["verdict"] == "ok"                    # the export gate's verdict


def test_teacher_forced_logits_catch_a_changed_model_whose_tokens_agree(random_model, tmp_path):
    """Another random model emits the same uniform tokens; its logits differ: failed, never ok."""
    ckpt, bundle = random_model
    from toolkit.parity.generation import generation_parity
    from toolkit.parity.tolerances import tolerance
    from toolkit.reference.torch_engine import TorchEngine

    model = load_checkpoint(ckpt).model
    other = Transformer(model.config, seed=2)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 64, int(n)).tolist() for n in rng.integers(1, 12, 16)]
    report = generation_parity(TorchEngine(model), TorchEngine(other), seqs, tolerance("fp32", "cpu"), "cpu", "fp32",
                               beams=(1,), max_new_tokens=8)
    c = report.checks[0]
    assert c.tokens_equal >= 0.98 and not c.varied
    assert c.verdict == "failed" and c.teacher_forced["max_abs"] > 1e-4 and "FAILED" in report.summary()


def test_teacher_forced_in_two_passes_equals_the_lockstep_comparison(random_model):
    """teacher_forced runs the reference first (its logits spilled to a file) and then the candidate, given engines or
    makers of them; its figures are those of feeding both side by side."""
    from runtime.generate import pad_batch
    from toolkit.parity.generation import teacher_forced
    from toolkit.parity.tolerances import tolerance
    from toolkit.reference.torch_engine import TorchEngine

    model = load_checkpoint(random_model[0]).model
    other = Transformer(model.config, seed=2)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, 64, int(n)).tolist() for n in rng.integers(1, 12, 70)]       # two chunks of 64
    tokens = [rng.integers(3, 64, int(n)).tolist() for n in rng.integers(0, 7, 70)]      # some outputs empty
    ref, got = TorchEngine(model), TorchEngine(other)
    worst, same, rows = 0.0, 0, []
    for start in range(0, 70, 64):                        # the lockstep comparison, written out
        chunk, outs = seqs[start:start + 64], tokens[start:start + 64]
        length = max(1, max(len(t) for t in outs))
        ids, mask = pad_batch(chunk, ref.pad_id)
        states = [e.start(ids, mask, 1, length) for e in (ref, got)]
        feed = np.full(len(chunk), ref.bos_id, dtype=np.int64)
        for pos in range(length):
            a, b = (s.step(feed, None) for s in states)
            keep = np.asarray([pos < len(t) for t in outs])
            worst = max(worst, float(np.abs(b[keep].astype(np.float64) - a[keep]).max(initial=0.0)))
            same += int((a[keep].argmax(-1) == b[keep].argmax(-1)).sum())
            rows.append(a[keep])
            feed = np.asarray([t[pos] if pos < len(t) else ref.eos_id for t in outs], dtype=np.int64)
    positions = sum(len(t) for t in tokens)
    tol = tolerance("fp32", "cpu")
    for pair in ((ref, got), (lambda: TorchEngine(model), lambda: TorchEngine(other))):
        tf = teacher_forced(*pair, seqs, tokens, tol)
        assert tf["positions"] == positions and tf["max_abs"] == pytest.approx(worst, rel=1e-6) and worst > 1e-4
        assert tf["argmax_equal"] == same / positions and tf["verdict"] == "failed"
        assert tf["reference_std"] == pytest.approx(float(np.concatenate(rows).std(axis=0).mean()), rel=1e-4)


def test_the_gate_holds_one_model_at_a_time(toy_exported, tmp_path, monkeypatch):
    """optimize's gate compares the new graphs with the source bundle's: each side's sessions are made in its turn
    and freed before the other's are made (graph comparison, token check), so its memory peak is one model's
    sessions, not two; in the graph comparison, one graph's."""
    import weakref

    import runtime.ort_engine
    import toolkit.parity.graphs as graphs
    from exporters.optimize import optimize_bundle

    live, most = weakref.WeakSet(), []

    def counted(cls):
        class Counted(cls):
            def __init__(self, *args, **kwargs):
                most.append(len(live))                     # how many were alive when this one was made
                super().__init__(*args, **kwargs)
                live.add(self)
        return Counted

    sessions, alive = weakref.WeakSet(), []
    make_session = graphs.make_session

    def made(*args, **kwargs):                             # the graph comparison's sessions
        alive.append(len(sessions))
        session = make_session(*args, **kwargs)
        sessions.add(session)
        return session

    monkeypatch.setattr(graphs, "Feed", counted(graphs.Feed))
    monkeypatch.setattr(graphs, "make_session", made)
    monkeypatch.setattr(runtime.ort_engine, "Feed", counted(runtime.ort_engine.Feed))
    _, report = optimize_bundle(toy_exported[1], tmp_path / "fp32", samples=16)
    assert report.parity["verdict"] == "ok" and report.parity["generation"]["basis"] == "tokens"
    assert len(most) == 4 and max(most) == 0, most      # graphs: source, candidate; tokens: source, candidate
    # within a side, one graph at a time: the encoder's session is gone before the decoder's is made (export's
    # gate too: NLLB's embedding is in both graphs)
    assert alive == [0, 0, 0, 0], alive


def test_optimize_int8_of_uniform_outputs_is_refused_unless_allowed(random_model, tmp_path):
    """Before: verified (100% equal tokens of one repeated output). Now: inconclusive, exit 1, nothing written."""
    _, bundle = random_model
    out = tmp_path / "int8"
    result = run("optimize", bundle, "--out", out, "--precision", "int8", "--per-tensor")
    assert result.exit_code == 1, result.output
    assert "INCONCLUSIVE" in result.stderr and "--allow-unverified" in result.stderr and "Traceback" not in result.output
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".onnxformer-" in p.name]
    result = run("optimize", bundle, "--out", out, "--precision", "int8", "--per-tensor", "--allow-unverified")
    assert result.exit_code == 0, result.output
    parity = read_manifest(out)["parity"]
    assert parity["verified"] is False and parity["verdict"] == "inconclusive" and parity["allowed_unverified"]
    assert "UNVERIFIED" in result.stdout
    assert "NOT verified" in run("inspect", out).stdout


def test_optimize_int8_below_the_token_row_exits_1_and_writes_nothing(toy_exported, tmp_path):
    """The trained toy model keeps only ~89% of its greedy tokens in int8 (a tiny model quantizes badly). Before:
    written with "verified": false that nothing read. Now: exit 1 and nothing at --out, unless allowed."""
    _, bundle = toy_exported
    out = tmp_path / "int8"
    result = run("optimize", bundle, "--out", out, "--precision", "int8")
    assert result.exit_code == 1, result.output
    assert "did not pass the gate" in result.stderr and "greedy tokens failed" in result.stderr
    assert "(needed 98%)" in result.stderr and "Traceback" not in result.output
    tried = re.findall(r"([\w-]+) [\d.]+% tokens \((\w+)\)", result.stderr)     # each recipe's figure, in order
    assert tried == [(name, "failed") for name in NAMES], result.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".onnxformer-" in p.name]
    allowed = run("optimize", bundle, "--out", out, "--precision", "int8", "--allow-unverified", "--json")
    assert allowed.exit_code == 0, allowed.output
    parity = read_manifest(out)["parity"]
    assert parity["verdict"] == "failed" and parity["verdicts"]["tokens"] == "failed" and not parity["verified"]
    assert parity["allowed_unverified"] and parity["generation"]["basis"] == "tokens"
    assert parity["generation"]["tokens_equal"] < 0.98 <= parity["generation"]["token_match"]
    assert json.loads(allowed.stdout)["parity"]["verdict"] == "failed"


def int8_scales(bundle: Path) -> dict[str, tuple]:
    """{weight: shape of its int8 scale} of the MatMul weights quantize_dynamic made (NAME_quantized, NAME_scale)."""
    import onnx
    from onnx import numpy_helper

    scales = {}
    for g in ("encoder", "decoder"):
        inits = {i.name: i for i in onnx.load(str(bundle / f"{g}.onnx"), load_external_data=False).graph.initializer}
        for name in inits:
            if name.endswith("_quantized") and name[:-len("_quantized")] + "_scale" in inits:
                scales[name[:-len("_quantized")]] = numpy_helper.to_array(inits[name[:-len("_quantized")] + "_scale"]).shape
    return scales


def test_packed_weights_get_per_channel_scales_even_per_tensor(toy_exported, tmp_path):
    """Q/K/V of a layer and the cross K/V of every decoder layer are one matrix after packing: one scale each
    output channel there (the rest stays per tensor), so the cross K/V of all layers no longer share one scale."""
    _, bundle = toy_exported
    out = tmp_path / "int8"
    assert run("optimize", bundle, "--out", out, "--precision", "int8", "--per-tensor",
               "--allow-unverified").exit_code == 0
    scales = int8_scales(out)
    packed = {k: v for k, v in scales.items() if ".packed.weight" in k}
    others = {k: v for k, v in scales.items() if ".packed.weight" not in k}
    assert len(packed) >= 3 and all(len(shape) == 1 and shape[0] > 1 for shape in packed.values()), packed
    assert others and all(shape == () for shape in others.values()), others


@pytest.mark.slow
def test_a_key_channel_outlier_costs_per_tensor_int8_its_tokens_but_not_packed_per_channel(toy_exported, tmp_path):
    """The trained toy model with one key channel per self-attention scaled 100x and its query channel 1/100 (the
    same function: q . k is unchanged and attention runs in float). One scale for the packed Q/K/V (before) loses
    most greedy tokens; per-channel scales on the packed weights (now) keep as many as on the plain model."""
    ckpt, bundle = toy_exported
    loaded = load_checkpoint(ckpt)
    model = loaded.model
    with torch.no_grad():
        for layer in [*model.encoder.layers, *model.decoder.layers]:
            for proj, factor in ((layer.self_attn.k_proj, 100.0), (layer.self_attn.q_proj, 0.01)):
                proj.weight[0].mul_(factor)
                proj.bias[0].mul_(factor)
    save_checkpoint(tmp_path / "ckpt", model, loaded.tokenizer)
    assert run("export", tmp_path / "ckpt", "--out", tmp_path / "fp32").exit_code == 0
    import exporters.precision as P
    from exporters.optimize import optimize_bundle

    tokens = {}      # weight bits: auto (7 where 8-bit products saturate), so the outlier alone is judged
    for name, source, packed in (("plain", bundle, True), ("outlier", tmp_path / "fp32", True),
                                 ("outlier, one scale", tmp_path / "fp32", False)):
        real = P.to_int8
        P.to_int8 = lambda m, pc=True, rr=False, pp=True, packed=packed, **kw: real(m, pc, rr, packed, **kw)
        try:
            _, report = optimize_bundle(source, tmp_path / name, precision="int8", recipe="default",
                                        allow_unverified=True)
        finally:
            P.to_int8 = real
        tokens[name] = report.parity["generation"]["tokens_equal"]
    print(f"int8 greedy tokens equal: {tokens}")
    assert tokens["outlier, one scale"] < tokens["plain"] - 0.3
    assert tokens["outlier"] >= tokens["plain"] - 0.02
