"""exporters/tied_table: the 8-bit tied table read by rows, its projection by row slices stored as the table's own
bytes, and runtime/bundle.LookupPages."""

from __future__ import annotations

import mmap

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from exporters.shared_weights import save_graph, share_weights
from exporters.tied_table import VIEWS, TiedTablePass, slice_rows

V, D = 1000, 16                       # 16 bytes a row: a slice starts every 256 rows (a page)


def _models(scales: str, seed: int = 0) -> dict[str, onnx.ModelProto]:
    """int8_embedding's form: an encoder that looks tokens up in Q^T [D, V], a decoder that also projects on it."""
    rng = np.random.default_rng(seed)
    qt = rng.integers(-127, 128, size=(D, V), dtype=np.int8)
    inits = [numpy_helper.from_array(qt, "table")]
    if scales == "scalar":
        inits.append(numpy_helper.from_array(np.array(1.0, np.float32), "unit"))
        product = ["x", "table", "unit"]
    else:                             # per column, with zero points
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 2, V).astype(np.float32), "col_scale"))
        inits.append(numpy_helper.from_array(rng.integers(-3, 4, V).astype(np.int8), "col_zero"))
        product = ["x", "table", "col_scale", "col_zero"]
    lookup = [helper.make_node("Gather", ["table", "ids"], ["g"], axis=1),
              helper.make_node("Transpose", ["g"], ["gt"], perm=[1, 2, 0]),
              helper.make_node("Cast", ["gt"], ["emb"], to=TP.FLOAT)]
    ids = helper.make_tensor_value_info("ids", TP.INT64, ["b", "t"])
    x = helper.make_tensor_value_info("x", TP.FLOAT, ["b", "t", D])
    emb = helper.make_tensor_value_info("emb", TP.FLOAT, None)
    logits = helper.make_tensor_value_info("logits", TP.FLOAT, None)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    encoder = helper.make_graph(lookup, "encoder", [ids], [emb], inits[:1])
    decoder = helper.make_graph(lookup + [helper.make_node("DynamicQuantizeMatMul", product, ["logits"],
                                                           domain="com.microsoft")],
                                "decoder", [ids, x], [emb, logits], inits)
    return {g: helper.make_model(m, opset_imports=opsets) for g, m in (("encoder", encoder), ("decoder", decoder))}


def _run(model, feeds: dict, path: str | None = None) -> list[np.ndarray]:
    source = path or model.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, feeds)


def _rows(model: onnx.ModelProto, slice_bytes: int) -> tuple[onnx.ModelProto, TiedTablePass]:
    step = TiedTablePass(slice_bytes)
    converted = ir.from_proto(model)
    step(converted)
    return ir.to_proto(converted), step


