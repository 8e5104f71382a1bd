"""onnxformer demo: the main job on the shipped example model."""

from pathlib import Path

import click

from toolkit.apps.commands._common import friendly
from toolkit.apps.extras import require


@click.command("demo")
@click.option("--out", default="out/demo", show_default=True, type=click.Path(path_type=Path),
              help="where the demo writes its bundles")
@click.option("--held-out", default=300, show_default=True, help="held-out dates for the accuracy/parity table")
@click.option("--no-bench", is_flag=True, help="skip the speed table")
@friendly
def command(out, held_out, no_bench):
    """Export, optimize, check parity, show outputs and speed, on examples/dates."""
    require("export")
    from toolkit.apps.demo import EXAMPLE, run_demo

    if not (EXAMPLE / "config.json").exists():
        from toolkit.reference.errors import CheckpointError
        raise CheckpointError(f"the example checkpoint {EXAMPLE} is missing; train it with "
                              f"'onnxformer train --task dates --out {EXAMPLE}'")
    run_demo(out, held_out=held_out, bench=not no_bench)
