"""Property-based fuzzing (hypothesis) of what users feed us: texts, id lists, option values, manifest and config
JSON fields, truncated and corrupted files. Every failure must be one of our errors (OnnxformerError: a one-line
message, exit 2 from the command line), never another exception, a traceback or a hang."""

from __future__ import annotations

import json
import math
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.bundle import load_bundle
from runtime.errors import OnnxformerError
from runtime.generate import generate_ids
from runtime.manifest import file_entries, read_manifest, verify_hashes
from runtime.search import SearchOptions
from toolkit.reference.checkpoint import load_checkpoint
from toolkit.apps.cli import main

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                derandomize=True)
SECONDS = 60                         # any single example taking longer counts as a hang

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True)
                    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=8)


@contextmanager
def no_hang(seconds: int = SECONDS):
    """Fail (instead of waiting forever) when the body runs longer than `seconds`."""
    def alarm(signum, frame):
        raise TimeoutError(f"hung for more than {seconds} s")
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def ours_or_fine(fn, *args, **kwargs):
    """Run fn: it may succeed or raise one of our errors; anything else fails the test."""
    with no_hang():
        try:
            return fn(*args, **kwargs)
        except OnnxformerError as exc:
            message = str(exc)
            assert message and "\n" not in message and "Traceback" not in message, message
            return exc


def cli_exits_cleanly(*args) -> None:
    """A command on fuzzed input: exit 0, 1 (a check failed) or 2 with one error line; never a traceback."""
    with no_hang():
        result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code in (0, 1, 2), (args, result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, (SystemExit, type(None))), (args, repr(result.exception))
    assert "Traceback" not in result.output
    if result.exit_code:                                 # ours: "error: ..."; click's usage errors: "Error: ..."
        err = result.stderr.strip().splitlines()[-1]
        assert err.startswith(("error:", "Error:")), result.stderr


@pytest.fixture(scope="module")
def loaded(toy_exported):
    return load_bundle(toy_exported[1], provider="cpu")


@settings(max_examples=150, **SETTINGS)
@given(text=st.text(max_size=80))
def test_any_text_is_generated_from_or_refused(loaded, text):
    def go():
        ids = loaded.tokenizer.encode(text)
        return generate_ids(loaded.engine, [ids], SearchOptions(max_new_tokens=4))
    ours_or_fine(go)


@settings(max_examples=150, **SETTINGS)
@given(seqs=st.lists(st.lists(st.integers(-2 ** 65, 2 ** 65), max_size=70), max_size=5))
def test_any_id_lists_are_generated_from_or_refused(loaded, seqs):
    ours_or_fine(generate_ids, loaded.engine, seqs, SearchOptions(max_new_tokens=3))


@settings(max_examples=200, **SETTINGS)
@given(beam=st.integers(-3, 12), new=st.integers(-5, 80), num_return=st.integers(-2, 12),
       lp=st.floats(allow_nan=True, allow_infinity=True) | st.floats(-3, 3), batch=st.integers(1, 3))
def test_any_option_values_are_served_or_refused(loaded, beam, new, num_return, lp, batch):
    opts = SearchOptions(max_new_tokens=new, beam=beam, num_return=num_return, length_penalty=lp)
    result = ours_or_fine(generate_ids, loaded.engine, [[5, 6, 7]] * batch, opts)
    if not isinstance(result, OnnxformerError):
        assert -10 <= lp <= 10                           # a NaN, infinite or absurd penalty is refused, never served
        for hyps in result:
            assert 1 <= len(hyps) <= num_return and all(math.isfinite(h.score) or not h.tokens for h in hyps)


@settings(max_examples=40, **SETTINGS)
@given(text=st.text(max_size=30), ids=st.text(alphabet=" 0123456789-x,", max_size=20),
       beam=st.sampled_from(["0", "1", "3", "-1", "x", "99"]), new=st.sampled_from(["0", "5", "-2", "1e3", "65"]))
def test_generate_command_on_fuzzed_arguments(toy_exported, text, ids, beam, new):
    _, bundle = toy_exported
    cli_exits_cleanly("generate", bundle, text, "--beam", beam, "--max-new-tokens", new)
    cli_exits_cleanly("generate", bundle, "--ids", ids, "--max-new-tokens", "3")


def set_path(data, path, value):
    """data with the value at a key path replaced (a copy)."""
    data = json.loads(json.dumps(data))
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


def key_paths(data, prefix=()):
    """Every key path of a JSON object (dict keys and list indices), shallow first."""
    out = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        out.append(prefix + (key,))
        out += key_paths(value, prefix + (key,))
    return out


@pytest.fixture(scope="module")
def manifest_paths(toy_exported):
    manifest = read_manifest(toy_exported[1])
    paths = [p for p in key_paths(manifest) if p[0] not in ("parity", "producer", "created", "source", "passes")]
    return manifest, paths


