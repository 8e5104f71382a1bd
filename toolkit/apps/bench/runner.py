"""Orchestration: plan the engines, start their workers, run the interleaved rounds, hand the replies to the report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.errors import InputError
from toolkit.apps.bench.report import build_report
from toolkit.apps.bench.settings import FIRST_TOKEN, BenchSettings, ModelInfo, describe_model, profile_plan
from toolkit.apps.bench.worker import Worker

# Engines run in separate worker processes on few cores: after a call, ORT's and OpenMP's thread pools spin
# for a while before sleeping, and would steal the cores of the next engine's call. A short idle gap first.
SETTLE_S = 0.05


@dataclass
class EngineRun:
    """One engine under test: its model, worker, and what it reported when loaded."""

    info: ModelInfo
    use_cache: bool
    worker: Worker | None = None
    loaded: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)       # batch size -> list of run replies
    peaks: dict = field(default_factory=dict)       # batch size -> peak RSS bytes
    profile: list = field(default_factory=list)     # step-profile run replies

    @property
    def name(self) -> str:
        return self.loaded["engine"]

    @property
    def weight_bytes(self) -> int:
        return self.info.weight_bytes if self.info.weight_bytes is not None else self.loaded["weight_bytes"]


def plan_engines(infos: list[ModelInfo], nocache: bool) -> list[EngineRun]:
    """Checkpoints give torch-cache (and torch-nocache); bundles give their ONNX Runtime provider."""
    runs = []
    for info in infos:
        runs.append(EngineRun(info, True))
        if info.kind == "checkpoint" and nocache:
            runs.append(EngineRun(info, False))
    return runs


def check_sizes(infos: list[ModelInfo], s: BenchSettings) -> None:
    """Refuse settings some model cannot serve, before any worker starts."""
    for info in infos:
        max_len, vocab = info.config.get("max_len", 0), info.config.get("vocab_size", 0)
        if s.src_len > max_len or s.new_tokens > max_len:
            raise InputError(f"{info.path} serves at most {max_len} source and {max_len} new tokens; "
                             f"lower --src-len ({s.src_len}) or --new-tokens ({s.new_tokens})")
        if vocab <= FIRST_TOKEN:
            raise InputError(f"{info.path} has vocab_size {vocab}; random sources need ids >= {FIRST_TOKEN}")


def source_batch(infos: list[ModelInfo], s: BenchSettings) -> np.ndarray:
    """The one random source batch every engine gets [max batch, src_len]; batch b uses its first b rows."""
    vocab = min(info.config.get("src_vocab_size") or info.config["vocab_size"] for info in infos)   # source ids
    rng = np.random.default_rng(s.seed)
    return rng.integers(FIRST_TOKEN, vocab, size=(max(s.batch_sizes), s.src_len), dtype=np.int64)


def run_bench(models: list[str], settings: BenchSettings, progress=None) -> dict:
    """Benchmark every engine of every MODEL; returns the report (settings, machine, rows, step profile).
    progress(done, total, label) is called after every call a worker makes."""
    s = settings.resolved()
    s.validate()
    infos = [describe_model(m) for m in models]
    check_sizes(infos, s)
    runs = plan_engines(infos, s.nocache)
    profiled = [r for r in runs if r.use_cache] if s.step_profile else []
    total = 2 + len(runs) + len(s.batch_sizes) * (s.warmup + s.repeat) * len(runs) + s.repeat * len(profiled)
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total, label)

    src = source_batch(infos, s)
    probe = Worker("machine probe", s.threads)
    try:
        machine = probe.call(op="probe", threads=s.threads)
    finally:
        probe.close()
    tick("probed machine")
    try:
        for run in runs:                            # workers import and load side by side
            run.worker = Worker(f"{run.info.path} ({'cache' if run.use_cache else 'nocache'})", s.threads)
            run.worker.send(op="load", path=run.info.path, provider=s.provider, threads=s.threads,
                            use_cache=run.use_cache)
        for run in runs:
            run.loaded = run.worker.receive()
            run.worker.label = f"{run.info.path} [{run.name}]"
            tick(f"loaded {Path(run.info.path).name} [{run.name}]")
        for batch in s.batch_sizes:
            ids = src[:batch].tolist()
            for run in runs:
                run.worker.call(op="phase")
            for rnd in range(s.warmup + s.repeat):
                for run in runs:
                    time.sleep(SETTLE_S)            # let the previous engine's spinning threads go idle
                    reply = run.worker.call(op="run", ids=ids, new_tokens=s.new_tokens)
                    if rnd >= s.warmup:
                        run.calls.setdefault(batch, []).append(reply)
                    run.peaks[batch] = reply["peak_rss"]
                    what = "warm-up" if rnd < s.warmup else f"round {rnd - s.warmup + 1}/{s.repeat}"
                    tick(f"batch {batch} {what}: {Path(run.info.path).name} [{run.name}]")
        for rnd in range(s.repeat if profiled else 0):
            for run in profiled:
                time.sleep(SETTLE_S)
                new_tokens, _ = profile_plan(run.info.config)
                run.profile.append(run.worker.call(op="run", ids=src[:1].tolist(), new_tokens=new_tokens,
                                                   all_steps=True))
                tick(f"step profile round {rnd + 1}/{s.repeat}: {Path(run.info.path).name} [{run.name}]")
    finally:
        for run in runs:
            if run.worker:
                run.worker.close()
    return build_report(s, machine, infos, runs, profiled)
