"""The other batch-invariant int8 form, for comparison only: an int8 bundle's quantized MatMuls as
com.microsoft.MatMulNBits with bits=8 and accuracy_level 4 (MLAS quantizes each row of A to int8 per block of K
inside the kernel, so rows do not see each other), with the same int8 weights and scales.

    python benchmarks/studies/nbits8_variant.py INT8_BUNDLE OUT [--block 128]

The weights are the bundle's own (per-column scale repeated for every block of K, zero point 128 = int8 + 128),
so only the activation quantization differs from the source. The new bundle is not gated (a benchmark variant:
`onnxformer optimize` does not make it); it is measured beside `--activation-scales per-row` in
benchmarks/studies/activation_scales.sh.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from exporters.bundle import graph_entry, write_manifest  # noqa: E402
from exporters.row_activations import RowActivationsPass, _const  # noqa: E402
from exporters.shared_weights import SHARED_FILE, inline_external, share_weights  # noqa: E402
from runtime.manifest import GRAPHS, read_manifest  # noqa: E402


def to_nbits8(model: ir.Model, block: int) -> int:
    """Replace every dynamically quantized MatMul whose K divides by `block`; returns how many."""
    finder, graph, done = RowActivationsPass(), model.graph, 0
    for node in list(graph):
        match = finder._match(node)
        if match is None:
            continue
        x, bq, bs, bzp, last, remove = match
        q = _const(bq).astype(np.int32)
        if bzp is not None:
            q = q - _const(bzp).astype(np.int32)
        k, n = q.shape
        if k % block:
            continue
        scale = np.broadcast_to(_const(bs).astype(np.float32).reshape(-1), (n,))
        blocks = (q.T.reshape(n, k // block, block) + 128).astype(np.uint8)
        scales = np.repeat(scale[:, None], k // block, axis=1).reshape(-1).astype(np.float32)
        w = ir.Value(name=f"{bq.name}.nbits8", const_value=ir.tensor(blocks))
        s = ir.Value(name=f"{bq.name}.nbits8_scale", const_value=ir.tensor(scales))
        graph.register_initializer(w)
        graph.register_initializer(s)
        new = ir.node("MatMulNBits", [x, w, s], domain="com.microsoft",
                      attributes={"K": k, "N": n, "bits": 8, "block_size": block, "accuracy_level": 4})
        graph.insert_before(node, [new])
        finder._replace(last, new.outputs[0])
        for dead in remove:
            if not any(o.is_graph_output() or any(True for _ in o.uses()) for o in dead.outputs):
                graph.remove(dead, safe=True)
        done += 1
    RemoveUnusedNodesPass()(model)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--block", type=int, default=128, help="weights per block along K (16-256, a power of 2)")
    args = parser.parse_args()
    manifest = read_manifest(args.bundle)
    if manifest["precision"] != "int8":
        sys.exit(f"error: {args.bundle} is {manifest['precision']}, not int8")
    if args.out.exists():
        sys.exit(f"error: {args.out} exists; remove it first")
    args.out.mkdir(parents=True)
    paths = {}
    for g in GRAPHS:
        model = ir.load(args.bundle / manifest["graphs"][g]["file"])
        inline_external(model)
        print(f"{g}: {to_nbits8(model, args.block)} MatMuls -> MatMulNBits bits=8 block {args.block}")
        paths[g] = args.out / manifest["graphs"][g]["file"]
        ir.save(model, paths[g])
    if manifest.get("tokenizer"):
        shutil.copy(args.bundle / manifest["tokenizer"], args.out / manifest["tokenizer"])
    manifest.pop("shared_weights", None)
    manifest.pop("files", None)
    shared = share_weights(paths)
    if shared is not None:
        manifest["shared_weights"] = shared
    for g in GRAPHS:
        manifest["graphs"][g].update(graph_entry(paths[g]))
    manifest["passes"] = (manifest.get("passes") or []) + [f"matmul_nbits8_block{args.block} (benchmark variant)"]
    write_manifest(args.out, manifest)
    print(f"wrote {args.out}" + (f" ({SHARED_FILE} shared)" if shared else ""))


if __name__ == "__main__":
    main()
