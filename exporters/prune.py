"""What the graphs store: unused initializers (removed), and weights stored more than once (reported).

    removed = prune_unused(model)              # an onnx_ir Model, in place, before it is saved
    removed = prune_file("tmp/decoder.onnx")   # or a saved graph file (rewritten only when something goes)
    print(format_weight_report(weight_report({"encoder": enc_path, "decoder": dec_path})))

Removal is onnx_ir's RemoveUnusedNodesPass (dead nodes, then initializers nothing reads); this module
counts what it removed. The report finds the same values stored twice: across the two graph files (the
embedding matrix and the positional table, unless exporters/shared_weights stored them once in a file both graphs
reference: then they are listed as stored once) and as a transposed copy (the tied
output projection that the exporter folds to embedding^T next to the embedding that Gather reads).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

MIN_BYTES = 1024            # smaller tensors (shapes, scalars, biases of tiny models) are not worth reporting


def _nbytes(value: ir.Value) -> int:
    tensor = value.const_value
    return int(tensor.nbytes) if tensor is not None else 0


def prune_unused(model: ir.Model) -> dict:
    """Remove dead nodes and unused initializers in place; {"initializers": [names], "bytes": n, "nodes": n}."""
    before = {name: _nbytes(v) for name, v in model.graph.initializers.items()}
    nodes = sum(1 for _ in model.graph.all_nodes())
    RemoveUnusedNodesPass()(model)
    gone = sorted(set(before) - set(model.graph.initializers))
    return {"initializers": gone, "bytes": sum(before[n] for n in gone),
            "nodes": nodes - sum(1 for _ in model.graph.all_nodes())}


def prune_file(path: str | Path) -> dict:
    """prune_unused on a saved graph; the file is rewritten only when something was removed."""
    model = ir.load(path)
    removed = prune_unused(model)
    if removed["initializers"] or removed["nodes"]:
        ir.save(model, path)
    return removed


# ---------------------------------------------------------------------------------------------- report

def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes() + str(array.dtype).encode()
                          + str(array.shape).encode()).hexdigest()


def weight_report(paths: dict[str, str | Path], min_bytes: int = MIN_BYTES) -> dict:
    """Per graph: initializer count, bytes by dtype and unused names; across graphs: values stored more than once."""
    graphs, by_digest, transposed_of = {}, defaultdict(list), {}
    for graph, path in paths.items():
        model = ir.load(path)
        used = _used_names(model)
        by_dtype: dict[str, int] = defaultdict(int)
        unused = []
        for name, value in model.graph.initializers.items():
            array = value.const_value.numpy()
            by_dtype[str(array.dtype)] += array.nbytes
            if name not in used:
                unused.append(name)
            if array.nbytes < min_bytes:
                continue
            digest = _digest(array)
            tensor = value.const_value                          # external data: where it is stored, else this graph
            where = ((tensor.location, tensor.offset) if isinstance(tensor, ir.ExternalTensor) else (graph, name))
            by_digest[digest].append((graph, name, array.nbytes, where))
            if array.ndim == 2:
                transposed_of[digest] = _digest(array.T)
        graphs[graph] = {"file": Path(path).name, "bytes": Path(path).stat().st_size,
                         "initializers": len(model.graph.initializers), "initializer_bytes": dict(by_dtype),
                         "unused": unused}
    same = [{"copies": [f"{g}:{n}" for g, n, _, _ in entries], "bytes": entries[0][2],
             "extra_bytes": entries[0][2] * (len({e[3] for e in entries}) - 1)}
            for entries in by_digest.values() if len({e[3] for e in entries}) > 1]
    once = [{"readers": [f"{g}:{n}" for g, n, _, _ in entries], "stored_in": entries[0][3][0], "bytes": entries[0][2]}
            for entries in by_digest.values() if len(entries) > 1 and len({e[3] for e in entries}) == 1]
    transposed, seen = [], set()
    for digest, t_digest in transposed_of.items():         # value groups that are each other's transpose
        pair = frozenset({digest, t_digest})
        if t_digest in by_digest and len(pair) == 2 and pair not in seen:  # a symmetric matrix is not a copy
            seen.add(pair)
            copy, original = by_digest[digest], by_digest[t_digest]
            transposed.append({"tensor": [f"{g}:{n}" for g, n, _, _ in copy],
                               "transpose_of": [f"{g}:{n}" for g, n, _, _ in original], "bytes": copy[0][2]})
    return {"graphs": graphs, "same_values": sorted(same, key=lambda d: -d["bytes"]),
            "stored_once": sorted(once, key=lambda d: -d["bytes"]),
            "transposed_copies": sorted(transposed, key=lambda d: -d["bytes"]),
            "duplicated_bytes": sum(d["extra_bytes"] for d in same) + sum(t["bytes"] for t in transposed)}


def _used_names(model: ir.Model) -> set[str]:
    """Names read by any node (subgraphs included) or returned as graph outputs."""
    used = {v.name for v in model.graph.outputs}
    for node in model.graph.all_nodes():
        used.update(v.name for v in node.inputs if v is not None)
    return used


def format_weight_report(report: dict) -> str:
    """A short readable version of weight_report()."""
    lines = []
    for graph, g in report["graphs"].items():
        dtypes = ", ".join(f"{d} {n / 1e6:.2f} MB" for d, n in sorted(g["initializer_bytes"].items()))
        lines.append(f"{graph}: {g['file']} {g['bytes'] / 1e6:.2f} MB, {g['initializers']} initializers ({dtypes}), "
                     f"{len(g['unused'])} unused")
    for d in report["same_values"]:
        lines.append(f"  same values: {' = '.join(d['copies'])} ({d['bytes'] / 1e6:.2f} MB each)")
    for d in report.get("stored_once", []):
        lines.append(f"  stored once: {' = '.join(d['readers'])} in {d['stored_in']} ({d['bytes'] / 1e6:.2f} MB)")
    for t in report["transposed_copies"]:
        lines.append(f"  transposed copy: {' = '.join(t['tensor'])} = ({' = '.join(t['transpose_of'])})^T "
                     f"({t['bytes'] / 1e6:.2f} MB)")
    return "\n".join(lines)


__all__ = ["prune_unused", "prune_file", "weight_report", "format_weight_report"]
