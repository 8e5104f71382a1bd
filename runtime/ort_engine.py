"""The ONNX Runtime engine: runtime.generate's Engine over an encoder session and a cached decoder session.

    engine = OrtEngine(encoder_session, decoder_session, config, provider="cpu", io_binding=False)
    state = engine.start(input_ids, attention_mask, expand, max_steps)   # encoder once; rows repeated for beams
    logits = state.step(tokens, keep)                          # one decoder step, presents become pasts

Three data paths share the state logic (DecodeState) and differ only in where tensors live:
- HostPath: `session.run` with numpy arrays; every output comes back to the host each step.
- StaticPath (runtime/static_cache.py): for decoders optimized with a static KV cache: one preallocated buffer
  per cache tensor, bound as both past and present, written in place (no per-step copy of the cache).
- BoundPath: IO binding with OrtValues; the cross K/V and the KV cache stay on the device (on CPU that is
  host memory without a copy; on CUDA no host round trip per step): each step binds the previous
  step's presents as pasts, and only the logits are copied to the host. Rows are reordered on the
  device by a one-node Gather graph (runtime.session.gather_model).

All per-request state lives in the DecodeState, never on the engine: one engine serves many threads.
"""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort

from runtime.session import FLOAT, SessionConfig, device_of, gather_model, make_session
from runtime.spec import (CROSS, PAST, PRESENT, SELF, cache_names, default_row_inputs, empty_past, row_inputs_of,
                          source_pad_id, source_vocab_size, suppressed_ids)
from runtime.static_cache import StaticPath, is_static, per_row_cache


class HostPath:
    """Tensors are numpy arrays; `session.run` copies every output to the host."""

    def __init__(self, engine: "OrtEngine"):
        self.e = engine

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> list:
        return self.e.encoder.run(self.e.cross_names, {"input_ids": ids, "attention_mask": mask})

    def take(self, tensors: list, rows: np.ndarray) -> list:
        return [np.take(t, rows, axis=0) for t in tensors]            # one gather per tensor

    take_past = take

    def mask(self, mask: np.ndarray):
        return mask

    def empty_past(self, n: int, steps: int | None = None) -> list:
        return [empty_past(n, self.e.n_heads, self.e.head_dim)] * len(self.e.past_names)

    def decode(self, tokens: np.ndarray, mask, past: list, cross: list) -> tuple[np.ndarray, list]:
        feeds = {"input_ids": tokens, "encoder_attention_mask": mask,
                 **dict(zip(self.e.past_names, past)), **dict(zip(self.e.cross_in_names, cross))}
        if self.e.row_inputs:                                          # every row alone: default positions, mask
            feeds.update(default_row_inputs(len(tokens), past[0].shape[2], tokens.shape[1], names=self.e.row_inputs))
        logits, *presents = self.e.decoder.run(self.e.decoder_out_names, feeds)
        return logits, presents


class BoundPath:
    """Tensors are OrtValues on the session's device; IO binding feeds them back without a host copy."""

    def __init__(self, engine: "OrtEngine"):
        self.e = engine
        self.device = device_of(engine.provider)
        self._gather = None
        self._lock = threading.Lock()

    def _bind_outputs(self, binding, names: list[str]) -> None:
        for name in names:
            binding.bind_output(name, self.device, 0)                  # ORT allocates each run, on the device

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> list:
        binding = self.e.encoder.io_binding()
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", mask)
        self._bind_outputs(binding, self.e.cross_names)
        self.e.encoder.run_with_iobinding(binding)
        return binding.get_outputs()

    def gather(self) -> ort.InferenceSession:
        """The Gather session for 2 * layers float tensors (self or cross K/V), made on first use."""
        with self._lock:
            if self._gather is None:
                n = len(self.e.past_names)
                one_thread = SessionConfig(intra_op_threads=1)            # a copy: no thread pool spinning beside the decoder
                self._gather = make_session(gather_model([FLOAT] * n, [4] * n), self.e.provider, one_thread)
            return self._gather

    def take(self, tensors: list, rows: np.ndarray) -> list:
        binding = self.gather().io_binding()
        for i, t in enumerate(tensors):
            binding.bind_ortvalue_input(f"x{i}", t)
        binding.bind_cpu_input("indices", np.ascontiguousarray(rows, dtype=np.int64))
        self._bind_outputs(binding, [f"y{i}" for i in range(len(tensors))])
        self.gather().run_with_iobinding(binding)
        return binding.get_outputs()

    take_past = take

    def mask(self, mask: np.ndarray):
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(mask), self.device, 0)  # copied once per move

    def empty_past(self, n: int, steps: int | None = None) -> list:
        empty = ort.OrtValue.ortvalue_from_numpy(empty_past(n, self.e.n_heads, self.e.head_dim))
        return [empty] * len(self.e.past_names)                        # zero bytes: host is fine

    def decode(self, tokens: np.ndarray, mask, past: list, cross: list) -> tuple[np.ndarray, list]:
        binding = self.e.decoder.io_binding()                          # fresh each step: outputs never reuse buffers
        binding.bind_cpu_input("input_ids", tokens)
        binding.bind_ortvalue_input("encoder_attention_mask", mask)
        if self.e.row_inputs:                                          # every row alone: default positions, mask
            for name, value in default_row_inputs(len(tokens), past[0].shape()[2], tokens.shape[1],
                                                  names=self.e.row_inputs).items():
                binding.bind_cpu_input(name, value)
        for name, value in zip(self.e.past_names, past):
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(self.e.cross_in_names, cross):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")                           # the one tensor the search reads on the host
        self._bind_outputs(binding, self.e.decoder_out_names[1:])
        self.e.decoder.run_with_iobinding(binding)
        logits, *presents = binding.get_outputs()
        return logits.numpy(), presents


