"""Greedy and beam search over any engine, in numpy.

One search serves every engine (PyTorch with or without cache, ONNX Runtime on any provider), so
engines can differ only in their numbers, never in how tokens are chosen. An engine gives a
`DecodeState` per request:

    state.step(tokens [N] int64, keep [N'] int64 | None) -> logits [N', vocab] float32

`keep` selects, before the step, which current rows go on (and in what order): beam search
reorders hypotheses with it, greedy search drops finished rows with it. The state reorders its
self-attention cache by `keep`; rows that stay with their source need no cross-attention copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class DecodeState(Protocol):
    def step(self, tokens: np.ndarray, keep: np.ndarray | None) -> np.ndarray: ...


@dataclass
class Hypothesis:
    """One generated sequence: token ids (without the start token, with EOS if reached) and its score."""

    tokens: list[int]
    score: float                  # sum of token log-probabilities, divided by len ** length_penalty (beam)
    finished: bool = True         # ended with EOS (False: stopped at max_new_tokens)


@dataclass
class SearchOptions:
    max_new_tokens: int = 64
    beam: int = 1                 # 1 = greedy
    length_penalty: float = 1.0   # beam scores are log-prob / len ** length_penalty
    num_return: int = 1           # hypotheses returned per input (<= beam)
    ignore_eos: bool = False      # never stop at EOS (benchmarks: every engine does the same work)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities [N, V]: float32 elementwise, the normalizer summed in float64 (8x cheaper than all-float64)."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float64)).astype(shifted.dtype)


def chosen_logprob(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """log p(token) per row [N], without materializing the whole log-softmax."""
    rows = np.arange(len(tokens))
    top = logits.max(axis=-1)
    norm = np.log(np.exp(logits - top[:, None]).sum(axis=-1, dtype=np.float64))
    return logits[rows, tokens].astype(np.float64) - top - norm


def top_k_stable(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row, best first, ties by lower index: the first k of a stable argsort
    of -x, found with a partial sort (the full sort of beam * vocab candidates cost ~2.7 ms a step per input)."""
    if k >= x.shape[1]:
        return np.argsort(-x, axis=1, kind="stable")
    kth = -np.partition(-x, k - 1, axis=1)[:, k - 1]               # the k-th largest value of each row
    out = np.empty((x.shape[0], k), dtype=np.int64)
    for r, (row, t) in enumerate(zip(x, kth)):
        idx = np.flatnonzero(row >= t)                               # every candidate that can be in the top k
        out[r] = idx[np.argsort(-row[idx], kind="stable")[:k]]       # idx is ascending: ties stay by index
    return out


def greedy(state: DecodeState, batch: int, bos: int, eos: int, opts: SearchOptions,
           limits: np.ndarray | None = None, stop: np.ndarray | None = None) -> list[list[Hypothesis]]:
    """Pick the most likely token each step; finished rows leave the batch, so only live rows are computed.

    `limits` gives each input its own most new tokens (default: opts.max_new_tokens for all): a row leaves when
    it reaches its limit, with the tokens and score an unbatched search with that limit gives. `stop` is a bool
    array the caller may set from another thread while the search runs (a server's client went away): that
    input's row leaves at the next step and its hypothesis is what it had so far.
    """
    limits = np.full(batch, opts.max_new_tokens) if limits is None else np.asarray(limits)
    stop = np.zeros(batch, dtype=bool) if stop is None else stop
    tokens: list[list[int]] = [[] for _ in range(batch)]
    scores = np.zeros(batch, dtype=np.float64)
    done = [False] * batch
    live = np.flatnonzero((limits > 0) & ~stop)     # which inputs the state's rows belong to
    last = np.full(len(live), bos, dtype=np.int64)  # the token each live row feeds next
    keep = None if len(live) == batch else live
    for step in range(int(limits.max(initial=0))):
        if len(live) == 0:
            break
        logits = state.step(last, keep)             # [live, V]
        if opts.ignore_eos:
            logits[:, eos] = -np.inf
        nxt = logits.argmax(axis=-1)
        scores[live] += chosen_logprob(logits, nxt)
        for row, item in enumerate(live):
            tokens[item].append(int(nxt[row]))
            done[item] = bool(nxt[row] == eos)
        alive = np.flatnonzero((nxt != eos) & (limits[live] > step + 1) & ~stop[live])
        keep = None if len(alive) == len(live) else alive
        live, last = live[alive], nxt[alive].astype(np.int64)
    return [[Hypothesis(tokens[i], float(scores[i]), done[i])] for i in range(batch)]


