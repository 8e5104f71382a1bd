"""Open a model directory as a generation engine: a PyTorch checkpoint or an ONNX Runtime bundle.

Both give a runtime.generate Engine and (for text models) a tokenizer, so `generate` and `bench`
treat them alike. torch is imported only for checkpoints, onnxruntime only for bundles.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.session import check_provider
from toolkit.reference.errors import CheckpointError
from toolkit.apps.extras import require


@dataclass
class OpenModel:
    """An opened model: its engine, tokenizer (None for id-only models), kind and where it came from."""

    engine: object                  # runtime.generate.Engine
    tokenizer: object | None        # runtime.tokenizer.CharTokenizer
    kind: str                       # "checkpoint" | "bundle"
    path: Path
    provider: str                   # "cpu" | "cuda" (what actually runs)
    info: str = ""                  # e.g. precision of a bundle

    def describe(self) -> str:
        """One line: kind, path, what runs it."""
        runner = "PyTorch" if self.kind == "checkpoint" else "ONNX Runtime"
        extra = f", {self.info}" if self.info else ""
        return f"{self.kind} {self.path} ({runner} on {self.provider}{extra})"


def model_kind(path: str | Path) -> str:
    """'bundle' (manifest.json) or 'checkpoint' (config.json); a clear error for anything else."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model {path} does not exist; pass a checkpoint directory (config.json + weights) "
                              f"or a bundle directory (manifest.json)")
    if not path.is_dir():
        raise CheckpointError(f"model {path} is not a directory; pass a checkpoint directory (config.json + weights) "
                              f"or a bundle directory (manifest.json)")
    if (path / "manifest.json").exists():
        return "bundle"
    if (path / "config.json").exists():
        return "checkpoint"
    raise CheckpointError(f"{path} is neither a checkpoint (no config.json) nor a bundle (no manifest.json); "
                          f"create one with 'onnxformer train', 'onnxformer init' or 'onnxformer export'")


def open_model(path: str | Path, provider: str = "auto", threads: int | None = None,
               use_cache: bool = True, one_graph_at_a_time: bool = False, shortlist: bool = True) -> OpenModel:
    """Load a checkpoint (PyTorch engine) or a bundle (ONNX Runtime engine) from a directory; one_graph_at_a_time,
    shortlist: see runtime.bundle.load_bundle (bundles only)."""
    check_provider(provider, threads)
    path = Path(path)
    if model_kind(path) == "bundle":
        from runtime.bundle import load_bundle

        b = load_bundle(path, provider=provider, threads=threads, one_graph_at_a_time=one_graph_at_a_time,
                        shortlist=shortlist)
        return OpenModel(b.engine, b.tokenizer, "bundle", path, b.provider, b.manifest["precision"])
    return _open_checkpoint(path, provider, threads, use_cache)


def _open_checkpoint(path: Path, provider: str, threads: int | None, use_cache: bool) -> OpenModel:
    require("torch")
    from toolkit.reference.api import checkpoint_engine

    engine, tokenizer = checkpoint_engine(path, provider, threads, use_cache)
    return OpenModel(engine, tokenizer, "checkpoint", path, engine.device, "" if use_cache else "no KV cache")