def _feeds(batch: int, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {"ids": rng.integers(0, V, size=(batch, 3)), "x": rng.standard_normal((batch, 3, D), dtype=np.float32)}


@pytest.mark.parametrize("scales", ["scalar", "per-column"])
@pytest.mark.parametrize("slice_bytes", [4096, 1 << 20])
def test_rows_give_bit_identical_lookups_and_logits(scales, slice_bytes):
    decoder = _models(scales)["decoder"]
    after, step = _rows(decoder, slice_bytes)
    ops = [n.op_type for n in after.graph.node]
    slices = slice_rows(V, D, slice_bytes)
    assert ops.count("QGemm") == len(slices) == (4 if slice_bytes == 4096 else 1)
    assert "DynamicQuantizeMatMul" not in ops and "Transpose" not in ops
    assert step.counts["tied_table_lookup"] == 1 and step.counts["tied_table_projection"] == 1
    table = next(t for t in after.graph.initializer if list(t.dims) == [V, D])
    assert not [t for t in after.graph.initializer if list(t.dims) == [D, V]]          # Q^T is gone
    for batch in (1, 5):
        want, got = _run(decoder, _feeds(batch)), _run(after, _feeds(batch))
        assert all(np.array_equal(w, g) for w, g in zip(want, got))                      # bit for bit
    views = {e.key: e.value for e in after.metadata_props}[VIEWS]
    assert all(f'"tensor": "{table.name}"' in views for _ in slices)


def test_a_graph_whose_table_is_read_by_something_else_is_left_alone():
    decoder = _models("scalar")["decoder"]
    decoder.graph.node.append(helper.make_node("Identity", ["table"], ["copy"]))
    decoder.graph.output.append(helper.make_tensor_value_info("copy", TP.INT8, None))
    after, step = _rows(decoder, 4096)
    assert [n.op_type for n in after.graph.node] == [n.op_type for n in decoder.graph.node] and not step.changed


def test_the_slices_are_stored_as_the_tables_own_bytes(tmp_path):
    models = _models("scalar")
    for g, model in models.items():
        save_graph(ir.from_proto(_rows(model, 4096)[0]), tmp_path / f"{g}.onnx")
    record = share_weights({g: tmp_path / f"{g}.onnx" for g in models})
    (table,) = [t for t in record["tensors"] if t["dtype"] == "int8"]
    assert table["shape"] == [V, D] and table["graphs"] == ["encoder", "decoder"]
    assert record["bytes"] < V * D + 4 * 4096                              # the table once, not twice
    decoder = onnx.load(str(tmp_path / "decoder.onnx"), load_external_data=False)
    assert not [e for e in decoder.metadata_props if e.key == VIEWS]
    where = {t.name: {e.key: e.value for e in t.external_data} for t in decoder.graph.initializer}
    gemms = [n for n in decoder.graph.node if n.op_type == "QGemm"]
    starts = [int(where[n.input[3]]["offset"]) for n in gemms]
    assert starts == [table["offset"] + a * D for a, _ in slice_rows(V, D, 4096)]
    assert all(where[n.input[3]]["location"] == "weights.data" for n in gemms)
    want = _run(models["decoder"], _feeds(4))
    got = _run(None, _feeds(4), str(tmp_path / "decoder.onnx"))
    assert all(np.array_equal(w, g) for w, g in zip(want, got))


def test_a_view_whose_bytes_differ_from_its_table_is_a_bug_not_a_wrong_bundle(tmp_path):
    models = _models("scalar")
    for g, model in models.items():
        converted = ir.from_proto(_rows(model, 4096)[0])
        if g == "decoder":                                 # say the second slice starts one row later than it does
            views = converted.metadata_props[VIEWS].replace(f'"offset": {256 * D}', f'"offset": {257 * D}')
            converted.metadata_props[VIEWS] = views
        save_graph(converted, tmp_path / f"{g}.onnx")
    with pytest.raises(ValueError, match="is not the part of .* its metadata says"):
        share_weights({g: tmp_path / f"{g}.onnx" for g in models})


def _float_models(bias: bool = False, seed: int = 0) -> dict[str, onnx.ModelProto]:
    """A tied fp32 model's form: lookups Gather(T [V, D], ids), the decoder's projection MatMul(x, Transpose(T))."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((V, D), dtype=np.float32), "table")]
    ids = helper.make_tensor_value_info("ids", TP.INT64, ["b", "t"])
    x = helper.make_tensor_value_info("x", TP.FLOAT, ["b", "t", D])
    emb = helper.make_tensor_value_info("emb", TP.FLOAT, None)
    logits = helper.make_tensor_value_info("logits", TP.FLOAT, None)
    lookup = helper.make_node("Gather", ["table", "ids"], ["emb"])
    project = [helper.make_node("Transpose", ["table"], ["t"], perm=[1, 0]),
               helper.make_node("MatMul", ["x", "t"], ["raw" if bias else "logits"])]
    if bias:                                          # BART's final_logits_bias after the product
        inits.append(numpy_helper.from_array(rng.standard_normal(V, dtype=np.float32), "bias"))
        project.append(helper.make_node("Add", ["raw", "bias"], ["logits"]))
    opsets = [helper.make_opsetid("", 17)]
    encoder = helper.make_graph([lookup], "encoder", [ids], [emb], inits[:1])
    decoder = helper.make_graph([lookup, *project], "decoder", [ids, x], [emb, logits], inits)
    return {g: helper.make_model(m, opset_imports=opsets) for g, m in (("encoder", encoder), ("decoder", decoder))}


def _float_rows(model: onnx.ModelProto, float_slice_bytes: int) -> tuple[onnx.ModelProto, TiedTablePass]:
    step = TiedTablePass(floats=True, float_slice_bytes=float_slice_bytes)
    converted = ir.from_proto(model)
    step(converted)
    return ir.to_proto(converted), step


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("slice_bytes", [16384, 1 << 20])
def test_fp32_projection_by_row_slices_gives_bit_identical_logits(bias, slice_bytes):
    decoder = _float_models(bias)["decoder"]
    after, step = _float_rows(decoder, slice_bytes)
    ops = [n.op_type for n in after.graph.node]
    slices = slice_rows(V, D * 4, slice_bytes)
    assert ops.count("Gemm") == len(slices) == (4 if slice_bytes == 16384 else 1)
    assert "Transpose" not in ops and "MatMul" not in ops and ops.count("Gather") == 1
    assert step.counts["tied_table_float_projection"] == 1 and step.changed
    for batch in (1, 5):
        want, got = _run(decoder, _feeds(batch)), _run(after, _feeds(batch))
        assert all(np.array_equal(w, g) for w, g in zip(want, got))                      # bit for bit
    views = {e.key: e.value for e in after.metadata_props}[VIEWS]
    assert views.count('"tensor": "table"') == len(slices)


def test_fp32_slices_are_stored_as_the_tables_own_bytes_and_int8_passes_leave_floats_alone(tmp_path):
    models = _float_models()
    assert not TiedTablePass()(ir.from_proto(models["decoder"])).modified        # without floats: as it was
    for g, model in models.items():
        save_graph(ir.from_proto(_float_rows(model, 16384)[0]), tmp_path / f"{g}.onnx")
    record = share_weights({g: tmp_path / f"{g}.onnx" for g in models})
    assert record["bytes"] < V * D * 4 + 4 * 4096                          # the table once
    decoder = onnx.load(str(tmp_path / "decoder.onnx"), load_external_data=False)
    where = {t.name: {e.key: e.value for e in t.external_data} for t in decoder.graph.initializer}
    starts = [int(where[n.input[1]]["offset"]) for n in decoder.graph.node if n.op_type == "Gemm"]
    table = int(where["table"]["offset"])
    assert starts == [table + a * D * 4 for a, _ in slice_rows(V, D * 4, 16384)]
    want = _run(models["decoder"], _feeds(3))
    got = _run(None, _feeds(3), str(tmp_path / "decoder.onnx"))
    assert all(np.array_equal(w, g) for w, g in zip(want, got))


def test_fp32_table_read_by_something_else_is_left_alone():
    decoder = _float_models()["decoder"]
    decoder.graph.node.append(helper.make_node("Identity", ["table"], ["copy"]))
    decoder.graph.output.append(helper.make_tensor_value_info("copy", TP.FLOAT, None))
    after, step = _float_rows(decoder, 16384)
    assert [n.op_type for n in after.graph.node] == [n.op_type for n in decoder.graph.node] and not step.changed


def _resident_kib(address: int) -> int:
    """Rss of the mapping that starts at `address`, from /proc/self/smaps."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-")[0] == f"{address:x}" or line.split("-")[0] == f"{address:08x}":
            return next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("Rss:"))
    raise AssertionError("mapping not found")


