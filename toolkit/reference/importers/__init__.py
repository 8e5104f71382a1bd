"""Importers: checkpoints of other frameworks mapped onto the reference model, written as onnxformer checkpoints.

    import_model("opus-mt-en-de/", "out/ckpt")                       # a Marian save_pretrained directory
    import_model("model.pt", "out/ckpt", format="nn-transformer")    # the PyTorch translation tutorial's layout

An importer never changes the reference model's defaults: it sets the ModelConfig variants the checkpoint
uses, and refuses, by name, what the reference model cannot represent (ImportRefused), so that an imported
model is never silently a different model. Parity against the original is the proof (toolkit/parity/original.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from toolkit.reference.errors import CheckpointError

FORMATS = ("marian", "nn-transformer")


class ImportRefused(CheckpointError):
    """A source checkpoint that cannot be imported: unreadable, or using a feature the reference model lacks."""


def detect_format(source: str | Path) -> str:
    """'marian' for a directory whose config.json says model_type marian (or a hub-style name), 'nn-transformer'
    for a state-dict file; anything else names what was expected."""
    path = Path(source)
    if path.is_dir():
        if (path / "config.json").is_file():
            from toolkit.reference.importers.marian import read_json

            if read_json(path / "config.json").get("model_type") == "marian":
                return "marian"
            raise ImportRefused(f"{path}/config.json is not a Marian config (model_type is not 'marian'); pass a "
                                f"Marian directory, or --format nn-transformer with a state-dict file")
        if (path / "manifest.json").exists():
            raise ImportRefused(f"{path} is an onnxformer bundle; import reads other frameworks' checkpoints")
        raise ImportRefused(f"{path} has no config.json, so it is not a Marian directory; pass the directory written "
                            f"by save_pretrained, or a state-dict file with --format nn-transformer")
    if path.is_file():
        return "nn-transformer"
    if not path.exists() and str(source).count("/") == 1 and not str(source).startswith((".", "/")):
        return "marian"                                             # a hub name such as Helsinki-NLP/opus-mt-en-de
    raise ImportRefused(f"{source} does not exist; pass a Marian directory, a hub name, or a state-dict file")


def import_model(source: str | Path, out: str | Path, format: str | None = None, force: bool = False,
                 config_file: str | Path | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """Import SOURCE into an onnxformer checkpoint at OUT; returns OUT."""
    from toolkit.reference.checkpoint import check_checkpoint_output

    if format is not None and format not in FORMATS:
        raise ImportRefused(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    check_checkpoint_output(out, force)
    format = format or detect_format(source)
    progress = progress or (lambda msg: None)
    if format == "marian":
        if config_file is not None:
            raise ImportRefused("--config is for nn-transformer state dicts; a Marian directory carries its config.json")
        from toolkit.reference.importers.marian import import_marian

        return import_marian(source, out, force, progress)
    from toolkit.reference.importers.nn_transformer import import_nn_transformer

    return import_nn_transformer(source, out, config_file, force, progress)
