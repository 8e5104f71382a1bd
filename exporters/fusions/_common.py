"""Helpers shared by the fusion rules: shape checks, constants, and the attention bias built once per graph."""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

Dim = Union[int, ir.SymbolicDim, None]

# a masked-out score must be at least this negative for `score + fill` to act like `fill` under softmax
MASK_FILL_LIMIT = -1e4


def dims_match(bindings: dict[str, Dim], value: ir.Value | None, dims: Sequence[str]) -> bool:
    """True when value's shape has rank len(dims) and agrees with the dims already bound (binding new ones).

    A dim spelled as a digit string ("1") must equal that integer; "_" matches anything.
    """
    if value is None or value.shape is None or value.shape.rank() != len(dims):
        return False
    for actual, name in zip(value.shape, dims):
        if name == "_":
            continue
        if name.isdigit():
            if actual != int(name):
                return False
        elif name not in bindings:
            bindings[name] = actual
        elif actual != bindings[name]:
            return False
    return True


def require_dims(result: pattern.MatchResult, bindings: dict, value: ir.Value | None, dims: Sequence[str],
                 what: str) -> bool:
    """dims_match, recording a readable failure on `result` (for MatchingTracer) when it does not hold."""
    if dims_match(bindings, value, dims):
        return True
    shape = None if value is None else value.shape
    result.fail(f"{what}: shape {shape} is not [{', '.join(dims)}]", value)
    return False


def scalar(value: ir.Value | None) -> float | None:
    """The float value of a constant with a single element (initializer or Constant node), else None."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    array = tensor.numpy()
    return float(array.reshape(-1)[0]) if array.size == 1 else None


def float_dtype(value: ir.Value) -> np.dtype | None:
    """The numpy float dtype of a value (the graph's float type where that value lives), or None."""
    if value.dtype is None or not value.dtype.is_floating_point():
        return None
    return value.dtype.numpy()


def constant(op, array: np.ndarray) -> ir.Value:
    """A Constant node; small constants are merged across layers by common-subexpression elimination."""
    return op.Constant(value=ir.tensor(np.asarray(array)))


def length_of(op, value: ir.Value, axis: int) -> ir.Value:
    """A 1-element int64 tensor holding value.shape[axis], taken from a value shared by all layers when possible.

    A symbolic dim is read from the graph input that declares it (so every layer computes the same node,
    which CSE then keeps once); a fixed dim becomes a constant; otherwise the value's own shape is used.
    """
    dim = value.shape[axis] if value.shape is not None and value.shape.rank() > axis else None
    if isinstance(dim, int):
        return constant(op, np.array([dim], dtype=np.int64))
    graph = value.graph
    if dim is not None and dim.value is not None and graph is not None:
        for graph_input in graph.inputs:
            for i, d in enumerate(graph_input.shape or ()):
                if isinstance(d, ir.SymbolicDim) and d.value == dim.value:
                    return op.Shape(graph_input, start=i, end=i + 1)
    return op.Shape(value, start=axis, end=axis + 1)
