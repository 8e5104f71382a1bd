"""Translation for the compatible APIs: texts in, texts out, on the model that serves the language pair.

    texts = await translate(model, ["Monday, 30 November 2026. Nov 3rd 1999."], source="en")

Every text is split into sentences and pieces that fit the model (toolkit.apps.segment); all the pieces of a request go to
the model's scheduler as jobs of at most --max-batch rows each, so they decode in one batch where they fit (and
share it with other requests, like /v1/generate's inputs), and every text comes back joined with its whitespace.
Request bodies are JSON objects or forms (application/x-www-form-urlencoded or multipart/form-data), as the
LibreTranslate and DeepL clients send them.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from starlette.formparsers import FormParser, MultiPartParser

from runtime.errors import OnnxformerError
from runtime.generate import to_outputs
from runtime.request import Request as Generation, languages, search_options, target_options
from toolkit.apps.serve.app import RequestError, read_body, submit, wait_for_disconnect
from toolkit.apps.serve.models import ServedModel
from toolkit.apps.serve.scheduler import Job
from toolkit.apps.segment import plan_texts


async def read_fields(request: Request, limit: int) -> dict[str, object]:
    """The request's fields: a JSON object as it is, a form's (or query's) fields as strings (a list where a field
    repeats). RequestError (400, 413, 415) for a body that is none of these."""
    body = await read_body(request, limit)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    fields: dict[str, object] = _pairs(request.query_params.multi_items())
    if not body:
        return fields
    if kind == "application/json":
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(400, "malformed_json", f"the body is not valid JSON ({exc}); send a JSON object")
        if not isinstance(data, dict):
            raise RequestError(400, "malformed_json", "the body must be a JSON object such as {\"q\": \"text\"}")
        return {**fields, **data}
    if kind not in ("application/x-www-form-urlencoded", "multipart/form-data"):
        raise RequestError(415, "media_type", f"unsupported Content-Type {kind or '(none)'!r}; send JSON "
                                              f"(application/json) or a form (application/x-www-form-urlencoded)")

    form = await parse_form(request.headers, body, kind == "multipart/form-data")
    return {**fields, **_pairs((k, v) for k, v in form.multi_items() if isinstance(v, str))}


async def parse_form(headers, body: bytes, multipart: bool):
    """starlette's FormData of a form body already read (multipart: its files as UploadFile); RequestError (400)
    for a broken one."""
    async def stream():
        yield body
        yield b""

    parser = MultiPartParser if multipart else FormParser
    try:
        return await parser(headers, stream()).parse()
    except Exception as exc:                                # python-multipart's errors for a broken form
        raise RequestError(400, "malformed_form", f"the form cannot be read ({exc}); send a valid form or JSON")


def _pairs(items) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in items:
        if key in out:
            out[key] = (out[key] if isinstance(out[key], list) else [out[key]]) + [value]
        else:
            out[key] = value
    return out


def text_list(value, field: str) -> list[str]:
    """A field that holds one text or a list of texts, as a list; RequestError (400) for anything else."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise RequestError(400, "validation", f"{field!r} must be a text or a non-empty list of texts")
    return texts


async def translate(model: ServedModel, texts: list[str], source: str | None, request: Request,
                    target: str | None = None) -> list[str]:
    """The translations of `texts` by `model` (source: the language whose sentence rules split them; a multilingual
    model decodes from source into target, its own codes of these client codes); a client that leaves (`request`
    disconnects) frees its rows: RequestError 499."""
    service, arrived = model.service, time.monotonic()
    if not service.ready:
        raise RequestError(503, "not_ready", f"the server is {service.state}; retry shortly", retry_after=1)
    lang = source or (model.source[0] if model.source and not model.native else None)
    try:
        tokenizer, lead = languages(service.tokenizer, *model.pair(source, target or ""))
        plan = plan_texts(texts, tokenizer, service.engine.max_len, lang)
    except OnnxformerError as exc:
        raise RequestError(400, "validation", str(exc)) from None
    step, settings = service.settings.max_batch, service.settings
    if len(plan.rows) > step * settings.max_queue:
        raise RequestError(413, "too_large", f"the texts split into {len(plan.rows)} sentences, more than this "
                                             f"server takes in one request ({step * settings.max_queue}); send fewer")
    hyps = await _decode(service, plan.rows, arrived, request, lead)
    outputs = to_outputs(hyps, service.engine.eos_id, service.tokenizer)
    metrics = service.metrics
    metrics.requests.labels("ok").inc()
    metrics.latency.observe(time.monotonic() - arrived)
    metrics.tokens.inc(sum(len(o.ids) for o in outputs))
    return plan.join([o.text for o in outputs])


async def _decode(service, rows: list[list[int]], arrived: float, request: Request, lead: list[int]) -> list:
    """Greedy hypotheses of `rows` (each target starting with `lead`, its forced language), queued as jobs of at
    most --max-batch rows; all cancelled if the client leaves."""
    engine, step = service.engine, service.settings.max_batch

    def part(rows: list[list[int]]) -> Generation:
        targets = target_options(None, len(rows), lead=lead)
        return Generation.build(engine, rows, None, search_options(engine, engine.max_len - len(lead), **targets))
    try:                                                     # validated whole before any part is queued
        parts = [part(rows[i:i + step]) for i in range(0, len(rows), step)]
    except OnnxformerError as exc:
        raise RequestError(400, "validation", str(exc)) from None
    jobs: list[Job] = []
    try:
        for part in parts:
            jobs.append(Job(part, arrived))
            submit(service, jobs[-1])
    except RequestError:
        for job in jobs[:-1]:
            service.scheduler.cancel(job)
        raise
    answers = asyncio.gather(*(asyncio.wrap_future(job.future) for job in jobs))
    disconnect = asyncio.ensure_future(wait_for_disconnect(request))
    done, _ = await asyncio.wait({answers, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if answers not in done:                                  # the client left: free its rows, answer nobody
        for job in jobs:
            service.scheduler.cancel(job)
        answers.cancel()
        raise RequestError(499, "cancelled", "the client closed the connection")
    disconnect.cancel()
    try:
        return [h for per_job in answers.result() for h in per_job]
    except Exception as exc:                                 # the engine failed on a batch
        raise RequestError(500, "engine", f"translation failed: {type(exc).__name__}: {exc}".splitlines()[0])
