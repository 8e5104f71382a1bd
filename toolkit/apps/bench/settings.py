"""What a benchmark run is: its settings, and what the parent knows about each MODEL without loading it."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runtime.errors import InputError, read_json
from runtime.session import PROVIDER_CHOICES

FIRST_TOKEN = 3                 # ids 0-2 are pad, bos, eos: random sources use [3, vocab)
PROFILE_PASTS = (8, 256)        # step-profile past lengths (clipped to the model's max_len - 1)
PROFILE_WINDOW = 2              # a past length's step time is the median over steps past +- 2


@dataclass(frozen=True)
class BenchSettings:
    """Everything that defines a benchmark run (recorded verbatim in the report)."""

    batch_sizes: tuple[int, ...] = (1, 8)
    src_len: int = 32               # source tokens per input (no padding)
    new_tokens: int = 64            # generated tokens per input, exactly
    provider: str = "auto"          # auto | cpu | cuda
    threads: int | None = None      # torch and ORT intra-op threads; None = os.cpu_count()
    repeat: int = 5                 # timed rounds (one call per engine per round)
    warmup: int = 1                 # untimed rounds first
    nocache: bool = True            # also measure torch-nocache for checkpoints
    step_profile: bool = False      # also time single steps at PROFILE_PASTS (batch 1, cached engines)
    seed: int = 0                   # source batch seed

    def resolved(self) -> "BenchSettings":
        """Defaults filled in (threads) and batch sizes sorted, so peaks grow monotonically."""
        threads = self.threads or os.cpu_count() or 1
        return BenchSettings(**{**asdict(self), "threads": threads,
                                "batch_sizes": tuple(sorted(set(self.batch_sizes)))})

    def validate(self) -> None:
        if not self.batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise InputError(f"batch sizes must be positive integers, got {list(self.batch_sizes)}; e.g. --batch-sizes 1,8")
        for name in ("src_len", "new_tokens", "repeat"):
            if getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise InputError(f"warmup must be 0 or more, got {self.warmup}")
        if self.threads is not None and self.threads < 1:
            raise InputError(f"threads must be at least 1, got {self.threads}")
        if self.provider not in PROVIDER_CHOICES:
            raise InputError(f"unknown provider {self.provider!r}; choose one of: {', '.join(PROVIDER_CHOICES)}")


@dataclass
class ModelInfo:
    """What the parent knows about a MODEL without loading it (no torch needed)."""

    path: str
    kind: str                       # "checkpoint" | "bundle"
    config: dict                    # ModelConfig as a dict
    precision: str                  # fp32 | fp16 | int8
    fused: bool                     # any fusion rewrites applied (bundles)
    fusions: dict = field(default_factory=dict)
    model_bytes: int = 0            # all files in the directory
    weight_bytes: int | None = None  # decoder weights a step reads (bundles; checkpoints: measured by the worker)
    weight_source: str = ""
    kv_cache: str = "dynamic"       # bundles: the manifest's "static" | "dynamic"; PyTorch eager grows its cache


def describe_model(path: str | Path) -> ModelInfo:
    """Classify MODEL as checkpoint or bundle and read its config, precision and sizes."""
    from toolkit.apps.engines import model_kind

    path = Path(path)
    kind = model_kind(path)
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    if kind == "bundle":
        from runtime.manifest import read_manifest

        manifest = read_manifest(path)
        fusions = {k: int(v) for k, v in (manifest.get("fusions") or {}).items()}
        weight_bytes, source = decoder_weight_bytes(path, manifest)
        return ModelInfo(str(path), kind, manifest["model"], manifest["precision"], sum(fusions.values()) > 0,
                         fusions, size, weight_bytes, source, manifest.get("kv_cache", "dynamic"))
    config = read_json(path / "config.json", InputError, "re-save the checkpoint")
    return ModelInfo(str(path), kind, config, "fp32", False, {}, size, None, "")


def decoder_weight_bytes(bundle: Path, manifest: dict) -> tuple[int, str]:
    """Bytes of decoder weights one step reads: initializers and constants, except embedding tables only
    gathered from (a lookup reads one row). Without the onnx package: the decoder file size."""
    decoder = bundle / manifest["graphs"]["decoder"]["file"]
    try:
        import onnx
        from onnx import helper
    except ImportError:
        extra = sum(p.stat().st_size for p in bundle.glob(decoder.name + "*.data"))
        return decoder.stat().st_size + extra, "decoder file size"
    graph = onnx.load(str(decoder), load_external_data=False).graph
    users: dict[str, set] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, set()).add(node.op_type)
    tensors = [(t.name, t) for t in graph.initializer]
    tensors += [(n.output[0], a.t) for n in graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    total = 0
    for name, t in tensors:
        if users.get(name) == {"Gather"}:
            continue
        total += math.prod(t.dims) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total, "decoder initializers (embedding lookups excluded)"


def profile_plan(config: dict) -> tuple[int, list[int]]:
    """Tokens to generate and the past lengths to read for the step profile of a model."""
    new_tokens = min(max(PROFILE_PASTS) + 1, config["max_len"])
    return new_tokens, sorted({min(p, new_tokens - 1) for p in PROFILE_PASTS})
