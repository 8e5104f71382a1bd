"""OpenAI's audio API over the served Whisper bundles: POST /v1/audio/transcriptions and /v1/audio/translations.

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY")   # any key when the server has no --api-keys
    client.audio.transcriptions.create(file=open("talk.wav", "rb"), model="whisper-1", response_format="srt")

A request is OpenAI's multipart form: `file` (WAV, FLAC, OGG or MP3: runtime.audio reads it), `model`, and optionally
`language` (transcriptions only; none: detected), `prompt` (text the audio follows: openai-whisper's initial_prompt,
given to the first 30 s window after <|startofprev|>, its last 223 tokens; never in the answer),
`response_format` (json, text, srt, vtt, verbose_json), `temperature` (t: openai-whisper's fallback schedule t,
t + 0.2, ... up to 1; 0 by default) and `timestamp_granularities[]` (segment, with verbose_json). runtime.Transcriber
decodes the file as `onnxformer transcribe` does: json and text without timestamps; srt, vtt and verbose_json with
the model's timestamp tokens where it has them (else a segment a 30 s window). /v1/audio/translations is the same with
task "translate" (into English) and no `language`.

`model` names a served speech bundle; when the server holds exactly one, any name (OpenAI's "whisper-1") is that one;
with several, an unknown name is a 404 naming them; a text model's name is a 400. Transcription is CPU work: it runs
on one worker thread per speech model (its engine uses every core; the event loop stays free), with at most
--max-queue requests waiting or running (more: 503 with Retry-After); a client that leaves while waiting frees its
place (one whose file is being decoded leaves it to finish). The body is bounded by --max-audio-bytes (413). Every
refusal is OpenAI's error shape, {"error": {"message", "type", "param", "code"}}; the API keys of compat.KeyCheck
answer these paths (401, 429) in that shape too.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from runtime import subtitles
from runtime.errors import AudioError, OnnxformerError
from runtime.transcribe import Transcriber, Transcription
from toolkit.apps.languages import language_name
from toolkit.apps.serve.app import RequestError, read_body, wait_for_disconnect
from toolkit.apps.serve.models import ModelSet, ServedModel
from toolkit.apps.serve.translate import parse_form

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
TIMESTAMPED = ("srt", "vtt", "verbose_json")          # decoded with timestamps (where the model has them)
MEDIA = {"text": "text/plain; charset=utf-8", "srt": "application/x-subrip; charset=utf-8",
         "vtt": "text/vtt; charset=utf-8"}
COMMON = ("file", "model", "prompt", "response_format", "temperature")
FIELDS = {"transcribe": COMMON + ("language", "timestamp_granularities[]", "timestamp_granularities"),
          "translate": COMMON}
PATHS = {"transcribe": "/v1/audio/transcriptions", "translate": "/v1/audio/translations"}
KEY_CODES = {"missing_key": "invalid_api_key", "invalid_key": "invalid_api_key", "quota": "insufficient_quota",
             "rate": "rate_limit_exceeded"}


class AudioRefusal(RequestError):
    """A refused audio request: a RequestError with the OpenAI error's `param` (the form field at fault)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 retry_after: int | None = None):
        super().__init__(status, code, message, retry_after)
        self.param = param


def openai_error(status: int, code: str, message: str, param: str | None = None,
                 retry_after: int | None = None) -> JSONResponse:
    """OpenAI's error answer: {"error": {"message", "type", "param", "code"}} (and Retry-After when given)."""
    kind = "server_error" if status >= 500 else "requests" if status == 429 else "invalid_request_error"
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


@dataclass
class Speech:
    """A served Whisper model, its Transcriber and its worker: one transcription at a time, at most max_queue
    waiting or running."""

    model: ServedModel
    transcriber: Transcriber
    max_queue: int
    pending: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="onnxformer-audio"))

    def submit(self, work) -> Future:
        """work() on the worker thread; AudioRefusal 503 (Retry-After) when max_queue requests are in already."""
        with self.lock:
            if self.pending >= self.max_queue:
                raise AudioRefusal(503, "queue_full", f"{self.pending} transcriptions are waiting or running, this "
                                                      f"server's --max-queue; retry shortly", retry_after=1)
            self.pending += 1
        future = self.pool.submit(work)
        future.add_done_callback(self._done)                   # also when it is cancelled before it ran
        return future

    def _done(self, _future) -> None:
        with self.lock:
            self.pending -= 1


@dataclass(frozen=True)
class Ask:
    """One audio request's form, checked: the file's bytes and name, and what it asks for."""

    audio: bytes
    filename: str
    model: str
    task: str
    language: str | None
    fmt: str
    temperatures: tuple[float, ...]
    prompt: str | None = None


