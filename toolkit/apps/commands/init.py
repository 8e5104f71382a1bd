"""onnxformer init: write a random-weight checkpoint from a preset."""

import click

from toolkit.apps.commands._common import friendly
from toolkit.apps.extras import require


@click.command("init")
@click.option("--preset", "preset_name", default="tiny", show_default=True,
              help="tiny (tests), small, or base (the paper's base model)")
@click.option("--out", required=True, type=click.Path(), help="checkpoint directory to write")
@click.option("--seed", default=0, show_default=True, help="weight initialization seed")
@click.option("--layers", type=int, help="encoder and decoder layers")
@click.option("--d-model", type=int, help="model width")
@click.option("--heads", type=int, help="attention heads (must divide d_model)")
@click.option("--ffn", type=int, help="feed-forward inner size")
@click.option("--vocab", type=int, help="vocabulary size")
@click.option("--max-len", type=int, help="longest source/target sequence")
@click.option("--norm", type=click.Choice(["pre", "post"]), help="LayerNorm placement")
@click.option("--activation", type=click.Choice(["relu", "gelu"]), help="feed-forward activation")
@click.option("--untied", is_flag=True, help="separate output projection instead of tied embeddings")
@click.option("--force", is_flag=True, help="replace an existing --out")
@friendly
def command(preset_name, out, seed, layers, d_model, heads, ffn, vocab, max_len, norm, activation, untied, force):
    """Write a random-weight checkpoint (for tests and benchmarks)."""
    require("torch")
    from toolkit.reference.checkpoint import save_checkpoint
    from toolkit.reference.config import preset
    from toolkit.reference.model import Transformer

    config = preset(preset_name, n_encoder_layers=layers, n_decoder_layers=layers, d_model=d_model, n_heads=heads,
                    d_ff=ffn, vocab_size=vocab, max_len=max_len, norm=norm, activation=activation,
                    tie_embeddings=False if untied else None)
    model = Transformer(config, seed=seed)
    save_checkpoint(out, model, force=force)
    click.echo(f"wrote {out}: preset {preset_name}, {model.num_parameters():,} parameters "
               f"({config.n_encoder_layers}+{config.n_decoder_layers} layers, d_model {config.d_model}, "
               f"{config.n_heads} heads, vocab {config.vocab_size})")
