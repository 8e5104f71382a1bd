"""What every command shares: the one-line error handling."""

from __future__ import annotations

import functools
import sys

import click

from runtime.errors import OnnxformerError


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
