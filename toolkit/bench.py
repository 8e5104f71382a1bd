"""Benchmarks: every engine does the same work, interleaved, each measured in its own worker process.

    report = run_bench(["ckpt", "bundle-fp32", "bundle-int8"], BenchSettings(batch_sizes=(1, 8)))

Engines: a checkpoint gives PyTorch eager with KV cache ("torch-cache") and recomputing the prefix
("torch-nocache"); a bundle gives ONNX Runtime on its provider ("cpu", "cuda"), whatever precision and
fusions it holds. Every engine generates exactly `new_tokens` greedy tokens (EOS suppressed) for the same
seeded random source batch.

How it measures:
- Each engine lives in a worker subprocess (`python -m toolkit.bench --worker`), so its memory is its own.
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
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from runtime.errors import InputError, OnnxformerError
from runtime.generate import check_request
from runtime.search import SearchOptions, search
from runtime.session import PROVIDER_CHOICES

FIRST_TOKEN = 3                 # ids 0-2 are pad, bos, eos: random sources use [3, vocab)
PROFILE_PASTS = (8, 256)        # step-profile past lengths (clipped to the model's max_len - 1)
PROFILE_WINDOW = 2              # a past length's step time is the median over steps past +- 2
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


# Engines run in separate worker processes on few cores: after a call, ORT's and OpenMP's thread pools spin
# for a while before sleeping, and would steal the cores of the next engine's call. A short idle gap first.
SETTLE_S = 0.05

@dataclass(frozen=True)
class BenchSettings:
    """Everything that defines a benchmark run (recorded verbatim in the report)."""

    batch_sizes: tuple[int, ...] = (1, 8)
    src_len: int = 32               # source tokens per input (no padding)
    new_tokens: int = 64            # generated tokens per input, exactly
    provider: str = "auto"          # auto | cpu | cuda
    threads: int | None = None      # torch and ORT intra-op threads; None = os.cpu_count()
    repeat: int = 5                 # timed rounds (one call per engine per round)
    warmup: int = 1                 # untimed rounds first
    nocache: bool = True            # also measure torch-nocache for checkpoints
    step_profile: bool = False      # also time single steps at PROFILE_PASTS (batch 1, cached engines)
    seed: int = 0                   # source batch seed

    def resolved(self) -> "BenchSettings":
        """Defaults filled in (threads) and batch sizes sorted, so peaks grow monotonically."""
        threads = self.threads or os.cpu_count() or 1
        return BenchSettings(**{**asdict(self), "threads": threads,
                                "batch_sizes": tuple(sorted(set(self.batch_sizes)))})

    def validate(self) -> None:
        if not self.batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise InputError(f"batch sizes must be positive integers, got {list(self.batch_sizes)}; e.g. --batch-sizes 1,8")
        for name in ("src_len", "new_tokens", "repeat"):
            if getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise InputError(f"warmup must be 0 or more, got {self.warmup}")
        if self.threads is not None and self.threads < 1:
            raise InputError(f"threads must be at least 1, got {self.threads}")
        if self.provider not in PROVIDER_CHOICES:
            raise InputError(f"unknown provider {self.provider!r}; choose one of: {', '.join(PROVIDER_CHOICES)}")


# ------------------------------------------------------------------------------------- models (parent side)

@dataclass
class ModelInfo:
    """What the parent knows about a MODEL without loading it (no torch needed)."""

    path: str
    kind: str                       # "checkpoint" | "bundle"
    config: dict                    # ModelConfig as a dict
    precision: str                  # fp32 | fp16 | int8
    fused: bool                     # any fusion rewrites applied (bundles)
    fusions: dict = field(default_factory=dict)
    model_bytes: int = 0            # all files in the directory
    weight_bytes: int | None = None  # decoder weights a step reads (bundles; checkpoints: measured by the worker)
    weight_source: str = ""
    kv_cache: str = "dynamic"       # bundles: the manifest's "static" | "dynamic"; PyTorch eager grows its cache


def describe_model(path: str | Path) -> ModelInfo:
    """Classify MODEL as checkpoint or bundle and read its config, precision and sizes."""
    from toolkit.engines import model_kind

    path = Path(path)
    kind = model_kind(path)
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    if kind == "bundle":
        from runtime.manifest import read_manifest

        manifest = read_manifest(path)
        fusions = {k: int(v) for k, v in (manifest.get("fusions") or {}).items()}
        weight_bytes, source = decoder_weight_bytes(path, manifest)
        return ModelInfo(str(path), kind, manifest["model"], manifest["precision"], sum(fusions.values()) > 0,
                         fusions, size, weight_bytes, source, manifest.get("kv_cache", "dynamic"))
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path / 'config.json'} is not valid JSON ({exc}); re-save the checkpoint") from None
    return ModelInfo(str(path), kind, config, "fp32", False, {}, size, None, "")


def decoder_weight_bytes(bundle: Path, manifest: dict) -> tuple[int, str]:
    """Bytes of decoder weights one step reads: initializers and constants, except embedding tables only
    gathered from (a lookup reads one row). Without the onnx package: the decoder file size."""
    decoder = bundle / manifest["graphs"]["decoder"]["file"]
    try:
        import onnx
        from onnx import helper
    except ImportError:
        extra = sum(p.stat().st_size for p in bundle.glob(decoder.name + "*.data"))
        return decoder.stat().st_size + extra, "decoder file size"
    graph = onnx.load(str(decoder), load_external_data=False).graph
    users: dict[str, set] = {}
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, set()).add(node.op_type)
    tensors = [(t.name, t) for t in graph.initializer]
    tensors += [(n.output[0], a.t) for n in graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    total = 0
    for name, t in tensors:
        if users.get(name) == {"Gather"}:
            continue
        total += math.prod(t.dims) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total, "decoder initializers (embedding lookups excluded)"


def step_flops(config: dict, batch: int, past: float, src_len: int) -> float:
    """FLOPs of one decode step: projections, FFN, output layer, and attention over past + 1 and src_len keys."""
    d, f, layers, vocab = config["d_model"], config["d_ff"], config["n_decoder_layers"], config["vocab_size"]
    macs = layers * (4 * d * d + 2 * d * d + 2 * d * f) + vocab * d   # self q,k,v,o; cross q,o; FFN; output
    macs += layers * (2 * d * (past + 1) + 2 * d * src_len)           # scores and weighted sums
    return 2.0 * batch * macs


def step_cache_bytes(config: dict, batch: int, past: float, src_len: int) -> float:
    """Bytes of float32 self- and cross-attention keys and values one decode step reads."""
    return config["n_decoder_layers"] * 2 * batch * config["d_model"] * (past + src_len) * 4.0


def roofline(config: dict, weight_bytes: int, batch: int, past: float, src_len: int, step_s: float,
             machine: dict) -> dict:
    """The larger of the memory and compute bounds of a step, and the measured step's fraction of it."""
    mem_s = (weight_bytes + step_cache_bytes(config, batch, past, src_len)) / (machine["bandwidth_gbs"] * 1e9)
    cmp_s = step_flops(config, batch, past, src_len) / (machine["gemm_gflops"] * 1e9)
    bound, bound_s = ("memory", mem_s) if mem_s >= cmp_s else ("compute", cmp_s)
    return {"roofline_bound": bound, "bound_ms": round(bound_s * 1e3, 4),
            "roofline_fraction": round(bound_s / step_s, 4) if step_s > 0 else None}


