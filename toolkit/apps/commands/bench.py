"""onnxformer bench: side-by-side throughput, latency, memory and roofline of checkpoints and bundles."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import click

from runtime.session import PROVIDER_CHOICES
from toolkit.apps.commands._common import friendly


def parse_sizes(ctx, param, value: str) -> tuple[int, ...]:
    """'1,8' -> (1, 8); anything else is a usage error (exit 2)."""
    try:
        sizes = tuple(int(part) for part in value.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(b < 1 for b in sizes):
        raise click.BadParameter(f"{value!r} is not a comma-separated list of positive integers, e.g. 1,8")
    return sizes


@click.command("bench")
@click.argument("models", nargs=-1, required=True, type=click.Path())
@click.option("--batch-sizes", default="1,8", show_default=True, callback=parse_sizes, help="comma-separated")
@click.option("--src-len", default=32, show_default=True, type=click.IntRange(min=1), help="source tokens per input")
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="tokens generated per input (EOS suppressed, so exactly this many)")
@click.option("--provider", default="auto", show_default=True, type=click.Choice(PROVIDER_CHOICES))
@click.option("--threads", type=click.IntRange(min=1), help="torch and ORT intra-op threads [default: all CPUs]")
@click.option("--repeat", default=5, show_default=True, type=click.IntRange(min=1), help="timed rounds")
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(min=0), help="untimed rounds first")
@click.option("--seed", default=0, show_default=True, help="seed of the random source batch")
@click.option("--no-nocache", is_flag=True, help="skip PyTorch without KV cache (torch-nocache)")
@click.option("--step-profile", is_flag=True, help="also time one step at past length 8 and 256 (batch 1)")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON instead of the table")
@click.option("--save", type=click.Path(dir_okay=False), help="also write the JSON report to this file")
@click.option("--plot", type=click.Path(dir_okay=False), help="write a PNG bar chart of tokens/s")
@friendly
def command(models, batch_sizes, src_len, new_tokens, provider, threads, repeat, warmup, seed, no_nocache,
            step_profile, as_json, save, plot):
    """Benchmark MODEL... (checkpoints: PyTorch with and without KV cache; bundles: ONNX Runtime).

    Every engine generates the same tokens from the same random sources, in its own worker process,
    interleaved round by round. Prints a table (or --json) with tokens/s, latency, encoder and step
    time, peak memory, size, roofline fraction and the ratio to the first MODEL's first engine.
    """
    from runtime.errors import InputError
    from toolkit.apps.bench import BenchSettings, print_tables, run_bench

    for out in (save, plot):
        if out and not Path(out).resolve().parent.is_dir():
            raise InputError(f"cannot write {out}: its directory does not exist; create it or choose another path")
    if plot:
        from toolkit.apps.plot import require_matplotlib
        require_matplotlib()
    settings = BenchSettings(batch_sizes=batch_sizes, src_len=src_len, new_tokens=new_tokens, provider=provider,
                             threads=threads, repeat=repeat, warmup=warmup, nocache=not no_nocache,
                             step_profile=step_profile, seed=seed)
    with progress_bar() as progress:
        report = run_bench(list(models), settings, progress)
    text = json.dumps(report, indent=2)
    if save:
        Path(save).write_text(text + "\n")
    if plot:
        from toolkit.apps.plot import plot_report
        plot_report(report, plot)
    if as_json:
        click.echo(text)
    else:
        print_tables(report)
    for path in (save, plot):
        if path:
            click.echo(f"wrote {path}", err=True)


@contextlib.contextmanager
def progress_bar():
    """A progress callback drawing on stderr: a rich bar on a terminal, else one line per update (logs)."""
    def plain(done, total, label):
        click.echo(f"[{done}/{total}] {label}", err=True)

    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        yield plain
        return
    if not sys.stderr.isatty():
        yield plain
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    task = bar.add_task("starting workers", total=None)
    with bar:
        yield lambda done, total, label: bar.update(task, completed=done, total=total, description=label)
