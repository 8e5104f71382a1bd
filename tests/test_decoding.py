"""Decoding controls on the trained toy model: validation, transformers' processors, sampling, prefixes, logprobs,
streaming. (Ids against MarianMTModel.generate: tests/test_decoding_marian.py; scoring: tests/test_score.py.)"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from runtime.bundle import load_bundle
from runtime.errors import InputError
from runtime.generate import generate_ids
from runtime.processors import Controls, draw, warp
from runtime.score import score_ids
from runtime.search import SearchOptions
from runtime.stream import Detokenizer, stream
from toolkit.reference.torch_engine import TorchEngine
from toolkit.testing.toy import toy_inputs


@pytest.fixture(scope="module")
def engines(toy_exported):
    """(PyTorch engine, fp32 bundle engine, bundle tokenizer) of conftest's exported toy."""
    from toolkit.reference.checkpoint import load_checkpoint

    checkpoint, bundle = toy_exported
    loaded = load_bundle(bundle, "cpu")
    return TorchEngine(load_checkpoint(checkpoint).model), loaded.engine, loaded.tokenizer


@pytest.fixture(scope="module")
def inputs(toy_model):
    return toy_inputs(toy_model.config, 8, min_len=3, max_len=12, seed=5)


BAD = [(dict(sample=True, beam=2), "sample draws one token"),
       (dict(sample=True, temperature=0.0), r"temperature must be a number in \(0, 100\]"),
       (dict(sample=True, top_k=-1), r"top_k must be an integer in \[0, 64\]"),
       (dict(sample=True, top_p=1.5), r"top_p must be a number in \(0, 1\]"),
       (dict(sample=True, top_p=float("nan")), "top_p must be"),
       (dict(sample=True, seed=-1), "seed must be an integer"),
       (dict(sample=True, num_return=65), r"num_return must be an integer in \[1, 64\]"),
       (dict(temperature=0.7), "temperature shapes sampling only; set sample"),
       (dict(sample=1), "sample must be true or false"),
       (dict(repetition_penalty=0.0), r"repetition_penalty must be a number in \(0, 100\]"),
       (dict(no_repeat_ngram_size=-2), "no_repeat_ngram_size must be an integer"),
       (dict(min_new_tokens=2.5), "min_new_tokens must be an integer"),
       (dict(bad_words_ids=((),)), r"bad_words_ids\[0\] must be a non-empty list"),
       (dict(bad_words_ids=((5, 64),)), r"bad_words_ids\[0\] has token id\(s\) \[64\] outside"),
       (dict(bad_words_ids=((2,),)), r"bad_words_ids\[0\] bans the end token 2 alone"),
       (dict(prefix_ids=((5,),), max_new_tokens=8), "prefix_ids must give one prefix per input"),
       (dict(prefix_ids=((5,), (2,)), max_new_tokens=8), r"prefix_ids\[1\] holds the end token"),
       (dict(prefix_ids=((5,), (6,)), max_new_tokens=0), "prefix_ids need max_new_tokens of at least 1"),
       (dict(prefix_ids=((5,) * 60, ()), max_new_tokens=8), r"prefix_ids\[0\] has 60 tokens"),
       (dict(sample=True, seed_index=(3,)), r"seed_index must give one index per input \(2\), got 1"),
       (dict(sample=True, seed_index=(3, -1)), r"seed_index\[1\] must be an integer"),
       (dict(seed_index=(3, 4)), "seed_index shapes sampling only; set sample")]


@pytest.mark.parametrize("options,message", BAD)
def test_out_of_range_options_are_refused_by_name(engines, options, message):
    with pytest.raises(InputError, match=message):
        generate_ids(engines[0], [[5, 6], [7, 8]], SearchOptions(**options))


def test_no_control_set_means_no_controls():
    """The default options take the plain path (Controls.of is None): no extra work per step; each control alone
    does not."""
    assert Controls.of(SearchOptions(), 2, 1, 2) is None
    for name, value in {"sample": True, "repetition_penalty": 1.2, "no_repeat_ngram_size": 2, "min_new_tokens": 1,
                        "bad_words_ids": ((5,),), "prefix_ids": ((5,), ()), "return_logprobs": True}.items():
        assert Controls.of(replace(SearchOptions(), **{name: value}), 2, 1, 2) is not None, name