def speech_models(models: ModelSet) -> dict[str, Speech]:
    """{name: Speech} of the served models whose encoder reads audio features (Whisper bundles)."""
    return {m.name: Speech(m, Transcriber.from_engine(m.service.engine, m.service.tokenizer, m.name),
                           m.service.settings.max_queue)
            for m in models.models.values() if getattr(m.service.engine, "feature_shape", None) is not None}


def pick(models: ModelSet, speech: dict[str, Speech], name: str) -> Speech:
    """The speech model a request's `model` names: itself, or the only one when one is served (any name)."""
    if name in speech:
        return speech[name]
    served = ", ".join(speech) or "none"
    if name in models.models:
        raise AudioRefusal(400, "model_not_speech", f"model {name!r} is a text model: it takes no audio; the speech "
                                                    f"models served are: {served}", "model")
    if not speech:
        raise AudioRefusal(404, "model_not_found", f"this server serves no speech model (it serves "
                                                   f"{', '.join(models.models)}); serve a Whisper bundle for "
                                                   f"/v1/audio", "model")
    if len(speech) == 1:
        return next(iter(speech.values()))
    raise AudioRefusal(404, "model_not_found", f"unknown model {name!r}; the speech models served are: {served}",
                       "model")


def schedule(value: str | None) -> tuple[float, ...]:
    """The temperatures of a `temperature` field: openai-whisper's fallback from it by 0.2 up to 1.0."""
    try:
        start = float(value) if value not in (None, "") else 0.0
    except ValueError:
        start = float("nan")
    if not 0.0 <= start <= 1.0:
        raise AudioRefusal(400, "invalid_temperature", f"temperature must be a number from 0 to 1, got {value!r}",
                           "temperature")
    return tuple(round(float(t), 6) for t in np.arange(start, 1.0 + 1e-6, 0.2))


async def read_ask(request: Request, limit: int, task: str) -> Ask:
    """The request's form, read within `limit` bytes and checked; AudioRefusal naming the first problem."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "multipart/form-data":
        raise AudioRefusal(400, "invalid_content_type", f"unsupported Content-Type {kind or '(none)'!r}; send "
                                                        f"multipart/form-data with the audio as the 'file' field")
    try:
        body = await read_body(request, limit)
    except RequestError:
        raise AudioRefusal(413, "file_too_large", f"the request is larger than this server's limit of {limit} "
                                                  f"bytes (--max-audio-bytes); send a shorter clip, or a compressed "
                                                  f"one (FLAC, MP3)", "file") from None
    values = fields_of(await parse_form(request.headers, body, True), task)
    upload = values.get("file")
    if not isinstance(upload, UploadFile):
        raise AudioRefusal(400, "missing_file", "'file' is required: the audio (WAV, FLAC, OGG or MP3) as a "
                                                "multipart file field", "file")
    audio = await upload.read()
    name = upload.filename or "file"
    if not audio:
        raise AudioRefusal(400, "invalid_audio", f"{name!r} is empty (0 bytes); send an audio file", "file")
    return Ask(audio, name, model_field(values), task, values.get("language") or None, format_field(values),
               schedule(values.get("temperature")), values.get("prompt") or None)


def fields_of(form, task: str) -> dict:
    """The form's fields by name (timestamp_granularities as a list, checked); AudioRefusal for an unknown,
    repeated or misplaced one."""
    values: dict = {}
    for key, value in form.multi_items():
        if key not in FIELDS[task]:
            raise AudioRefusal(400, "unknown_parameter", f"unknown parameter {key!r}; {PATHS[task]} takes: "
                                                         f"{', '.join(FIELDS[task][:7])}", key)
        if key.startswith("timestamp_granularities"):
            values.setdefault("granularities", []).append(value)
        elif key in values:
            raise AudioRefusal(400, "duplicate_parameter", f"{key!r} is given twice; give it once", key)
        elif key != "file" and not isinstance(value, str):
            raise AudioRefusal(400, "invalid_parameter", f"{key!r} must be a text field, not a file", key)
        else:
            values[key] = value
    return values


def model_field(values: dict) -> str:
    name = values.get("model")
    if not name:
        raise AudioRefusal(400, "missing_model", "'model' is required: a served speech model's name (any name, "
                                                 "e.g. whisper-1, when the server serves one)", "model")
    return name


def format_field(values: dict) -> str:
    """response_format (json by default), checked with the timestamp granularities it allows."""
    fmt = values.get("response_format") or "json"
    if fmt not in FORMATS:
        raise AudioRefusal(400, "unsupported_response_format", f"response_format {fmt!r} is not supported; use one "
                                                               f"of {', '.join(FORMATS)}", "response_format")
    granularities = values.get("granularities", [])
    bad = [g for g in granularities if g != "segment"]
    if bad:
        raise AudioRefusal(400, "unsupported_granularity", f"timestamp_granularities {bad[0]!r} is not supported "
                                                           f"(no word timestamps); ask for segment",
                           "timestamp_granularities")
    if granularities and fmt != "verbose_json":
        raise AudioRefusal(400, "invalid_parameter", "timestamp_granularities needs response_format verbose_json",
                           "timestamp_granularities")
    return fmt


async def transcribe(speech: Speech, ask: Ask, request: Request) -> Transcription:
    """The Transcription of ask's file, made on the speech model's worker; AudioRefusal for audio it cannot read
    or options it cannot take, 499 when the client leaves first."""
    tr = speech.transcriber
    timestamps = ask.fmt in TIMESTAMPED and tr.has_timestamps
    future = speech.submit(lambda: tr.transcribe(ask.audio, language=ask.language, task=ask.task,
                                                 timestamps=timestamps, temperatures=ask.temperatures,
                                                 initial_prompt=ask.prompt))
    answer = asyncio.wrap_future(future)
    disconnect = asyncio.ensure_future(wait_for_disconnect(request))
    done, _ = await asyncio.wait({answer, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if answer not in done:                      # a waiting job never runs; a running one finishes, unanswered
        future.cancel()
        raise AudioRefusal(499, "cancelled", "the client closed the connection")
    disconnect.cancel()
    try:
        return answer.result()
    except AudioError as exc:
        raise AudioRefusal(400, "invalid_audio", f"{ask.filename!r}: {exc}", "file") from None
    except OnnxformerError as exc:
        param = "language" if ask.language and "language" in str(exc) else \
            "prompt" if ask.prompt and "prompt" in str(exc) else None
        raise AudioRefusal(400, "invalid_request", str(exc), param) from None


def verbose(result: Transcription, task: str) -> dict:
    """OpenAI's verbose_json: task, language (its English name, lower case), duration, text, segments."""
    code = "en" if task == "translate" or result.language is None else result.language
    keys = ("id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob", "compression_ratio",
            "no_speech_prob")
    return {"task": task, "language": language_name(code).lower(), "duration": result.duration,
            "text": result.text, "segments": [{k: getattr(s, k) for k in keys} for s in result.segments]}


