"""onnxformer export: checkpoint -> fp32 bundle, kept only if graph parity with PyTorch holds."""

import click

from toolkit.apps.commands._common import friendly
from toolkit.apps.extras import require


@click.command("export")
@click.argument("checkpoint", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="bundle directory to write")
@click.option("--opset", default=20, show_default=True, help="ONNX opset (18..23)")
@click.option("--force", is_flag=True, help="replace an existing bundle at --out")
@friendly
def command(checkpoint, out, opset, force):
    """Export a checkpoint to an ONNX bundle (encoder.onnx + cached decoder.onnx), validated by parity."""
    require("export")
    from exporters.export import export_checkpoint
    from toolkit.parity import ParityError

    def progress(message: str) -> None:
        click.echo(f"  {message}")

    click.echo(f"exporting {checkpoint} -> {out}")
    try:
        export_checkpoint(checkpoint, out, opset=opset, force=force, progress=progress)
    except ParityError as exc:
        if exc.report is not None:
            click.echo(str(exc.report))
        raise
    from runtime.manifest import read_manifest
    from toolkit.parity.graphs import record_table

    parity = read_manifest(out)["parity"]
    click.echo(record_table(parity))
    click.echo(parity["summary"])
    click.echo(f"wrote {out}")
