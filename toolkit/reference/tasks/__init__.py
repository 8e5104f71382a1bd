"""Example tasks: data generators with a fixed seed, used to train small real models.

A task module may also supply parity inputs for the models trained on it: `owns(tokenizer)` says whether a
tokenizer is the task's, `parity_inputs(tokenizer, max_len, samples)` gives held-out sources as token ids, and
`accuracy(engine, tokenizer, samples)` its metric on held-out examples (the int8 gate's accuracy row).
"""

from __future__ import annotations

import importlib

TASKS = ("dates",)                  # task modules that supply parity inputs


def task_parity_inputs(tokenizer, max_len: int, samples: int) -> tuple[list[list[int]], str] | None:
    """(held-out inputs, their description) from the task that owns this tokenizer, or None (no task does)."""
    if tokenizer is None:
        return None
    for name in TASKS:
        task = importlib.import_module(f"toolkit.reference.tasks.{name}")
        if task.owns(tokenizer):
            seqs = task.parity_inputs(tokenizer, max_len, samples)
            if seqs:
                return seqs, f"{len(seqs)} {name} held-out examples"
    return None


def task_accuracy(tokenizer, engines, samples: int) -> tuple[tuple[float, ...], str] | None:
    """((metric of each engine), what was measured) from the task that owns this tokenizer, or None (no task
    owns it, or it has no metric). engines: Engines, or zero-argument callables that make them (each made in its
    turn and dropped after its score: optimize's gate)."""
    if tokenizer is None:
        return None
    for name in TASKS:
        task = importlib.import_module(f"toolkit.reference.tasks.{name}")
        if task.owns(tokenizer) and hasattr(task, "accuracy"):
            scores = tuple(task.accuracy(engine if hasattr(engine, "start") else engine(), tokenizer, samples)
                           for engine in engines)
            return scores, f"{name} held-out exact match ({min(samples, task.HELD_OUT_SIZE)} examples)"
    return None
