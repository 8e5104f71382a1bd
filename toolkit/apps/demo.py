"""The main job, on the shipped example model: export, optimize, parity, sample outputs, speed.

    checkpoint --export--> fp32 bundle --optimize--> fused fp32 bundle, int8 bundle
    then: the same dates through PyTorch and every bundle, held-out accuracy and token agreement, a speed table.

Every step calls the same library functions as the command line does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dates" / "checkpoint"
SAMPLES = ("Monday, 30 November 2026", "11/30/26", "30.11.2026", "Nov 30th 2026", "2026/11/30",
           "30th of July 1969", "Fri, 13 Feb 2009", "1/2/2003", "December 31, 1999", "20000229")


def run_demo(out: Path, checkpoint: Path = EXAMPLE, held_out: int = 300, bench: bool = True,
             console: Console | None = None) -> dict:
    """Run every step into `out`; returns a summary dict (also what `--json` would print)."""
    from toolkit.reference.checkpoint import load_checkpoint
    from toolkit.reference.torch_engine import TorchEngine

    console = console or Console()
    started = time.perf_counter()
    step = _stepper(console)
    out.mkdir(parents=True, exist_ok=True)

    step(f"1. PyTorch reference: {checkpoint}")
    ckpt = load_checkpoint(checkpoint)
    c = ckpt.config
    console.print(f"   {ckpt.model.num_parameters():,} parameters, {c.n_encoder_layers}+{c.n_decoder_layers} layers, "
                  f"d_model {c.d_model}, {c.n_heads} heads, {c.norm}-norm, vocabulary {c.vocab_size} characters")
    engines = {"PyTorch": TorchEngine(ckpt.model)}
    bundles = _make_bundles(checkpoint, out, console, step)
    engines.update(_load_engines(bundles))
    _side_by_side(engines, ckpt.tokenizer, console, step)
    summary = {"engines": _held_out_table(engines, ckpt.tokenizer, held_out, console, step)}
    if bench:
        summary["bench"] = _bench(checkpoint, bundles, step)
    summary["seconds"] = time.perf_counter() - started
    console.print(f"\n[bold]done[/bold] in {summary['seconds']:.0f} s; bundles in {out}/ "
                  f"(try: onnxformer generate {bundles['ORT int8']} \"Nov 30th 2026\")", highlight=False)
    return summary


def _make_bundles(checkpoint: Path, out: Path, console: Console, step) -> dict[str, Path]:
    """Steps 2 and 3: export the checkpoint, then optimize it (fused fp32, int8); the bundles by engine name."""
    from exporters.export import export_checkpoint
    from exporters.optimize import optimize_bundle
    from runtime.manifest import read_manifest
    from toolkit.parity.graphs import record_table

    step("2. export: encoder.onnx + KV-cached decoder.onnx, kept only if graph parity holds")
    fp32 = export_checkpoint(checkpoint, out / "dates-fp32", force=True, progress=_note(console))
    record = read_manifest(fp32)["parity"]
    console.print(record_table(record), highlight=False)
    console.print(f"   {record['summary']}")

    step("3. optimize: attention + LayerNorm fusion (fp32), then int8 weights")
    fused, report = optimize_bundle(fp32, out / "dates-fused", force=True, progress=_note(console))
    console.print(f"   fused: {_rewrites(report)}")
    int8, report8 = optimize_bundle(fp32, out / "dates-int8", precision="int8", force=True, progress=_note(console))
    console.print(f"   int8:  {_rewrites(report8)}")
    return {"ORT fp32": fp32, "ORT fused": fused, "ORT int8": int8}


def _load_engines(bundles: dict[str, Path]) -> dict:
    from runtime.bundle import load_bundle

    return {name: load_bundle(path, provider="cpu").engine for name, path in bundles.items()}


def _side_by_side(engines: dict, tokenizer, console: Console, step) -> None:
    """Step 4: the sample dates through every engine, one column each."""
    from toolkit.reference.tasks.dates import normalize

    step("4. the same dates, side by side")
    table = Table("input", *engines, header_style="bold")
    outputs = {name: normalize(engine, tokenizer, SAMPLES) for name, engine in engines.items()}
    for i, text in enumerate(SAMPLES):
        table.add_row(text, *(outputs[name][i] for name in engines))
    console.print(table)


def _held_out_table(engines: dict, tokenizer, held_out: int, console: Console, step) -> dict:
    """Step 5: accuracy and agreement with PyTorch on held-out dates; the summary's "engines" entry."""
    from toolkit.parity.generation import compare_tokens
    from toolkit.reference.tasks.dates import held_out_examples, normalize

    step(f"5. parity and accuracy on {held_out} held-out dates (greedy)")
    examples = held_out_examples()[:held_out]
    texts, truth = [s for s, _ in examples], [t for _, t in examples]
    predictions = {name: normalize(engine, tokenizer, texts) for name, engine in engines.items()}
    reference = [tokenizer.encode(t) for t in predictions["PyTorch"]]
    table = Table("engine", "exact match", "inputs = PyTorch", "tokens = PyTorch", header_style="bold")
    summary = {}
    for name, predicted in predictions.items():
        accuracy = sum(p == t for p, t in zip(predicted, truth)) / len(truth)
        same_inputs, same_tokens, _ = compare_tokens(reference, [tokenizer.encode(p) for p in predicted])
        table.add_row(name, f"{accuracy:.1%}", f"{same_inputs:.1%}", f"{same_tokens:.1%}")
        summary[name] = {"accuracy": accuracy, "same_inputs": same_inputs, "same_tokens": same_tokens}
    console.print(table)
    return summary


def _bench(checkpoint: Path, bundles: dict[str, Path], step) -> list:
    """Step 6: the speed tables; their rows."""
    from toolkit.apps.bench import BenchSettings, print_tables, run_bench

    step("6. speed: PyTorch (KV cache) vs ONNX Runtime, batch 1 and 8, 16 new tokens, interleaved rounds")
    settings = BenchSettings(batch_sizes=(1, 8), src_len=24, new_tokens=16, repeat=15, warmup=2, nocache=False)
    report = run_bench([str(checkpoint), *(str(path) for path in bundles.values())], settings)
    print_tables(report)
    return report["rows"]


def _stepper(console: Console) -> Callable[[str], None]:
    return lambda title: console.rule(f"[bold]{title}", align="left")


def _note(console: Console) -> Callable[[str], None]:
    return lambda message: console.print(f"   [dim]{message}[/dim]", highlight=False)


def _rewrites(report) -> str:
    fired = ", ".join(f"{rule} x{n}" for rule, n in report.totals.items() if n) or "no rewrites"
    sizes = " + ".join(f"{g} {report.before[g]['nodes']}->{report.after[g]['nodes']} nodes" for g in report.after)
    return f"{fired}; {sizes}"
