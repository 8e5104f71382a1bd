"""Would weight-only quantization (onnxruntime's MatMulNBits) beat the int8 bundle? An ad-hoc study, not a test.

    python benchmarks/studies/weight_only_study.py out/bench/base/base-fp32-fused out/bench/base/base-int8 \
        --work out/bench/base/weight-only --batches 1,8

From a fused fp32 bundle it writes two copies whose MatMul weights onnxruntime's MatMulNBitsQuantizer turned into
8-bit and 4-bit blocks (block 32, symmetric, accuracy level 4: int8 activations inside MLAS), after the same
transposed-weight fold the int8 pass uses; then it times them against the int8 bundle (dynamic quantization,
MatMulInteger) with benchmarks/fusion_step_time.py's loop. The copies are study material: their manifests keep
the fp32 bundle's parity record, so they are not bundles to ship.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir

from exporters.bundle import op_counts
from exporters.logs import quiet_loggers
from exporters.optimize import _fuse_graph


def weight_only(source: Path, out: Path, bits: int, block: int = 32) -> Path:
    """A copy of `source` with MatMulNBits weights of `bits` bits."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out)
    manifest = json.loads((out / "manifest.json").read_text())
    for graph in ("encoder", "decoder"):
        model, _, _ = _fuse_graph(source / f"{graph}.onnx", False, "ort", "int8", None)   # the int8 pre-passes only
        with quiet_loggers("root", "onnxruntime", "onnxruntime.quantization"):
            quantizer = MatMulNBitsQuantizer(ir.to_proto(model), bits=bits, block_size=block, is_symmetric=True,
                                             accuracy_level=4)
            quantizer.process()
        path = out / f"{graph}.onnx"
        proto = quantizer.model.model
        ir.save(ir.from_proto(proto), path)
        entry = manifest["graphs"][graph]
        counts = op_counts(proto.graph)
        entry.update(sha256=hashlib.sha256(path.read_bytes()).hexdigest(), bytes=path.stat().st_size,
                     op_counts=dict(counts), nodes=sum(counts.values()))
    manifest["precision"] = "int8"
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))         # benchmarks/, for its step-time tool
    from fusion_step_time import Decoder

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fp32", type=Path, help="a fused fp32 bundle")
    parser.add_argument("int8", type=Path, help="the int8 bundle to compare with")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    bundles = {"int8 (MatMulInteger)": args.int8,
               "8-bit MatMulNBits": weight_only(args.fp32, args.work / "nbits8", 8),
               "4-bit MatMulNBits": weight_only(args.fp32, args.work / "nbits4", 4)}
    batches = [int(b) for b in args.batches.split(",")]
    decoders = {name: Decoder(path, threads=args.threads) for name, path in bundles.items()}
    for d in decoders.values():
        for b in batches:
            d.run(b, 24, 4)
    best: dict = {}
    for _ in range(args.rounds):
        for b in batches:
            for name, d in decoders.items():
                ms = float(np.median(d.run(b, 24, args.steps)[1:])) * 1e3
                best[(name, b)] = min(best.get((name, b), float("inf")), ms)
    sizes = {name: sum(p.stat().st_size for p in Path(path).glob("*.onnx")) / 1e6 for name, path in bundles.items()}
    print("| weights | graphs MB | " + " | ".join(f"ms/step batch {b}" for b in batches) + " |")
    print("|---|---|" + "---|" * len(batches))
    for name in bundles:
        print(f"| {name} | {sizes[name]:.1f} | " + " | ".join(f"{best[(name, b)]:.2f}" for b in batches) + " |")


if __name__ == "__main__":
    main()
