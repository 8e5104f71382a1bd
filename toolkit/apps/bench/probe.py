"""Measuring inside a worker: the machine's memory bandwidth and GEMM throughput, memory peaks, and timed calls."""

from __future__ import annotations

import gc
import os
import platform
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from runtime.request import Request
from runtime.search import SearchOptions, search


def rss_bytes() -> int:
    """Current resident set size (0 where /proc is unavailable)."""
    return _proc_status("VmRSS") or 0


def reset_peak() -> bool:
    """Reset this process's peak-RSS mark to its current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak RSS since the last reset (VmHWM), else since the process started (ru_maxrss)."""
    hwm = _proc_status("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def probe_machine(threads: int, mib: int = 256, gemm_n: int = 1024) -> dict:
    """Memory read bandwidth (best of threaded max-reductions and BLAS dot, GB/s) and float32 GEMM GFLOP/s.
    Run in a worker whose BLAS was started with `threads` threads."""
    data = np.ones(mib << 18, dtype=np.float32)                       # mib MiB, far beyond caches
    chunks = np.array_split(data, threads)
    with ThreadPoolExecutor(threads) as pool:
        reduce_s = _best(lambda: list(pool.map(np.max, chunks)), 5)
        dot_s = _best(lambda: list(pool.map(lambda c: np.dot(c, c), chunks)), 5)
    a = np.random.default_rng(0).random((gemm_n, gemm_n), dtype=np.float32)
    a @ a
    gemm_s = _best(lambda: a @ a, 5)
    reads = {"max_reduce": data.nbytes / reduce_s / 1e9, "dot": data.nbytes / dot_s / 1e9}
    return {"bandwidth_gbs": round(max(reads.values()), 2),
            "bandwidth_detail": {k: round(v, 2) for k, v in reads.items()},
            "gemm_gflops": round(2 * gemm_n ** 3 / gemm_s / 1e9, 2), "gemm_n": gemm_n, "probe_mib": mib,
            "probe_threads": threads, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
            "numpy": np.__version__}


class TimedState:
    """Wraps a DecodeState and records how long each step takes."""

    def __init__(self, state):
        self.state, self.times = state, []

    def step(self, tokens, keep):
        t = time.perf_counter()
        logits = self.state.step(tokens, keep)
        self.times.append(time.perf_counter() - t)
        return logits


def timed_generate(engine, ids: np.ndarray, new_tokens: int, sync=None) -> dict:
    """One greedy call of exactly new_tokens tokens per input: total, encoder and per-step seconds."""
    opts = SearchOptions(max_new_tokens=new_tokens, ignore_eos=True)
    Request.build(engine, ids.tolist(), None, opts)         # refuses what the engine cannot serve, before timing
    mask = np.ones_like(ids)
    gc.collect()
    t0 = time.perf_counter()
    state = engine.start(ids, mask, 1, new_tokens)
    if sync:
        sync()                                          # CUDA torch: the encoder really finished
    t1 = time.perf_counter()
    timed = TimedState(state)
    hyps = search(timed, len(ids), engine.bos_id, engine.eos_id, opts)
    t2 = time.perf_counter()
    return {"latency": t2 - t0, "encode": t1 - t0, "steps": timed.times,
            "tokens": [len(h[0].tokens) for h in hyps]}


def torch_step_weight_bytes(model) -> int:
    """Bytes of the parameters a decode step reads: the decoder (minus the cross-attention key/value
    projections, which run once in encode) plus the output projection."""
    skip = (".cross_attn.k_proj.", ".cross_attn.v_proj.")
    total = sum(p.numel() * p.element_size() for n, p in model.decoder.named_parameters()
                if not any(s in f".{n}" for s in skip))
    out = model.embed.lut.weight if model.config.tie_embeddings else model.generator.proj.weight
    return total + out.numel() * out.element_size()
