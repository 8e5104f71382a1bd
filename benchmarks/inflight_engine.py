"""Engine-only comparison of in-flight and request-level batching, and the static-cache step time by span.

    flock /tmp/onnxformer-bench.lock .venv/bin/python benchmarks/inflight_engine.py out/bench/base/base-int8

1. The same 96 inputs (8-32 source tokens, 8-128 new tokens each, EOS suppressed) decoded request-level in batches of
   16 (runtime.generate.generate_ids with per-input limits) and in-flight in a 32-slot runtime.inflight.InflightBatch
   that admits a waiting input whenever a slot is free: seconds and generated tokens per second.
2. One 32-row static-cache batch stepped 200 times: the median step time per 50 positions of filled cache (the span
   each row attends over; in a per-row static cache every in-flight row attends over its own length only).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from runtime.bundle import load_bundle
from runtime.generate import generate_ids
from runtime.inflight import InflightBatch
from runtime.search import SearchOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--inputs", type=int, default=96)
    args = ap.parse_args()
    e = load_bundle(args.bundle, provider="cpu", threads=args.threads).engine
    rng = np.random.default_rng(0)
    n = args.inputs
    seqs = [rng.integers(4, e.src_vocab_size, size=int(rng.integers(8, 33))).tolist() for _ in range(n)]
    limits = rng.integers(8, 129, size=n)
    t = time.perf_counter()
    for i in range(0, n, 16):
        generate_ids(e, seqs[i:i + 16], SearchOptions(max_new_tokens=int(limits[i:i + 16].max()), ignore_eos=True),
                     limits=limits[i:i + 16])
    request = time.perf_counter() - t
    print(f"request-level, batches of 16: {request:.1f} s, {limits.sum() / request:.0f} tokens/s", flush=True)
    batch = InflightBatch(e, slots=32, opts=SearchOptions(ignore_eos=True))
    t, waiting, steps = time.perf_counter(), 0, 0
    while waiting < n or batch.live:
        if waiting < n and batch.free:
            k = min(batch.free, n - waiting)
            batch.join(seqs[waiting:waiting + k], limits[waiting:waiting + k].tolist())
            waiting += k
        batch.step()
        steps += 1
    inflight = time.perf_counter() - t
    print(f"in-flight, 32 slots: {inflight:.1f} s, {limits.sum() / inflight:.0f} tokens/s, {steps} steps "
          f"({inflight / steps * 1e3:.1f} ms each); in-flight / request-level "
          f"throughput {request / inflight:.2f}x", flush=True)
    ids = rng.integers(4, e.src_vocab_size, size=(32, 24))
    state = e.start(ids, np.ones_like(ids), 1, 250)
    tokens, times = np.full(32, e.bos_id), {}
    for step in range(200):
        t = time.perf_counter()
        state.step(tokens, None)
        times.setdefault(step // 50, []).append(time.perf_counter() - t)
    for k, v in times.items():
        print(f"static cache, 32 rows, span {k * 50}-{k * 50 + 49}: {np.median(v) * 1e3:.1f} ms per step")


if __name__ == "__main__":
    main()
