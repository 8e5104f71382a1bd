"""The Python API on a PyTorch checkpoint: the runtime's Translator over the reference engine.

    from toolkit.reference.api import load_checkpoint_translator

    translator = load_checkpoint_translator("examples/dates/checkpoint", provider="cpu")
    translator.generate(["11/30/26"], beam=4, num_return=2)     # what runtime.Translator gives on its bundle

Everything but the engine is runtime.api's: the options, the checks, the results.
"""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.api import Translator
from runtime.errors import ProviderError
from runtime.session import check_provider
from toolkit.reference.checkpoint import load_checkpoint
from toolkit.reference.torch_engine import TorchEngine


def checkpoint_engine(path: str | Path, provider: str = "auto", threads: int | None = None,
                      use_cache: bool = True) -> tuple[TorchEngine, object | None]:
    """The PyTorch engine and tokenizer of a checkpoint directory, on CUDA for provider "cuda" (ProviderError
    without a CUDA device) or "auto" when there is one, else on the CPU; `threads`: torch's intra-op threads (a
    process-wide setting); use_cache False recomputes the prefix each step. CheckpointError when it is broken."""
    check_provider(provider, threads)
    if provider == "cuda" and not torch.cuda.is_available():
        raise ProviderError("provider 'cuda' was asked for but this PyTorch has no CUDA device; "
                            "use --provider cpu (or auto)")
    device = "cuda" if provider in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    if threads is not None:
        torch.set_num_threads(threads)
    ckpt = load_checkpoint(path)
    return TorchEngine(ckpt.model, use_cache=use_cache, device=device), ckpt.tokenizer


def load_checkpoint_translator(path: str | Path, provider: str = "auto", threads: int | None = None,
                               use_cache: bool = True) -> Translator:
    """A Translator over the checkpoint directory `path` (runtime.api.Translator's methods, computed by PyTorch;
    arguments as `checkpoint_engine`)."""
    engine, tokenizer = checkpoint_engine(path, provider, threads, use_cache)
    return Translator.from_engine(engine, tokenizer, provider=engine.device)
