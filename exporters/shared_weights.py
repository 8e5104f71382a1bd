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
read-only mapping (runtime.bundle.shared_tables, SessionOptions.add_initializer), so that they are resident
once and not once per session's mapping; they must stay page-aligned views of the file: OrtValues of tensors read
into memory raise the peak instead.

A tensor the model's metadata names as a part of another (exporters/tied_table: the projection's row slices of
the 8-bit table) is pointed at that tensor's bytes in weights.data, after they are checked to be the same, and
not stored again.

Models past protobuf's 2 GB: export and optimize save every graph with save_graph, its weights in GRAPH.onnx.data
beside it (never inside one protobuf message), and share_weights reads them from there a tensor at a time, so no
step holds a graph's weights in one message.

ORT-format (.ort) graphs cannot reference external data: the converter embeds the tensors in each .ort file.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from exporters.tied_table import VIEWS
from runtime.manifest import GRAPHS, sha256_file

MIN_BYTES = 1024             # smaller tensors found in both graphs (shapes, scalars) stay inside each graph
SHARED_FILE = "weights.data"
ALIGN = 64                   # offsets of small tensors in the file
PAGE = 4096                  # large tensors start on a page: ONNX Runtime then maps them instead of reading them
EXTERNAL_BYTES = 64 * 1024   # tensors at least this large go to the weights file even when only one graph reads them


