"""Generation, shared by every engine: pad a validated request's inputs (runtime.request), run the search, report.

An engine (PyTorch in toolkit/, ONNX Runtime in runtime/) provides

    engine.start(input_ids [B, S] int64, attention_mask [B, S] int64, expand: int, max_steps: int | None)
        -> DecodeState      (max_steps: the most steps the state will take; engines may size caches by it)

which runs the encoder once and returns a state whose rows are the inputs, each repeated `expand`
times (row b * expand + j), ready for `runtime.search`. An audio engine (`engine.feature_shape`, Whisper's) is given
its features [B, n_mels, frames] float32 as input_ids and, as attention_mask, ones over the encoder's positions
(the decoder's source mask: nothing is padded); `encoder_inputs` makes either pair from a request.
An engine with a vocabulary shortlist (`engine.shortlist`, runtime/shortlist.py) also takes `targets=` (each
input's forced prefix ids): its state then decodes on the shortlist, unless the request's options turn it off.
An engine may also provide `engine.encode(input_ids, attention_mask)` (the encoder's run alone) and take its
result as `start(..., encoded=)`: several decodes of the same inputs then share one encoder run (Whisper's window:
its first step for the language and the no-speech probability, then each fallback temperature).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol, Sequence

import numpy as np

from runtime.errors import NumericsError
from runtime.request import Request
from runtime.search import (DecodeState, Hypothesis, SearchOptions, max_steps, rows_per_input, search,
                            start_token)


class Engine(Protocol):
    pad_id: int
    bos_id: int                     # the decoder's start token
    eos_id: int
    vocab_size: int                 # target vocabulary (logits)
    src_vocab_size: int             # source vocabulary (input ids)
    src_pad_id: int                 # the id source rows are padded with (runtime.spec.source_pad_id)
    suppress_ids: tuple[int, ...]   # never generated (runtime.spec.suppressed_ids)
    forced_eos: bool                # EOS at the length limit by default (runtime.spec.forces_eos)
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
    logprobs: list[float] | None = None   # return_logprobs: each id's log-probability (aligned with ids)

    def to_dict(self) -> dict:
        """The record's fields; `logprobs` only when they were asked for."""
        record = asdict(self)
        if self.logprobs is None:
            del record["logprobs"]
        return record


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token id lists into input_ids and attention_mask (1 = token, 0 = padding), both int64."""
    width = max(len(s) for s in sequences)
    ids = np.full((len(sequences), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(sequences), width), dtype=np.int64)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask


def encoder_inputs(engine: Engine, sequences: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """What engine.start takes for a request's sequences: right-padded ids and their mask, or an audio encoder's
    stacked features [B, n_mels, frames] float32 and the decoder's source mask, ones [B, frames / 2]."""
    shape = getattr(engine, "feature_shape", None)
    if shape is None:
        return pad_batch(sequences, engine.src_pad_id)
    return np.stack(sequences).astype(np.float32), np.ones((len(sequences), shape[1] // 2), dtype=np.int64)


def generate(engine: Engine, request: Request, stop: np.ndarray | None = None,
             on_step=None, encoded: list | None = None) -> list[list[Hypothesis]]:
    """Hypotheses for each input of a validated request (runtime.request), in input order, best first.

    Each input stops at its own limit (request.limits: a server's merged batch gives each what it would get
    alone). `stop`: inputs the caller no longer needs, set while the search runs (runtime.search.greedy).
    `on_step(step, inputs, tokens)`: each step's tokens as they are chosen (greedy and sampling: runtime.search.greedy).
    A non-finite logit raises NumericsError naming, in `inputs`, the inputs whose rows gave it.
    `encoded`: the request's encoder outputs, already computed by `engine.encode` (the encoder is not run again).
    """
    opts, n = request.opts, len(request.sequences)
    state, start = start_search(engine, request, encoded), start_token(opts, engine.bos_id)
    if state is None:
        return search(None, n, start, engine.eos_id, opts)
    limits = np.asarray(request.limits, dtype=np.int64) if opts.beam == 1 else None
    try:
        return search(state, n, start, engine.eos_id, opts, limits, stop, on_step)
    except NumericsError as exc:
        exc.inputs = sorted({int(i) for i in state.inputs[exc.rows]})
        raise


def generate_ids(engine: Engine, sequences: Sequence, opts: SearchOptions,
                 limits: Sequence[int] | None = None, stop: np.ndarray | None = None) -> list[list[Hypothesis]]:
    """generate() for token id inputs (an audio engine's: log-mel feature arrays [n_mels, frames]): builds and
    validates their Request (InputError when the model cannot serve them). `limits`: each input's own max new
    tokens (greedy), at most opts.max_new_tokens."""
    return generate(engine, Request.build(engine, sequences, None, opts, limits), stop)


class RowsOf:
    """A DecodeState that knows which input each of its rows decodes (row b * expand + j starts as input b),
    so an error in a step's logits can name its inputs."""

    def __init__(self, state: DecodeState, n: int, expand: int):
        self.state, self.inputs = state, np.repeat(np.arange(n), expand)

    def step(self, tokens: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
        if keep is not None:
            self.inputs = self.inputs[keep]
        return self.state.step(tokens, keep)

    def feed(self, tokens: np.ndarray) -> np.ndarray:
        return self.state.feed(tokens)


def start_search(engine: Engine, request: Request, encoded: list | None = None) -> "RowsOf | None":
    """The validated request's decoder state (None when no token is to be generated: no encoder run): what
    runtime.search (or runtime.stream) runs. Its rows know their inputs (RowsOf). `encoded`: engine.encode's
    result for the request's inputs (an engine with `encode` takes it as start(encoded=))."""
    opts = request.opts
    if opts.max_new_tokens == 0:
        return None
    ids, mask = encoder_inputs(engine, request.sequences)
    expand = rows_per_input(opts)                                      # beams, or samples, per input
    extra = {}
    if opts.shortlist and getattr(engine, "shortlist", None) is not None:   # its rows may take their prefixes too
        extra["targets"] = [opts.prefix_ids[i] if opts.prefix_ids else () for i in range(len(ids))]
    if encoded is not None:
        extra["encoded"] = encoded
    return RowsOf(engine.start(ids, mask, expand, max_steps(opts), **extra), len(ids), expand)   # encoder runs once


def to_outputs(hyps: list[list[Hypothesis]], eos_id: int, tokenizer=None) -> list[Output]:
    """Flatten hypotheses into Output records (EOS stripped, text decoded when there is a tokenizer)."""
    outs = []
    for index, per_input in enumerate(hyps):
        for rank, h in enumerate(per_input):
            ids = h.tokens[:-1] if h.tokens and h.tokens[-1] == eos_id else list(h.tokens)
            text = tokenizer.decode(ids) if tokenizer is not None else None
            lps = None if h.logprobs is None else [round(float(x), 6) for x in h.logprobs[:len(ids)]]
            outs.append(Output(index, rank, text, [int(t) for t in ids], round(float(h.score), 6), h.finished, lps))
    return outs


def records(inputs: Sequence, outputs: list[Output]) -> list[dict]:
    """The JSON records of `onnxformer generate --json` (and the server's answers): the input beside each Output."""
    return [{"input": inputs[out.index], **out.to_dict()} for out in outputs]
