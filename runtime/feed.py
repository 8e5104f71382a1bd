"""Feeding the graphs: the one place that builds encoder and decoder inputs and runs their sessions.

    feed = Feed(encoder_session, decoder_session, config, layout="static-per-row", provider="cpu")
    cross = feed.encode(ids, mask)                                   # numpy; feed.encode_bound: OrtValues on the device
    logits, presents = feed.decode(tokens, mask, past, cross)        # the dynamic contract, any layout
    bound = feed.bind_static(mask, cross, buffers)                   # static layouts: bound once ...
    logits = bound.step(tokens, lengths)                             # ... then ids, lengths, positions per step
    logits, presents = feed.decode(tokens, mask, past, cross, vocab)  # vocab: a shortlist's ids [V'] (every way)

The decoder is fed by its declared layout (the manifest's decoder_layout, runtime/spec.py), never by its input
names:

    dynamic          past [B,H,P,Dh] in, present [B,H,P+T,Dh] out; position_ids, decoder_attention_mask [B,P]
    static-per-row   one buffer [B,H,cache_len,Dh] bound as past and present; past_sequence_length int32 [B]
                     (each row's own filled length); position_ids [B,1]; no key mask
    static-shared    the same buffer; past_sequence_length int32 [1] (all rows at one length); position_ids [B,1];
                     decoder_attention_mask [B,cache_len], all ones (every slot below the length is a real token)

Three ways to feed, by where tensors live:
- host (`encode`, `decode`): numpy in, `session.run`, numpy out. For a static layout `decode` runs the graph in
  the dynamic contract, one token at a time into a buffer of exactly the positions needed (parity compares a
  static graph with its source this way);
- bound (`encode_bound`, `decode_bound`, `gather`): IO binding, OrtValues stay on the session's device and only
  the logits come to the host;
- static (`bind_static` -> StaticStep): the buffers, cross K/V and masks are bound once (numpy views wrapped
  without a copy on the CPU, OrtValues on the device); a step binds its token ids, filled lengths and positions
  only, and the graph writes the new key/value into the buffers in place.

Every decoder call takes an optional `vocab` (runtime/shortlist.py): the call then runs the bundle's shortlist
decoder, which gives logits [.., V'] for those ids only. Pass the `Selection` that `feed.select(ids)` made once for
the request (its vocab_ids and the projection rows gathered for them); plain ids [V'] work too, gathered each call.
"""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort

from runtime.session import FLOAT, SessionConfig, device_of, gather_model, make_session
from runtime.spec import (CROSS, DECODER_ATTENTION_MASK, DECODER_LAYOUTS, DYNAMIC, INPUT_FEATURES, INPUT_IDS, PAST,
                          PAST_SEQUENCE_LENGTH, POSITION_IDS, PRESENT, SELF, SHORTLIST_WEIGHT, STATIC_PER_ROW, VOCAB_IDS,
                          cache_names, default_row_inputs, feature_shape, head_dim_of, takes_key_mask)
from runtime.shortlist import Selection

ENCODER_MASK = "encoder_attention_mask"


