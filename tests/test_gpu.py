"""The CUDA path: fp32 and fp16 bundles on the CUDA execution provider, with IO binding keeping the cache on the GPU.

Marked `gpu`; every test skips cleanly where onnxruntime has no CUDAExecutionProvider (CI, this machine).
scripts/gpu_check.sh runs them on a machine with an NVIDIA GPU.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs onnxruntime-gpu with a CUDA device")]


@pytest.fixture(scope="module")
def toy(toy_exported):
    from toolkit.reference.checkpoint import load_checkpoint
    from toolkit.testing.toy import toy_inputs

    checkpoint, bundle = toy_exported
    ckpt = load_checkpoint(checkpoint)
    return ckpt.model, bundle, toy_inputs(ckpt.config, 24, seed=3)


@pytest.fixture(scope="module")
def optimized(toy, tmp_path_factory):
    """Fused fp32 and fp16 bundles for the CUDA target."""
    from exporters.optimize import optimize_bundle

    _, bundle, _ = toy
    root = tmp_path_factory.mktemp("cuda_bundles")
    fp32, _ = optimize_bundle(bundle, root / "fused", target="cuda", precision="fp32")
    fp16, _ = optimize_bundle(bundle, root / "fp16", target="cuda", precision="fp16")
    return {"fp32": fp32, "fp16": fp16}


def _tokens(engine, seqs, beam=1):
    from runtime.generate import generate_ids
    from runtime.search import SearchOptions

    return [h[0].tokens for h in generate_ids(engine, seqs, SearchOptions(max_new_tokens=16, beam=beam))]


def test_auto_picks_cuda_and_binds_the_cache_on_the_device(toy):
    from runtime.bundle import load_bundle

    _, bundle, seqs = toy
    loaded = load_bundle(bundle, provider="auto")
    assert loaded.provider == "cuda" and loaded.engine.io_binding
    state = loaded.engine.start(*_padded(seqs[:3]), expand=1)
    state.step(np.full(3, loaded.engine.bos_id), None)
    assert all(v.device_name().lower() == "cuda" for v in state.past + state.cross)


def _padded(seqs):
    from runtime.generate import pad_batch

    return pad_batch(seqs, 0)


@pytest.mark.parametrize("beam", [1, 4])
def test_cuda_fp32_tokens_equal_pytorch(toy, beam):
    from runtime.bundle import load_bundle
    from toolkit.reference.torch_engine import TorchEngine

    model, bundle, seqs = toy
    reference = _tokens(TorchEngine(model), seqs, beam)
    assert len({tuple(t) for t in reference}) > len(seqs) // 2, "reference outputs must vary across inputs"
    assert _tokens(load_bundle(bundle, provider="cuda").engine, seqs, beam) == reference


@pytest.mark.parametrize("variant", ["exported", "fused"])
def test_cuda_fp32_graph_parity(toy, optimized, variant):
    from toolkit.parity.graphs import graph_parity

    model, bundle, _ = toy
    report = graph_parity(model, bundle if variant == "exported" else optimized["fp32"], provider="cuda",
                          precision="fp32")
    assert report.ok, str(report)


def test_cuda_fp16_parity_within_the_fp16_row(toy, optimized):
    from runtime.bundle import load_bundle
    from toolkit.parity.generation import generation_parity
    from toolkit.parity.graphs import graph_parity
    from toolkit.parity.tolerances import tolerance
    from toolkit.reference.torch_engine import TorchEngine

    model, _, seqs = toy
    graphs = graph_parity(model, optimized["fp16"], provider="cuda", precision="fp16")
    assert graphs.ok, str(graphs)
    tokens = generation_parity(TorchEngine(model), load_bundle(optimized["fp16"], provider="cuda").engine, seqs,
                               tolerance("fp16", "cuda"), "cuda", "fp16")
    assert tokens.ok, tokens.table()


@pytest.mark.parametrize("beam", [1, 4])
def test_cuda_static_cache_tokens_equal_pytorch(toy, beam, tmp_path_factory):
    """--kv-cache static for CUDA: the buffers live on the device and beams gather them there."""
    from exporters.optimize import optimize_bundle
    from runtime.bundle import load_bundle
    from toolkit.reference.torch_engine import TorchEngine

    model, bundle, seqs = toy
    static, report = optimize_bundle(bundle, tmp_path_factory.mktemp("cuda_static") / "b", target="cuda",
                                     kv_cache="static")
    assert report.kv_cache == "static"
    engine = load_bundle(static, provider="cuda").engine
    assert engine.static_cache
    state = engine.start(*_padded(seqs[:3]), expand=1)
    state.step(np.full(3, engine.bos_id), None)
    assert all(v.device_name().lower() == "cuda" for v in state.past.buffers + state.cross)
    assert _tokens(engine, seqs, beam) == _tokens(TorchEngine(model), seqs, beam)
