"""What the search does to a step's logits before it chooses a token: the decoding controls, in one place.

    controls = Controls.of(opts, batch, n, eos)          # None when no control is set: the plain search runs
    forced = controls.forced(step, rows)                 # each row's prefix token at this step, -1 where it chooses
    processed = controls.process(logp, history, generated)      # transformers' logits processors, on a copy
    tokens = controls.draw(processed, controls.uniforms(rows))  # sampling: one draw from each row's own generator

The processors are transformers' (generation/logits_process.py), vectorized over rows and applied in its order:
RepetitionPenalty, NoRepeatNGram, NoBadWords, MinNewTokensLength, then the suppressed ids (SuppressTokens, and
SuppressTokensAtBegin at a row's first token after its prefix: Whisper's); sampling then applies
Temperature, TopK and TopP. As in transformers, a row's history is the decoder's input so far: the start token,
the forced prefix, the generated tokens. Greedy and sampling process the raw logits; beam search processes the
log-softmax (as transformers' beam search does), so a repetition penalty scales log-probabilities there.

Rows decoded together need not share their options (an in-flight batch, runtime.inflight): `settings` is what
`process` and `draw` read of the options, so rows of several requests with equal settings are processed in one
call, each keeping its own prefix, history and generator. Their histories may then differ in length: a history
is left-padded with -1 (never a token), which no processor takes for one.

Sampling is reproducible per request: row j of input b draws from its own numpy Generator seeded from
(seed, b, j), so its tokens do not depend on its batch neighbours or on the engine that computed the logits. A part
of a split request (Ray Data's batches) names its inputs' positions in the whole in opts.seed_index.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


SETTINGS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_new_tokens", "suppress",
            "begin_suppress", "timestamps", "max_initial_timestamp", "sample",
            "temperature", "top_k", "top_p")          # the options process() and draw() read (not the per-row ones)


class Controls:
    """The per-search state of the decoding controls of one SearchOptions (see the module docstring)."""

    def __init__(self, opts, batch: int, n: int, eos: int):
        self.opts, self.n, self.eos = opts, n, eos
        lengths = [len(p) for p in opts.prefix_ids] or [0] * batch
        self.prefix_len = np.repeat(np.asarray(lengths, dtype=np.int64), n)        # per row (input b, return j)
        self.prefix = np.full((batch * n, max(lengths, default=0)), -1, dtype=np.int64)
        for b, p in enumerate(opts.prefix_ids):
            self.prefix[b * n:(b + 1) * n, :len(p)] = p
        self.needs_history = bool(opts.repetition_penalty != 1.0 or opts.no_repeat_ngram_size or opts.bad_words_ids
                                  or opts.timestamps is not None)
        self.bans = [tuple(w) for w in opts.bad_words_ids]
        self.settings = tuple(getattr(opts, name) for name in SETTINGS)   # rows of equal settings process together
        self.generators = None
        if opts.sample:
            seed = request_seed(opts)
            self.generators = [row_generator(seed, seed_index(opts, r // n), r % n) for r in range(batch * n)]

    @classmethod
    def of(cls, opts, batch: int, n: int, eos: int) -> "Controls | None":
        """The controls of `opts` over batch inputs of n rows each, or None when none is set (nothing to do)."""
        active = (opts.sample or opts.repetition_penalty != 1.0 or opts.no_repeat_ngram_size or opts.min_new_tokens
                  or opts.bad_words_ids or opts.prefix_ids or opts.return_logprobs or opts.begin_suppress
                  or opts.timestamps is not None)
        return cls(opts, batch, n, eos) if active else None

    def forced(self, step, rows: np.ndarray) -> np.ndarray:
        """Each row's forced prefix token at `step` (its step-th target token; an int, or one per row), -1 where the
        row chooses."""
        width = self.prefix.shape[1]
        if np.ndim(step) == 0:
            return np.full(len(rows), -1, dtype=np.int64) if step >= width else self.prefix[rows, step]
        inside = step < width
        out = np.full(len(rows), -1, dtype=np.int64)
        out[inside] = self.prefix[rows[inside], step[inside]]
        return out

    def generated(self, step, rows: np.ndarray) -> np.ndarray:
        """How many tokens each row has chosen before `step` (an int, or one per row): its tokens after the prefix."""
        return np.maximum(step - self.prefix_len[rows], 0)

    def process(self, scores: np.ndarray, history: np.ndarray | None, generated: np.ndarray) -> np.ndarray:
        """The processed copy of scores [N, V] (logits or log-probabilities); history [N, T] (start token, prefix,
        tokens so far; needed when `needs_history`); generated [N]: each row's tokens after its prefix."""
        o, out = self.opts, scores.copy()
        if o.repetition_penalty != 1.0:
            repetition_penalty(out, history, o.repetition_penalty)
        if o.no_repeat_ngram_size:
            no_repeat_ngram(out, history, o.no_repeat_ngram_size)
        if self.bans:
            bad_words(out, history, self.bans)
        if o.min_new_tokens:
            out[generated < o.min_new_tokens, self.eos] = -np.inf
        if o.begin_suppress:                                           # the first token after the prefix
            out[np.ix_(np.flatnonzero(generated == 0), list(o.begin_suppress))] = -np.inf
        out = suppress(out, o.suppress)
        if o.timestamps is not None:                                   # Whisper's timestamp rules come last
            timestamp_rules(out, history, generated, o.timestamps, self.eos, o.max_initial_timestamp)
        return out

    def uniforms(self, rows) -> np.ndarray:
        """The next uniform [0, 1) draw of each row's own generator (rows: row ids): one a row and step."""
        return np.array([self.generators[r].random() for r in rows])

    def draw(self, logits: np.ndarray, u: np.ndarray) -> np.ndarray:
        """A token per row, drawn from softmax(warp(logits)) with its uniform u (Controls.uniforms)."""
        return draw(warp(logits, self.opts.temperature, self.opts.top_k, self.opts.top_p), u)


