"""The HTTP server (toolkit/apps/serve): batching gives every request its unbatched output, bad requests get one-line
4xx answers, overload gets 503 + Retry-After, clients that leave free their rows, SIGTERM drains and exits 0.

Servers listen on 127.0.0.1 with a free port; every load is bounded in requests and time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from runtime.bundle import load_bundle  # noqa: E402
from runtime.generate import generate_ids  # noqa: E402
from runtime.request import Request  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from toolkit.apps.serve.app import ServeSettings, Service, bind, create_app  # noqa: E402
from toolkit.apps.serve.loadtest import LoadSpec, make_requests  # noqa: E402
from toolkit.apps.serve.scheduler import Job, Overloaded, Scheduler  # noqa: E402
from toolkit.testing.toy import toy_inputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bundles(toy_exported, tmp_path_factory):
    """{kv cache kind: bundle dir}: the exported toy bundle (dynamic cache) and its fused static-cache optimization."""
    from exporters.optimize import optimize_bundle

    static, _ = optimize_bundle(toy_exported[1], tmp_path_factory.mktemp("serve") / "static")
    return {"dynamic": toy_exported[1], "static": static}


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles["dynamic"]


@pytest.fixture(scope="module")
def config(toy_model_factory):
    return toy_model_factory().config


@contextmanager
def serving(service: Service):
    """`service` on a uvicorn server in a thread, on 127.0.0.1 and a free port; yields its base URL."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        wait_ready(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_ready(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"server at {url} did not become ready")


class Gated:
    """An engine whose start() waits for `gate` (holds a batch so tests can fill the queue) and counts rows."""

    def __init__(self, engine):
        self.inner, self.gate, self.started_rows = engine, threading.Event(), []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, ids, mask, expand, max_steps=None):
        self.started_rows.append(len(ids))
        assert self.gate.wait(60), "gate never opened"
        return self.inner.start(ids, mask, expand, max_steps)


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name or (sample.name.startswith(name + "{")):
                total += sample.value
    return total


