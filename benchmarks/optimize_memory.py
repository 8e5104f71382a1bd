"""Where `onnxformer optimize`'s resident memory goes: anonymous and file-backed RSS, sampled every 50 ms, by phase.

    .venv/bin/python benchmarks/optimize_memory.py EXPORTED_BUNDLE OUT_DIR [--precision fp32|int8]

The phases are the optimize steps (transform: load and fuse; the gate: its graph comparison, its engines and its
token check; write: the bundle's files), marked by wrapping those functions in this process. Each row gives the
largest VmRSS, RssAnon (heap: sessions' weights, prepacked matrices, arrays) and RssFile (mapped file pages, such
as weights.data read in place) seen while that phase ran; "X >" is a phase running, "X <" what follows its end.
OUT_DIR must not exist (optimize refuses an existing one). The bundle is written --allow-unverified: a random-weight
model's gate is often inconclusive, and memory is what is measured here.
"""

from __future__ import annotations

import argparse
import functools
import threading
import time

FIELDS = ("VmRSS", "RssAnon", "RssFile")


def rss(fields: tuple[str, ...] = FIELDS, unit: int = 1024 ** 3, pid: int | str = "self") -> dict[str, float]:
    """A process's resident memory by kind (/proc/PID/status `fields`; this one's by default), in `unit` bytes
    (GiB)."""
    out = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in fields:
                out[key] = int(value.split()[0]) * 1024 / unit
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("out")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "int8"))
    args = parser.parse_args()

    import exporters.optimize as optimize
    import toolkit.parity.gate as gate

    phase, samples, done = ["start"], [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((phase[-1], rss()))
            time.sleep(0.05)

    def mark(module, name: str, label: str) -> None:
        inner = getattr(module, name)

        @functools.wraps(inner)
        def wrapped(*a, **k):
            phase.append(f"{label} >")
            try:
                return inner(*a, **k)
            finally:
                phase.append(f"{label} <")

        setattr(module, name, wrapped)

    mark(optimize, "transform", "transform")
    mark(optimize, "write", "write")
    mark(gate, "bundle_parity", "gate: graphs")
    mark(gate, "engine", "gate: engine")
    mark(gate, "generation_parity", "gate: tokens")
    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    optimize.optimize_bundle(args.bundle, args.out, precision=args.precision, allow_unverified=True)
    done.set()
    print(f"optimize {args.precision}: {time.perf_counter() - start:.0f} s")
    peaks: dict[str, dict[str, float]] = {}
    for name, values in samples:
        row = peaks.setdefault(name, dict.fromkeys(FIELDS, 0.0))
        for key in FIELDS:
            row[key] = max(row[key], values.get(key, 0.0))
    print(f"| phase | RSS GiB | anonymous GiB | file-backed GiB |\n|---|---|---|---|")
    for name, row in peaks.items():                                   # dicts keep the phases' order
        print(f"| {name} | {row['VmRSS']:.2f} | {row['RssAnon']:.2f} | {row['RssFile']:.2f} |")


if __name__ == "__main__":
    main()
