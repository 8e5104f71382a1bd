"""The server's streamed answers ("stream": true: server-sent events) and POST /v1/score: each input's streamed ids
and text pieces join to the unstreamed answer, whose records the last event carries, under either scheduler; a
client that leaves frees its in-flight row; beam search cannot stream; /v1/score answers what runtime.score and
`onnxformer score --json` give for the same pairs."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from runtime.score import score_ids, score_texts  # noqa: E402
from toolkit.apps.serve.app import ServeSettings, Service, create_app  # noqa: E402
from toolkit.apps.serve.inflight import InflightScheduler  # noqa: E402
from toolkit.apps.serve.models import ModelSet  # noqa: E402

from test_serve import bundles, label_metric, serving  # noqa: E402,F401 (bundles: a fixture)
from test_serve_inflight import Slow  # noqa: E402

TEXTS = ["abcdef", "XYZ", "hello", "q"]


def stream_events(client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/generate", json={**body, "stream": True}) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = list(answer.iter_lines())
    assert all(line.startswith("data: ") or line == "" for line in lines), lines
    return [json.loads(line[len("data: "):]) for line in lines if line]


def assert_joins_to(events: list[dict], outputs: list[dict]) -> None:
    """Every event but the last is a piece; each input's pieces join to its output; the last carries `outputs`."""
    *pieces, final = events
    assert final["final"] is True and final["outputs"] == outputs and "final" not in pieces[0]
    for out in outputs:
        mine = [e for e in pieces if e["index"] == out["index"]]
        assert [t for e in mine for t in e["ids"]] == out["ids"]
        assert "".join(e["text"] for e in mine) == out["text"]
        assert sum(1 for e in mine if e["text"]) >= min(2, len(out["text"])), "the text came in one piece"


@pytest.mark.parametrize("kv, scheduler", [("dynamic", "request-level"), ("static", "in-flight")])
def test_streamed_events_join_to_the_unstreamed_answer(bundles, kv, scheduler):
    from fastapi.testclient import TestClient

    service = Service.load(bundles[kv], ServeSettings(provider="cpu", max_wait_ms=5))
    assert service.scheduler.kind == scheduler
    greedy = {"inputs": TEXTS, "max_new_tokens": 12}
    sampled = {**greedy, "sample": True, "seed": 3, "temperature": 1.5}
    penalized = {**greedy, "repetition_penalty": 1.4}                # request-level under either scheduler
    with TestClient(create_app(service, start_in_background=False)) as client:
        for body in (greedy, sampled, penalized):
            plain = client.post("/v1/generate", json=body).json()["outputs"]
            events = stream_events(client, body)
            for record in plain + events[-1]["outputs"]:
                record["score"] = round(record["score"], 4)
            assert_joins_to(events, plain)
        steps = getattr(service.scheduler, "steps", None)
        assert len({tuple(r["ids"]) for r in plain}) >= 3, "outputs do not vary: equality would prove nothing"
        ids = stream_events(client, {"ids": [[5, 6, 7, 8]], "max_new_tokens": 6})
        assert ids[-1]["outputs"][0]["ids"] == [t for e in ids[:-1] for t in e["ids"]]
        empty = stream_events(client, {"inputs": ["abc"], "max_new_tokens": 0})
        assert len(empty) == 1 and empty[0]["outputs"][0]["ids"] == []
    if scheduler == "in-flight":
        assert steps > 0                                             # the streamed greedy rows decoded in-flight


@pytest.mark.parametrize("extra, message", [
    ({"beam": 2}, "beam search (beam 2) knows its best hypothesis only at the end; use beam 1"),
    ({"sample": True, "num_return": 2}, "streaming sends one output per input; use num_return 1"),
])
def test_a_stream_that_cannot_follow_one_hypothesis_gets_422(client, extra, message):
    answer = client.post("/v1/generate", json={"inputs": ["abc"], "stream": True, **extra})
    assert answer.status_code == 422 and message in answer.json()["error"], answer.text


@pytest.fixture(scope="module")
def client(bundles):
    from fastapi.testclient import TestClient

    service = Service.load(bundles["dynamic"], ServeSettings(provider="cpu", max_batch=4))
    with TestClient(create_app(service, start_in_background=False)) as c:
        yield c


def test_a_streaming_client_that_leaves_frees_its_in_flight_row(bundles):
    """The client reads two events and closes the connection: its row leaves the batch at the next step."""
    service = Service.load(bundles["static"], ServeSettings(provider="cpu", max_batch=2, batching="inflight"))
    scheduler = service.scheduler = InflightScheduler(Slow(service.engine), max_batch=2, max_queue=8,
                                                      metrics=service.metrics)
    with serving(service) as url:
        body = {"ids": [[5, 6, 7]], "max_new_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/generate", json=body, timeout=60) as answer:
            lines = answer.iter_lines()
            assert [next(lines).startswith("data: ") for _ in range(3)] == [True, False, True]   # event, blank, event
            assert scheduler.batch.live == 1
        deadline = time.monotonic() + 20
        while scheduler.batch.live or label_metric(url, "onnxformer_errors_total", kind="cancelled") < 1:
            assert time.monotonic() < deadline, "the row stayed in the batch after its client left"
            time.sleep(0.01)
        assert scheduler.steps < 60 and not scheduler._rows
        answer = httpx.post(url + "/v1/generate", json={**body, "stream": False, "max_new_tokens": 4}, timeout=60)
        assert len(answer.json()["outputs"][0]["ids"]) == 4                 # the server goes on


