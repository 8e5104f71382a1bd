"""onnxformer generate: run greedy or beam search on a checkpoint (PyTorch) or a bundle (ONNX Runtime)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from runtime.errors import InputError
from runtime.session import PROVIDER_CHOICES
from toolkit.apps.commands._common import friendly, text_lines


def parse_ids(text: str) -> list[int]:
    """'5 6 7' (spaces or commas) -> [5, 6, 7]."""
    parts = text.replace(",", " ").split()
    if not parts:
        raise InputError("--ids got an empty list; pass token ids like --ids \"5 6 7\"")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise InputError(f"--ids {text!r} is not a list of integers; pass token ids like --ids \"5 6 7\"") from None


def read_inputs(texts: tuple[str, ...], input_file: str | None, ids: tuple[str, ...]) -> list[str | list[int]]:
    """Inputs in order: TEXT arguments, then the lines of --input, then each --ids."""
    inputs = [*texts, *(text_lines(input_file) or []), *(parse_ids(s) for s in ids)]
    if not inputs:
        raise InputError("no inputs given; pass TEXT arguments, --input FILE or --ids \"5 6 7\"")
    return inputs


@click.command("generate")
@click.argument("model", type=click.Path(path_type=Path))
@click.argument("texts", nargs=-1)
@click.option("--input", "input_file", type=click.Path(allow_dash=True),
              help="file with one input a line, no blank lines ('-': stdin)")
@click.option("--ids", multiple=True, help='token ids of one input, e.g. "5 6 7" (repeatable)')
# the search options: each flag named as its runtime.search.SearchOptions field, passed on by name (**options)
@click.option("--beam", default=1, show_default=True, help="beam width (1 = greedy)")
@click.option("--num-return", default=1, show_default=True, help="hypotheses returned per input (<= beam)")
@click.option("--length-penalty", default=1.0, show_default=True, help="beam scores are log-prob / length ** this")
@click.option("--max-new-tokens", type=int, help="most tokens generated per input [default: min(64, max_len)]")
@click.option("--provider", type=click.Choice(PROVIDER_CHOICES), default="auto", show_default=True)
@click.option("--threads", type=int, help="intra-op threads (default: the library's choice)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object a line for each returned hypothesis")
@click.option("--ray", "use_ray", is_flag=True, help="bundles: generate with Ray Data over a pool of actors (ray extra)")
@click.option("--replicas", default=1, show_default=True, help="with --ray: actors, each with its own engine")
@click.option("--batch-size", default=32, show_default=True, help="with --ray: inputs per batch sent to an actor")
@click.option("--address", help="with --ray: join this Ray cluster ('auto' or HOST:6379) instead of a local one")
@friendly
def command(model, texts, input_file, ids, provider, threads, as_json, use_ray, replicas, batch_size, address,
            **options):
    """Generate from MODEL (a checkpoint or a bundle) for each TEXT, --input line and --ids.

    Prints one line per input: the generated text (or ids, for models without a tokenizer); with
    --num-return N the N hypotheses are tab-separated, best first.
    """
    from runtime.generate import generate, records, to_outputs
    from runtime.request import Request, search_options
    from toolkit.apps.engines import open_model

    inputs = read_inputs(texts, input_file, ids)
    if use_ray:
        return _generate_on_ray(model, inputs, options, provider, threads, as_json, replicas, batch_size, address)
    opened = open_model(model, provider=provider, threads=threads, one_graph_at_a_time=True)   # one generate call:
    # the encoder runs once, so its session is released before the decoder's is made (peak memory on the edge)
    engine, tokenizer = opened.engine, opened.tokenizer
    request = Request.build(engine, inputs, tokenizer, search_options(engine, **options))
    outputs = to_outputs(generate(engine, request), engine.eos_id, tokenizer)
    if provider == "auto":                                 # say what "auto" chose (stderr: stdout stays the output)
        click.echo(f"generated with {opened.describe()}", err=True)
    print_records(records(request.inputs, outputs), len(inputs), as_json)


def print_records(recs: list[dict], n_inputs: int, as_json: bool) -> None:
    """--json: one record a line; else one line per input, its hypotheses tab-separated."""
    if as_json:
        for record in recs:
            click.echo(json.dumps(record, ensure_ascii=False))
        return
    lines: list[list[str]] = [[] for _ in range(n_inputs)]
    for rec in recs:
        lines[rec["index"]].append(rec["text"] if rec["text"] is not None else " ".join(map(str, rec["ids"])))
    for hyps in lines:
        click.echo("\t".join(hyps))


def _generate_on_ray(model, inputs, options, provider, threads, as_json, replicas, batch_size, address) -> None:
    from runtime.bundle import load_bundle
    from runtime.request import Request, search_options
    from toolkit.apps.extras import require
    from toolkit.apps.engines import model_kind

    require("ray")
    if model_kind(model) != "bundle":
        raise InputError(f"--ray generates with bundles only; {model} is a checkpoint: export it first "
                         f"(onnxformer export {model} --out BUNDLE)")
    if batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {batch_size}")
    loaded = load_bundle(model, provider=provider, threads=threads)
    request = Request.build(loaded.engine, inputs, loaded.tokenizer, search_options(loaded.engine, **options))
    from toolkit.apps.serve.ray_data import generate_on_ray                 # validated first: fail before Ray

    click.echo(f"generating {len(inputs)} inputs with Ray Data: {replicas} actor(s), batches of {batch_size}", err=True)
    recs = generate_on_ray(model, request, actors=replicas, batch_size=batch_size, provider=provider,
                           threads=threads, address=address)
    print_records(recs, len(inputs), as_json)
