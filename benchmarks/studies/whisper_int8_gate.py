"""Why the int8 gate misses on the speech-trained tiny Whisper: int8 against fp32 on held-out speech clips and on
the gate's random log-mel features, for the whole int8 bundle and for each part quantized alone.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/studies/whisper_int8_gate.py --fused out/wint8/fused \
        --int8 out/wint8/int8 --work out/wint8/study [--groups]

--fused: the fp32 fused bundle (the reference, as optimize's gate runs it); --int8: an int8 bundle of the same
source (`optimize --precision int8 --recipe default --allow-unverified`). Candidates: the int8 bundle, its encoder
with the fp32 decoder, the fp32 encoder with its decoder; --groups adds fp32 decoders with only one group of
MatMuls quantized (self-attention, cross-attention, FFN, projection). Per input set and candidate it prints the
gate's figure (greedy tokens equal, free-running, 32 new tokens), and, teacher-forced on the reference's greedy
tokens: the largest and mean logit error, the argmax flips, the fp32 top-1 minus top-2 margin at each flip and the
smallest margin of the set (the engine's suppressed ids are no rival, as in greedy), and per set each input's
smallest margin. Held-out clips: toolkit/testing/tiny_whisper_speech (cache out/whisper-speech).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from runtime.manifest import decoder_layout  # noqa: E402
from runtime.search import SearchOptions  # noqa: E402
from toolkit.parity.gate import engine  # noqa: E402
from toolkit.parity.generation import _best_tokens, _forced_logits, compare_tokens, forced_owners  # noqa: E402
from toolkit.parity.inputs import random_features  # noqa: E402
from toolkit.reference.config import ModelConfig  # noqa: E402

MAX_NEW = 32                          # the gate's: min(32, max_len)
# The fused graphs' MatMuls in graph order, by role (the names are the exporter's, not the modules'): each decoder
# layer [self K/V packed, self Q, self out, cross Q, cross out, fc1, fc2]; each encoder layer [Q/K packed, V, out,
# fc1, fc2], then the decoder layers' cross K/V (packed), which the encoder graph computes once.
GROUPS = {"decoder": {"self-attention": (0, 1, 2), "cross-attention Q/out": (3, 4), "ffn": (5, 6)},
          "encoder": {"attention": (0, 1, 2), "ffn": (3, 4), "cross K/V": ()}}


def graphs(bundle: Path) -> tuple[dict, dict[str, Path]]:
    manifest = json.loads((bundle / "manifest.json").read_text())
    return manifest, {g: bundle / manifest["graphs"][g]["file"] for g in ("encoder", "decoder")}


def run(paths: dict[str, Path], manifest: dict, seqs, tokens=None) -> tuple[list[list[int]], np.ndarray]:
    """(its greedy tokens, its teacher-forced logits [positions, vocab] along `tokens`, default its own)."""
    eng = engine(paths, manifest["model"], "cpu", decoder_layout(manifest))
    own = _best_tokens(eng, seqs, SearchOptions(max_new_tokens=MAX_NEW, beam=1))
    rows = []
    _forced_logits(eng, seqs, tokens or own, lambda offset, logits: rows.append(np.asarray(logits, np.float64)))
    return own, np.concatenate(rows)


def row(name: str, ref: tuple, cand: tuple, suppressed: tuple[int, ...]) -> dict:
    ref_tokens, ref_logits = ref
    got_tokens, got_logits = cand
    seq_eq, tok_eq, _ = compare_tokens(ref_tokens, got_tokens)
    err = np.abs(got_logits - ref_logits).max(-1)
    margin = margins_of(ref_logits, suppressed)
    ref_logits, got_logits = ref_logits.copy(), got_logits.copy()
    ref_logits[:, list(suppressed)] = got_logits[:, list(suppressed)] = -np.inf
    flips = np.flatnonzero(got_logits.argmax(-1) != ref_logits.argmax(-1))
    return {"candidate": name, "tokens_equal": tok_eq, "sequences_equal": seq_eq,
            "distinct": len({tuple(t) for t in ref_tokens}), "positions": len(err),
            "max_err": float(err.max()), "mean_err": float(err.mean()), "flips": len(flips),
            "flip_margins": [round(float(margin[i]), 4) for i in flips][:12],
            "flip_errors": [round(float(err[i]), 4) for i in flips][:12],
            "min_margin": float(margin.min()), "near_ties": int((margin < err.max()).sum())}


def group_graph(fused: Path, manifest: dict, graph: str, group: str, layers: int, work: Path) -> Path:
    """The fp32 fused `graph` with only `group`'s MatMuls in int8 (the default recipe's pre-passes and scales: the
    decoder's 8-bit embedding is in every decoder group; group "none": that alone)."""
    import onnx_ir as ir

    from exporters.int8_recipes import RECIPES, prepare
    from exporters.precision import to_int8

    model, _, _, _ = prepare(ir.load(fused / manifest["graphs"][graph]["file"]), RECIPES[0])
    for i, node in enumerate(model.graph):
        node.name = node.name or f"node_{i}"
    names = [n.name for n in model.graph if n.op_type == "MatMul"]
    per = (len(names) - (layers if graph == "encoder" else 0)) // layers
    if group == "cross K/V":
        mine = names[per * layers:]
    else:
        picks = GROUPS[graph].get(group, ())
        mine = [names[layer * per + k] for layer in range(layers) for k in picks]
    to_int8(model, per_channel=False, keep_float=tuple(n for n in names if n not in mine))
    out = work / f"{graph}-{group.replace(' ', '_').replace('/', '')}.onnx"
    ir.save(model, out, external_data=out.name + ".data")
    print(f"{graph} {group}: {len(mine)} of {len(names)} MatMuls in int8", file=sys.stderr)
    return out


