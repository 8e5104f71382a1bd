"""A bounded load generator for `onnxformer serve`: fixed request count, a time limit, loopback only.

    report = run_loadtest(LoadSpec("http://127.0.0.1:8000", requests=256, concurrency=32))
    print(report["throughput_rps"], report["latency_ms"]["p99"], report["errors"], report["lost"])

`concurrency` clients each send one request at a time (closed loop) until `requests` have been sent or
`duration_s` has passed; then it stops by itself. Each request carries one input of random token ids and its own max_new_tokens drawn from
[min_new, max_new] with EOS suppressed, so output lengths are exactly the mixed lengths asked for. The report
counts answers by status, errors, lost requests (no HTTP answer at all), throughput (requests and generated
tokens per second), latency percentiles, and the server's batch sizes (from its /metrics, before and after).
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import numpy as np

from runtime.errors import OnnxformerError


class LoadtestError(OnnxformerError):
    """A load test that cannot run as asked (not loopback, no server, bad settings)."""


@dataclass(frozen=True)
class LoadSpec:
    url: str
    requests: int = 256             # requests sent in all
    concurrency: int = 32           # clients, each with one request in flight
    duration_s: float = 600.0       # stop sending after this long, whatever is left
    min_new: int = 8                # each request's max_new_tokens is drawn from [min_new, max_new]
    max_new: int = 128
    min_src: int = 8                # source tokens per input, drawn from [min_src, max_src]
    max_src: int = 32
    beam: int = 1
    seed: int = 0
    timeout_s: float = 300.0        # one request's limit; past it the request counts as lost

    def check(self) -> None:
        if self.requests < 1 or self.concurrency < 1:
            raise LoadtestError("--requests and --concurrency must be at least 1")
        if not 0 <= self.min_new <= self.max_new or not 1 <= self.min_src <= self.max_src:
            raise LoadtestError("need 0 <= --min-new-tokens <= --max-new-tokens and 1 <= min <= max source length")
        if self.duration_s <= 0 or self.timeout_s <= 0:
            raise LoadtestError("--duration and --timeout must be positive")


def check_loopback(url: str) -> str:
    """The base URL, if its host is on this machine's loopback (127.0.0.0/8, ::1); a LoadtestError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadtestError(f"{url!r} is not an http URL; pass the server's address, e.g. http://127.0.0.1:8000")
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(parts.hostname, parts.port or 80)}
    except socket.gaierror:
        raise LoadtestError(f"host {parts.hostname!r} cannot be resolved; use 127.0.0.1") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise LoadtestError(f"{parts.hostname} is not a loopback address; the load generator only sends to servers "
                            f"on this machine (127.0.0.1, localhost, ::1)")
    return url.rstrip("/")


def make_requests(spec: LoadSpec, model: dict) -> list[dict]:
    """The request bodies, seeded: one input each, mixed source and output lengths."""
    rng = random.Random(spec.seed)
    max_len = model["model"]["max_len"]
    vocab = model["model"]["vocab_size"]
    bodies = []
    for _ in range(spec.requests):
        src = rng.randint(min(spec.min_src, max_len), min(spec.max_src, max_len))
        new = rng.randint(min(spec.min_new, max_len), min(spec.max_new, max_len))
        bodies.append({"ids": [[rng.randrange(4, vocab) for _ in range(src)]], "max_new_tokens": new,
                       "ignore_eos": True, "beam": spec.beam})
    return bodies


