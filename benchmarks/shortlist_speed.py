"""The vocabulary shortlist's speed: decode steps with and without it, and the projection mechanisms compared.

    python benchmarks/shortlist_speed.py steps BUNDLE... [--batch-sizes 1,8] [--new-tokens 32] [--per-token 75]
    python benchmarks/shortlist_speed.py projection [--shapes 512x58101,1024x256206] [--batch-sizes 1,8]

`steps`: greedy decoding (EOS ignored) of random 32-token sources with the shortlist and without, back to back
(alternating, --repeat times, medians), CPU time and wall time per generated token. The bundles may hold random
weights: the map is synthetic, Marian's conventional lexical shortlist sizes (the --always most frequent targets,
--per-token candidates a source token, random ids), written with the bundle's shortlist decoder
(exporters/shortlist_graph.py) into the bundle folder (the manifest is left alone).

`projection`: the output projection alone, per step, at a model shape (d_model x vocab), for the mechanisms:
full (MatMul by the constant [D, V] weight, as the decoder has it), gather (the shortlist decoder's: Gather of the
rows each step, then the product; what the runtime uses) and bound (the gathered rows made once per request and
bound as an input: the product only).

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

    rows = []
    for bundle in map(Path, args.bundles):
        loaded = load_bundle(bundle, provider="cpu", threads=args.threads, shortlist=False)
        engine = loaded.engine
        decoder = bundle / loaded.manifest["graphs"]["decoder"]["file"]
        variant = write_shortlist_decoder(decoder, bundle / "decoder.shortlist.onnx", bundle)
        engine.use_shortlist(synthetic_map(engine.src_vocab_size, engine.vocab_size, args.per_token, args.always),
                             make_session(variant, "cpu", SessionConfig(intra_op_threads=args.threads)))
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

    from exporters.shortlist_graph import TABLE, shortlist_decoder
    from runtime.session import SessionConfig, make_session

    w = np.random.default_rng(0).standard_normal((width, vocab), dtype=np.float32) * 0.05
    hidden = helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", "t", width])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "t", vocab])
    graph = helper.make_graph([helper.make_node("MatMul", ["h", "w"], ["logits"])], "projection", [hidden], [logits],
                              [numpy_helper.from_array(w, "w")])
    del w
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "full.onnx"),
              save_as_external_data=True, location="full.data")
    del graph
    gather = shortlist_decoder(onnx.load(str(folder / "full.onnx"), load_external_data=False), folder)
    onnx.save(gather, str(folder / "gather.onnx"), save_as_external_data=True, location="gather.data")
    del gather
    bound = onnx.load(str(folder / "gather.onnx"), load_external_data=False)   # rows an input, not a Gather
    bound.graph.node.remove(next(n for n in bound.graph.node if n.name == "shortlist.gather"))
    table = next(t for t in bound.graph.initializer if t.name == TABLE)
    rows = numpy_helper.to_array(table, base_dir=str(folder))
    bound.graph.initializer.remove(table)
    bound.graph.input.append(helper.make_tensor_value_info("shortlist.rows", TensorProto.FLOAT, ["v", width]))
    count = next(n for n in bound.graph.node if n.name == "shortlist.count_shape")
    count.input[0] = "shortlist.rows"
    count.attribute.append(helper.make_attribute("end", 1))
    bound.graph.input.remove(next(i for i in bound.graph.input if i.name == "vocab_ids"))
    onnx.save(bound, str(folder / "bound.onnx"))
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
            binding.bind_ortvalue_input("shortlist.rows", rows_value)
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
