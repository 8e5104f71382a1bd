"""What every command shares: lazy import checks and the one-line error handling."""

from __future__ import annotations

import functools
import importlib
import sys

import click

from runtime.errors import OnnxformerError


class MissingExtra(OnnxformerError):
    """A command needs packages of an extra (export: torch, onnx, onnxscript; serve; ray) that this install lacks."""


def require(extra: str = "export"):
    """Import check for commands that need PyTorch and friends: a clear message instead of a traceback."""
    missing = []
    modules = {"export": ("torch", "onnx", "onnxscript"), "torch": ("torch",),
               "serve": ("fastapi", "uvicorn", "prometheus_client", "httpx"), "ray": ("ray",)}[extra]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise MissingExtra(f"this command needs {', '.join(missing)}, which {verb} not installed; "
                           f"install it with: pip install 'onnxformer[{'export' if extra == 'torch' else extra}]'")


def friendly(fn):
    """Turn user-facing errors into a one-line message and exit code (2, or 1 for failed checks)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OnnxformerError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted; nothing was left half-written", err=True)
            sys.exit(130)

    return wrapper
