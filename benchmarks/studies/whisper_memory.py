"""Where a Whisper race worker's memory goes: resident memory (VmRSS) and its peak (VmHWM) after each part of what
benchmarks/race_whisper.py's worker runs, one fresh process per engine / setting (MiB):

    .venv/bin/python benchmarks/studies/whisper_memory.py out/race-whisper/base [--precision int8] [--speed 7]

Parts: the imports, the model loaded, one 30 s encoder run, a 64-token decode, a 60 s transcribe (2 windows of 224
tokens, the end token ignored). Settings:

    onnxformer             the bundle as the race loads it (runtime.session.SessionConfig's defaults)
    onnxformer-noarena     the same with the audio encoder's arena off (SessionConfig(fixed_encoder_arena=False): the
                           runtime before 2026-12-07, its buffers from glibc's heap)
    onnxformer-noprepack   the same with onnxruntime's weight prepacking off (session.disable_prepacking): what the
                           prepacked copies of the MatMul weights hold
    faster-whisper         CTranslate2's model (faster-whisper's venv, out/peers-whisper)

--speed N instead times onnxformer and onnxformer-noarena, a fresh process each, alternated twice: the median of N
encoder runs and of N 64-token decodes after a warm-up (wall and CPU ms, minor page faults a run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def status() -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def transcriber(model: str, setting: str):
    """The bundle loaded for a setting (onnxformer, onnxformer-noarena, onnxformer-noprepack)."""
    from runtime import session
    from runtime.transcribe import Transcriber
    if setting.endswith("noprepack"):
        to_ort = session.SessionConfig.to_ort

        def lean(self):
            opts = to_ort(self)
            opts.add_session_config_entry("session.disable_prepacking", "1")
            return opts
        session.SessionConfig.to_ort = lean
    options = session.SessionConfig(fixed_encoder_arena=not setting.endswith("noarena"))
    return Transcriber(model, provider="cpu", threads=2, session_options=options)


def onnxformer_parts(model: str, setting: str):
    import dataclasses

    import race_whisper as race

    from runtime.generate import generate
    from runtime.request import Request
    yield "imports"
    tr = transcriber(model, setting)
    yield "loaded"
    features, samples = race.inputs(60)
    encoded = tr.encode(features[None])
    yield "encoder"
    prompt = tr.prompt("en", "transcribe", False)
    opts = dataclasses.replace(tr.options(prompt, False, max_new_tokens=64), ignore_eos=True)
    generate(tr.engine, Request.build(tr.engine, [features], None, opts), encoded=encoded)
    yield "decode 64"
    window_options = tr.options
    tr.options = lambda *a, **k: dataclasses.replace(window_options(*a, **k), ignore_eos=True)
    tr.transcribe(samples, language="en", beam=1, temperatures=(0.0,), compression_ratio_threshold=None,
                  logprob_threshold=None, no_speech_threshold=None, max_new_tokens=224)
    yield "transcribe 60 s"


def faster_whisper_parts(model: str, compute: str):
    import ctranslate2
    import numpy as np
    import race_whisper as race
    from faster_whisper import WhisperModel
    from faster_whisper.tokenizer import Tokenizer
    yield "imports"
    wm = WhisperModel(model, device="cpu", compute_type=compute, cpu_threads=2, num_workers=1)
    yield "loaded"
    features, samples = race.inputs(60)
    encoded = wm.model.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(features[None])), to_cpu=False)
    yield "encoder"
    tok = Tokenizer(wm.hf_tokenizer, wm.model.is_multilingual, task="transcribe", language="en")
    prompt = [*tok.sot_sequence, tok.no_timestamps]
    wm.model.generate(encoded, [prompt], beam_size=1, max_length=128, suppress_tokens=[tok.eot], suppress_blank=False)
    yield "decode 64"
    list(wm.transcribe(samples, language="en", beam_size=1, temperature=0.0, condition_on_previous_text=False,
                       without_timestamps=True, vad_filter=False, compression_ratio_threshold=None,
                       log_prob_threshold=None, no_speech_threshold=None, suppress_tokens=[-1, tok.eot],
                       max_new_tokens=2 * 224 - len(prompt))[0])
    yield "transcribe 60 s"


def worker(setting: str, model: str, compute: str) -> None:
    parts = faster_whisper_parts(model, compute) if setting == "faster-whisper" else onnxformer_parts(model, setting)
    print(json.dumps([(part, *status()) for part in parts]))


def speed_worker(setting: str, model: str, rounds: str) -> None:
    """Median (wall ms, CPU ms, minor faults) of `rounds` encoder runs and of as many 64-token decodes."""
    import dataclasses
    import resource
    import statistics
    import time

    import race_whisper as race

    from runtime.generate import generate
    from runtime.request import Request
    tr = transcriber(model, setting)
    features, _ = race.inputs(60)
    opts = dataclasses.replace(tr.options(tr.prompt("en", "transcribe", False), False, max_new_tokens=64),
                               ignore_eos=True)

    def measure(fn):
        rows = []
        for _ in range(int(rounds) + 1):                      # the first is the warm-up
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            out = fn()
            r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            rows.append(((t1 - t0) * 1e3, (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1e3,
                         r1.ru_minflt - r0.ru_minflt))
        return [statistics.median(c) for c in zip(*rows[1:])], out
    encoder, encoded = measure(lambda: tr.encode(features[None]))
    request = Request.build(tr.engine, [features], None, opts)
    decode, _ = measure(lambda: generate(tr.engine, request, encoded=encoded))
    print(json.dumps({"encoder": encoder, "decode": decode}))


def speed(shape_dir: Path, precision: str, rounds: int) -> None:
    model = shape_dir / f"onnxformer-{precision}"
    print("| setting | encoder wall / CPU ms, faults | decode 64 wall / CPU ms, faults |\n|---|---|---|")
    for setting in ("onnxformer-noarena", "onnxformer") * 2:
        out = subprocess.run([sys.executable, __file__, "--speed-worker", setting, str(model), str(rounds)],
                             check=True, capture_output=True, text=True, cwd=ROOT,
                             env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"})
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {setting} | " + " | ".join("{:.0f} / {:.0f}, {:.0f}".format(*r[k]) for k in ("encoder", "decode"))
              + " |")


def main() -> None:
    if sys.argv[1:2] in (["--worker"], ["--speed-worker"]):
        (worker if sys.argv[1] == "--worker" else speed_worker)(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape_dir", type=Path, help="a race_whisper.py shape folder (out/race-whisper/SHAPE)")
    ap.add_argument("--precision", choices=["fp32", "int8"], default="int8")
    ap.add_argument("--speed", type=int, metavar="N", help="time the arena on and off instead (N rounds)")
    args = ap.parse_args()
    if args.speed:
        speed(args.shape_dir, args.precision, args.speed)
        return
    fw_python = __import__("race_whisper").peer_python("faster-whisper")      # its venv, built on first use
    runs = [("onnxformer", sys.executable, args.shape_dir / f"onnxformer-{args.precision}"),
            ("onnxformer-noarena", sys.executable, args.shape_dir / f"onnxformer-{args.precision}"),
            ("onnxformer-noprepack", sys.executable, args.shape_dir / f"onnxformer-{args.precision}"),
            ("faster-whisper", fw_python, args.shape_dir / f"ct2-{args.precision}")]
    compute = "int8" if args.precision == "int8" else "float32"
    print("| VmRSS / VmHWM MiB after | " + " | ".join(["imports", "loaded", "encoder", "decode 64", "transcribe 60 s"])
          + " |")
    print("|---" * 6 + "|")
    for setting, py, model in runs:
        out = subprocess.run([str(py), __file__, "--worker", setting, str(model), compute], check=True,
                             capture_output=True, text=True, cwd=ROOT,
                             env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"})
        parts = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {setting} | " + " | ".join(f"{rss:.0f} / {hwm:.0f}" for _, rss, hwm in parts) + " |")


if __name__ == "__main__":
    main()
