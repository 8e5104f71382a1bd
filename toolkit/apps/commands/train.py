"""onnxformer train: train an example model on generated data and write it as a checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from toolkit.apps.commands._common import friendly
from toolkit.apps.extras import require

TASKS = ("dates",)


@click.command("train")
@click.option("--task", type=click.Choice(TASKS), default="dates", show_default=True, help="example task")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="checkpoint directory to write")
@click.option("--steps", type=click.IntRange(min=1), help="training steps [default: the task's recipe]")
@click.option("--seed", default=0, show_default=True, help="seed for weights, data order and dropout")
@click.option("--eval-every", type=click.IntRange(min=0), help="held-out evaluation interval in steps (0: only at the end)")
@click.option("--threads", type=click.IntRange(min=1), help="PyTorch intra-op threads")
@click.option("--force", is_flag=True, help="replace an existing --out")
@friendly
def command(task, out, steps, seed, eval_every, threads, force):
    """Train the example model of TASK on generated data (fixed seed) and write a checkpoint to --out.

    Shows step, loss and held-out exact-match accuracy as it goes; training.json in the checkpoint
    records the recipe, the timing and the final held-out accuracy.
    """
    require("torch")
    from toolkit.reference.checkpoint import check_checkpoint_output

    check_checkpoint_output(out, force)              # refuse before spending minutes on training
    import torch

    from toolkit.reference.checkpoint import save_checkpoint
    from toolkit.reference.tasks import dates

    if threads is not None:
        torch.set_num_threads(threads)
    steps = steps or dates.RECIPE["steps"]
    eval_every = dates.RECIPE["eval_every"] if eval_every is None else eval_every
    report_every = max(1, min(50, steps // 20))
    click.echo(f"training {task}: {steps} steps, seed {seed}, {torch.get_num_threads()} thread(s)")

    def progress(info: dict) -> None:
        if "accuracy" in info or info["step"] % report_every == 0:
            acc = f"  held-out {info['accuracy']:7.2%}" if "accuracy" in info else ""
            click.echo(f"step {info['step']:>6}/{steps}  loss {info['loss']:.4f}{acc}  {info['elapsed_s']:6.1f}s")

    model, tokenizer, record = dates.train_dates(steps=steps, seed=seed, eval_every=eval_every, on_progress=progress)
    record["threads"] = torch.get_num_threads()
    save_checkpoint(out, model, tokenizer, training=record, force=force)
    size = sum(f.stat().st_size for f in out.iterdir())
    click.echo(f"wrote {out}: {record['parameters']:,} parameters, {size / 1e6:.1f} MB, "
               f"held-out exact match {record['held_out']['exact_match']:.2%} "
               f"({record['held_out']['size']} dates), trained in {record['train_seconds']:.0f}s")