# ------------------------------------------------------------------------------- probes (worker side)

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


# ------------------------------------------------------------------------------- timing (worker side)

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
    check_request(ids.tolist(), opts, engine.vocab_size, engine.max_len)
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


class WorkerSide:
    """The worker's state: at most one engine, and the commands the parent sends."""

    def __init__(self):
        self.opened, self.sync = None, None

    def handle(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op == "probe":
            return probe_machine(cmd["threads"])
        if op == "load":
            return self.load(cmd)
        if op == "phase":
            return {"reset": reset_peak()}
        if op == "run":
            ids = np.asarray(cmd["ids"], dtype=np.int64)
            out = timed_generate(self.opened.engine, ids, cmd["new_tokens"], self.sync)
            if not cmd.get("all_steps"):
                out["step_sum"], out["steps"] = sum(out["steps"]), len(out["steps"])
            out["peak_rss"] = peak_rss_bytes()
            return out
        raise ValueError(f"unknown worker command {op!r}")

    def load(self, cmd: dict) -> dict:
        from toolkit.engines import open_model

        before = rss_bytes()
        self.opened = open_model(cmd["path"], provider=cmd["provider"], threads=cmd["threads"],
                                 use_cache=cmd["use_cache"])
        versions = {"numpy": np.__version__}
        reply = {"rss_before_load": before, "provider": self.opened.provider}
        if self.opened.kind == "checkpoint":
            import torch

            engine = self.opened.engine
            versions["torch"] = torch.__version__
            reply.update(engine=engine.name, weight_bytes=torch_step_weight_bytes(engine.model),
                         weight_source="parameters of decoder step + output projection",
                         torch_threads=torch.get_num_threads())
            if engine.device == "cuda":
                self.sync = torch.cuda.synchronize
        else:
            import onnxruntime

            versions["onnxruntime"] = onnxruntime.__version__
            reply["engine"] = self.opened.provider
        reply["rss_after_load"] = rss_bytes()
        reply["versions"] = versions
        reply["torch_loaded"] = "torch" in sys.modules      # bundles run without it
        return reply


def worker_main() -> None:
    """Serve JSON-line commands on stdin; replies go to the original stdout, everything else to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    side = WorkerSide()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            reply = side.handle(cmd)
        except OnnxformerError as exc:
            reply = {"error": str(exc), "user": True, "exit_code": exc.exit_code}
        except Exception:  # report it to the parent with its traceback
            reply = {"error": traceback.format_exc(), "user": False}
        proto.write(json.dumps(reply) + "\n")


# ------------------------------------------------------------------------------ workers (parent side)

class BenchError(OnnxformerError):
    """A benchmark that cannot run as asked (the message comes from the engine's worker)."""


class Worker:
    """A worker subprocess; `call` sends one command and returns its reply."""

    def __init__(self, label: str, threads: int):
        self.label = label
        env = dict(os.environ, **{var: str(threads) for var in THREAD_VARS})
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "toolkit.bench", "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)

    def send(self, **cmd) -> None:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass                                    # receive() reports the dead worker with its log

    def call(self, **cmd) -> dict:
        self.send(**cmd)
        return self.receive()

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"benchmark worker for {self.label} died (exit code {self.proc.returncode}):\n"
                               f"{self._log_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            if reply.get("user"):
                err = BenchError(f"{self.label}: {reply['error']}")
                err.exit_code = reply.get("exit_code", 2)
                raise err
            raise RuntimeError(f"benchmark worker for {self.label} failed:\n{reply['error']}")
        return reply

    def _log_tail(self, chars: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read()[-chars:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


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
    vocab = min(info.config["vocab_size"] for info in infos)
    rng = np.random.default_rng(s.seed)
    return rng.integers(FIRST_TOKEN, vocab, size=(max(s.batch_sizes), s.src_len), dtype=np.int64)


def profile_plan(config: dict) -> tuple[int, list[int]]:
    """Tokens to generate and the past lengths to read for the step profile of a model."""
    new_tokens = min(max(PROFILE_PASTS) + 1, config["max_len"])
    return new_tokens, sorted({min(p, new_tokens - 1) for p in PROFILE_PASTS})


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


# ---------------------------------------------------------------------------------------------- report

def build_report(s: BenchSettings, machine: dict, infos: list[ModelInfo], runs: list[EngineRun],
                 profiled: list[EngineRun]) -> dict:
    """The JSON report: exact settings, machine probe, one row per engine and batch size, step profile."""
    rows = []
    for batch in s.batch_sizes:
        for run in runs:
            rows.append(engine_row(s, machine, run, batch))
    for batch in s.batch_sizes:
        first = next(r for r in rows if r["batch_size"] == batch)
        for row in rows:
            if row["batch_size"] == batch:
                row["ratio_to_first"] = round(row["tokens_per_s"] / first["tokens_per_s"], 3)
    versions = {}
    for run in runs:
        versions.update(run.loaded.get("versions", {}))
    report = {"settings": {**asdict(s), "batch_sizes": list(s.batch_sizes), "first_token_id": FIRST_TOKEN,
                           "search": "greedy, EOS suppressed (ignore_eos)", "order": "interleaved rounds"},
              "machine": machine, "versions": versions,
              "models": [{k: v for k, v in asdict(i).items() if k != "config"} | {"config": i.config} for i in infos],
              "rows": rows}
    if profiled:
        report["step_profile"] = [profile_row(run) for run in profiled]
    return report


def engine_row(s: BenchSettings, machine: dict, run: EngineRun, batch: int) -> dict:
    """Statistics of one engine at one batch size."""
    calls = run.calls[batch]
    lat = np.array([c["latency"] for c in calls])
    enc = np.array([c["encode"] for c in calls])
    step = np.array([c["step_sum"] / c["steps"] for c in calls])
    loop = (lat - enc) / s.new_tokens - step                    # search's own work per step (argmax, bookkeeping)
    tokens = [t for c in calls for t in c["tokens"]]
    p50 = float(np.median(lat))
    past = (s.new_tokens - 1) / 2                               # average past length over the call
    info = run.info
    row = {"model": info.path, "label": Path(info.path).name, "kind": info.kind, "engine": run.name,
           "provider": run.loaded.get("provider"), "precision": info.precision, "fused": info.fused,
           "kv_cache": kv_cache(run), "batch_size": batch, "src_len": s.src_len, "new_tokens": s.new_tokens,
           "tokens_generated": min(tokens), "tokens_generated_max": max(tokens),
           "tokens_per_s": round(batch * s.new_tokens / p50, 2),
           "latency_ms_p50": round(p50 * 1e3, 3), "latency_ms_p90": round(float(np.percentile(lat, 90)) * 1e3, 3),
           "encoder_ms": round(float(np.median(enc)) * 1e3, 3), "step_ms": round(float(np.median(step)) * 1e3, 4),
           "search_ms_per_step": round(float(np.median(loop)) * 1e3, 4),
           "peak_rss_mb": round(run.peaks[batch] / 2**20, 1),
           "rss_growth_mb": round((run.peaks[batch] - run.loaded["rss_before_load"]) / 2**20, 1),
           "model_mb": round(info.model_bytes / 2**20, 2), "weight_mb_per_step": round(run.weight_bytes / 2**20, 2),
           "weight_source": info.weight_source or run.loaded.get("weight_source", ""),
           "torch_loaded": run.loaded.get("torch_loaded"), "rounds": len(calls)}
    row.update(roofline(info.config, run.weight_bytes, batch, past, s.src_len, float(np.median(step)), machine))
    return row


def kv_cache(run: EngineRun) -> str:
    """How the engine keeps its self-attention cache: static (in place), dynamic (grown each step), none."""
    return run.info.kv_cache if run.use_cache else "none"


def profile_row(run: EngineRun) -> dict:
    """Median engine step time at each profiled past length (batch 1), and the longest over the shortest."""
    new_tokens, pasts = profile_plan(run.info.config)
    at = {}
    for past in pasts:
        lo, hi = max(1, past - PROFILE_WINDOW), min(new_tokens - 1, past + PROFILE_WINDOW)
        at[str(past)] = round(float(np.median([t for c in run.profile for t in c["steps"][lo:hi + 1]])) * 1e3, 4)
    first, last = at[str(pasts[0])], at[str(pasts[-1])]
    return {"model": run.info.path, "label": Path(run.info.path).name, "engine": run.name,
            "precision": run.info.precision, "fused": run.info.fused, "kv_cache": kv_cache(run), "batch_size": 1,
            "new_tokens": new_tokens, "step_ms_at_past": at, "window": PROFILE_WINDOW,
            "ratio": round(last / first, 3), "target_ratio": 1.15, "rounds": len(run.profile)}


TABLE_COLUMNS = ("model", "engine", "prec", "fused", "cache", "batch", "tok/s", "p50 ms", "p90 ms", "enc ms", "step ms",
                 "roofline", "peak MB", "size MB", "ratio")


def table_rows(report: dict) -> list[tuple[str, ...]]:
    """The report's rows as strings, in TABLE_COLUMNS order."""
    out = []
    for r in report["rows"]:
        frac = r["roofline_fraction"]
        roof = f"{frac * 100:.0f}% {r['roofline_bound'][:3]}" if frac is not None else "-"
        out.append((r["label"], r["engine"], r["precision"], "yes" if r["fused"] else "no", r.get("kv_cache", "-"),
                    str(r["batch_size"]),
                    f"{r['tokens_per_s']:.1f}", f"{r['latency_ms_p50']:.1f}", f"{r['latency_ms_p90']:.1f}",
                    f"{r['encoder_ms']:.2f}", f"{r['step_ms']:.2f}", roof, f"{r['peak_rss_mb']:.0f}",
                    f"{r['model_mb']:.1f}", f"{r['ratio_to_first']:.2f}x"))
    return out


PROFILE_COLUMNS = ("model", "engine", "prec", "fused", "cache", "step ms by past length", "ratio", "target")


def profile_table_rows(report: dict) -> list[tuple[str, ...]]:
    out = []
    for p in report.get("step_profile", []):
        at = ", ".join(f"{k}: {v:.2f}" for k, v in p["step_ms_at_past"].items())
        out.append((p["label"], p["engine"], p["precision"], "yes" if p["fused"] else "no", p.get("kv_cache", "-"), at,
                    f"{p['ratio']:.2f}x", f"<= {p['target_ratio']:.2f}x"))
    return out


def machine_line(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    return (f"machine: {m['cpu_count']} CPUs, read bandwidth {m['bandwidth_gbs']:.1f} GB/s, float32 GEMM "
            f"{m['gemm_gflops']:.1f} GFLOP/s ({m['probe_threads']} threads); {s['threads']} threads, "
            f"src_len {s['src_len']}, new_tokens {s['new_tokens']}, {s['repeat']} rounds after {s['warmup']} warm-up")




def print_tables(report: dict) -> None:
    """The benchmark table (and the step profile), with rich when installed."""
    tables = [(TABLE_COLUMNS, table_rows(report), "onnxformer bench")]
    if report.get("step_profile"):
        tables.append((PROFILE_COLUMNS, profile_table_rows(report), "decode step time vs past length (batch 1)"))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for columns, rows, title in tables:
            widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
            print(title)
            for line in (columns, *rows):
                print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        print(machine_line(report))
        return
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160)
    for columns, rows, title in tables:
        table = Table(title=title, title_justify="left")
        for i, name in enumerate(columns):
            table.add_column(name, justify="left" if i < 2 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    console.print(machine_line(report) + "; roofline: share of the memory (mem) or compute (com) bound",
                  highlight=False)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    worker_main()
