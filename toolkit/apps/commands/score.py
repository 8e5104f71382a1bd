"""onnxformer score: the log-probability a model (checkpoint or bundle) gives each target text of its source."""

from __future__ import annotations

import json
from pathlib import Path

import click

from runtime.errors import InputError
from runtime.session import PROVIDER_CHOICES
from toolkit.apps.commands._common import friendly, text_lines


@click.command("score")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--source", "source_file", required=True, type=click.Path(allow_dash=True),
              help="file with one source text a line")
@click.option("--target", "target_file", required=True, type=click.Path(allow_dash=True),
              help="file with one target text a line, line n the target of source line n")
@click.option("--src-lang", help="multilingual models: the sources' language code, e.g. fra_Latn")
@click.option("--tgt-lang", help="multilingual models: the targets' language code, e.g. deu_Latn (fed first, not "
              "scored)")
@click.option("--provider", type=click.Choice(PROVIDER_CHOICES), default="auto", show_default=True)
@click.option("--threads", type=int, help="intra-op threads (default: the library's choice)")
@click.option("--json", "as_json", is_flag=True,
              help="one JSON object a line: index, source, target, ids, token_logprobs, score")
@friendly
def command(model, source_file, target_file, src_lang, tgt_lang, provider, threads, as_json):
    """Score each --target line given its --source line with MODEL (a checkpoint or a bundle), teacher-forced.

    Prints one score a line: log p(target | source), the sum of the target tokens' log-probabilities, the end
    token included (targets are encoded on the target side, without it; it is appended).
    """
    from runtime.score import score_texts
    from toolkit.apps.engines import open_model

    sources = text_lines(source_file, "--source")
    targets = text_lines(target_file, "--target", blank_ok=True)
    if len(sources) != len(targets):
        raise InputError(f"--source has {len(sources)} lines and --target {len(targets)}; give one target line "
                         f"per source line")
    opened = open_model(model, provider=provider, threads=threads)
    for record in score_texts(opened.engine, opened.tokenizer, sources, targets, src_lang, tgt_lang):
        click.echo(json.dumps(record, ensure_ascii=False) if as_json else f"{record['score']:.6f}")
