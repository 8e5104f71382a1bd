"""Keep the command line's output ours: the exporter, quantizer and converters log advice we report ourselves."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def quiet_loggers(*names: str, level: int = logging.ERROR):
    """Raise the named loggers to `level` for the duration, then restore them."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, old in zip(loggers, levels):
            lg.setLevel(old)
