"""Where a bundle's `generate` memory goes: resident memory, anonymous and file-backed, after loading and after a
batch-1 and a batch-8 run (random source ids, exactly --new-tokens tokens each).

    .venv/bin/python benchmarks/generate_memory.py BUNDLE [--new-tokens 64] [--src-len 32]

Anonymous memory is ONNX Runtime's own (prepacked weights, arenas) and Python's; file-backed memory is the bundle's
mapped weights that were touched (and the libraries' code). Prints one row a stage, in MiB.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimize_memory import rss  # noqa: E402  (this folder is on sys.path when run as a script)

FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def status() -> dict[str, float]:
    return rss(FIELDS, unit=1024 ** 2)                      # MiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--src-len", type=int, default=32)
    args = ap.parse_args()
    from runtime.bundle import load_bundle
    from runtime.generate import generate_ids
    from runtime.search import SearchOptions

    rows = [("start", status())]
    bundle = load_bundle(args.bundle, "cpu")
    rows.append(("loaded", status()))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(5, 1000, args.src_len).tolist() for _ in range(8)]   # every real shape's vocabulary is larger
    opts = SearchOptions(max_new_tokens=args.new_tokens, ignore_eos=True)
    generate_ids(bundle.engine, seqs[:1], opts)
    rows.append(("batch 1", status()))
    generate_ids(bundle.engine, seqs, opts)
    rows.append(("batch 8", status()))
    print(f"{'stage':<10}" + "".join(f"{k:>10}" for k in FIELDS) + "   (MiB)")
    for stage, values in rows:
        print(f"{stage:<10}" + "".join(f"{values.get(k, float('nan')):>10.1f}" for k in FIELDS))


if __name__ == "__main__":
    main()
