"""The runtime's typed errors and the base class of every user-facing error.

Each message names the problem and the fix; the command line prints it and exits with `exit_code`. Errors of
the layers above live with them: toolkit.reference.errors (ConfigError, CheckpointError), toolkit.parity (ParityError),
exporters (OptimizeError, StaticCacheError, ...)."""

from __future__ import annotations

import json
from pathlib import Path


class OnnxformerError(Exception):
    """Base class for user-facing errors (bad input, bad files)."""

    exit_code = 2


class TokenizerError(OnnxformerError):
    """Text or token ids the tokenizer cannot represent."""


class InputError(OnnxformerError):
    """A generation request the model cannot serve (empty, too long, bad ids)."""


class SourceTooLong(InputError):
    """An input longer than the model's maximum source length (the caller may name its own way to split it)."""

    def __init__(self, message: str, index: int, tokens: int, limit: int):
        super().__init__(message)
        self.index, self.tokens, self.limit = index, tokens, limit


class NumericsError(OnnxformerError):
    """The model gave a NaN or infinite logit while decoding: its numbers are broken, not the request."""

    exit_code = 1

    def __init__(self, message: str, rows=()):
        super().__init__(message)
        self.rows = [int(r) for r in rows]      # the rows of the step's logits that gave it
        self.inputs: list[int] | None = None    # ... and the inputs they decode, where the caller knows them


class BundleError(OnnxformerError):
    """A bundle that is missing, tampered with, or from an unknown format version."""


class ProviderError(OnnxformerError):
    """An execution provider that was asked for but is not available."""


class AudioError(OnnxformerError):
    """An audio file that cannot be read (missing, corrupt, a format not read, no samples) or samples the
    front-end cannot take (runtime.audio)."""


def read_json(path: str | Path, error: type[OnnxformerError], fix: str, missing: str | None = None):
    """The content of a JSON file we read (config, tokenizer, manifest); a missing, unreadable or malformed file
    becomes `error` with one line naming the file, what is wrong and `fix` (`missing`: the fix when absent)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path} is missing; {missing or fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path} is not valid JSON ({exc}); {fix}") from None
    except OSError as exc:                          # a directory, no permission, an I/O error
        raise error(f"{path} cannot be read ({exc.strerror or exc}); {fix}") from None
