"""Errors of toolkit's reference side (configs and checkpoints); torch-free, so any layer above can catch them."""

from runtime.errors import OnnxformerError


class ConfigError(OnnxformerError):
    """A model configuration that cannot be built."""


class CheckpointError(OnnxformerError):
    """A checkpoint directory that cannot be loaded."""
