"""Validation of exported graphs: the onnx checker (full check, strict shape inference) and spec-vs-graph."""

from __future__ import annotations

from pathlib import Path

import onnx

from exporters.bundle import tensor_specs
from runtime.errors import OnnxformerError
from runtime.spec import GraphSpec


class GraphCheckError(OnnxformerError):
    """An exported graph that fails the onnx checker or does not match its spec: an exporter bug (exit 1)."""

    exit_code = 1


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
    it with its spec."""
    path = Path(path)
    try:
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path))
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GraphCheckError(f"{path.name} fails the onnx checker: {first}") from exc
    if spec is not None:
        problems = interface_problems(model, spec)
        if problems:
            raise GraphCheckError(f"{path.name} does not match its graph spec: " + "; ".join(problems))
    return model
