"""The runtime's typed errors and the base class of every user-facing error.

Each message names the problem and the fix; the command line prints it and exits with `exit_code`. Errors of
the layers above live with them: toolkit.errors (ConfigError, CheckpointError), toolkit.parity (ParityError),
exporters (OptimizeError, StaticCacheError, ...)."""


class OnnxformerError(Exception):
    """Base class for user-facing errors (bad input, bad files)."""

    exit_code = 2


class TokenizerError(OnnxformerError):
    """Text or token ids the tokenizer cannot represent."""


class InputError(OnnxformerError):
    """A generation request the model cannot serve (empty, too long, bad ids)."""


class BundleError(OnnxformerError):
    """A bundle that is missing, tampered with, or from an unknown format version."""


class ProviderError(OnnxformerError):
    """An execution provider that was asked for but is not available."""
