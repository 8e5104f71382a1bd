"""`onnxformer serve`: bundles behind an HTTP API (FastAPI on uvicorn), with batching across requests.

    app.py        the ASGI app: routes, error answers, the Service that owns the engine, `run` (uvicorn)
    scheduler.py  the batching scheduler: a bounded queue and one decoding thread
    schemas.py    request and answer bodies (pydantic), request limits
    sse.py        "stream": true: server-sent events, a piece of text per chosen token, then the records
    scoring.py    POST /v1/score: teacher-forced log-probabilities of given (source, target) pairs
    metrics.py    Prometheus metrics (one registry per Service)
    ray_serve.py  the same app and engine in Ray Serve deployments
    ray_data.py   offline generation with Ray Data (map_batches over an actor pool)
    loadtest.py   a bounded load generator for a running server (loopback only)
    models.py     several bundles in one server: names, languages, routing, merged metrics
    translate.py  texts in, texts out on one model (the compatible APIs' core), form and JSON bodies
    compat.py     the LibreTranslate- and DeepL-compatible routes, the API-key check of every route
    audio_routes.py  OpenAI's /v1/audio/transcriptions and /v1/audio/translations over Whisper bundles
    keys.py       API keys, per-key request rates and monthly character quotas, who may listen where

The top layer of toolkit: it imports the runtime (and nothing that needs torch), so a bundle serves from a
`pip install "onnxformer[cpu,serve]"` install.
"""
