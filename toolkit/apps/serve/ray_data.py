"""Offline generation with Ray Data: `onnxformer generate BUNDLE --input FILE --ray [--replicas N]`.

    records = generate_on_ray("out/bundle", request, actors=2)      # a runtime.request.Request, built on the driver

The request's inputs become a dataset; `map_batches` sends batches of them to a pool of `BatchGenerator` actors,
each with its own engine and the request's SearchOptions (the object itself, as built), and the records come back
in input order: the records of `onnxformer generate --json`.
Needs only the runtime and ray (no web stack); ray_serve.py shares `init_ray`.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from runtime.errors import OnnxformerError


class RayError(OnnxformerError):
    """Ray could not start or join a cluster as asked."""


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Join the cluster at `address`, or start a local instance bound to 127.0.0.1 (no dashboard, no usage stats)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")        # never phone home
    import ray

    if ray.is_initialized():
        return
    try:
        if address:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                     _node_ip_address="127.0.0.1")
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        raise RayError(f"cannot start or join {where} ({str(exc).splitlines()[0][:200]}); check the address "
                       f"(e.g. --address auto on a node of the cluster, or HOST:6379)") from None


class BatchGenerator:
    """A Ray Data actor: one engine; turns a batch of inputs into their generate --json records."""

    def __init__(self, bundle: str, provider: str, threads: int | None, opts):
        from runtime.bundle import load_bundle

        self.bundle = load_bundle(bundle, provider=provider, threads=threads)
        self.opts = opts                                                # the driver's request's SearchOptions

    def __call__(self, batch: dict) -> dict:
        from runtime.generate import generate, records, to_outputs
        from runtime.processors import seed_index
        from runtime.request import Request

        inputs = [json.loads(x) for x in batch["input"]]
        sources = [json.loads(x) for x in batch["ids"]]                # encoded on the driver (its src_lang framing)
        engine, tokenizer = self.bundle.engine, self.bundle.tokenizer
        opts, positions = self.opts, [int(i) for i in batch["index"]]  # per-input options: this batch's part
        if opts.prefix_ids:
            opts = replace(opts, prefix_ids=tuple(opts.prefix_ids[i] for i in positions))
        if opts.sample:                                                 # each input draws as in the whole request
            opts = replace(opts, seed_index=tuple(seed_index(opts, i) for i in positions))
        request = Request.build(engine, sources, None, opts)            # this actor's part of the request
        outputs = to_outputs(generate(engine, request), engine.eos_id, tokenizer)
        recs = records(inputs, outputs)
        for rec in recs:
            rec["index"] = int(batch["index"][rec["index"]])            # position in the whole input, not the batch
        per_input: list[list[dict]] = [[] for _ in inputs]
        for rec, out in zip(recs, outputs):
            per_input[out.index].append(rec)
        return {"index": batch["index"], "records": [json.dumps(per, ensure_ascii=False) for per in per_input]}


def generate_on_ray(bundle: str | Path, request, actors: int = 1, batch_size: int = 32,
                    provider: str = "auto", threads: int | None = None, address: str | None = None) -> list[dict]:
    """The generate --json records of every input of `request` (validated on the driver, against the bundle: inside
    the actors a bad one would be a Ray error), in input order, computed by `actors` Ray Data actors."""
    if actors < 1:
        raise RayError(f"--replicas must be at least 1, got {actors}")
    init_ray(address, None if address else max(actors * int(threads or 1), os.cpu_count() or 1))
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    items = [{"index": i, "input": json.dumps(x), "ids": json.dumps(ids)}
             for i, (x, ids) in enumerate(zip(request.inputs, request.sequences))]
    ds = ray.data.from_items(items).map_batches(
        BatchGenerator, batch_size=batch_size, concurrency=actors, num_cpus=float(threads or 1),
        fn_constructor_kwargs={"bundle": str(Path(bundle).resolve()), "provider": provider, "threads": threads,
                               "opts": request.opts})
    rows = sorted(ds.take_all(), key=lambda r: r["index"])             # preserve_order keeps it; sorting proves it
    return [rec for row in rows for rec in json.loads(row["records"])]
