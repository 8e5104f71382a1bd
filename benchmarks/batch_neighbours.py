"""How often a request's output depends on the other requests in its batch (the server batches requests).

For each bundle, every held-out dates input is generated alone (batch 1) and then inside batches of --batch random
neighbours, --contexts times with different neighbours; an input "depends on its neighbours" when any batched
output differs from its output alone. fp32 is the control (padding and batch shape only: expected 0). int8 uses
dynamic quantization: each MatMul's activation scale is computed over the whole batch tensor (per tensor), so a
neighbour with larger activations changes every row's rounding; `optimize --activation-scales per-row` gives each
row its own (exporters/row_activations). --same-length batches only inputs of one token length, so the batch has
no padding: fp32 and per-row int8 must then give identical scores, and any difference is the neighbours'.
--inflight decodes each context in one runtime.inflight.InflightBatch of --batch slots instead (the server's
default batching): the inputs in a random order, 1-3 joining at each step while slots are free, so a row's
neighbours change as others finish and join (needs a CPU bundle with the per-row static cache).

    python benchmarks/batch_neighbours.py out/dates-fused out/dates-int8 --threads 2 [--same-length] [--inflight] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bundle import load_bundle  # noqa: E402
from runtime.generate import generate_ids  # noqa: E402
from runtime.inflight import InflightBatch  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from toolkit.reference.tasks.dates import TARGET_LEN, held_out_examples  # noqa: E402


def batches(lengths: list[int], batch: int, rng: np.random.Generator, same_length: bool) -> list[np.ndarray]:
    """A random split of the inputs into batches of `batch` (same_length: within each token length)."""
    order = rng.permutation(len(lengths))
    groups = [order[np.array([lengths[i] for i in order]) == n] for n in sorted(set(lengths))] if same_length else [order]
    return [g[start:start + batch] for g in groups for start in range(0, len(g), batch)]


def inflight(engine, seqs: list, limit: int, slots: int, rng: np.random.Generator) -> list:
    """Every input's hypothesis from one in-flight batch: inputs in a random order, 1-3 joining per step."""
    order, got = list(rng.permutation(len(seqs))), [None] * len(seqs)
    batch = InflightBatch(engine, slots=slots)
    while order or batch.live:
        k = min(int(rng.integers(1, 4)), batch.free, len(order))
        if k:
            take, order = order[:k], order[k:]
            batch.join([seqs[i] for i in take], [limit] * k, keys=take)
        for row in batch.step():
            got[row.key] = row.hypothesis()
    return got


def measure(bundle: str, batch: int, contexts: int, threads: int | None, seed: int, same_length: bool = False,
            in_flight: bool = False) -> dict:
    loaded = load_bundle(bundle, provider="cpu", threads=threads)
    engine, tok = loaded.engine, loaded.tokenizer
    examples = held_out_examples()
    seqs = [tok.encode(src) for src, _ in examples]
    opts = SearchOptions(max_new_tokens=TARGET_LEN + 1)
    alone_hyps = [generate_ids(engine, [s], opts)[0][0] for s in seqs]
    alone = [h.tokens for h in alone_hyps]
    rng = np.random.default_rng(seed)
    differs = np.zeros(len(seqs), dtype=bool)
    changed_outputs, correct_batched, score_diff = 0, [], 0.0
    for _ in range(contexts):
        got = [None] * len(seqs)
        if in_flight:
            pairs = enumerate(inflight(engine, seqs, opts.max_new_tokens, batch, rng))
        else:
            pairs = ((i, hyps[0]) for rows in batches([len(s) for s in seqs], batch, rng, same_length)
                     for i, hyps in zip(rows, generate_ids(engine, [seqs[i] for i in rows], opts)))
        for i, hyp in pairs:
            got[i] = hyp.tokens
            if got[i] == alone[i]:                                      # same tokens: how far did the numbers move
                score_diff = max(score_diff, abs(hyp.score - alone_hyps[i].score))
        diff = np.array([g != a for g, a in zip(got, alone)])
        differs |= diff
        changed_outputs += int(diff.sum())
        correct_batched.append(np.mean([tok.decode(g) == t for g, (_, t) in zip(got, examples)]))
    correct_alone = np.mean([tok.decode(a) == t for a, (_, t) in zip(alone, examples)])
    return {"bundle": bundle, "precision": loaded.manifest["precision"], "inputs": len(seqs), "batch": batch,
            "contexts": contexts, "same_length": same_length, "inflight": in_flight,
            "inputs_depending_on_neighbours": int(differs.sum()),
            "share_depending": round(float(differs.mean()), 4),
            "outputs_changed": changed_outputs, "share_outputs_changed": round(changed_outputs / (contexts * len(seqs)), 4),
            "max_score_diff_same_tokens": float(f"{score_diff:.3g}"),
            "accuracy_alone": round(float(correct_alone), 4),
            "accuracy_batched_mean": round(float(np.mean(correct_batched)), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", type=int, default=4)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--same-length", action="store_true", help="batch only inputs of one token length (no padding)")
    parser.add_argument("--inflight", action="store_true", help="decode each context in-flight (rows join and leave)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.inflight and args.same_length:
        parser.error("--same-length is for request-level batches; in-flight rows join at different steps")
    rows = [measure(b, args.batch, args.contexts, args.threads, args.seed, args.same_length, args.inflight)
            for b in args.bundles]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'bundle':<28}{'precision':<10}{'inputs':>7}{'depend':>8}{'share':>8}{'changed':>9}{'score diff':>12}"
          f"{'acc alone':>11}{'acc batched':>13}")
    for r in rows:
        print(f"{Path(r['bundle']).name:<28}{r['precision']:<10}{r['inputs']:>7}{r['inputs_depending_on_neighbours']:>8}"
              f"{r['share_depending']:>8.2%}{r['share_outputs_changed']:>9.2%}{r['max_score_diff_same_tokens']:>12.2e}"
              f"{r['accuracy_alone']:>11.2%}"
              f"{r['accuracy_batched_mean']:>13.2%}")


if __name__ == "__main__":
    main()
