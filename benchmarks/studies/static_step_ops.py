"""Static-cache decoder step time by filled length, and where it goes (ONNX Runtime's profiler, per op type).

    .venv/bin/python benchmarks/studies/static_step_ops.py out/bench/base/base-int8 [OTHER_BUNDLE ...] --rows 1 8 32

For each bundle and row count: one IO-bound step over zeroed [rows, H, 256, Dh] buffers (past and present bound to
one buffer, as the runtime binds them), every row at the same filled length (10, 60, 120, 180, 240), 30 steps each;
prints the median step time and, for 32 rows, the attention ops' share. Works with both static layouts: the
per-row cache (GroupQueryAttention, past_sequence_length [rows]; CPU bundles) and the shared slot
(DecoderMaskedMultiHeadAttention, [1], with a key mask; CUDA bundles and CPU bundles optimized before it), so
the two can be raced at equal lengths. An ad-hoc study, not a test.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import numpy as np
import onnxruntime as ort

SPANS = (10, 60, 120, 180, 240)
RUNS = 30


def profile(bundle: str, rows: int, threads: int, cap: int = 256, src: int = 24) -> list[tuple[int, float, dict]]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "step")
    session = ort.InferenceSession(f"{bundle}/decoder.onnx", so, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    per_row = not isinstance(inputs["past_sequence_length"].shape[0], int)
    heads, head_dim = inputs["past_key_values.0.decoder.key"].shape[1], inputs["past_key_values.0.decoder.key"].shape[3]
    rng = np.random.default_rng(0)
    feeds = {"encoder_attention_mask": np.ones((rows, src), np.int64)}
    for name in inputs:
        if name.startswith("past_key_values."):
            length = cap if ".decoder." in name else src
            feeds[name] = (np.zeros if ".decoder." in name else rng.random)((rows, heads, length, head_dim)).astype(np.float32)
    if "decoder_attention_mask" in inputs:
        feeds["decoder_attention_mask"] = np.ones((rows, cap), np.int64)
    binding, values = session.io_binding(), {}
    for name, array in feeds.items():
        values[name] = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(name, values[name])
    for out in session.get_outputs():
        if out.name.startswith("present."):
            binding.bind_ortvalue_output(out.name, values[out.name.replace("present.", "past_key_values.")])
    binding.bind_output("logits", "cpu")
    medians = []
    for span in SPANS:
        times = []
        for _ in range(RUNS):
            binding.bind_cpu_input("input_ids", np.full((rows, 1), 5, np.int64))
            binding.bind_cpu_input("past_sequence_length", np.full(rows if per_row else 1, span, np.int32))
            binding.bind_cpu_input("position_ids", np.full((rows, 1), span, np.int64))
            t = time.perf_counter()
            session.run_with_iobinding(binding)
            times.append(time.perf_counter() - t)
        medians.append(float(np.median(times)))
    events = json.load(open(session.end_profiling()))
    runs = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run"]
    by_span = [collections.Counter() for _ in SPANS]
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            run = next((i for i, (a, z) in enumerate(runs) if a <= e["ts"] <= z), None)
            if run is not None and run % RUNS >= 3:                      # the first runs of a span warm up
                by_span[run // RUNS][e["args"]["op_name"]] += e["dur"] / (RUNS - 3) / 1000
    return [(span, med, ops) for span, med, ops in zip(SPANS, medians, by_span)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(f"onnxruntime {ort.__version__}, {args.threads} threads; median step ms (attention op ms) by filled length")
    print(f"{'bundle':<40}{'rows':>5}" + "".join(f"{s:>15}" for s in SPANS))
    for bundle in args.bundles:
        for rows in args.rows:
            cells = []
            for span, med, ops in profile(bundle, rows, args.threads):
                attention = sum(v for k, v in ops.items() if k in ("GroupQueryAttention", "DecoderMaskedMultiHeadAttention"))
                cells.append(f"{med * 1e3:7.2f} ({attention:4.1f})")
            print(f"{bundle[-40:]:<40}{rows:>5}" + "".join(f"{c:>15}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