def test_lookup_pages_gives_a_tables_pages_back(tmp_path):
    from runtime.bundle import LookupPages

    path = tmp_path / "table.bin"
    path.write_bytes(np.arange(8 << 20, dtype=np.uint32).tobytes())      # 32 MiB
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapped, np.uint32)
    address = view.ctypes.data                                           # where the mapping starts
    assert int(view[::1024].sum()) > 0                                   # a read on every page
    before = _resident_kib(address)
    LookupPages(mapped, [(0, 16 << 20)]).give_back()                     # the first half
    after = _resident_kib(address)
    assert before >= 30 * 1024 and before - after >= 15 * 1024
    assert int(view[::1024].sum()) == int(np.arange(0, 8 << 20, 1024, dtype=np.uint64).sum())   # still the file
    del view
    mapped.close()


def test_fp32_table_without_lookups_is_left_alone():
    """Only a tied table (read by lookups too) is sliced: the slices are views of bytes the bundle keeps anyway."""
    decoder = _float_models()["decoder"]
    decoder.graph.node.remove(decoder.graph.node[0])                 # the Gather
    decoder.graph.output.remove(decoder.graph.output[0])
    after, step = _float_rows(decoder, 16384)
    assert [n.op_type for n in after.graph.node] == ["Transpose", "MatMul"] and not step.changed
