"""onnxformer shortlist: a vocabulary shortlist from the model's own translations of a corpus, gated, in a bundle."""

import click

from toolkit.apps.commands._common import friendly, text_lines
from toolkit.apps.extras import require
from toolkit.parity.inputs import DEFAULT_SAMPLES


def _sizes(ctx, param, value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of positive counts, e.g. 20,50,100")
    return sizes


@click.command("shortlist")
@click.argument("bundle", type=click.Path())
@click.option("--corpus", "corpus_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="source texts the model translates to build the map, one a line (token ids such as \"5 6 7\" "
                   "for a bundle without tokenizer)")
@click.option("--out", required=True, type=click.Path(), help="bundle directory to write (a copy with the shortlist)")
@click.option("--size", "sizes", default="20,50,100", show_default=True, callback=_sizes,
              help="candidate target tokens a source token, comma-separated: the gate tries them from the smallest "
                   "and keeps the first that passes")
@click.option("--always", default=200, show_default=True,
              help="the most frequent target tokens every request may produce (besides the specials)")
@click.option("--input", "input_file", type=click.Path(exists=True, dir_okay=False),
              help="held-out source texts for the gate, one a line (as optimize takes them) [default: the model's "
                   "task's held-out inputs, else random ids]")
@click.option("--samples", default=DEFAULT_SAMPLES, show_default=True, help="inputs of the gate's token check")
@click.option("--max-new-tokens", type=int, help="most tokens a translation [default: min(64, max_len)]")
@click.option("--src-lang", help="multilingual models: the corpus's language code, e.g. eng_Latn [default: the "
                                 "one the model was imported with]")
@click.option("--tgt-lang", "tgt_langs", default="",
              help="multilingual models: the target language codes, comma-separated, e.g. deu_Latn,fra_Latn: one map "
                   "per language, each gated on its own; a request uses its target language's map")
@click.option("--allow-unverified", is_flag=True,
              help="write the bundle even when no size passes the gate, marked unverified [default: refuse, exit 1]")
@click.option("--force", is_flag=True, help="replace an existing bundle at --out")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@friendly
def command(bundle, corpus_file, out, sizes, always, input_file, samples, max_new_tokens, src_lang, tgt_langs,
            allow_unverified, force, as_json):
    """Build a vocabulary shortlist for BUNDLE: each source token's likely target tokens, so that decoding computes
    the output projection for a request's candidates only. Kept when its greedy tokens agree with the full
    vocabulary's on >= 99.5% of held-out tokens."""
    require("export")
    from exporters.shortlist import shortlist_bundle
    from runtime.manifest import read_manifest
    from toolkit.apps.commands.generate import parse_ids

    lines = text_lines(corpus_file, "--corpus")
    tokenizer = read_manifest(bundle).get("tokenizer")
    corpus = lines if tokenizer else [parse_ids(line, "--corpus") for line in lines]

    def progress(message: str) -> None:
        if not as_json:
            click.echo(f"  {message}")

    _, report = shortlist_bundle(bundle, corpus, out, sizes, always, text_lines(input_file), samples, max_new_tokens,
                                 allow_unverified, force, progress, src_lang,
                                 [c.strip() for c in tgt_langs.split(",") if c.strip()])
    if as_json:
        import json

        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(report.format())
        click.echo(f"wrote {out}")
