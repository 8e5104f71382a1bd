"""Scoring given translations: the log-probability a model gives each token of a target, teacher-forced.

    scored = score_ids(engine, sources, targets)      # any engine: PyTorch, a bundle of either decoder layout
    scored[i].logprobs                                # one per target token, EOS included (appended)
    scored[i].score                                   # their sum: log p(target | source)
    records = score_texts(engine, tokenizer, ["source text"], ["target text"])   # `onnxformer score --json`

The decoder reads the start token and the target (without its last token) and its logits at each position give
the next token's log-probability, as transformers computes a loss from `labels=`. In the dynamic layout the whole
target goes through one decoder run (position_ids [batch, new_len]); a static cache takes one token a step.
Targets are right-padded to the longest: the decoder's causal mask keeps padding from earlier positions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from runtime.errors import InputError
from runtime.generate import Engine, pad_batch
from runtime.request import check_sources, encode_inputs, encode_target
from runtime.search import chosen_logprob


@dataclass
class Scored:
    """One target's teacher-forced log-probabilities."""

    logprobs: list[float]           # log p(token | source, earlier tokens), one per target token, EOS last
    score: float                    # their sum
    ids: list[int] = field(default_factory=list)   # the target's ids, EOS last (aligned with logprobs)

    def to_dict(self) -> dict:
        return asdict(self)


def target_ids(targets: Sequence[Sequence[int]], vocab_size: int, max_len: int, eos: int) -> list[list[int]]:
    """Each target with EOS appended (unless it already ends with it), checked: ids in the vocabulary, EOS only last,
    at most max_len tokens with EOS."""
    out = []
    for i, target in enumerate(targets):
        ids = [int(t) for t in target]
        ids = ids if ids and ids[-1] == eos else ids + [eos]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InputError(f"target {i} has token id(s) {bad[:5]} outside the target vocabulary [0, {vocab_size}); "
                             f"use ids below {vocab_size}")
        if eos in ids[:-1]:
            raise InputError(f"target {i} holds the end token {eos} before its end; score what precedes it")
        if len(ids) > max_len:
            raise InputError(f"target {i} has {len(ids)} tokens with EOS, more than the model's maximum length "
                             f"{max_len}; shorten it")
        out.append(ids)
    return out


def score_ids(engine: Engine, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]) -> list[Scored]:
    """Teacher-forced log-probabilities of each (source, target) pair, in input order (see the module docstring)."""
    if len(sources) != len(targets):
        raise InputError(f"got {len(sources)} sources and {len(targets)} targets; give one target per source")
    check_sources(sources, engine)
    wanted = target_ids(targets, engine.vocab_size, engine.max_len, engine.eos_id)
    width = max(len(t) for t in wanted)
    fed = np.full((len(wanted), width), engine.bos_id, dtype=np.int64)   # start token, then the target's tokens
    labels = np.full((len(wanted), width), engine.bos_id, dtype=np.int64)
    for row, ids in enumerate(wanted):
        fed[row, 1:len(ids)] = ids[:-1]
        labels[row, :len(ids)] = ids
    ids, mask = pad_batch(sources, engine.src_pad_id)
    logits = engine.start(ids, mask, 1, width).feed(fed)                  # [B, T, V]
    logp = chosen_logprob(logits.reshape(-1, logits.shape[-1]), labels.ravel()).reshape(labels.shape)
    return [Scored([float(x) for x in logp[row, :len(t)]], float(logp[row, :len(t)].sum()), t)
            for row, t in enumerate(wanted)]


def score_texts(engine: Engine, tokenizer, sources: Sequence, targets: Sequence) -> list[dict]:
    """The records of `onnxformer score --json` (and of the server's /v1/score): each (source, target) pair's target
    ids (target side, EOS appended), their teacher-forced log-probabilities (`token_logprobs`) and their sum
    (`score`). Sources and targets are texts, or token id lists (a target's without EOS); records echo them."""
    source_ids = encode_inputs(list(sources), tokenizer)
    target_seqs = [list(t) if not isinstance(t, str) else encode_target(tokenizer, "target", i, t, "target ids")
                   for i, t in enumerate(targets)]
    scored = score_ids(engine, source_ids, target_seqs)
    return [{"index": i, "source": src, "target": tgt, "ids": s.ids, "token_logprobs": s.logprobs, "score": s.score}
            for i, (src, tgt, s) in enumerate(zip(sources, targets, scored))]
