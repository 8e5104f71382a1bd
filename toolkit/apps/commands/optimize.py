"""onnxformer optimize: bundle -> fused / converted bundle, with a report of rewrites and parity."""

import click

from toolkit.apps.commands._common import friendly, text_lines
from toolkit.apps.extras import require
from toolkit.parity.inputs import DEFAULT_SAMPLES


@click.command("optimize")
@click.argument("bundle", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="bundle directory to write")
@click.option("--target", default="cpu", show_default=True, help="cpu | cuda | wasm (onnxruntime-web, for onnxformer web): the provider the bundle is for")
@click.option("--precision", default="fp32", show_default=True,
              help="fp32 | fp16 (cuda) | int8 (cpu, dynamic quantization of MatMul weights, 8-bit embeddings) | "
                   "int4 (cpu, 4-bit weight-only MatMulNBits, 8-bit embeddings)")
@click.option("--fuse/--no-fuse", default=True, show_default=True, help="rewrite attention, LayerNorm and GELU blocks")
@click.option("--attention", default="ort", show_default=True,
              help="ort: com.microsoft.MultiHeadAttention | onnx: the standard Attention op (opset 23)")
@click.option("--kv-cache", default="auto", show_default=True,
              type=click.Choice(["auto", "static", "dynamic"]),
              help="static: a preallocated decoder cache updated in place (no per-step copy); dynamic: the exported "
                   "concat cache; auto: static for --target cpu with fused attention")
@click.option("--recipe", default="auto", show_default=True,
              help="int8 recipe: auto (try default, per-channel, per-row, per-channel-per-row, fp32-projection in "
                   "that order, cheapest first, and keep the first that passes the gate) | one of those names | "
                   "blocks (8-bit weight blocks in the decoder: batch 1 faster or slower by shape, batch 8 slower; "
                   "never tried by auto) | fp32-cross-kv (default with the encoder's cross-attention K/V projections "
                   "in float32: an encoder cost once a request, none per decode step; never tried by auto)")
@click.option("--weight-bits", type=click.Choice(["auto", "8", "7"]), default="auto", show_default=True,
              help="int8 weight bits: 7 is exact on every CPU, 8 is one bit more precise but saturates in the int8 "
                   "kernel of x86 CPUs without VNNI (AVX2 / AVX-512 only); auto: 7 on such a CPU, else 8")
@click.option("--per-channel/--per-tensor", default=None,
              help="int8 weight scales: only recipes with these [default: as the recipe says]")
@click.option("--activation-scales", default=None, type=click.Choice(["per-tensor", "per-row"]),
              help="int8 activation ranges: per-tensor (one per MatMul input, over the whole batch) | per-row (one "
                   "per token row: a row's output no longer depends on its batch neighbours); only recipes with "
                   "these [default: as the recipe says]")
@click.option("--ort-format", is_flag=True,
              help="also write ORT-format (.ort) graphs and required_operators.config (CPU minimal/mobile builds)")
@click.option("--force", is_flag=True, help="replace an existing bundle at --out")
@click.option("--allow-unverified", is_flag=True,
              help="write the bundle even when its parity gate fails or is inconclusive (outputs that do not vary, "
                   "e.g. random weights), marked unverified in its manifest [default: refuse, exit 1]")
@click.option("--input", "input_file", type=click.Path(exists=True, dir_okay=False),
              help="source texts, one a line, for the parity gate's token check (the first --samples; the "
                   "bundle's tokenizer encodes them) [default: the model's task's held-out inputs, else random ids, which "
                   "a text model such as an imported Marian never sees]")
@click.option("--gate-audio", multiple=True, type=click.Path(exists=True),
              help="speech clips (files, or a directory of them; repeatable) for an audio (Whisper) bundle's gate: "
                   "the first --samples clips' log-mel features [default: seeded random log-mel features, which a "
                   "Whisper model never hears: a trained one's greedy choices on them are near-ties int8 flips]")
@click.option("--samples", default=DEFAULT_SAMPLES, show_default=True,
              help="inputs of the parity gate's token check (the same inputs `onnxformer parity` judges)")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@friendly
def command(bundle, out, target, precision, fuse, attention, kv_cache, recipe, weight_bits, per_channel,
            activation_scales, ort_format, force, allow_unverified, input_file, gate_audio, samples, as_json):
    """Optimize a bundle for ONNX Runtime: attention/LayerNorm/GELU fusion, fp16 or int8, checked for parity."""
    require("export")
    from exporters.optimize import optimize_bundle
    from toolkit.parity import ParityError

    def progress(message: str) -> None:
        if not as_json:
            click.echo(f"  {message}")

    texts = text_lines(input_file)
    try:
        _, report = optimize_bundle(bundle, out, target=target, precision=precision, fuse=fuse, attention=attention,
                                    force=force, per_channel=per_channel, progress=progress,
                                    ort_format=ort_format, kv_cache=kv_cache, allow_unverified=allow_unverified,
                                    activation_scales=activation_scales, texts=texts, samples=samples,
                                    recipe=recipe, weight_bits=weight_bits, gate_audio=list(gate_audio) or None)
    except ParityError as exc:
        if isinstance(exc.report, dict) and not as_json:
            from toolkit.parity.graphs import record_table
            if exc.report.get("outputs"):
                click.echo(record_table(exc.report))
            if exc.report.get("generation"):
                click.echo(exc.report["generation"]["summary"])
        raise
    if as_json:
        import json

        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(report.format())
        click.echo(f"wrote {out}")
