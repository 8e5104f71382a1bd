"""Models past protobuf's 2 GB: export, optimize (fp32 and int8) and generate never put a graph's weights inside
one protobuf message, so the 2 GB limit of a message never applies to them.

A small model proves it without gigabytes: every onnx.ModelProto serialized during the run (onnx.save, the
checker, shape inference, the quantizer: all serialize through SerializeToString) must stay under a limit smaller
than the model's embedding, which any graph carrying its weights inside would pass. The real shape (NLLB-600M,
2.5 GB of float32 weights) runs in benchmarks/big_models.sh with its peak memory recorded.
"""

from __future__ import annotations

import onnx
import pytest
import torch

from exporters.export import export_model
from exporters.optimize import optimize_bundle
from runtime.bundle import load_bundle
from runtime.generate import generate_ids
from runtime.manifest import read_manifest, verify_hashes
from runtime.search import SearchOptions
from toolkit.reference.config import preset
from toolkit.reference.model import Transformer

VOCAB, D_MODEL = 8192, 64
LIMIT = VOCAB * D_MODEL * 4 // 2          # half the float32 embedding: a graph holding it inside is over


@pytest.fixture
def capped(monkeypatch):
    """Fail any serialization of a ModelProto over LIMIT bytes; returns the sizes serialized."""
    real, sizes = onnx.ModelProto.SerializeToString, []

    def serialize(self, *args, **kwargs):
        size = self.ByteSize()
        sizes.append(size)
        assert size <= LIMIT, f"a ModelProto of {size} bytes was serialized (weights inside the message)"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", serialize)
    return sizes


@pytest.fixture(scope="module")
def wide_model():
    torch.manual_seed(0)
    config = preset("tiny", vocab_size=VOCAB, d_model=D_MODEL, n_heads=4, d_ff=128, dropout=0.0)
    return Transformer(config).eval()


def only_shared_weights(bundle) -> None:
    """The bundle keeps its weights in weights.data only: no graph's own data file left, every graph small."""
    names = {p.name for p in bundle.iterdir()}
    assert "weights.data" in names and not any(n.endswith(".onnx.data") for n in names), names
    for g in ("encoder", "decoder"):
        assert (bundle / f"{g}.onnx").stat().st_size < LIMIT
    verify_hashes(bundle, read_manifest(bundle))


def test_export_and_optimize_keep_every_protobuf_small(wide_model, capped, tmp_path):
    exported = export_model(wide_model, tmp_path / "fp32")
    only_shared_weights(exported)
    fused, _ = optimize_bundle(exported, tmp_path / "fused")
    int8, report = optimize_bundle(exported, tmp_path / "int8", precision="int8", samples=8, allow_unverified=True)
    for bundle in (fused, int8):
        only_shared_weights(bundle)
    assert "quantize_int8" in report.passes and max(capped) <= LIMIT
    rng = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (n,), generator=rng).tolist() for n in (5, 9, 7, 12)]
    opts = SearchOptions(max_new_tokens=8)
    outputs = {b.name: [h[0].tokens for h in generate_ids(load_bundle(b).engine, seqs, opts)]
               for b in (exported, fused, int8)}
    assert len({tuple(t) for t in outputs["fp32"]}) > 1                 # the reference outputs vary
    assert outputs["fused"] == outputs["fp32"]
    assert all(len(t) > 0 for t in outputs["int8"])
