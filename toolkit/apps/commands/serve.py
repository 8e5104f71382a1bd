"""onnxformer serve: an HTTP server (FastAPI on uvicorn) over a bundle, batching requests together."""

from __future__ import annotations

from pathlib import Path

import click

from toolkit.apps.commands._common import friendly
from toolkit.apps.extras import require


@click.command("serve")
@click.argument("bundles", nargs=-1, required=True, metavar="[NAME=]BUNDLE...")
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
@click.option("--max-audio-bytes", default=25 << 20, show_default=True, help="largest body of an audio request "
              "(POST /v1/audio/...; 413 above it)")
@click.option("--ray", "use_ray", is_flag=True, help="run the server in Ray Serve replicas (the ray extra)")
@click.option("--replicas", default=1, show_default=True, help="with --ray: replicas, spread over the cluster's nodes")
@click.option("--address", help="with --ray: join this Ray cluster ('auto' or HOST:6379) instead of a local one")
@click.option("--languages", multiple=True, metavar="NAME=SRC:TGT",
              help="the language pair a model translates (codes may be comma lists); repeat per model; default: "
                   "the bundle manifest's 'languages' field")
@click.option("--api-keys", type=click.Path(path_type=Path), help="file of API keys, one a line, each optionally "
              "with rpm=N (requests per minute) and chars=N (characters per month); the /v1, /translate and /v2 "
              "routes then need a key")
@click.option("--protect-metrics", is_flag=True, help="with --api-keys: /metrics needs a key too")
@click.option("--allow-open", is_flag=True, help="listen on a non-loopback --host without --api-keys")
@click.option("--ssl-certfile", type=click.Path(path_type=Path), help="serve HTTPS with this certificate (PEM)")
@click.option("--ssl-keyfile", type=click.Path(path_type=Path), help="the certificate's private key (PEM)")
@friendly
def command(bundles, host, port, provider, threads, max_batch, max_wait_ms, max_queue, batching, max_beam,
            max_audio_bytes, use_ray, replicas, address, languages, api_keys, protect_metrics, allow_open,
            ssl_certfile, ssl_keyfile):
    """Serve one or more bundles over HTTP: POST /v1/generate ("stream": true: server-sent events), POST /v1/score,
    GET /healthz, /v1/model, /v1/models, /metrics, /docs, the LibreTranslate (/translate, /languages) and DeepL
    (/v2/translate, /v2/languages, /v2/usage) APIs, and for Whisper bundles OpenAI's POST /v1/audio/transcriptions
    and /v1/audio/translations. Several bundles are given as NAME=BUNDLE; a lone BUNDLE is
    named after its folder.

    Greedy requests join the running batch at the next decoding step and leave it when done (in-flight
    batching, where the bundle allows it: --batching auto, the default); with --batching request, and for beam
    requests, requests that arrive within --max-wait-ms of each other decode as one batch. SIGTERM (or Ctrl-C) stops
    accepting connections, answers every accepted request, and exits 0. With --ray the same app runs in
    --replicas Ray Serve replicas (each batching its own requests), on a local Ray instance or the cluster at
    --address.
    """
    require("serve")
    from toolkit.apps.serve.keys import check_access
    from toolkit.apps.serve.app import ServeSettings, bind, run
    from toolkit.apps.serve.models import ModelSet, parse_languages, parse_specs

    settings = ServeSettings(provider=provider, threads=threads, max_batch=max_batch, max_wait_ms=max_wait_ms,
                             max_queue=max_queue, max_beam=max_beam, batching=batching,
                             max_audio_bytes=max_audio_bytes)
    settings.check()
    named = parse_specs(list(bundles))
    pairs = parse_languages(list(languages), list(named))
    if use_ray:
        if len(named) > 1 or api_keys or ssl_certfile or languages:
            raise click.UsageError("--ray serves one bundle, without --api-keys, --languages or --ssl-certfile")
        check_access(host, None, protect_metrics, allow_open, None, None)     # no keys: loopback or --allow-open
        require("ray")
        from toolkit.apps.serve.ray_serve import serve_on_ray

        serve_on_ray(next(iter(named.values())), settings, host, port, replicas, address,
                     log=lambda line: click.echo(line, err=True))
        return
    if replicas != 1 or address:
        raise click.UsageError("--replicas and --address need --ray")
    keys, ssl = check_access(host, api_keys, protect_metrics, allow_open, ssl_certfile, ssl_keyfile)
    sock = bind(host, port)                           # before loading: a taken port fails at once
    click.echo(f"loading {', '.join(f'{n}={p}' for n, p in named.items())} ...", err=True)
    models = ModelSet.load(named, settings, pairs)
    bound_host, bound_port = sock.getsockname()[:2]
    for model in models.models.values():
        info = model.service.model_info()
        langs = f", {','.join(model.source)} -> {','.join(model.target)}" if model.target else ""
        click.echo(f"model {model.name}: {info['bundle']} ({info['precision']}, {info['kv_cache']} KV cache, ONNX "
                   f"Runtime on {info['provider']}{langs}), {model.service.scheduler.kind} batching", err=True)
        if model.service.scheduler.not_inflight:
            click.echo(f"note: {model.name}: request-level batching, not in-flight: "
                       f"{model.service.scheduler.not_inflight}", err=True)
    click.echo(f"serving on {'https' if ssl else 'http'}://{bound_host}:{bound_port}: max batch {max_batch}, max "
               f"wait {max_wait_ms:g} ms, queue {max_queue}, {'API keys' if keys else 'no API keys'}; warming up",
               err=True)
    run(models, sock, log=lambda line: click.echo(line, err=True), keys=keys, ssl=ssl)
