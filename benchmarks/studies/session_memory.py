"""A race worker's peak memory under onnxruntime's CPU memory arena and memory patterns, one process per setting.

    .venv/bin/python benchmarks/studies/session_memory.py BUNDLE SPEC [--settings on,arena-off,lean] [--runs 1]

BUNDLE is an onnxformer bundle, SPEC a race spec that benchmarks/race_peers.py wrote beside it
(race-spec-onnxformer-*.json: the inputs, batch sizes, new tokens, threads). Each setting runs in a fresh process
what benchmarks/peer_worker.py runs (the token pass over all inputs at once, then warm-up and timed rounds per
batch size) and prints VmRSS and VmHWM (MiB) after each part, and each round's milliseconds:

    on         the CPU memory arena and memory patterns on (onnxruntime's defaults; the runtime's before 2026-12-05)
    arena-off  the arena off, memory patterns on
    lean       both off (runtime.session.SessionConfig's defaults now)

--runs repeats every setting that many times (glibc's heap makes a process's peak vary from run to run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"on": (True, True), "arena-off": (False, True), "lean": (False, False)}   # (arena, pattern)


def worker(bundle: str, spec_file: str, setting: str) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    from optimize_memory import rss
    from peer_worker import batches

    from runtime.bundle import load_bundle
    from runtime.generate import generate_ids
    from runtime.search import SearchOptions
    from runtime.session import SessionConfig

    arena, pattern = SETTINGS[setting]
    spec = json.loads(Path(spec_file).read_text())
    config = SessionConfig(cpu_memory_arena=arena, memory_pattern=pattern)
    engine = load_bundle(bundle, "cpu", session_options=config, threads=spec["threads"]).engine
    opts = SearchOptions(max_new_tokens=spec["max_new_tokens"], beam=spec["beam"],
                         ignore_eos=spec["min_new_tokens"] >= spec["max_new_tokens"])
    inputs = spec["inputs"]

    def report(part: str, rounds=()) -> None:
        mem = rss(("VmRSS", "VmHWM"), unit=1024 ** 2)
        print(f"{setting:<10} {part:<12} {mem['VmRSS']:>8.0f} {mem['VmHWM']:>8.0f}   "
              + " ".join(f"{r * 1e3:.0f}" for r in rounds), flush=True)

    report("loaded")
    for chunk in batches(inputs, 64):
        generate_ids(engine, chunk, opts)
    report("token pass")
    for b in spec["batch_sizes"]:
        rounds = []
        for _ in range(spec["warmup"] + spec["repeat"]):
            start = time.perf_counter()
            generate_ids(engine, inputs[:b], opts)
            rounds.append(time.perf_counter() - start)
        report(f"batch {b}", rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("spec")
    ap.add_argument("--settings", default="on,arena-off,lean")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.bundle, args.spec, args.worker)
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        ap.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    print(f"{'setting':<10} {'after':<12} {'VmRSS':>8} {'VmHWM':>8}   round ms (warm-up first)   (MiB)")
    for _ in range(args.runs):
        for setting in settings:
            subprocess.run([sys.executable, __file__, args.bundle, args.spec, "--worker", setting], check=True)


if __name__ == "__main__":
    main()
