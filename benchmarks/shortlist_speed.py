"""The vocabulary shortlist's speed: decode steps with and without it, and the projection mechanisms compared.

    python benchmarks/shortlist_speed.py steps BUNDLE... [--batch-sizes 1,8] [--new-tokens 32] [--per-token 75]
    python benchmarks/shortlist_speed.py projection [--shapes 512x58101,1024x256206] [--batch-sizes 1,8]

`steps`: greedy decoding (EOS ignored) of random 32-token sources with the shortlist and without, back to back
(alternating, --repeat times, medians), CPU time and wall time per generated token. The bundles may hold random
weights: the map is synthetic, Marian's conventional lexical shortlist sizes (the --always most frequent targets,
--per-token candidates a source token, random ids), written with the bundle's shortlist decoder
(exporters/shortlist_graph.py) into the bundle folder (the manifest is left alone).

`projection`: the output projection alone, per step, at a model shape (d_model x vocab), for the mechanisms:
full (MatMul by the constant [D, V] weight, as the decoder has it), gather (a Gather of the rows inside the graph
every step, then the product: the first shortlist decoder, before 2026-12-02) and bound (the shortlist decoder's
now: the rows gathered once per request by the runtime and bound as an input: the product only).

Run under the bench lock: flock /tmp/onnxformer-bench.lock python benchmarks/shortlist_speed.py ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def synthetic_map(src_vocab: int, vocab: int, per_token: int, always: int, seed: int = 0):
    from runtime.shortlist import Shortlist

    rng = np.random.default_rng(seed)
    candidates = np.sort(rng.integers(always, vocab, size=(src_vocab, per_token)), axis=1).ravel()
    offsets = np.arange(src_vocab + 1, dtype=np.int64) * per_token
    return Shortlist(offsets, candidates.astype(np.int64), np.arange(min(always, vocab), dtype=np.int64))


def shortlisted_copy(bundle: Path, out: Path, shortlist) -> Path:
    """A copy of `bundle` at `out` (copied: onnx refuses external data with several hard links) carrying `shortlist` (a
    synthetic map: no gate ran, so the manifest's record says verified false, synthetic true), its shortlist decoder
    and weight: a bundle every runtime path loads with the shortlist on, for races."""
    import shutil

    from exporters.bundle import graph_entry, write_manifest
    from exporters.shortlist import DECODER_FILE, MAP_FILE, save_map
    from exporters.shortlist_graph import write_shortlist_decoder
    from runtime.manifest import read_manifest, sha256_file

    manifest = read_manifest(bundle)
    if manifest.pop("shortlist", None):
        raise SystemExit(f"{bundle} has a shortlist already; give the bundle without one")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in set(manifest["files"]) - {"manifest.json"}:
        shutil.copyfile(bundle / name, out / name)
    _, weight = write_shortlist_decoder(out / manifest["graphs"]["decoder"]["file"], out / DECODER_FILE, out)
    save_map(shortlist, out / MAP_FILE)
    manifest["shortlist"] = {"file": MAP_FILE, "sha256": sha256_file(out / MAP_FILE),
                             "decoder": graph_entry(out / DECODER_FILE), "weight": weight, "sizes": shortlist.sizes(),
                             "size": int(shortlist.sizes()["most_candidates"]), "always": len(shortlist.always),
                             "verified": False, "synthetic": True}
    write_manifest(out, manifest)
    return out


def timed(fn) -> tuple[float, float]:
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c, time.perf_counter() - w


def steps(args) -> list[dict]:
    from exporters.shortlist_graph import write_shortlist_decoder
    from runtime.bundle import load_bundle
    from runtime.generate import generate_ids
    from runtime.search import SearchOptions
    from runtime.session import SessionConfig, make_session
    from runtime.shortlist import ShortlistWeight

    rows = []
    for bundle in map(Path, args.bundles):
        loaded = load_bundle(bundle, provider="cpu", threads=args.threads, shortlist=False)
        engine = loaded.engine
        decoder = bundle / loaded.manifest["graphs"]["decoder"]["file"]
        variant, weight = write_shortlist_decoder(decoder, bundle / "decoder.shortlist.onnx", bundle)
        table = np.memmap(bundle / weight["file"], dtype=weight["dtype"], mode="r", offset=weight["offset"],
                          shape=tuple(weight["shape"]))
        engine.use_shortlist(synthetic_map(engine.src_vocab_size, engine.vocab_size, args.per_token, args.always),
                             make_session(variant, "cpu", SessionConfig(intra_op_threads=args.threads)),
                             ShortlistWeight(table, weight["feed"]))
        rng = np.random.default_rng(1)
        for batch in args.batch_sizes:
            seqs = rng.integers(3, engine.src_vocab_size - 1, size=(batch, args.src_len)).tolist()
            union = len(np.unique(np.concatenate([engine.shortlist.of(s) for s in seqs])))
            runs = {True: [], False: []}
            for on in (True, False):                                      # warm-up
                generate_ids(engine, seqs, SearchOptions(max_new_tokens=4, ignore_eos=True, shortlist=on))
            for _ in range(args.repeat):
                for on in (False, True):
                    opts = SearchOptions(max_new_tokens=args.new_tokens, ignore_eos=True, shortlist=on)
                    runs[on].append(timed(lambda: generate_ids(engine, seqs, opts)))
            per = {on: [statistics.median(r[i] for r in runs[on]) * 1e3 / args.new_tokens for i in (0, 1)]
                   for on in runs}
            rows.append({"bundle": bundle.name, "precision": loaded.manifest["precision"], "batch": batch,
                         "vocab": engine.vocab_size, "shortlist_vocab": union,
                         "full_cpu_ms": per[False][0], "shortlist_cpu_ms": per[True][0],
                         "full_wall_ms": per[False][1], "shortlist_wall_ms": per[True][1],
                         "speedup_cpu": per[False][0] / per[True][0], "speedup_wall": per[False][1] / per[True][1]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _projection_sessions(width: int, vocab: int, threads: int, folder: Path):
    """(full, gather, bound) sessions of the projection alone, weights random, written to `folder` with their
    weights as external data (ONNX Runtime maps them), and the rows table [V, D]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from exporters.shortlist_graph import shortlist_decoder
    from runtime.session import SessionConfig, make_session
    from runtime.spec import SHORTLIST_WEIGHT

    w = np.random.default_rng(0).standard_normal((width, vocab), dtype=np.float32) * 0.05
    hidden = helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", "t", width])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "t", vocab])
    graph = helper.make_graph([helper.make_node("MatMul", ["h", "w"], ["logits"])], "projection", [hidden], [logits],
                              [numpy_helper.from_array(w, "w")])
    del w
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "full.onnx"),
              save_as_external_data=True, location="full.data")
    del graph
    bound, table = shortlist_decoder(onnx.load(str(folder / "full.onnx"), load_external_data=False), folder)
    rows = table.array
    onnx.save(bound, str(folder / "bound.onnx"))
    gather = bound                                                   # the rows gathered in the graph, every step
    gather.graph.input.remove(next(i for i in gather.graph.input if i.name == SHORTLIST_WEIGHT))
    gather.graph.initializer.append(numpy_helper.from_array(rows, "table"))
    gather.graph.node.insert(0, helper.make_node("Gather", ["table", "vocab_ids"], [SHORTLIST_WEIGHT], axis=0))
    onnx.save(gather, str(folder / "gather.onnx"), save_as_external_data=True, location="gather.data")
    del gather, bound
    config = SessionConfig(intra_op_threads=threads)
    return [make_session(folder / f"{k}.onnx", "cpu", config) for k in ("full", "gather", "bound")], rows


