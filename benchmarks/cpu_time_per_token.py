"""CPU time of decoding, which other processes on the machine hardly change: one intra-op thread, EOS ignored.

    python benchmarks/cpu_time_per_token.py BUNDLE... [--new-tokens 64] [--rounds 5] [--src-len 24]

For each bundle (interleaved, round by round): the process CPU time of one greedy request at batch 1 (encoder
once, then exactly --new-tokens decoder steps), the best of --rounds; also the resident memory after it. Wall
clock on a shared 2-core machine moves with the neighbours' load; with one thread, CPU time measures the work.
"""

from __future__ import annotations

import argparse
import random
import resource
import time

from runtime.bundle import load_bundle
from runtime.generate import generate_ids
from runtime.search import SearchOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--src-len", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    bundles = {path: load_bundle(path, provider="cpu", threads=1) for path in args.bundles}
    vocab = next(iter(bundles.values())).manifest["model"]["vocab_size"]
    rng = random.Random(1)
    ids = [rng.randrange(3, vocab) for _ in range(args.src_len)]
    opts = SearchOptions(max_new_tokens=args.new_tokens, ignore_eos=True)
    best = {path: float("inf") for path in bundles}
    for path, bundle in bundles.items():                      # warm-up
        generate_ids(bundle.engine, [ids], opts)
    for _ in range(args.rounds):
        for path, bundle in bundles.items():
            t = time.process_time()
            generate_ids(bundle.engine, [ids], opts)
            best[path] = min(best[path], time.process_time() - t)
    first = next(iter(best.values()))
    print(f"{'bundle':<40} {'CPU ms / request':>17} {'ms / token':>11} {'ratio':>6}")
    for path, seconds in best.items():
        print(f"{path:<40} {seconds * 1e3:>17.1f} {seconds * 1e3 / args.new_tokens:>11.3f} {seconds / first:>6.3f}")
    print(f"(batch 1, {args.src_len} source tokens, {args.new_tokens} new tokens, 1 thread, best of {args.rounds}; "
          f"peak RSS of this process with all bundles loaded: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
