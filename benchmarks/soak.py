"""Soak: many requests through one loaded engine (mixed batch sizes, greedy and beam), resident memory sampled as
it goes. Run in a fresh process, so the curve is this engine's alone:

    python benchmarks/soak.py BUNDLE [--requests 10000] [--warmup 1000] [--every 250] [--json FILE]

Prints the RSS curve and the growth after warm-up (last and largest sample against the sample at the end of
warm-up); exit 1 when the growth reaches --max-growth (default 5%). tests/test_soak_and_kill.py runs it (slow).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bundle import load_bundle  # noqa: E402
from runtime.generate import generate_ids  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402

BATCHES = (1, 2, 4, 8)
BEAMS = (1, 1, 2, 4)                      # half greedy


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(bundle: str | Path, requests: int = 10_000, warmup: int = 1000, every: int = 250, seed: int = 0,
         threads: int = 1, max_new: int = 16) -> dict:
    loaded = load_bundle(bundle, provider="cpu", threads=threads)
    engine, rng = loaded.engine, np.random.default_rng(seed)
    vocab, longest = engine.vocab_size, min(engine.max_len, 24)
    curve, tokens, start = [], 0, time.perf_counter()
    for i in range(1, requests + 1):
        batch, beam = int(rng.choice(BATCHES)), int(rng.choice(BEAMS))
        seqs = [rng.integers(3, vocab, int(rng.integers(1, longest + 1))).tolist() for _ in range(batch)]
        opts = SearchOptions(max_new_tokens=int(rng.integers(1, max_new + 1)), beam=beam,
                             num_return=int(rng.integers(1, beam + 1)))
        tokens += sum(len(h.tokens) for hyps in generate_ids(engine, seqs, opts) for h in hyps)
        if i % every == 0:
            curve.append({"requests": i, "rss_mb": rss_bytes() / 2 ** 20, "seconds": time.perf_counter() - start})
    base = next(p["rss_mb"] for p in curve if p["requests"] >= warmup)
    after = [p["rss_mb"] for p in curve if p["requests"] >= warmup]
    return {"bundle": str(bundle), "kv_cache": loaded.manifest.get("kv_cache", "dynamic"), "requests": requests,
            "warmup": warmup, "tokens": tokens, "seconds": time.perf_counter() - start, "rss_at_warmup_mb": base,
            "rss_last_mb": after[-1], "rss_max_mb": max(after), "growth": max(after) / base - 1, "curve": curve}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-growth", type=float, default=0.05)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    result = soak(args.bundle, args.requests, args.warmup, args.every, threads=args.threads)
    for p in result["curve"]:
        print(f"{p['requests']:>6} requests  {p['rss_mb']:8.1f} MB  {p['seconds']:7.1f} s")
    print(f"{result['requests']} requests, {result['tokens']} tokens in {result['seconds']:.0f} s ({result['kv_cache']} "
          f"cache); RSS {result['rss_at_warmup_mb']:.1f} MB after {result['warmup']} (warm-up), max "
          f"{result['rss_max_mb']:.1f} MB after: growth {result['growth']:+.2%} (limit {args.max_growth:.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["growth"] < args.max_growth else 1


if __name__ == "__main__":
    sys.exit(main())
