"""ONNX Runtime's 8-bit weight kernels on one matrix, at decode-step batch sizes: which reads its weights fastest.

    python benchmarks/int8_kernels.py [--shape 768x50265] [--batch-sizes 1,8] [--threads 2] [--calls 30]

One MatMul [M, K] x [K, N] with random weights, as four graphs: fp32 (MatMul), the int8 recipes' form (onnxruntime
quantize_dynamic: DynamicQuantizeLinear + MatMulInteger, which ONNX Runtime fuses into DynamicQuantizeMatMul:
per-tensor activation scale, one weight scale), and MatMulNBits in 8 and 4 bits (weight blocks of 128 along K,
(--block), symmetric, accuracy_level 4: MLAS quantizes each activation row's blocks to int8 inside the kernel). Prints the
best of --rounds medians, ms a call, and each one's max abs error against fp32. Run under the bench lock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def graphs(k: int, n: int, folder: Path, block: int = 128) -> dict[str, Path]:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    w = (np.random.default_rng(0).standard_normal((k, n)) * 0.05).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
                              [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "fp32.onnx"),
              save_as_external_data=True, location="fp32.data")
    files = {"fp32 MatMul": folder / "fp32.onnx", "int8 DynamicQuantizeMatMul": folder / "dq.onnx"}
    quantize_dynamic(str(folder / "fp32.onnx"), str(files["int8 DynamicQuantizeMatMul"]), weight_type=QuantType.QInt8)
    for bits in (8, 4):
        q = MatMulNBitsQuantizer(onnx.load(str(folder / "fp32.onnx")), bits=bits, block_size=block, is_symmetric=True,
                                 accuracy_level=4)
        q.process()
        files[f"MatMulNBits {bits}-bit"] = folder / f"nbits{bits}.onnx"
        onnx.save(q.model.model, str(files[f"MatMulNBits {bits}-bit"]), save_as_external_data=True,
                  location=f"nbits{bits}.data")
    return files


def main() -> None:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="768x50265", help="K x N (d_model x vocabulary: the output projection)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block", type=int, default=128, help="MatMulNBits: weights per scale along K")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    k, n = (int(v) for v in args.shape.split("x"))
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = graphs(k, n, Path(tmp), args.block)
        sessions = {name: ort.InferenceSession(str(f), so, providers=["CPUExecutionProvider"])
                    for name, f in files.items()}
        for m in (int(b) for b in args.batch_sizes.split(",")):
            x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
            ref = sessions["fp32 MatMul"].run(None, {"x": x})[0]
            times = {name: [] for name in sessions}
            for _ in range(args.rounds):                       # interleaved: the kernels share the machine's state
                for name, s in sessions.items():
                    s.run(None, {"x": x})
                    calls = []
                    for _ in range(args.calls):
                        start = time.perf_counter()
                        s.run(None, {"x": x})
                        calls.append(time.perf_counter() - start)
                    times[name].append(statistics.median(calls) * 1e3)
            for name, s in sessions.items():
                err = float(np.abs(s.run(None, {"x": x})[0] - ref).max())
                rows.append({"shape": args.shape, "batch": m, "kernel": name, "ms": min(times[name]),
                             "max_abs_error": err})
    print(f"{'batch':>5} {'kernel':<28} {'ms a call':>10} {'max abs err':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['kernel']:<28} {r['ms']:>10.3f} {r['max_abs_error']:>12.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
