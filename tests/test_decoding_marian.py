"""Decoding controls against transformers' own generate: an imported tiny Marian's ids equal MarianMTModel.generate's.

For each control transformers has (repetition_penalty, no_repeat_ngram_size, min_new_tokens, bad_words_ids, a
decoder prefix through decoder_input_ids), greedy and beam: our search over the imported PyTorch model
(TorchEngine + generate_ids) gives the very ids MarianMTModel.generate gives. Each case also checks that the
control changed the outputs of some inputs (a control that did nothing would pass trivially), and the model's
outputs vary (>= 16 distinct of 32). One search per control runs in the fast suite, the other is slow.
"""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from runtime.generate import generate_ids, pad_batch  # noqa: E402
from runtime.score import score_ids  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from runtime.stream import stream  # noqa: E402
from toolkit.parity.original import hf_pad, load_original  # noqa: E402
from toolkit.reference.checkpoint import load_checkpoint  # noqa: E402
from toolkit.reference.importers import import_model  # noqa: E402
from toolkit.reference.torch_engine import TorchEngine  # noqa: E402
from toolkit.testing.tiny_marian import build_tiny_marian, corpus  # noqa: E402

TEXTS = corpus(n=32, seed=3)
MAX_NEW = 16


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    """(our TorchEngine over the imported checkpoint, MarianMTModel, token ids of TEXTS, plain greedy outputs)."""
    root = tmp_path_factory.mktemp("marian-decoding")
    directory = build_tiny_marian(root / "opus-mt-tiny", steps=150)
    checkpoint = load_checkpoint(import_model(directory, root / "checkpoint"))
    model, tok = load_original(directory)
    seqs = [tok(t)["input_ids"] for t in TEXTS]
    plain = hf_generate(model, seqs, 1)
    assert len({tuple(p) for p in plain}) >= 16                    # outputs that vary: token equality means something
    return TorchEngine(checkpoint.model), model, seqs, plain, checkpoint.tokenizer


def hf_generate(model, seqs: list[list[int]], beam: int, prefix=None, max_new: int = MAX_NEW,
                **controls) -> list[list[int]]:
    """MarianMTModel.generate's best hypothesis per input (start token dropped, cut after EOS) with `controls` as
    GenerationConfig fields; prefix: decoder_input_ids after the start token (equal lengths)."""
    from transformers import GenerationConfig

    c = model.config
    bad = [[c.pad_token_id]] + [list(w) for w in controls.pop("bad_words_ids", ())]
    controls.setdefault("forced_eos_token_id", None)                 # (the tiny model's own is None as well)
    gc = GenerationConfig(num_beams=beam, max_new_tokens=max_new, do_sample=False, early_stopping="never",
                          num_return_sequences=1, bad_words_ids=bad, decoder_start_token_id=c.decoder_start_token_id,
                          eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
                          forced_bos_token_id=None, min_length=0, use_cache=True, **controls)
    ids, mask = pad_batch(seqs, hf_pad(model))
    extra = {}
    if prefix is not None:
        extra["decoder_input_ids"] = torch.tensor([[c.decoder_start_token_id, *p] for p in prefix])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = model.generate(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                             generation_config=gc, **extra)
    out = []
    for row in gen[:, 1:].tolist():
        out.append(row[: row.index(c.eos_token_id) + 1] if c.eos_token_id in row else row)
    return out


def cases(plain: list[list[int]], eos: int) -> dict:
    """Each control's settings, chosen from the plain outputs so that they bite: the most frequent token and
    bigram banned, prefixes taken from other inputs' outputs, a minimum beyond most outputs' length."""
    tokens = Counter(t for p in plain for t in p if t != eos)
    bigrams = Counter(tuple(p[i:i + 2]) for p in plain for i in range(len(p) - 1) if eos not in p[i:i + 2])
    starts = [p[:2] for p in plain if len(p) >= 3 and eos not in p[:2]]
    prefix = [starts[(i + 1) % len(starts)] for i in range(len(plain))]
    return {
        "repetition_penalty": {"repetition_penalty": 1.6},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
        "min_new_tokens": {"min_new_tokens": int(np.percentile([len(p) for p in plain], 75)) + 1},
        "bad_words_ids": {"bad_words_ids": ((tokens.most_common(1)[0][0],), bigrams.most_common(1)[0][0])},
        "prefix_ids": {"prefix": prefix},
    }