# --- POST /v1/score ---

SOURCES, TARGETS = ["abcdef", "XYZ", "hello"], ["abc", "xyzXYZ", ""]


def test_score_answers_what_runtime_score_and_the_cli_give(bundles, tmp_path):
    from fastapi.testclient import TestClient

    from toolkit.apps.cli import main

    service = Service.load(bundles["dynamic"], ServeSettings(provider="cpu", max_batch=4))
    want = score_texts(service.engine, service.tokenizer, SOURCES, TARGETS)
    (tmp_path / "src.txt").write_text("\n".join(SOURCES) + "\n")
    (tmp_path / "tgt.txt").write_text("\n".join(TARGETS) + "\n")
    cli = CliRunner().invoke(main, ["score", str(bundles["dynamic"]), "--source", str(tmp_path / "src.txt"),
                                    "--target", str(tmp_path / "tgt.txt"), "--json", "--provider", "cpu"])
    assert cli.exit_code == 0, cli.output
    assert [json.loads(line) for line in cli.stdout.splitlines()] == want
    assert len({round(r["score"], 3) for r in want}) == 3, "scores do not vary: equality would prove nothing"
    with TestClient(create_app(service, start_in_background=False)) as client:
        texts = client.post("/v1/score", json={"source": SOURCES, "target": TARGETS})
        assert texts.status_code == 200, texts.text
        assert texts.json()["scores"] == want
        pairs = client.post("/v1/score", json={"pairs": [{"source": s, "target": t} for s, t in zip(SOURCES,
                                                                                                    TARGETS)]})
        assert pairs.json()["scores"] == want
        sources = [service.tokenizer.encode(s) for s in SOURCES]
        targets = [r["ids"][:-1] for r in want]                          # without the end token
        ids = client.post("/v1/score", json={"source_ids": sources, "target_ids": targets}).json()["scores"]
        assert [(r["source"], r["target"]) for r in ids] == list(zip(sources, targets))
        np.testing.assert_allclose([r["score"] for r in ids], [s.score for s in score_ids(service.engine, sources,
                                                                                              targets)], atol=0)
        assert [r["token_logprobs"] for r in ids] == [r["token_logprobs"] for r in want]


SCORE_BAD = [
    ({"source": ["abc"]}, '"source" needs "target"'),
    ({"source": ["abc", "d"], "target": ["x"]}, "got 2 sources and 1 targets; give one target per source"),
    ({"source": ["abc"], "target": ["x"], "source_ids": [[5]], "target_ids": [[6]]}, "give exactly one of"),
    ({}, "give exactly one of"),
    ({"pairs": [{"source": "abc"}]}, "'pairs.0.target'"),
    ({"source": ["a"] * 5, "target": ["b"] * 5}, "too many pairs: 5, this server scores at most 4"),
    ({"source": [""], "target": ["x"]}, "input 0 is empty"),
    ({"source_ids": [[5, 6]], "target_ids": [[999]]}, "target 0 has token id(s) [999] outside the target vocab"),
    ({"source": ["abc"], "target": ["x"], "model": "other"}, "unknown model 'other'"),
    ({"source": ["abc"], "targets": ["x"]}, "unknown field 'targets'"),
]


@pytest.mark.parametrize("body, message", SCORE_BAD, ids=[str(i) for i in range(len(SCORE_BAD))])
def test_bad_score_requests_get_a_one_line_422(client, body, message):
    answer = client.post("/v1/score", json=body)
    assert answer.status_code == 422 and message in answer.json()["error"], answer.text
    assert "\n" not in answer.json()["error"]


def test_score_picks_the_named_model(bundles):
    from fastapi.testclient import TestClient

    settings = ServeSettings(provider="cpu")
    models = ModelSet.load({"dynamic": bundles["dynamic"], "static": bundles["static"]}, settings, {
        "dynamic": (("en",), ("de",)), "static": (("en",), ("fr",))})
    with TestClient(create_app(models, start_in_background=False)) as client:
        for name in ("dynamic", "static"):
            service = models.models[name].service
            got = client.post("/v1/score", json={"model": name, "source": SOURCES, "target": TARGETS})
            assert got.status_code == 200, got.text
            want = score_texts(service.engine, service.tokenizer, SOURCES, TARGETS)
            np.testing.assert_allclose([r["score"] for r in got.json()["scores"]], [r["score"] for r in want],
                                       atol=1e-5)
        unnamed = client.post("/v1/score", json={"source": SOURCES, "target": TARGETS})
        assert unnamed.status_code == 422 and "serves several models" in unnamed.json()["error"]
