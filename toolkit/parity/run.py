"""A bundle against the checkpoint it came from, as `onnxformer parity` runs it: graph parity (each graph output,
toolkit.parity.graphs), then generation parity (toolkit.parity.generation) on the inputs every token verdict is
judged on (toolkit.parity.inputs), composed into one report (report.Combined) the command only prints.

    report = checkpoint_parity("checkpoint/", "bundle/", provider="cpu", samples=100, beam=4)
    report.verdict, report.to_dict(), str(report)

Both engines run in `threads` intra-op threads (1 unless asked): parity checks numbers, not speed, a small
model's batches are too small to split, and on a machine whose cores are busy (the other engine's spinning
threads in this very process, other jobs) every tiny operator of a split one waits for a descheduled worker.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from runtime.bundle import load_bundle
from runtime.errors import InputError
from toolkit.parity.generation import generation_parity
from toolkit.parity.graphs import graph_parity
from toolkit.parity.inputs import DEFAULT_SAMPLES, choose_inputs
from toolkit.parity.report import Combined
from toolkit.parity.tolerances import tolerance
from toolkit.reference.checkpoint import load_checkpoint
from toolkit.reference.torch_engine import TorchEngine


@contextmanager
def torch_threads(threads: int):
    """PyTorch's intra-op thread count set for a block, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def searches(beam: int, max_new_tokens: int) -> tuple[int, ...]:
    """The beam widths a parity run checks: greedy, and `beam` besides when it is above 1."""
    if beam < 1:
        raise InputError(f"--beam must be at least 1, got {beam}")
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    return (1,) if beam == 1 else (1, beam)


def checkpoint_parity(checkpoint: str | Path, bundle: str | Path, provider: str = "auto",
                      samples: int = DEFAULT_SAMPLES, beam: int = 4, max_new_tokens: int = 32,
                      texts: list[str] | None = None, threads: int = 1, progress=None, audio=None) -> Combined:
    """Graphs and generated tokens of a bundle against the checkpoint it was exported from: greedy, and beam
    `beam` besides. texts: source texts as the token checks' inputs (through the checkpoint's tokenizer, else
    the bundle's); audio: an audio model's inputs as clips (files or directories, toolkit.parity.inputs.audio_inputs).
    progress: called with one line saying what is compared, once both are loaded."""
    beams = searches(beam, max_new_tokens)
    if threads < 1:
        raise InputError(f"--threads must be at least 1, got {threads}")
    ckpt, loaded = load_checkpoint(checkpoint), load_bundle(bundle, provider=provider, threads=threads)
    precision = loaded.manifest["precision"]
    tol = tolerance(precision, loaded.provider)                      # refuses pairs the table does not define
    inputs = choose_inputs(ckpt.config, ckpt.tokenizer or loaded.tokenizer, samples, texts, audio=audio,
                           option="--audio")
    if progress is not None:
        progress(f"comparing {bundle} ({precision}, onnxruntime on {loaded.provider}) with {checkpoint} (PyTorch)")
    with torch_threads(threads):
        graphs = graph_parity(ckpt.model, bundle, provider=loaded.provider, precision=precision)
        tokens = generation_parity(TorchEngine(ckpt.model), loaded.engine, inputs.seqs, tol, loaded.provider,
                                   precision, beams, max_new_tokens, inputs.source, inputs.representative)
    return Combined({"graphs": graphs, "generation": tokens}, {"checkpoint": str(checkpoint), "bundle": str(bundle),
                                                               "provider": loaded.provider, "precision": precision})


__all__ = ["checkpoint_parity", "searches", "torch_threads"]
