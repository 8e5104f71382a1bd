"""Scale-out on Ray (slow: starts a local Ray instance on 127.0.0.1): `serve --ray` answers like `serve`, and
`generate --ray` (Ray Data over an actor pool) prints exactly what `generate` prints, in input order."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")
import httpx  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from toolkit.apps.cli import main  # noqa: E402
from toolkit.apps.serve.app import ServeSettings, bind  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local():
    from toolkit.apps.serve.ray_data import init_ray

    init_ray(None, num_cpus=2)
    yield
    import ray

    ray.shutdown()


def test_generate_with_ray_data_equals_generate(ray_local, toy_exported, tmp_path):
    bundle = toy_exported[1]
    lines = ["abcdef", "XYZ", "hello", "q", "mnopqrs", "abc", "Zz8", "0123"] * 5    # 40 inputs, 3 batches of 16
    source = tmp_path / "inputs.txt"
    source.write_text("\n".join(lines) + "\n")
    args = ["generate", str(bundle), "--input", str(source), "--json", "--provider", "cpu", "--max-new-tokens", "12"]
    plain = CliRunner().invoke(main, args)
    on_ray = CliRunner().invoke(main, args + ["--ray", "--replicas", "2", "--batch-size", "16"])
    assert plain.exit_code == 0 and on_ray.exit_code == 0, on_ray.output
    expected = [json.loads(x) for x in plain.stdout.splitlines()]
    got = [json.loads(x) for x in on_ray.stdout.splitlines()]
    assert [r["index"] for r in got] == list(range(40))
    assert [(r["input"], r["ids"], r["finished"]) for r in got] == [(r["input"], r["ids"], r["finished"])
                                                                    for r in expected]
    assert len({tuple(r["ids"]) for r in expected}) >= 6, "outputs do not vary: equality would prove nothing"


def test_generate_with_ray_data_gives_each_batch_its_inputs_prefixes(ray_local, toy_exported, tmp_path):
    bundle = toy_exported[1]
    lines = ["abcdef", "XYZ", "hello", "q", "mnopqrs", "abc"]
    (tmp_path / "inputs.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "prefixes.txt").write_text("\n".join(["A", "", "he", "Zq", "m", "b"]) + "\n")
    args = ["generate", str(bundle), "--input", str(tmp_path / "inputs.txt"), "--json", "--provider", "cpu",
            "--max-new-tokens", "8", "--prefix-file", str(tmp_path / "prefixes.txt"), "--bad-words", "ab,c",
            "--repetition-penalty", "1.5", "--return-logprobs"]
    plain = CliRunner().invoke(main, args)
    on_ray = CliRunner().invoke(main, args + ["--ray", "--replicas", "2", "--batch-size", "4"])
    assert plain.exit_code == 0 and on_ray.exit_code == 0, on_ray.output
    expected = [json.loads(x) for x in plain.stdout.splitlines()]
    got = [json.loads(x) for x in on_ray.stdout.splitlines()]
    assert [(r["ids"], r["finished"]) for r in got] == [(r["ids"], r["finished"]) for r in expected]
    assert all(len(r["logprobs"]) == len(r["ids"]) for r in got) and got[3]["text"].startswith("Zq")


def test_generate_with_ray_data_samples_each_input_as_generate_does(ray_local, toy_exported, tmp_path):
    """Each input's generator is seeded by its index in the whole input, not in its Ray batch."""
    bundle = toy_exported[1]
    (tmp_path / "inputs.txt").write_text("\n".join(["abcdef", "XYZ", "hello", "q", "mnopqrs", "abc", "Zz8"]) + "\n")
    args = ["generate", str(bundle), "--input", str(tmp_path / "inputs.txt"), "--json", "--provider", "cpu",
            "--max-new-tokens", "10", "--sample", "--seed", "7", "--temperature", "2.0", "--num-return", "2"]
    plain = CliRunner().invoke(main, args)
    on_ray = CliRunner().invoke(main, args + ["--ray", "--replicas", "2", "--batch-size", "3"])
    assert plain.exit_code == 0 and on_ray.exit_code == 0, on_ray.output
    expected = [json.loads(x) for x in plain.stdout.splitlines()]
    got = [json.loads(x) for x in on_ray.stdout.splitlines()]
    assert [(r["index"], r["rank"], r["ids"]) for r in got] == [(r["index"], r["rank"], r["ids"]) for r in expected]
    assert len({tuple(r["ids"]) for r in expected}) >= 8, "samples do not vary: equality would prove nothing"


