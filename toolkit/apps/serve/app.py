"""The HTTP API over a bundle: a FastAPI app around a Service (the loaded bundle, its scheduler, its metrics).

    service = Service.load("out/dates-int8", ServeSettings(max_batch=32))
    app = create_app(service)                 # ASGI: uvicorn here (`run`), or inside a Ray Serve replica
    run(service, host="127.0.0.1", port=8000) # blocks; SIGTERM drains and returns

Routes: POST /v1/generate (the records, or server-sent events: sse.py), POST /v1/score (scoring.py), GET /healthz,
GET /v1/model, GET /v1/models, GET /metrics, FastAPI's /docs and /openapi.json, the LibreTranslate- and
DeepL-compatible routes of compat.py, and OpenAI's POST /v1/audio/transcriptions and /v1/audio/translations
(audio_routes.py: Whisper bundles). `create_app` takes one Service or a models.ModelSet (several bundles; a request
names its model). Every refusal is a JSON body {"error": "<one line naming the problem and the fix>"} with a 4xx
(the request) or 503 (not ready, queue full, shutting down; with Retry-After) status.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from runtime.bundle import Bundle, load_bundle
from runtime.errors import InputError, OnnxformerError
from runtime.generate import records, to_outputs
from toolkit.apps.serve.metrics import Metrics
from toolkit.apps.serve.models import ModelSet
from toolkit.apps.serve.inflight import InflightScheduler
from toolkit.apps.serve.scheduler import Job, Overloaded, Scheduler, Stopped
from toolkit.apps.serve.schemas import GenerateRequest, GenerateResponse, Limits, parse_request
from toolkit.apps.serve.sse import HEADERS, MEDIA_TYPE, Tokens, events


class ServeError(OnnxformerError):
    """The server cannot start as asked (port in use, bad settings)."""


@dataclass(frozen=True)
class ServeSettings:
    """How a server runs its bundle: provider, threads, batching and request limits."""

    provider: str = "auto"          # auto | cpu | cuda
    threads: int | None = None      # ONNX Runtime intra-op threads (None: its default)
    max_batch: int = 32             # inputs decoded together; also the most inputs one request may carry
    max_wait_ms: float = 5.0        # how long the oldest waiting request waits for others to join its batch
    max_queue: int = 256            # requests waiting or decoding; more get 503 + Retry-After
    max_beam: int = 8
    max_audio_bytes: int = 25 << 20  # an audio request's body (POST /v1/audio/...: 413 above it; OpenAI's 25 MB)
    batching: str = "auto"          # request | inflight | auto (in-flight where the bundle allows it, else
                                    # request-level): in-flight gives more throughput on CPU
                                    # (benchmarks/RESULTS.md, "Serving")

    def check(self) -> None:
        for name, low in (("max_batch", 1), ("max_queue", 1), ("max_beam", 1), ("max_wait_ms", 0),
                          ("max_audio_bytes", 1)):
            if getattr(self, name) < low:
                raise ServeError(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(self, name)}")
        if self.batching not in BATCHING:
            raise ServeError(f"--batching must be one of {', '.join(BATCHING)}, got {self.batching!r}")
        if self.threads is not None and self.threads < 1:
            raise ServeError(f"--threads must be at least 1, got {self.threads}")

    @property
    def limits(self) -> Limits:
        return Limits(max_inputs=self.max_batch, max_beam=self.max_beam)


BATCHING = ("request", "inflight", "auto")


def make_scheduler(engine, settings: ServeSettings, metrics: Metrics) -> Scheduler:
    """In-flight batching (greedy requests; beam requests still batch request-level) where the engine allows it:
    --batching inflight refuses a bundle it cannot serve that way (ServeError: the reason and the fix), auto falls
    back to request-level batching."""
    args = (engine, settings.max_batch, settings.max_wait_ms, settings.max_queue, metrics)
    why = None
    if getattr(engine, "feature_shape", None) is not None:     # audio_routes decodes a speech model's requests
        why = "a speech (Whisper) model decodes its audio requests on its own worker, one 30 s window at a time"
        if settings.batching == "inflight":
            raise ServeError(f"--batching inflight: {why}; serve it with --batching request (or auto)")
    elif settings.batching != "request":
        try:
            return InflightScheduler(*args)
        except InputError as exc:
            if settings.batching == "inflight":
                raise ServeError(f"--batching inflight: {exc}; or serve with --batching request (or auto)") from None
            why = str(exc)
    scheduler = Scheduler(*args)
    scheduler.not_inflight = why                              # auto fell back: why in-flight is not possible
    return scheduler


class Service:
    """A loaded bundle with its scheduler and metrics: everything the routes need, nothing HTTP-specific."""

    def __init__(self, bundle: Bundle, settings: ServeSettings):
        settings.check()
        self.bundle, self.settings, self.limits = bundle, settings, settings.limits
        self.engine, self.tokenizer = bundle.engine, bundle.tokenizer
        self.metrics = Metrics()
        self.scheduler = make_scheduler(self.engine, settings, self.metrics)
        self.state = "loaded"       # loaded -> warming up -> ready -> draining -> stopped
        self._started = False

    @classmethod
    def load(cls, path: str | Path, settings: ServeSettings | None = None) -> "Service":
        settings = settings or ServeSettings()
        settings.check()
        return cls(load_bundle(path, provider=settings.provider, threads=settings.threads), settings)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def start(self) -> None:
        """Start the scheduler and warm the engine up (once; a second call does nothing)."""
        if self._started:
            return
        self._started = True
        self.state = "warming up"
        self.warm_up()
        self.scheduler.start()
        self.state = "ready"

    def warm_up(self) -> None:
        """Decode a few steps before serving, so the first requests do not pay for first runs."""
        self.scheduler.warm_up()

    def stop(self) -> None:
        """Finish every accepted request, then stop the decoding thread."""
        self.state = "draining"
        self.scheduler.stop()
        self.state = "stopped"

    def model_info(self) -> dict:
        m = self.bundle.manifest
        keys = ("vocab_size", "d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "max_len")   # vocab: target
        return {
            "bundle": str(self.bundle.path), "precision": m.get("precision"), "kv_cache": m.get("kv_cache", "dynamic"),
            "provider": self.bundle.provider, "engine": getattr(self.engine, "name", "ort"),
            "tokenizer": self.tokenizer is not None, "fusions": m.get("fusions", {}),
            "model": {**{k: m["model"][k] for k in keys if k in m["model"]},
                      "src_vocab_size": self.engine.src_vocab_size},
            "scheduler": {"kind": self.scheduler.kind, "max_batch": self.settings.max_batch,
                          "max_wait_ms": self.settings.max_wait_ms, "max_queue": self.settings.max_queue,
                          **({"not_inflight": self.scheduler.not_inflight} if self.scheduler.not_inflight else {})},
            "limits": {**asdict(self.limits), "max_new_tokens": self.engine.max_len,
                       "max_input_tokens": self.engine.max_len},
        }


class RequestError(Exception):
    """A request the server refuses: HTTP status, metrics kind, one-line message."""

    def __init__(self, status: int, kind: str, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.kind, self.retry_after = status, kind, retry_after


def submit(service: Service, job: Job) -> None:
    """Queue `job` on the service's scheduler; RequestError (503 + Retry-After) when it is full or stopping."""
    try:
        service.scheduler.submit(job)
    except Overloaded as exc:
        raise RequestError(503, "queue_full", str(exc), retry_after=exc.retry_after) from None
    except Stopped as exc:
        raise RequestError(503, "shutting_down", str(exc), retry_after=1) from None


