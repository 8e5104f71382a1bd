"""Reading what families import: JSON files, hub downloads, weight files and state dicts, transformers itself.

Shared by every family; torch and the hub client are imported inside the functions that need them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from runtime.errors import read_json as read_json_file
from toolkit.reference.errors import CheckpointError
from toolkit.reference.importers.registry import HUB_FILES, ImportRefused

WRAPPERS = ("model_state_dict", "state_dict", "model")     # training scripts' checkpoints: {key: state dict, ...}
PREFIXES = {"module.": "DataParallel/DistributedDataParallel", "_orig_mod.": "torch.compile"}
BROKEN = "the source model is broken (a diverged training run?); import a sound one"


def read_json(path: Path) -> dict:
    """A JSON object of a model directory (config.json, tokenizer_config.json, ...)."""
    data = read_json_file(path, ImportRefused, "download the model again", missing="pass the complete model directory")
    if not isinstance(data, dict):
        raise ImportRefused(f"{path} is not a JSON object; download the model again")
    return data


def with_generation_config(directory: Path, hf: dict) -> dict:
    """config.json's fields with what generate reads from generation_config.json where the directory has one:
    forced_eos_token_id (that file decides it; absent there: none), and decoder_start_token_id where config.json
    lacks it."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return hf
    gen = read_json(path)
    hf = {**hf, "forced_eos_token_id": gen.get("forced_eos_token_id")}
    if hf.get("decoder_start_token_id") is None and gen.get("decoder_start_token_id") is not None:
        hf["decoder_start_token_id"] = gen["decoder_start_token_id"]
    return hf


def forced_eos(hf: dict, eos: int, where: Path) -> bool:
    """Whether generate ends a target at the length limit with EOS (forced_eos_token_id, the end token itself or
    a one-id list of it); ImportRefused for another token, which the search cannot force."""
    forced = hf.get("forced_eos_token_id")
    if isinstance(forced, list) and len(forced) == 1:
        forced = forced[0]
    if forced is not None and forced != eos:
        raise ImportRefused(f"{where}: forced_eos_token_id {forced!r} is not the end token {eos}; the search forces "
                            f"only EOS at the length limit (set it to {eos} or null and import again)")
    return forced is not None


def is_hub_name(source: str | Path) -> bool:
    """A name such as Helsinki-NLP/opus-mt-en-de: no such local path, one slash, not a relative or absolute path."""
    text = str(source)
    return not Path(source).exists() and text.count("/") == 1 and not text.startswith((".", "/"))


def download(name: str, progress: Callable[[str], None], patterns=("config.json",)) -> Path:
    """The local snapshot of hub model NAME holding PATTERNS (transformers' hub client; exit 2 without a network)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ImportRefused(f"{name} is not a directory, and downloading a hub model needs transformers; "
                            f"pip install 'onnxformer[import]', or download the model elsewhere and pass its "
                            f"directory") from None
    progress(f"downloading {' '.join(patterns)} of {name} from the Hugging Face hub")
    try:
        return Path(snapshot_download(name, allow_patterns=list(patterns)))
    except Exception as exc:                        # no network, unknown repo, refused: all the same to the user
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise ImportRefused(f"cannot download {name} ({first}); without a network, download the model where there "
                            f"is one (e.g. huggingface-cli download {name} --local-dir DIR), copy DIR here and "
                            f"pass it as SOURCE") from None


def read_state(file: Path, fix: str, progress: Callable[[str], None]) -> dict:
    """The state dict (name -> tensor) in a weights file. A training checkpoint's wrapper ({"model_state_dict": ...},
    "state_dict", "model") and the 'module.' prefix DataParallel adds are taken off, and progress says so; NaN or
    infinite weights are refused naming the tensor."""
    import torch

    from toolkit.reference.checkpoint import nonfinite, read_weights

    try:
        state = read_weights(file, fix)
    except CheckpointError as exc:                  # the same message, as the importers' error
        raise ImportRefused(str(exc)) from None
    if isinstance(state, dict) and not all(isinstance(v, torch.Tensor) for v in state.values()):
        key = next((k for k in WRAPPERS if isinstance(state.get(k), dict)), None)
        if key is not None:
            others = sorted(str(k) for k in state if k != key)
            progress(f"{file}: took the state dict under {key!r}"
                     f"{' (left ' + ', '.join(others[:4]) + ')' if others else ''}")
            state = state[key]
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ImportRefused(f"{file} is not a state dict (name -> tensor) nor one wrapped under "
                            f"{', '.join(repr(w) for w in WRAPPERS)}; {fix}")
    for prefix, who in PREFIXES.items():
        if all(isinstance(k, str) and k.startswith(prefix) for k in state):
            progress(f"{file}: removed the {prefix!r} prefix {who} adds to every name")
            state = {k[len(prefix):]: v for k, v in state.items()}
    broken = nonfinite(state)
    if broken:
        raise ImportRefused(f"{file}: {broken}; {BROKEN}")
    return state


def one_eos(eos, where: Path) -> int:
    """config.json's eos_token_id as one id (a one-id list taken apart); ImportRefused for several."""
    if isinstance(eos, list):
        if len(eos) != 1:
            raise ImportRefused(f"{where}: several EOS ids {eos}; the reference model stops at one")
        eos = eos[0]
    return eos


def model_of(config, mapped: dict, where: Path):
    """The reference Transformer (eval mode) holding a family's mapped tensors; ImportRefused naming the first
    names or shapes that do not match the config (a checkpoint that disagrees with its config.json)."""
    from toolkit.reference.model import Transformer

    expected = Transformer.empty(config).state_dict()
    wrong = [k for k, v in mapped.items() if k not in expected or tuple(expected[k].shape) != tuple(v.shape)]
    missing = sorted(set(expected) - set(mapped))
    if wrong or missing:
        raise ImportRefused(f"{where}: the weights do not match config.json (shape or name: "
                            f"{', '.join((wrong + missing)[:4])})")
    return Transformer.from_state(config, mapped)


def require_transformers(what: str):
    """transformers, or an ImportRefused naming what needs it."""
    try:
        import transformers
    except ImportError:
        raise ImportRefused(f"{what} needs transformers; pip install 'onnxformer[import]'") from None
    return transformers


def quiet_from_pretrained(load, path: Path):
    """load(str(path)) with transformers' logging, warnings and progress bars silenced (their advice is not for our
    users; the bar would land in the middle of our reports)."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load(str(path))
    finally:
        if bar:
            hf_logging.enable_progress_bar()


__all__ = ["model_of", "one_eos", "read_json", "is_hub_name", "download", "read_state", "require_transformers", "quiet_from_pretrained",
           "HUB_FILES"]
