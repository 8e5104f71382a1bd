"""The worker protocol: one engine per subprocess (`python -m toolkit.apps.bench`), JSON lines both ways.

    worker = Worker("label", threads)         # the parent's handle
    reply = worker.call(op="load", path=..., provider=..., threads=..., use_cache=True)
    reply = worker.call(op="run", ids=[[...]], new_tokens=64)      # {"latency", "encode", "steps", ...}

Commands: probe (machine), load (open one model), phase (reset the memory peak), run (one timed call), quit.
A user error in the worker (OnnxformerError) comes back as BenchError with its exit code; anything else as a
RuntimeError with the worker's traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

from runtime.errors import OnnxformerError
from toolkit.apps.bench.probe import peak_rss_bytes, probe_machine, reset_peak, rss_bytes, timed_generate, torch_step_weight_bytes

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


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
        from toolkit.apps.engines import open_model

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


class BenchError(OnnxformerError):
    """A benchmark that cannot run as asked (the message comes from the engine's worker)."""


class Worker:
    """A worker subprocess; `call` sends one command and returns its reply."""

    def __init__(self, label: str, threads: int):
        self.label = label
        env = dict(os.environ, **{var: str(threads) for var in THREAD_VARS})
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "toolkit.apps.bench"], stdin=subprocess.PIPE,
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
