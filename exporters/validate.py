"""Validation of exported graphs: the onnx checker (full check, strict shape inference), spec-vs-graph, and finite
weights (export and optimize refuse a graph whose initializers hold NaN or Inf)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from exporters.bundle import tensor_specs
from runtime.errors import OnnxformerError
from runtime.spec import GraphSpec


class GraphCheckError(OnnxformerError):
    """An exported graph that fails the onnx checker or does not match its spec: an exporter bug (exit 1)."""

    exit_code = 1


class NonFiniteWeightsError(OnnxformerError):
    """A graph whose weights hold NaN or Inf: every output would be garbage, so nothing is written (exit 2)."""


def check_finite(weights: Iterable[tuple[str, np.ndarray]], graph: str) -> None:
    """Refuse the first float weight (name, values) that holds a NaN or an Inf, naming it."""
    for name, values in weights:
        if values.dtype.kind == "f" and not finite(values):
            bad = int(np.size(values) - np.isfinite(values).sum())
            raise NonFiniteWeightsError(f"{graph}: weight {name} holds {bad} NaN/Inf value(s), so every output would "
                                        f"be garbage; fix the checkpoint's weights (or choose a precision whose range "
                                        f"holds them) and run again; nothing was written")


def finite(values: np.ndarray, chunk: int = 1 << 24) -> bool:
    """Whether every value is finite, a slice at a time (isfinite's mask of a 1 GB embedding would be 256 MB)."""
    flat = values.reshape(-1)
    return all(bool(np.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.size, chunk))


def proto_weights(model: onnx.ModelProto, base_dir: str | Path = "") -> Iterable[tuple[str, np.ndarray]]:
    """(name, values) of an onnx graph's initializers, one at a time. External data is mapped read-only from
    base_dir, not read: file pages the kernel can drop, where a read copy of a large embedding would be heap."""
    for t in model.graph.initializer:
        yield t.name, mapped_array(t, Path(base_dir)) if uses_external_data(t) else numpy_helper.to_array(t)


def uses_external_data(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


def mapped_array(t: onnx.TensorProto, base_dir: Path) -> np.ndarray:
    """An external tensor's values as a read-only np.memmap of its data file (onnx's location/offset/length)."""
    info = {e.key: e.value for e in t.external_data}
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
    shape = tuple(t.dims)
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return np.zeros(shape, dtype)
    return np.memmap(base_dir / info["location"], dtype=dtype, mode="r", offset=int(info.get("offset", 0)),
                     shape=shape)


def ir_weights(model: ir.Model) -> Iterable[tuple[str, np.ndarray]]:
    """(name, values) of an onnx_ir graph's initializers."""
    return ((name, v.const_value.numpy()) for name, v in model.graph.initializers.items() if v.const_value is not None)


def interface_problems(model: onnx.ModelProto, spec: GraphSpec) -> list[str]:
    """Differences between a graph's real inputs/outputs and its spec: names, order, dtypes, symbolic dims."""
    problems = []
    for kind, values, wanted in (("input", model.graph.input, spec.inputs), ("output", model.graph.output, spec.outputs)):
        real = tensor_specs(values)
        names, want_names = [t["name"] for t in real], [t.name for t in wanted]
        if names != want_names:
            missing, extra = sorted(set(want_names) - set(names)), sorted(set(names) - set(want_names))
            problems.append(f"{kind}s differ from the spec (missing {missing}, unexpected {extra}, "
                            f"or out of order)")
            continue
        for got, want in zip(real, wanted):
            if got["dtype"] != want.dtype:
                problems.append(f"{kind} {want.name} has dtype {got['dtype']}, spec says {want.dtype}")
            if list(got["shape"]) != list(want.shape):
                problems.append(f"{kind} {want.name} has shape {got['shape']}, spec says {list(want.shape)}")
    return problems


def check_graph(path: str | Path, spec: GraphSpec | None = None) -> onnx.ModelProto:
    """Run onnx.checker (full check: includes strict, type-checked shape inference) on a saved graph, then compare
    it with its spec. The weights are not loaded: read them with proto_weights(model, path.parent)."""
    path = Path(path)
    try:
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path), load_external_data=False)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GraphCheckError(f"{path.name} fails the onnx checker: {first}") from exc
    if spec is not None:
        problems = interface_problems(model, spec)
        if problems:
            raise GraphCheckError(f"{path.name} does not match its graph spec: " + "; ".join(problems))
    return model
