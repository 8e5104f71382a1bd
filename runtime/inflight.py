"""In-flight (continuous) batching: rows join a running batch at any decoding step and leave at once.

    batch = InflightBatch(engine, slots=32)            # an OrtEngine over a per-row static-cache decoder
    rows = batch.join([[5, 6, 7], [8, 9]], limits=[16, 64])   # the encoder runs for these rows only
    rows += batch.join(*batch.request_rows(request))   # a validated request's rows, each with its options
    while batch.live:
        for row in batch.step():                       # one decoder step for every live row
            print(row.key, row.hypothesis())           # rows that finished (EOS, their limit, or stopped)

Each row has its own row of one static KV buffer [slots, H, capacity, Dh] per cache tensor and its own length:
the decoder's per-row static cache (exporters/static_cache.py, GroupQueryAttention) takes
`past_sequence_length` [rows], so a row writes its new key/value at slot `length` of its buffer row and attends
over its own slots 0..length only, and `position_ids` [rows, 1] = length (its start token sits at position 0).
A row that joins starts at slot 0 of a free buffer row, whatever the other rows' lengths; a step costs each row
its own length (no shared write slot, no key mask, no compaction).

A finished row leaves before the next step: the last live rows move into the freed places (their filled slots,
cross K/V, source mask, length), so the buffer's leading rows are always the live ones and the next joiner takes
the row after them. A step binds the live rows rounded up to a multiple of ROW_BUCKET (the rows past them, at
length 0, compute nothing anyone reads), so the bound shapes, and the binding, change rarely.

Cross-attention K/V live in [slots, H, width, Dh] buffers as wide as the longest source seen, each row padded
with encoder_attention_mask 0 (as a request-level batch pads them). A join writes only the joiners' rows; a
leave moves only as many rows as left. Each row's tokens, finished flag and score are computed as
runtime.search.greedy computes them for that row alone (fp32: the same tokens; the score within float rounding:
tests/test_inflight.py).

A row decodes greedily unless its request sets decoding controls (runtime/processors.py: penalties, n-gram and
word bans, min_new_tokens, a prefix, logprobs, sampling with its own seeded generator per sample): such a row
carries its request's Controls and its row index there, and gets the tokens runtime.search gives it alone. Rows
of any requests whose controls have equal settings are processed in one call; plain greedy rows take the plain
path (no processing). Beam search keeps request-level batching.

CPU only: the buffers are numpy arrays bound without a copy (runtime/feed.py's bind_static).

With a vocabulary shortlist (the engine's, runtime/shortlist.py) each row holds its own candidates; a step
computes the logits of the union of the live rows' candidates (the binding changes when the union does) and
masks each row to its own, so a row gets what it gets alone. A row that joins without the shortlist makes the
batch step on the full vocabulary while it is live (the others still masked to their candidates).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from runtime.errors import InputError
from runtime.feed import Feed
from runtime.generate import pad_batch
from runtime.processors import Controls
from runtime.request import check_sources
from runtime.search import Hypothesis, SearchOptions, chosen_logprob, ends_with_eos, greedy_pick, rows_per_input
from runtime.shortlist import Selection, widen
from runtime.spec import DYNAMIC, STATIC_PER_ROW

ROW_BUCKET = 2          # rows bound per step: the live rows rounded up to a multiple (few shapes, few rebinds)
REOPTIMIZE = "optimize the exported bundle again for --target cpu (its static cache then keeps a length per row)"


def check_engine(engine) -> None:
    """Refuse engines in-flight batching cannot drive, with the fix (InputError, one line)."""
    layout = getattr(engine, "layout", DYNAMIC)
    if layout == DYNAMIC:
        raise InputError("in-flight batching needs a static-cache decoder; optimize the bundle with "
                         "--kv-cache static")
    if engine.provider != "cpu":
        raise InputError(f"in-flight batching runs on the CPU provider only so far, not {engine.provider}: load the "
                         f"bundle on the CPU provider (serve --provider cpu)")
    if layout != STATIC_PER_ROW:
        raise InputError(f"this bundle's static cache has one shared length for all rows (decoder layout {layout}: "
                         f"a CUDA bundle, or a model whose head size is not a multiple of 8); {REOPTIMIZE}")


@dataclass(eq=False)
class Row:
    """One input (or one sample of an input) decoding in the batch."""

    key: Any                        # the caller's handle (e.g. (job, row index))
    limit: int                      # most steps: its prefix's, then its max new tokens
    length: int = 0                 # filled slots of its buffer row (= the position of the token it feeds next)
    src_len: int = 0
    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    finished: bool = False          # ended with EOS
    stopped: bool = False           # the caller gave it up (stop()): it leaves at the next step
    left: bool = False              # no longer in the batch (its hypothesis is final)
    ignore_eos: bool = False        # never stop at EOS (the batch's opts.ignore_eos applies to every row)
    forced_eos: bool = False        # its last token at its limit is EOS, forced and not scored (opts.forced_eos)
    last: int = 0                   # the token it feeds next
    controls: Controls | None = None    # its request's decoding controls (None: plain greedy search)
    index: int = 0                  # its row in them (input b's sample j: b * n + j)
    logprobs: list[float] | None = None   # return_logprobs: each token's log-probability
    candidates: Any = None          # its shortlist candidates (sorted vocabulary ids), None: the whole vocabulary

    def hypothesis(self) -> Hypothesis:
        lps = None if self.logprobs is None else list(self.logprobs)
        return Hypothesis(list(self.tokens), float(self.score), self.finished, lps)


class InflightBatch:
    """Greedy (or controlled) decoding of up to `slots` rows that join and leave at any step (one thread drives it)."""

    def __init__(self, engine, slots: int = 32, opts: SearchOptions | None = None, capacity: int | None = None):
        check_engine(engine)
        if slots < 1:
            raise ValueError("slots must be at least 1")
        self.e, self.slots = engine, slots
        self.feed = Feed(engine.encoder, engine.decoder, engine.config, engine.layout, engine.provider,
                         engine.feed.shortlist_decoder, engine.feed.shortlist_weight)
        self.vocab = None                                 # the bound shortlist Selection (None: full vocabulary)
        self._union = ([], None)                          # (the rows' candidate arrays, their union): _vocab's cache
        self._allowed = (None, [], None)                  # (Selection, candidate arrays, masks): _rows_logits' cache
        self.opts = opts or SearchOptions()
        self.suppress = tuple(engine.suppress_ids)
        self.forced_eos = ends_with_eos(self.opts, getattr(engine, "forced_eos", False))   # joining rows' default
        self.capacity = capacity or engine.max_len                    # buffer positions (>= any row's limit)
        shape = (slots, engine.n_heads, self.capacity, engine.head_dim)
        self.buffers = [np.zeros(shape, dtype=np.float32) for _ in engine.past_names]
        self.rows: list[Row] = []                                     # buffer row i holds rows[i]
        self.cross: list[np.ndarray] = []                             # [slots, H, width, Dh] per tensor
        self.src_mask = np.zeros((slots, 0), dtype=np.int64)         # [slots, width]; 0 past a row's source
        self.bound = 0                                                # rows the binding covers (>= live rows)
        self._binding = None
        self.steps = self.joined = 0

    @property
    def live(self) -> int:
        return len(self.rows)

    @property
    def free(self) -> int:
        return self.slots - len(self.rows)

    # --- rows in ---

    def request_rows(self, request) -> tuple[list, list[int], list]:
        """join's sequences, limits and controls for a validated greedy or sampling request (runtime.request): each
        input once per sample (row b * n + j: input b's j-th, as runtime.search numbers them), with its limit and
        (its request's Controls, b * n + j), or None for plain greedy search. `answer` gathers the result."""
        opts, n, inputs = request.opts, rows_per_input(request.opts), len(request.sequences)
        if opts.beam != 1:
            raise ValueError("in-flight rows decode greedy search or sampling; beam search batches request-level")
        if opts.start_id is not None:                                  # rows start from the engine's bos_id
            raise ValueError("in-flight rows start from the model's decoder start token; decode start_id alone")
        controls = Controls.of(opts, inputs, n, self.e.eos_id)
        if controls is None and set(opts.suppress) != set(self.suppress):   # plain, but its own suppressed ids
            controls = Controls(opts, inputs, n, self.e.eos_id)
        rows = range(inputs * n)
        return ([request.sequences[r // n] for r in rows], [request.limits[r // n] for r in rows],
                [None if controls is None else (controls, r) for r in rows])

    def join(self, sequences: Sequence[Sequence[int]], limits: Sequence[int], controls: Sequence | None = None,
             keys: Sequence | None = None, shortlist: Sequence[bool] | None = None) -> list[Row]:
        """Add rows (at most `free`): the encoder runs for them only; they decode from the next step on. Rows
        with limit 0 are returned finished-empty and never join (as greedy gives them). controls: per row, None
        for plain greedy search or (Controls, its row there) (request_rows); a row's limit counts the tokens after
        its prefix. shortlist: per row, whether it decodes on the engine's shortlist (default: the batch options'
        shortlist), where the engine has one."""
        keys = list(range(len(sequences))) if keys is None else list(keys)
        if len(sequences) > self.free:
            raise ValueError(f"{len(sequences)} rows do not fit: {self.free} of {self.slots} slots are free")
        controls = [None] * len(sequences) if controls is None else list(controls)
        limits = [int(n) + (int(c[0].prefix_len[c[1]]) if c is not None and n > 0 else 0)
                  for n, c in zip(limits, controls)]
        bad = [n for n in limits if not 0 <= n <= self.capacity]
        if bad:
            raise InputError(f"max new tokens (and prefixes) must be between 0 and the batch's cache of "
                             f"{self.capacity} positions, got {bad[:5]}")
        check_sources(sequences, self.e)                              # a server checked them before: runtime.request
        on = [self.opts.shortlist] * len(sequences) if shortlist is None else list(shortlist)
        table = getattr(self.e, "shortlist", None)
        rows = [Row(k, n, src_len=len(s), left=n == 0, last=self.e.bos_id, forced_eos=self.forced_eos,
                    candidates=table.of(s, _prefix(c)) if table is not None and use else None)
                for k, s, n, use, c in zip(keys, sequences, limits, on, controls)]
        for row, c in zip(rows, controls):
            if c is not None:
                row.controls, row.index = c
                row.logprobs = [] if c[0].opts.return_logprobs else None
        joining = [i for i, r in enumerate(rows) if r.limit > 0]
        if not joining:
            return rows
        ids, mask = pad_batch([sequences[i] for i in joining], self.e.src_pad_id)
        cross = self.feed.encode(ids, mask)
        n, k, width = len(self.rows), len(joining), mask.shape[1]
        self._widen(width)
        for buf, new in zip(self.cross, cross):                      # the joiners' rows, in place
            buf[n:n + k, :, :width] = new
            buf[n:n + k, :, width:] = 0
        self.src_mask[n:n + k] = 0
        self.src_mask[n:n + k, :width] = mask
        for i in joining:                                             # each from slot 0 of its buffer row
            self.rows.append(rows[i])
        self.joined += len(joining)
        return rows

    def _widen(self, width: int) -> None:
        """Cross K/V buffers at least `width` source positions wide (the widest source seen so far: a row's
        padding is masked by encoder_attention_mask 0, as in a request-level batch)."""
        if self.cross and self.src_mask.shape[1] >= width:
            return
        old, n = self.cross, len(self.rows)
        shape = (self.slots, self.e.n_heads, width, self.e.head_dim)
        self.cross = [np.zeros(shape, dtype=np.float32) for _ in self.e.cross_names]
        for buf, prev in zip(self.cross, old):
            buf[:n, :, :prev.shape[2]] = prev[:n]
        mask = np.zeros((self.slots, width), dtype=np.int64)
        mask[:, 0] = 1                                                # rows bound but not live see one key
        mask[:n, :self.src_mask.shape[1]] = self.src_mask[:n]
        self.src_mask = mask
        self._binding = None

    # --- one step ---

    def stop(self, row: Row) -> None:
        """The caller no longer wants this row: it leaves at the next step with what it has."""
        row.stopped = True

    def step(self) -> list[Row]:
        """One decoder step for every live row; returns the rows that left (finished, at their limit, stopped)."""
        gone = [r for r in self.rows if r.stopped]
        if gone:
            self._leave()
        if not self.rows:
            return gone
        n = len(self.rows)
        bound = min(self.slots, -(-n // ROW_BUCKET) * ROW_BUCKET)
        vocab = self._vocab()
        if self._binding is None or bound != self.bound or not _same(vocab, self.vocab):
            self.vocab = None if vocab is None else self.feed.select(vocab)   # the projection rows: gathered here
            self._binding, self.bound = self._bind(bound), bound
        tokens = np.full((bound, 1), self.e.bos_id, dtype=np.int64)   # rows past n: not live, results unused
        lengths = np.zeros(bound, dtype=np.int32)                     # ... at length 0 (slot 0 of a free row)
        tokens[:n, 0] = [r.last for r in self.rows]
        lengths[:n] = [r.length for r in self.rows]
        logits = self._rows_logits(self._binding.step(tokens, lengths)[:n])   # [n, V]
        self.steps += 1
        no_eos = [i for i, r in enumerate(self.rows) if r.ignore_eos] if not self.opts.ignore_eos else slice(None)
        logits[no_eos, self.e.eos_id] = -np.inf
        nxt, scores = greedy_pick(logits, self.suppress)
        controlled = [i for i, r in enumerate(self.rows) if r.controls is not None]
        gains = scores
        if controlled:                                                # their own tokens; a forced one scores 0
            gains = np.where(self._control(logits, nxt, scores, np.asarray(controlled)), scores, 0.0)
        end = [i for i, r in enumerate(self.rows) if r.forced_eos and len(r.tokens) + 1 >= r.limit]
        if end:                                                       # rows at their limit end with EOS, unscored
            nxt[end] = self.e.eos_id
            scores[end] = chosen_logprob(logits[end], nxt[end])
            gains = gains.copy() if gains is scores else gains       # scores keep the model's log-probability
            gains[end] = 0.0
        for r, token, score, gain in zip(self.rows, nxt, scores, gains):
            r.length += 1
            r.tokens.append(int(token))
            r.score += float(gain)
            if r.logprobs is not None:
                r.logprobs.append(float(score))
            r.finished = bool(token == self.e.eos_id)
            r.last = int(token)
            if r.finished or len(r.tokens) >= r.limit:
                r.stopped = True
        left = [r for r in self.rows if r.stopped]
        if left:
            self._leave()
        assert n >= len(self.rows)
        return gone + left

    def _vocab(self) -> np.ndarray | None:
        """The shortlist ids a step computes: the union of the live rows' candidates (None: the full vocabulary,
        when no row or any row decodes without the shortlist). Computed again only when the rows change."""
        own = [r.candidates for r in self.rows]
        if not own or any(c is None for c in own):
            return None
        if not _same_arrays(own, self._union[0]):                     # the cached lists keep their arrays alive
            self._union = (own, np.unique(np.concatenate(own)))
        return self._union[1]

    def _rows_logits(self, logits: np.ndarray) -> np.ndarray:
        """Each live row's full-vocabulary logits [n, V] (a copy: ORT reuses the output's memory), restricted to its
        own candidates where it has them (the masks made again only when the rows or the bound ids change)."""
        if self.vocab is None and all(r.candidates is None for r in self.rows):
            return logits[:, -1].copy()
        own = [r.candidates for r in self.rows]
        vocab = self.vocab.ids if self.vocab is not None else np.arange(logits.shape[-1])
        vocab_of, rows_of, allowed = self._allowed
        if vocab_of is not self.vocab or not _same_arrays(own, rows_of):
            allowed = np.stack([np.ones(len(vocab), dtype=bool) if c is None else np.isin(vocab, c) for c in own])
            self._allowed = (self.vocab, own, allowed)
        return widen(logits[:, -1:], vocab, allowed, self.e.vocab_size)[:, 0]

    def _control(self, logits: np.ndarray, nxt: np.ndarray, scores: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Rows idx's tokens and log-probabilities, in place in nxt and scores: the row's prefix token while one is
        due, else chosen (or drawn, with its own generator) on its logits processed by its Controls, in one call
        for the rows of equal settings. Returns whether each row chose its token (over all rows)."""
        rows = [self.rows[i] for i in idx]
        steps = np.array([len(r.tokens) for r in rows])
        forced, generated = np.empty(len(rows), dtype=np.int64), np.empty(len(rows), dtype=np.int64)
        for c, at in _groups(rows, lambda r: r.controls):             # one request's rows: its prefixes
            own = np.array([rows[k].index for k in at])
            forced[at], generated[at] = c.forced(steps[at], own), c.generated(steps[at], own)
        chosen = np.ones(len(nxt), dtype=bool)
        chosen[idx] = forced < 0
        nxt[idx] = np.where(forced < 0, nxt[idx], forced)
        free = np.flatnonzero(forced < 0)                             # the rows that choose (positions in rows)
        for _, at in _groups([rows[k] for k in free], lambda r: r.controls.settings):
            at = free[at]
            group, c = idx[at], rows[at[0]].controls
            history = self._history([rows[k] for k in at]) if c.needs_history else None
            processed = c.process(logits[group], history, generated[at])
            if c.opts.sample:                                         # each row's draw from its own generator
                u = np.concatenate([rows[k].controls.uniforms([rows[k].index]) for k in at])
                nxt[group] = c.draw(processed, u)
            else:
                nxt[group] = processed.argmax(axis=-1)
        scores[idx] = chosen_logprob(logits[idx], nxt[idx])
        return chosen

    def _history(self, rows: list[Row]) -> np.ndarray:
        """Each row's decoder input so far (start token, then its tokens), left-padded with -1 to the longest."""
        width = 1 + max(len(r.tokens) for r in rows)
        out = np.full((len(rows), width), -1, dtype=np.int64)
        for j, r in enumerate(rows):
            out[j, width - 1 - len(r.tokens):] = [self.e.bos_id, *r.tokens]
        return out

    # --- rows out ---

    def _leave(self) -> None:
        """Drop stopped rows: the last staying rows move into their places, so the live rows stay the leading
        buffer rows and only as many rows move as left (their filled slots, cross K/V, source masks)."""
        stay = [i for i, r in enumerate(self.rows) if not r.stopped]
        n = len(stay)
        holes = [i for i in range(n) if self.rows[i].stopped]      # places below n that are freed
        movers = [i for i in stay if i >= n]                        # staying rows above n: one per hole
        for r in self.rows:
            r.left = r.stopped
        order = list(range(n))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        if holes:
            filled = max(self.rows[i].length for i in movers)         # the movers' slots; the rest is never read
            for buf in self.buffers:
                buf[holes, :, :filled] = buf[movers, :, :filled]
            for buf in self.cross:
                buf[holes] = buf[movers]
            self.src_mask[holes] = self.src_mask[movers]
        self.rows = [self.rows[i] for i in order]

    def _bind(self, n: int):
        """The decoder's binding for the leading n buffer rows: buffers (past and present in one), cross K/V, source
        mask. Views of the slot arrays, no copies: joins and leaves change their contents in place, so the binding
        lives until n changes or the cross buffers widen."""
        return self.feed.bind_static(self.src_mask[:n], [buf[:n] for buf in self.cross],   # leading rows: contiguous
                                     [buf[:n] for buf in self.buffers], self.vocab)


def _same(a: np.ndarray | None, b: Selection | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and (a is b.ids or np.array_equal(a, b.ids)))


def _prefix(control) -> np.ndarray:
    """A row's forced target prefix ids (its request's Controls and its row there), empty without controls."""
    if control is None:
        return np.zeros(0, dtype=np.int64)
    controls, row = control
    return controls.prefix[row][:controls.prefix_len[row]]


def _same_arrays(a: list, b: list) -> bool:
    """The same arrays (objects, not values) in the same order; None entries compare as None."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def answer(rows: Sequence[Row], n: int) -> list[list[Hypothesis]]:
    """A request's hypotheses from its rows in request_rows' order: per input, its n samples (n = 1: greedy)."""
    return [[r.hypothesis() for r in rows[b:b + n]] for b in range(0, len(rows), n)]


def _groups(items: list, key) -> list[tuple[Any, np.ndarray]]:
    """(key, positions of the items with that key), in the order the keys first occur."""
    out: dict = {}
    for k, item in enumerate(items):
        out.setdefault(key(item), []).append(k)
    return [(k, np.asarray(at)) for k, at in out.items()]


__all__ = ["InflightBatch", "Row", "answer", "check_engine", "REOPTIMIZE"]