def _batch_stats(metrics_text: str) -> tuple[float, float]:
    """(batches, rows) so far, from the server's onnxformer_batch_rows histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    count = total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "onnxformer_batch_rows":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value
    return count, total


async def _run(spec: LoadSpec, progress=None) -> dict:
    import httpx

    base = check_loopback(spec.url)
    limits = httpx.Limits(max_connections=spec.concurrency + 2, max_keepalive_connections=spec.concurrency + 2)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=spec.timeout_s) as client:
        try:
            model = (await client.get("/v1/model", timeout=10)).json()
            health = await client.get("/healthz", timeout=10)
            before = _batch_stats((await client.get("/metrics", timeout=10)).text)
        except (httpx.HTTPError, ValueError) as exc:
            raise LoadtestError(f"no onnxformer server answers at {base} ({type(exc).__name__}); start one with "
                                f"'onnxformer serve BUNDLE' first") from None
        if health.status_code != 200:
            raise LoadtestError(f"the server at {base} is not ready ({health.text.strip()}); wait for /healthz")
        bodies = make_requests(spec, model)
        results: list[tuple[int | None, float, int, str]] = []     # status (None: lost), seconds, tokens, error
        next_index = 0
        start = time.monotonic()
        deadline = start + spec.duration_s

        async def client_loop() -> None:
            nonlocal next_index
            while next_index < len(bodies) and time.monotonic() < deadline:
                body = bodies[next_index]
                next_index += 1
                sent = time.monotonic()
                try:
                    answer = await client.post("/v1/generate", json=body)
                except httpx.HTTPError as exc:
                    results.append((None, time.monotonic() - sent, 0, type(exc).__name__))
                else:
                    tokens, error = 0, ""
                    if answer.status_code == 200:
                        outs = answer.json()["outputs"]
                        tokens = sum(len(o["ids"]) for o in outs)
                        if len(outs) != 1 or tokens != body["max_new_tokens"]:
                            error = f"answer has {tokens} tokens, asked for {body['max_new_tokens']}"
                    else:
                        error = answer.text[:200]
                    results.append((answer.status_code, time.monotonic() - sent, tokens, error))
                if progress is not None:
                    progress(len(results), len(bodies))

        await asyncio.gather(*(client_loop() for _ in range(spec.concurrency)))
        wall = time.monotonic() - start
        after = _batch_stats((await client.get("/metrics", timeout=10)).text)
    return report(spec, model, results, wall, before, after)


def latency_ms(seconds: list[float]) -> dict[str, float]:
    """p50, p90, p99 and max of request latencies given in seconds, in milliseconds (zeros for none)."""
    latencies = np.array(seconds) * 1000 if seconds else np.zeros(1)
    return {**{q: round(float(np.percentile(latencies, int(q[1:]))), 1) for q in ("p50", "p90", "p99")},
            "max": round(float(latencies.max()), 1)}


def report(spec: LoadSpec, model: dict, results: list, wall: float, before, after) -> dict:
    ok = [r for r in results if r[0] == 200 and not r[3]]
    latency = latency_ms([r[1] for r in ok])
    statuses: dict[str, int] = {}
    for r in results:
        key = "lost" if r[0] is None else str(r[0])
        statuses[key] = statuses.get(key, 0) + 1
    batches, rows = after[0] - before[0], after[1] - before[1]
    return {
        "url": spec.url, "spec": asdict(spec),
        "server": {"bundle": model.get("bundle"), "precision": model.get("precision"),
                   "scheduler": model.get("scheduler"), "provider": model.get("provider")},
        "sent": len(results), "ok": len(ok), "errors": len(results) - len(ok) - statuses.get("lost", 0),
        "lost": statuses.get("lost", 0), "statuses": statuses,
        "first_errors": sorted({r[3] for r in results if r[3]})[:3],
        "wall_s": round(wall, 3),
        "throughput_rps": round(len(ok) / wall, 3),
        "tokens_per_s": round(sum(r[2] for r in ok) / wall, 1),
        "latency_ms": {q: latency[q] for q in ("p50", "p90", "p99")},
        "latency_ms_max": latency["max"],
        "server_batches": int(batches), "mean_batch_rows": round(rows / batches, 2) if batches else 0.0,
    }


def run_loadtest(spec: LoadSpec, progress=None) -> dict:
    spec.check()
    return asyncio.run(_run(spec, progress))
