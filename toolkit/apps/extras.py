"""Optional packages: a clear one-line error (exit 2) when a feature needs an extra this install lacks."""

from __future__ import annotations

import importlib

from runtime.errors import OnnxformerError

EXTRAS = {"export": ("torch", "onnx", "onnxscript"), "torch": ("torch",),   # extra -> modules it provides
          "serve": ("fastapi", "uvicorn", "prometheus_client", "httpx"), "ray": ("ray",)}
PIP_EXTRA = {"torch": "export"}                                             # the pyproject extra that installs it


class MissingExtra(OnnxformerError):
    """A command needs packages of an extra (export: torch, onnx, onnxscript; serve; ray) that this install lacks."""


def require(extra: str = "export") -> None:
    """Import check for features that need PyTorch and friends: a clear message instead of a traceback."""
    missing = []
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise MissingExtra(f"this command needs {', '.join(missing)}, which {verb} not installed; "
                           f"install it with: pip install 'onnxformer[{PIP_EXTRA.get(extra, extra)}]'")
