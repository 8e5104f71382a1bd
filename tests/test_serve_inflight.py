"""The server's in-flight batching (toolkit/apps/serve/inflight.py): greedy and sampling requests, with any decoding
controls, join the running batch at the next step and each gets its unbatched output; beam requests still batch
request-level; a client that leaves frees its slots; SIGTERM answers every accepted request and exits 0; bundles
that cannot run in-flight are refused or fall back as --batching says."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from runtime.bundle import load_bundle  # noqa: E402
from runtime.generate import generate_ids  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from toolkit.apps.serve.app import ServeError, ServeSettings, Service  # noqa: E402
from toolkit.apps.serve.inflight import InflightScheduler  # noqa: E402
from toolkit.apps.serve.scheduler import Scheduler  # noqa: E402
from toolkit.testing.toy import toy_inputs  # noqa: E402

from test_serve import assert_same, bundles, metric, queued, start_server  # noqa: E402,F401 (bundles: a fixture)


@pytest.fixture(scope="module")
def engine(bundles):
    return load_bundle(bundles["static"], provider="cpu").engine


def test_requests_joining_the_running_batch_get_their_unbatched_outputs(engine, toy_model_factory):
    config = toy_model_factory().config
    rng = np.random.default_rng(8)
    seqs = toy_inputs(config, 48, min_len=1, max_len=12, seed=21)
    scheduler = InflightScheduler(engine, max_batch=6, max_queue=64)
    scheduler.start()
    jobs = []
    for i in range(0, 48, 2):                       # 1-2 inputs a request, mixed lengths, some ignore EOS, a few beams
        beam = 3 if i % 16 == 8 else 1
        opts = SearchOptions(max_new_tokens=int(rng.integers(0, 24)) if beam == 1 else 10, beam=beam,
                             num_return=1 if beam == 1 else 2, ignore_eos=bool(i % 6 == 0))
        jobs.append(queued(engine, seqs[i:i + 1 + (i % 4 == 0)], opts))
        scheduler.submit(jobs[-1])
        time.sleep(float(rng.uniform(0, 0.01)))     # arrivals spread over the batch's steps
    results = [job.future.result(timeout=120) for job in jobs]
    scheduler.stop()
    outputs = set()
    for job, got in zip(jobs, results):
        assert_same(generate_ids(engine, job.sequences, job.opts), got)
        outputs.update(tuple(h.tokens) for per in got for h in per)
    assert len(outputs) > 20, "the model's outputs do not vary: equality would prove nothing"
    assert scheduler.batch.joined > 0 and scheduler.steps < sum(j.opts.max_new_tokens * len(j.sequences)
                                                                for j in jobs if j.opts.beam == 1)


def test_requests_with_their_own_options_join_the_running_batch(engine, toy_model_factory):
    """Greedy and sampling requests with every decoding control (test_inflight.mixed_options) join the running
    batch as they arrive, a beam request batches request-level between them: each answer equals generate_ids'."""
    from test_inflight import assert_answers, mixed_options

    config = toy_model_factory().config
    seqs = toy_inputs(config, 26, min_len=2, max_len=12, seed=31) + toy_inputs(config, 4, min_len=2, max_len=12,
                                                                                 seed=32)
    requests = list(enumerate(mixed_options(engine, seqs)))          # (k, options): request k has inputs 2k, 2k + 1
    requests.insert(6, (0, dict(beam=3, num_return=2)))
    rng = np.random.default_rng(9)
    scheduler = InflightScheduler(engine, max_batch=6, max_queue=64)
    scheduler.start()
    jobs = []
    for k, opts in requests:
        inputs = seqs[2 * k:2 * k + 1 + ("prefix_ids" not in opts or len(opts["prefix_ids"]) == 2)]
        jobs.append(queued(engine, inputs, SearchOptions(**{"max_new_tokens": 10 + k % 5, **opts})))
        scheduler.submit(jobs[-1])
        time.sleep(float(rng.uniform(0, 0.01)))     # arrivals spread over the batch's steps
    results = [job.future.result(timeout=120) for job in jobs]
    scheduler.stop()
    for job, got in zip(jobs, results):
        assert_answers(generate_ids(engine, job.sequences, job.opts), got)
    in_flight = [job for job in jobs if job.opts.beam == 1]
    assert scheduler.batch.joined == sum(len(job.sequences) * job.opts.num_return for job in in_flight)


class Slow:
    """The engine, its decoder steps 5 ms longer: a request stays in the batch long enough to be cancelled there."""

    def __init__(self, engine):
        self.inner = engine
        self.decoder = self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def io_binding(self):
        return self.inner.decoder.io_binding()

    def run_with_iobinding(self, binding):
        time.sleep(0.005)
        return self.inner.decoder.run_with_iobinding(binding)


def test_a_cancelled_request_frees_its_slots_at_the_next_step(engine, toy_model_factory):
    config = toy_model_factory().config
    seqs = toy_inputs(config, 3, min_len=3, max_len=8, seed=22)
    scheduler = InflightScheduler(Slow(engine), max_batch=2, max_queue=8)
    scheduler.start()
    long = queued(engine, [seqs[0], seqs[1]], SearchOptions(max_new_tokens=60, ignore_eos=True))   # takes both slots
    waiting = queued(engine, [seqs[2]], SearchOptions(max_new_tokens=5, ignore_eos=True))
    scheduler.submit(long)
    deadline = time.monotonic() + 30
    while scheduler.batch.live < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    scheduler.submit(waiting)
    scheduler.cancel(long)
    got = waiting.future.result(timeout=60)
    assert_same(generate_ids(engine, waiting.sequences, waiting.opts), got)
    partial = long.future.result(timeout=60)                     # resolved once, with what it had
    assert all(len(per[0].tokens) < 60 for per in partial)
    scheduler.stop()
    assert scheduler.batch.live == 0 and not scheduler._rows and not scheduler._running