def suppress(logits: np.ndarray, ids: tuple[int, ...]) -> np.ndarray:
    """Tokens the model never generates (Marian's pad) get -inf, in place."""
    if ids:
        logits[:, list(ids)] = -np.inf
    return logits


def request_seed(opts) -> int:
    """The seed of a sampling request: its own, or fresh entropy (not reproducible) when it gives none."""
    return np.random.SeedSequence().entropy if opts.seed is None else opts.seed


def seed_index(opts, index: int) -> int:
    """The index input `index` of a request seeds its generators by: its position in the whole request
    (opts.seed_index, where the request is a part of a split one), else `index`."""
    return int(opts.seed_index[index]) if opts.seed_index else index


def row_generator(seed: int, index: int, ret: int) -> np.random.Generator:
    """The generator of the ret-th sample of input `index` of a request with this seed: the one source of its draws."""
    return np.random.default_rng([seed, index, ret])


def repetition_penalty(scores: np.ndarray, history: np.ndarray, penalty: float) -> None:
    """RepetitionPenaltyLogitsProcessor, in place: each token in a row's history has its score divided by the
    penalty where positive, multiplied where negative (once, however often it occurred). A -1 of a left-padded
    history counts as the row's last token (already in it)."""
    history = np.where(history < 0, history[:, -1:], history)
    seen = np.take_along_axis(scores, history, axis=1)
    np.put_along_axis(scores, history, np.where(seen < 0, seen * penalty, seen / penalty), axis=1)


