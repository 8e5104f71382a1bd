"""The ONNX Runtime engine: runtime.generate's Engine over an encoder session and a cached decoder session.

    engine = OrtEngine(encoder_session, decoder_session, config, provider="cpu", io_binding=False,
                       layout="dynamic")                       # the manifest's decoder_layout
    state = engine.start(input_ids, attention_mask, expand, max_steps)   # encoder once; rows repeated for beams
    logits = state.step(tokens, keep)                          # one decoder step, presents become pasts

Three data paths share the state logic (DecodeState) and differ only in where tensors live:
- HostPath: `session.run` with numpy arrays; every output comes back to the host each step.
- StaticPath (runtime/static_cache.py): for bundles whose manifest declares a static decoder layout: one
  preallocated buffer per cache tensor, bound as both past and present, written in place (no per-step copy).
- BoundPath: IO binding with OrtValues; the cross K/V and the KV cache stay on the device (on CPU that is
  host memory without a copy; on CUDA no host round trip per step): each step binds the previous
  step's presents as pasts, and only the logits are copied to the host. Rows are reordered on the
  device by a one-node Gather graph (runtime.session.gather_model).
Every input is built and every session run by runtime/feed.py; the paths decide where tensors live.

All per-request state lives in the DecodeState, never on the engine: one engine serves many threads.
The paths read the engine's `Facts`, never the engine: a path the engine owns that pointed back at it would make
a cycle, and the engine, its sessions and their weights would then outlive their last use until Python's cyclic
collector happened to run (optimize's gate sessions stayed alive while the bundle was written).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from runtime.feed import Feed
from runtime.shortlist import Selection, Shortlist, ShortlistWeight, widen
from runtime.spec import (DYNAMIC, begin_suppressed_ids, empty_past, feature_shape, forces_eos, source_pad_id,
                          source_vocab_size, suppressed_ids)
from runtime.static_cache import StaticPath


@dataclass(frozen=True)
class Facts:
    """What the data paths read of their engine (see the module docstring)."""

    feed: Feed
    n_heads: int
    head_dim: int
    past_names: list
    max_len: int
    vocab_size: int


class HostPath:
    """Tensors are numpy arrays; `session.run` copies every output to the host."""

    def __init__(self, engine: Facts):
        self.e = engine

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> list:
        return self.e.feed.encode(ids, mask)

    def take(self, tensors: list, rows: np.ndarray) -> list:
        return [np.take(t, rows, axis=0) for t in tensors]            # one gather per tensor

    take_past = take

    def mask(self, mask: np.ndarray):
        return mask

    def empty_past(self, n: int, steps: int | None = None) -> list:
        return [empty_past(n, self.e.n_heads, self.e.head_dim)] * len(self.e.past_names)

    def decode(self, tokens: np.ndarray, mask, past: list, cross: list, vocab=None) -> tuple[np.ndarray, list]:
        return self.e.feed.decode(tokens, mask, past, cross, vocab)


class BoundPath:
    """Tensors are OrtValues on the session's device; IO binding feeds them back without a host copy."""

    def __init__(self, engine: Facts):
        self.e = engine
        self.device = engine.feed.device

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> list:
        return self.e.feed.encode_bound(ids, mask)

    def take(self, tensors: list, rows: np.ndarray) -> list:
        return self.e.feed.gather(tensors, rows)

    take_past = take

    def mask(self, mask: np.ndarray):
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(mask), self.device, 0)  # copied once per move

    def empty_past(self, n: int, steps: int | None = None) -> list:
        empty = ort.OrtValue.ortvalue_from_numpy(empty_past(n, self.e.n_heads, self.e.head_dim))
        return [empty] * len(self.e.past_names)                        # zero bytes: host is fine

    def decode(self, tokens: np.ndarray, mask, past: list, cross: list, vocab=None) -> tuple[np.ndarray, list]:
        return self.e.feed.decode_bound(tokens, mask, past, cross, vocab)


