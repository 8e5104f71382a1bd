"""The registry of model families: which family reads a source, how it converts, how parity loads its original.

A family is one module of this package that calls `register_family` at import time (see the package docstring
for the API). The registry imports every public module of the package the first time it is asked, so adding a
family adds a file and nothing else; the command line's --format choices, `import`'s detection and `parity
ORIGINAL BUNDLE`'s reference detection all read `families()`. Family modules keep their top level free of torch
(import it inside functions): the command line lists the choices without loading torch.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from toolkit.reference.errors import CheckpointError

HUB_FILES = ("*.json", "*.safetensors", "*.bin", "*.spm", "*.model", "*.txt")   # what a hub download fetches
# model types of transformers whose computation the reference model lacks: model_type -> what it would need
UNREPRESENTABLE = {
    "umt5": "per-layer relative position buckets and RMS LayerNorm without bias",
    "longt5": "local and transient-global attention with relative position buckets",
    "switch_transformers": "mixture-of-experts feed-forward layers",
    "nllb-moe": "mixture-of-experts feed-forward layers",
    "speech_to_text": "an audio encoder (convolutional subsampling of speech features)",
    "seamless_m4t": "speech encoders and decoders",
    "prophetnet": "n-stream self-attention predicting future n-grams",
    "xlm-prophetnet": "n-stream self-attention predicting future n-grams",
    "led": "Longformer's sliding-window and global attention",
    "bigbird_pegasus": "block-sparse attention",
    "pegasus_x": "block-local attention with global tokens",
    "encoder-decoder": "a composed encoder and decoder (token types, learned absolute positions)",
    "vision-encoder-decoder": "an image encoder",
}


class ImportRefused(CheckpointError):
    """A source checkpoint that cannot be imported: unreadable, or using a feature the reference model lacks."""


@dataclass(frozen=True)
class ImportOptions:
    """What a family's convert gets besides the source."""

    config_file: Path | None                    # --config (only families with takes_config get one)
    progress: Callable[[str], None]             # one line for the user (stderr on the command line)
    work: Path                                  # a scratch directory that lives until the checkpoint is written


class Converted(NamedTuple):
    """What convert returns: the reference model in eval mode, its tokenizer (or None), and what import.json records
    besides "format" and "source" (the files read, the config used, notes)."""

    model: Any                                  # toolkit.reference.model.Transformer
    tokenizer: Any
    record: dict


@dataclass(frozen=True)
class Family:
    """One model family the importer reads."""

    name: str                                   # the --format choice and import.json's "format"
    source: str                                 # what SOURCE is, for --help, README and messages
    convert: Callable[[Path, ImportOptions], Converted]
    model_types: tuple[str, ...] = ()           # a directory whose config.json has one of these model_types
    reads_files: bool = False                   # a single file (a state dict) is this family's source
    takes_config: bool = False                  # --config JSON is accepted (and passed as options.config_file)
    load_original: Callable[[Path], tuple] | None = None   # (original model in eval mode, its tokenizer): parity
    original: str = "the original"              # its name in parity reports: "MarianMTModel (transformers)"
    hub_files: tuple[str, ...] = HUB_FILES      # for model_types families: the files a hub download fetches


_FAMILIES: dict[str, Family] = {}
_loaded = False


def register_family(family: Family) -> Family:
    """Add a family (called by its module at import); a second family with the same name or model_type is an error
    in the code, not the user's."""
    taken = {t: f.name for f in _FAMILIES.values() for t in f.model_types}
    clash = [t for t in family.model_types if t in taken]
    if family.name in _FAMILIES or clash:
        raise ValueError(f"family {family.name!r} clashes with a registered one (name, or model_types {clash})")
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, Family]:
    """Every registered family by name, in name order (the modules of this package are imported once)."""
    global _loaded
    if not _loaded:
        package = importlib.import_module("toolkit.reference.importers")
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            if not info.name.startswith("_"):                 # modules that register nothing add nothing
                importlib.import_module(f"{package.__name__}.{info.name}")
        _loaded = True
    return dict(sorted(_FAMILIES.items()))


def get_family(name: str) -> Family:
    known = families()
    if name not in known:
        raise ImportRefused(f"unknown format {name!r}; choose one of {', '.join(known)}")
    return known[name]


def supported() -> str:
    """The families as a message lists them: "marian (config.json model_type marian), nn-transformer (...)"."""
    return ", ".join(f"{f.name} ({describe(f)})" for f in families().values())


def describe(family: Family) -> str:
    if family.model_types:
        return f"config.json model_type {' or '.join(family.model_types)}"
    return "a state-dict file" if family.reads_files else family.source


def family_of_type(model_type: object, where: Path) -> Family:
    """The family reading a config.json with this model_type; otherwise an ImportRefused that names the type and,
    for a type the reference model cannot represent at all, the missing feature."""
    for family in families().values():
        if model_type in family.model_types:
            return family
    if model_type is None:
        raise ImportRefused(f"{where} has no model_type, so its family is unknown; supported: {supported()}")
    if model_type in UNREPRESENTABLE:
        raise ImportRefused(f"{where} is a {model_type} model, which onnxformer's reference model cannot "
                            f"represent (it lacks {UNREPRESENTABLE[model_type]}); supported: {supported()}")
    raise ImportRefused(f"{where} has model_type {model_type!r}, a family onnxformer does not import; "
                        f"supported: {supported()}")


def detect(source: str | Path) -> Family:
    """The family of a local source: a directory by its config.json's model_type, a file by the families that
    read single files. Anything else is refused naming what was expected."""
    from toolkit.reference.importers.sources import read_json

    path = Path(source)
    if path.is_dir():
        if (path / "manifest.json").exists():
            raise ImportRefused(f"{path} is an onnxformer bundle; import reads other frameworks' checkpoints")
        if (path / "config.json").is_file():
            return family_of_type(read_json(path / "config.json").get("model_type"), path / "config.json")
        raise ImportRefused(f"{path} has no config.json, so its family is unknown; pass the directory written by "
                            f"save_pretrained, or a file; supported: {supported()}")
    readers = [f for f in families().values() if f.reads_files]
    if path.is_file() and len(readers) == 1:
        return readers[0]
    if path.is_file():
        raise ImportRefused(f"{path} is a file that several families read; pass --format "
                            f"{' or '.join(f.name for f in readers)}")
    raise ImportRefused(f"{source} does not exist; pass a model directory, a hub name or a file; "
                        f"supported: {supported()}")


def original_family(path: str | Path) -> Family | None:
    """The family whose original a parity run can load from path (a model directory of a family with
    load_original), or None (path is a checkpoint, a bundle, or something else)."""
    path = Path(path)
    if not path.is_dir() or not (path / "config.json").is_file() or (path / "manifest.json").exists():
        return None
    from toolkit.reference.importers.sources import read_json

    model_type = read_json(path / "config.json").get("model_type")
    found = [f for f in families().values() if model_type in f.model_types and f.load_original is not None]
    return found[0] if found else None


__all__ = ["Family", "ImportOptions", "Converted", "ImportRefused", "register_family", "families", "get_family",
           "detect", "family_of_type", "original_family", "supported", "UNREPRESENTABLE"]