def timestamp_rules(scores: np.ndarray, history: np.ndarray, generated: np.ndarray, begin: int, eos: int,
                    max_initial: int | None = None) -> None:
    """WhisperTimeStampLogitsProcessor, in place: ids >= `begin` are timestamps (<|0.00|>, <|0.02|>, ...) and
    `begin - 1` is <|notimestamps|> (never chosen). Over each row's generated tokens (the last `generated` of its
    history): timestamps come in pairs (after a lone timestamp only a timestamp or the end, after a pair text),
    never decrease (and a pair's end is not repeated); the first token is a timestamp, at most `max_initial`
    (an index: 50 is 1.00 s); and where the timestamps' summed probability beats the likeliest text token's, a
    timestamp is taken."""
    scores[:, begin - 1] = -np.inf
    for r in range(len(scores)):
        seq = history[r, history.shape[1] - int(generated[r]):] if generated[r] else history[r, :0]
        last = len(seq) >= 1 and seq[-1] >= begin
        penultimate = len(seq) < 2 or seq[-2] >= begin
        if last:
            if penultimate:
                scores[r, begin:] = -np.inf                          # a pair closed: text next
            else:
                scores[r, :eos] = -np.inf                            # a lone timestamp: no text token next
        stamps = seq[seq >= begin]
        if len(stamps):                                              # monotonic: not below the last one
            floor = int(stamps[-1]) if last and not penultimate else int(stamps[-1]) + 1
            scores[r, begin:floor] = -np.inf
        if generated[r] == 0:                                        # the first token: a timestamp, early enough
            scores[r, :begin] = -np.inf
            if max_initial is not None:
                scores[r, begin + max_initial + 1:] = -np.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = scores - scores.max(axis=1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(axis=1, keepdims=True))
        stamp = np.logaddexp.reduce(logp[:, begin:], axis=1)
    take = stamp > logp[:, :begin].max(axis=1)
    scores[np.ix_(np.flatnonzero(take), np.arange(begin))] = -np.inf


def no_repeat_ngram(scores: np.ndarray, history: np.ndarray, n: int) -> None:
    """NoRepeatNGramLogitsProcessor, in place: a token that would complete an n-gram already in the row's history
    gets -inf (the history's last n-1 tokens matched against every earlier window)."""
    length = history.shape[1]
    if length < n:
        return
    windows = sliding_window_view(history, n, axis=1)                   # [N, length - n + 1, n]
    matches = (windows[..., :-1] == history[:, None, length + 1 - n:]).all(axis=-1)
    rows, at = np.nonzero(matches)
    scores[rows, windows[rows, at, -1]] = -np.inf


def bad_words(scores: np.ndarray, history: np.ndarray | None, bans: list[tuple[int, ...]]) -> None:
    """NoBadWordsLogitsProcessor, in place: a banned sequence's last token gets -inf in the rows whose history ends
    with the rest of it (always, for a one-token sequence)."""
    for seq in bans:
        head, last = seq[:-1], seq[-1]
        if not head:
            scores[:, last] = -np.inf
        elif len(head) <= history.shape[1]:
            scores[(history[:, -len(head):] == head).all(axis=1), last] = -np.inf


def warp(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper (min_tokens_to_keep 1) in transformers'
    order, on a copy: filtered tokens get -inf."""
    out = logits / temperature if temperature != 1.0 else logits.copy()
    if top_k and top_k < out.shape[1]:
        kth = np.partition(out, -top_k, axis=1)[:, -top_k]               # the k-th largest score: ties stay
        out[out < kth[:, None]] = -np.inf
    if top_p < 1.0:
        order = np.argsort(out, axis=1, kind="stable")                  # ascending, as transformers sorts
        ranked = np.take_along_axis(out, order, axis=1).astype(np.float64)
        probs = np.exp(ranked - ranked[:, -1:])
        cumulative = np.cumsum(probs / probs.sum(axis=1, keepdims=True), axis=1)
        remove = cumulative <= 1.0 - top_p                               # the least likely tokens, mass <= 1 - p
        remove[:, -1] = False                                            # the most likely token always stays
        np.put_along_axis(out, order, np.where(remove, -np.inf, ranked).astype(out.dtype), axis=1)
    return out


def draw(logits: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling: per row, the token whose interval of the cumulative softmax holds u (uniform [0, 1)).
    Tokens at -inf have empty intervals and are never drawn."""
    probs = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    cdf = np.cumsum(probs, axis=1)
    picked = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)
    last = probs.shape[1] - 1 - (probs[:, ::-1] > 0).argmax(axis=1)    # u * total rounded up to total: the last
    return np.minimum(picked, last).astype(np.int64)                     # token that can be drawn
