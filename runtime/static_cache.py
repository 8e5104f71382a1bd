"""Running decoders with a static KV cache (exporters/static_cache.py writes them; `optimize --kv-cache static`).

A static decoder takes its self-attention cache as one preallocated buffer per layer and tensor,
[rows, heads, cache_len, head_dim], plus `past_sequence_length` (how many positions are filled: per row,
int32 [rows], on CPU bundles, whose GroupQueryAttention nodes let rows sit at different lengths; one int32 [1]
for all rows on CUDA bundles, DecoderMaskedMultiHeadAttention). The runtime sizes cache_len per request: the
most tokens it may generate (at most the model's max_len). The attention nodes write the new key/value at that
position and attend over the filled part. The runtime binds the same buffer as past input and present output,
so a step copies nothing: the step time no longer grows with a copy of the whole cache.

    StaticPath        the OrtEngine data path for such decoders (IO binding; buffers in host memory on CPU,
                      on the device on CUDA)
    DynamicView       runs a static decoder with the dynamic contract's feeds and outputs (past [B,H,P,Dh] in,
                      present [B,H,P+T,Dh] out, T tokens fed one at a time): parity checks use it to compare a
                      static graph with its source step by step
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.errors import InputError
from runtime.spec import (DECODER_ATTENTION_MASK, INPUT_IDS, PAST, PAST_SEQUENCE_LENGTH, POSITION_IDS, SELF, is_cache,
                          per_row_lengths, present_of)


def is_static(session: ort.InferenceSession) -> bool:
    """Whether a decoder session takes the static cache (it has a past_sequence_length input)."""
    return any(i.name == PAST_SEQUENCE_LENGTH for i in session.get_inputs())


def per_row_cache(session: ort.InferenceSession) -> bool:
    """Whether a static decoder takes one filled length per row (past_sequence_length [batch])."""
    return any(i.name == PAST_SEQUENCE_LENGTH and per_row_lengths(i.shape) for i in session.get_inputs())


def filled_lengths(rows: int, length: int, per_row: bool) -> np.ndarray:
    """past_sequence_length's feed for `rows` rows all filled to `length`: int32 [rows] (per row) or [1] (shared)."""
    return np.full(rows if per_row else 1, length, dtype=np.int32)


class StaticCache:
    """A request's self-attention buffers: `rows` live rows, `length` of `capacity` positions filled.

    `binding` is the decoder's IO binding with the buffers, cross K/V and mask bound; it lives until the rows
    change (a reorder), so a step binds only its token ids and past_sequence_length.
    """

    def __init__(self, buffers: list, rows: int, capacity: int, length: int = 0):
        self.buffers, self.rows, self.capacity, self.length = buffers, rows, capacity, length
        self.binding = self.key_mask = None


class StaticPath:
    """OrtEngine data path for static-cache decoders: past and present bound to one buffer, updated in place.

    On the CPU the buffers are numpy arrays (IO binding wraps them without a copy); a beam reorder or dropped
    rows move only the filled part, in place. On CUDA they are OrtValues on the device, and a reorder gathers
    them into new buffers with the engine's Gather graph. The encoder, the cross K/V and the mask are handled by
    `base`, the engine's path for the device (HostPath on CPU, BoundPath on CUDA).
    """

    def __init__(self, engine, base, device: str):
        self.e, self.device, self.on_host = engine, device, device == "cpu"
        self.encode, self.take, self.mask = base.encode, base.take, base.mask

    def empty_past(self, n: int, steps: int | None = None) -> StaticCache:
        """Zeroed buffers for n rows and `steps` positions (the request's new tokens; default the model's max_len)."""
        length = self.e.max_len if steps is None else max(1, min(int(steps), self.e.max_len))
        shape = (n, self.e.n_heads, length, self.e.head_dim)
        if self.on_host:
            buffers = [np.zeros(shape, dtype=np.float32) for _ in self.e.past_names]
        else:
            buffers = [ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, self.device, 0)
                       for _ in self.e.past_names]
        return StaticCache(buffers, n, length)

    def take_past(self, cache: StaticCache, rows: np.ndarray) -> StaticCache:
        """Keep rows `rows` (beam reorder, finished rows dropped; never more rows than before)."""
        if not self.on_host:                                        # gathered into new device buffers
            return StaticCache(self.take(cache.buffers, rows), len(rows), cache.capacity, cache.length)
        filled = cache.length
        for buf in cache.buffers:                                   # only the filled positions move, in place
            buf[:len(rows), :, :filled] = buf[rows, :, :filled]     # the right side is gathered first: safe
        cache.rows, cache.binding = len(rows), None                 # rows (and maybe cross K/V, mask) changed
        return cache

    def decode(self, tokens: np.ndarray, mask, cache: StaticCache, cross: list) -> tuple[np.ndarray, StaticCache]:
        if cache.length >= cache.capacity:
            raise InputError(f"the static KV cache holds {cache.capacity} positions and is full: the request was "
                             f"started for {cache.capacity} steps (engine.start max_steps; at most the model's "
                             f"max_len {self.e.max_len})")
        if cache.binding is None:
            cache.binding = self._bind(mask, cache, cross)
        binding = cache.binding
        binding.bind_cpu_input("input_ids", tokens)
        binding.bind_cpu_input(PAST_SEQUENCE_LENGTH, filled_lengths(cache.rows, cache.length, self.e.per_row_cache))
        if self.e.row_inputs:                                        # every row alone: all at position `length`
            binding.bind_cpu_input(POSITION_IDS, np.full((cache.rows, 1), cache.length, dtype=np.int64))
        self.e.decoder.run_with_iobinding(binding)
        cache.length += 1
        return binding.get_outputs()[0].numpy().copy(), cache        # ORT reuses the bound output's memory next step

    def _bind(self, mask, cache: StaticCache, cross: list):
        """A binding with everything but the step's token ids and position: mask, cross K/V, the buffers."""
        binding = self.e.decoder.io_binding()
        if self.on_host:
            binding.bind_cpu_input("encoder_attention_mask", mask)
            for name, value in zip(self.e.cross_in_names, cross):
                binding.bind_cpu_input(name, value)
        else:
            binding.bind_ortvalue_input("encoder_attention_mask", mask)
            for name, value in zip(self.e.cross_in_names, cross):
                binding.bind_ortvalue_input(name, value)
        if DECODER_ATTENTION_MASK in self.e.row_inputs:              # every slot below `length` is a real token
            cache.key_mask = np.ones((cache.rows, cache.capacity), dtype=np.int64)
            binding.bind_cpu_input(DECODER_ATTENTION_MASK, cache.key_mask)
        binding.bind_output("logits", "cpu")                         # the one tensor the search reads on the host
        for past, present, buf in zip(self.e.past_names, self.e.present_names, cache.buffers):
            # host: the leading rows of a C-order array are contiguous, so the view wraps without a copy
            value = ort.OrtValue.ortvalue_from_numpy(buf[:cache.rows]) if self.on_host else buf
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)              # the same buffer: written in place
        return binding