def respond(result: Transcription, fmt: str, task: str) -> Response:
    """The answer in response_format `fmt`: json {"text"}, verbose_json, or a text body (text, srt, vtt)."""
    if fmt == "json":
        return JSONResponse({"text": result.text})
    if fmt == "verbose_json":
        return JSONResponse(verbose(result, task))
    writer = {"text": subtitles.txt, "srt": subtitles.srt, "vtt": subtitles.vtt}[fmt]
    return Response(writer(result), media_type=MEDIA[fmt])


def add_audio_routes(app: FastAPI, models: ModelSet) -> None:
    """POST /v1/audio/transcriptions and /v1/audio/translations on `app` (see the module docstring)."""
    speech = speech_models(models)
    limit = models.services[0].settings.max_audio_bytes        # every model of a server has the same settings
    for task, path in PATHS.items():
        _route(app, models, speech, limit, task, path)


def _route(app: FastAPI, models: ModelSet, speech: dict[str, Speech], limit: int, task: str, path: str) -> None:
    async def audio(request: Request):
        arrived, chosen = time.monotonic(), []
        try:
            if not models.ready:
                raise AudioRefusal(503, "not_ready", f"the server is {models.state}; retry shortly", retry_after=1)
            ask = await read_ask(request, limit, task)
            chosen.append(pick(models, speech, ask.model))
            result = await transcribe(chosen[0], ask, request)
        except RequestError as exc:
            outcome = {503: "overloaded", 499: "cancelled"}.get(exc.status, "client_error")
            (chosen[0].model.service.metrics if chosen else models.front).refused(exc.kind, outcome)
            if exc.status == 499:
                return Response(status_code=499)
            return openai_error(exc.status, exc.kind, str(exc), getattr(exc, "param", None), exc.retry_after)
        metrics = chosen[0].model.service.metrics
        metrics.requests.labels("ok").inc()
        metrics.latency.observe(time.monotonic() - arrived)
        metrics.tokens.inc(sum(len(s.tokens) for s in result.segments))
        return respond(result, ask.fmt, task)

    audio.__doc__ = (f"OpenAI's audio {task}: a multipart `file` and `model` (and {', '.join(FIELDS[task][2:])}); "
                     f"answers in response_format json | text | srt | vtt | verbose_json.")
    app.add_api_route(path, audio, methods=["POST"], tags=["OpenAI"], name=f"audio_{task}")
