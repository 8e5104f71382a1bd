"""onnxformer import: a checkpoint of a registered model family (toolkit/reference/importers) -> checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import click

from toolkit.apps.commands._common import friendly
from toolkit.apps.extras import require
from toolkit.reference.importers.registry import families

FAMILIES = families()


@click.command("import", help="Import SOURCE into an onnxformer checkpoint. SOURCE is one of: " +
               "; ".join(f"{f.name}: {f.source}" for f in FAMILIES.values()) + ".")
@click.argument("source")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="checkpoint directory to write")
@click.option("--format", "fmt", type=click.Choice(list(FAMILIES)),
              help="source family [default: detected: a directory by its config.json's model_type, a file as a "
                   "state dict]")
@click.option("--config", "config_file", type=click.Path(path_type=Path),
              help="nn-transformer: JSON with nhead and the special ids (see examples/marian/README.md)")
@click.option("--force", is_flag=True, help="replace an existing checkpoint at --out")
@friendly
def command(source, out, fmt, config_file, force):
    require("torch")
    from toolkit.reference.checkpoint import load_checkpoint
    from toolkit.reference.importers import import_model

    start = time.perf_counter()
    path = import_model(source, out, fmt, force, config_file, progress=lambda m: click.echo(m, err=True))
    ckpt = load_checkpoint(path)
    c = ckpt.config
    tok = type(ckpt.tokenizer).__name__ if ckpt.tokenizer is not None else "none"
    click.echo(f"imported {source} -> {path} in {time.perf_counter() - start:.1f} s: {ckpt.model.num_parameters():,} "
               f"parameters, {c.n_encoder_layers}+{c.n_decoder_layers} layers, d_model {c.d_model}, {c.n_heads} heads, "
               f"FFN {c.d_ff} ({c.activation}), vocab {c.source_vocab_size}"
               f"{'' if c.share_embeddings else '/' + str(c.vocab_size)}, tokenizer {tok}")