class DynamicView:
    """A static decoder seen through the dynamic contract: feeds past [B,H,P,Dh] and T tokens, returns
    logits [B,T,V] and presents [B,H,P+T,Dh]. Tokens go through one at a time (the graph's one-token step)."""

    def __init__(self, session: ort.InferenceSession):
        self.session = session
        self.pasts = [i.name for i in session.get_inputs() if is_cache(i.name, PAST, SELF)]
        self.per_row = per_row_cache(session)
        self.takes_mask = any(i.name == DECODER_ATTENTION_MASK for i in session.get_inputs())

    def run(self, names: list[str] | None, feeds: dict) -> list[np.ndarray]:
        out_names = [o.name for o in self.session.get_outputs()]
        names = names or out_names
        tokens = feeds["input_ids"]
        filled = feeds[self.pasts[0]].shape[2]
        buffers = {}                                                     # room for exactly this call's positions
        for name in self.pasts:
            past = feeds[name]
            buffers[name] = np.zeros(past.shape[:2] + (filled + tokens.shape[1],) + past.shape[3:], dtype=past.dtype)
            buffers[name][:, :, :filled] = past
        per_token = (INPUT_IDS, POSITION_IDS, DECODER_ATTENTION_MASK)
        fixed = {k: v for k, v in feeds.items() if k not in buffers and k not in per_token}
        mask = None
        if DECODER_ATTENTION_MASK in feeds and not self.takes_mask and not (feeds[DECODER_ATTENTION_MASK] == 1).all():
            raise ValueError("this static decoder keeps each row's own tokens in its slots and takes no "
                             "decoder_attention_mask: every past slot given must be a real token (mask all ones)")
        if DECODER_ATTENTION_MASK in feeds and self.takes_mask:          # [B, P] -> the buffer's [B, P + T]
            mask = np.ones((len(tokens), filled + tokens.shape[1]), dtype=np.int64)
            mask[:, :filled] = feeds[DECODER_ATTENTION_MASK]            # this call's earlier tokens are real
        logits = []
        for t in range(tokens.shape[1]):
            step = {INPUT_IDS: np.ascontiguousarray(tokens[:, t:t + 1]),
                    PAST_SEQUENCE_LENGTH: filled_lengths(len(tokens), filled + t, self.per_row)}
            if mask is not None:
                step[DECODER_ATTENTION_MASK] = mask
            if POSITION_IDS in feeds:
                step[POSITION_IDS] = np.ascontiguousarray(feeds[POSITION_IDS][:, t:t + 1])
            outs = dict(zip(out_names, self.session.run(out_names, {**fixed, **buffers, **step})))
            logits.append(outs["logits"])
            buffers = {name: outs[present_of(name)] for name in self.pasts}
        result = {"logits": np.concatenate(logits, axis=1)}
        result.update({present_of(name): buffers[name] for name in self.pasts})
        return [result[n] for n in names]


def dynamic_view(session: ort.InferenceSession):
    """The session itself for dynamic decoders (and encoders); a DynamicView for static decoders."""
    return DynamicView(session) if is_static(session) else session


__all__ = ["StaticPath", "StaticCache", "DynamicView", "dynamic_view", "is_static", "per_row_cache", "filled_lengths"]
