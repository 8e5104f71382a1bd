"""One request's error never reaches another: requests are validated completely before they join a batch (source
ids against the SOURCE vocabulary, on a model whose source vocabulary is smaller than its target's), a failure
traced to some inputs fails only their requests, and an untraced one never quotes another request's input."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

import runtime.inflight  # noqa: E402
from runtime.bundle import load_bundle  # noqa: E402
from runtime.errors import NumericsError  # noqa: E402
from runtime.generate import generate_ids  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from toolkit.apps.serve.app import ServeSettings, Service  # noqa: E402
from toolkit.apps.serve.inflight import InflightScheduler  # noqa: E402
from toolkit.apps.serve.scheduler import Scheduler, SharedFailure  # noqa: E402
from toolkit.testing.toy import toy_inputs  # noqa: E402

from test_request import Poisoned  # noqa: E402
from test_serve import assert_same, queued, serving  # noqa: E402

SRC_VOCAB = 40                      # the target vocabulary is the tiny preset's 64


@pytest.fixture(scope="module")
def separate(toy_model, tmp_path_factory):
    """(config, {kv cache: bundle}) of the trained toy model given a source vocabulary of its first SRC_VOCAB ids,
    smaller than its target vocabulary (no training: its source embedding is those rows of the shared one)."""
    from exporters.export import export_checkpoint
    from exporters.optimize import optimize_bundle
    from toolkit.reference.checkpoint import save_checkpoint
    from toolkit.reference.model import Transformer

    config = dataclasses.replace(toy_model.config, src_vocab_size=SRC_VOCAB, share_embeddings=False)
    model = Transformer(config).eval()
    state = toy_model.state_dict()
    state.update({"src_" + k: v[:SRC_VOCAB] for k, v in state.items() if k.startswith("embed.")})
    model.load_state_dict(state)
    root = tmp_path_factory.mktemp("separate")
    dynamic = export_checkpoint(save_checkpoint(root / "checkpoint", model), root / "bundle", check_parity=False)
    static, _ = optimize_bundle(dynamic, root / "static")                  # its parity gate checks the export too
    return config, {"dynamic": dynamic, "static": static}


@pytest.mark.parametrize("batching", ["inflight", "request"])
def test_eight_valid_requests_and_one_bad_at_once(separate, batching):
    config, bundles = separate
    service = Service.load(bundles["static"], ServeSettings(provider="cpu", batching=batching, max_batch=16,
                                                            max_wait_ms=200))
    expected = InflightScheduler if batching == "inflight" else Scheduler
    assert type(service.scheduler) is expected
    seqs = toy_inputs(config, 8, min_len=2, max_len=10, seed=31)
    bodies = [{"ids": [s], "max_new_tokens": 4 + i} for i, s in enumerate(seqs)]
    bodies.insert(3, {"ids": [[5, SRC_VOCAB + 10, 6]], "max_new_tokens": 8})    # a target id, not a source id
    answers: list = [None] * len(bodies)
    with serving(service) as url:
        info = httpx.get(url + "/v1/model").json()["model"]
        assert info["src_vocab_size"] == SRC_VOCAB and info["vocab_size"] == 64
        go = threading.Barrier(len(bodies))

        def send(i):
            go.wait()
            answers[i] = httpx.post(url + "/v1/generate", json=bodies[i], timeout=120)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    bad = answers.pop(3)
    assert bad.status_code == 422 and "outside the source vocabulary of 40 ids" in bad.json()["error"]
    assert [a.status_code for a in answers] == [200] * 8
    engine = load_bundle(bundles["static"], provider="cpu").engine
    got = [a.json()["outputs"][0]["ids"] for a in answers]
    alone = [[t for t in generate_ids(engine, [s], SearchOptions(max_new_tokens=4 + i))[0][0].tokens
              if t != config.eos_id] for i, s in enumerate(seqs)]
    assert got == alone
    assert len({tuple(ids) for ids in got}) >= 6, "the model's outputs do not vary: equality would prove nothing"


def test_a_non_finite_logit_fails_only_its_request_at_request_level(separate):
    config, bundles = separate
    engine = load_bundle(bundles["dynamic"], provider="cpu").engine
    seqs = toy_inputs(config, 3, min_len=3, max_len=8, seed=32)
    seqs[1][0] = Poisoned.POISON
    opts = SearchOptions(max_new_tokens=10, ignore_eos=True)
    jobs = [queued(engine, [s], opts) for s in seqs]
    scheduler = Scheduler(Poisoned(engine), max_batch=3, max_wait_ms=10_000)
    for job in jobs:                                 # queued before the thread starts: one full batch
        scheduler.submit(job)
    scheduler.start()
    with pytest.raises(NumericsError, match="non-finite logit"):
        jobs[1].future.result(60)
    for i in (0, 2):
        assert_same(generate_ids(engine, jobs[i].sequences, opts), jobs[i].future.result(60))
    scheduler.stop()


def test_a_non_finite_logit_fails_only_its_rows_in_flight(separate, monkeypatch):
    config, bundles = separate
    engine = load_bundle(bundles["static"], provider="cpu").engine
    seqs = toy_inputs(config, 4, min_len=3, max_len=8, seed=33)
    opts = SearchOptions(max_new_tokens=12, ignore_eos=True)
    jobs = [queued(engine, [s], opts) for s in seqs]
    scheduler = InflightScheduler(engine, max_batch=8, max_queue=8)
    pick = runtime.inflight.greedy_pick

    def poisoned(logits, suppressed=()):            # the rows of job 2 give NaN from their fourth step on
        for i, row in enumerate(scheduler.batch.rows):
            if row.key[0] is jobs[2] and row.length >= 3:
                logits[i] = np.nan
        return pick(logits, suppressed)

    monkeypatch.setattr(runtime.inflight, "greedy_pick", poisoned)
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    with pytest.raises(NumericsError, match="non-finite logit"):
        jobs[2].future.result(60)
    for i in (0, 1, 3):
        assert_same(generate_ids(engine, jobs[i].sequences, opts), jobs[i].future.result(60))
    scheduler.stop()
    assert scheduler.batch.live == 0 and not scheduler._rows


class Failing:
    """The engine, failing (with its inputs in the message, as ONNX Runtime's errors may quote them) on any batch
    that holds an input starting with 9."""

    def __init__(self, engine):
        self.inner = engine

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, ids, mask, expand, max_steps=None):
        if (ids[:, 0] == 9).any():
            raise RuntimeError(f"cannot run on input_ids {ids.tolist()}")
        return self.inner.start(ids, mask, expand, max_steps)


def test_an_untraced_failure_never_quotes_another_request(separate):
    config, bundles = separate
    engine = load_bundle(bundles["dynamic"], provider="cpu").engine
    opts = SearchOptions(max_new_tokens=4)
    mine, theirs = queued(engine, [[9, 10, 11]], opts), queued(engine, [[31, 32, 33]], opts)
    scheduler = Scheduler(Failing(engine), max_batch=2, max_wait_ms=10_000)
    scheduler.submit(mine), scheduler.submit(theirs)
    scheduler.start()
    for job in (mine, theirs):
        with pytest.raises(SharedFailure) as caught:
            job.future.result(60)
        message = str(caught.value)
        assert "RuntimeError" in message and "31" not in message and "9, 10" not in message
    alone = queued(engine, [[9, 10, 11]], opts)      # alone, a request learns its own error
    scheduler.max_wait = 0
    scheduler.submit(alone)
    with pytest.raises(RuntimeError, match=r"\[\[9, 10, 11\]\]"):
        alone.future.result(60)
    scheduler.stop()
