"""onnxformer runtime: load a bundle and generate with ONNX Runtime. Imports only numpy and onnxruntime.

    from runtime import Translator          # the Python API (runtime.api): generate, score, stream
    from runtime import Transcriber         # Whisper: audio to text and segments (runtime.transcribe)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.api import Result, ScoreRecord, Translator
    from runtime.transcribe import Segment, Transcriber, Transcription

API = ("Translator", "Result", "ScoreRecord")
SPEECH = ("Transcriber", "Transcription", "Segment")


def __getattr__(name: str):
    """The API's names, imported on first use: importing one runtime module does not load them all."""
    if name in API:
        from runtime import api

        return getattr(api, name)
    if name in SPEECH:
        from runtime import transcribe

        return getattr(transcribe, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")


__all__ = [*API, *SPEECH]
