"""Scale-out on Ray Serve: the same app and engine in Ray Serve replicas (offline generation: ray_data.py).

    serve_on_ray("out/bundle", ServeSettings(), host="127.0.0.1", port=8000, replicas=2, address=None)

Ray Serve: each replica is a `Replica` actor that loads the bundle, warms up, and serves create_app's FastAPI app
(so batching, metrics and limits are per replica, exactly as `onnxformer serve`); Ray's proxy spreads requests over
the replicas, which Ray places on the nodes of its cluster. `address` joins an existing cluster ("auto", or
"HOST:6379"); without it a local Ray instance starts on 127.0.0.1. Every node must see the bundle at the same path.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import asdict
from pathlib import Path

from toolkit.apps.serve.app import ServeSettings, Service, create_app
from toolkit.apps.serve.ray_data import RayError, init_ray


def _replica_class():
    """The Ray Serve deployment class (built lazily: importing ray.serve is slow and needs the ray extra)."""
    from ray import serve

    @serve.ingress()
    class Replica:
        """One replica: a Service (bundle, scheduler, metrics) and its FastAPI app."""

        def __init__(self, bundle: str, settings: dict):
            self.service = Service.load(bundle, ServeSettings(**settings))

        def __serve_build_asgi_app__(self):
            return create_app(self.service, start_in_background=False)   # ready when Ray routes to it

        def check_health(self) -> None:
            if self.service.state not in ("loaded", "warming up", "ready"):
                raise RuntimeError(f"replica is {self.service.state}")

    return Replica


def deployment(bundle: str | Path, settings: ServeSettings, replicas: int = 1):
    """The bound Ray Serve application: `replicas` copies of the server, each with `settings.threads` CPUs."""
    from ray import serve

    bundle = str(Path(bundle).resolve())
    cpus = float(settings.threads or 1)
    dep = serve.deployment(_replica_class(), name="onnxformer", num_replicas=replicas,
                           max_ongoing_requests=settings.max_queue,
                           ray_actor_options={"num_cpus": cpus}, graceful_shutdown_timeout_s=120)
    return dep.bind(bundle, asdict(settings))


def serve_on_ray(bundle: str | Path, settings: ServeSettings, host: str, port: int, replicas: int,
                 address: str | None, log=print, stop: threading.Event | None = None) -> None:
    """Run the server on Ray Serve until SIGTERM / Ctrl-C (or `stop` is set); then drain and shut down."""
    from ray import serve

    if replicas < 1:
        raise RayError(f"--replicas must be at least 1, got {replicas}")
    settings.check()
    Service.load(bundle, settings)                               # fail here, with the one-line error, not in Ray
    init_ray(address, None if address else max(replicas * int(settings.threads or 1), os.cpu_count() or 1))
    serve.start(http_options={"host": host, "port": port})
    log(f"deploying {replicas} replica(s) of {bundle} on Ray Serve ...")
    serve.run(deployment(bundle, settings, replicas), name="onnxformer", route_prefix="/")
    log(f"ready: http://{host}:{port} ({replicas} replica(s) on Ray Serve)")
    stop = stop or threading.Event()
    previous = {sig: signal.signal(sig, lambda s, f: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        stop.wait()
    finally:
        log("draining: Ray Serve finishes the requests in flight, then stops")
        serve.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
