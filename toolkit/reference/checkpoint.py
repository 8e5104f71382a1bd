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
    model = Transformer(config, seed=0)
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
    model.load_state_dict(state)
    model.eval()
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
    if (path / WEIGHTS).exists():
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(str(path / WEIGHTS))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {path}: {WEIGHTS} is unreadable ({exc}); re-save the checkpoint") from None
    if (path / WEIGHTS_PT).exists():
        try:
            state = torch.load(path / WEIGHTS_PT, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types for corrupt or unsafe files
            raise CheckpointError(f"checkpoint {path}: {WEIGHTS_PT} cannot be loaded safely ({type(exc).__name__}); "
                                  f"re-save it as a plain state dict") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {path}: {WEIGHTS_PT} is not a state dict")
        return state
    raise CheckpointError(f"checkpoint {path} has no weights ({WEIGHTS} or {WEIGHTS_PT}); re-save the checkpoint")