FAST = {"repetition_penalty": 4, "no_repeat_ngram_size": 1, "min_new_tokens": 4, "bad_words_ids": 1,
        "prefix_ids": 4}                                              # the search of each control that runs fast
CASES = [pytest.param(control, beam, marks=() if FAST[control] == beam else pytest.mark.slow)
         for control in FAST for beam in (1, 4)]


@pytest.mark.parametrize("control,beam", CASES)
def test_control_ids_equal_marian_generate(marian, control, beam):
    engine, model, seqs, plain, _ = marian
    settings = dict(cases(plain, engine.eos_id)[control])
    prefix = settings.pop("prefix", None)
    want = hf_generate(model, seqs, beam, prefix=prefix, **settings)
    if prefix is not None:
        settings["prefix_ids"] = tuple(tuple(p) for p in prefix)
    opts = SearchOptions(max_new_tokens=MAX_NEW, beam=beam, **settings)
    got = [h[0].tokens for h in generate_ids(engine, seqs, opts)]
    baseline = plain if beam == 1 else hf_generate(model, seqs, beam)
    assert sum(w != b for w, b in zip(want, baseline)) >= 4        # the control changed outputs
    assert got == want


@pytest.mark.parametrize("beam", [1, 4])
def test_forced_eos_ids_equal_marian_generate(marian, beam):
    """forced_eos (transformers' forced_eos_token_id, which opus-mt configs set): an output reaching the limit ends
    with EOS there, forced and not scored. The limit is the unforced outputs' median length, so that outputs that end
    themselves and outputs cut by the limit mix (measured per search: beam's outputs run longer, by how much this
    model decides); the ids equal generate's, which differ from generate's without."""
    engine, model, seqs, plain, _ = marian
    limit = int(np.median([len(p) for p in (plain if beam == 1 else hf_generate(model, seqs, beam))]))
    want = hf_generate(model, seqs, beam, max_new=limit, forced_eos_token_id=engine.eos_id)
    unforced = hf_generate(model, seqs, beam, max_new=limit)
    assert sum(w != u for w, u in zip(want, unforced)) >= 4                # forcing changed outputs
    assert sum(len(w) < limit for w in want) >= 2                          # and some ended before the limit
    got = generate_ids(engine, seqs, SearchOptions(max_new_tokens=limit, beam=beam, forced_eos=True))
    assert [h[0].tokens for h in got] == want
    assert all(h[0].finished for h in got)                                  # every output now ends with EOS


def test_scores_equal_marian_labels(marian):
    """score_ids on the imported model: each target token's log-probability as MarianMTModel computes it from
    labels= (its loss's terms), within 1e-5 in float32; targets of varied lengths in one padded batch."""
    engine, model, seqs, plain, _ = marian
    targets = [p[:-1] if p and p[-1] == engine.eos_id else p for p in plain]
    targets = [t[::-1] if i % 2 else t for i, t in enumerate(targets)]     # some unlikely targets too
    scored = score_ids(engine, seqs, targets)
    ids, mask = pad_batch(seqs, hf_pad(model))
    labels = torch.tensor(pad_batch([t + [engine.eos_id] for t in targets], -100)[0])
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                       labels=labels).logits
    logp = torch.log_softmax(logits, dim=-1)
    for row, (s, t) in enumerate(zip(scored, targets)):
        want = logp[row, torch.arange(len(t) + 1), labels[row, :len(t) + 1]].numpy()
        np.testing.assert_allclose(s.logprobs, want, atol=1e-5)
    assert len({round(s.score, 3) for s in scored}) >= 16


def test_stream_pieces_join_to_the_generated_text(marian):
    engine, _, seqs, _, tokenizer = marian
    opts, spaced = SearchOptions(max_new_tokens=MAX_NEW), 0
    for text in TEXTS[:6]:
        pieces = list(stream(engine, tokenizer, text, opts))
        hyp = generate_ids(engine, [tokenizer.encode(text)], opts)[0][0]
        assert "".join(pieces) == tokenizer.decode(hyp.tokens) and len(pieces) >= 3
        spaced += sum(p.startswith(" ") for p in pieces)
    assert spaced >= 2                                                  # SentencePiece word starts became spaces