def test_processors_equal_transformers_processors():
    """Each processor and warper gives exactly what transformers' gives, on logits that vary and histories that
    repeat tokens and n-grams."""
    from transformers.generation import logits_process as lp

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(6, 40)).astype(np.float32)
    history = rng.integers(0, 8, size=(6, 9))                          # small ids: repeats, n-grams recur
    t_logits, t_hist = torch.from_numpy(logits), torch.from_numpy(history)
    opts = SearchOptions(repetition_penalty=1.7, no_repeat_ngram_size=2, min_new_tokens=3,
                         bad_words_ids=((7,), (3, 4), (history[0, -2], history[0, -1], 9)))
    controls = Controls(opts, 6, 1, 2)
    generated = np.array([0, 1, 2, 3, 4, 5])
    want = t_logits
    for proc in (lp.RepetitionPenaltyLogitsProcessor(1.7), lp.NoRepeatNGramLogitsProcessor(2),
                 lp.NoBadWordsLogitsProcessor([list(map(int, w)) for w in opts.bad_words_ids], eos_token_id=2)):
        want = proc(t_hist, want)
    want = want.numpy().copy()
    want[generated < 3, 2] = -np.inf                                    # MinNewTokensLength, per row's count
    got = controls.process(logits, history, generated)
    np.testing.assert_array_equal(got, want)
    assert np.isinf(got).sum() > 6 and (got != logits).any(axis=1).all()    # the processors did bite
    for temperature, k, p in ((0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (1.3, 12, 0.6)):
        want = t_logits
        for warper, on in ((lp.TemperatureLogitsWarper(temperature), temperature != 1.0),
                           (lp.TopKLogitsWarper(max(k, 1)), k > 0), (lp.TopPLogitsWarper(p), p < 1.0)):
            want = warper(None, want) if on else want
        np.testing.assert_allclose(warp(logits, temperature, k, p), want.numpy(), rtol=1e-6)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """The p-value of Pearson's chi-square test of counts against probabilities (cells with probability > 0)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    return float(1 - torch.special.gammainc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 4, 1.0), (1.0, 0, 0.7),
                                                     (1.4, 6, 0.9)])
def test_sampling_follows_the_warped_distribution(temperature, top_k, top_p):
    """20000 draws on fixed logits: filtered tokens never come, the others at their warped softmax probability
    (chi-square p > 0.001 with a fixed seed, so the test cannot flake), and the distribution is not the unwarped one."""
    logits = np.array([[2.0, 1.5, 1.2, 0.9, 0.5, 0.2, 0.0, -0.4, -1.0, -2.0]], dtype=np.float32)
    warped = warp(logits, temperature, top_k, top_p)[0]
    probs = np.exp(warped - warped.max())
    probs /= probs.sum()
    n = 20000
    u = np.random.default_rng(1).random(n)
    tokens = draw(np.repeat(warp(logits, temperature, top_k, top_p), n, axis=0), u)
    counts = np.bincount(tokens, minlength=logits.shape[1])
    kept = probs > 0
    assert counts[~kept].sum() == 0
    assert kept.sum() == (top_k or 10) if top_p == 1.0 else kept.sum() < 10
    assert chi_square_p(counts[kept], probs[kept]) > 1e-3
    plain = np.exp(logits[0] - logits.max())
    if (temperature, top_k, top_p) != (1.0, 0, 1.0):                   # the warping shows
        assert chi_square_p(counts, plain / plain.sum()) < 1e-3


def test_samples_are_reproducible_per_row_and_equal_across_engines(engines, inputs):
    """Same seed, same tokens: on the PyTorch checkpoint and its fp32 bundle, alone or beside other inputs; each
    of num_return samples its own; another seed gives other samples."""
    torch_engine, bundle_engine, _ = engines
    opts = SearchOptions(max_new_tokens=14, sample=True, temperature=1.5, top_p=0.95, seed=7, num_return=3)
    ours = [[h.tokens for h in per] for per in generate_ids(torch_engine, inputs, opts)]
    assert ours == [[h.tokens for h in per] for per in generate_ids(bundle_engine, inputs, opts)]
    assert len({tuple(t) for per in ours for t in per}) >= len(inputs) * 2       # samples differ
    first = generate_ids(bundle_engine, inputs[:1] + inputs[5:], opts)[0]     # other neighbours
    assert [h.tokens for h in first] == ours[0]
    greedy = [h[0].tokens for h in generate_ids(torch_engine, inputs, SearchOptions(max_new_tokens=14))]
    assert sum(g not in per for g, per in zip(greedy, ours)) >= len(inputs) // 2   # not greedy in disguise
    other = [[h.tokens for h in per] for per in generate_ids(torch_engine, inputs, replace(opts, seed=8))]
    assert other != ours


@pytest.mark.parametrize("beam", [1, 3])
def test_prefix_is_forced_unscored_and_returned(engines, inputs, beam):
    """The ids start with the prefix; the bundle and PyTorch agree; the score counts only chosen tokens (beam: and
    normalizes by their number); logprobs give every token's log-probability, forced ones included, as teacher
    forcing (runtime.score) computes them."""
    torch_engine, bundle_engine, _ = engines
    prefixes = tuple(tuple(seq[-1:-3:-1]) if i % 3 else () for i, seq in enumerate(inputs))   # some inputs none
    opts = SearchOptions(max_new_tokens=10, beam=beam, prefix_ids=prefixes, return_logprobs=True)
    hyps = [h[0] for h in generate_ids(torch_engine, inputs, opts)]
    assert [h.tokens for h in hyps] == [h[0].tokens for h in generate_ids(bundle_engine, inputs, opts)]
    plain = [h[0].tokens for h in generate_ids(torch_engine, inputs, replace(opts, prefix_ids=()))]
    assert sum(h.tokens != p for h, p in zip(hyps, plain)) >= 3
    scored = score_ids(torch_engine, inputs, [h.tokens for h in hyps])
    for h, prefix, s in zip(hyps, prefixes, scored):
        assert tuple(h.tokens[:len(prefix)]) == prefix and len(h.logprobs) == len(h.tokens)
        np.testing.assert_allclose(h.logprobs, s.logprobs[:len(h.tokens)], atol=1e-5)
        chosen = sum(h.logprobs[len(prefix):])
        expected = chosen / (len(h.tokens) - len(prefix)) if beam > 1 else chosen
        assert h.score == pytest.approx(expected, abs=1e-5)


def test_greedy_logprobs_sum_to_the_score_and_sampling_logprobs_are_the_models(engines, inputs):
    torch_engine = engines[0]
    for opts in (SearchOptions(max_new_tokens=12, return_logprobs=True),
                 SearchOptions(max_new_tokens=12, return_logprobs=True, sample=True, seed=3, temperature=2.0)):
        hyps = [h[0] for h in generate_ids(torch_engine, inputs, opts)]
        scored = score_ids(torch_engine, inputs, [h.tokens for h in hyps])
        for h, s in zip(hyps, scored):
            assert sum(h.logprobs) == pytest.approx(h.score, abs=1e-9)
            np.testing.assert_allclose(h.logprobs, s.logprobs[:len(h.tokens)], atol=1e-5)
    assert generate_ids(torch_engine, inputs, SearchOptions(max_new_tokens=4))[0][0].logprobs is None


def limit_between_lengths(engine, inputs, opts: SearchOptions, width: int, need_ended: bool) -> int:
    """A max_new_tokens at which, on this model, some targets of `opts` reach the limit and (need_ended) some end
    before it: measured by decoding, not hoped for (another CPU's kernels train another toy model, whose targets
    end elsewhere: tried shortest limit first)."""
    seen = {}
    for limit in range(2, 16):
        hyps = [h[0] for h in generate_ids(engine, inputs, replace(opts, max_new_tokens=limit))]
        ended = sum(len(h.tokens) < width + limit for h in hyps)
        cut = sum(len(h.tokens) == width + limit and not h.finished for h in hyps)
        seen[limit] = (cut, ended)
        if cut and (ended or not need_ended):
            return limit
    raise AssertionError(f"no max_new_tokens in 2..15 has targets both cut at the limit and (needed: {need_ended}) "
                         f"ended before it on this model; (cut, ended) per limit: {seen}")


@pytest.mark.parametrize("extra", [{}, {"return_logprobs": True}, {"sample": True, "seed": 4},
                                   {"prefix_ids": ((9,),) * 8, "min_new_tokens": 30}])
def test_forced_eos_ends_a_target_at_its_limit_unscored(engines, inputs, extra):
    """forced_eos: a target that reaches max_new_tokens ends with EOS (finished), its other tokens as without it;
    EOS is not scored (its log-probability, where asked for, is the model's); ended targets are untouched. On the
    plain path, with logprobs, sampling (the same draws) and a prefix plus a minimum past the limit (which forced
    EOS overrides, as transformers' processors order it); bundle and PyTorch agree; one request turns it off.
    The limit is measured so that some targets reach it and some end before it (with the minimum, none can)."""
    torch_engine, bundle_engine, _ = engines
    eos, width = torch_engine.eos_id, len(extra.get("prefix_ids", ((),))[0])
    base = SearchOptions(return_logprobs=True, **{k: v for k, v in extra.items() if k != "return_logprobs"})
    limit = limit_between_lengths(torch_engine, inputs, base, width, need_ended="min_new_tokens" not in extra)
    opts = replace(base, max_new_tokens=limit)
    plain = [h[0] for h in generate_ids(torch_engine, inputs, opts)]
    forced = [h[0] for h in generate_ids(torch_engine, inputs, replace(opts, forced_eos=True))]
    assert [h[0].tokens for h in generate_ids(bundle_engine, inputs, replace(opts, forced_eos=True))] == \
        [h.tokens for h in forced]
    cut = 0
    for p, f in zip(plain, forced):
        if len(p.tokens) < width + limit:                             # ended before the limit: untouched
            assert (f.tokens, f.score, f.finished) == (p.tokens, p.score, True)
            continue
        cut += not p.finished
        assert f.tokens == p.tokens[:-1] + [eos] and f.finished
        assert f.score == pytest.approx(p.score - p.logprobs[-1], abs=1e-9)     # the last token is not scored
        assert f.logprobs[:-1] == p.logprobs[:-1] and np.isfinite(f.logprobs[-1]) and f.logprobs[-1] < 0
    assert cut > 0, (limit, cut)
    with pytest.raises(InputError, match="forced_eos ends a target with EOS .* ignore_eos never lets it end"):
        generate_ids(torch_engine, inputs, SearchOptions(forced_eos=True, ignore_eos=True))
    with pytest.raises(InputError, match="forced_eos must be true, false or unset"):
        generate_ids(torch_engine, inputs, SearchOptions(forced_eos=1))


def test_stream_pieces_join_to_the_generated_text(engines):
    _, bundle_engine, tokenizer = engines
    for opts in (SearchOptions(max_new_tokens=12), SearchOptions(max_new_tokens=12, sample=True, seed=1)):
        for text in ("abcdef", "HelloWorld42"):
            pieces = list(stream(bundle_engine, tokenizer, text, opts))
            hyp = generate_ids(bundle_engine, [tokenizer.encode(text)], opts)[0][0]
            assert "".join(pieces) == tokenizer.decode(hyp.tokens) and len(pieces) >= 3
    with pytest.raises(InputError, match="beam search .* knows its best hypothesis only at the end"):
        stream(bundle_engine, tokenizer, "abc", SearchOptions(beam=2))


class Bytes:
    """A byte-level tokenizer: token id = one UTF-8 byte (eos 256)."""

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_detokenizer_waits_for_the_rest_of_a_character():
    detok = Detokenizer(Bytes(), eos=256)
    pieces = [detok.push(b) for b in "aé€😀b".encode("utf-8")] + [detok.push(256), detok.flush()]
    assert [p for p in pieces if p] == ["a", "é", "€", "😀", "b"]


class Words:
    """A tokenizer that cleans up spaces around punctuation, as transformers decodes SentencePiece models."""

    clean_up = True
    words = ["", "", "", "it", "'", "s", "ok", ".", "do", "n't"]

    def decode(self, ids) -> str:
        from runtime.tokenizer import _clean_up_spaces

        return _clean_up_spaces(" ".join(self.words[i] for i in ids if i > 2))


def test_detokenizer_sends_whole_words_where_a_later_token_may_remove_a_space():
    detok = Detokenizer(Words(), eos=2)
    ids = [3, 4, 5, 6, 7, 8, 9, 7]
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == Words().decode(ids) == "it's ok. don't."
    assert [p for p in pieces if p] == ["it", "'s", " ok.", " don't."]   # never "it '", which "s" undoes


def test_a_part_of_a_split_request_samples_as_the_whole_does(engines, inputs):
    """seed_index gives each input of a part (Ray Data's batches) the generators of its position in the whole."""
    engine = engines[1]
    opts = SearchOptions(max_new_tokens=12, sample=True, temperature=1.5, seed=9, num_return=2)
    whole = [[h.tokens for h in per] for per in generate_ids(engine, inputs, opts)]
    for part in ([5, 6, 7], [2, 0]):
        got = generate_ids(engine, [inputs[i] for i in part], replace(opts, seed_index=tuple(part)))
        assert [[h.tokens for h in per] for per in got] == [whole[i] for i in part]
    unplaced = generate_ids(engine, inputs[5:8], opts)                # without it: the part's own positions
    assert [[h.tokens for h in per] for per in unplaced] != whole[5:8]
    plain = [[h.tokens for h in per] for per in generate_ids(engine, inputs[:3], opts)]
    assert plain == whole[:3]

