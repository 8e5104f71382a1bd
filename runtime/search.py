"""Greedy and beam search over any engine, in numpy.

One search serves every engine (PyTorch with or without cache, ONNX Runtime on any provider), so
engines can differ only in their numbers, never in how tokens are chosen. An engine gives a
`DecodeState` per request:

    state.step(tokens [N] int64, keep [N'] int64 | None) -> logits [N', vocab] float32
    state.feed(tokens [N, T] int64) -> logits [N, T, vocab]     (T given tokens at once: runtime.score)

`keep` selects, before the step, which current rows go on (and in what order): beam search
reorders hypotheses with it, greedy search drops finished rows with it. The state reorders its
self-attention cache by `keep`; rows that stay with their source need no cross-attention copy.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from runtime.errors import NumericsError
from runtime.options import (Hypothesis, SearchOptions, check_options, ends_with_eos,  # noqa: F401  (re-exported)
                             max_steps, rows_per_input, start_token)
from runtime.processors import Controls, suppress

NON_FINITE = ("the model gave a non-finite logit (NaN or inf) while decoding; its numbers overflow or its weights "
              "are broken: check the bundle with onnxformer parity, or use its fp32 version")


class DecodeState(Protocol):
    def step(self, tokens: np.ndarray, keep: np.ndarray | None) -> np.ndarray: ...

    def feed(self, tokens: np.ndarray) -> np.ndarray: ...


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
    of -x, found with a partial sort (a full sort of beam * vocab candidates per input costs far more a step)."""
    if k >= x.shape[1]:
        return np.argsort(-x, axis=1, kind="stable")
    kth = -np.partition(-x, k - 1, axis=1)[:, k - 1]               # the k-th largest value of each row
    out = np.empty((x.shape[0], k), dtype=np.int64)
    for r, (row, t) in enumerate(zip(x, kth)):
        idx = np.flatnonzero(row >= t)                               # every candidate that can be in the top k
        out[r] = idx[np.argsort(-row[idx], kind="stable")[:k]]       # idx is ascending: ties stay by index
    return out


