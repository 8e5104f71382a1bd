"""Errors of toolkit's reference side (configs, checkpoints, output directories); torch-free, so any layer above can catch them."""

from runtime.errors import OnnxformerError


class ConfigError(OnnxformerError):
    """A model configuration that cannot be built."""


class CheckpointError(OnnxformerError):
    """A checkpoint directory that cannot be loaded."""


class OutputError(OnnxformerError):
    """An --out that cannot be written or must not be replaced (toolkit/reference/outdir.py; nothing was touched)."""
