"""onnxformer runtime: load a bundle and generate with ONNX Runtime. Imports only numpy and onnxruntime.

    from runtime import Translator          # the Python API (runtime.api): generate, score, stream
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.api import Result, ScoreRecord, Translator

API = ("Translator", "Result", "ScoreRecord")


def __getattr__(name: str):
    """The API's names, imported on first use: importing one runtime module does not load them all."""
    if name in API:
        from runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")


__all__ = list(API)
