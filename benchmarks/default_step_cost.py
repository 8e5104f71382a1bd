"""What plain greedy decoding costs per step: CPU time (process_time, less sensitive than wall time to other
processes) of generate_ids on a bundle, and of the numpy search alone on a state that returns fixed logits. Run it
with two trees (before and after a change to the search) on bundles of one checkpoint, to see that a new
decoding control costs nothing when it is not used.

    PYTHONPATH=TREE python benchmarks/default_step_cost.py BUNDLE [--steps 32] [--repeat 60]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from runtime.bundle import load_bundle
from runtime.generate import generate_ids
from runtime.search import SearchOptions, greedy

TEXTS = ["12 March 2019", "march 3rd, 2001", "Sat 5 Jan 1999", "2020-01-02", "the 4th of july 1976", "1 1 2000",
         "dec 31 1999", "June 6, 1944"]


class Fixed:
    """A decoder state that returns the same random logits every step: the search's own work, no model."""

    def __init__(self, rows: int, vocab: int):
        self.logits = np.random.default_rng(0).normal(size=(rows, vocab)).astype(np.float32)

    def step(self, tokens, keep):
        return self.logits[:len(tokens)].copy()


def per_step(run, repeat: int, steps: int, scale: float) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        run()
        times.append((time.process_time() - start) / steps * scale)
    return float(np.min(times)), float(np.percentile(times, 25))


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
        low, p25 = per_step(lambda: generate_ids(engine, seqs[:batch], opts), args.repeat, args.steps, 1e3)
        print(f"| bundle step, CPU ms | {batch} | {low:.4f} | {p25:.4f} |")
    for batch in (1, 8):
        low, p25 = per_step(lambda: greedy(Fixed(batch, engine.vocab_size), batch, engine.bos_id, engine.eos_id,
                                           opts), args.repeat * 3, args.steps, 1e6)
        print(f"| search alone, CPU us | {batch} | {low:.2f} | {p25:.2f} |")


if __name__ == "__main__":
    main()
