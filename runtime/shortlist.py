"""The vocabulary shortlist: which target tokens a request may produce, from its source tokens.

    shortlist = Shortlist.load(bundle / "shortlist.npz", src_vocab_size, vocab_size)
    vocab, allowed = shortlist.select(input_ids, attention_mask, extra)   # the union [V'], each input's own [B, V']
    logits = widen(local_logits, vocab, allowed[sources], vocab_size)      # [N, T, V'] -> [N, T, V], -inf elsewhere

The file (`onnxformer shortlist` writes it) maps each source token to its candidate target tokens (CSR:
`offsets` int64 [src_vocab + 1], `candidates` int32) and holds the tokens every request may produce (`always`:
the specials and the most frequent targets). A request's candidates are the union over all its inputs: the
decoder's shortlist graph projects onto those rows of the output matrix only (its `vocab_ids` input), and each
row is then masked to its own input's candidates, so a row decodes exactly as it would alone.

Local logit indices become vocabulary ids here and only here (`widen`): the search and its logits processors
see full-vocabulary logits in which every token outside the row's candidates is -inf.

The decoder does not gather the projection's rows for those ids itself each step: a request's state gathers them
once (`ShortlistWeight.take`, from the table the manifest's shortlist "weight" record maps, e.g. a tied model's
embedding in weights.data) and every step of the request binds them (`Selection`: the shortlist decoder's extra
inputs). A per-step gather copied V' x D floats a step, more than the product it fed at batch 1 (RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.errors import BundleError

ARRAYS = ("offsets", "candidates", "always")
FEEDS = ("rows", "columns")         # the shortlist weight's layout: [V', D] (fp32 Gemm) or [D, V'] (int8 MatMul)


class Shortlist:
    """A source-token -> candidate-target-tokens map plus the always-included targets (validated on load); a
    multilingual bundle's file holds one map per target language (`languages`: the language's lead token id ->
    its map), picked per input by the first token of its forced target prefix (the target language)."""

    def __init__(self, offsets: np.ndarray, candidates: np.ndarray, always: np.ndarray,
                 languages: dict[int, "Shortlist"] | None = None):
        self.offsets, self.candidates, self.always = offsets, candidates, always
        self.languages = languages or None

    @classmethod
    def per_language(cls, maps: dict[int, "Shortlist"]) -> "Shortlist":
        """One map per target language, keyed by the language's lead token id (its forced first target token)."""
        empty = np.zeros(0, dtype=np.int64)
        first = next(iter(maps.values()))
        return cls(np.zeros_like(first.offsets), empty, empty, dict(maps))

    @classmethod
    def load(cls, path: str | Path, src_vocab_size: int, vocab_size: int) -> "Shortlist":
        """The map(s) in `path`; a file that does not describe maps for these vocabularies is a BundleError."""
        try:
            with np.load(path, allow_pickle=False) as data:
                leads = np.asarray(data["leads"]).astype(np.int64).tolist() if "leads" in data else None
                suffixes = [""] if leads is None else [f"_{i}" for i in range(len(leads))]
                arrays = [{name: np.asarray(data[name + k]) for name in ARRAYS} for k in suffixes]
        except (OSError, ValueError, KeyError) as exc:
            raise BundleError(f"{path} is not a shortlist file ({str(exc).splitlines()[0][:200]}); copy the bundle "
                              f"again or rebuild it with onnxformer shortlist") from None
        maps = []
        for a in arrays:
            offsets, candidates, always = (a[n] for n in ARRAYS)
            problem = _problem(offsets, candidates, always, src_vocab_size, vocab_size)
            if problem:
                raise BundleError(f"{path}: {problem}; rebuild the shortlist with onnxformer shortlist")
            maps.append(cls(offsets.astype(np.int64), candidates.astype(np.int64), np.unique(always.astype(np.int64))))
        if leads is None:
            return maps[0]
        if len(set(leads)) != len(leads) or any(not 0 <= t < vocab_size for t in leads):
            raise BundleError(f"{path}: its language lead tokens must be distinct target ids; rebuild the shortlist "
                              f"with onnxformer shortlist")
        return cls.per_language(dict(zip(leads, maps)))

    def pick(self, targets=()) -> list["Shortlist"]:
        """The maps an input with this forced target prefix decodes on: its target language's (the first prefix
        token), or every language's when it names none of them (their union: never fewer candidates)."""
        if self.languages is None:
            return [self]
        lead = int(targets[0]) if len(targets) else None
        return [self.languages[lead]] if lead in self.languages else list(self.languages.values())

    def of(self, tokens, targets=()) -> np.ndarray:
        """The sorted candidates of one input's source tokens (ids), the always-included ones and its forced
        target prefix `targets` among them."""
        tokens = np.unique(np.asarray(tokens, dtype=np.int64)).tolist()
        parts = [np.asarray(targets, dtype=np.int64).reshape(-1)]
        for m in self.pick(targets):
            parts += [m.always] + [m.candidates[m.offsets[t]:m.offsets[t + 1]] for t in tokens]
        return np.unique(np.concatenate(parts))

    def select(self, input_ids: np.ndarray, attention_mask: np.ndarray, extra=None) -> tuple[np.ndarray, np.ndarray]:
        """(vocab [V'] int64, the sorted union of every input's candidates; allowed [B, V'] bool, each input's own).
        `extra`: per input, its forced target prefix (ids it may also produce; its first picks the language's map)."""
        own = [self.of(ids[mask > 0], extra[b] if extra is not None else ())
               for b, (ids, mask) in enumerate(zip(input_ids, attention_mask))]
        vocab = np.unique(np.concatenate(own))
        allowed = np.zeros((len(own), len(vocab)), dtype=bool)
        for b, mine in enumerate(own):
            allowed[b, np.searchsorted(vocab, mine)] = True
        return vocab, allowed

    def sizes(self) -> dict:
        """How large the map is: candidates per source token (most, mean over tokens with any), always-included
        (per-language maps: the largest of each figure, and how many languages)."""
        if self.languages is not None:
            each = [m.sizes() for m in self.languages.values()]
            return {k: max(e[k] for e in each) for k in each[0]} | {"languages": len(each)}
        counts = np.diff(self.offsets)
        listed = counts[counts > 0]
        return {"source_tokens": int(len(listed)), "most_candidates": int(counts.max(initial=0)),
                "mean_candidates": round(float(listed.mean()), 2) if len(listed) else 0.0,
                "always": int(len(self.always))}