class GreedySearch:
    """Greedy search, and sampling (opts.sample: num_return rows per input, each its own draws), one step at a time:
    `steps()` runs the search and yields after each step, `hypotheses()` gives the result (runtime.stream reads
    the steps; `greedy` runs them all).

    Finished rows leave the batch, so only live rows are computed. `limits` gives each input its own most new
    tokens (default: opts.max_new_tokens for all): a row leaves when it reaches its limit, with the tokens and score
    an unbatched search with that limit gives; with opts.forced_eos its last token there is EOS, forced and not
    scored (transformers' forced_eos_token_id). `stop` is a bool array (per input) the caller may set from another
    thread while the search runs (a server's client went away): that input's rows leave at the next step and its
    hypotheses are what they had so far.
    """

    def __init__(self, state: DecodeState, batch: int, bos: int, eos: int, opts: SearchOptions,
                 limits: np.ndarray | None = None, stop: np.ndarray | None = None):
        self.state, self.bos, self.eos, self.opts, self.n = state, bos, eos, opts, rows_per_input(opts)
        self.controls = Controls.of(opts, batch, self.n, eos)
        self.forced_eos = ends_with_eos(opts)
        limits = np.full(batch, opts.max_new_tokens) if limits is None else np.asarray(limits)
        self.limits = np.repeat(limits, self.n)                        # steps of each row: the prefix, then its limit
        if self.controls is not None:
            self.limits = np.where(self.limits > 0, self.limits + self.controls.prefix_len, 0)
        self.stop = np.zeros(batch, dtype=bool) if stop is None else stop
        rows = batch * self.n
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.scores = np.zeros(rows, dtype=np.float64)
        self.done = [False] * rows
        self.logprobs = [[] for _ in range(rows)] if opts.return_logprobs else None

    def steps(self):
        """Run the search; after each step yield (rows, tokens): the live rows (input b's j-th is row b * n + j)
        and the token each took."""
        n, eos, limits, stop = self.n, self.eos, self.limits, self.stop
        tokens, done, scores, lps = self.tokens, self.done, self.scores, self.logprobs
        live = np.flatnonzero((limits > 0) & ~stop[np.arange(len(limits)) // n])
        last = np.full(len(live), self.bos, dtype=np.int64)           # the token each live row feeds next
        keep = None if len(live) == len(limits) else live
        history = None                                                 # start token and tokens so far, per live row
        if self.controls is not None and self.controls.needs_history:
            history = last[:, None]
        for step in range(int(limits.max(initial=0))):
            if len(live) == 0:
                break
            logits = self.state.step(last, keep)                       # [live, V]
            if self.opts.ignore_eos:
                logits[:, eos] = -np.inf
            nxt, logprob, chosen = self.pick(logits, step, live, history)
            scores[live] += logprob if chosen is None else np.where(chosen, logprob, 0.0)
            for item, token in zip(live.tolist(), nxt.tolist()):
                tokens[item].append(token)
                done[item] = token == eos
            if lps is not None:
                for item, value in zip(live.tolist(), logprob.tolist()):
                    lps[item].append(value)
            yield live, nxt
            alive = np.flatnonzero((nxt != eos) & (limits[live] > step + 1) & ~stop[live if n == 1 else live // n])
            keep = None if len(alive) == len(live) else alive
            live, last = live[alive], nxt[alive].astype(np.int64)
            if history is not None:
                history = np.concatenate([history, nxt[:, None]], axis=1)[alive]

    def pick(self, logits: np.ndarray, step: int, live: np.ndarray, history: np.ndarray | None):
        """Each live row's token [N], its log-probability under the model [N], and whether the row chose it (None:
        all did) rather than having it forced by its prefix (or, forced_eos, by its limit)."""
        c = self.controls
        end = self.limits[live] == step + 1 if self.forced_eos else None   # rows at their last step: EOS there
        if c is None:                                                  # the plain path: nothing else to do
            nxt, logprob = greedy_pick(logits, self.opts.suppress)
            if end is None or not end.any():
                return nxt, logprob, None
            nxt[end] = self.eos
            logprob[end] = chosen_logprob(logits[end], nxt[end])      # only the forced rows' change
            return nxt, logprob, ~end
        nxt = c.forced(step, live)
        if end is not None:
            nxt[end] = self.eos
        chosen = nxt < 0
        if chosen.any():                                               # only choosing rows draw: a row's draws
            mine = np.flatnonzero(chosen)                              # never depend on its neighbours' prefixes
            past = None if history is None else history[mine]
            processed = c.process(logits[mine], past, c.generated(step, live[mine]))
            nxt[mine] = c.draw(processed, c.uniforms(live[mine])) if self.opts.sample else processed.argmax(axis=-1)
        return nxt, chosen_logprob(logits, nxt), chosen

    def hypotheses(self) -> list[list[Hypothesis]]:
        n, lps = self.n, self.logprobs
        return [[Hypothesis(self.tokens[r], float(self.scores[r]), self.done[r], None if lps is None else lps[r])
                 for r in range(b * n, (b + 1) * n)] for b in range(len(self.limits) // n)]


def greedy(state: DecodeState, batch: int, bos: int, eos: int, opts: SearchOptions,
           limits: np.ndarray | None = None, stop: np.ndarray | None = None,
           on_step=None) -> list[list[Hypothesis]]:
    """Pick the most likely token each step (or draw one: opts.sample); see GreedySearch. `on_step(step, inputs,
    tokens)`, when given, is called after each step with each live row's input and the token it took (a server
    streams them)."""
    search = GreedySearch(state, batch, bos, eos, opts, limits, stop)
    for step, (rows, tokens) in enumerate(search.steps()):
        if on_step is not None:
            on_step(step, rows // search.n, tokens)
    return search.hypotheses()


def greedy_pick(logits: np.ndarray, suppressed: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Greedy's choice for each row [N] and its log-probability [N]: the best token that is not suppressed, scored
    on the unmasked log-softmax (as transformers scores it). One rule for every greedy decoder (this module's
    `greedy`, runtime.inflight's rows)."""
    nxt = suppress(logits.copy(), suppressed).argmax(axis=-1) if suppressed else logits.argmax(axis=-1)
    return nxt, chosen_logprob(logits, nxt)


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
    - at the last allowed step every one of the first K continuations counts as finished (unfinished: no EOS);
      with opts.forced_eos that step's only continuation is EOS, scored 0 (transformers' forced_eos_token_id).
    The stopping rule is exact (Hugging Face's early_stopping="never"): an input closes only once no live beam can
    still reach (`attainable`) its num_return-th best finished score, so closing never changes what is returned
    (the heuristic of early_stopping=False, the live score normalized at the current length, closed too early).
    A closed input's rows leave the state: they cost no more decoder work.

    A prefix (opts.prefix_ids) is forced on beam 0 first, adding nothing to the score; lengths (normalization,
    max_new_tokens) count the tokens after it, as transformers counts them after decoder_input_ids, and the first
    opts.prefix_counted prefix tokens as well (normalization only: a forced target-language token, which
    transformers' forced_bos_token_id counts). `stop` (as in greedy): an input set there leaves at the next step
    with what it has.
    """
    k, forced_eos = opts.beam, ends_with_eos(opts)
    b = _Beams(batch, k, bos, opts, Controls.of(opts, batch, k, eos))
    for step in range(opts.max_new_tokens + int(b.prefix_len.max(initial=0))):
        if stop is not None and stop[b.live].any() and not b.drop(np.flatnonzero(stop[b.live])):
            break
        logits = state.step(b.last, b.keep)                          # [open inputs * K, V]
        if opts.ignore_eos:
            logits[:, eos] = -np.inf
        raw = log_softmax(logits)
        logp = suppress(raw, opts.suppress) if b.controls is None else b.processed(raw, step)
        if forced_eos:
            logp = b.end_with(logp, raw, step, eos)
        vocab = logp.shape[-1]
        cand = (b.scores[:, None] + logp).reshape(len(b.live), k * vocab)
        top = top_k_stable(cand, 2 * k)                              # best 2K continuations per open input
        rows, toks, still = [], [], []
        for i, inp in enumerate(b.live):
            at = step - int(b.prefix_len[inp])                       # this input's step after its prefix
            if at < 0:                                               # forced: beam 0 takes the prefix token
                picked = [(i * k, int(b.controls.prefix[inp * k, step]), b.scores[i * k])]
            else:
                picked = b.rank(i, inp, top[i], cand[i], vocab, at, raw, eos)
                if picked is None:
                    continue                                         # the input closes: its rows leave
            picked += [(i * k, eos, -np.inf)] * (k - len(picked))    # every continuation ended: dead rows
            still.append(inp)
            rows += [p[0] for p in picked]
            toks += [p[1:] for p in picked]
        if not still:
            break
        b.advance(still, rows, toks, raw)
    return [b.finished[i][: opts.num_return] for i in range(batch)]


class _Beams:
    """beam_search's state: the open inputs, their K rows each (live[i] owns rows i*K..i*K+K-1), the rows' tokens,
    summed scores and (return_logprobs) per-token log-probabilities, and each input's K best finished hypotheses."""

    def __init__(self, batch: int, k: int, bos: int, opts: SearchOptions, controls: Controls | None):
        self.k, self.bos, self.opts, self.controls = k, bos, opts, controls
        self.prefix_len = np.zeros(batch, dtype=np.int64) if controls is None else controls.prefix_len[::k]
        self.live = np.arange(batch)
        self.seqs = np.zeros((batch * k, 0), dtype=np.int64)
        self.lps = np.zeros((batch * k, 0)) if opts.return_logprobs else None
        self.scores = np.tile(np.r_[0.0, np.full(k - 1, -np.inf)], batch)   # only beam 0 starts live
        self.finished: list[list[Hypothesis]] = [[] for _ in range(batch)]   # best first
        self.last, self.keep = np.full(batch * k, bos, dtype=np.int64), None

    def norm(self, score: float, length: int) -> float:
        return float(score / (length ** self.opts.length_penalty))

    def hypothesis(self, tokens: list[int], score: float, inp: int, finished: bool, lps=None):
        length = max(len(tokens) - int(self.prefix_len[inp]) + self.opts.prefix_counted, 1)
        return Hypothesis(tokens, self.norm(score, length), finished, lps)

    def processed(self, raw: np.ndarray, step: int) -> np.ndarray:
        """The controls' processing of the rows' log-probabilities (transformers' beam search processes these)."""
        rows = (self.live[:, None] * self.k + np.arange(self.k)).ravel()
        history = None
        if self.controls.needs_history:
            history = np.concatenate([np.full((len(self.seqs), 1), self.bos), self.seqs], axis=1)
        return self.controls.process(raw, history, self.controls.generated(step, rows))

    def end_with(self, logp: np.ndarray, raw: np.ndarray, step: int, eos: int) -> np.ndarray:
        """logp with the rows of inputs at their last step (forced_eos) allowing EOS only, at log-probability 0, as
        transformers' ForcedEOSTokenLogitsProcessor does; a copy where it changes raw (the model's, which the
        returned log-probabilities keep)."""
        last = np.repeat(step - self.prefix_len[self.live] == self.opts.max_new_tokens - 1, self.k)
        if not last.any():
            return logp
        logp = logp.copy() if logp is raw else logp
        logp[last] = -np.inf
        logp[last, eos] = 0.0
        return logp

    def rank(self, i: int, inp: int, top: np.ndarray, cand: np.ndarray, vocab: int, at: int, raw, eos: int):
        """Input i's continuations this step (its `at`-th after the prefix): finished ones are kept, the first K
        live ones returned as (row, token, score, log-prob); None when the input is done."""
        k, final, picked = self.k, at == self.opts.max_new_tokens - 1, []
        for rank, c in enumerate(top):
            src, tok, score = i * k + c // vocab, int(c % vocab), float(cand[c])
            if tok == eos or final:
                if rank < k and np.isfinite(score):
                    lps = None if self.lps is None else self.lps[src].tolist() + [float(raw[src, tok])]
                    self.finished[inp].append(self.hypothesis(self.seqs[src].tolist() + [tok], score, inp,
                                                              tok == eos, lps))
                continue
            if len(picked) < k:
                picked.append((src, tok, score))
        self.finished[inp] = sorted(self.finished[inp], key=lambda h: -h.score)[:k]   # stable: earlier ones win ties
        counted = self.opts.prefix_counted
        if final or _done(self.finished[inp], max((p[2] for p in picked), default=-np.inf), at + 1 + counted,
                          self.opts):
            return None
        return picked

    def drop(self, gone: np.ndarray) -> bool:
        """Open inputs `gone` (positions in live) leave with what their live beams had; False when none is left."""
        k = self.k
        for i in gone:
            inp = self.live[i]
            if not self.finished[inp]:
                self.finished[inp] = sorted(
                    (self.hypothesis(self.seqs[r].tolist(), self.scores[r], inp, False,
                                     None if self.lps is None else self.lps[r].tolist())
                     for r in range(i * k, (i + 1) * k) if np.isfinite(self.scores[r])), key=lambda h: -h.score)
        go = np.setdiff1d(np.arange(len(self.live)), gone)
        rows = (go[:, None] * k + np.arange(k)).ravel()              # the rows of the inputs that go on
        self.keep = rows if self.keep is None else self.keep[rows]
        self.live, self.last = self.live[go], self.last[rows]
        self.scores, self.seqs = self.scores[rows], self.seqs[rows]
        if self.lps is not None:
            self.lps = self.lps[rows]
        return len(self.live) > 0

    def advance(self, still: list[int], rows: list[int], picks: list[tuple], raw: np.ndarray) -> None:
        """The open inputs after a step, and their rows: each from row `rows[j]` with token and score `picks[j]`."""
        keep = np.asarray(rows, dtype=np.int64)
        self.last = np.asarray([p[0] for p in picks], dtype=np.int64)
        if self.lps is not None:
            self.lps = np.concatenate([self.lps[keep], raw[keep, self.last][:, None]], axis=1)
        self.live, self.scores = np.asarray(still, dtype=np.int64), np.asarray([p[1] for p in picks], dtype=np.float64)
        self.seqs = np.concatenate([self.seqs[keep], self.last[:, None]], axis=1)
        self.keep = None if len(keep) == len(raw) and (keep == np.arange(len(keep))).all() else keep


def _done(finished: list[Hypothesis], best_live: float, length: int, opts: SearchOptions) -> bool:
    """Whether an input is done after a step that left its live beams at `length` tokens: none is left alive, or
    none can still beat its num_return-th best finished hypothesis (running on would return the same)."""
    if not np.isfinite(best_live):
        return True
    if len(finished) < opts.num_return:
        return False
    final = opts.max_new_tokens + opts.prefix_counted
    return attainable(best_live, length, final, opts.length_penalty) <= finished[opts.num_return - 1].score


def search(state: DecodeState, batch: int, bos: int, eos: int, opts: SearchOptions,
           limits: np.ndarray | None = None, stop: np.ndarray | None = None,
           on_step=None) -> list[list[Hypothesis]]:
    """Greedy (or sampling) when beam == 1, else beam search; one list of hypotheses per input, best first (samples
    in the order of their seeds).

    `limits` (greedy only: per-input max new tokens), `stop` (inputs nobody waits for any more) and `on_step`
    (greedy only: each step's tokens): see greedy.
    """
    if opts.max_new_tokens == 0 and limits is None:                  # (check_options refuses a prefix here)
        return [[Hypothesis([], 0.0, False, [] if opts.return_logprobs else None)] for _ in range(batch)]
    if opts.beam == 1:
        return greedy(state, batch, bos, eos, opts, limits, stop, on_step)
    if limits is not None and len(set(np.asarray(limits).tolist())) > 1:
        raise ValueError("per-input max_new_tokens work with greedy search only; group beam requests by it")
    return beam_search(state, batch, bos, eos, opts, stop)
