"""onnxformer inspect: what a bundle holds (reads manifest.json only; needs no torch and no onnx)."""

import json

import click

from toolkit.apps.commands._common import friendly


@click.command("inspect")
@click.argument("bundle", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@friendly
def command(bundle, as_json):
    """Show a bundle's graphs, inputs/outputs, op counts, sizes, precision, fusions and parity record."""
    from runtime.manifest import format_inspect, inspect_report

    report = inspect_report(bundle)
    click.echo(json.dumps(report, indent=2) if as_json else format_inspect(report))