class OrtState:
    """Decoder state of one request: the mask, cross K/V and self-attention cache of its current rows, and with a
    shortlist its Selection (vocab: its ids [V'] and the decoder inputs made for them once) and each input's own
    candidates among them (allowed [inputs, V'])."""

    def __init__(self, path, mask: np.ndarray, cross: list, sources: np.ndarray, steps: int | None = None,
                 shortlist: tuple[Selection, np.ndarray] | None = None):
        self.path, self.cross, self.sources = path, cross, sources     # sources: the input each row belongs to
        self.host_mask = mask                                          # [N, S] int64
        self.mask = path.mask(mask)
        self.past = path.empty_past(len(mask), steps)                  # [N, H, 0, Dh] per tensor, or static buffers
        self.vocab, self.allowed = shortlist if shortlist is not None else (None, None)

    def step(self, tokens: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
        if keep is not None:                                           # reorder/drop rows before the step
            keep = np.asarray(keep, dtype=np.int64)
            self.past = self.path.take_past(self.past, keep)
            moved = self.sources[keep]
            if not np.array_equal(moved, self.sources):                # rows changed input: cross K/V and mask follow
                self.cross = self.path.take(self.cross, keep)
                self.host_mask = self.host_mask[keep]
                self.mask = self.path.mask(self.host_mask)
            self.sources = moved
        return self.feed(np.asarray(tokens, dtype=np.int64)[:, None])[:, -1]   # [N, V]

    def feed(self, tokens: np.ndarray) -> np.ndarray:
        """T given tokens per row [N, T] -> logits [N, T, V] (teacher forcing; the cache grows by T): one decoder
        run in the dynamic layout, one run per token for a static cache (its graph takes one token a step)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        if isinstance(self.path, StaticPath) and tokens.shape[1] > 1:
            return np.stack([self.feed(tokens[:, t:t + 1])[:, 0] for t in range(tokens.shape[1])], axis=1)
        logits, self.past = self.path.decode(tokens, self.mask, self.past, self.cross, self.vocab)
        if self.vocab is None:
            return logits
        return widen(logits, self.vocab.ids, self.allowed[self.sources], self.path.e.vocab_size)


class OrtEngine:
    """runtime.generate.Engine over ONNX Runtime sessions of a bundle's encoder and decoder graphs."""

    def __init__(self, encoder: ort.InferenceSession, decoder: ort.InferenceSession, config: dict,
                 provider: str = "cpu", io_binding: bool | None = None, layout: str = DYNAMIC,
                 shortlist: tuple[Shortlist, ort.InferenceSession, ShortlistWeight | None] | None = None):
        self.config, self.provider, self.layout = config, provider, layout
        self.feed = Feed(encoder, decoder, config, layout, provider)
        self.shortlist = None                                          # the bundle's map, used by start(targets=)
        if shortlist is not None:
            self.use_shortlist(*shortlist)
        self.pad_id, self.bos_id, self.eos_id = config["pad_id"], config["bos_id"], config["eos_id"]
        self.vocab_size, self.max_len = config["vocab_size"], config["max_len"]
        self.src_vocab_size, self.suppress_ids = source_vocab_size(config), suppressed_ids(config)
        self.src_pad_id, self.forced_eos = source_pad_id(config), forces_eos(config)
        self.feature_shape, self.begin_suppress_ids = feature_shape(config), begin_suppressed_ids(config)
        self.n_heads, self.head_dim = self.feed.n_heads, self.feed.head_dim
        self.cross_names, self.past_names = self.feed.cross_names, self.feed.past_names
        self.static_cache = layout != DYNAMIC
        facts = Facts(self.feed, self.n_heads, self.head_dim, self.past_names, self.max_len, self.vocab_size)
        if self.static_cache:                                          # one buffer per cache, bound as past and present
            self.io_binding = True
            self.path = StaticPath(facts, HostPath(facts) if provider == "cpu" else BoundPath(facts), self.feed.device)
        else:
            self.io_binding = default_io_binding(provider) if io_binding is None else io_binding
            self.path = BoundPath(facts) if self.io_binding else HostPath(facts)
        self.name = f"ort-{provider}" + ("-static-cache" if self.static_cache else
                                         "-iobinding" if self.io_binding else "")

    def use_shortlist(self, shortlist: Shortlist, decoder: ort.InferenceSession,
                      weight: ShortlistWeight | None = None) -> None:
        """Decode requests asking for it on this map and the decoder's shortlist variant (the runtime.spec
        shortlist_decoder_spec interface; `weight`: the table its shortlist_weight input is gathered from, None for
        a decoder that gathers its rows itself)."""
        self.shortlist, self.feed.shortlist_decoder, self.feed.shortlist_weight = shortlist, decoder, weight

    @property
    def encoder(self):
        return self.feed.encoder

    @encoder.setter
    def encoder(self, session) -> None:
        self.feed.encoder = session

    @property
    def decoder(self):
        return self.feed.decoder

    @decoder.setter
    def decoder(self, session) -> None:
        self.feed.decoder = session

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> list:
        """The encoder's run alone: the cross K/V (2 * layers tensors [B, H, S, Dh]) that start(encoded=) takes,
        so several decodes of the same inputs (Whisper's first step, then each temperature) share one run."""
        ids = np.ascontiguousarray(input_ids, dtype=np.float32 if self.feature_shape else np.int64)
        return self.path.encode(ids, np.ascontiguousarray(attention_mask, dtype=np.int64))

    def start(self, input_ids: np.ndarray, attention_mask: np.ndarray, expand: int,
              max_steps: int | None = None, targets: list | None = None, encoded: list | None = None) -> OrtState:
        """input_ids: token ids [B, S], or an audio encoder's features [B, n_mels, frames] (runtime.generate).
        `targets` (only where the engine has a shortlist): decode on the shortlist of the inputs' source tokens,
        each input's rows restricted to its own candidates and its targets[b] (its forced prefix ids); None: the
        whole vocabulary. `encoded`: encode(input_ids, attention_mask) already run (the encoder is then skipped;
        the tensors are only read, never written, so one result serves many states)."""
        ids = np.ascontiguousarray(input_ids, dtype=np.float32 if self.feature_shape else np.int64)   # [B, S]
        mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
        shortlist = None
        if targets is not None:                                        # the projection rows: gathered once, here
            vocab, allowed = self.shortlist.select(ids, mask, targets)
            shortlist = self.feed.select(vocab), allowed
        cross = self.path.encode(ids, mask) if encoded is None else list(encoded)   # 2 * layers [B, H, S, Dh]
        sources = np.arange(len(ids))
        if expand > 1:                                                 # beam rows b * expand + j share input b
            sources = np.repeat(sources, expand)
            cross = self.path.take(cross, sources)
            mask = mask[sources]
        return OrtState(self.path, mask, cross, sources, max_steps, shortlist)


def default_io_binding(provider: str) -> bool:
    """CUDA: IO binding (no host round trip per step). CPU: plain session.run, which is faster there: IO binding's
    per-input bind calls cost more than the output copies they save, and a beam reorder by np.take costs less than
    a run of the Gather session."""
    return provider == "cuda"
