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

from runtime.errors import NumericsError

NON_FINITE = ("the model gave a non-finite logit (NaN or inf) while decoding; its numbers overflow or its weights "
              "are broken: check the bundle with onnxformer parity, or use its fp32 version")


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
    suppress: tuple[int, ...] = ()  # token ids never generated (the model's, e.g. Marian's pad; set by generate_ids)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities [N, V]: float32 elementwise, the normalizer summed in float64 (8x cheaper than all-float64)."""
    shifted = logits - row_max(logits)[:, None]
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float64)).astype(shifted.dtype)


def row_max(logits: np.ndarray) -> np.ndarray:
    """Each row's largest logit [N]. NaN or inf there (a NaN anywhere in a row makes its max NaN) is an error,
    never an empty answer; checked on the max the softmax needs anyway, not on every logit."""
    top = logits.max(axis=-1)
    if not np.isfinite(top).all():
        raise NumericsError(NON_FINITE, rows=np.flatnonzero(~np.isfinite(top)))
    return top


def chosen_logprob(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """log p(token) per row [N], without materializing the whole log-softmax."""
    rows = np.arange(len(tokens))
    top = row_max(logits)
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
        nxt, logprob = greedy_pick(logits, opts.suppress)
        scores[live] += logprob
        for row, item in enumerate(live):
            tokens[item].append(int(nxt[row]))
            done[item] = bool(nxt[row] == eos)
        alive = np.flatnonzero((nxt != eos) & (limits[live] > step + 1) & ~stop[live])
        keep = None if len(alive) == len(live) else alive
        live, last = live[alive], nxt[alive].astype(np.int64)
    return [[Hypothesis(tokens[i], float(scores[i]), done[i])] for i in range(batch)]


def greedy_pick(logits: np.ndarray, suppressed: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Greedy's choice for each row [N] and its log-probability [N]: the best token that is not suppressed, scored
    on the unmasked log-softmax (as transformers scores it). One rule for every greedy decoder (this module's
    `greedy`, runtime.inflight's rows)."""
    nxt = suppress(logits.copy(), suppressed).argmax(axis=-1) if suppressed else logits.argmax(axis=-1)
    return nxt, chosen_logprob(logits, nxt)


def suppress(logits: np.ndarray, ids: tuple[int, ...]) -> np.ndarray:
    """Tokens the model never generates (Marian's pad) get -inf, in place."""
    if ids:
        logits[:, list(ids)] = -np.inf
    return logits


def attainable(score: float, length: int, max_new_tokens: int, length_penalty: float) -> float:
    """The best normalized score a hypothesis grown from a live beam (log-probability sum `score` over `length`
    tokens) can still reach. Exact, as log-probabilities are <= 0 and a sum only falls: for length_penalty >= 0
    the longest length divides least (score / max_new_tokens ** lp); for lp < 0 the next length is best."""
    final = max_new_tokens if length_penalty >= 0 else min(length + 1, max_new_tokens)
    return score / final ** length_penalty


def beam_search(state: DecodeState, batch: int, bos: int, eos: int, opts: SearchOptions,
                stop: np.ndarray | None = None) -> list[list[Hypothesis]]:
    """Keep the `beam` best partial hypotheses per input; return the best finished ones by normalized score.

    The ranking rules are Hugging Face's (transformers' `_beam_search`), so that imported models give the very
    tokens their original gives:
    - each step ranks the 2K best continuations of all K beams by summed log-probability; of these, the ones
      ending in EOS that rank within the first K are finished (score / length ** length_penalty, EOS counted in
      the length), and the first K that do not end in EOS go on;
    - an input keeps its K best finished hypotheses;
    - at the last allowed step every one of the first K continuations counts as finished (unfinished: no EOS).
    The stopping rule is exact (Hugging Face's early_stopping="never"): an input closes only once no live beam can
    still reach (`attainable`) its num_return-th best finished score, so closing never changes what is returned
    (the heuristic of early_stopping=False, the live score normalized at the current length, closed too early).
    A closed input's rows leave the state: they cost no more decoder work.

    `stop` (as in greedy): an input set there leaves at the next step with what it has.
    """
    k, lp = opts.beam, opts.length_penalty
    live = np.arange(batch)                                          # open inputs; live[i] owns rows i*K..i*K+K-1
    seqs = np.zeros((batch * k, 0), dtype=np.int64)                  # tokens of each row's beam
    scores = np.tile(np.r_[0.0, np.full(k - 1, -np.inf)], batch)    # log-prob sums; only beam 0 starts live
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]   # the K best finished, best first
    last, keep = np.full(batch * k, bos, dtype=np.int64), None

    def norm(score: float, length: int) -> float:
        return float(score / (length ** lp))

    for step in range(opts.max_new_tokens):
        if stop is not None and stop[live].any():                    # nobody waits for these any more
            for i in np.flatnonzero(stop[live]):
                if not finished[live[i]]:                            # what its live beams had
                    finished[live[i]] = sorted((Hypothesis(seqs[r].tolist(), norm(scores[r], max(seqs.shape[1], 1)), False)
                                                for r in range(i * k, (i + 1) * k) if np.isfinite(scores[r])),
                                               key=lambda h: -h.score)
            go = np.flatnonzero(~stop[live])
            rows = (go[:, None] * k + np.arange(k)).ravel()          # the rows of the inputs that go on
            keep = rows if keep is None else keep[rows]
            live, last, scores, seqs = live[go], last[rows], scores[rows], seqs[rows]
            if len(live) == 0:
                break
        logits = state.step(last, keep)                              # [open inputs * K, V]
        if opts.ignore_eos:
            logits[:, eos] = -np.inf
        logp = suppress(log_softmax(logits), opts.suppress)          # suppressed after normalizing, as HF does
        vocab = logp.shape[-1]
        cand = (scores[:, None] + logp).reshape(len(live), k * vocab)
        top = top_k_stable(cand, 2 * k)                              # best 2K continuations per open input
        final = step == opts.max_new_tokens - 1
        rows, toks, vals, still = [], [], [], []
        for i, b in enumerate(live):
            picked = []
            for rank, c in enumerate(top[i]):
                src, tok, score = i * k + c // vocab, int(c % vocab), float(cand[i, c])
                if tok == eos or final:
                    if rank < k and np.isfinite(score):
                        done = seqs[src].tolist() + [tok]
                        finished[b].append(Hypothesis(done, norm(score, len(done)), tok == eos))
                    continue
                if len(picked) < k:
                    picked.append((src, tok, score))
            finished[b] = sorted(finished[b], key=lambda h: -h.score)[:k]   # stable: earlier ones win ties
            picked += [(i * k, eos, -np.inf)] * (k - len(picked))    # every continuation ended: dead rows
            if final or _done(finished[b], max(p[2] for p in picked), step + 1, opts):
                continue                                             # the input closes: its rows leave
            still.append(b)
            for src, tok, score in picked:
                rows.append(src), toks.append(tok), vals.append(score)
        if not still:
            break
        live, keep = np.asarray(still, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        last, scores = np.asarray(toks, dtype=np.int64), np.asarray(vals, dtype=np.float64)
        seqs = np.concatenate([seqs[keep], last[:, None]], axis=1)
        if len(keep) == len(logits) and (keep == np.arange(len(keep))).all():
            keep = None
    return [finished[b][: opts.num_return] for b in range(batch)]


def _done(finished: list[Hypothesis], best_live: float, length: int, opts: SearchOptions) -> bool:
    """Whether an input is done after a step that left its live beams at `length` tokens: none is left alive, or
    none can still beat its num_return-th best finished hypothesis (running on would return the same)."""
    if not np.isfinite(best_live):
        return True
    if len(finished) < opts.num_return:
        return False
    return attainable(best_live, length, opts.max_new_tokens, opts.length_penalty) <= finished[opts.num_return - 1].score


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
