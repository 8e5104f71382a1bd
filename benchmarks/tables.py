"""How the benchmark scripts print their rows: JSON with --json, else one table line a row.

    print_rows(rows, [("bundle", "bundle", "<40"), ("share", "projection_share", ">6.1%")], as_json=args.json)

A column is (header, the row's key, a format spec whose width also aligns the header).
"""

from __future__ import annotations

import json
import re

ALIGN_WIDTH = re.compile(r"[<>^]?\d*")


def print_rows(rows: list[dict], columns: list[tuple[str, str, str]], as_json: bool = False) -> None:
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    widths = [ALIGN_WIDTH.match(spec).group() for _, _, spec in columns]       # "<40" of "<40", ">6" of ">6.1%"
    print(" ".join(f"{header:{width}}" for (header, _, _), width in zip(columns, widths)))
    for row in rows:
        print(" ".join(f"{row[key]:{spec}}" for _, key, spec in columns))
