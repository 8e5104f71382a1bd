"""int8 on CPUs whose int8 kernel saturates (x86 without VNNI): the kernel's error, and what it costs the trained
family models' int8 gate, 8-bit recipes against 7-bit ones.

    .venv/bin/python benchmarks/int8_saturation.py [--families bart,mbart,m2m100,pegasus] [--steps N] [--json OUT]

1. The kernel: one com.microsoft.DynamicQuantizeMatMul (512 x 256, random activations) against exact integer
   arithmetic on the same quantized activations, with full-range 8-bit weights and with 7-bit ones (|w| <= 64),
   and runtime.session.int8_saturates' verdict.
2. The models: each family's trained test model (toolkit.testing.tiny_families.trained_original, as
   tests/test_families_trained.py builds it, or trained for --steps) imported, exported, fused; then every int8
   recipe with 8-bit and with 7-bit weights (--weight-bits) through optimize's gate on the 64 held-out texts
   (greedy tokens equal to the fp32 bundle's; the row: 98%).
Prints one table; --json writes the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def kernel_errors() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_int8_recipes import _int8_error      # the test's own measurement

    from runtime.session import int8_saturates

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    return {"saturates": int8_saturates(),
            "error_8bit": _int8_error(rng.integers(-127, 128, (512, 256)).astype(np.int8), x),
            "error_7bit": _int8_error(rng.integers(-64, 65, (512, 256)).astype(np.int8), x)}


def family_rows(names: list[str], work: Path, steps: int) -> list[dict]:
    from exporters.export import export_checkpoint
    from exporters.int8_recipes import RECIPES
    from exporters.optimize import optimize_bundle
    from toolkit.parity import ParityError
    from toolkit.reference.importers import import_model
    from toolkit.testing.tiny_families import held_out, trained_original

    texts, rows = held_out(64), []
    for name in names:
        root = work / name
        trained_original(name, root / "hf", steps=steps)
        ckpt = import_model(root / "hf", root / "ckpt")
        fused, _ = optimize_bundle(export_checkpoint(ckpt, root / "bundle"), root / "fused")
        for bits, recipe in ((bits, recipe) for bits in (8, 7) for recipe in RECIPES):
            try:
                _, report = optimize_bundle(fused, root / f"{recipe.name}-{bits}", precision="int8",
                                            recipe=recipe.name, weight_bits=bits, texts=texts, samples=64,
                                            allow_unverified=True)
                parity = report.parity
            except ParityError as exc:
                parity = exc.report or {"verdict": "error"}
            gen = parity.get("generation") or {}
            rows.append({"family": name, "steps": steps, "recipe": recipe.name, "weight_bits": bits,
                         "tokens_equal": gen.get("tokens_equal"), "verdict": parity.get("verdict")})
            print(f"{name:<8} {recipe.name:<20} {bits} bits {gen.get('tokens_equal', float('nan')):8.2%} "
                  f"{parity.get('verdict')}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="bart,mbart,m2m100,pegasus")
    ap.add_argument("--steps", type=int, default=None, help="training steps [default: the tests' TRAINED_STEPS]")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    kernel = kernel_errors()
    print(f"int8_saturates: {kernel['saturates']}; DynamicQuantizeMatMul error / magnitude: 8-bit weights "
          f"{kernel['error_8bit']:.3g}, 7-bit weights {kernel['error_7bit']:.3g}", flush=True)
    with tempfile.TemporaryDirectory() as work:
        from toolkit.testing.tiny_families import TRAINED_STEPS

        steps = args.steps or TRAINED_STEPS
        print(f"trained models: {steps} steps", flush=True)
        rows = family_rows([n for n in args.families.split(",") if n], Path(work), steps)
    best = {}
    for r in rows:
        key = (r["family"], r["weight_bits"])
        if r["tokens_equal"] is not None and r["tokens_equal"] > best.get(key, (-1, ""))[0]:
            best[key] = (r["tokens_equal"], r["recipe"])                  # the first of equals: auto's order
    print("\n| family | best recipe, 8-bit weights | best recipe, 7-bit weights |\n|---|---|---|")
    for family in dict.fromkeys(r["family"] for r in rows):
        cells = [f"{best[(family, b)][0]:.2%} ({best[(family, b)][1]})" if (family, b) in best else "-" for b in (8, 7)]
        print(f"| {family} | {cells[0]} | {cells[1]} |")
    if args.json:
        args.json.write_text(json.dumps({"kernel": kernel, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
