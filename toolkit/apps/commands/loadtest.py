"""onnxformer loadtest: a bounded load test of a running `onnxformer serve` (loopback only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from toolkit.apps.commands._common import friendly
from toolkit.apps.extras import require


@click.command("loadtest")
@click.argument("url")
@click.option("--requests", "n_requests", default=256, show_default=True, help="requests sent in all")
@click.option("--concurrency", default=32, show_default=True, help="clients, each with one request in flight")
@click.option("--duration", default=600.0, show_default=True, help="stop sending after this many seconds")
@click.option("--min-new-tokens", default=8, show_default=True, help="each request's max_new_tokens is drawn from")
@click.option("--max-new-tokens", default=128, show_default=True, help="[min, max] (EOS suppressed; capped at max_len)")
@click.option("--min-src", default=8, show_default=True, help="source tokens per request, drawn from [min, max]")
@click.option("--max-src", default=32, show_default=True)
@click.option("--beam", default=1, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--timeout", default=300.0, show_default=True, help="seconds before one request counts as lost")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option("--save", type=click.Path(dir_okay=False, path_type=Path), help="also write the JSON report here")
@friendly
def command(url, n_requests, concurrency, duration, min_new_tokens, max_new_tokens, min_src, max_src, beam, seed,
            timeout, as_json, save):
    """Load-test the server at URL (127.0.0.1 / localhost / ::1 only) with a fixed number of requests.

    Exit code 0 when every request got a correct answer, 1 when any failed or was lost.
    """
    require("serve")
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from toolkit.apps.serve.loadtest import LoadSpec, run_loadtest

    spec = LoadSpec(url, n_requests, concurrency, duration, min_new_tokens, max_new_tokens, min_src, max_src, beam,
                    seed, timeout)
    err = Console(stderr=True)
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task(f"{n_requests} requests, {concurrency} clients", total=n_requests)
        result = run_loadtest(spec, progress=lambda done, total: bar.update(task, completed=done))
    if save:
        save.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        table = Table(title=f"loadtest {url} ({result['server']['scheduler']['kind']} batching, "
                            f"max batch {result['server']['scheduler']['max_batch']})")
        for col in ("sent", "ok", "errors", "lost", "wall s", "req/s", "tokens/s", "p50 ms", "p90 ms", "p99 ms",
                    "mean batch"):
            table.add_column(col, justify="right")
        lat = result["latency_ms"]
        table.add_row(*map(str, (result["sent"], result["ok"], result["errors"], result["lost"], result["wall_s"],
                                 result["throughput_rps"], result["tokens_per_s"], lat["p50"], lat["p90"], lat["p99"],
                                 result["mean_batch_rows"])))
        Console(width=None if sys.stdout.isatty() else 150).print(table)
        if result["first_errors"]:
            err.print(f"first errors: {result['first_errors']}")
    if result["errors"] or result["lost"] or result["sent"] < n_requests:
        raise SystemExit(1)
