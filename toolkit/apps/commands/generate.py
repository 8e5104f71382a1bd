"""onnxformer generate: run greedy or beam search on a checkpoint (PyTorch) or a bundle (ONNX Runtime)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from runtime.errors import InputError, SourceTooLong
from runtime.request import languages, target_options
from runtime.session import PROVIDER_CHOICES
from toolkit.apps.commands._common import friendly, text_lines


def parse_ids(text: str, flag: str = "--ids", empty: bool = False) -> list[int]:
    """'5 6 7' (spaces or commas) -> [5, 6, 7]; `empty`: '' is an empty list."""
    parts = text.replace(",", " ").split()
    if not parts and not empty:
        raise InputError(f"{flag} got an empty list; pass token ids like {flag} \"5 6 7\"")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise InputError(f"{flag} {text!r} is not a list of integers; pass token ids like {flag} \"5 6 7\"") from None


def target_flags(tokenizer, inputs: int, prefix: str | None, prefix_ids: str | None, prefix_file: str | None,
                 bad_words: str | None, bad_words_ids: str | None, lead=()) -> dict:
    """The SearchOptions fields of the target-side flags (runtime.request.target_options, as the server's):
    --prefix-ids and --prefix one prefix for every input, --prefix-file one a line, one per input; `lead` the
    target language's forced ids (runtime.request.languages), before every prefix."""
    if sum(x is not None for x in (prefix, prefix_ids, prefix_file)) > 1:
        raise InputError("give one of --prefix, --prefix-ids and --prefix-file")
    if prefix_file is not None:
        prefix = text_lines(prefix_file, "--prefix-file", blank_ok=True)
        if len(prefix) != inputs:
            raise InputError(f"--prefix-file {prefix_file} has {len(prefix)} lines for {inputs} inputs; give one "
                             f"prefix a line for each input")
    ids = None if prefix_ids is None else [parse_ids(prefix_ids, "--prefix-ids", empty=True)] * inputs
    banned = None if bad_words_ids is None else [parse_ids(s, "--bad-words-ids") for s in bad_words_ids.split(";")]
    words = None if bad_words is None else bad_words.split(",")
    return target_options(tokenizer, inputs, prefix=prefix, prefix_ids=ids, bad_words=words, bad_words_ids=banned,
                          lead=lead)


def split_inputs(inputs: list, tokenizer, max_len: int, split: bool, lang: str | None = None):
    """The rows to decode and the toolkit.apps.segment Plan that joins their records back into one per input (None: no
    text to split, every input is its row). A text is cut into sentences, and a sentence over max_len tokens into
    pieces that fit, as the server's compatible APIs do; token ids stay whole."""
    if not split or tokenizer is None or not any(isinstance(x, str) for x in inputs):
        return inputs, None
    from toolkit.apps.segment import plan_texts

    for i, text in enumerate(inputs):
        if isinstance(text, str) and not text.strip():
            raise InputError(f"input {i} is empty; every input needs at least one token (a text that is not blank)")
    plan = plan_texts(inputs, tokenizer, max_len, lang)
    return plan.rows, plan


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
@click.option("--split/--no-split", default=True, show_default=True,
              help="cut each text into sentences (and an over-long sentence into pieces), decode them in one batch and "
                   "join the outputs with the text's whitespace; --no-split: one row per text, over max_len refused")
# the search options: each flag named as its runtime.search.SearchOptions field, passed on by name (**options)
@click.option("--beam", default=1, show_default=True, help="beam width (1 = greedy)")
@click.option("--num-return", default=1, show_default=True, help="hypotheses returned per input (<= beam)")
@click.option("--length-penalty", default=1.0, show_default=True, help="beam scores are log-prob / length ** this")
@click.option("--max-new-tokens", type=int, help="most tokens generated per input [default: min(64, max_len)]")
@click.option("--sample", is_flag=True, help="draw each token at random instead of taking the most likely")
@click.option("--temperature", default=1.0, show_default=True, help="with --sample: logits / this")
@click.option("--top-k", default=0, show_default=True, help="with --sample: only the k most likely tokens (0 = all)")
@click.option("--top-p", default=1.0, show_default=True, help="with --sample: the most likely tokens reaching this "
              "probability (1 = all)")
@click.option("--seed", type=int, help="with --sample: the seed (reproducible draws) [default: fresh entropy]")
@click.option("--repetition-penalty", default=1.0, show_default=True, help="> 1 makes repeated tokens less likely")
@click.option("--no-repeat-ngram-size", default=0, show_default=True, help="no n-gram of this size twice (0 = off)")
@click.option("--min-new-tokens", default=0, show_default=True, help="no end token before this many new tokens")
@click.option("--forced-eos/--no-forced-eos", default=None,
              help="end an output that reaches --max-new-tokens with the end token, as transformers' "
                   "forced_eos_token_id does [default: the model's own: on for BART, mBART, Pegasus and Marian models "
                   "whose config sets it]")
@click.option("--return-logprobs", is_flag=True, help="--json records carry each id's log-probability (logprobs)")
@click.option("--shortlist/--no-shortlist", default=True, show_default=True,
              help="bundles with a vocabulary shortlist (onnxformer shortlist): decode on it, or on the whole "
                   "vocabulary")
# the target-side flags, turned into prefix_ids and bad_words_ids by runtime.request.target_options
@click.option("--prefix", help="target text every output starts with (forced)")
@click.option("--prefix-ids", help='target ids every output starts with, e.g. "5 6"')
@click.option("--prefix-file", type=click.Path(allow_dash=True),
              help="one target prefix a line, one per input (a blank line: none)")
@click.option("--bad-words", help='comma-separated target texts never generated, e.g. "w1,w2"')
@click.option("--bad-words-ids", help='target id sequences never generated, ";" between them, e.g. "5 6;7"')
@click.option("--src-lang", help="multilingual models: the source language code, e.g. fra_Latn [default: the "
              "one it was imported with]")
@click.option("--tgt-lang", help="multilingual models: the target language code, e.g. deu_Latn (forced first, "
              "not scored; required by NLLB and mBART-50)")
@click.option("--provider", type=click.Choice(PROVIDER_CHOICES), default="auto", show_default=True)
@click.option("--threads", type=int, help="intra-op threads (default: the library's choice)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object a line for each returned hypothesis")
@click.option("--ray", "use_ray", is_flag=True, help="bundles: generate with Ray Data over a pool of actors (ray extra)")
@click.option("--replicas", default=1, show_default=True, help="with --ray: actors, each with its own engine")
@click.option("--batch-size", default=32, show_default=True, help="with --ray: inputs per batch sent to an actor")
@click.option("--address", help="with --ray: join this Ray cluster ('auto' or HOST:6379) instead of a local one")
@friendly
def command(model, texts, input_file, ids, split, provider, threads, as_json, use_ray, replicas, batch_size, address,
            prefix, prefix_ids, prefix_file, bad_words, bad_words_ids, src_lang, tgt_lang, **options):
    """Generate from MODEL (a checkpoint or a bundle) for each TEXT, --input line and --ids.

    Prints one line per input: the generated text (or ids, for models without a tokenizer); with
    --num-return N the N hypotheses are tab-separated, best first. A text longer than a sentence is split into
    sentences that decode in one batch, joined back with its whitespace (--no-split keeps it whole).
    """
    from runtime.generate import generate, records, to_outputs
    from toolkit.apps.engines import open_model

    inputs = read_inputs(texts, input_file, ids)
    targets = (prefix, prefix_ids, prefix_file, bad_words, bad_words_ids)
    langs = (src_lang, tgt_lang)
    if use_ray:
        return _generate_on_ray(model, inputs, split, options, targets, langs, provider, threads, as_json, replicas,
                                batch_size, address)
    opened = open_model(model, provider=provider, threads=threads, one_graph_at_a_time=True,   # one generate call:
                        shortlist=options["shortlist"])
    # the encoder runs once, so its session is released before the decoder's is made (peak memory on the edge)
    engine, tokenizer = opened.engine, opened.tokenizer
    request, plan = build_request(engine, tokenizer, inputs, split, options, targets, langs)
    outputs = to_outputs(generate(engine, request), engine.eos_id, tokenizer)
    if provider == "auto":                                 # say what "auto" chose (stderr: stdout stays the output)
        click.echo(f"generated with {opened.describe()}", err=True)
    print_records(joined(records(request.inputs, outputs), plan, inputs), len(inputs), as_json)


def build_request(engine, tokenizer, inputs: list, split: bool, options: dict, targets: tuple, langs: tuple):
    """The validated Request of the rows (split_inputs) with the search, target and language flags, and the rows'
    Plan."""
    from runtime.request import Request, search_options

    framed, lead = languages(tokenizer, *langs)
    rows, plan = split_inputs(inputs, framed, engine.max_len, split, langs[0])     # the source's sentence rules
    options.update(target_flags(framed, len(inputs), *targets, lead=lead))
    if plan is not None:
        plan.per_row(options, lead)
        say_cuts(plan, engine.max_len)
    try:
        return Request.build(engine, rows, framed, search_options(engine, **options)), plan
    except SourceTooLong as exc:
        if split or tokenizer is None:
            raise
        raise InputError(f"input {exc.index} has {exc.tokens} tokens, more than the model's maximum source length "
                         f"{exc.limit}; drop --no-split to translate it in sentences and pieces that fit, or "
                         f"shorten it") from None


def say_cuts(plan, max_len: int) -> None:
    """Say on stderr (stdout stays the output) which inputs held a sentence over max_len, cut into pieces."""
    for text in sorted({t for t, _, _ in plan.cut}):
        cuts = [(n, k) for t, n, k in plan.cut if t == text]
        click.echo(f"note: input {text} has {len(cuts)} sentence(s) longer than the model's maximum source length "
                   f"{max_len} ({', '.join(str(n) for n, _ in cuts)} tokens), each cut at whitespace into pieces that "
                   f"fit ({sum(k for _, k in cuts)} in all), translated one by one and joined; --no-split refuses "
                   f"such an input instead", err=True)


def joined(recs: list[dict], plan, inputs: list) -> list[dict]:
    """The rows' records as one per input and rank (as they are when nothing was split)."""
    return recs if plan is None else plan.join_records(recs, inputs)


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


def _generate_on_ray(model, inputs, split, options, targets, langs, provider, threads, as_json, replicas, batch_size,
                     address) -> None:
    from runtime.bundle import load_bundle
    from toolkit.apps.extras import require
    from toolkit.apps.engines import model_kind

    require("ray")
    if model_kind(model) != "bundle":
        raise InputError(f"--ray generates with bundles only; {model} is a checkpoint: export it first "
                         f"(onnxformer export {model} --out BUNDLE)")
    if batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {batch_size}")
    loaded = load_bundle(model, provider=provider, threads=threads)
    request, plan = build_request(loaded.engine, loaded.tokenizer, inputs, split, options, targets, langs)
    from toolkit.apps.serve.ray_data import generate_on_ray                 # validated first: fail before Ray

    click.echo(f"generating {len(inputs)} inputs with Ray Data: {replicas} actor(s), batches of {batch_size}", err=True)
    recs = generate_on_ray(model, request, actors=replicas, batch_size=batch_size, provider=provider,
                           threads=threads, address=address)
    print_records(joined(recs, plan, inputs), len(inputs), as_json)