def _value(x) -> ort.OrtValue:
    """An OrtValue as it is (on its device), or a numpy array wrapped without a copy (it keeps the array alive)."""
    return x if isinstance(x, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(x)


class Feed:
    """How an encoder and a decoder session are fed: tensor names from runtime/spec.py, the decoder by its layout."""

    def __init__(self, encoder, decoder, config: dict, layout: str = DYNAMIC, provider: str = "cpu",
                 shortlist_decoder=None, shortlist_weight=None):
        if layout not in DECODER_LAYOUTS:
            raise ValueError(f"unknown decoder layout {layout!r}; one of {DECODER_LAYOUTS}")
        self.encoder, self.decoder, self.layout, self.provider = encoder, decoder, layout, provider
        self.shortlist_decoder = shortlist_decoder                     # the same graph taking vocab_ids, or None
        self.shortlist_weight = shortlist_weight                       # its projection table (ShortlistWeight), or None
        self.device = device_of(provider)
        self.static, self.per_row, self.key_mask = layout != DYNAMIC, layout == STATIC_PER_ROW, takes_key_mask(layout)
        self.n_heads, self.head_dim = config["n_heads"], head_dim_of(config)
        self.features = feature_shape(config) is not None              # an audio encoder: features in, no mask
        layers = config["n_decoder_layers"]
        self.cross_names = cache_names(layers, PRESENT, CROSS)         # encoder outputs
        self.cross_in_names = cache_names(layers, PAST, CROSS)         # ... fed to the decoder by these names
        self.past_names = cache_names(layers, PAST, SELF)
        self.present_names = cache_names(layers, PRESENT, SELF)
        self.decoder_out_names = ["logits"] + self.present_names
        self._gather = None
        self._lock = threading.Lock()

    # --- the encoder ---

    def encoder_feeds(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        """The encoder's inputs by its spec: token ids and their mask, or an audio encoder's features alone (`ids`
        holds them; `mask` is the decoder's, unused here)."""
        if self.features:
            return {INPUT_FEATURES: np.ascontiguousarray(ids, dtype=np.float32)}
        return {INPUT_IDS: ids, "attention_mask": mask}

    def encode(self, ids: np.ndarray, mask: np.ndarray, names: list[str] | None = None) -> list[np.ndarray]:
        """The encoder's outputs `names` (default: the cross K/V, 2 * layers [B, H, S, Dh]) as numpy arrays."""
        return self.encoder.run(names or self.cross_names, self.encoder_feeds(ids, mask))

    def encode_bound(self, ids: np.ndarray, mask: np.ndarray) -> list[ort.OrtValue]:
        """The cross K/V as OrtValues on the session's device (no host copy)."""
        binding = self.encoder.io_binding()
        for name, value in self.encoder_feeds(ids, mask).items():
            binding.bind_cpu_input(name, value)
        self._bind_outputs(binding, self.cross_names)
        self.encoder.run_with_iobinding(binding)
        return binding.get_outputs()

    # --- the decoder, in the dynamic contract ---

    def session(self, vocab: np.ndarray | None):
        """The decoder session a call runs: the shortlist decoder when it is given a shortlist's ids."""
        if vocab is None:
            return self.decoder
        if self.shortlist_decoder is None:
            raise ValueError("a shortlist's vocab ids were given but the bundle has no shortlist decoder")
        return self.shortlist_decoder

    def select(self, ids: np.ndarray) -> Selection:
        """The shortlist decoder's inputs for computing the logits of `ids` (sorted target ids): made once per
        request (or per change of an in-flight batch's rows), bound by every step."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        feeds = {VOCAB_IDS: ids}
        if self.shortlist_weight is not None:
            feeds[SHORTLIST_WEIGHT] = self.shortlist_weight.take(ids)
        return Selection(ids, feeds)

    def _vocab_feed(self, vocab) -> dict:
        if vocab is None:
            return {}
        return (vocab if isinstance(vocab, Selection) else self.select(vocab)).feeds

    def decode(self, tokens: np.ndarray, mask: np.ndarray, past: list, cross: list,
               vocab: np.ndarray | None = None) -> tuple[np.ndarray, list]:
        """tokens [B, T] after past [B, H, P, Dh] (every slot a real token): logits [B, T, V] (V': len(vocab)) and
        presents [B, H, P + T, Dh], numpy. Static layouts run T one-token steps into buffers of P + T positions."""
        if self.static:
            return self._decode_static(tokens, mask, past, cross, vocab)
        feeds = {INPUT_IDS: tokens, ENCODER_MASK: mask, **default_row_inputs(len(tokens), past[0].shape[2],
                                                                              tokens.shape[1], self.layout),
                 **dict(zip(self.past_names, past)), **dict(zip(self.cross_in_names, cross)), **self._vocab_feed(vocab)}
        logits, *presents = self.session(vocab).run(self.decoder_out_names, feeds)
        return logits, presents

    def _decode_static(self, tokens: np.ndarray, mask: np.ndarray, past: list, cross: list, vocab=None):
        rows, filled, new = len(tokens), past[0].shape[2], tokens.shape[1]
        buffers = []
        for p in past:                                                 # room for exactly this call's positions
            buf = np.zeros(p.shape[:2] + (filled + new,) + p.shape[3:], dtype=p.dtype)
            buf[:, :, :filled] = p
            buffers.append(buf)
        fixed = {ENCODER_MASK: mask, **dict(zip(self.cross_in_names, cross)), **self._vocab_feed(vocab)}
        if self.key_mask:
            fixed[DECODER_ATTENTION_MASK] = np.ones((rows, filled + new), dtype=np.int64)
        logits = []
        for t in range(new):
            lengths = np.full(rows if self.per_row else 1, filled + t, dtype=np.int32)
            step = {INPUT_IDS: np.ascontiguousarray(tokens[:, t:t + 1]), PAST_SEQUENCE_LENGTH: lengths,
                    POSITION_IDS: np.full((rows, 1), filled + t, dtype=np.int64), **dict(zip(self.past_names, buffers))}
            out, *buffers = self.session(vocab).run(self.decoder_out_names, {**fixed, **step})
            logits.append(out)
        return np.concatenate(logits, axis=1), buffers

    def decode_bound(self, tokens: np.ndarray, mask: ort.OrtValue, past: list, cross: list,
                     vocab: np.ndarray | None = None) -> tuple[np.ndarray, list]:
        """decode with IO binding (dynamic layout): past, cross K/V and the mask are OrtValues on the device, the
        presents stay there; only the logits come to the host."""
        session = self.session(vocab)
        binding = session.io_binding()                                 # fresh each step: outputs never reuse buffers
        binding.bind_cpu_input(INPUT_IDS, tokens)
        for name, value in self._vocab_feed(vocab).items():
            binding.bind_cpu_input(name, value)
        binding.bind_ortvalue_input(ENCODER_MASK, mask)
        for name, value in default_row_inputs(len(tokens), past[0].shape()[2], tokens.shape[1], self.layout).items():
            binding.bind_cpu_input(name, value)
        for name, value in zip(self.past_names + self.cross_in_names, list(past) + list(cross)):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")                           # the one tensor the search reads on the host
        self._bind_outputs(binding, self.present_names)
        session.run_with_iobinding(binding)
        logits, *presents = binding.get_outputs()
        return logits.numpy(), presents

    # --- the decoder, static layouts ---

    def bind_static(self, mask, cross: list, buffers: list, vocab: np.ndarray | None = None) -> "StaticStep":
        """A binding of everything but a step's token ids, lengths and positions: the source mask, cross K/V, and
        each buffer as both past and present (numpy arrays or views, wrapped without a copy, or device OrtValues),
        and a shortlist's Selection. Every tensor holds the same rows."""
        session = self.session(vocab)
        binding = session.io_binding()
        kept = [_value(mask), *(_value(c) for c in cross)]            # the binding refers to their memory
        for name, value in self._vocab_feed(vocab).items():
            kept.append(_value(value))
            binding.bind_ortvalue_input(name, kept[-1])
        binding.bind_ortvalue_input(ENCODER_MASK, kept[0])
        for name, value in zip(self.cross_in_names, kept[1:]):
            binding.bind_ortvalue_input(name, value)
        if self.key_mask:                                              # every slot below the length is a real token
            rows, _, capacity, _ = _shape(buffers[0])
            kept.append(_value(np.ones((rows, capacity), dtype=np.int64)))
            binding.bind_ortvalue_input(DECODER_ATTENTION_MASK, kept[-1])
        binding.bind_output("logits", "cpu")                           # the one tensor the search reads on the host
        for past, present, buf in zip(self.past_names, self.present_names, buffers):
            value = _value(buf)
            kept.append(value)
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)               # the same buffer: written in place
        return StaticStep(self, session, binding, kept)

    # --- reordering rows on the device ---

    def gather(self, tensors: list[ort.OrtValue], rows: np.ndarray) -> list[ort.OrtValue]:
        """Rows `rows` of each float tensor, gathered on the device by a one-node Gather graph (made on first use)."""
        with self._lock:
            if self._gather is None:
                n = len(self.past_names)
                one_thread = SessionConfig(intra_op_threads=1)            # no thread pool spinning beside the decoder
                self._gather = make_session(gather_model([FLOAT] * n, [4] * n), self.provider, one_thread)
        binding = self._gather.io_binding()
        for i, t in enumerate(tensors):
            binding.bind_ortvalue_input(f"x{i}", t)
        binding.bind_cpu_input("indices", np.ascontiguousarray(rows, dtype=np.int64))
        self._bind_outputs(binding, [f"y{i}" for i in range(len(tensors))])
        self._gather.run_with_iobinding(binding)
        return binding.get_outputs()

    def _bind_outputs(self, binding, names: list[str]) -> None:
        for name in names:
            binding.bind_output(name, self.device, 0)                  # ORT allocates each run, on the device


def _shape(x) -> tuple:
    """The shape of a numpy array or an OrtValue."""
    return x.shape if isinstance(x, np.ndarray) else tuple(x.shape())


class StaticStep:
    """One static-layout binding: `step` binds a step's inputs and runs the decoder; everything else stays bound."""

    def __init__(self, feed: Feed, session, binding, kept: list):
        self.feed, self.session, self.binding, self.kept = feed, session, binding, kept

    def step(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """tokens int64 [rows, 1]; lengths int32 [rows], each row's filled slots (= its new token's position; the
        shared-slot layout takes lengths[0] for all rows). Returns the logits [rows, 1, V]: ORT's output memory,
        reused by the next run (copy what you keep)."""
        binding = self.binding
        binding.bind_cpu_input(INPUT_IDS, tokens)
        binding.bind_cpu_input(PAST_SEQUENCE_LENGTH, lengths if self.feed.per_row else lengths[:1])
        binding.bind_cpu_input(POSITION_IDS, lengths.astype(np.int64)[:, None])
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()


__all__ = ["Feed", "StaticStep"]
