"""Typed errors. Each message names the problem and the fix; the command line prints it and exits 2."""


class OnnxformerError(Exception):
    """Base class for user-facing errors (bad input, bad files)."""

    exit_code = 2


class ConfigError(OnnxformerError):
    """A model configuration that cannot be built."""


class CheckpointError(OnnxformerError):
    """A checkpoint directory that cannot be loaded."""


class TokenizerError(OnnxformerError):
    """Text or token ids the tokenizer cannot represent."""


class InputError(OnnxformerError):
    """A generation request the model cannot serve (empty, too long, bad ids)."""


class BundleError(OnnxformerError):
    """A bundle that is missing, tampered with, or from an unknown format version."""


class ProviderError(OnnxformerError):
    """An execution provider that was asked for but is not available."""


class ParityError(OnnxformerError):
    """Parity out of tolerance: a check failed (exit code 1)."""

    exit_code = 1

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report
