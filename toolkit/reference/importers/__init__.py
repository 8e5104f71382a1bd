"""Importers: checkpoints of other frameworks mapped onto the reference model, written as onnxformer checkpoints.

    import_model("opus-mt-en-de/", "out/ckpt")                       # family detected: config.json model_type
    import_model("model.pt", "out/ckpt", format="nn-transformer", config_file="hp.json")

An importer never changes the reference model's defaults: it sets the ModelConfig variants the checkpoint
uses, and refuses, by name, what the reference model cannot represent (ImportRefused), so that an imported
model is never silently a different model. Parity against the original is the proof (toolkit/parity/original.py).

Adding a family is one module in this package (plus its tests); the registry (registry.py) imports every
public module here, so nothing else changes: `onnxformer import --format`, detection, `parity ORIGINAL BUNDLE`
and the README's list (a test checks it) follow. The module's top level must not import torch (import it
inside functions) and ends with:

    FAMILY = register_family(Family(
        name="bart",                                  # --format choice, import.json "format"
        source="a BART save_pretrained directory or hub name",       # for --help and messages
        convert=convert,                              # (Path, ImportOptions) -> Converted(model, tokenizer, record)
        model_types=("bart",),                        # config.json model_type(s) detected as this family
        load_original=load_original,                  # Path -> (transformers model in eval mode, tokenizer), or None
        original="BartForConditionalGeneration (transformers)",     # its name in parity reports
        hub_files=("*.json", "*.txt", "*.safetensors")))            # optional: what a hub download fetches

- convert(path, options) gets a local path (a hub name is downloaded first, to a directory) and returns
  Converted(model, tokenizer, record): the reference Transformer in eval mode, a runtime tokenizer or None, and
  what import.json records besides "format" and "source". options.config_file is --config (only for
  takes_config=True families), options.progress(msg) prints a line, options.work is a scratch directory that
  lives until the checkpoint is written (tokenizer files may stay there). Refuse with ImportRefused; the
  registry refuses NaN/Inf weights and writes the checkpoint (import.json gets "format" and "source").
- sources.py has the shared readers: read_json, read_state (safetensors or torch.save files, truncation,
  training-checkpoint wrappers and 'module.' prefixes), require_transformers, quiet_from_pretrained.
- A single-file source (a state dict) is detected for a family with reads_files=True.
- registry.UNREPRESENTABLE names the model_types the reference model cannot represent and what each lacks;
  a registered family's model_types take precedence over it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from toolkit.reference.importers.registry import (Converted, Family, ImportOptions, ImportRefused, detect, families,
                                                  family_of_type, get_family, original_family, register_family)


def resolve(source: str | Path, format: str | None, progress: Callable[[str], None]) -> tuple[Path, Family]:
    """The local path of SOURCE and its family: a hub name is downloaded (its config.json first, to learn the
    family, then that family's files); a local path is detected unless --format names the family."""
    from toolkit.reference.importers.sources import download, is_hub_name, read_json

    family = get_family(format) if format is not None else None
    hub = [f for f in families().values() if f.model_types]
    if is_hub_name(source) and (family is None or family.model_types) and hub:
        config = download(str(source), progress) / "config.json"
        if not config.is_file():
            raise ImportRefused(f"hub model {source} has no config.json, so its family is unknown")
        family = family or family_of_type(read_json(config).get("model_type"), config)
        return download(str(source), progress, family.hub_files), family
    if family is None:
        return Path(source), detect(source)
    if not Path(source).exists():
        raise ImportRefused(f"{source} does not exist; pass {family.source}")
    return Path(source), family


def import_model(source: str | Path, out: str | Path, format: str | None = None, force: bool = False,
                 config_file: str | Path | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """Import SOURCE (a directory, hub name or file of a registered family) into an onnxformer checkpoint at OUT."""
    from toolkit.reference.checkpoint import check_checkpoint_output, nonfinite, save_checkpoint
    from toolkit.reference.importers.sources import BROKEN

    progress = progress or (lambda msg: None)
    if format is not None:
        get_family(format)                                       # an unknown --format before anything else
    check_checkpoint_output(out, force)
    path, family = resolve(source, format, progress)
    if config_file is not None and not family.takes_config:
        takers = [f.name for f in families().values() if f.takes_config]
        raise ImportRefused(f"--config is for {' and '.join(takers)} sources; a {family.name} source carries its "
                            f"own config")
    with tempfile.TemporaryDirectory(prefix="onnxformer-import-") as work:
        model, tokenizer, record = family.convert(path, ImportOptions(Path(config_file) if config_file else None,
                                                                      progress, Path(work)))
        state = model.state_dict()
        broken = nonfinite(state)                # sources.read_state names the source's tensor; this is for all
        if broken:
            raise ImportRefused(f"{source}: {broken} (after conversion); {BROKEN}")
        progress(f"mapped {len(state)} tensors ({model.num_parameters():,} parameters) from {path}")
        record = {"format": family.name, "source": str(source), **record}
        return save_checkpoint(out, model, tokenizer, force=force, imported=record)


def reference_of(original: str | Path):
    """The reference Transformer converted in memory from an original (what parity against the original compares
    with the original framework's forward)."""
    family = detect(original)
    with tempfile.TemporaryDirectory(prefix="onnxformer-import-") as work:
        return family.convert(Path(original), ImportOptions(None, lambda msg: None, Path(work))).model


__all__ = ["import_model", "reference_of", "resolve", "ImportRefused", "Family", "ImportOptions", "Converted",
           "register_family", "families", "get_family", "detect", "original_family"]