def test_generate_ray_refuses_checkpoints(ray_local, toy_exported):
    result = CliRunner().invoke(main, ["generate", str(toy_exported[0]), "abc", "--ray"])
    assert result.exit_code == 2 and "--ray generates with bundles only" in result.stderr, result.output


@pytest.fixture(scope="module")
def static_bundle(toy_exported, tmp_path_factory):
    """The toy optimized for the CPU: per-row static cache, so the replicas batch in-flight (serve's default)."""
    from exporters.optimize import optimize_bundle

    return optimize_bundle(toy_exported[1], tmp_path_factory.mktemp("ray") / "static")[0]


@pytest.mark.parametrize("kind", ["request-level", "in-flight"])
def test_serve_on_ray_answers_like_serve(ray_local, toy_exported, static_bundle, kind):
    from fastapi.testclient import TestClient

    from toolkit.apps.serve.app import Service, create_app
    from toolkit.apps.serve.ray_serve import serve_on_ray

    bundle = toy_exported[1] if kind == "request-level" else static_bundle   # auto batching: the bundle decides
    free = bind("127.0.0.1", 0)
    port = free.getsockname()[1]
    free.close()
    stop = threading.Event()
    logs: list[str] = []
    server = threading.Thread(target=serve_on_ray, args=(bundle, ServeSettings(provider="cpu", threads=1),
                                                         "127.0.0.1", port, 2, None, logs.append, stop))
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("ready:") for line in logs):
            assert server.is_alive() and time.monotonic() < deadline, logs
            time.sleep(0.2)
        body = {"inputs": ["abcdef", "XYZ", "hello"], "max_new_tokens": 10}
        with TestClient(create_app(Service.load(bundle, ServeSettings(provider="cpu")), False)) as local:
            expected = local.post("/v1/generate", json=body).json()["outputs"]
        answers = [httpx.post(url + "/v1/generate", json=body, timeout=60) for _ in range(6)]
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        for a in answers:
            assert [(r["ids"], r["text"]) for r in a.json()["outputs"]] == [(r["ids"], r["text"]) for r in expected]
        bad = httpx.post(url + "/v1/generate", json={"inputs": ["abc"], "beam": 0}, timeout=30)
        assert bad.status_code == 422 and "beam must be between" in bad.json()["error"]
        assert httpx.get(url + "/healthz", timeout=30).json() == {"status": "ready"}
        assert httpx.get(url + "/v1/model", timeout=30).json()["scheduler"]["kind"] == kind
        assert "onnxformer_requests_total" in httpx.get(url + "/metrics", timeout=30).text
    finally:
        stop.set()
        server.join(120)
    assert not server.is_alive()


def test_serve_ray_command_drains_on_sigterm_and_exits_0(toy_exported):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    free = bind("127.0.0.1", 0)
    port = free.getsockname()[1]
    free.close()
    proc = subprocess.Popen([sys.executable, "-m", "toolkit.apps.cli", "serve", str(toy_exported[1]), "--ray",
                             "--replicas", "1", "--threads", "1", "--port", str(port), "--provider", "cpu"],
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 180
        while True:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "serve --ray exited before it was ready"
            if line.startswith("ready: "):
                break
            assert time.monotonic() < deadline
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/generate", json={"inputs": ["abc"], "max_new_tokens": 5},
                            timeout=60)
        assert answer.status_code == 200 and len(answer.json()["outputs"]) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
