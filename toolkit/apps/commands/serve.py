"""onnxformer serve: an HTTP server (FastAPI on uvicorn) over a bundle, batching requests together."""

from __future__ import annotations

from pathlib import Path

import click

from toolkit.apps.commands._common import friendly
from toolkit.apps.extras import require


@click.command("serve")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", default=8000, show_default=True, help="port to listen on (0: a free one, printed)")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--threads", type=int, help="ONNX Runtime intra-op threads (default: one per core)")
@click.option("--max-batch", default=32, show_default=True, help="inputs decoded together (and most per request)")
@click.option("--max-wait-ms", default=5.0, show_default=True, help="how long a request waits for others to batch with")
@click.option("--max-queue", default=256, show_default=True, help="requests waiting or decoding; more get 503")
@click.option("--batching", type=click.Choice(["request", "inflight", "auto"]), default="auto", show_default=True,
              help="request: requests arriving within --max-wait-ms decode as one batch; inflight: greedy requests "
                   "join the running batch at the next step (CPU bundles with the per-row static cache); auto: "
                   "inflight where the bundle allows it, else request")
@click.option("--max-beam", default=8, show_default=True, help="largest beam width a request may ask for")
@click.option("--ray", "use_ray", is_flag=True, help="run the server in Ray Serve replicas (the ray extra)")
@click.option("--replicas", default=1, show_default=True, help="with --ray: replicas, spread over the cluster's nodes")
@click.option("--address", help="with --ray: join this Ray cluster ('auto' or HOST:6379) instead of a local one")
@friendly
def command(bundle, host, port, provider, threads, max_batch, max_wait_ms, max_queue, batching, max_beam, use_ray,
            replicas, address):
    """Serve BUNDLE over HTTP: POST /v1/generate, GET /healthz, /v1/model, /metrics, /docs.

    Greedy requests join the running batch at the next decoding step and leave it when done (in-flight
    batching, where the bundle allows it: --batching auto, the default); with --batching request, and for beam
    requests, requests that arrive within --max-wait-ms of each other decode as one batch. SIGTERM (or Ctrl-C) stops
    accepting connections, answers every accepted request, and exits 0. With --ray the same app runs in
    --replicas Ray Serve replicas (each batching its own requests), on a local Ray instance or the cluster at
    --address.
    """
    require("serve")
    from toolkit.apps.serve.app import ServeSettings, Service, bind, run

    settings = ServeSettings(provider=provider, threads=threads, max_batch=max_batch, max_wait_ms=max_wait_ms,
                             max_queue=max_queue, max_beam=max_beam, batching=batching)
    settings.check()
    if use_ray:
        require("ray")
        from toolkit.apps.serve.ray_serve import serve_on_ray

        serve_on_ray(bundle, settings, host, port, replicas, address, log=lambda line: click.echo(line, err=True))
        return
    if replicas != 1 or address:
        raise click.UsageError("--replicas and --address need --ray")
    sock = bind(host, port)                           # before loading: a taken port fails at once
    click.echo(f"loading {bundle} ...", err=True)
    service = Service.load(bundle, settings)
    info = service.model_info()
    bound_host, bound_port = sock.getsockname()[:2]
    click.echo(f"serving {bundle} ({info['precision']}, {info['kv_cache']} KV cache, ONNX Runtime on "
               f"{info['provider']}) on http://{bound_host}:{bound_port}: {service.scheduler.kind} batching, "
               f"max batch {max_batch}, max wait {max_wait_ms:g} ms, queue {max_queue}; warming up", err=True)
    if service.scheduler.not_inflight:
        click.echo(f"note: request-level batching, not in-flight: {service.scheduler.not_inflight}", err=True)
    run(service, sock, log=lambda line: click.echo(line, err=True))