class OrtState:
    """Decoder state of one request: the mask, cross K/V and self-attention cache of its current rows."""

    def __init__(self, path, mask: np.ndarray, cross: list, sources: np.ndarray, steps: int | None = None):
        self.path, self.cross, self.sources = path, cross, sources     # sources: the input each row belongs to
        self.host_mask = mask                                          # [N, S] int64
        self.mask = path.mask(mask)
        self.past = path.empty_past(len(mask), steps)                  # [N, H, 0, Dh] per tensor, or static buffers

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
        logits, self.past = self.path.decode(tokens, self.mask, self.past, self.cross)
        return logits


class OrtEngine:
    """runtime.generate.Engine over ONNX Runtime sessions of a bundle's encoder and decoder graphs."""

    def __init__(self, encoder: ort.InferenceSession, decoder: ort.InferenceSession, config: dict,
                 provider: str = "cpu", io_binding: bool | None = None):
        self.encoder, self.decoder, self.provider = encoder, decoder, provider
        self.pad_id, self.bos_id, self.eos_id = config["pad_id"], config["bos_id"], config["eos_id"]
        self.vocab_size, self.max_len = config["vocab_size"], config["max_len"]
        self.src_vocab_size, self.suppress_ids = source_vocab_size(config), suppressed_ids(config)
        self.src_pad_id = source_pad_id(config)
        self.n_heads, self.head_dim = config["n_heads"], config["d_model"] // config["n_heads"]
        layers = config["n_decoder_layers"]
        self.cross_names = cache_names(layers, PRESENT, CROSS)         # encoder outputs
        self.cross_in_names = cache_names(layers, PAST, CROSS)         # ... fed to the decoder by these names
        self.past_names = cache_names(layers, PAST, SELF)
        self.present_names = cache_names(layers, PRESENT, SELF)
        self.decoder_out_names = ["logits"] + self.present_names
        self.static_cache = is_static(decoder)
        self.row_inputs = row_inputs_of(i.name for i in decoder.get_inputs())   # per-row positions (and key mask)
        self.per_row_cache = per_row_cache(decoder)                    # static: each row at its own length
        if self.static_cache:                                          # one buffer per cache, bound as past and present
            self.io_binding = True
            self.path = StaticPath(self, HostPath(self) if provider == "cpu" else BoundPath(self), device_of(provider))
        else:
            self.io_binding = default_io_binding(provider) if io_binding is None else io_binding
            self.path = BoundPath(self) if self.io_binding else HostPath(self)
        self.name = f"ort-{provider}" + ("-static-cache" if self.static_cache else
                                         "-iobinding" if self.io_binding else "")

    def start(self, input_ids: np.ndarray, attention_mask: np.ndarray, expand: int,
              max_steps: int | None = None) -> OrtState:
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)          # [B, S]
        mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
        cross = self.path.encode(ids, mask)                            # 2 * layers tensors [B, H, S, Dh]
        sources = np.arange(len(ids))
        if expand > 1:                                                 # beam rows b * expand + j share input b
            sources = np.repeat(sources, expand)
            cross = self.path.take(cross, sources)
            mask = mask[sources]
        return OrtState(self.path, mask, cross, sources, max_steps)


def default_io_binding(provider: str) -> bool:
    """CUDA: IO binding (no host round trip per step). CPU: plain session.run, which measured faster."""
    # CPU time per decode step, 1 thread (tiny / small preset, batch 1-8): plain 3-17% below IO binding, whose
    # per-input bind calls cost more than the output copies they save; a beam reorder by np.take is 0.006-0.18 ms
    # against 0.03-0.24 ms for the Gather session.
    return provider == "cuda"