def beam_search(state: DecodeState, batch: int, bos: int, eos: int, opts: SearchOptions,
                stop: np.ndarray | None = None) -> list[list[Hypothesis]]:
    """Keep the `beam` best partial hypotheses per input; return the best finished ones by normalized score.

    `stop` (as in greedy): once every input is stopped, the search ends early (its partial results are for nobody).
    """
    k = opts.beam
    rows = batch * k
    seqs = np.zeros((rows, 0), dtype=np.int64)                       # tokens of each live beam
    beam_scores = np.tile(np.r_[0.0, np.full(k - 1, -np.inf)], batch)  # only beam 0 starts live
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    closed = np.zeros(batch, dtype=bool)
    last, keep = np.full(rows, bos, dtype=np.int64), None

    def norm(score: float, length: int) -> float:
        return float(score / (length ** opts.length_penalty))

    for step in range(opts.max_new_tokens):
        if stop is not None and stop.all():
            break
        logits = state.step(last, keep)                              # [B*K, V]
        if opts.ignore_eos:
            logits[:, eos] = -np.inf
        logp = log_softmax(logits)
        vocab = logp.shape[-1]
        cand = (beam_scores[:, None] + logp).reshape(batch, k * vocab)
        top = top_k_stable(cand, 2 * k)                              # best 2K continuations per input
        next_rows, next_tok, next_scores = [], [], []
        for b in range(batch):
            picked = 0
            for c in top[b]:
                src_row, tok, score = b * k + c // vocab, int(c % vocab), float(cand[b, c])
                if picked == k:
                    break
                if closed[b]:                                       # keep shapes: pad with a dead beam
                    next_rows.append(b * k), next_tok.append(eos), next_scores.append(-np.inf)
                    picked += 1
                    continue
                if tok == eos:
                    if np.isfinite(score) and c in top[b, :k]:
                        toks = seqs[src_row].tolist() + [tok]
                        finished[b].append(Hypothesis(toks, norm(score, len(toks))))
                    continue
                next_rows.append(src_row), next_tok.append(tok), next_scores.append(score)
                picked += 1
            while picked < k:                                       # every continuation ended: dead beams
                next_rows.append(b * k), next_tok.append(eos), next_scores.append(-np.inf)
                picked += 1
        keep = np.asarray(next_rows, dtype=np.int64)
        last = np.asarray(next_tok, dtype=np.int64)
        beam_scores = np.asarray(next_scores, dtype=np.float64)
        seqs = np.concatenate([seqs[keep], last[:, None]], axis=1)
        for b in range(batch):                                      # an input is done when no live beam can win
            if closed[b] or len(finished[b]) < k:
                continue
            worst = min(h.score for h in finished[b])
            best_live = beam_scores[b * k:(b + 1) * k].max()
            if not np.isfinite(best_live) or norm(best_live, step + 1) <= worst:
                closed[b] = True
        if closed.all():
            break
        if (keep == np.arange(rows)).all():
            keep = None
    results = []
    for b in range(batch):
        hyps = list(finished[b])
        if not closed[b]:                                           # stopped at max_new_tokens: live beams count too
            for r in range(b * k, (b + 1) * k):
                if np.isfinite(beam_scores[r]) and seqs.shape[1]:
                    hyps.append(Hypothesis(seqs[r].tolist(), norm(beam_scores[r], seqs.shape[1]), False))
        hyps.sort(key=lambda h: -h.score)
        results.append(hyps[: opts.num_return])
    return results


def search(state: DecodeState, batch: int, bos: int, eos: int, opts: SearchOptions,
           limits: np.ndarray | None = None, stop: np.ndarray | None = None) -> list[list[Hypothesis]]:
    """Greedy when beam == 1, else beam search; one list of hypotheses per input, best first.

    `limits` (greedy only: per-input max new tokens) and `stop` (inputs nobody waits for any more): see greedy.
    """
    if opts.max_new_tokens == 0 and limits is None:
        return [[Hypothesis([], 0.0, False)] for _ in range(batch)]
    if opts.beam == 1:
        return greedy(state, batch, bos, eos, opts, limits, stop)
    if limits is not None and len(set(np.asarray(limits).tolist())) > 1:
        raise ValueError("per-input max_new_tokens work with greedy search only; group beam requests by it")
    return beam_search(state, batch, bos, eos, opts, stop)