def projection(args) -> list[dict]:
    import onnxruntime as ort

    rows = []
    for shape in args.shapes:
        width, vocab = (int(x) for x in shape.split("x"))
        folder = Path(tempfile.mkdtemp(prefix="projection-"))
        (full, gather, bound), table = _projection_sessions(width, vocab, args.threads, folder)
        rng = np.random.default_rng(2)
        for batch in args.batch_sizes:
            h = rng.standard_normal((batch, 1, width), dtype=np.float32)
            picked = np.unique(rng.integers(0, vocab, size=args.always + batch * args.src_len * args.per_token))
            ids = np.unique(np.concatenate([np.arange(args.always), picked]))
            rows_value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(table[ids]))
            binding = bound.io_binding()                               # bound once per request
            binding.bind_ortvalue_input("shortlist_weight", rows_value)
            binding.bind_cpu_input("vocab_ids", ids)
            binding.bind_cpu_input("h", h)
            binding.bind_output("logits", "cpu")
            calls = {"full": lambda: full.run(None, {"h": h}),
                     "gather": lambda: gather.run(None, {"h": h, "vocab_ids": ids}),
                     "bound": lambda: bound.run_with_iobinding(binding)}
            result = {"shape": shape, "batch": batch, "shortlist_vocab": len(ids)}
            times = {k: [] for k in calls}
            for _ in range(args.repeat):
                for name, call in calls.items():
                    call()
                    times[name].append(timed(lambda: [call() for _ in range(args.steps)]))
            for name in calls:
                result[f"{name}_cpu_us"] = statistics.median(t[0] for t in times[name]) * 1e6 / args.steps
                result[f"{name}_wall_us"] = statistics.median(t[1] for t in times[name]) * 1e6 / args.steps
            rows.append(result)
            print(json.dumps(result), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["steps", "projection"])
    parser.add_argument("bundles", nargs="*")
    parser.add_argument("--batch-sizes", default="1,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--shapes", default="512x58101,1024x256206", type=lambda s: s.split(","))
    parser.add_argument("--src-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--per-token", type=int, default=75, help="candidates a source token (Marian's usual 75)")
    parser.add_argument("--always", type=int, default=100, help="always-included targets (Marian's usual 100)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50, help="projection mode: calls a timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows = steps(args) if args.mode == "steps" else projection(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
