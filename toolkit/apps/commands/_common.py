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


def text_lines(input_file: str | None) -> list[str] | None:
    """The non-blank lines of an --input file of source texts (None without one); an empty file is an input error."""
    if input_file is None:
        return None
    from pathlib import Path

    from runtime.errors import InputError

    texts = [line for line in Path(input_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise InputError(f"--input {input_file} has no text lines; pass source texts, one a line")
    return texts
