"""CPU time of decoding, which other processes on the machine hardly change: one intra-op thread, EOS ignored.

    python benchmarks/cpu_time_per_token.py BUNDLE... [--new-tokens 64] [--rounds 5] [--src-len 24] [--batch 1]

For each bundle (interleaved, round by round): the process CPU time of one greedy request (encoder once, then
exactly --new-tokens decoder steps), the best of --rounds; also the resident memory after it. Also a request of one
new token, in the same rounds: (T(new_tokens) - T(1)) / (new_tokens - 1) is the decoder step alone, and T(1) the
encoder plus the first step. Wall clock on a shared 2-core machine moves with the neighbours' load; with one
thread, CPU time measures the work.
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
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    bundles = {path: load_bundle(path, provider="cpu", threads=1) for path in args.bundles}
    vocab = next(iter(bundles.values())).manifest["model"]["vocab_size"]
    rng = random.Random(1)
    seqs = [[rng.randrange(3, vocab) for _ in range(args.src_len)] for _ in range(args.batch)]
    runs = {n: SearchOptions(max_new_tokens=n, ignore_eos=True) for n in (args.new_tokens, 1)}
    best = {(path, n): float("inf") for path in bundles for n in runs}
    for path, bundle in bundles.items():                      # warm-up
        generate_ids(bundle.engine, seqs, runs[args.new_tokens])
    for _ in range(args.rounds):
        for path, bundle in bundles.items():
            for n, opts in runs.items():
                t = time.process_time()
                generate_ids(bundle.engine, seqs, opts)
                best[path, n] = min(best[path, n], time.process_time() - t)
    first = next(iter(bundles))
    step = {path: (best[path, args.new_tokens] - best[path, 1]) / max(1, args.new_tokens - 1) for path in bundles}
    print(f"{'bundle':<40} {'CPU ms / request':>17} {'ms / token':>11} {'ratio':>6} {'step ms':>8} {'ratio':>6} "
          f"{'enc+1 ms':>9}")
    for path in bundles:
        seconds = best[path, args.new_tokens]
        print(f"{path:<40} {seconds * 1e3:>17.1f} {seconds * 1e3 / args.new_tokens:>11.3f} "
              f"{seconds / best[first, args.new_tokens]:>6.3f} {step[path] * 1e3:>8.3f} {step[path] / step[first]:>6.3f} "
              f"{best[path, 1] * 1e3:>9.2f}")
    print(f"(batch {args.batch}, {args.src_len} source tokens, {args.new_tokens} new tokens, 1 thread, best of "
          f"{args.rounds}; step = (T({args.new_tokens}) - T(1)) / {args.new_tokens - 1}; peak RSS of this process "
          f"with all bundles loaded: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
