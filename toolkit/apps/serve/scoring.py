"""POST /v1/score: the log-probability a served model gives each target of its source, teacher-forced
(runtime.score; what `onnxformer score --json` prints).

    {"source": ["Monday, 30 November 2026"], "target": ["2026-11-30"]}     texts, one target per source
    {"pairs": [{"source": "Monday, 30 November 2026", "target": "2026-11-30"}]}
    {"source_ids": [[5, 6, 7]], "target_ids": [[9, 10]]}                   token ids (a target without EOS)
    ... and "model": NAME where the server serves several

    -> {"scores": [{"index", "source", "target", "ids", "token_logprobs", "score"}, ...], "total_ms": 3.1}

A request carries at most --max-batch pairs, scored in one decoder run. Each model scores one request at a time, on
a worker thread (the event loop and the decoding thread go on); at most --max-queue requests wait for it (503 and
Retry-After beyond). Bad pairs get a 422 naming the pair and the fix.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from runtime.errors import OnnxformerError
from runtime.score import score_texts
from toolkit.apps.serve.app import RequestError, error_response, read_request
from toolkit.apps.serve.models import ModelSet
from toolkit.apps.serve.schemas import Limits, ScoreRequest


class Scorer:
    """One model's scoring: one request at a time on a worker thread, at most max_queue waiting for it."""

    def __init__(self, service):
        self.service, self.lock, self.waiting = service, asyncio.Lock(), 0

    async def score(self, sources: list, targets: list, src_lang: str | None = None,
                    tgt_lang: str | None = None) -> list[dict]:
        """The records of the pairs (runtime.score.score_texts); RequestError 422 for a bad pair, 503 when full."""
        if self.waiting >= self.service.settings.max_queue:
            raise RequestError(503, "queue_full", f"the server's scoring queue is full "
                                                  f"({self.service.settings.max_queue} requests); retry after a "
                                                  f"second", retry_after=1)
        self.waiting += 1                                        # the event loop's thread only: no race
        try:
            async with self.lock:
                return await asyncio.to_thread(score_texts, self.service.engine, self.service.tokenizer, sources,
                                               targets, src_lang, tgt_lang)
        except OnnxformerError as exc:
            raise RequestError(422, "validation", str(exc)) from None
        finally:
            self.waiting -= 1


def add_score_route(app: FastAPI, models: ModelSet) -> None:
    """POST /v1/score on `app`."""
    scorers = {id(s): Scorer(s) for s in models.services}
    limits = models.services[0].limits                         # every model of a server has the same settings

    @app.post("/v1/score", openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": ScoreRequest.model_json_schema()}}}},
        responses={400: {"description": "malformed JSON"}, 413: {"description": "body too large"},
                   422: {"description": "a bad field or pair, or too many pairs"},
                   503: {"description": "warming up, queue full or shutting down (see Retry-After)"}})
    async def score(request: Request):
        """Teacher-forced log-probabilities of each (source, target) pair: the records of `onnxformer score
        --json`."""
        arrived, picked = time.monotonic(), []
        try:
            service, parsed, sources, targets = await _accept(models, limits, request, picked)
            records = await scorers[id(service)].score(sources, targets, parsed.src_lang, parsed.tgt_lang)
        except RequestError as exc:
            (picked[0].metrics if picked else models.front).refused(
                exc.kind, "overloaded" if exc.status == 503 else "client_error")
            return error_response(exc.status, str(exc), exc.retry_after)
        service.metrics.requests.labels("ok").inc()
        return JSONResponse({"scores": records, "total_ms": round((time.monotonic() - arrived) * 1000, 3)})


async def _accept(models: ModelSet, limits: Limits, request: Request, picked: list) -> tuple:
    """(the Service, the parsed ScoreRequest, sources, targets) of a score request (the Service also appended to `picked`); RequestError for
    every refusal."""
    parsed, service = await read_request(models, limits, request, ScoreRequest, picked)
    sources, targets = parsed.sides()
    if len(sources) > limits.max_inputs:
        raise RequestError(422, "too_many_inputs", f"too many pairs: {len(sources)}, this server scores at most "
                                                   f"{limits.max_inputs} in one request; split the request")
    return service, parsed, sources, targets


__all__ = ["add_score_route", "Scorer"]
