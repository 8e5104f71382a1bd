"""The runtime: bundles load with every check, and ONNX Runtime generates exactly PyTorch's tokens (fp32, CPU).

Two trained toy models cover the configurations: the shared one (post-norm, ReLU, tied, head_dim 8) and a
pre-norm, GELU, untied one with an odd head_dim (9). Each is compared greedy and beam, on the plain
(session.run) and the IO-binding data path, on padded batches of varied lengths.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from runtime.bundle import load_bundle
from runtime.errors import BundleError, InputError, ProviderError
from runtime.generate import generate_ids, to_outputs
from runtime.manifest import FORMAT_VERSION, file_entries, read_manifest, sha256_file, verify_hashes
from runtime.ort_engine import default_io_binding
from runtime.search import SearchOptions
from runtime.session import FLOAT, INT64, SessionConfig, choose_provider, gather_model, make_session
from toolkit.testing.toy import toy_inputs
from toolkit.reference.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parents[1]
DATES = ROOT / "examples" / "dates" / "checkpoint"
HAS_CUDA = "CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers()
PATHS = {"plain": False, "iobinding": True}


@pytest.fixture(scope="module")
def variant(toy_model_factory, tmp_path_factory):
    """Pre-norm, GELU, untied, head_dim 9 (d_model 36, 4 heads): trained and exported once."""
    from exporters.export import export_model

    model = toy_model_factory(norm="pre", activation="gelu", tie_embeddings=False, d_model=36, n_heads=4)
    return model, export_model(model, tmp_path_factory.mktemp("variant") / "bundle", check_parity=False)


@pytest.fixture(scope="module")
def toy_model(toy_model_factory):
    """The model inside the shared toy bundle (post-norm, ReLU, tied, head_dim 8)."""
    return toy_model_factory()


@pytest.fixture(scope="module")
def models(toy_model, toy_exported, variant):
    """{name: (PyTorch model, bundle dir)} for the configurations under test."""
    return {"post-relu-tied-hd8": (toy_model, toy_exported[1]), "pre-gelu-untied-hd9": variant}


@pytest.fixture(scope="module")
def bundle(toy_exported):
    return toy_exported[1]


@pytest.fixture(scope="module")
def engines(bundle, tmp_path_factory):
    """The toy bundle loaded once per data path (shared, as a server would share it), and its fused
    static-cache optimization (runtime/static_cache.py's data path)."""
    from exporters.optimize import optimize_bundle

    loaded = {name: load_bundle(bundle, provider="cpu", io_binding=iob).engine for name, iob in PATHS.items()}
    static, _ = optimize_bundle(bundle, tmp_path_factory.mktemp("static") / "fused")
    loaded["static"] = load_bundle(static, provider="cpu").engine
    assert loaded["static"].static_cache
    return loaded


def tokens_of(hyps) -> list[list[list[int]]]:
    return [[h.tokens for h in per_input] for per_input in hyps]


def assert_same(reference, got, score_atol: float = 1e-4) -> None:
    """Identical tokens and finished flags; scores equal up to float32 noise."""
    assert tokens_of(got) == tokens_of(reference)
    assert [[h.finished for h in p] for p in got] == [[h.finished for h in p] for p in reference]
    np.testing.assert_allclose([h.score for p in got for h in p], [h.score for p in reference for h in p],
                               atol=score_atol, rtol=0)


# ------------------------------------------------------------------------------------------ parity

@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("name", ["post-relu-tied-hd8", "pre-gelu-untied-hd9"])
def test_tokens_equal_pytorch(models, name, beam, path):
    model, bundle_dir = models[name]
    seqs = toy_inputs(model.config, 24, min_len=1, max_len=12, seed=7)     # one padded batch, lengths 1..12
    opts = SearchOptions(max_new_tokens=16, beam=beam, num_return=min(beam, 2))
    reference = generate_ids(TorchEngine(model), seqs, opts)
    best = [p[0].tokens for p in reference]
    assert len({tuple(t) for t in best}) > len(seqs) // 2, "reference outputs barely depend on the input"
    assert any(len(set(t)) > 2 for t in best), "reference outputs repeat one token"
    got = generate_ids(load_bundle(bundle_dir, provider="cpu", io_binding=PATHS[path]).engine, seqs, opts)
    assert_same(reference, got)


@pytest.mark.parametrize("case", ["batch1", "batch64", "src_len1", "src_at_max", "new0", "new1", "long"])
def test_edge_cases_equal_pytorch(toy_model, engines, case):
    c = toy_model.config
    rng = np.random.default_rng(11)
    seqs = {"batch1": [[5, 9, 13]], "batch64": toy_inputs(c, 64, 1, 12, seed=3), "src_len1": [[7], [30], [4, 8]],
            "src_at_max": [rng.integers(3, c.vocab_size, c.max_len).tolist(), [6, 7]],
            "new0": [[5, 6], [7]], "new1": [[5, 6], [7]], "long": toy_inputs(c, 6, 1, 12, seed=5)}[case]
    new = {"new0": 0, "new1": 1, "long": c.max_len}.get(case, 16)
    for beam in (1, 2 if case == "batch64" else 3):
        opts = SearchOptions(max_new_tokens=new, beam=beam)
        reference = generate_ids(TorchEngine(toy_model), seqs, opts)
        for engine in engines.values():
            assert_same(reference, generate_ids(engine, seqs, opts))
        assert all(len(p[0].tokens) <= new for p in reference)
    if case == "batch64":                                    # inputs finish at different steps
        lengths = {len(p[0].tokens) for p in reference}
        assert len(lengths) > 2, lengths


def test_greedy_drops_finished_rows_and_moves_cross_kv_only_then(engines):
    """keep that only reorders within an input leaves cross K/V alone; dropping rows moves them."""
    engine = engines["plain"]
    ids, mask = np.array([[5, 6, 7], [8, 9, 0]]), np.array([[1, 1, 1], [1, 1, 0]])
    state = engine.start(ids, mask, expand=2)
    cross = state.cross
    state.step(np.array([1, 1, 1, 1]), None)
    state.step(np.array([5, 6, 7, 8]), np.array([1, 0, 3, 2]))         # beams swap within their input
    assert state.cross is cross and state.past[0].shape[0] == 4
    state.step(np.array([5, 6]), np.array([0, 3]))                     # rows from two inputs: still the same sources
    assert state.cross is not cross and state.mask.shape == (2, 3)
    np.testing.assert_array_equal(state.sources, [0, 1])


def test_iobinding_equals_plain_logits_step_by_step(engines):
    ids, mask = np.array([[5, 6, 7, 8], [9, 10, 0, 0]]), np.array([[1, 1, 1, 1], [1, 1, 0, 0]])
    states = {name: e.start(ids, mask, expand=2) for name, e in engines.items()}
    steps = [(np.array([1, 1, 1, 1]), None), (np.array([4, 5, 6, 7]), np.array([1, 0, 2, 3])),
             (np.array([8, 9]), np.array([0, 2])), (np.array([10]), np.array([1]))]
    for tokens, keep in steps:
        plain, bound = (states[n].step(tokens, keep) for n in ("plain", "iobinding"))
        assert plain.shape == (len(tokens), 64)
        np.testing.assert_array_equal(plain, bound)


def test_eight_threads_equal_one_thread(engines, toy_model):
    """One loaded bundle serving 8 threads at once gives each request what it gets alone."""
    requests = [(toy_inputs(toy_model.config, 5, 1, 12, seed=100 + i), SearchOptions(max_new_tokens=12, beam=1 + i % 3))
                for i in range(16)]
    for engine in engines.values():
        alone = [tokens_of(generate_ids(engine, seqs, opts)) for seqs, opts in requests]
        together: dict[int, list] = {}
        errors = []

        def worker(offset: int) -> None:
            try:
                for i in range(offset, len(requests), 8):
                    together[i] = tokens_of(generate_ids(engine, *requests[i]))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert [together[i] for i in range(len(requests))] == alone


def test_outputs_decode_text_with_the_bundle_tokenizer(bundle, toy_model):
    loaded = load_bundle(bundle, provider="cpu")
    assert loaded.tokenizer is not None and loaded.manifest["format_version"] == FORMAT_VERSION
    seqs = [loaded.tokenizer.encode("hello"), loaded.tokenizer.encode("Ab3")]
    outs = to_outputs(generate_ids(loaded.engine, seqs, SearchOptions(max_new_tokens=10)), 2, loaded.tokenizer)
    ref = to_outputs(generate_ids(TorchEngine(toy_model), seqs, SearchOptions(max_new_tokens=10)), 2, loaded.tokenizer)
    assert [o.text for o in outs] == [o.text for o in ref] and all(isinstance(o.text, str) for o in outs)


def test_ort_format_graphs_are_used_and_decode_identically(bundle, tmp_path, engines):
    import subprocess
    import sys

    copy = Path(shutil.copytree(bundle, tmp_path / "b"))
    subprocess.run([sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", str(copy)], check=True,
                   capture_output=True)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["ort_graphs"] = {name: {"file": f"{name}.ort", "sha256": sha256_file(copy / f"{name}.ort"),
                                     "bytes": (copy / f"{name}.ort").stat().st_size} for name in ("encoder", "decoder")}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="names encoder.ort but does not list it under 'files'"):
        load_bundle(copy, provider="cpu")
    manifest["files"] = file_entries(copy)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    loaded = load_bundle(copy, provider="cpu")
    assert loaded.files == {"encoder": "encoder.ort", "decoder": "decoder.ort"}
    seqs = [[5, 6, 7], [9, 30, 31, 40, 41]]
    for beam in (1, 4):
        opts = SearchOptions(max_new_tokens=12, beam=beam)
        assert_same(generate_ids(engines["plain"], seqs, opts), generate_ids(loaded.engine, seqs, opts), 1e-6)
    (copy / "decoder.ort").write_bytes((copy / "decoder.ort").read_bytes()[:-10])
    with pytest.raises(BundleError, match="decoder.ort"):
        load_bundle(copy, provider="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu with CUDAExecutionProvider")
@pytest.mark.parametrize("path", PATHS)
def test_cuda_tokens_equal_pytorch(models, path):
    """On CUDA the IO-binding path keeps cross K/V and the cache on the GPU; beams reorder there by Gather."""
    model, bundle_dir = models["post-relu-tied-hd8"]
    loaded = load_bundle(bundle_dir, provider="cuda", io_binding=PATHS[path])
    assert loaded.provider == "cuda" and loaded.engine.decoder.get_providers()[0] == "CUDAExecutionProvider"
    seqs = toy_inputs(model.config, 32, min_len=1, max_len=12, seed=9)
    for beam in (1, 4):
        opts = SearchOptions(max_new_tokens=16, beam=beam)
        assert tokens_of(generate_ids(loaded.engine, seqs, opts)) == tokens_of(generate_ids(TorchEngine(model), seqs, opts))


# ------------------------------------------------------------------------------------------ sessions

def test_provider_choice():
    assert choose_provider("auto") == ("cuda" if HAS_CUDA else "cpu")
    assert choose_provider("cpu") == "cpu"
    with pytest.raises(ProviderError, match="unknown provider 'tpu'"):
        choose_provider("tpu")


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has CUDA")
def test_cuda_without_cuda_names_what_is_missing(bundle):
    for call in (lambda: choose_provider("cuda"), lambda: load_bundle(bundle, provider="cuda")):
        with pytest.raises(ProviderError) as err:
            call()
        message = str(err.value)
        assert "CUDAExecutionProvider is not available" in message and "onnxruntime" in message
        assert "onnxruntime-gpu" in message and "CPUExecutionProvider" in message


def test_session_options_in_one_place():
    opts = SessionConfig().to_ort()
    assert opts.graph_optimization_level.name == "ORT_ENABLE_ALL"
    assert opts.execution_mode.name == "ORT_SEQUENTIAL"
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert not opts.enable_cpu_mem_arena and not opts.enable_mem_pattern      # a large model's peak: what a run needs
    assert SessionConfig(cpu_memory_arena=True, memory_pattern=True).to_ort().enable_mem_pattern
    custom = SessionConfig().with_(intra_op_threads=3, spinning=False, graph_optimization="basic").to_ort()
    assert custom.intra_op_num_threads == 3 and custom.graph_optimization_level.name == "ORT_ENABLE_BASIC"
    assert custom.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(ProviderError, match="graph optimization level"):
        SessionConfig(graph_optimization="max").to_ort()


def test_encoder_threads_do_not_spin(bundle):
    """The encoder runs once a request; its spinning threads would take the cores from the decoder's steps."""
    config = SessionConfig(intra_op_threads=2)
    assert config.for_graph("encoder").spinning is False and config.for_graph("decoder").spinning is True
    assert config.with_(encoder_spinning=True).for_graph("encoder").spinning is True
    engine = load_bundle(bundle, "cpu", threads=2).engine
    entry = "session.intra_op.allow_spinning"
    assert engine.encoder.get_session_options().get_session_config_entry(entry) == "0"
    assert engine.decoder.get_session_options().get_session_config_entry(entry) == "1"


def test_only_an_encoder_of_one_input_shape_keeps_the_arena(bundle):
    """An audio encoder's input has one shape (30 s of features): its session keeps ORT's arena, which then holds
    one run's buffers; a token encoder's shapes vary by request and its session, like every decoder's, has none."""
    config = SessionConfig()
    assert config.for_graph("encoder", fixed_input=True).to_ort().enable_cpu_mem_arena
    assert not config.for_graph("encoder").to_ort().enable_cpu_mem_arena
    assert not config.for_graph("decoder", fixed_input=True).to_ort().enable_cpu_mem_arena
    assert not config.with_(fixed_encoder_arena=False).for_graph("encoder", fixed_input=True).cpu_memory_arena
    engine = load_bundle(bundle, "cpu").engine                              # a text bundle: no arena anywhere
    assert not engine.encoder.get_session_options().enable_cpu_mem_arena
    assert not engine.decoder.get_session_options().enable_cpu_mem_arena


def test_default_data_path_per_provider():
    assert default_io_binding("cuda") is True and default_io_binding("cpu") is False


def test_gather_graph_is_valid_onnx_and_gathers_rows():
    import onnx

    model = gather_model([FLOAT, FLOAT, INT64], [4, 4, 2])
    onnx.checker.check_model(onnx.load_from_string(model), full_check=True)
    session = make_session(model, "cpu")
    rng = np.random.default_rng(0)
    x, empty, m = rng.standard_normal((5, 2, 3, 4), dtype=np.float32), np.zeros((5, 2, 0, 4), np.float32), \
        np.arange(10).reshape(5, 2)
    rows = np.array([4, 0, 0, 2])
    y, y_empty, y_m = session.run(None, {"x0": x, "x1": empty, "x2": m, "indices": rows})
    np.testing.assert_array_equal(y, x[rows])
    assert y_empty.shape == (4, 2, 0, 4)
    np.testing.assert_array_equal(y_m, m[rows])


# ------------------------------------------------------------------------------------------ bad input

@pytest.fixture
def bundle_copy(bundle, tmp_path) -> Path:
    return Path(shutil.copytree(bundle, tmp_path / "bundle"))


def edit_manifest(path: Path, change) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_tampered_graph_is_a_bundle_error(bundle_copy):
    data = bytearray((bundle_copy / "decoder.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF                                      # same size, one byte changed
    (bundle_copy / "decoder.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"decoder\.onnx does not match its sha256.*copy the bundle again or re-export"):
        load_bundle(bundle_copy, provider="cpu")


@pytest.mark.parametrize("field, change", [("n_heads", lambda v: v * 2), ("d_model", lambda v: v + 8),
                                           ("vocab_size", lambda v: v + 5), ("n_decoder_layers", lambda v: v + 1)])
def test_an_edited_model_config_is_refused_at_load(bundle_copy, field, change):
    """manifest.json is not in its own file list, so an edited model config passes the hash check: the config
    check against the graphs' fixed dims and cache layers refuses it at load, naming the field."""
    edit_manifest(bundle_copy, lambda m: m["model"].update({field: change(m["model"][field])}))
    verify_hashes(bundle_copy, read_manifest(bundle_copy))           # every file still matches its hash
    with pytest.raises(BundleError, match=rf"model config .*{field}.*copy the bundle again or re-export") as err:
        load_bundle(bundle_copy, provider="cpu")
    assert "\n" not in str(err.value)


def test_newer_format_version_is_a_bundle_error(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(BundleError, match="newer than this onnxformer reads"):
        load_bundle(bundle_copy, provider="cpu")


@pytest.mark.parametrize("name", ["encoder.onnx", "tokenizer.json", "manifest.json"])
def test_missing_file_is_a_bundle_error(bundle_copy, name):
    (bundle_copy / name).unlink()
    with pytest.raises(BundleError, match=name.replace(".", r"\.")):
        load_bundle(bundle_copy, provider="cpu")


def test_graph_interface_differing_from_manifest_is_a_bundle_error(bundle_copy):
    def swap(m):                                                      # hashes stay valid, interfaces do not
        m["graphs"]["encoder"]["file"], m["graphs"]["decoder"]["file"] = "decoder.onnx", "encoder.onnx"
        m["graphs"]["encoder"]["sha256"], m["graphs"]["decoder"]["sha256"] = \
            m["graphs"]["decoder"]["sha256"], m["graphs"]["encoder"]["sha256"]
        for g in m["graphs"].values():
            g.pop("bytes", None)
    edit_manifest(bundle_copy, swap)
    with pytest.raises(BundleError, match=r"graph inputs do not match the manifest.*re-export"):
        load_bundle(bundle_copy, provider="cpu")


def test_manifest_model_config_without_sizes_is_a_bundle_error(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m["model"].pop("n_heads"))
    with pytest.raises(BundleError, match="model config lacks n_heads"):
        load_bundle(bundle_copy, provider="cpu")


def test_manifest_interface_differing_from_config_is_a_bundle_error(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m["graphs"]["decoder"]["inputs"][0].update(name="tokens"))
    with pytest.raises(BundleError, match="decoder interface differs from the model config"):
        load_bundle(bundle_copy, provider="cpu")


@pytest.mark.parametrize("seqs, message", [
    ([[5, 64, 7]], r"input 0 has token id\(s\) \[64\] outside the source vocabulary"),
    ([[5], [-1]], r"input 1 has token id\(s\) \[-1\]"),
    ([[5], []], "input 1 is empty"),
    ([], "no inputs given"),
    ([[5] * 65], "more than the model's maximum source length 64"),
])
def test_bad_requests_are_input_errors(engines, seqs, message):
    with pytest.raises(InputError, match=message):
        generate_ids(engines["plain"], seqs, SearchOptions(max_new_tokens=4))


@pytest.mark.parametrize("args, message", [
    (["--ids", "5 64"], "outside the source vocabulary"),
    (["--ids", " ".join(["5"] * 65)], "maximum source length"),
    (["--ids", "5", "--beam", "2", "--num-return", "3"], "number of returned hypotheses"),
])
def test_generate_cli_bad_input_exits_2(bundle, args, message):
    from toolkit.apps.cli import main

    result = CliRunner().invoke(main, ["generate", str(bundle), "--provider", "cpu", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_generate_cli_broken_bundle_exits_2(bundle_copy):
    from toolkit.apps.cli import main

    (bundle_copy / "decoder.onnx").write_bytes(b"not a graph")
    result = CliRunner().invoke(main, ["generate", str(bundle_copy), "--ids", "5 6"])
    assert result.exit_code == 2
    assert "decoder.onnx" in result.output and "Traceback" not in result.output


# ------------------------------------------------------------------------------------------ example model

@pytest.mark.slow
@pytest.mark.skipif(not (DATES / "config.json").exists(), reason=f"example checkpoint {DATES} not trained yet")
def test_example_model_tokens_equal_pytorch_on_200_inputs(tmp_path):
    from exporters.export import export_checkpoint
    from toolkit.reference.checkpoint import load_checkpoint
    from toolkit.parity.generation import parity_inputs

    ckpt = load_checkpoint(DATES)
    bundle_dir = export_checkpoint(DATES, tmp_path / "bundle")
    engine = load_bundle(bundle_dir, provider="cpu").engine
    seqs, _ = parity_inputs(ckpt.config, ckpt.tokenizer, 200)
    for beam in (1, 4):
        opts = SearchOptions(max_new_tokens=11, beam=beam)
        reference = generate_ids(TorchEngine(ckpt.model), seqs, opts)
        assert len({tuple(p[0].tokens) for p in reference}) > 100
        assert tokens_of(generate_ids(engine, seqs, opts)) == tokens_of(reference)