def error_response(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused once it passes `limit` bytes (memory stays bounded whatever a client sends)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, "too_large", f"the request body has {declared} bytes, more than this server's "
                                             f"limit of {limit}; send fewer or shorter inputs per request")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, "too_large", f"the request body is larger than this server's limit of {limit} "
                                                 f"bytes; send fewer or shorter inputs per request")
        chunks.append(chunk)
    return b"".join(chunks)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read: only a disconnect comes now)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(service: Service | ModelSet, start_in_background: bool = True, on_ready=None, keys=None) -> FastAPI:
    """The FastAPI app for `service` (or several: a ModelSet). Its lifespan starts the services (warm-up in a thread
    when `start_in_background`, so /healthz answers 503 meanwhile; then `on_ready()`) and drains them at shutdown.
    `keys` (keys.ApiKeys): the API keys the /v1, LibreTranslate and DeepL routes ask for (None: an open server)."""
    from toolkit.apps.serve.audio_routes import add_audio_routes
    from toolkit.apps.serve.compat import add_compat_routes
    from toolkit.apps.serve.scoring import add_score_route

    models = service if isinstance(service, ModelSet) else ModelSet.single(service)
    app = FastAPI(title="onnxformer", version="1", lifespan=_lifespan(models, start_in_background, on_ready),
                  description="Generate with an onnxformer bundle (ONNX Runtime), batched across requests.")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        models.front.refused("internal", "error")
        return error_response(500, f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")

    _generate_route(app, models)
    add_score_route(app, models)
    _info_routes(app, models)
    add_compat_routes(app, models, keys)
    add_audio_routes(app, models)
    return app


def _lifespan(models: ModelSet, start_in_background: bool, on_ready):
    """The app's lifespan: start the models (in a thread when `start_in_background`), then `on_ready()`; drain them
    at shutdown."""
    def start() -> None:
        models.start()
        if on_ready is not None:
            on_ready()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_in_background:
            threading.Thread(target=start, name="onnxformer-warm-up", daemon=True).start()
        else:
            await asyncio.to_thread(start)
        yield
        await asyncio.to_thread(models.stop)

    return lifespan


def _generate_route(app: FastAPI, models: ModelSet) -> None:
    """POST /v1/generate on `app`."""
    limits = models.services[0].limits                 # every model of a server has the same settings

    @app.post("/v1/generate", response_model=GenerateResponse, openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": GenerateRequest.model_json_schema()}}}},
        responses={200: {"description": "the records; with \"stream\": true, server-sent events",
                         "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                   400: {"description": "malformed JSON"}, 413: {"description": "body too large"},
                   422: {"description": "a field of the wrong type, unknown, or out of range"},
                   503: {"description": "warming up, queue full or shutting down (see Retry-After)"}})
    async def generate(request: Request):
        """Generate for each input; answers the records of `onnxformer generate --json` ("stream": true: server-sent
        events, a piece of text a token, then those records)."""
        arrived = time.monotonic()
        picked = []                                              # the model, once the body names it
        try:
            job, tokens = await _accept(models, limits, request, arrived, picked)
        except RequestError as exc:
            outcome = "overloaded" if exc.status == 503 else "client_error"
            (picked[0].metrics if picked else models.front).refused(exc.kind, outcome)
            return error_response(exc.status, str(exc), exc.retry_after)
        service = picked[0]
        if tokens is not None:
            return _streamed(service, job, tokens, arrived)
        future = asyncio.wrap_future(job.future)
        disconnect = asyncio.ensure_future(wait_for_disconnect(request))
        done, _ = await asyncio.wait({future, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if future not in done:                                   # the client left: free its rows, answer nobody
            _cancel(service, job)
            return Response(status_code=499)
        disconnect.cancel()
        try:
            return JSONResponse(answer(service, job, arrived))
        except RequestError as exc:
            return error_response(exc.status, str(exc))


def answer(service: Service, job: Job, arrived: float) -> dict:
    """The answer to a job whose future is done, {"outputs": generate --json records, "queue_ms", "total_ms"}
    (counted in the metrics); RequestError 500 when the engine failed on it (scheduler.fail)."""
    metrics = service.metrics
    try:
        hyps = job.future.result()
    except Exception as exc:
        metrics.refused("engine", "error")
        raise RequestError(500, "engine", f"generation failed: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    outputs = to_outputs(hyps, service.engine.eos_id, service.tokenizer)
    finished = time.monotonic()
    metrics.requests.labels("ok").inc()
    metrics.latency.observe(finished - arrived)
    metrics.tokens.inc(sum(len(o.ids) for o in outputs))
    recs = records(job.request.inputs, outputs)
    return {"outputs": recs if job.plan is None else job.plan.join_records(recs, job.texts),
            "queue_ms": round(((job.started or finished) - arrived) * 1000, 3),
            "total_ms": round((finished - arrived) * 1000, 3)}


def _cancel(service: Service, job: Job) -> None:
    """The client left: free the job's rows (or its place in the queue); nobody is answered."""
    service.scheduler.cancel(job)
    service.metrics.refused("cancelled", "cancelled")


def _streamed(service: Service, job: Job, tokens: Tokens, arrived: float) -> StreamingResponse:
    """The event stream of a job with "stream": true (sse.py); its last event holds what `answer` gives."""
    def finish() -> dict:
        try:
            return answer(service, job, arrived)
        except RequestError as exc:
            return {"error": str(exc)}

    body = events(tokens, len(job.sequences), service.tokenizer, service.engine.eos_id, finish,
                  lambda: _cancel(service, job))
    return StreamingResponse(body, media_type=MEDIA_TYPE, headers=HEADERS)


async def read_request(models: ModelSet, limits: Limits, request: Request, schema, picked: list) -> tuple:
    """(the body parsed as `schema` (schemas.py), the Service it names, also appended to `picked`) once the server
    is ready; RequestError for a refusal."""
    if not models.ready:
        raise RequestError(503, "not_ready", f"the server is {models.state}; retry shortly", retry_after=1)
    body = await read_body(request, limits.max_body_bytes)
    try:
        parsed = parse_request(body, schema)
    except ValueError as exc:
        malformed = str(exc).startswith("the body is not valid JSON")
        raise RequestError(400 if malformed else 422, "malformed_json" if malformed else "validation",
                           str(exc)) from None
    try:
        service = models.pick(parsed.model)
    except LookupError as exc:
        raise RequestError(422, "unknown_model", str(exc)) from None
    picked.append(service)
    return parsed, service


async def _accept(models: ModelSet, limits: Limits, request: Request, arrived: float,
                  picked: list) -> tuple[Job, Tokens | None]:
    """Read, check and queue a request (its Service appended to `picked`); RequestError for every refusal. It is
    validated completely here (runtime.request), before it can join a batch: a bad request never fails another.
    A streamed one ("stream": true) gets its Tokens before it is queued."""
    parsed, service = await read_request(models, limits, request, GenerateRequest, picked)
    try:
        request, plan = limits.request(parsed, service.engine, service.tokenizer)
        job = Job(request, arrived, plan=plan, texts=parsed.inputs)
    except OnnxformerError as exc:
        kind = "too_many_inputs" if str(exc).startswith("too many inputs") else "validation"
        raise RequestError(422, kind, str(exc)) from None
    tokens = Tokens(job, asyncio.get_running_loop()) if parsed.stream else None
    submit(service, job)
    return job, tokens


def _info_routes(app: FastAPI, models: ModelSet) -> None:
    """GET /healthz, /v1/model, /v1/models and /metrics on `app`."""
    @app.get("/healthz")
    async def healthz():
        """200 once the bundle is loaded and warmed up; 503 before (and while draining)."""
        if models.ready:
            return {"status": "ready"}
        return JSONResponse({"status": models.state}, status_code=503, headers={"Retry-After": "1"})

    @app.get("/v1/model")
    async def model(name: str | None = None):
        """A bundle's manifest summary, the provider it runs on, and the server's batching and limits (?name=MODEL
        when several are served)."""
        try:
            return models.pick(name).model_info()
        except LookupError as exc:
            return error_response(422, str(exc))

    @app.get("/v1/models")
    async def list_models():
        """Every served model: its name, languages, precision, memory (bundle bytes), provider and batching."""
        return {"models": [m.info() for m in models.models.values()]}

    @app.get("/metrics")
    async def prometheus():
        """Prometheus metrics (text format)."""
        return Response(models.metrics_text(), media_type=Metrics.content_type)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), or a ServeError naming the problem."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ServeError(f"--host {host!r} cannot be resolved ({exc.strerror}); pass an address such as 127.0.0.1")
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or stop the "
                         f"program that holds it") from None
    sock.listen(2048)
    return sock


def run(service: Service | ModelSet, sock: socket.socket, log=print, keys=None, ssl: tuple | None = None) -> None:
    """Serve `service` (or several: a ModelSet) on the bound socket until SIGTERM or Ctrl-C; both stop accepting,
    finish every accepted request, drain the schedulers and return (so the process exits 0). `keys`: see
    create_app; `ssl`: (certificate file, key file) to serve HTTPS."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    scheme = "https" if ssl else "http"
    app = create_app(service, start_in_background=True, on_ready=lambda: log(f"ready: {scheme}://{host}:{port}"),
                     keys=keys)
    certfile, keyfile = ssl or (None, None)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=None, timeout_keep_alive=5,
                            ssl_certfile=certfile, ssl_keyfile=keyfile)
    server = uvicorn.Server(config)
    stopping = []
    # uvicorn re-raises the signal it stopped on once it is done; with a handler of ours there, that is a no-op
    previous = {sig: signal.signal(sig, lambda s, f: stopping.append(s)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    services = service.services if isinstance(service, ModelSet) else [service]
    ok = sum(s.metrics.requests.labels("ok")._value.get() for s in services)
    tokens = sum(s.metrics.tokens._value.get() for s in services)
    log(f"stopped: {int(ok)} requests answered, {int(tokens)} tokens generated, "
        f"{sum(s.scheduler.batches for s in services)} batches")
