"""Per-step decode time of several bundles of one model, and where the time goes (ORT's profiler, per op type).

    python benchmarks/fusion_step_time.py unfused=out/base fused=out/base-fused int8=out/base-int8 --batches 1,8
    python benchmarks/fusion_step_time.py int8=out/base-int8 --batches 1 --profile out/profiles   # + op table

Each bundle is loaded as the runtime loads it (runtime.bundle.load_bundle: its engine, data path and session
options), the encoder runs once on a random source, then `--steps` one-token decoder steps with greedy tokens.
Bundles are measured in turn, round after round (`--rounds`), so load from other processes spreads evenly; a
cell is the median step time of the best round. `--profile DIR` also runs one decode per bundle and batch with
ORT's profiler on and prints, per op type, the kernel time per step and its share; "outside kernels" is the
measured step time minus the kernels' sum (ORT's executor, the binding or feeding, Python).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from runtime.bundle import load_bundle
from runtime.session import SessionConfig


class Decoder:
    """One bundle's engine and a greedy decode loop that records each step's time."""

    def __init__(self, bundle: Path, profile: str | None = None, threads: int = 0):
        options = SessionConfig(intra_op_threads=threads, profile_prefix=profile)
        self.bundle = load_bundle(bundle, "cpu", session_options=options)
        self.engine, self.config = self.bundle.engine, self.bundle.manifest["model"]

    def run(self, batch: int, src_len: int, steps: int, seed: int = 0) -> list[float]:
        rng = np.random.default_rng(seed)
        ids = rng.integers(3, self.config["vocab_size"], (batch, src_len)).astype(np.int64)
        state = self.engine.start(ids, np.ones_like(ids), 1)
        tokens = np.full(batch, self.config["bos_id"], dtype=np.int64)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            logits = state.step(tokens, None)
            times.append(time.perf_counter() - start)
            tokens = logits.argmax(-1).astype(np.int64)
        return times

    def end_profiling(self) -> str:
        self.engine.encoder.end_profiling()
        return self.engine.decoder.end_profiling()


def op_table(profile: str, skip: int, step_ms: float) -> list[tuple[str, float, float]]:
    """(part, ms per step, share of the step) from an ORT profile, over the decoder runs after the first `skip`
    (warm-up: arena growth, first-run costs): each op type's kernels (largest first), then ORT's own time
    around them (executor, memory planning) and the time outside ORT's run (binding, Python)."""
    events = json.loads(Path(profile).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[skip:]
    run_ms = sum(hi - lo for lo, hi in runs) / 1e3 / len(runs)
    per_op: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            if any(lo <= e["ts"] <= hi for lo, hi in runs):
                per_op[e["args"].get("op_name", "?")] += e["dur"] / 1e3 / len(runs)
    step_ms = max(step_ms, run_ms)
    rows = sorted(((op, ms, ms / step_ms) for op, ms in per_op.items()), key=lambda r: -r[1])
    executor = run_ms - sum(ms for _, ms, _ in rows)
    outside = step_ms - run_ms
    return rows + [("ORT executor around the kernels", executor, executor / step_ms),
                   ("outside ORT's run (binding, Python)", outside, outside / step_ms)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+", help="name=bundle_dir")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--src-len", type=int, default=24)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT's default)")
    parser.add_argument("--profile", type=Path, help="write ORT profiles of one decode run per bundle/batch here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    named = dict(b.split("=", 1) for b in args.bundles)
    batches = [int(b) for b in args.batches.split(",")]
    decoders = {name: Decoder(Path(path), threads=args.threads) for name, path in named.items()}
    for d in decoders.values():                                       # warm up every session and shape
        for b in batches:
            d.run(b, args.src_len, 4)
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for b in batches:
            for name, d in decoders.items():
                median = float(np.median(d.run(b, args.src_len, args.steps)[1:])) * 1e3
                best[(name, b)] = min(best.get((name, b), float("inf")), median)
    result = {"step_ms": {f"{n}@{b}": round(v, 3) for (n, b), v in best.items()}, "profiles": {}}
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        for name, path in named.items():
            for b in batches:
                d = Decoder(Path(path), str(args.profile / f"{name}_b{b}"), args.threads)
                for _ in range(2):                                    # warm-up, then the profiled decode
                    times = d.run(b, args.src_len, args.steps)
                step_ms = float(np.mean(times[1:])) * 1e3
                rows = op_table(d.end_profiling(), args.steps + 1, step_ms)
                result["profiled_step_ms"] = {**result.get("profiled_step_ms", {}), f"{name}@{b}": round(step_ms, 3)}
                result["profiles"][f"{name}@{b}"] = [{"op": op, "ms_per_step": round(ms, 4), "share": round(sh, 4)}
                                                     for op, ms, sh in rows]
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"median ms per decoder step (best of {args.rounds} rounds; src_len {args.src_len}, "
          f"{args.steps} steps, past 1..{args.steps}, intra-op threads {args.threads or 'default'})")
    print(f"{'bundle':<16}" + "".join(f"{'batch ' + str(b):>12}" for b in batches))
    for name in decoders:
        print(f"{name:<16}" + "".join(f"{best[(name, b)]:>12.3f}" for b in batches))
    for key, rows in result["profiles"].items():
        print(f"\n{key}: step {result['profiled_step_ms'][key]:.3f} ms with the profiler on "
              f"({result['step_ms'][key]:.3f} ms off)\n| op | ms/step | share |\n|---|---|---|")
        for r in rows[:8] + rows[-2:]:
            print(f"| {r['op']} | {r['ms_per_step']:.3f} | {r['share']:.0%} |")


if __name__ == "__main__":
    main()
