"""Token agreement and task accuracy of quantized dates bundles against the fp32 bundle, on the 1,000 held-out dates.

    python benchmarks/quantized_quality.py out/edge/dates-fp32 out/edge/dates-int8 out/edge/dates-int4 [--json]

Greedy decoding of every held-out date with each bundle (runtime engine, CPU); per bundle: exact-match accuracy
against the task's targets, and greedy tokens equal to the first (reference) bundle's, position by position. This is
what the int8 and int4 rows of toolkit/parity/tolerances.py are judged by on the example task.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from runtime.bundle import load_bundle
from tables import print_rows
from runtime.generate import generate_ids
from runtime.search import SearchOptions
from toolkit.reference.tasks.dates import held_out_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", type=Path, nargs="+", help="reference bundle first (fp32), then the others")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    pairs = held_out_examples()
    rows, reference = [], None
    for path in args.bundles:
        bundle = load_bundle(path, provider="cpu")
        seqs = [bundle.tokenizer.encode(src) for src, _ in pairs]
        hyps = generate_ids(bundle.engine, seqs, SearchOptions(max_new_tokens=min(32, bundle.engine.max_len)))
        ids = [h[0].tokens for h in hyps]
        texts = [bundle.tokenizer.decode(t) for t in ids]
        accuracy = sum(t == tgt for t, (_, tgt) in zip(texts, pairs)) / len(pairs)
        reference = reference or ids
        total = sum(max(len(a), len(b)) for a, b in zip(reference, ids))
        equal = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(reference, ids)) / total
        size = sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".onnx", ".data"))
        rows.append({"bundle": str(path), "precision": bundle.manifest["precision"], "accuracy": accuracy,
                     "tokens_equal_to_reference": equal, "sequences_equal": sum(a == b for a, b in zip(reference, ids)) / len(ids),
                     "distinct_outputs": len({tuple(i) for i in ids}), "onnx_bytes": size})
    for r in rows:
        r["onnx_mb"] = r["onnx_bytes"] / 1e6
    print_rows(rows, [("bundle", "bundle", "<40"), ("precision", "precision", "<9"), ("accuracy", "accuracy", ">9.2%"),
                      ("tokens = ref", "tokens_equal_to_reference", ">13.2%"), ("seqs = ref", "sequences_equal", ">11.2%"),
                      ("MB (.onnx+.data)", "onnx_mb", ">17.3f")], args.json)

if __name__ == "__main__":
    main()
