"""A Transcription written as text, JSON, SubRip (.srt) or WebVTT (.vtt).

    write(result, "json")     # -> str; FORMATS: txt, json, srt, vtt
"""

from __future__ import annotations

import json

from runtime.errors import InputError

FORMATS = ("txt", "json", "srt", "vtt")


def clock(seconds: float, sep: str) -> str:
    """HH:MM:SS<sep>mmm (SubRip: ',', WebVTT: '.')."""
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def txt(result) -> str:
    return result.text.strip() + "\n"


def as_json(result) -> str:
    return json.dumps(result.to_dict(), ensure_ascii=False) + "\n"


def srt(result) -> str:
    blocks = [f"{i}\n{clock(s.start, ',')} --> {clock(s.end, ',')}\n{s.text.strip()}\n"
              for i, s in enumerate(result.segments, 1)]
    return "\n".join(blocks)


def vtt(result) -> str:
    blocks = [f"{clock(s.start, '.')} --> {clock(s.end, '.')}\n{s.text.strip()}\n" for s in result.segments]
    return "WEBVTT\n\n" + "\n".join(blocks)


WRITERS = {"txt": txt, "json": as_json, "srt": srt, "vtt": vtt}


def write(result, fmt: str) -> str:
    """The text of a runtime.transcribe.Transcription in format fmt (one of FORMATS)."""
    if fmt not in WRITERS:
        raise InputError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return WRITERS[fmt](result)


__all__ = ["write", "FORMATS", "clock"]
