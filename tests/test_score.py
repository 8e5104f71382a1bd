"""runtime.score: teacher-forced log-probabilities of given targets, for every engine. (Against MarianMTModel's
`labels=`: tests/test_decoding_marian.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.bundle import load_bundle
from runtime.errors import InputError
from runtime.score import score_ids
from toolkit.parity.tolerances import tolerance
from toolkit.reference.checkpoint import load_checkpoint
from toolkit.reference.torch_engine import TorchEngine
from toolkit.testing.toy import toy_inputs


@pytest.fixture(scope="module")
def toy(toy_exported):
    checkpoint, bundle = toy_exported
    model = load_checkpoint(checkpoint).model
    return model, TorchEngine(model), load_bundle(bundle, "cpu").engine


@pytest.fixture(scope="module")
def pairs(toy):
    """Sources and targets of varied lengths (one empty: EOS alone is scored), targets random: scores vary."""
    config = toy[0].config
    sources = toy_inputs(config, 7, min_len=1, max_len=12, seed=11)
    targets = toy_inputs(config, 7, min_len=1, max_len=14, seed=12)
    targets[3] = []
    return sources, targets


@torch.no_grad()
def forward_logprobs(model, src: list[int], target: list[int]) -> np.ndarray:
    """log p of each of target + EOS by the model's training forward (no cache, no runtime), in float64."""
    c = model.config
    s, labels = torch.tensor([src]), torch.tensor(target + [c.eos_id])
    logp = torch.log_softmax(model(s, torch.ones_like(s), torch.tensor([[c.bos_id] + target])).double(), dim=-1)[0]
    return logp[torch.arange(len(labels)), labels].numpy()


def test_scores_equal_the_models_forward(toy, pairs):
    model, engine, _ = toy
    scored = score_ids(engine, *pairs)
    for s, src, tgt in zip(scored, *pairs):
        want = forward_logprobs(model, src, tgt)
        assert len(s.logprobs) == len(tgt) + 1
        np.testing.assert_allclose(s.logprobs, want, atol=1e-5)
        assert s.score == pytest.approx(float(np.sum(s.logprobs)), abs=1e-9)
    assert len({round(s.score, 3) for s in scored}) == len(scored)
    alone = score_ids(engine, pairs[0][:1], pairs[1][:1])[0]              # padding does not leak
    np.testing.assert_allclose(alone.logprobs, scored[0].logprobs, atol=1e-5)


def test_bundle_scores_equal_pytorch(toy, pairs):
    _, engine, bundle = toy
    limit = tolerance("fp32", "cpu").atol
    for ours, theirs in zip(score_ids(bundle, *pairs), score_ids(engine, *pairs)):
        np.testing.assert_allclose(ours.logprobs, theirs.logprobs, atol=limit)


def test_static_cache_bundle_scores_one_token_a_step(toy, pairs, toy_exported, tmp_path):
    from exporters.optimize import optimize_bundle

    static, report = optimize_bundle(toy_exported[1], tmp_path / "static", kv_cache="static")
    assert report.kv_cache == "static"
    limit = tolerance("fp32", "cpu").atol
    for ours, theirs in zip(score_ids(load_bundle(static, "cpu").engine, *pairs), score_ids(toy[1], *pairs)):
        np.testing.assert_allclose(ours.logprobs, theirs.logprobs, atol=limit)


def test_a_trailing_eos_is_not_doubled(toy, pairs):
    engine = toy[1]
    src, tgt = pairs[0][0], pairs[1][0]
    assert score_ids(engine, [src], [tgt + [engine.eos_id]]) == score_ids(engine, [src], [tgt])


@pytest.mark.parametrize("sources,targets,message", [
    ([[5]], [[5], [6]], "got 1 sources and 2 targets"),
    ([[5]], [[5, 99]], r"target 0 has token id\(s\) \[99\] outside the target vocabulary"),
    ([[5]], [[5, 2, 6]], "target 0 holds the end token 2 before its end"),
    ([[5]], [[5] * 64], "target 0 has 65 tokens with EOS, more than the model's maximum length 64"),
    ([[]], [[5]], "input 0 is empty"),
])
def test_bad_pairs_are_refused(toy, sources, targets, message):
    with pytest.raises(InputError, match=message):
        score_ids(toy[1], sources, targets)
