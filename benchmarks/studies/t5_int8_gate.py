"""The int8 gate on the trained tiny T5 variants: arbitrary held-out texts against texts whose greedy steps all have
a clear best token (toolkit/parity/confident.py), per int8 recipe.

    .venv/bin/python benchmarks/studies/t5_int8_gate.py --variants t5,v1.1,mt5,byt5 --steps 600 --pool 1024 \
        --recipes default,per-row --out out/t5-int8-gate

Prints one row per variant, input set and recipe: the gate's greedy tokens equal to the fp32 bundle's, its
verdict, the distinct outputs, the smallest top-2 margin of the set, and the int8 graphs' largest logit error on
the gate's graph check.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from toolkit.apps.cli import main  # noqa: E402
from toolkit.parity.confident import greedy_margins  # noqa: E402
from toolkit.testing.tiny_families import held_out  # noqa: E402
from toolkit.testing.tiny_t5 import trained_t5  # noqa: E402


def cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    if result.exit_code not in (0, 1):
        raise SystemExit(f"onnxformer {' '.join(args[:1])} failed: {result.output[-800:]}")
    return result.output


def variant_rows(name: str, steps: int, pool_size: int, recipes: list[str], out: Path) -> list[dict]:
    root = out / f"{name}-{steps}"
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    model, tok = trained_t5(name, root / name, steps=steps)
    print(f"{name}: trained {steps} steps in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    pool = held_out(pool_size)
    margins = greedy_margins(model, tok, pool, 32)
    best = sorted(sorted(range(pool_size), key=lambda i: -margins[i])[:64])
    sets = {"first 64": list(range(64)), "64 most confident": best}
    cli("import", str(root / name), "--out", str(root / "ckpt"))
    cli("export", str(root / "ckpt"), "--out", str(root / "bundle"))
    rows = []
    for label, chosen in sets.items():
        texts = root / f"{label.replace(' ', '-')}.txt"
        texts.write_text("\n".join(pool[i] for i in chosen) + "\n")
        for recipe in recipes:
            target = root / f"int8-{recipe}-{texts.stem}"
            cli("optimize", str(root / "bundle"), "--out", str(target), "--precision", "int8", "--recipe", recipe,
                "--input", str(texts), "--samples", "64", "--allow-unverified")
            parity = json.loads((target / "manifest.json").read_text())["parity"]
            gen = parity["generation"]
            rows.append({"variant": name, "steps": steps, "inputs": label, "recipe": recipe,
                         "tokens_equal": gen["tokens_equal"], "verdict": gen["verdict"],
                         "distinct": gen["distinct_outputs"], "min_margin": min(margins[i] for i in chosen),
                         "graph_max_abs": parity.get("max_abs")})
            print(f"  {label:18} {recipe:12} {gen['tokens_equal']:.2%} {gen['verdict']}", file=sys.stderr)
    return rows


def main_() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="t5,v1.1,mt5,byt5")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--pool", type=int, default=1024, help="held-out texts the confident 64 are chosen from")
    ap.add_argument("--recipes", default="default,per-row")
    ap.add_argument("--out", type=Path, default=Path("out/t5-int8-gate"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [r for v in args.variants.split(",")
            for r in variant_rows(v, args.steps, args.pool, args.recipes.split(","), args.out)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| variant | steps | inputs | recipe | greedy tokens equal | verdict | distinct | smallest margin | graph max abs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['steps']} | {r['inputs']} | {r['recipe']} | {r['tokens_equal']:.2%} | "
              f"{r['verdict']} | {r['distinct']} | {r['min_margin']:.3f} | {r['graph_max_abs']:.3f} |")


if __name__ == "__main__":
    main_()
