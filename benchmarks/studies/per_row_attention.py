"""Shared write slot vs per-row write positions for an in-flight batch (an ad-hoc study, not a test).

    python benchmarks/studies/per_row_attention.py --rows 32 --threads 2

The study behind the per-row static cache (exporters/static_cache.py). In-flight batching (runtime/inflight.py)
keeps rows that joined at different steps in one static cache. com.microsoft.DecoderMaskedMultiHeadAttention takes
one past_sequence_length, so with it every row writes at one shared slot and a step attends over the span since
the oldest live row joined, masked or not (the layout CUDA bundles keep). com.microsoft.GroupQueryAttention takes a
per-row `seqlens_k` and writes each row's new key/value at its own position of a shared past/present buffer, so a
row pays for its own length only: CPU bundles now use it. One self-attention layer, both kernels, IO binding with
past and present bound to one buffer (as the runtime's static cache does); also checks that both give the same
output when every row has the same length.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

MS = "com.microsoft"


def _model(node, inputs) -> bytes:
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("o", "present_k", "present_v")]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def models(rows: int, heads: int, head_dim: int, cache: int) -> dict[str, bytes]:
    f = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    i32 = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.INT32, shape)  # noqa: E731
    qkv = [f(n, [rows, 1, heads * head_dim]) for n in ("q", "k", "v")]
    past = [f(n, [rows, heads, cache, head_dim]) for n in ("past_k", "past_v")]
    gqa = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"],
                           ["o", "present_k", "present_v"], domain=MS, num_heads=heads, kv_num_heads=heads)
    dmmha = helper.make_node("DecoderMaskedMultiHeadAttention", ["q", "k", "v", "mask", "", "past_k", "past_v", "psl"],
                             ["o", "present_k", "present_v"], domain=MS, num_heads=heads, past_present_share_buffer=1)
    return {"gqa": _model(gqa, qkv + past + [i32("seqlens_k", [rows]), i32("total", [1])]),
            "dmmha": _model(dmmha, qkv + [i32("mask", [rows, None])] + past + [i32("psl", [1])])}


def bind(session: ort.InferenceSession, feeds: dict):
    binding, values = session.io_binding(), {}
    for name, array in feeds.items():
        values[name] = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(name, values[name])
    binding.bind_output("o", "cpu")
    binding.bind_ortvalue_output("present_k", values["past_k"])        # one buffer, bound as past and present
    binding.bind_ortvalue_output("present_v", values["past_v"])
    return binding


def timed(session: ort.InferenceSession, feeds: dict, runs: int) -> tuple[float, np.ndarray]:
    binding = bind(session, feeds)
    for _ in range(3):
        session.run_with_iobinding(binding)
    start = time.perf_counter()
    for _ in range(runs):
        session.run_with_iobinding(binding)
    ms = (time.perf_counter() - start) / runs * 1e3
    session.run_with_iobinding(binding)
    return ms, binding.get_outputs()[0].numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cache", type=int, default=256)
    ap.add_argument("--spans", default="25,100,175", help="filled slots before this step, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=100)
    a = ap.parse_args()
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    sessions = {k: ort.InferenceSession(m, so, providers=["CPUExecutionProvider"])
                for k, m in models(a.rows, a.heads, a.head_dim, a.cache).items()}
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((a.rows, 1, a.heads * a.head_dim), dtype=np.float32) for _ in range(3))
    past = rng.standard_normal((2, a.rows, a.heads, a.cache, a.head_dim), dtype=np.float32)
    print(f"{a.rows} rows, {a.heads} heads x {a.head_dim}, buffer {a.cache}, {a.threads} threads, "
          f"onnxruntime {ort.__version__}: ms per layer step")
    print(f"{'keys per row':>22} {'DMMHA (shared slot)':>20} {'GQA (per-row)':>14} {'max diff':>9}")
    for span in (int(s) for s in a.spans.split(",")):
        common = {"q": q, "k": k, "v": v, "past_k": past[0].copy(), "past_v": past[1].copy()}
        gqa = {**common, "seqlens_k": np.full(a.rows, span, np.int32), "total": np.array([span + 1], np.int32)}
        dmmha = {**common, "past_k": past[0].copy(), "past_v": past[1].copy(),
                 "mask": np.ones((a.rows, span + 1), np.int32), "psl": np.array([span], np.int32)}
        t_g, o_g = timed(sessions["gqa"], gqa, a.runs)
        t_d, o_d = timed(sessions["dmmha"], dmmha, a.runs)
        print(f"{span + 1:>22} {t_d:>20.3f} {t_g:>14.3f} {np.abs(o_g - o_d).max():>9.1e}")
    lens = rng.integers(0, max(int(s) for s in a.spans.split(",")) + 1, a.rows).astype(np.int32)
    ragged = {"q": q, "k": k, "v": v, "past_k": past[0].copy(), "past_v": past[1].copy(), "seqlens_k": lens,
              "total": np.array([lens.max() + 1], np.int32)}
    t_r, _ = timed(sessions["gqa"], ragged, a.runs)
    print(f"{f'{lens.min() + 1}-{lens.max() + 1}, per row':>22} {'-':>20} {t_r:>14.3f}")


if __name__ == "__main__":
    main()
