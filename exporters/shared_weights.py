"""One copy of the weights both graphs hold, and the large weights out of the graph files: weights.data.

    record = share_weights({"encoder": tmp / "encoder.onnx", "decoder": tmp / "decoder.onnx"})
    manifest["shared_weights"] = record          # file, sha256, bytes, and the tensors both graphs read

The token embedding (or its int8 form, exporters/fusions/int8_embedding) and the positional table are read by
both graphs, and two graph files store them twice. Here every initializer whose values appear in both graphs
(>= MIN_BYTES) is written once to weights.data, and both graphs reference it as ONNX external data (location,
offset, length) under one name; every other tensor of >= EXTERNAL_BYTES goes there too. The graphs stay valid
ONNX next to that file (any ONNX tool opens them), and the manifest hashes it like the graphs.

In memory (RESULTS.md, "Leaner edge bundles"): ONNX Runtime maps external data that starts on a page (PAGE)
instead of reading it, so both sessions map the same file pages (one copy in the page cache) and the large weights
never pass through a parsed protobuf, which lowers the peak resident memory of `onnxformer generate`. The tensors both graphs read are then handed to both sessions as one OrtValue each over one
read-only mapping (runtime.bundle.shared_initializers, SessionOptions.add_initializer), so that they are resident
once and not once per session's mapping; they must stay page-aligned views of the file: OrtValues of tensors read
into memory raise the peak instead.

ORT-format (.ort) graphs cannot reference external data: the converter embeds the tensors in each .ort file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from runtime.manifest import GRAPHS, sha256_file

MIN_BYTES = 1024             # smaller tensors found in both graphs (shapes, scalars) stay inside each graph
SHARED_FILE = "weights.data"
ALIGN = 64                   # offsets of small tensors in the file
PAGE = 4096                  # large tensors start on a page: ONNX Runtime then maps them instead of reading them
EXTERNAL_BYTES = 64 * 1024   # tensors at least this large go to the weights file even when only one graph reads them


def _digest(tensor: onnx.TensorProto) -> str:
    return hashlib.sha256(tensor.raw_data + bytes(tensor.data_type) + str(list(tensor.dims)).encode()).hexdigest()


def _rename_inputs(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                if all(i.name != old for i in sub.initializer):      # a subgraph's own tensor of that name shadows it
                    _rename_inputs(sub, old, new)


def _names(graph: onnx.GraphProto) -> set[str]:
    """Every value name of a graph and its subgraphs: initializers, inputs, outputs, node outputs."""
    names = {t.name for t in graph.initializer} | {v.name for v in (*graph.input, *graph.output)}
    for node in graph.node:
        names.update(node.output)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                names |= _names(sub)
    return names


def share_weights(paths: dict[str, Path], min_bytes: int = MIN_BYTES, external_bytes: int = EXTERNAL_BYTES) -> dict | None:
    """Write the graphs' weights to one file beside them, each tensor once; returns the manifest record, or None.

    Tensors found in both graphs (>= min_bytes) are stored once and referenced by both under one name; every other
    tensor of >= external_bytes is stored there too, so that ONNX Runtime maps it from the file (page-aligned
    offsets) instead of parsing it out of the graph's protobuf: no transient copy, no heap left fragmented after
    loading. Smaller tensors stay inside the graphs."""
    models = {g: _load_raw(paths[g]) for g in GRAPHS}
    out = paths["encoder"].parent / SHARED_FILE
    with open(out, "wb") as f:
        weights = _WeightsFile(f, external_bytes)
        tensors = _store_common(models, min_bytes, weights)
        for g in GRAPHS:                                                      # the rest of the large weights
            for tensor in models[g].graph.initializer:
                if tensor.data_location != onnx.TensorProto.EXTERNAL and len(tensor.raw_data) >= external_bytes:
                    data = tensor.raw_data
                    _point(tensor, weights.place(data), len(data))
    if weights.offset == 0:                                                   # nothing large, nothing common
        out.unlink()
        return None
    for g in GRAPHS:
        onnx.save(models[g], str(paths[g]))
    return {"file": SHARED_FILE, "sha256": sha256_file(out), "bytes": out.stat().st_size, "tensors": tensors}


def _load_raw(path: Path) -> onnx.ModelProto:
    """A graph with raw_data for every tensor, to compare bytes."""
    model = onnx.load(str(path))
    for tensor in model.graph.initializer:
        if not tensor.HasField("raw_data") and tensor.data_type != onnx.TensorProto.STRING:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
    return model


class _WeightsFile:
    """The weights file being written: each tensor's bytes at an aligned offset (a page for large ones)."""

    def __init__(self, f, external_bytes: int):
        self.f, self.external_bytes, self.offset = f, external_bytes, 0

    def place(self, data: bytes) -> int:
        """Append `data`; returns the offset it starts at."""
        pad = -self.offset % (PAGE if len(data) >= self.external_bytes else ALIGN)
        self.f.write(b"\0" * pad + data)
        start, self.offset = self.offset + pad, self.offset + pad + len(data)
        return start


def _point(tensor: onnx.TensorProto, start: int, length: int) -> None:
    """Make `tensor` read its values from the weights file at [start, start + length)."""
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", SHARED_FILE), ("offset", str(start)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _store_common(models: dict, min_bytes: int, weights: _WeightsFile) -> list[dict]:
    """Write each tensor found in both graphs (>= min_bytes) once, both graphs reading it under one name; returns
    the manifest's records of them."""
    index = {g: {} for g in GRAPHS}
    for g, model in models.items():
        for tensor in model.graph.initializer:
            if len(tensor.raw_data) >= min_bytes:
                index[g].setdefault(_digest(tensor), tensor)
    common = [d for d in index["encoder"] if d in index["decoder"]]
    taken = {g: _names(models[g].graph) for g in GRAPHS}
    tensors = []
    for digest in common:
        first = index["encoder"][digest]
        name = _shared_name(digest, index, taken)
        data = first.raw_data
        start = weights.place(data)
        for g in GRAPHS:
            tensor = index[g][digest]
            if tensor.name != name:
                _rename_inputs(models[g].graph, tensor.name, name)
                tensor.name = name
            _point(tensor, start, len(data))
        tensors.append({"name": name, "dtype": str(onnx.helper.tensor_dtype_to_np_dtype(first.data_type)),
                        "shape": list(first.dims), "offset": start, "length": len(data), "graphs": list(GRAPHS)})
    return tensors


def _shared_name(digest: str, index: dict, taken: dict) -> str:
    """The one name both graphs read a common tensor under (added to `taken`): the encoder's, unless that name
    means something else in either graph."""
    first = index["encoder"][digest]
    name = first.name                                                     # kept when it means the same in both
    if any(name in taken[g] and index[g][digest].name != name for g in GRAPHS):
        name = f"shared.{first.name}"
        while any(name in taken[g] for g in GRAPHS):                        # a name free in both graphs
            name += "_"
    for g in GRAPHS:
        taken[g].add(name)
    return name


def inline_external(model) -> None:
    """Give every initializer of an onnx_ir model read from external data (a bundle's weights.data) its values
    in memory, so that saving the model elsewhere writes them into the new file instead of a dangling reference."""
    import onnx_ir as ir

    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value = ir.tensor(value.const_value.numpy(), name=value.name)


def shared_bytes(record: dict | None) -> int:
    """Bytes stored once instead of twice (the tensors both graphs read)."""
    return sum(t["length"] for t in (record or {}).get("tensors", []))


__all__ = ["share_weights", "shared_bytes", "inline_external", "SHARED_FILE"]
