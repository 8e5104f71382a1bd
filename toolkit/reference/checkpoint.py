"""Checkpoints: a directory with config.json, weights.safetensors (or weights.pt) and, for text models, tokenizer.json.

Loading never executes pickled code: safetensors is plain data, and .pt files load with weights_only=True.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.errors import TokenizerError
from toolkit.reference.errors import CheckpointError, ConfigError
from runtime.tokenizer import CharTokenizer, load_tokenizer, tokenizer_files
from toolkit.reference.config import ModelConfig
from toolkit.reference.model import Transformer
from toolkit.reference.outdir import OutputKind, check_output, staged_output

CONFIG, WEIGHTS, WEIGHTS_PT, TOKENIZER, TRAINING = "config.json", "weights.safetensors", "weights.pt", "tokenizer.json", "training.json"
IMPORTED = "import.json"            # where an imported checkpoint came from (toolkit/importers)
CHECKPOINT_FILES = (CONFIG, WEIGHTS, WEIGHTS_PT, TOKENIZER, TRAINING, IMPORTED)   # every file a writer may write


def checkpoint_files(path: Path) -> set[str] | None:
    """The files of the onnxformer checkpoint at path (recognised by a config.json of ours beside its weights),
    or None when path is not one."""
    try:
        ModelConfig.load(path / CONFIG)
    except (ConfigError, OSError, UnicodeDecodeError):
        return None
    if not any((path / w).is_file() for w in (WEIGHTS, WEIGHTS_PT)):
        return None
    files = set(CHECKPOINT_FILES)
    if (path / TOKENIZER).is_file():                 # a SentencePiece tokenizer's models and vocabularies
        try:
            files |= set(tokenizer_files(load_tokenizer(path / TOKENIZER)))
        except TokenizerError:
            return None
    return files


CHECKPOINT_KIND = OutputKind("checkpoint", checkpoint_files, "'onnxformer init', 'train' or 'import'")


def check_checkpoint_output(path: str | Path, force: bool = False) -> Path:
    """Refuse, before any work, an --out that save_checkpoint would not write (see toolkit/reference/outdir.py)."""
    return check_output(path, force, CHECKPOINT_KIND)


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model in eval mode, its config, and the tokenizer when it has one."""

    model: Transformer
    config: ModelConfig
    tokenizer: CharTokenizer | None       # or a runtime.tokenizer.SentencePieceTokenizer
    path: Path


def save_checkpoint(path: str | Path, model: Transformer, tokenizer: CharTokenizer | None = None,
                    training: dict | None = None, force: bool = False, imported: dict | None = None) -> Path:
    """Write a checkpoint directory atomically; force replaces only an onnxformer checkpoint (toolkit/reference/outdir.py)."""
    from safetensors.torch import save_file

    path = check_checkpoint_output(path, force)
    if tokenizer is not None:
        problem = vocab_mismatch(tokenizer, model.config)
        if problem:
            raise ConfigError(problem)
    with staged_output(path, force, CHECKPOINT_KIND) as tmp:
        model.config.save(tmp / CONFIG)
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS))
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER)
        if training is not None:
            (tmp / TRAINING).write_text(json.dumps(training, indent=2) + "\n")
        if imported is not None:
            (tmp / IMPORTED).write_text(json.dumps(imported, indent=2) + "\n")
    return path


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load a checkpoint directory, with a clear error for each way it can be broken."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; create one with 'onnxformer init' or 'onnxformer train'")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; a checkpoint is a directory holding {CONFIG} and weights")
    if (path / "manifest.json").exists():
        raise CheckpointError(f"{path} is an ONNX bundle, not a PyTorch checkpoint; pass the checkpoint directory")
    try:
        config = ModelConfig.load(path / CONFIG)
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from None
    model = Transformer.empty(config)                 # shapes only: the weights are the file's (from_state)
    state = _load_state(path)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path}: weights do not match config.json (missing: {missing[:3]}, unexpected: {unexpected[:3]}); "
            f"the weights belong to another model")
    for name, tensor in model.state_dict().items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint {path}: weight {name} has shape {tuple(state[name].shape)}, "
                                  f"config.json implies {tuple(tensor.shape)}; the weights belong to another model")
    broken = nonfinite(state)
    if broken:
        raise CheckpointError(f"checkpoint {path}: {broken}; the model is broken (a diverged training run?), "
                              f"retrain it or import it again from a sound source")
    model = Transformer.from_state(config, state)
    tokenizer = None
    if (path / TOKENIZER).exists():
        try:
            tokenizer = load_tokenizer(path / TOKENIZER)
        except TokenizerError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from None
        problem = vocab_mismatch(tokenizer, config)
        if problem:
            raise CheckpointError(f"checkpoint {path}: {problem}")
    return Checkpoint(model, config, tokenizer, path)