@settings(max_examples=120, **SETTINGS)
@given(data=st.data())
def test_any_manifest_field_changed_to_any_json_loads_or_is_a_bundle_error(toy_exported, manifest_paths, tmp_path,
                                                                         data):
    manifest, paths = manifest_paths
    path = data.draw(st.sampled_from(paths), label="field")
    value = data.draw(JSON, label="value")
    copy = tmp_path / "b"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(toy_exported[1], copy)
    (copy / "manifest.json").write_text(json.dumps(set_path(manifest, path, value)))
    ours_or_fine(load_bundle, copy, provider="cpu")


@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_any_config_field_changed_to_any_json_loads_or_is_a_checkpoint_error(toy_exported, tmp_path, data):
    ckpt, _ = toy_exported
    config = json.loads((ckpt / "config.json").read_text())
    key = data.draw(st.sampled_from(sorted(config) + ["unknown_field"]), label="field")
    value = data.draw(JSON, label="value")
    copy = tmp_path / "c"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(ckpt, copy)
    (copy / "config.json").write_text(json.dumps({**config, key: value}))
    ours_or_fine(load_checkpoint, copy)


def corrupt(data: bytes, how: str, where: float, byte: int) -> bytes:
    at = min(int(where * len(data)), max(len(data) - 1, 0))
    if how == "truncate":
        return data[:at]
    if how == "flip" and data:
        return data[:at] + bytes([data[at] ^ (byte or 1)]) + data[at + 1:]
    return data[:at] + bytes([byte]) * 64 + data[at:]            # insert


CORRUPTION = dict(how=st.sampled_from(["truncate", "flip", "insert"]), where=st.floats(0, 1), byte=st.integers(0, 255))


@settings(max_examples=60, **SETTINGS)
@given(name=st.sampled_from(["encoder.onnx", "decoder.onnx", "tokenizer.json", "manifest.json"]), **CORRUPTION)
def test_a_truncated_or_corrupted_bundle_file_is_a_bundle_error(toy_exported, tmp_path, name, how, where, byte):
    copy = tmp_path / "b"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(toy_exported[1], copy)
    (copy / name).write_bytes(corrupt((copy / name).read_bytes(), how, where, byte))
    result = ours_or_fine(load_bundle, copy, provider="cpu")
    if name != "manifest.json":                          # a changed file never gets past its hash
        assert isinstance(result, OnnxformerError) and name in str(result), result


@settings(max_examples=40, **SETTINGS)
@given(name=st.sampled_from(["encoder.onnx", "decoder.onnx", "tokenizer.json"]), **CORRUPTION)
def test_a_corrupted_file_whose_hash_was_updated_still_fails_cleanly(toy_exported, tmp_path, name, how, where, byte):
    """Past the hash check (someone re-hashed a broken file): onnxruntime or the tokenizer must refuse it as ours."""
    copy = tmp_path / "b"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(toy_exported[1], copy)
    (copy / name).write_bytes(corrupt((copy / name).read_bytes(), how, where, byte))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"] = file_entries(copy)
    for entry in manifest["graphs"].values():
        entry.update(manifest["files"][entry["file"]])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    verify_hashes(copy, read_manifest(copy))
    loaded = ours_or_fine(load_bundle, copy, provider="cpu")
    if not isinstance(loaded, OnnxformerError):          # it loaded (the change was harmless): it must also run
        ours_or_fine(generate_ids, loaded.engine, [[5, 6, 7]], SearchOptions(max_new_tokens=3))


@settings(max_examples=40, **SETTINGS)
@given(name=st.sampled_from(["config.json", "weights.safetensors", "tokenizer.json"]), **CORRUPTION)
def test_a_truncated_or_corrupted_checkpoint_file_is_a_checkpoint_error(toy_exported, tmp_path, name, how, where,
                                                                      byte):
    ckpt, _ = toy_exported
    copy = tmp_path / "c"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(ckpt, copy)
    (copy / name).write_bytes(corrupt((copy / name).read_bytes(), how, where, byte))
    ours_or_fine(load_checkpoint, copy)


@settings(max_examples=25, **SETTINGS)
@given(name=st.sampled_from(["manifest.json", "encoder.onnx", "tokenizer.json"]), **CORRUPTION)
def test_commands_on_a_corrupted_bundle_exit_2_without_a_traceback(toy_exported, tmp_path, name, how, where, byte):
    ckpt, bundle = toy_exported
    copy = tmp_path / "b"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(bundle, copy)
    (copy / name).write_bytes(corrupt((copy / name).read_bytes(), how, where, byte))
    for args in (("inspect", copy), ("generate", copy, "abc"), ("parity", ckpt, copy, "--samples", "4"),
                 ("optimize", copy, "--out", tmp_path / "o", "--force")):
        cli_exits_cleanly(*args)
        shutil.rmtree(tmp_path / "o", ignore_errors=True)


def test_every_config_field_with_every_kind_of_bad_value_is_a_config_error():
    """The exhaustive companion of the config fuzz: each field, each JSON kind, each edge number."""
    from toolkit.reference.config import PRESETS, ModelConfig

    base = PRESETS["tiny"].to_dict()
    values = [None, "x", [], {}, True, 1.5, -1, 0, 10 ** 30, float("nan"), float("inf"), 1e-300]
    for key in base:
        for value in values:
            ours_or_fine(ModelConfig.from_dict, {**base, key: value})
