"""How much of a decode step the output projection takes: ORT's own profile of a bundle's decoder.

    python benchmarks/projection_share.py BUNDLE [--batch-sizes 1,8] [--steps 32] [--threads 2]

Runs greedy decoding (EOS suppressed) on random sources with session profiling on, then sums the profiled node
times of the decoder steps, split into the output projection (the nodes whose output ends in the vocabulary
axis: the logits MatMul, its bias Add, and int8's quantize/dequantize around it; the QGemms (int8) and Gemms (fp32)
by row slices of the tied table, exporters/tied_table) and everything else. Prints a
table (and --json). The projection reads vocab x d_model weights every step: for opus-mt-en-de 58101 x 512.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
from tables import print_rows


def profile(bundle: Path, batch: int, steps: int, threads: int) -> dict:
    import onnxruntime as ort

    from runtime.bundle import load_bundle
    from runtime.generate import generate_ids
    from runtime.search import SearchOptions
    from runtime.session import SessionConfig

    with tempfile.TemporaryDirectory() as tmp:
        options = SessionConfig()
        loaded = load_bundle(bundle, provider="cpu", threads=threads)
        vocab = loaded.manifest["model"]["vocab_size"]
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "dec")
        so.intra_op_num_threads = threads
        dec = ort.InferenceSession(str(bundle / loaded.files["decoder"]), so, providers=["CPUExecutionProvider"])
        loaded.engine.decoder = dec
        rng = np.random.default_rng(0)
        src_vocab = loaded.engine.src_vocab_size
        seqs = rng.integers(3, src_vocab - 1, size=(batch, 32)).tolist()
        generate_ids(loaded.engine, seqs, SearchOptions(max_new_tokens=steps, ignore_eos=True))
        trace = json.loads(Path(dec.end_profiling()).read_text())
    by = defaultdict(float)
    runs = 0
    for ev in trace:
        if ev.get("cat") == "Session" and ev.get("name") == "model_run":
            runs += 1
        if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time"):
            continue
        shapes = [list(s.values())[0] for s in ev.get("args", {}).get("output_type_shape", [])]
        sliced = ev.get("args", {}).get("op_name") in ("QGemm", "Gemm")   # the tied table's row slices: no other
        proj = any(s and s[-1] == vocab for s in shapes) or sliced      # Gemm in a decoder (3-D MatMuls elsewhere)
        by["projection" if proj else "rest"] += ev["dur"] / 1000.0
    runs = max(runs, 1)
    total = by["projection"] + by["rest"]
    return {"batch": batch, "steps": runs, "projection_ms": by["projection"] / runs, "rest_ms": by["rest"] / runs,
            "projection_share": by["projection"] / total if total else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", nargs="+", type=Path)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [{"bundle": str(b), **profile(b, int(n), args.steps, args.threads)}
            for b in args.bundles for n in args.batch_sizes.split(",")]
    print_rows(rows, [("bundle", "bundle", "<40"), ("batch", "batch", ">5"), ("steps", "steps", ">5"),
                      ("projection ms", "projection_ms", ">13.3f"), ("rest ms", "rest_ms", ">8.3f"),
                      ("share", "projection_share", ">6.1%")], args.json)

if __name__ == "__main__":
    main()
