"""The one request type (runtime/request.py): validated once, source ids against the SOURCE vocabulary and target
options against the target one; batch keys and merges derive from every option (a new option is never dropped);
a non-finite logit is an error naming its inputs, never an empty answer; `generate` on models whose source
vocabulary is larger or smaller than the target's."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from runtime.errors import InputError, NumericsError
from runtime.generate import generate, generate_ids
from runtime.request import PER_INPUT, Request, differing, merge, search_options, split
from runtime.search import SearchOptions

MODEL = SimpleNamespace(vocab_size=64, src_vocab_size=40, suppress_ids=(0,), eos_id=2, max_len=20)


@dataclasses.dataclass
class Extended(SearchOptions):
    """SearchOptions with one more option, as a new decoding control adds one."""

    diversity: float = 0.0


def test_source_ids_are_checked_against_the_source_vocabulary_and_targets_against_the_target():
    assert Request.build(MODEL, [[39, 5]]).sequences == [[39, 5]]
    with pytest.raises(InputError, match=r"input 1 has token id\(s\) \[40\] outside the source vocabulary of 40 ids; "
                                         r"use source ids 0..39"):
        Request.build(MODEL, [[5], [40, 6]])
    with pytest.raises(InputError, match="suppressed token id.* outside the target vocabulary of 64 ids"):
        Request.build(MODEL, [[5]], opts=SearchOptions(max_new_tokens=4, suppress=(64,)))
    request = Request.build(MODEL, [[5]], opts=SearchOptions(max_new_tokens=4, suppress=(63,)))
    assert request.opts.suppress == (0, 63)                      # the model's own and the caller's


def test_the_default_and_every_refusal_name_the_input_and_fix():
    assert search_options(MODEL).max_new_tokens == 20            # min(64, max_len)
    assert search_options(SimpleNamespace(max_len=512)).max_new_tokens == 64
    assert search_options(MODEL, max_new_tokens=0, beam=3).beam == 3
    for inputs, message in [([], "no inputs given"), (["  "], "input 0 is empty"), ([[5], []], "input 1 is empty"),
                            ([[5] * 21], "maximum source length 20"), (["abc"], "no tokenizer")]:
        with pytest.raises(InputError, match=message):
            Request.build(MODEL, inputs)
    for opts, message in [(SearchOptions(max_new_tokens=21), "between 0 and the model's maximum length 20"),
                          (SearchOptions(max_new_tokens=4, beam=0), "beam width"),
                          (SearchOptions(max_new_tokens=4, beam=2, num_return=3), "number of returned"),
                          (SearchOptions(max_new_tokens=4, beam=2, length_penalty=float("nan")), "length penalty")]:
        with pytest.raises(InputError, match=message):
            Request.build(MODEL, [[5]], opts=opts)


def test_batch_keys_and_merges_carry_every_option_a_new_one_included():
    names = {f.name for f in dataclasses.fields(Extended)}
    greedy = Request.build(MODEL, [[5]], opts=Extended(max_new_tokens=4))
    assert {name for name, _ in greedy.batch_key} == (names - set(PER_INPUT) - {"prefix_ids"}) | {"prefix"}
    longer = Request.build(MODEL, [[6], [7]], opts=Extended(max_new_tokens=9))
    warmer = Request.build(MODEL, [[6]], opts=Extended(max_new_tokens=4, diversity=0.5))
    assert longer.batch_key == greedy.batch_key and warmer.batch_key != greedy.batch_key
    merged = merge([greedy, longer])
    assert type(merged.opts) is Extended and merged.opts.max_new_tokens == 9 and merged.limits == [4, 9, 9]
    assert merged.sequences == [[5], [6], [7]]
    with pytest.raises(ValueError, match="equal batch keys"):
        merge([greedy, warmer])
    beam = Request.build(MODEL, [[5]], opts=Extended(max_new_tokens=4, beam=2))
    assert ("max_new_tokens", 4) in beam.batch_key                # beam inputs share one length
    assert differing(warmer.opts, greedy.opts, ("max_new_tokens",)) == ["diversity"]


def test_split_cuts_inputs_limits_and_per_input_options_and_keeps_the_rest():
    request = Request.build(MODEL, [[5], [6, 7], [8], [9]], opts=Extended(max_new_tokens=6, diversity=0.5,
                                                                      prefix_ids=((3,), (), (4, 4), (5,))),
                            limits=[6, 2, 6, 3])
    parts = split(request, 3)
    assert [p.sequences for p in parts] == [[[5], [6, 7], [8]], [[9]]] and [p.limits for p in parts] == [[6, 2, 6], [3]]
    assert [p.opts.prefix_ids for p in parts] == [((3,), (), (4, 4)), ((5,),)]
    assert all(type(p.opts) is Extended and p.opts.diversity == 0.5 and p.opts.suppress == (0,) for p in parts)
    again = merge(split(Request.build(MODEL, [[5], [6], [7]], opts=Extended(max_new_tokens=4)), 2))
    assert again.sequences == [[5], [6], [7]] and again.limits == [4, 4, 4]
    with pytest.raises(InputError, match="batch size must be at least 1, got 0"):
        split(request, 0)


class Poisoned:
    """The engine, but the rows of inputs that start with POISON give NaN logits from their third step on."""

    POISON = 9

    def __init__(self, engine):
        self.inner = engine

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, ids, mask, expand, max_steps=None):
        bad = np.repeat(ids[:, 0] == self.POISON, expand)             # per row: row b * expand + j is input b's
        return PoisonedState(self.inner.start(ids, mask, expand, max_steps), bad)


class PoisonedState:
    def __init__(self, state, bad):
        self.state, self.bad, self.steps = state, bad, 0

    def step(self, tokens, keep):
        if keep is not None:
            self.bad = self.bad[keep]
        logits = self.state.step(tokens, keep)
        self.steps += 1
        if self.steps >= 3:
            logits[self.bad] = np.nan
        return logits


@pytest.mark.parametrize("beam", [1, 3])
def test_a_non_finite_logit_is_an_error_naming_its_inputs(toy_model, beam):
    from toolkit.reference.torch_engine import TorchEngine

    engine = Poisoned(TorchEngine(toy_model))
    seqs = [[5, 6, 7], [9, 8, 7], [4, 5], [9, 4]]
    opts = SearchOptions(max_new_tokens=8, beam=beam, ignore_eos=True)
    with pytest.raises(NumericsError, match="non-finite logit") as caught:
        generate(engine, Request.build(engine, seqs, opts=opts))
    assert caught.value.inputs == [1, 3] and caught.value.exit_code == 1
    fine = generate_ids(engine, [seqs[0], seqs[2]], opts)           # the same inputs without the poisoned ones
    assert [len(h[0].tokens) for h in fine] == [8, 8]


def test_generate_on_separate_vocabularies(tmp_path, toy_model_factory):
    """A source vocabulary larger than the target's: a source id above the target vocabulary is served; one at or
    above the source vocabulary is exit 2 naming its size."""
    from toolkit.apps.cli import main
    from toolkit.reference.checkpoint import save_checkpoint
    from toolkit.reference.config import preset
    from toolkit.reference.model import Transformer

    config = preset("tiny", src_vocab_size=80, share_embeddings=False)
    checkpoint = save_checkpoint(tmp_path / "ckpt", Transformer(config, seed=1))
    served = CliRunner().invoke(main, ["generate", str(checkpoint), "--ids", "70 79 5", "--max-new-tokens", "3"])
    assert served.exit_code == 0 and len(served.stdout.split()) <= 3, served.output
    refused = CliRunner().invoke(main, ["generate", str(checkpoint), "--ids", "5 80", "--max-new-tokens", "3"])
    assert refused.exit_code == 2 and "outside the source vocabulary of 80 ids" in refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.output
    blank = CliRunner().invoke(main, ["generate", str(checkpoint), " "])
    assert blank.exit_code == 2 and "input 0 is empty" in blank.stderr


def test_requests_with_prefixes_or_sampling_decode_alone():
    """A sample's generator is seeded by the input's index in its request, and inputs with different prefixes need
    their own: merging such a request with another would change its output, so its batch key is its own. Inputs
    that share one prefix (a target language) batch with other requests of that prefix only."""
    plain = [Request.build(MODEL, [[5]], opts=SearchOptions(max_new_tokens=4)) for _ in range(2)]
    assert plain[0].batch_key == plain[1].batch_key
    for opts in (SearchOptions(max_new_tokens=4, sample=True, seed=3),
                 SearchOptions(max_new_tokens=4, prefix_ids=((7,), (8,)))):
        a, b = (Request.build(MODEL, [[5], [6]], opts=opts) for _ in range(2))
        assert a.batch_key != b.batch_key and a.batch_key != plain[0].batch_key
    shared = [Request.build(MODEL, [[5]] * n, opts=SearchOptions(max_new_tokens=4, prefix_ids=((7,),) * n))
              for n in (1, 2)]
    other = Request.build(MODEL, [[5]], opts=SearchOptions(max_new_tokens=4, prefix_ids=((8,),)))
    assert shared[0].batch_key == shared[1].batch_key not in (other.batch_key, plain[0].batch_key)
    assert merge(shared).opts.prefix_ids == ((7,),) * 3
