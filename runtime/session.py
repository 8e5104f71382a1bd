"""Execution providers and session options, chosen in one visible place.

    provider = choose_provider("auto")          # "cuda" when this onnxruntime has CUDA, else "cpu"
    session = make_session(path, provider, SessionConfig(intra_op_threads=4))

Also builds the one-node Gather graph the runtime uses to reorder the KV cache on the device, written
as protobuf bytes by hand so that the runtime needs no `onnx` package.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import onnxruntime as ort

from runtime.errors import ProviderError

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}   # the one provider list
PROVIDER_CHOICES = ("auto", *PROVIDERS)          # what users may ask for (--provider, open_model, bench)
_LEVELS = {"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
           "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
           "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
           "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
_MODES = {"sequential": ort.ExecutionMode.ORT_SEQUENTIAL, "parallel": ort.ExecutionMode.ORT_PARALLEL}


@dataclass(frozen=True)
class SessionConfig:
    """Every ONNX Runtime session option the runtime sets; override fields with `with_(...)`."""

    intra_op_threads: int = 0             # threads inside one operator; 0 = ORT default (one per physical core)
    inter_op_threads: int = 0             # threads across operators (parallel mode only); 0 = ORT default
    graph_optimization: str = "all"       # "disabled" | "basic" | "extended" | "all" (ORT_ENABLE_ALL)
    spinning: bool = True                 # intra-op threads spin while waiting (a decoder step is short: waking threads costs)
    encoder_spinning: bool = False        # the encoder's threads: see for_graph
    execution_mode: str = "sequential"    # "sequential" | "parallel"
    log_severity: int = 3                 # 0 verbose .. 3 errors only (CUDA's "nodes placed on CPU" notes are noise)
    profile_prefix: str | None = None     # write an ORT profile (JSON, per-node kernel times) with this file prefix
    cpu_memory_arena: bool = False        # ORT's CPU arena keeps the most it ever grew to; without it and without
                                          # memory patterns (one block per input shape, kept), a large model's peak
                                          # is what a request needs, at the same speed (RESULTS.md, "The memory
                                          # arena and memory patterns")
    memory_pattern: bool = False          # ORT's mem pattern: each run's tensors planned into one block per input
                                          # shape, kept; the CUDA device's own arena is not affected by either
    fixed_encoder_arena: bool = True      # the arena on for an encoder whose input has one shape (Whisper's 30 s
                                          # of features): see for_graph

    def for_graph(self, graph: str, fixed_input: bool = False) -> "SessionConfig":
        """The options for one graph. The encoder runs once a request and then its threads, spinning, would take
        the cores from the decoder's first steps (RESULTS.md, "Two thread pools"); without spinning the encoder
        costs a little more, once a request.

        fixed_input: the encoder's input has one shape whatever the request (an audio encoder's features, 30 s).
        Its session then keeps ORT's CPU arena (with fixed_encoder_arena): every run asks for the same buffers,
        which the arena holds once and reuses. Without it glibc's heap kept what a run freed and, fragmented,
        grew at each later run (Whisper base int8: a race worker's peak 355 MB with the heap, 309 with the
        arena, the same speed; RESULTS.md, "Whisper's int8 peak"). A token encoder's shapes vary by request:
        there the arena would keep the largest request's, so it stays off."""
        if graph != "encoder":
            return self
        return replace(self, spinning=self.encoder_spinning,
                       cpu_memory_arena=self.cpu_memory_arena or (fixed_input and self.fixed_encoder_arena))

    def with_(self, **changes) -> "SessionConfig":
        """A copy with the given fields changed (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_ort(self) -> ort.SessionOptions:
        if self.graph_optimization not in _LEVELS:
            raise ProviderError(f"graph optimization level {self.graph_optimization!r} is unknown; "
                                f"choose one of: {', '.join(_LEVELS)}")
        if self.execution_mode not in _MODES:
            raise ProviderError(f"execution mode {self.execution_mode!r} is unknown; choose one of: {', '.join(_MODES)}")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(self.intra_op_threads)
        opts.inter_op_num_threads = int(self.inter_op_threads)
        opts.graph_optimization_level = _LEVELS[self.graph_optimization]
        opts.execution_mode = _MODES[self.execution_mode]
        opts.log_severity_level = int(self.log_severity)
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spinning else "0")
        opts.enable_cpu_mem_arena = bool(self.cpu_memory_arena)
        opts.enable_mem_pattern = bool(self.memory_pattern)
        if self.profile_prefix:
            opts.enable_profiling = True
            opts.profile_file_prefix = self.profile_prefix
        return opts


def installed_onnxruntime() -> str:
    """'onnxruntime-gpu 1.32.0' or 'onnxruntime 1.32.0': the package this environment runs."""
    import importlib.metadata                       # here: resident memory that loading a bundle does not need

    for dist in ("onnxruntime-gpu", "onnxruntime"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"onnxruntime {ort.__version__}"


def check_provider(provider: str, threads: int | None = None) -> None:
    """Refuse a provider name that is not one of PROVIDER_CHOICES, or fewer than one thread, before any loading."""
    if provider not in PROVIDER_CHOICES:
        raise ProviderError(f"unknown provider {provider!r}; choose one of: {', '.join(PROVIDER_CHOICES)}")
    if threads is not None and threads < 1:
        raise ProviderError(f"threads must be at least 1, got {threads}")


def choose_provider(name: str = "auto") -> str:
    """'auto' -> 'cuda' when this onnxruntime offers CUDAExecutionProvider, else 'cpu'; 'cuda' fails clearly."""
    available = ort.get_available_providers()
    if name == "auto":
        return "cuda" if PROVIDERS["cuda"] in available else "cpu"
    if name not in PROVIDERS:
        raise ProviderError(f"unknown provider {name!r}; choose one of: {', '.join(PROVIDER_CHOICES)}")
    if PROVIDERS[name] not in available:
        raise ProviderError(
            f"{PROVIDERS[name]} is not available in this onnxruntime (installed: {installed_onnxruntime()}, "
            f"providers: {', '.join(available)}); install onnxruntime-gpu instead of onnxruntime "
            f"(`make install` does so on a machine where nvidia-smi finds a GPU) or use --provider cpu")
    return name


def provider_list(provider: str) -> list:
    """The providers list for InferenceSession: CUDA keeps CPU as the home of nodes it has no kernel for."""
    if provider == "cuda":
        return [(PROVIDERS["cuda"], {"device_id": 0}), PROVIDERS["cpu"]]
    return [PROVIDERS["cpu"]]


def make_session(model: str | Path | bytes, provider: str, config: SessionConfig | None = None,
                 initializers: dict[str, ort.OrtValue] | None = None) -> ort.InferenceSession:
    """An InferenceSession on `provider` ('cpu' or 'cuda'); raises ProviderError if CUDA did not come up.

    `initializers` replace the graph's initializers of those names (SessionOptions.add_initializer): sessions given
    the same OrtValue read one buffer. ONNX Runtime does not own them, so the session keeps a reference."""
    config = config or SessionConfig()
    source = model if isinstance(model, bytes) else str(model)
    options = config.to_ort()
    for name, value in (initializers or {}).items():
        options.add_initializer(name, value)
    session = ort.InferenceSession(source, sess_options=options, providers=provider_list(provider))
    session.onnxformer_initializers = initializers         # keeps the buffers alive as long as the session
    if PROVIDERS[provider] not in session.get_providers():    # e.g. CUDA/cuDNN libraries missing at load time
        raise ProviderError(f"{PROVIDERS[provider]} could not be started by {installed_onnxruntime()} (the session "
                            f"fell back to {', '.join(session.get_providers())}); check that the CUDA and cuDNN "
                            f"libraries onnxruntime-gpu needs are installed, or use --provider cpu")
    return session


class Arg(NamedTuple):
    """What InferenceSession.get_inputs()/get_outputs() give (onnxruntime.NodeArg): name, type, shape."""

    name: str
    type: str                       # "tensor(float)", "tensor(int64)", ...
    shape: list


class OnDemandSession:
    """An InferenceSession made on first use and dropped by `release()`, so that a process can hold one graph's
    weights at a time (`onnxformer generate`: the encoder runs once, then only the decoder; runtime.bundle's
    one_graph_at_a_time). `before` runs before the session is made (it releases the other graph's session).
    Until the session exists, get_inputs()/get_outputs() answer from the interface given (the manifest's, which
    the made session is checked against), so that an engine asking them does not load the graph.

    For one-shot use: a session released while a request still holds its IO binding (a server decoding while it
    encodes new requests) would be made again at every switch."""

    def __init__(self, make: Callable[[], ort.InferenceSession], inputs: list[Arg], outputs: list[Arg]):
        self._make, self._inputs, self._outputs = make, inputs, outputs
        self._session: ort.InferenceSession | None = None
        self.before: Callable[[], None] | None = None

    @property
    def loaded(self) -> bool:
        return self._session is not None

    def session(self) -> ort.InferenceSession:
        if self._session is None:
            if self.before is not None:
                self.before()
            self._session = self._make()
        return self._session

    def release(self) -> None:
        if self._session is not None:
            self._session = None
            return_freed_memory()

    def get_inputs(self) -> list:
        return self._inputs if self._session is None else self._session.get_inputs()

    def get_outputs(self) -> list:
        return self._outputs if self._session is None else self._session.get_outputs()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.session(), name)


def return_freed_memory() -> None:
    """Give the memory of dropped sessions back to the system: glibc keeps freed heap for reuse (malloc_trim).
    What was dropped must be freed already, by reference counting: no collection runs here (a cyclic collection in
    a large process takes a good part of a second, and the gate's engines switch graphs once a batch)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):                 # not glibc (musl, macOS): nothing to trim
        pass


def device_of(provider: str) -> str:
    """OrtValue device type for a provider: where IO binding keeps tensors."""
    return "cuda" if provider == "cuda" else "cpu"


# --- a one-node Gather graph, serialized by hand (ONNX protobuf field numbers noted beside each field) ---

FLOAT, INT64 = 1, 7                    # onnx.TensorProto element types


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _msg(field: int, payload: bytes | str) -> bytes:
    payload = payload.encode() if isinstance(payload, str) else payload
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _value_info(name: str, elem_type: int, rank: int) -> bytes:
    dims = b"".join(_msg(1, _msg(2, f"{name}_d{i}")) for i in range(rank))       # Dimension.dim_param = 2
    tensor = _int(1, elem_type) + _msg(2, dims)                                    # Tensor: elem_type 1, shape 2
    return _msg(1, name) + _msg(2, _msg(1, tensor))                                # ValueInfo: name 1, type 2


def gather_model(elem_types: list[int], ranks: list[int]) -> bytes:
    """ModelProto: y_i = Gather(x_i, indices, axis=0) for each x_i; indices int64 [n]."""
    nodes = b"".join(_msg(1, _msg(1, f"x{i}") + _msg(1, "indices") + _msg(2, f"y{i}") + _msg(4, "Gather"))
                     for i in range(len(elem_types)))                              # Node: input 1, output 2, op_type 4
    inputs = b"".join(_msg(11, _value_info(f"x{i}", t, r)) for i, (t, r) in enumerate(zip(elem_types, ranks)))
    inputs += _msg(11, _value_info("indices", INT64, 1))
    outputs = b"".join(_msg(12, _value_info(f"y{i}", t, r)) for i, (t, r) in enumerate(zip(elem_types, ranks)))
    graph = nodes + _msg(2, "gather_rows") + inputs + outputs                      # Graph: node 1, name 2, input 11, output 12
    opset = _msg(1, "") + _int(2, 13)                                              # OperatorSetId: domain 1, version 2
    return _int(1, 7) + _msg(2, "onnxformer.runtime") + _msg(7, graph) + _msg(8, opset)  # Model: ir_version 1, producer 2, graph 7, opset_import 8


# --- does this CPU's int8 kernel saturate? a one-node DynamicQuantizeMatMul, serialized the same way ---

INT8 = 3
PROBE_K = 64


def _probe_model() -> bytes:
    """ModelProto: y = com.microsoft.DynamicQuantizeMatMul(a float [1, K], b int8 [K, 1], b_scale float [])."""
    node = (_msg(1, "a") + _msg(1, "b") + _msg(1, "b_scale") + _msg(2, "y") + _msg(4, "DynamicQuantizeMatMul")
            + _msg(7, "com.microsoft"))                                             # Node: domain 7
    inputs = _msg(11, _value_info("a", FLOAT, 2)) + _msg(11, _value_info("b", INT8, 2))
    inputs += _msg(11, _value_info("b_scale", FLOAT, 0))
    graph = _msg(1, node) + _msg(2, "int8_probe") + inputs + _msg(12, _value_info("y", FLOAT, 2))
    opsets = _msg(8, _msg(1, "") + _int(2, 17)) + _msg(8, _msg(1, "com.microsoft") + _int(2, 1))
    return _int(1, 8) + _msg(2, "onnxformer.runtime") + _msg(7, graph) + opsets


@functools.cache
def int8_saturates() -> bool:
    """Whether ONNX Runtime's CPU int8 kernel saturates products of 8-bit weights on this machine (measured once
    a process, by running the kernel).

    Dynamic quantization multiplies uint8 activations by int8 weights. x86 CPUs without VNNI (AVX2 and AVX-512
    without VNNI: AMD before Zen 4, Intel before Cascade Lake) add pairs of those products in int16
    (vpmaddubsw), which saturates: 255 x 127 x 2 = 64,770 > 32,767. With full-range weights the kernel's results
    are then wrong by up to a quarter of their magnitude (benchmarks/RESULTS.md, "int8 on CPUs without VNNI"),
    while 7-bit weights (|w| <= 64: 255 x 64 x 2 = 32,640) are exact. VNNI and ARM kernels accumulate in int32
    and never saturate. The probe: activations of 1.0 (quantized to 255) times weights of 127, K of them: exact
    K x 127, saturated about half of it."""
    import numpy as np

    session = make_session(_probe_model(), "cpu", SessionConfig(intra_op_threads=1))
    y = session.run(None, {"a": np.ones((1, PROBE_K), np.float32), "b": np.full((PROBE_K, 1), 127, np.int8),
                           "b_scale": np.array(1.0, np.float32)})[0]
    return not abs(float(y[0, 0]) - PROBE_K * 127) < 0.5
