"""Greedy and beam search (runtime.search) driven by the PyTorch engine on a trained toy model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.errors import InputError
from runtime.generate import generate_ids, to_outputs
from runtime.search import SearchOptions, beam_search, greedy
from toolkit.testing.toy import toy_inputs
from toolkit.reference.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def engine(toy_model):
    return TorchEngine(toy_model)


@pytest.fixture(scope="module")
def inputs(toy_model):
    return toy_inputs(toy_model.config, 10, min_len=1, max_len=12, seed=3)


def start(engine, seqs, expand):
    from runtime.generate import pad_batch

    ids, mask = pad_batch(seqs, engine.pad_id)
    return engine.start(ids, mask, expand)


@torch.no_grad()
def sequence_logprob(model, src: list[int], tokens: list[int]) -> float:
    """Sum of log-probabilities of `tokens` given src, by teacher forcing (no search, no cache)."""
    c = model.config
    s = torch.tensor([src])
    tgt = torch.tensor([[c.bos_id] + tokens[:-1]])
    logp = torch.log_softmax(model(s, torch.ones_like(s), tgt).double(), dim=-1)[0]   # [T, V]
    return float(logp[torch.arange(len(tokens)), torch.tensor(tokens)].sum())


def test_trained_toy_outputs_vary(engine, inputs):
    hyps = generate_ids(engine, inputs, SearchOptions(max_new_tokens=16))
    assert len({tuple(h[0].tokens) for h in hyps}) >= len(inputs) // 2
    assert len({len(h[0].tokens) for h in hyps}) > 1, "rows should finish at different steps"


def test_beam_width_one_equals_greedy(engine, inputs):
    opts = SearchOptions(max_new_tokens=16, beam=1, length_penalty=0.0)
    g = greedy(start(engine, inputs, 1), len(inputs), engine.bos_id, engine.eos_id, opts)
    b = beam_search(start(engine, inputs, 1), len(inputs), engine.bos_id, engine.eos_id, opts)
    assert [h[0].tokens for h in g] == [h[0].tokens for h in b]
    # equal up to fp32 noise: greedy drops finished rows, beam search keeps them, so batch shapes differ
    assert [h[0].score for h in g] == pytest.approx([h[0].score for h in b], abs=1e-4)


@pytest.mark.parametrize("beam", [2, 4])
def test_wider_beams_are_ordered_by_score_and_distinct(engine, inputs, beam):
    hyps = generate_ids(engine, inputs, SearchOptions(max_new_tokens=16, beam=beam, num_return=beam))
    for per_input in hyps:
        assert len(per_input) == beam
        scores = [h.score for h in per_input]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in per_input}) == beam


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_beam_scores_are_length_normalized_log_probabilities(toy_model, engine, inputs, length_penalty):
    opts = SearchOptions(max_new_tokens=16, beam=3, num_return=3, length_penalty=length_penalty)
    for src, per_input in zip(inputs[:4], generate_ids(engine, inputs[:4], opts)):
        for h in per_input:
            expected = sequence_logprob(toy_model, src, h.tokens) / len(h.tokens) ** length_penalty
            assert h.score == pytest.approx(expected, abs=1e-4)


def test_greedy_scores_are_log_probabilities(toy_model, engine, inputs):
    for src, per_input in zip(inputs, generate_ids(engine, inputs, SearchOptions(max_new_tokens=16))):
        h = per_input[0]
        assert h.score == pytest.approx(sequence_logprob(toy_model, src, h.tokens), abs=1e-4)


@pytest.mark.parametrize("beam", [1, 3])
def test_eos_ends_hypotheses_and_is_stripped_from_outputs(engine, inputs, beam):
    hyps = generate_ids(engine, inputs, SearchOptions(max_new_tokens=20, beam=beam, num_return=beam))
    eos = engine.eos_id
    for per_input in hyps:
        for h in per_input:
            assert h.finished and h.tokens[-1] == eos and eos not in h.tokens[:-1]
    for out in to_outputs(hyps, eos):
        assert eos not in out.ids and out.finished


@pytest.mark.parametrize("beam", [1, 3])
def test_hypotheses_cut_at_max_new_tokens_are_unfinished(engine, inputs, beam):
    long_inputs = [s for s in inputs if len(s) >= 4]
    hyps = generate_ids(engine, long_inputs, SearchOptions(max_new_tokens=3, beam=beam))
    for per_input in hyps:
        h = per_input[0]
        assert len(h.tokens) <= 3
        assert h.finished == (h.tokens[-1] == engine.eos_id)
    assert any(not h[0].finished and len(h[0].tokens) == 3 for h in hyps)


def test_ignore_eos_generates_exactly_max_new_tokens(engine, inputs):
    hyps = generate_ids(engine, inputs, SearchOptions(max_new_tokens=7, ignore_eos=True))
    assert all(len(h[0].tokens) == 7 and engine.eos_id not in h[0].tokens for h in hyps)


def test_greedy_rows_finishing_at_different_steps_match_running_alone(engine, inputs):
    opts = SearchOptions(max_new_tokens=20)
    batched = generate_ids(engine, inputs, opts)
    lengths = [len(h[0].tokens) for h in batched]
    assert len(set(lengths)) > 1
    for seq, h in zip(inputs, batched):
        assert generate_ids(engine, [seq], opts)[0][0].tokens == h[0].tokens


def test_max_new_tokens_zero_and_one(engine, inputs):
    class NoStart:
        pad_id, bos_id, eos_id, vocab_size, max_len = 0, 1, 2, engine.vocab_size, engine.max_len
        src_vocab_size, src_pad_id, suppress_ids = engine.vocab_size, 0, ()

        def start(self, *args):
            raise AssertionError("max_new_tokens=0 must not run the model")

    zero = generate_ids(NoStart(), inputs, SearchOptions(max_new_tokens=0, beam=2, num_return=2))
    assert all(len(h) == 1 and h[0].tokens == [] and not h[0].finished for h in zero)
    full = generate_ids(engine, inputs, SearchOptions(max_new_tokens=16))
    for beam in (1, 3):
        one = generate_ids(engine, inputs, SearchOptions(max_new_tokens=1, beam=beam))
        assert all(len(h[0].tokens) == 1 for h in one)
        firsts = [h[0].tokens[0] for h in one]
        assert firsts == [h[0].tokens[0] for h in full]
        assert len(set(firsts)) > 1, "first tokens should vary with the input"


def test_num_return(engine, inputs):
    hyps = generate_ids(engine, inputs, SearchOptions(max_new_tokens=16, beam=4, num_return=2))
    assert all(len(h) == 2 for h in hyps)
    outs = to_outputs(hyps, engine.eos_id)
    assert [(o.index, o.rank) for o in outs] == [(i, r) for i in range(len(inputs)) for r in range(2)]
    with pytest.raises(InputError, match="number of returned hypotheses"):
        generate_ids(engine, inputs, SearchOptions(beam=2, num_return=3))


def test_bad_requests_are_refused(engine):
    with pytest.raises(InputError, match="empty"):
        generate_ids(engine, [[5], []], SearchOptions())
    with pytest.raises(InputError, match="maximum source length"):
        generate_ids(engine, [[5] * (engine.max_len + 1)], SearchOptions())
    with pytest.raises(InputError, match="outside the source vocabulary of 64 ids"):
        generate_ids(engine, [[5, engine.vocab_size]], SearchOptions())
    with pytest.raises(InputError, match="no inputs"):
        generate_ids(engine, [], SearchOptions())
    with pytest.raises(InputError, match="beam width"):
        generate_ids(engine, [[5]], SearchOptions(beam=0))


def test_beam_search_reorders_the_cache(toy_model, inputs):
    """Beams reorder rows through `keep`: the cached engine must follow them exactly as the uncached one."""
    opts = SearchOptions(max_new_tokens=16, beam=4, num_return=4, length_penalty=0.6)
    a = generate_ids(TorchEngine(toy_model, use_cache=True), inputs, opts)
    b = generate_ids(TorchEngine(toy_model, use_cache=False), inputs, opts)
    assert [[h.tokens for h in x] for x in a] == [[h.tokens for h in x] for x in b]
    assert np.allclose([[h.score for h in x] for x in a], [[h.score for h in x] for x in b], atol=1e-4)
