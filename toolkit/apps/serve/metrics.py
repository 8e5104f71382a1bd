"""Prometheus metrics of one server (its own registry, so several Services in one process do not collide).

    onnxformer_requests_total{outcome}          answered requests: ok, client_error, overloaded, cancelled, error
    onnxformer_errors_total{kind}               refused or failed requests by kind (malformed_json, validation,
                                                too_large, queue_full, not_ready, cancelled, engine)
    onnxformer_queue_depth                      requests waiting for a batch
    onnxformer_active_rows                      decoder rows in the running batch
    onnxformer_batch_rows                       histogram: inputs decoded together in one batch (in-flight: in
                                                one decoder step, the live rows)
    onnxformer_joined_rows                      histogram: in-flight: inputs that joined the running batch at a step
    onnxformer_request_latency_seconds          histogram: arrival to answer, answered requests
    onnxformer_queue_wait_seconds               histogram: arrival to the start of its batch
    onnxformer_generated_tokens_total           tokens generated (returned hypotheses, EOS excluded)
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """The server's counters, gauges and histograms, and their Prometheus text."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("onnxformer_requests", "answered requests by outcome", ["outcome"], registry=r)
        self.errors = Counter("onnxformer_errors", "refused or failed requests by kind", ["kind"], registry=r)
        self.queue_depth = Gauge("onnxformer_queue_depth", "requests waiting for a batch", registry=r)
        self.active_rows = Gauge("onnxformer_active_rows", "decoder rows in the running batch", registry=r)
        self.batch_rows = Histogram("onnxformer_batch_rows", "inputs decoded together in one batch",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.joined_rows = Histogram("onnxformer_joined_rows", "inputs that joined the running batch at one step",
                                     buckets=BATCH_BUCKETS, registry=r)
        self.latency = Histogram("onnxformer_request_latency_seconds", "arrival to answer",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("onnxformer_queue_wait_seconds", "arrival to the start of its batch",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("onnxformer_generated_tokens", "tokens generated", registry=r)

    def refused(self, kind: str, outcome: str = "client_error") -> None:
        self.errors.labels(kind).inc()
        self.requests.labels(outcome).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
