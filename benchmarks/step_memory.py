"""A command's peak resident memory split by kind: anonymous (heap: tensors, sessions' weights, arrays) and
file-backed (mapped files that were read: safetensors weights, weights.data; pages the kernel can drop when memory
runs short, so they do not need memory of their own the way anonymous pages do).

    .venv/bin/python benchmarks/step_memory.py [--label NAME] -- COMMAND [ARGS...]

Samples /proc/PID/status every 50 ms while COMMAND runs and prints one line: its exit status, wall time, the peak
VmRSS (VmHWM, the kernel's own high-water mark) and the largest RssAnon and RssFile seen. Exits with COMMAND's
status. `/usr/bin/time -v` gives the same peak without the split.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from optimize_memory import rss  # noqa: E402  (this folder is on sys.path when run as a script)

FIELDS = ("VmHWM", "RssAnon", "RssFile")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default=None, help="the name printed first (default: the command)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command after --")
    peaks, start = dict.fromkeys(FIELDS, 0.0), time.perf_counter()
    child = subprocess.Popen(command)

    def sample() -> None:
        while child.poll() is None:
            try:
                for key, value in rss(FIELDS, pid=child.pid).items():
                    peaks[key] = max(peaks[key], value)
            except (OSError, ValueError):            # the process ended between poll and read
                return
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = child.wait()
    sampler.join()
    label = args.label or " ".join(command)[:80]
    print(f"{label}: exit {code}, {time.perf_counter() - start:.0f} s, peak RSS {peaks['VmHWM']:.2f} GiB "
          f"(anonymous at most {peaks['RssAnon']:.2f}, file-backed at most {peaks['RssFile']:.2f})", flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
