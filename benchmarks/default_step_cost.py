"""What plain greedy decoding costs per step: CPU time (process_time, less sensitive than wall time to other
processes) of generate_ids on a bundle, of the numpy search alone on a state that returns fixed logits, and (a
bundle with the per-row static cache) of an in-flight batch's step with plain greedy rows. Run it with two trees
(before and after a change to the search) on bundles of one checkpoint, to see that a new decoding control costs
nothing when it is not used. It also gives the step of 8 rows that all set CONTROLS (sampling, penalties, bans):
request-level, and in-flight with a tree whose in-flight rows keep their own options.

    PYTHONPATH=TREE python benchmarks/default_step_cost.py BUNDLE [--steps 32] [--repeat 60]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from runtime.bundle import load_bundle
from runtime.generate import generate_ids
from runtime.inflight import InflightBatch
from runtime.search import SearchOptions, greedy
from runtime.spec import STATIC_PER_ROW

TEXTS = ["12 March 2019", "march 3rd, 2001", "Sat 5 Jan 1999", "2020-01-02", "the 4th of july 1976", "1 1 2000",
         "dec 31 1999", "June 6, 1944"]

CONTROLS = dict(sample=True, seed=1, top_k=20, top_p=0.9, repetition_penalty=1.2, no_repeat_ngram_size=3)


class Fixed:
    """A decoder state that returns the same random logits every step: the search's own work, no model."""

    def __init__(self, rows: int, vocab: int):
        self.logits = np.random.default_rng(0).normal(size=(rows, vocab)).astype(np.float32)

    def step(self, tokens, keep):
        return self.logits[:len(tokens)].copy()


def per_step(run, repeat: int, steps: int, scale: float) -> tuple[float, float]:
    """Min and p25 over `repeat` runs of CPU time per step (run() returns the CPU seconds it measured)."""
    times = [run() / steps * scale for _ in range(repeat)]
    return float(np.min(times)), float(np.percentile(times, 25))


def timed(fn):
    """A run for per_step: fn's whole call, timed."""
    def run() -> float:
        start = time.process_time()
        fn()
        return time.process_time() - start
    return run


def inflight(engine, seqs, steps: int, options: dict | None = None):
    """A run of an in-flight batch: the rows join (not timed: the encoder), then step until all are done (timed).
    options: every row's request sets these controls (a tree with per-row options only)."""
    batch = InflightBatch(engine, slots=len(seqs), opts=SearchOptions(ignore_eos=True), capacity=steps)

    def run() -> float:
        if options is None:
            batch.join(seqs, [steps] * len(seqs))
        else:
            from runtime.request import Request

            opts = SearchOptions(max_new_tokens=steps, ignore_eos=True, **options)
            batch.join(*batch.request_rows(Request.build(engine, seqs, None, opts)))
        start = time.process_time()
        while batch.live:
            batch.step()
        return time.process_time() - start
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=60)
    args = parser.parse_args()
    model = load_bundle(args.bundle, "cpu", threads=1)
    engine, tok = model.engine, model.tokenizer
    seqs = [tok.encode(t) for t in TEXTS]
    opts = SearchOptions(max_new_tokens=args.steps, ignore_eos=True)
    print("| what | batch | min | p25 |\n|---|---|---|---|")
    for batch in (1, 8):
        low, p25 = per_step(timed(lambda: generate_ids(engine, seqs[:batch], opts)), args.repeat, args.steps, 1e3)
        print(f"| bundle step, CPU ms | {batch} | {low:.4f} | {p25:.4f} |")
    for batch in (1, 8):
        low, p25 = per_step(timed(lambda: greedy(Fixed(batch, engine.vocab_size), batch, engine.bos_id, engine.eos_id,
                                                 opts)), args.repeat * 3, args.steps, 1e6)
        print(f"| search alone, CPU us | {batch} | {low:.2f} | {p25:.2f} |")
    low, p25 = per_step(timed(lambda: generate_ids(engine, seqs, replace(opts, **CONTROLS))),
                        args.repeat, args.steps, 1e3)
    print(f"| bundle step, every row with CONTROLS, CPU ms | 8 | {low:.4f} | {p25:.4f} |")
    if getattr(engine, "layout", None) != STATIC_PER_ROW:
        return
    for batch in (1, 8):
        low, p25 = per_step(inflight(engine, seqs[:batch], args.steps), args.repeat, args.steps, 1e3)
        print(f"| in-flight step, CPU ms | {batch} | {low:.4f} | {p25:.4f} |")
    if hasattr(InflightBatch, "request_rows"):
        low, p25 = per_step(inflight(engine, seqs, args.steps, CONTROLS), args.repeat, args.steps, 1e3)
        print(f"| in-flight step, every row with CONTROLS, CPU ms | 8 | {low:.4f} | {p25:.4f} |")


if __name__ == "__main__":
    main()
