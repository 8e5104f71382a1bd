"""Running decoders with a static KV cache (exporters/static_cache.py writes them; `optimize --kv-cache static`).

A static decoder (the manifest's decoder_layout "static-per-row" or "static-shared") takes its self-attention
cache as one preallocated buffer per layer and tensor, [rows, heads, cache_len, head_dim], plus
`past_sequence_length` (how many positions are filled: per row, int32 [rows], on CPU bundles, whose
GroupQueryAttention nodes let rows sit at different lengths; one int32 [1] for all rows on CUDA bundles,
DecoderMaskedMultiHeadAttention). The runtime sizes cache_len per request: the most tokens it may generate (at
most the model's max_len). The attention nodes write the new key/value at that position and attend over the
filled part. The buffer is bound as past input and present output (runtime/feed.py's bind_static), so a step
copies nothing: the step time does not grow with a copy of the whole cache.

    StaticPath        the OrtEngine data path for such decoders (IO binding; buffers in host memory on CPU,
                      on the device on CUDA)
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from runtime.errors import InputError


class StaticCache:
    """A request's self-attention buffers: `rows` live rows, `length` of `capacity` positions filled.

    `binding` is the decoder's runtime.feed.StaticStep with the buffers, cross K/V and mask bound; it lives until
    the rows change (a reorder), so a step binds only its token ids, filled lengths and positions.
    """

    def __init__(self, buffers: list, rows: int, capacity: int, length: int = 0):
        self.buffers, self.rows, self.capacity, self.length = buffers, rows, capacity, length
        self.binding = None


class StaticPath:
    """OrtEngine data path for static-cache decoders: past and present bound to one buffer, updated in place.

    On the CPU the buffers are numpy arrays (IO binding wraps them without a copy); a beam reorder or dropped
    rows move only the filled part, in place. On CUDA they are OrtValues on the device, and a reorder gathers
    them into new buffers with the engine's Gather graph. The encoder, the cross K/V and the mask are handled by
    `base`, the engine's path for the device (HostPath on CPU, BoundPath on CUDA). `engine`: the engine's
    runtime.ort_engine.Facts (never the engine itself).
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

    def decode(self, tokens: np.ndarray, mask, cache: StaticCache, cross: list,
               vocab: np.ndarray | None = None) -> tuple[np.ndarray, StaticCache]:
        if cache.length >= cache.capacity:
            raise InputError(f"the static KV cache holds {cache.capacity} positions and is full: the request was "
                             f"started for {cache.capacity} steps (engine.start max_steps; at most the model's "
                             f"max_len {self.e.max_len})")
        if cache.binding is None:                                    # host: the leading rows of a C-order array are
            buffers = [buf[:cache.rows] for buf in cache.buffers] if self.on_host else cache.buffers   # contiguous
            cache.binding = self.e.feed.bind_static(mask, cross, buffers, vocab)
        logits = cache.binding.step(tokens, np.full(cache.rows, cache.length, dtype=np.int32))
        cache.length += 1
        return logits.copy(), cache                                  # ORT reuses the bound output's memory next step


__all__ = ["StaticPath", "StaticCache"]