def test_batching_setting_chooses_and_refuses(bundles):
    static = Service.load(bundles["static"], ServeSettings(provider="cpu", batching="auto"))
    assert isinstance(static.scheduler, InflightScheduler) and static.model_info()["scheduler"]["kind"] == "in-flight"
    dynamic = Service.load(bundles["dynamic"], ServeSettings(provider="cpu", batching="auto"))   # auto falls back
    assert type(dynamic.scheduler) is Scheduler
    assert "--kv-cache static" in dynamic.model_info()["scheduler"]["not_inflight"]       # and says why
    assert "not_inflight" not in static.model_info()["scheduler"]
    default = Service.load(bundles["static"], ServeSettings(provider="cpu"))               # auto: in-flight
    assert isinstance(default.scheduler, InflightScheduler)
    request = Service.load(bundles["static"], ServeSettings(provider="cpu", batching="request"))
    assert type(request.scheduler) is Scheduler
    with pytest.raises(ServeError, match="--batching inflight: .*static-cache decoder.*--kv-cache static"):
        Service.load(bundles["dynamic"], ServeSettings(provider="cpu", batching="inflight"))
    from toolkit.apps.cli import main

    result = CliRunner().invoke(main, ["serve", str(bundles["dynamic"]), "--port", "0", "--batching", "inflight"])
    assert result.exit_code == 2 and "--kv-cache static" in result.stderr and "Traceback" not in result.output


SLOW_RUNS = """import functools, time, onnxruntime
def slowed(method):
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        time.sleep(0.003)
        return method(self, *args, **kwargs)
    return run
# both entry points: the static cache's decoder steps run through io_binding, never through run
onnxruntime.InferenceSession.run = slowed(onnxruntime.InferenceSession.run)
onnxruntime.InferenceSession.run_with_iobinding = slowed(onnxruntime.InferenceSession.run_with_iobinding)
"""


def test_sigterm_answers_every_in_flight_request_and_exits_0(bundles, tmp_path, monkeypatch):
    """SIGTERM while one request decodes and others wait for its slot: every accepted request gets its full answer
    (a client still connecting when the listener closes is refused, never accepted and dropped). The precondition
    is built, not hoped for: the server's every graph run, decoder steps included, takes 3 ms longer (a sitecustomize
    on its PYTHONPATH), so a 60-token request decodes for at least 0.18 s and 32 of them queue for seconds, however
    fast this CPU is."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_RUNS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    n = 32
    proc, url = start_server(bundles["static"], "--max-batch", "1", "--batching", "inflight")
    try:
        assert httpx.get(url + "/v1/model").json()["scheduler"]["kind"] == "in-flight"
        answers: list = [None] * n

        def send(i):
            try:
                answers[i] = httpx.post(url + "/v1/generate", json={"ids": [[5 + i % 20, 6, 7]], "max_new_tokens": 60,
                                                                    "ignore_eos": True}, timeout=120)
            except httpx.ConnectError:
                answers[i] = "refused"

        threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        deadline, seen = time.monotonic() + 30, []
        while True:                                 # (decoding, waiting) as /metrics saw them, the last 20 kept
            seen = seen[-19:] + [(metric(url, "onnxformer_active_rows"), metric(url, "onnxformer_queue_depth"))]
            if seen[-1][0] >= 1 and seen[-1][1] >= 4:
                break
            assert time.monotonic() < deadline, f"never saw one request decoding and others waiting: {seen}"
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        answered = [a for a in answers if a != "refused"]
        assert len(answered) >= 5 and all(a.status_code == 200 for a in answered)
        assert all(len(a.json()["outputs"][0]["ids"]) == 60 for a in answered)
        assert proc.wait(30) == 0
        tail = proc.stderr.read()
        assert f"stopped: {len(answered)} requests answered" in tail and "Traceback" not in tail, tail
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_default_server_batches_in_flight_and_a_full_queue_gets_503(bundles):
    """`onnxformer serve` without --batching on a CPU static-cache bundle batches in-flight; with one slot and a
    queue of 2, a burst of 16 requests gets 503 + Retry-After for the overflow and a full answer for every accepted
    request, and the metrics count each."""
    from test_serve import label_metric

    n = 16
    proc, url = start_server(bundles["static"], "--max-batch", "1", "--max-queue", "2")
    try:
        assert httpx.get(url + "/v1/model").json()["scheduler"]["kind"] == "in-flight"
        answers: list = [None] * n
        ready = threading.Barrier(n)

        def send(i):
            ready.wait()
            answers[i] = httpx.post(url + "/v1/generate", json={"ids": [[5 + i, 6, 7]], "max_new_tokens": 60,
                                                                "ignore_eos": True}, timeout=120)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        codes = [a.status_code for a in answers]
        assert set(codes) == {200, 503} and codes.count(200) >= 2, codes
        assert all(a.headers.get("retry-after") == "1" for a in answers if a.status_code == 503)
        assert all(len(a.json()["outputs"][0]["ids"]) == 60 for a in answers if a.status_code == 200)
        assert label_metric(url, "onnxformer_errors_total", kind="queue_full") == codes.count(503)
        assert label_metric(url, "onnxformer_requests_total", outcome="ok") == codes.count(200)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