def clip_margins(ref: tuple, suppressed: tuple[int, ...]) -> list[float]:
    """Per input: the smallest fp32 top-1 minus top-2 logit over its greedy steps (suppressed ids no rival)."""
    tokens, logits = ref
    low = np.full(len(tokens), np.inf)
    np.minimum.at(low, forced_owners(tokens), margins_of(logits, suppressed))
    return low.tolist()


def margins_of(logits: np.ndarray, suppressed: tuple[int, ...]) -> np.ndarray:
    logits = logits.copy()
    logits[:, list(suppressed)] = -np.inf
    top2 = np.sort(logits, -1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fused", type=Path, required=True)
    ap.add_argument("--int8", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("out/wint8/study"))
    ap.add_argument("--cache", type=Path, default=Path("out/whisper-speech"))
    ap.add_argument("--groups", action="store_true")
    ap.add_argument("--no-random", action="store_true", help="speech sets only")
    ap.add_argument("--pool", type=int, default=0, help="more held-out clips to speak (phrases seed 2)")
    ap.add_argument("--recipes", default="", help="more int8 bundles NAME=DIR,... (e.g. per-row=out/wint8/int8-per-row)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    from toolkit.testing.tiny_whisper_speech import trained_whisper

    manifest, fp32 = graphs(args.fused)
    _, int8 = graphs(args.int8)
    _, held = trained_whisper(args.cache)
    sets = {"held-out speech (24)": [h[0] for h in held],
            "gate's random features (100)": random_features(ModelConfig.from_dict(manifest["model"]), 100).seqs}
    if args.no_random:
        del sets["gate's random features (100)"]
    if args.pool:
        from runtime.audio import batch_features
        from toolkit.testing.tiny_whisper_speech import phrases, speak

        clips = speak(args.work / "pool", phrases(args.pool, seed=2))
        sets[f"more held-out speech ({args.pool})"] = list(batch_features([c[0] for c in clips]))
    candidates = {"int8 (both graphs)": int8, "int8 encoder only": {"encoder": int8["encoder"], "decoder":
                  fp32["decoder"]}, "int8 decoder only": {"encoder": fp32["encoder"], "decoder": int8["decoder"]}}
    for item in filter(None, args.recipes.split(",")):
        name, path = item.split("=")
        candidates[f"int8 {name}"] = graphs(Path(path))[1]
    if args.groups:
        for graph, groups in GROUPS.items():
            layers = manifest["model"][f"n_{graph}_layers"]
            for group in ("none", *groups) if graph == "decoder" else groups:
                paths = dict(fp32, **{graph: group_graph(args.fused, manifest, graph, group, layers, args.work)})
                candidates[f"{graph} {group} only"] = paths
    results = []
    for set_name, seqs in sets.items():
        ref = run(fp32, manifest, seqs)
        suppressed = engine(fp32, manifest["model"], "cpu", decoder_layout(manifest)).suppress_ids
        margins = sorted(clip_margins(ref, suppressed))
        print(json.dumps({"inputs": set_name, "clip_min_margins": [round(m, 3) for m in margins]}), flush=True)
        for name, paths in candidates.items():
            got_tokens, forced = run(paths, manifest, seqs, ref[0])
            results.append({"inputs": set_name, **row(name, ref, (got_tokens, forced), suppressed)})
            print(json.dumps(results[-1]), flush=True)
    (args.work / "results.json").write_text(json.dumps(results, indent=2))     # the margins are in the log


if __name__ == "__main__":
    main()
