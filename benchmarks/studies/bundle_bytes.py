"""Where a model folder's bytes go: an onnxformer bundle's tensors (both graphs, each weights.data range once) or a
CTranslate2 model.bin's variables, by kind.

    .venv/bin/python benchmarks/studies/bundle_bytes.py out/peers/models/flan-t5-base/onnxformer-int8 [--top 20]
    .venv/bin/python benchmarks/studies/bundle_bytes.py out/peers/models/flan-t5-base/ct2-int8

A bundle's tensors are grouped by dtype, matrix or vector, inline (in the .onnx) or in weights.data, and by name with
digits folded (`mul_N.packed.weight_scale`); what the graphs hold beyond their tensors is their nodes. model.bin is
read with CTranslate2's own layout (ctranslate2/specs/model_spec.py `_serialize`, binary version 6): name, rank,
dims, dtype, byte count and bytes per variable, then the aliases.
"""

from __future__ import annotations

import argparse
import re
import struct
from collections import Counter
from pathlib import Path

CT2_DTYPES = {0: "FLOAT", 1: "INT8", 2: "INT16", 3: "INT32", 4: "FLOAT16", 5: "BFLOAT16"}


def _shape_kind(dims: list[int]) -> str:
    return "matrix" if len(dims) == 2 and min(dims) > 1 else "vector"


def bundle_tensors(folder: Path) -> list[tuple[str, str, list[int], int, str]]:
    """(name, dtype, dims, bytes, 'inline' | 'weights.data') of every initializer and Constant of both graphs,
    a weights.data range counted the first time it is met."""
    import onnx

    seen, rows = set(), []
    for graph in ("encoder", "decoder"):
        model = onnx.load(str(folder / f"{graph}.onnx"), load_external_data=False)
        tensors = list(model.graph.initializer) + [a.t for n in model.graph.node for a in n.attribute
                                                   if a.type == onnx.AttributeProto.TENSOR]
        for t in tensors:
            dtype = onnx.TensorProto.DataType.Name(t.data_type)
            ext = {e.key: e.value for e in t.external_data}
            if not ext:
                rows.append((t.name, dtype, list(t.dims), t.ByteSize(), "inline"))
                continue
            where = (ext["location"], int(ext.get("offset", 0)), int(ext["length"]))
            if where not in seen:
                seen.add(where)
                rows.append((t.name, dtype, list(t.dims), where[2], ext["location"]))
    return rows


def ct2_variables(path: Path) -> tuple[list[tuple[str, str, list[int], int, str]], int]:
    """(name, dtype, dims, bytes, 'model.bin') of every variable, and the bytes of the names, dims and aliases."""
    data, pos = path.read_bytes(), 0

    def take(fmt: str):
        nonlocal pos
        value = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("H")
        pos += n
        return data[pos - n:pos - 1].decode()

    take("I"), string(), take("I")                                 # binary version, spec name, revision
    rows, payload = [], 0
    for _ in range(take("I")):
        name = string()
        dims = [take("I") for _ in range(take("B"))]
        dtype, size = CT2_DTYPES.get(take("B"), "?"), take("I")
        pos += size
        payload += size
        rows.append((name, dtype, dims, size, "model.bin"))
    return rows, len(data) - payload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--top", type=int, default=12, help="groups by name to list")
    args = ap.parse_args()
    for f in sorted(p for p in args.folder.iterdir() if p.is_file()):
        print(f"{f.name:32} {f.stat().st_size:>14,}")
    if (args.folder / "model.bin").exists():
        rows, other = ct2_variables(args.folder / "model.bin")
        print(f"{'model.bin: names, dims, aliases':32} {other:>14,}")
    else:
        rows = bundle_tensors(args.folder)
        inline = sum(r[3] for r in rows if r[4] == "inline")
        graphs = sum((args.folder / f"{g}.onnx").stat().st_size for g in ("encoder", "decoder"))
        print(f"{'graphs: nodes (less tensors)':32} {graphs - inline:>14,}")
    kinds, counts, names = Counter(), Counter(), Counter()
    for name, dtype, dims, size, where in rows:
        kind = f"{dtype} {_shape_kind(dims)} {where}"
        kinds[kind] += size
        counts[kind] += 1
        names[(re.sub(r"\d+", "N", name), dtype, where)] += size
    print()
    for kind, size in kinds.most_common():
        print(f"{kind:40} {counts[kind]:>5} {size:>14,}")
    print()
    for (name, dtype, where), size in names.most_common(args.top):
        print(f"{name:56} {dtype:6} {where:12} {size:>12,}")


if __name__ == "__main__":
    main()
