"""`onnxformer serve`: a bundle behind an HTTP API (FastAPI on uvicorn), with batching across requests.

    app.py        the ASGI app: routes, error answers, the Service that owns the engine, `run` (uvicorn)
    scheduler.py  the batching scheduler: a bounded queue and one decoding thread
    schemas.py    request and answer bodies (pydantic), request limits
    metrics.py    Prometheus metrics (one registry per Service)
    ray_serve.py  the same app and engine in Ray Serve deployments
    ray_data.py   offline generation with Ray Data (map_batches over an actor pool)
    loadtest.py   a bounded load generator for a running server (loopback only)

The top layer of toolkit: it imports the runtime (and nothing that needs torch), so a bundle serves from a
`pip install "onnxformer[cpu,serve]"` install.
"""
