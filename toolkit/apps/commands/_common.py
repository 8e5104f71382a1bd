"""What every command shares: the one-line error handling, and the one reader of --input files."""

from __future__ import annotations

import errno
import functools
import sys

import click

from runtime.errors import InputError, OnnxformerError


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
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            where = f" writing {exc.filename}" if exc.filename else ""
            click.echo(f"error: the disk is full ({exc.strerror or 'no space left on device'}{where}); what this "
                       f"command was writing was removed, nothing else was touched: free space (a bundle's "
                       f"weights.data is as large as its weights, and export and optimize write a second copy "
                       f"before it) or choose --out on another disk, and run it again", err=True)
            sys.exit(2)

    return wrapper


def text_lines(input_file: str | None, flag: str = "--input", blank_ok: bool = False) -> list[str] | None:
    """The lines of an --input file ('-': stdin), one input a line (None without one). A UTF-8 text file with at
    least one line, none of them blank: a blank line would be an empty input (and shift every answer after it);
    `blank_ok`: blank lines are kept (--prefix-file: an input without a prefix)."""
    if input_file is None:
        return None
    try:
        with click.open_file(input_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {flag} {input_file}: {exc}; pass a UTF-8 text file, one input a line") from None
    for n, line in enumerate(lines, 1):
        if not line.strip() and not blank_ok:
            raise InputError(f"{flag} {input_file} line {n} is blank; remove blank lines (one input a line)")
    if not lines:
        raise InputError(f"{flag} {input_file} has no text lines; pass texts, one a line")
    return lines
