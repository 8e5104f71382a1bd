"""Benchmarks: every engine does the same work, interleaved, each measured in its own worker process.

    report = run_bench(["ckpt", "bundle-fp32", "bundle-int8"], BenchSettings(batch_sizes=(1, 8)))

Engines: a checkpoint gives PyTorch eager with KV cache ("torch-cache") and recomputing the prefix
("torch-nocache"); a bundle gives ONNX Runtime on its provider ("cpu", "cuda"), whatever precision and
fusions it holds. Every engine generates exactly `new_tokens` greedy tokens (EOS suppressed) for the same
seeded random source batch.

How it measures:
- Each engine lives in a worker subprocess (`python -m toolkit.apps.bench`), so its memory is its own.
  Peak memory: the worker resets the kernel's high-water mark (/proc/self/clear_refs) when a batch size
  starts and reads VmHWM when it ends (ru_maxrss, never reset, where /proc is unavailable; batch sizes run in
  ascending order). peak_rss_mb is the whole worker (interpreter and libraries included); rss_growth_mb is
  that peak minus the worker's RSS before it loaded the model.
- The parent runs workers one at a time, A B C A B C ..., after warm-up, so engines never compete for cores
  and drift in machine load spreads over all of them. Timing happens inside the worker (no IPC counted):
  the call (encoder + search), the encoder (engine.start) and every decoder step (state.step) separately.
- Roofline: a decode step must at least read the weights it touches (bytes / bandwidth) and do its
  multiply-adds (FLOPs / GEMM throughput), both measured on this machine in the same run. The bound is the
  larger ("memory" or "compute"); roofline_fraction = bound time / measured engine step time. Weights are
  counted in their stored precision (int8 bundles read ~4x fewer bytes); the compute roof is float32 GEMM
  for every engine, so an int8 engine that is compute-bound can exceed a fraction of 1.

The package, one job a file:
    settings.py   BenchSettings, and what the parent reads about each MODEL (ModelInfo, weight bytes)
    probe.py      worker-side measurement: machine bandwidth and GEMM, memory peaks, timed calls
    worker.py     the worker protocol: the subprocess's command loop and the parent's Worker handle
    runner.py     orchestration: engines planned, workers started, interleaved rounds (run_bench)
    report.py     the JSON report's rows and step profile, roofline, the printed tables
"""

from __future__ import annotations

from toolkit.apps.bench.report import print_tables
from toolkit.apps.bench.runner import run_bench
from toolkit.apps.bench.settings import BenchSettings
from toolkit.apps.bench.worker import BenchError

__all__ = ["BenchSettings", "BenchError", "run_bench", "print_tables"]
