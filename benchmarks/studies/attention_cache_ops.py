"""One decoder self-attention step over a KV cache, three ways, on this onnxruntime (an ad-hoc study, not a test).

    python benchmarks/studies/attention_cache_ops.py --batch 1 --threads 2

- concat:  com.microsoft.MultiHeadAttention with past/present: the present is a new tensor, past + 1 long
           (the exported, dynamic cache)
- dmmha:   com.microsoft.DecoderMaskedMultiHeadAttention, past_present_share_buffer=1, one buffer bound as past
           and present (the static cache `optimize` writes)
- onnx24:  ONNX opset 24 TensorScatter (write the new key/value into the bound buffer) + Attention with
           nonpad_kv_seqlen (the standard-ops route)
Each is timed at several filled lengths of a 256-long cache; the onnx24 row also says whether a NaN in an
unfilled buffer position reaches the output (it must not: unfilled rows hold whatever was there).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h

N, D, MAX = 8, 64, 256


def _vi(name, elem, shape):
    return h.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, opsets):
    model = h.make_model(h.make_graph(nodes, "g", inputs, outputs), opset_imports=[h.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 10
    return model.SerializeToString()


def models(b: int) -> dict[str, bytes]:
    x = [_vi(n, T.FLOAT, [b, 1, N * D]) for n in ("q", "k", "v")]
    ms = [("", 20), ("com.microsoft", 1)]
    concat = _model([h.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "", "pk", "pv"], ["o", "rk", "rv"],
                                 domain="com.microsoft", num_heads=N)],
                    x + [_vi(n, T.FLOAT, [b, N, "P", D]) for n in ("pk", "pv")],
                    [_vi("o", T.FLOAT, [b, 1, N * D])] + [_vi(n, T.FLOAT, [b, N, "T", D]) for n in ("rk", "rv")], ms)
    dmmha = _model([h.make_node("DecoderMaskedMultiHeadAttention", ["q", "k", "v", "", "", "pk", "pv", "psl"],
                                ["o", "rk", "rv"], domain="com.microsoft", num_heads=N, past_present_share_buffer=1)],
                   x + [_vi(n, T.FLOAT, [b, N, MAX, D]) for n in ("pk", "pv")] + [_vi("psl", T.INT32, [1])],
                   [_vi("o", T.FLOAT, [b, 1, N * D])] + [_vi(n, T.FLOAT, [b, N, MAX, D]) for n in ("rk", "rv")], ms)
    onnx24 = _model([h.make_node("TensorScatter", ["pk", "k4", "pos"], ["rk"], axis=2),
                     h.make_node("TensorScatter", ["pv", "v4", "pos"], ["rv"], axis=2),
                     h.make_node("Attention", ["q4", "rk", "rv", "", "", "", "filled"], ["o"])],
                    [_vi(n, T.FLOAT, [b, N, 1, D]) for n in ("q4", "k4", "v4")]
                    + [_vi(n, T.FLOAT, [b, N, MAX, D]) for n in ("pk", "pv")]
                    + [_vi("pos", T.INT64, [b]), _vi("filled", T.INT64, [b])],
                    [_vi("o", T.FLOAT, [b, N, 1, D])] + [_vi(n, T.FLOAT, [b, N, MAX, D]) for n in ("rk", "rv")],
                    [("", 24)])
    return {"concat": concat, "dmmha": dmmha, "onnx24": onnx24}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    b = args.batch
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.log_severity_level = args.threads, 3
    sessions = {k: ort.InferenceSession(m, opts, providers=["CPUExecutionProvider"]) for k, m in models(b).items()}
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, 1, N * D)).astype(np.float32)
    q4 = np.ascontiguousarray(q.reshape(b, 1, N, D).transpose(0, 2, 1, 3))
    cache = {n: rng.standard_normal((b, N, MAX, D)).astype(np.float32) for n in ("pk", "pv")}
    values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in cache.items()}

    def timed(run) -> float:
        for _ in range(10):
            run()
        start = time.perf_counter()
        for _ in range(args.reps):
            run()
        return (time.perf_counter() - start) / args.reps * 1e6

    def bound(name, feeds, past):
        binding = sessions[name].io_binding()
        for k, v in feeds.items():
            binding.bind_cpu_input(k, v)
        for k, out in (("pk", "rk"), ("pv", "rv")):
            binding.bind_ortvalue_input(k, values[k])
            binding.bind_ortvalue_output(out, values[k])
        binding.bind_output("o", "cpu")
        return lambda: sessions[name].run_with_iobinding(binding)

    print(f"us per attention step, batch {b}, {N} heads of {D}, buffer {MAX}, {args.threads} threads")
    print(f"{'filled':>7} {'concat':>9} {'dmmha':>9} {'onnx24':>9}")
    for past in (8, 64, 128, 255):
        pasts = {n: np.ascontiguousarray(cache[n][:, :, :past]) for n in ("pk", "pv")}   # as a previous step made them
        concat = timed(lambda: sessions["concat"].run(None, {"q": q, "k": q, "v": q, **pasts}))
        dmmha = timed(bound("dmmha", {"q": q, "k": q, "v": q, "psl": np.array([past], np.int32)}, past))
        onnx24 = timed(bound("onnx24", {"q4": q4, "k4": q4, "v4": q4, "pos": np.full(b, past, np.int64),
                                        "filled": np.full(b, past + 1, np.int64)}, past))
        print(f"{past:>7} {concat:>9.1f} {dmmha:>9.1f} {onnx24:>9.1f}")
    poisoned = {n: a.copy() for n, a in cache.items()}
    for a in poisoned.values():
        a[:, :, 9:] = np.nan
    out = sessions["onnx24"].run(["o"], {"q4": q4, "k4": q4, "v4": q4, "pos": np.full(b, 8, np.int64),
                                         "filled": np.full(b, 9, np.int64), **poisoned})[0]
    print(f"onnx24 with NaN in unfilled positions: output {'has NaN' if np.isnan(out).any() else 'finite'}")


if __name__ == "__main__":
    main()