class ShortlistWeight:
    """The output projection as a table with a row per target id ([V, D], read-only, usually a view of a mapped
    bundle file), and how the shortlist decoder takes a request's part of it (`feed`, one of FEEDS)."""

    def __init__(self, table: np.ndarray, feed: str):
        if feed not in FEEDS or table.ndim != 2:
            raise ValueError(f"a shortlist weight is a [V, D] table fed as one of {FEEDS}, got {table.shape} {feed!r}")
        self.table, self.feed = table, feed

    def take(self, ids: np.ndarray) -> np.ndarray:
        """The rows of `ids` [V', D], or for "columns" their transpose [D, V'], contiguous (a copy)."""
        rows = np.take(self.table, ids, axis=0)
        return rows if self.feed == "rows" else np.ascontiguousarray(rows.T)


@dataclass(eq=False)
class Selection:
    """The target ids a request's decoder steps compute (`ids` [V'], sorted) and the shortlist decoder's inputs
    for them (`feeds`: vocab_ids, and the gathered shortlist_weight where the decoder takes it), made once."""

    ids: np.ndarray
    feeds: dict = field(default_factory=dict)


def _problem(offsets, candidates, always, src_vocab_size: int, vocab_size: int) -> str | None:
    if offsets.ndim != 1 or len(offsets) != src_vocab_size + 1 or offsets.dtype.kind not in "iu":
        return f"offsets must be {src_vocab_size + 1} integers (one more than the source vocabulary)"
    if candidates.ndim != 1 or always.ndim != 1 or candidates.dtype.kind not in "iu" or always.dtype.kind not in "iu":
        return "candidates and always must be 1-D integer arrays"
    if offsets[0] != 0 or offsets[-1] != len(candidates) or (np.diff(offsets) < 0).any():
        return "offsets must rise from 0 to the number of candidates"
    for name, ids in (("candidates", candidates), ("always", always)):
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            return f"{name} hold ids outside the target vocabulary of {vocab_size}"
    return None


def widen(logits: np.ndarray, vocab: np.ndarray, allowed: np.ndarray, vocab_size: int) -> np.ndarray:
    """Shortlist logits [N, T, V'] (columns: the ids in `vocab`) as full-vocabulary logits [N, T, vocab_size]:
    each row keeps its own candidates (`allowed` [N, V']), every other token is -inf."""
    out = np.full(logits.shape[:-1] + (vocab_size,), -np.inf, dtype=logits.dtype)
    out[..., vocab] = np.where(allowed[:, None, :], logits, -np.inf)
    return out


__all__ = ["Shortlist", "ShortlistWeight", "Selection", "widen", "ARRAYS", "FEEDS"]