def _digest(tensor: onnx.TensorProto, data: bytes) -> str:
    h = hashlib.sha256(data)
    h.update(bytes(tensor.data_type) + str(list(tensor.dims)).encode())
    return h.hexdigest()


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
    loading. Smaller tensors go inside the graphs. The graphs may come with their weights inside or in external
    data files beside them (save_graph: a model past protobuf's 2 GB never is one message); tensors are read one
    at a time, and the graphs' own data files are removed once weights.data holds everything."""
    models = {g: onnx.load(str(paths[g]), load_external_data=False) for g in GRAPHS}
    folder = paths["encoder"].parent
    out, part = folder / SHARED_FILE, folder / (SHARED_FILE + ".partial")
    with _Sources(folder) as sources, open(part, "w+b") as f:
        weights = _WeightsFile(f, external_bytes)
        placed = {g: {} for g in GRAPHS}                                      # graph -> tensor name -> offset
        tensors = _store_common(models, min_bytes, weights, sources, placed)
        shared = {t["name"] for t in tensors}
        for g in GRAPHS:                                                      # the rest of the large weights
            views, parts = _views(models[g]), []
            for tensor in models[g].graph.initializer:
                if tensor.name in shared:
                    continue
                if tensor.name in views:
                    parts.append(tensor)
                    continue
                data = sources.read(tensor)
                if len(data) >= external_bytes:
                    placed[g][tensor.name] = weights.place(data)
                    _point(tensor, placed[g][tensor.name], len(data))
                elif tensor.data_location == onnx.TensorProto.EXTERNAL:       # small: back inside the graph
                    _inline(tensor, data)
            for tensor in parts:                                              # after the tensors they are part of
                _store_view(tensor, views[tensor.name], placed[g], weights, sources, external_bytes)
        stale = sources.files() - {out}
    if weights.offset == 0:                                                   # nothing large, nothing common
        part.unlink()
        out.unlink(missing_ok=True)
    else:
        part.replace(out)
    for g in GRAPHS:
        onnx.save(models[g], str(paths[g]))
    for path in stale:
        path.unlink()
    if weights.offset == 0:
        return None
    return {"file": SHARED_FILE, "sha256": sha256_file(out), "bytes": out.stat().st_size, "tensors": tensors}


def save_graph(model, path: Path) -> None:
    """Save an onnx_ir model with its weights in a data file beside it (GRAPH.onnx.data), never inside one protobuf
    message (which holds at most 2 GB); share_weights then gathers them into weights.data."""
    import onnx_ir as ir

    data = graph_data(path)
    data.unlink(missing_ok=True)                                  # ir.save appends to an existing file
    ir.save(model, path, external_data=data.name, size_threshold_bytes=MIN_BYTES)


def graph_data(path: Path) -> Path:
    """The data file save_graph writes beside a graph."""
    return path.with_name(path.name + ".data")


class _Sources:
    """A tensor's bytes wherever its graph keeps them: inside the protobuf, or in an external data file of the
    folder (mapped, read a tensor at a time)."""

    def __init__(self, folder: Path):
        self.folder, self.maps = folder, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f, m in self.maps.values():
            m.close()
            f.close()

    def files(self) -> set[Path]:
        return set(self.maps)

    def read(self, tensor: onnx.TensorProto) -> bytes:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            if not tensor.HasField("raw_data") and tensor.data_type != onnx.TensorProto.STRING:
                tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
            return tensor.raw_data
        info = {e.key: e.value for e in tensor.external_data}
        path = self.folder / info["location"]
        if path not in self.maps:
            f = open(path, "rb")
            self.maps[path] = (f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        start = int(info.get("offset", 0))
        end = start + int(info["length"]) if "length" in info else len(self.maps[path][1])
        return self.maps[path][1][start:end]


def _inline(tensor: onnx.TensorProto, data: bytes) -> None:
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = data


class _WeightsFile:
    """The weights file being written: each tensor's bytes at an aligned offset (a page for large ones)."""

    def __init__(self, f, external_bytes: int):
        self.f, self.external_bytes, self.offset = f, external_bytes, 0

    def place(self, data: bytes) -> int:
        """Append `data`; returns the offset it starts at."""
        pad = -self.offset % (PAGE if len(data) >= self.external_bytes else ALIGN)
        self.f.write(b"\0" * pad)
        self.f.write(data)
        start, self.offset = self.offset + pad, self.offset + pad + len(data)
        return start

    def read(self, start: int, length: int) -> bytes:
        """`length` bytes written from `start` (fewer where the file ends before)."""
        self.f.flush()
        return os.pread(self.f.fileno(), length, start)


def _point(tensor: onnx.TensorProto, start: int, length: int) -> None:
    """Make `tensor` read its values from the weights file at [start, start + length)."""
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", SHARED_FILE), ("offset", str(start)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _views(model: onnx.ModelProto) -> dict[str, dict]:
    """{initializer: {"tensor": name, "offset": bytes}}: the initializers whose bytes are a part of another one's
    (exporters/tied_table), taken out of the model's metadata."""
    entry = next((e for e in model.metadata_props if e.key == VIEWS), None)
    if entry is None:
        return {}
    model.metadata_props.remove(entry)
    return json.loads(entry.value)


def _store_view(tensor: onnx.TensorProto, view: dict, placed: dict, weights: _WeightsFile, sources: _Sources,
                external_bytes: int) -> None:
    """Point a part of another tensor at that tensor's bytes in the weights file (stored once), where it was
    placed there and the bytes are the same; else store it like any other tensor."""
    data = sources.read(tensor)
    if view["tensor"] in placed:                                      # (placed: names before sharing)
        start = placed[view["tensor"]] + int(view["offset"])
        if int(view["offset"]) >= 0 and weights.read(start, len(data)) == data:     # the bytes written there
            _point(tensor, start, len(data))
            return
        raise ValueError(f"initializer {tensor.name} is not the part of {view['tensor']} its metadata says; "
                         f"this is a bug in onnxformer: please report it")
    if len(data) >= external_bytes:
        _point(tensor, weights.place(data), len(data))
    elif tensor.data_location == onnx.TensorProto.EXTERNAL:
        _inline(tensor, data)


def _store_common(models: dict, min_bytes: int, weights: _WeightsFile, sources: _Sources,
                  placed: dict) -> list[dict]:
    """Write each tensor found in both graphs (>= min_bytes) once, both graphs reading it under one name; returns
    the manifest's records of them."""
    index = {g: {} for g in GRAPHS}
    for g, model in models.items():
        for tensor in model.graph.initializer:
            data = sources.read(tensor)
            if len(data) >= min_bytes:
                index[g].setdefault(_digest(tensor, data), tensor)
    common = [d for d in index["encoder"] if d in index["decoder"]]
    taken = {g: _names(models[g].graph) for g in GRAPHS}
    tensors = []
    for digest in common:
        first = index["encoder"][digest]
        name = _shared_name(digest, index, taken)
        data = sources.read(first)
        start = weights.place(data)
        for g in GRAPHS:
            tensor = index[g][digest]
            placed[g][tensor.name] = start
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


def inline_external(model, copy: bool = False) -> None:
    """Give every initializer of an onnx_ir model read from external data (a bundle's weights.data) its values
    in memory, so that saving the model elsewhere writes them into the new file instead of a dangling reference.
    The values stay mapped from the file unless `copy` (a file about to be removed)."""
    import onnx_ir as ir

    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            values = value.const_value.numpy()
            value.const_value = ir.tensor(np.array(values) if copy else values, name=value.name)


def shared_bytes(record: dict | None) -> int:
    """Bytes stored once instead of twice (the tensors both graphs read)."""
    return sum(t["length"] for t in (record or {}).get("tensors", []))


__all__ = ["share_weights", "shared_bytes", "inline_external", "save_graph", "graph_data", "SHARED_FILE"]