def label_metric(url: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def queued(engine, sequences, opts: SearchOptions) -> Job:
    """A queued request, validated as the server validates it (runtime.request)."""
    return Job(Request.build(engine, sequences, None, opts))


# --- batching: each request gets exactly what it gets alone ---

def assert_same(alone, batched, atol=1e-4):
    assert [[h.tokens for h in per] for per in batched] == [[h.tokens for h in per] for per in alone]
    assert [[h.finished for h in per] for per in batched] == [[h.finished for h in per] for per in alone]
    np.testing.assert_allclose([h.score for per in batched for h in per], [h.score for per in alone for h in per],
                               atol=atol, rtol=0)


@pytest.mark.parametrize("kv", ["dynamic", "static"])
def test_batched_requests_equal_their_unbatched_outputs(bundles, config, kv):
    engine = load_bundle(bundles[kv], provider="cpu").engine
    rng = np.random.default_rng(3)
    seqs = toy_inputs(config, 40, min_len=1, max_len=12, seed=5)
    jobs = []
    for i in range(0, 40, 2):                       # requests of 1 or 2 inputs, greedy with mixed lengths, beams
        inputs = seqs[i:i + 1 + (i % 4 == 0)]
        beam = 1 if i % 6 else 3
        opts = SearchOptions(max_new_tokens=int(rng.integers(1, 20)) if beam == 1 else 12, beam=beam,
                             num_return=1 if beam == 1 else 2)
        jobs.append(queued(engine, inputs, opts))
    scheduler = Scheduler(engine, max_batch=16, max_wait_ms=500, max_queue=64)   # a short window: nothing else
    for job in jobs:                                # comes; all queued before the thread starts: they batch together
        scheduler.submit(job)
    scheduler.start()
    results = [job.future.result(timeout=120) for job in jobs]
    scheduler.stop()
    assert scheduler.batches <= 6, f"{scheduler.batches} batches for {len(jobs)} requests: nothing was batched"
    outputs = set()
    for job, got in zip(jobs, results):
        alone = generate_ids(engine, job.sequences, job.opts)
        assert_same(alone, got)
        outputs.update(tuple(h.tokens) for per in got for h in per)
    assert len(outputs) > 20, "the model's outputs do not vary: equality would prove nothing"


def test_server_answers_the_records_of_generate_json(bundle):
    from fastapi.testclient import TestClient

    from toolkit.apps.cli import main

    texts = ["abcdef", "XYZ", "hello", "q"]
    cli = CliRunner().invoke(main, ["generate", str(bundle), *texts, "--json", "--provider", "cpu",
                                    "--max-new-tokens", "9", "--beam", "2", "--num-return", "2"])
    assert cli.exit_code == 0, cli.output
    expected = [json.loads(line) for line in cli.stdout.splitlines() if line.startswith("{")]
    service = Service.load(bundle, ServeSettings(provider="cpu", max_wait_ms=50))
    with TestClient(create_app(service, start_in_background=False)) as client:
        answer = client.post("/v1/generate", json={"inputs": texts, "max_new_tokens": 9, "beam": 2, "num_return": 2})
        assert answer.status_code == 200, answer.text
        got = answer.json()["outputs"]
        for record in got + expected:
            record["score"] = round(record["score"], 4)
        assert got == expected
        ids = client.post("/v1/generate", json={"ids": [[5, 6, 7, 8]], "max_new_tokens": 5}).json()["outputs"]
        assert ids[0]["input"] == [5, 6, 7, 8] and len(ids[0]["ids"]) <= 5


@pytest.mark.parametrize("kv, scheduler", [("dynamic", "request-level"), ("static", "in-flight")])
def test_server_decoding_controls_equal_generate(bundles, kv, scheduler):
    """One request with several decoding controls answers what `onnxformer generate` prints for the same flags
    (fp32 bundle): sampling with a seed, penalties, bans, a per-input prefix file, logprobs, EOS forced at the
    limit; under either
    scheduler (in-flight: both requests decode in the running batch, each row with its own options)."""
    from fastapi.testclient import TestClient

    from toolkit.apps.cli import main

    bundle, texts = bundles[kv], ["abcdef", "XYZ", "hello"]
    body = {"inputs": texts, "max_new_tokens": 8, "sample": True, "seed": 7, "temperature": 0.8, "top_k": 20,
            "top_p": 0.95, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 2,
            "bad_words": ["ab"], "bad_words_ids": [[9, 10], [11]], "prefix": ["Q", "", "hi"],
            "return_logprobs": True, "forced_eos": True}
    with CliRunner().isolated_filesystem():
        Path("prefixes.txt").write_text("Q\n\nhi\n")
        flags = ["--max-new-tokens", "8", "--sample", "--seed", "7", "--temperature", "0.8", "--top-k", "20",
                 "--top-p", "0.95", "--repetition-penalty", "1.3", "--no-repeat-ngram-size", "2", "--min-new-tokens",
                 "2", "--bad-words", "ab", "--bad-words-ids", "9 10;11", "--prefix-file", "prefixes.txt",
                 "--return-logprobs", "--forced-eos"]
        cli = CliRunner().invoke(main, ["generate", str(bundle), *texts, "--json", "--provider", "cpu", *flags])
    assert cli.exit_code == 0, cli.output
    expected = [json.loads(line) for line in cli.stdout.splitlines() if line.startswith("{")]
    service = Service.load(bundle, ServeSettings(provider="cpu", max_wait_ms=50))
    assert service.scheduler.kind == scheduler
    with TestClient(create_app(service, start_in_background=False)) as client:
        plain = client.post("/v1/generate", json={"inputs": texts, "max_new_tokens": 8}).json()["outputs"]
        before = getattr(service.scheduler, "steps", 0)
        answer = client.post("/v1/generate", json=body)
        assert answer.status_code == 200, answer.text
        got = answer.json()["outputs"]
        assert getattr(service.scheduler, "steps", 0) > before or scheduler == "request-level"
    assert [r["ids"] for r in got] == [r["ids"] for r in expected]
    for g, e in zip(got, expected):
        assert len(g["logprobs"]) == len(g["ids"])
        np.testing.assert_allclose(g["logprobs"], e["logprobs"], atol=1e-4)
    assert got[0]["text"].startswith("Q") and got[2]["text"].startswith("hi")
    assert all(r["finished"] for r in got)                            # forced_eos: ended at the limit at the latest
    assert "logprobs" not in plain[0]
    assert [r["ids"] for r in got] != [r["ids"] for r in plain], "the controls changed nothing: proves nothing"


@pytest.mark.parametrize("kv", ["dynamic", "static"])
def test_server_sampling_equals_generate(bundles, kv):
    """Seeded sampling, one sample an input, answers what generate prints; the in-flight scheduler decodes it in
    its running batch (its step count moves) beside a greedy request."""
    from fastapi.testclient import TestClient

    from toolkit.apps.cli import main

    bundle, texts = bundles[kv], ["abcdef", "XYZ", "hello", "q"]
    flags = ["--max-new-tokens", "10", "--sample", "--seed", "5", "--temperature", "1.5", "--top-k", "30"]
    outputs = {}
    for seed in ("5", "6"):
        cli = CliRunner().invoke(main, ["generate", str(bundle), *texts, "--json", "--provider", "cpu",
                                        *flags[:4], seed, *flags[5:]])
        assert cli.exit_code == 0, cli.output
        outputs[seed] = [json.loads(line) for line in cli.stdout.splitlines() if line.startswith("{")]
    assert [r["ids"] for r in outputs["5"]] != [r["ids"] for r in outputs["6"]], "the seed changes nothing"
    service = Service.load(bundle, ServeSettings(provider="cpu", max_wait_ms=50))
    with TestClient(create_app(service, start_in_background=False)) as client:
        before = getattr(service.scheduler, "steps", 0)
        body = {"inputs": texts, "max_new_tokens": 10, "sample": True, "seed": 5, "temperature": 1.5, "top_k": 30}
        got = client.post("/v1/generate", json=body).json()["outputs"]
        if service.scheduler.kind == "in-flight":
            assert service.scheduler.steps > before
    assert [(r["ids"], r["finished"]) for r in got] == [(r["ids"], r["finished"]) for r in outputs["5"]]
    np.testing.assert_allclose([r["score"] for r in got], [r["score"] for r in outputs["5"]], atol=1e-4)


# --- bad requests: a 4xx with one line naming the problem ---

BAD = [
    (b'{"inputs": ["abc"', 400, "not valid JSON"),
    (b"[1, 2]", 422, "JSON object"),
    (b'{"inputs": "abc"}', 422, "'inputs'"),
    (b'{"inputs": ["abc"], "beam": "2"}', 422, "'beam'"),
    (b'{"inputs": ["abc"], "beam": 2.5}', 422, "'beam'"),
    (b'{"ids": [[5, "6"]]}', 422, "'ids.0.1'"),
    (b'{"inputs": ["abc"], "temprature": 0.7}', 422, "unknown field 'temprature'"),
    (b'{"inputs": ["abc"], "temperature": 0.7}', 422, "temperature shapes sampling only"),
    (b'{"inputs": ["abc"], "sample": true, "top_p": 2}', 422, "top_p must be a number in (0, 1]"),
    (b'{"inputs": ["abc"], "repetition_penalty": 0}', 422, "repetition_penalty must be"),
    (b'{"inputs": ["abc"], "bad_words_ids": [[999]]}', 422, "bad_words_ids[0] has token id(s) [999]"),
    (b'{"inputs": ["abc"], "bad_words": ["a!"]}', 422, "!"),
    (b'{"inputs": ["abc", "d"], "prefix_ids": [[5]]}', 422, "prefix_ids must give one prefix per input (2)"),
    (b'{"inputs": ["abc"], "prefix": "x", "prefix_ids": [[5]]}', 422, "not both"),
    (b'{"inputs": []}', 422, "no inputs"),
    (b'{"inputs": [""]}', 422, "input 0 is empty"),
    (b'{"inputs": ["' + b"a" * 65 + b'"]}', 422, "more than the model's maximum source length 64"),
    (b'{"inputs": ["abc", "' + b"a" * 65 + b'"]}', 422, "input 1 has 65 tokens"),
    (b'{"ids": [[5, 6, 999]]}', 422, "outside the source vocabulary of 64 ids"),
    (b'{"inputs": ["ab!"]}', 422, "!"),
    (b'{"inputs": ["a"], "beam": 0}', 422, "beam must be between 1 and 8"),
    (b'{"inputs": ["a"], "beam": 9}', 422, "beam must be between 1 and 8"),
    (b'{"inputs": ["a"], "max_new_tokens": -1}', 422, "max new tokens must be between 0 and"),
    (b'{"inputs": ["a"], "max_new_tokens": 65}', 422, "max new tokens must be between 0 and"),
    (b'{"inputs": ["a"], "beam": 2, "num_return": 3}', 422, "number of returned hypotheses"),
    (b'{"inputs": ["a"], "ids": [[5]]}', 422, "exactly one of"),
    (b'{"beam": 2}', 422, "exactly one of"),
    (json.dumps({"inputs": ["a"] * 5}).encode(), 422, "too many inputs: 5"),
    (json.dumps({"inputs": ["a" * 60] * 20000}).encode(), 413, "limit of 1048576"),
]


@pytest.fixture(scope="module")
def client(bundle):
    from fastapi.testclient import TestClient

    service = Service.load(bundle, ServeSettings(provider="cpu", max_batch=4))
    with TestClient(create_app(service, start_in_background=False)) as c:
        yield c


@pytest.mark.parametrize("body, status, message", BAD, ids=[f"{i}-{b[:24]!r}" for i, (b, *_ ) in enumerate(BAD)])
def test_bad_requests_get_a_one_line_4xx(client, body, status, message):
    answer = client.post("/v1/generate", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert message in error and "\n" not in error and "Traceback" not in error, error
    assert client.post("/v1/generate", json={"inputs": ["abc"], "max_new_tokens": 3}).status_code == 200


def test_model_metrics_health_and_openapi(client):
    info = client.get("/v1/model").json()
    assert info["precision"] == "fp32" and info["model"]["max_len"] == 64 and info["tokenizer"] is True
    assert info["scheduler"]["kind"] == "request-level" and info["limits"]["max_inputs"] == 4
    assert client.get("/healthz").json() == {"status": "ready"}
    client.post("/v1/generate", json={"inputs": ["abcd", "efg"], "max_new_tokens": 4, "ignore_eos": True})
    text = client.get("/metrics").text
    for name in ("onnxformer_requests_total", "onnxformer_errors_total", "onnxformer_queue_depth",
                 "onnxformer_batch_rows_bucket", "onnxformer_request_latency_seconds_bucket",
                 "onnxformer_generated_tokens_total"):
        assert name in text, name
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/v1/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"inputs", "ids", "beam", "max_new_tokens", "num_return"} <= set(body["properties"])
    assert client.get("/docs").status_code == 200


def test_healthz_is_503_until_warmed_up(bundle):
    from fastapi.testclient import TestClient

    service = Service.load(bundle, ServeSettings(provider="cpu"))
    gate = threading.Event()
    warm = service.warm_up
    service.warm_up = lambda: (gate.wait(30), warm())
    with TestClient(create_app(service, start_in_background=True)) as c:
        first = c.get("/healthz")
        assert first.status_code == 503 and first.json() == {"status": "warming up"}
        refused = c.post("/v1/generate", json={"inputs": ["abc"]})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        gate.set()
        deadline = time.monotonic() + 30
        while c.get("/healthz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert c.post("/v1/generate", json={"inputs": ["abc"]}).status_code == 200


# --- overload, disconnects, one answer per accepted request ---

def test_full_queue_gets_503_with_retry_after_and_every_accepted_request_one_answer(bundle):
    service = Service.load(bundle, ServeSettings(provider="cpu", max_batch=4, max_queue=6, max_wait_ms=1))
    gated = Gated(service.engine)
    service.scheduler.engine = gated
    gated.gate.set()                                # the warm-up's batches pass; then the gate holds batches
    with serving(service) as url:
        gated.gate.clear()
        gated.started_rows.clear()                  # the warm-up's
        answers: list = [None] * 40

        def send(i):
            answers[i] = httpx.post(url + "/v1/generate", json={"ids": [[5 + i % 50, 6, 7]], "max_new_tokens": 6},
                                    timeout=60)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(40)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(a is not None for a in answers) < 34:          # 6 accepted and held, the other 34 refused
            assert time.monotonic() < deadline, [a.status_code for a in answers if a is not None]
            time.sleep(0.02)
        assert metric(url, "onnxformer_queue_depth") <= 6             # bounded: never more than max_queue
        refused = [a for a in answers if a is not None]
        assert all(a.status_code == 503 and a.headers["retry-after"] == "1" and "queue is full" in a.json()["error"]
                   for a in refused)
        gated.gate.set()
        for t in threads:
            t.join(60)
        codes = [a.status_code for a in answers]
        assert codes.count(200) == 6 and codes.count(503) == 34
        assert label_metric(url, "onnxformer_requests_total", outcome="ok") == 6
        assert label_metric(url, "onnxformer_errors_total", kind="queue_full") == 34
        assert sum(gated.started_rows) == 6                           # each accepted request decoded once


def test_client_that_disconnects_while_queued_is_dropped(bundle):
    service = Service.load(bundle, ServeSettings(provider="cpu", max_batch=1, max_wait_ms=0))
    gated = Gated(service.engine)
    service.scheduler.engine = gated
    gated.gate.set()                                # the warm-up's batches pass; then the gate holds batches
    with serving(service) as url:
        gated.gate.clear()
        gated.started_rows.clear()                  # the warm-up's
        holder = threading.Thread(target=httpx.post, args=(url + "/v1/generate",),
                                  kwargs={"json": {"ids": [[5, 6]], "max_new_tokens": 3}, "timeout": 60})
        holder.start()                                                  # occupies the engine (gated)
        while not gated.started_rows:
            time.sleep(0.01)
        body = json.dumps({"ids": [[7, 8, 9]], "max_new_tokens": 3}).encode()
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as raw:     # queued behind it, then gone
            raw.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 10
            while metric(url, "onnxformer_queue_depth") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        deadline = time.monotonic() + 10
        while label_metric(url, "onnxformer_errors_total", kind="cancelled") < 1:
            assert time.monotonic() < deadline, "the server did not notice the client leave"
            time.sleep(0.01)
        assert metric(url, "onnxformer_queue_depth") == 0               # its place in the queue is free again
        gated.gate.set()
        holder.join(30)
        assert gated.started_rows == [1]                                # the departed request never decoded


def test_cancelled_rows_leave_the_running_batch(bundle, config):
    """A client leaving mid-decode: its rows drop out at the next step, the others finish unchanged."""
    engine = load_bundle(bundle, provider="cpu").engine
    rows_per_step: list[int] = []
    jobs = [queued(engine, [seq], SearchOptions(max_new_tokens=30, ignore_eos=True))
            for seq in toy_inputs(config, 4, seed=9)]
    scheduler = Scheduler(engine, max_batch=4, max_wait_ms=10_000)

    class Watch:
        def __getattr__(self, name):
            return getattr(engine, name)

        def start(self, ids, mask, expand, max_steps=None):
            state = engine.start(ids, mask, expand, max_steps)
            step = state.step

            def counted(tokens, keep):
                rows_per_step.append(len(tokens))
                if len(rows_per_step) == 5:
                    scheduler.cancel(jobs[1])                           # the client of job 1 goes away
                return step(tokens, keep)
            state.step = counted
            return state

    scheduler.engine = Watch()
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    results = [job.future.result(timeout=60) for job in jobs]
    scheduler.stop()
    assert rows_per_step[:5] == [4] * 5 and set(rows_per_step[5:]) == {3}
    for i in (0, 2, 3):
        assert_same(generate_ids(engine, jobs[i].sequences, jobs[i].opts), results[i])
    assert len(results[1][0][0].tokens) == 5


def test_the_batch_window_opens_when_the_engine_frees_up(bundle):
    """A request that waited through a whole batch still waits max_wait for others once the engine is free."""
    engine = load_bundle(bundle, provider="cpu").engine
    gated = Gated(engine)
    scheduler = Scheduler(gated, max_batch=8, max_wait_ms=400)
    opts = SearchOptions(max_new_tokens=3)
    first = queued(engine, [[5, 6]], opts)
    scheduler.submit(first)
    scheduler.start()
    while not gated.started_rows:                   # batch 1 (first) is decoding, held by the gate
        time.sleep(0.01)
    waiting = queued(engine, [[7, 8]], opts)
    scheduler.submit(waiting)
    time.sleep(0.6)                                 # longer than max_wait: its own window has passed
    gated.gate.set()
    first.future.result(30)
    late = queued(engine, [[9, 10]], opts)          # arrives just after the engine became free
    scheduler.submit(late)
    waiting.future.result(30), late.future.result(30)
    scheduler.stop()
    assert gated.started_rows == [1, 2]             # waiting and late decoded together


def test_scheduler_queue_is_bounded():
    scheduler = Scheduler(engine=None, max_batch=2, max_queue=3)
    model = SimpleNamespace(vocab_size=64, src_vocab_size=64, suppress_ids=(), eos_id=2, max_len=64)
    for _ in range(3):
        scheduler.submit(queued(model, [[5]], SearchOptions(max_new_tokens=2)))
    with pytest.raises(Overloaded, match="queue is full"):
        scheduler.submit(queued(model, [[5]], SearchOptions(max_new_tokens=2)))


# --- the command: SIGTERM drains and exits 0; bad settings exit 2 ---

def start_server(bundle: Path, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "toolkit.apps.cli", "serve", str(bundle), "--port", "0",
                             "--provider", "cpu", *args], stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if line.startswith("ready: "):
            return proc, line.split()[1]
        assert line or proc.poll() is None, "server exited before it was ready"
    proc.kill()
    raise AssertionError("server did not become ready")


def test_sigterm_finishes_in_flight_requests_and_exits_0(bundle):
    proc, url = start_server(bundle, "--max-wait-ms", "1500", "--max-batch", "8")
    try:
        answers: list = [None] * 6

        def send(i):
            answers[i] = httpx.post(url + "/v1/generate", json={"ids": [[5 + i, 6, 7]], "max_new_tokens": 20},
                                    timeout=60)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while metric(url, "onnxformer_queue_depth") < 6:              # all six accepted, waiting for the batch
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):                          # no longer accepting
            httpx.get(url + "/healthz", timeout=2)
        for t in threads:
            t.join(60)
        assert [a.status_code for a in answers] == [200] * 6
        assert all(len(a.json()["outputs"]) == 1 for a in answers)
        assert proc.wait(30) == 0
        tail = proc.stderr.read()
        assert "stopped: 6 requests answered" in tail and "Traceback" not in tail, tail
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("args, message", [
    (["--max-batch", "0"], "--max-batch must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
])
def test_serve_bad_settings_exit_2(bundle, args, message):
    from toolkit.apps.cli import main

    result = CliRunner().invoke(main, ["serve", str(bundle), "--port", "0", *args])
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr, result.output


def test_serve_missing_bundle_and_taken_port_exit_2(bundle, tmp_path):
    from toolkit.apps.cli import main

    result = CliRunner().invoke(main, ["serve", str(tmp_path / "nope"), "--port", "0"])
    assert result.exit_code == 2 and "does not exist" in result.stderr, result.output
    held = bind("127.0.0.1", 0)
    try:
        result = CliRunner().invoke(main, ["serve", str(bundle), "--port", str(held.getsockname()[1])])
        assert result.exit_code == 2 and "cannot listen on 127.0.0.1" in result.stderr, result.output
    finally:
        held.close()


# --- the load generator ---

def test_loadtest_is_bounded_and_counts_every_answer(bundle):
    from toolkit.apps.cli import main

    service = Service.load(bundle, ServeSettings(provider="cpu", max_batch=8))
    with serving(service) as url:
        result = CliRunner().invoke(main, ["loadtest", url, "--requests", "40", "--concurrency", "8",
                                           "--min-new-tokens", "2", "--max-new-tokens", "20", "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["sent"] == report["ok"] == 40 and report["errors"] == report["lost"] == 0
        assert report["latency_ms"]["p50"] <= report["latency_ms"]["p99"]
        assert report["server_batches"] < 40 and report["mean_batch_rows"] > 1
        asked = sum(b["max_new_tokens"] for b in make_requests(LoadSpec(url, 40, 8, min_new=2, max_new=20),
                                                                httpx.get(url + "/v1/model").json()))
        assert label_metric(url, "onnxformer_generated_tokens_total") == asked      # EOS suppressed: all of them


@pytest.mark.parametrize("url, message", [
    ("http://10.1.2.3:8000", "not a loopback address"),
    ("http://127.0.0.1:1", "no onnxformer server answers"),
    ("ftp://127.0.0.1", "not an http URL"),
])
def test_loadtest_refuses_other_hosts_and_absent_servers(url, message):
    from toolkit.apps.cli import main

    result = CliRunner().invoke(main, ["loadtest", url, "--requests", "1"])
    assert result.exit_code == 2 and message in result.stderr, result.output


def test_server_modules_do_not_import_torch():
    code = ("import sys; import toolkit.apps.serve.app, toolkit.apps.serve.loadtest, toolkit.apps.commands.serve; "
            "assert 'torch' not in sys.modules and 'onnx' not in sys.modules, 'torch or onnx imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers(),
                    reason="needs onnxruntime-gpu with CUDA")
def test_server_on_cuda_runs_the_engine_as_generate_does(bundles, config):
    """On CUDA the server's engine is load_bundle's: IO binding (or the static cache's bound buffers) on the device."""
    for kv, bundle_dir in bundles.items():
        reference = load_bundle(bundle_dir, provider="cuda").engine
        service = Service.load(bundle_dir, ServeSettings(provider="cuda"))
        assert service.engine.io_binding and service.engine.name.startswith("ort-cuda-")
        seqs = toy_inputs(config, 6, seed=2)
        jobs = [queued(reference, [s], SearchOptions(max_new_tokens=10)) for s in seqs]
        for job in jobs:
            service.scheduler.submit(job)
        service.start()
        try:
            for job in jobs:
                assert_same(generate_ids(reference, job.sequences, job.opts), job.future.result(60), atol=1e-3)
        finally:
            service.stop()
