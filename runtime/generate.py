"""Generation requests, shared by every engine: validate and pad inputs, run the search, report results.

An engine (PyTorch in toolkit/, ONNX Runtime in runtime/) provides

    engine.start(input_ids [B, S] int64, attention_mask [B, S] int64, expand: int, max_steps: int | None)
        -> DecodeState      (max_steps: the most steps the state will take; engines may size caches by it)

which runs the encoder once and returns a state whose rows are the inputs, each repeated `expand`
times (row b * expand + j), ready for `runtime.search`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Protocol, Sequence

import numpy as np

from runtime.errors import InputError
from runtime.search import (DecodeState, Hypothesis, SearchOptions, check_options, max_steps, rows_per_input,
                            search)


class Engine(Protocol):
    pad_id: int
    bos_id: int                     # the decoder's start token
    eos_id: int
    vocab_size: int                 # target vocabulary (logits)
    src_vocab_size: int             # source vocabulary (input ids)
    src_pad_id: int                 # the id source rows are padded with (runtime.spec.source_pad_id)
    suppress_ids: tuple[int, ...]   # never generated (runtime.spec.suppressed_ids)
    max_len: int

    def start(self, input_ids: np.ndarray, attention_mask: np.ndarray, expand: int,
              max_steps: int | None = None) -> DecodeState: ...


@dataclass
class Output:
    """One returned hypothesis of one input, as printed by `onnxformer generate --json`."""

    index: int                      # position of the input in the request
    rank: int                       # 0 = best hypothesis
    text: str | None                # decoded text (None for models without a tokenizer)
    ids: list[int]                  # generated token ids, EOS excluded
    score: float                    # log-probability (beam: length-normalized)
    finished: bool                  # ended with EOS rather than at max_new_tokens

    def to_dict(self) -> dict:
        return asdict(self)


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token id lists into input_ids and attention_mask (1 = token, 0 = padding), both int64."""
    width = max(len(s) for s in sequences)
    ids = np.full((len(sequences), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(sequences), width), dtype=np.int64)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask


def check_request(sequences: Sequence[Sequence[int]], opts: SearchOptions, vocab_size: int, max_len: int,
                  eos: int = -1, target_vocab_size: int | None = None) -> None:
    """Refuse what the model cannot serve, naming the input and the fix; nothing is silently truncated. vocab_size:
    the source vocabulary (input ids); target_vocab_size (default the same) and eos: what the options' ids are
    checked against (runtime.search.check_options)."""
    if len(sequences) == 0:
        raise InputError("no inputs given; pass at least one text (or --ids) to generate from")
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise InputError(f"input {i} is empty; every input needs at least one token")
        if len(seq) > max_len:
            raise InputError(f"input {i} has {len(seq)} tokens, more than the model's maximum source length "
                             f"{max_len}; shorten or split it")
        bad = [t for t in seq if not 0 <= int(t) < vocab_size]
        if bad:
            raise InputError(f"input {i} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size}); "
                             f"use ids below {vocab_size}")
    check_options(opts, len(sequences), target_vocab_size or vocab_size, max_len, eos)


def generate_ids(engine: Engine, sequences: Sequence[Sequence[int]], opts: SearchOptions,
                 limits: Sequence[int] | None = None, stop: np.ndarray | None = None) -> list[list[Hypothesis]]:
    """Hypotheses for each input, in input order, best first.

    `limits`: each input's own max new tokens (greedy; a server batching requests that asked for different
    lengths: each gets what it would alone); opts.max_new_tokens must then be their maximum. `stop`: inputs the
    caller no longer needs, set while the search runs (runtime.search.greedy).
    """
    if limits is not None:                                             # a caller's mistake, before any work
        limits = np.asarray(limits, dtype=np.int64)
        if len(limits) != len(sequences) or not len(limits) or int(limits.max()) != opts.max_new_tokens \
                or int(limits.min()) < 0:
            raise ValueError("limits must give one max_new_tokens per input, at most opts.max_new_tokens")
    state, opts = start_search(engine, sequences, opts)
    return search(state, len(sequences), engine.bos_id, engine.eos_id, opts, limits, stop)


def start_search(engine: Engine, sequences: Sequence[Sequence[int]],
                 opts: SearchOptions) -> tuple[DecodeState | None, SearchOptions]:
    """The checked request's decoder state (None when no token is to be generated: no encoder run) and its options
    with the model's suppressed ids: what runtime.search (or runtime.stream) runs."""
    check_request(sequences, opts, engine.src_vocab_size, engine.max_len, engine.eos_id, engine.vocab_size)
    opts = replace(opts, suppress=tuple(engine.suppress_ids))
    if opts.max_new_tokens == 0:
        return None, opts
    ids, mask = pad_batch(sequences, engine.src_pad_id)
    return engine.start(ids, mask, rows_per_input(opts), max_steps(opts)), opts   # encoder runs once here


def to_outputs(hyps: list[list[Hypothesis]], eos_id: int, tokenizer=None) -> list[Output]:
    """Flatten hypotheses into Output records (EOS stripped, text decoded when there is a tokenizer)."""
    outs = []
    for index, per_input in enumerate(hyps):
        for rank, h in enumerate(per_input):
            ids = h.tokens[:-1] if h.tokens and h.tokens[-1] == eos_id else list(h.tokens)
            text = tokenizer.decode(ids) if tokenizer is not None else None
            outs.append(Output(index, rank, text, [int(t) for t in ids], round(float(h.score), 6), h.finished))
    return outs


def encode_inputs(inputs: list[str | list[int]], tokenizer) -> list[list[int]]:
    """Token ids of every input; text needs a tokenizer."""
    seqs = []
    for i, item in enumerate(inputs):
        if isinstance(item, list):
            seqs.append(item)
        elif tokenizer is None:
            raise InputError(f"input {i} is text, but this model has no tokenizer (tokenizer.json); "
                             f"pass token ids instead (--ids \"5 6 7\" on the command line, \"ids\" in a server request)")
        else:
            seqs.append(tokenizer.encode(item))
    return seqs


def records(inputs: Sequence, outputs: list[Output]) -> list[dict]:
    """The JSON records of `onnxformer generate --json` (and the server's answers): the input beside each Output."""
    return [{"input": inputs[out.index], **out.to_dict()} for out in outputs]
