"""int8 numerics study: which weight scales and reduce_range to ship, measured against the fused fp32 bundle.

    python benchmarks/studies/int8_numerics.py [--dates examples/dates/checkpoint] [--base] [--work out/int8-study]

For each model (the trained dates example; with --base, the paper's base shape with random weights, vocab 8000)
it exports, fuses (fp32), then quantizes the same fused graphs several ways and runs optimize's gate on each
(toolkit.parity.gate against the fused fp32 bundle, on this CPU):
  per-tensor      one scale per weight matrix, packed Q/K/V and cross K/V included (what optimize shipped)
  packed-channel  one scale per output channel for packed weights, per tensor for the rest (the new default)
  per-channel     one scale per output channel everywhere
each with reduce_range off (8-bit weights) and on (7-bit: no int16 saturation in AVX2 kernels without VNNI).
Reports: logits max abs error (graph parity, teacher-forced along the fp32 bundle's greedy tokens), the
teacher-forced argmax agreement, greedy tokens equal over 64 inputs, and the dates held-out exact match.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = {"per-tensor": dict(per_channel=False, packed=False), "packed-channel": dict(per_channel=False, packed=True),
            "per-channel": dict(per_channel=True, packed=True)}


def variant_pass(per_channel: bool, packed: bool, reduce_range: bool):
    import exporters.precision as P
    from exporters.passes import ConvertPass

    return ConvertPass("quantize_int8", lambda model: P.to_int8(model, per_channel, reduce_range, packed))


def study(name: str, fused: Path, work: Path, samples: int) -> list[dict]:
    import exporters.int8_recipes as R
    import exporters.optimize as O

    rows, real = [], R.precision_pass
    for variant, opts in VARIANTS.items():
        for rr in (False, True):
            R.precision_pass = lambda precision, per_channel=True, activation_scales="per-tensor", keep_float=(), \
                o=opts, r=rr: variant_pass(o["per_channel"], o["packed"], r)
            try:
                out, report = O.optimize_bundle(fused, work / f"{name}-{variant}{'-rr' if rr else ''}", precision="int8",
                                                recipe="per-channel" if opts["per_channel"] else "default",
                                                samples=samples, force=True, allow_unverified=True)
            finally:
                R.precision_pass = real
            p = report.parity
            gen, acc = p["generation"], p.get("accuracy") or {}
            rows.append({"model": name, "scales": variant, "reduce_range": rr, "logits_max_abs": p["max_abs"],
                         "teacher_forced_argmax": p.get("teacher_forced_tokens_equal"),
                         "greedy_tokens_equal": gen["tokens_equal"], "distinct_outputs": gen["distinct_outputs"],
                         "accuracy": acc.get("candidate"), "accuracy_fp32": acc.get("source"),
                         "verdict": p["verdict"], "bundle": str(out)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def evaluate(fused: Path, variant: Path, samples: int, threads: int = 1) -> dict:
    """Teacher-forced logits of a variant against the fused fp32 bundle along the fp32 greedy tokens, on the
    task's held-out inputs (else random ids): worst and mean-per-position max abs error, argmax agreement; and
    greedy tokens equal. Uses only the runtime and toolkit.parity (runs under qemu for another CPU model)."""
    from runtime.bundle import load_bundle
    from runtime.generate import generate_ids
    from runtime.search import SearchOptions
    from toolkit.reference.config import ModelConfig
    from toolkit.parity.generation import compare_tokens, parity_inputs, teacher_forced
    from toolkit.parity.tolerances import tolerance

    ref, got = load_bundle(fused, "cpu", threads=threads), load_bundle(variant, "cpu", threads=threads)
    seqs, source = parity_inputs(ModelConfig.from_dict(ref.manifest["model"]), ref.tokenizer, samples)
    opts = SearchOptions(max_new_tokens=min(32, ref.engine.max_len))
    want = [h[0].tokens for h in generate_ids(ref.engine, seqs, opts)]
    have = [h[0].tokens for h in generate_ids(got.engine, seqs, opts)]
    tf = teacher_forced(ref.engine, got.engine, seqs, want, tolerance("fp32", "cpu"))
    return {"variant": variant.name, "inputs": source, "positions": tf["positions"], "logits_max_abs": tf["max_abs"],
            "logits_mean_max_abs": tf["mean_max_abs"], "argmax_equal": tf["argmax_equal"],
            "greedy_tokens_equal": compare_tokens(want, have)[1], "distinct_outputs": len({tuple(t) for t in want})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dates", default=str(ROOT / "examples" / "dates" / "checkpoint"), help="'' to skip it")
    ap.add_argument("--base", action="store_true")
    ap.add_argument("--work", default=str(ROOT / "out" / "int8-study"))
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--evaluate", nargs="+", metavar="BUNDLE", help="only evaluate: FUSED then variant bundles")
    args = ap.parse_args()
    if args.evaluate:
        fused, *variants = map(Path, args.evaluate)
        print(f"{'variant':<28} {'positions':>9} {'logits max':>10} {'mean max':>9} {'argmax eq':>9} {'greedy eq':>9}")
        for v in variants:
            r = evaluate(fused, v, args.samples)
            print(f"{r['variant']:<28} {r['positions']:>9} {r['logits_max_abs']:>10.3g} {r['logits_mean_max_abs']:>9.3g} "
                  f"{r['argmax_equal']:>9.2%} {r['greedy_tokens_equal']:>9.2%}   ({r['inputs']}, "
                  f"{r['distinct_outputs']} distinct)", flush=True)
        return 0
    from exporters.export import export_checkpoint
    from exporters.optimize import optimize_bundle

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    models = {"dates": Path(args.dates)} if args.dates else {}
    if args.base:
        base = work / "base-checkpoint"
        if not base.exists():
            subprocess.run([sys.executable, "-m", "toolkit.apps.cli", "init", "--preset", "base", "--vocab", "8000",
                            "--out", str(base)], check=True)
        models["base"] = base
    rows = []
    for name, ckpt in models.items():
        fp32 = work / f"{name}-fp32"
        if not (fp32 / "manifest.json").exists():
            export_checkpoint(ckpt, fp32, force=fp32.exists())
        fused = work / f"{name}-fused"
        if not (fused / "manifest.json").exists():
            optimize_bundle(fp32, fused, force=fused.exists())
        rows += study(name, fused, work, args.samples)
    print(f"\n{'model':<6} {'scales':<15} {'rr':<3} {'logits max abs':>14} {'tf argmax':>9} {'greedy tokens':>13} "
          f"{'distinct':>8} {'accuracy':>9}  verdict")
    for r in rows:
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.2%}"
        print(f"{r['model']:<6} {r['scales']:<15} {'on' if r['reduce_range'] else 'off':<3} {r['logits_max_abs']:>14.3g} "
              f"{r['teacher_forced_argmax']:>9.2%} {r['greedy_tokens_equal']:>13.2%} {r['distinct_outputs']:>8} "
              f"{acc:>9}  {r['verdict']}")
    (work / "int8_numerics.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