def vocab_mismatch(tokenizer, config: ModelConfig) -> str | None:
    """Why a tokenizer cannot feed a model (ids beyond its vocabularies), or None."""
    src = getattr(tokenizer, "src_vocab_size", tokenizer.vocab_size)
    if tokenizer.vocab_size > config.vocab_size:
        return (f"tokenizer has {tokenizer.vocab_size} target tokens but the model's vocab_size is {config.vocab_size}; "
                f"make vocab_size at least {tokenizer.vocab_size}")
    if src > config.source_vocab_size:
        return (f"tokenizer has {src} source tokens but the model's source vocabulary has {config.source_vocab_size}; "
                f"make it at least {src}")
    return None


def _load_state(path: Path) -> dict[str, torch.Tensor]:
    fix = "re-save the checkpoint"
    for name in (WEIGHTS, WEIGHTS_PT):
        if (path / name).exists():
            state = read_weights(path / name, fix)
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise CheckpointError(f"checkpoint {path}: {name} is not a state dict (name -> tensor); {fix}")
            return state
    raise CheckpointError(f"checkpoint {path} has no weights ({WEIGHTS} or {WEIGHTS_PT}); {fix}")


def read_weights(file: Path, fix: str):
    """What a weights file holds: safetensors (plain data), else torch.save's format loaded with weights_only=True,
    so no pickled code runs. A file cut short is reported as truncated; other failures end with fix."""
    try:
        short, safetensors = truncation(file), is_safetensors(file)
    except OSError as exc:                          # a directory, no permission, an I/O error
        raise CheckpointError(f"{file} cannot be read ({exc.strerror or exc}); {fix}") from None
    if short:
        raise CheckpointError(f"{file} is truncated ({short}): an interrupted copy, download or save; copy, download "
                              f"or save it again")
    if safetensors:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(str(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file} is unreadable ({exc}); {fix}") from None
    try:
        import zipfile                              # torch.save's zip format maps in place, as safetensors does
        return torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except Exception as exc:  # torch raises several types for corrupt or unsafe files
        raise CheckpointError(f"{file} cannot be loaded safely with weights_only=True ({type(exc).__name__}); "
                              f"{fix}") from None


def is_safetensors(file: Path) -> bool:
    """safetensors by name, or by content: an 8-byte header length followed by the JSON header's '{'."""
    with open(file, "rb") as f:
        head = f.read(9)
    return file.suffix == ".safetensors" or (len(head) == 9 and head[8:] == b"{")


def truncation(file: Path) -> str | None:
    """'N of M bytes' when a safetensors file or torch.save's zip archive ends before its own header says it should;
    None for a complete file, or one whose kind is not recognised (its reader reports that)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if head[:4] == b"PK\x03\x04":                     # torch.save: a zip whose directory is at the end
            import zipfile

            return None if zipfile.is_zipfile(file) else f"{size} bytes, the zip archive's directory is missing"
        if not is_safetensors(file):
            return None
        if len(head) < 8:
            return f"{size} of at least 8 bytes"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"{size} of at least {8 + n} bytes"
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
    ends = [v["data_offsets"][1] for v in header.values() if isinstance(v, dict) and "data_offsets" in v] \
        if isinstance(header, dict) else []
    need = 8 + n + max(ends, default=0)
    return f"{size} of {need} bytes" if size < need else None


def finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """Whether every value of t is finite, checked a slice at a time: isfinite makes temporaries of the tensor's
    size (its absolute values, two masks), 1.5 GB beside NLLB's 1 GB embedding if done at once."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def nonfinite(state: dict[str, torch.Tensor]) -> str | None:
    """Which weights hold NaN or infinite values ('weight NAME holds ...'), or None when all are finite."""
    bad = [name for name, t in state.items() if t.is_floating_point() and not finite(t)]
    if not bad:
        return None
    t = state[bad[0]]
    more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    return (f"weight {bad[0]} holds {int(torch.isnan(t).sum())} NaN and {int(torch.isinf(t).sum())} infinite values "
            f"of {t.numel()}{more}")
