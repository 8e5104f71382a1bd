"""What reading the 8-bit tied table by rows (exporters/tied_table) costs in speed, in two measurements.

    .venv/bin/python benchmarks/studies/tied_table_rows.py projection [--rounds 5]
    .venv/bin/python benchmarks/studies/tied_table_rows.py decode NAME=BUNDLE [NAME=BUNDLE[:nodrop] ...] [--rounds 4]
    .venv/bin/python benchmarks/studies/tied_table_rows.py arena BUNDLE [--rounds 6] [--new-tokens 64] [--repeat 1]

projection: the tied projection alone at the NLLB-600M shape (random int8 weights [256206, 1024], 2 threads):
    one com.microsoft.DynamicQuantizeMatMul by Q^T [D, V] (what bundles made before hold) against
    DynamicQuantizeLinear + com.microsoft.QGemm(transB) by 1, 4 and 16 row slices of Q [V, D] and a Concat; the
    median of 40 calls per round, rounds interleaved, at batch 1 and 8.
decode: greedy decoding of several bundles in one process, 64 new tokens (EOS ignored) of 8 random sources of 24
    ids: 3 sources one at a time (batch 1) and all 8 at once (batch 8) per round, the bundles' order reversed every
    other round. BUNDLE:nodrop loads it without runtime/bundle.LookupPages (giving the lookup pages back after
    each run).
arena: the same, for one bundle loaded three times: with onnxruntime's CPU memory arena and memory patterns, with
    the arena off, and with both off (the runtime's default since 2026-12-05: runtime.session.SessionConfig's
    cpu_memory_arena and memory_pattern); --repeat decodes each part that many times a round (for a small model,
    whose decode is short). Their memory: benchmarks/studies/session_memory.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

V, D = 256206, 1024


def projection_session(q: np.ndarray, kind: str, slices: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    if kind == "DynamicQuantizeMatMul":
        inits = [numpy_helper.from_array(np.ascontiguousarray(q.T), "qt"), one]
        nodes = [helper.make_node("DynamicQuantizeMatMul", ["x", "qt", "one"], ["y"], domain="com.microsoft")]
    else:
        inits = [one, numpy_helper.from_array(np.array(0, np.int8), "zp")]
        nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"])]
        step, outs = -(-len(q) // slices), []
        for i, a in enumerate(range(0, len(q), step)):
            inits.append(numpy_helper.from_array(q[a:a + step], f"w{i}"))
            nodes.append(helper.make_node("QGemm", ["xq", "xs", "xz", f"w{i}", "one", "zp"], [f"p{i}"],
                                          domain="com.microsoft", transB=1))
            outs.append(f"p{i}")
        nodes.append(helper.make_node("Concat", outs, ["y"], axis=1) if len(outs) > 1
                     else helper.make_node("Identity", outs, ["y"]))
    graph = helper.make_graph(nodes, "projection", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", D])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def projection(rounds: int) -> None:
    rng = np.random.default_rng(0)
    q = rng.integers(-64, 65, size=(V, D), dtype=np.int8)
    sessions = {"DynamicQuantizeMatMul by Q^T": projection_session(q, "DynamicQuantizeMatMul", 1)}
    for k in (1, 4, 16):
        sessions[f"QGemm by {k} slice(s) of Q"] = projection_session(q, "QGemm", k)
    del q
    times = {name: {1: [], 8: []} for name in sessions}
    for _ in range(rounds):
        for batch in (1, 8):
            x = rng.standard_normal((batch, D), dtype=np.float32)
            for name, session in sessions.items():
                calls = []
                for _ in range(40):
                    start = time.perf_counter()
                    session.run(None, {"x": x})
                    calls.append(time.perf_counter() - start)
                times[name][batch].append(np.median(calls) * 1e3)
    print(f"{'projection [b, 1024] x [1024, 256206]':<40} {'batch 1 ms':>10} {'batch 8 ms':>10}  (median of rounds)")
    for name, t in times.items():
        print(f"{name:<40} {np.median(t[1]):>10.2f} {np.median(t[8]):>10.2f}")


def decode(bundles: list[str], rounds: int) -> None:
    import runtime.bundle as runtime_bundle

    engines = {}
    default = runtime_bundle.RETURNED_BYTES
    for item in bundles:
        name, path = item.split("=", 1)
        runtime_bundle.RETURNED_BYTES = 1 << 62 if path.endswith(":nodrop") else default
        engines[name] = runtime_bundle.load_bundle(path.removesuffix(":nodrop"), "cpu", threads=2).engine
    runtime_bundle.RETURNED_BYTES = default
    race(engines, rounds, 64, 1)


def arena(bundle: str, rounds: int, new_tokens: int, repeat: int) -> None:
    from runtime.bundle import load_bundle
    from runtime.session import SessionConfig

    configs = {"arena on": SessionConfig(), "arena off": SessionConfig(cpu_memory_arena=False),
               "arena off, no pattern": SessionConfig(cpu_memory_arena=False, memory_pattern=False)}
    engines = {name: load_bundle(bundle, "cpu", session_options=config, threads=2).engine
               for name, config in configs.items()}
    race(engines, rounds, new_tokens, repeat)


def race(engines: dict, rounds: int, new_tokens: int, repeat: int) -> None:
    from runtime.generate import generate_ids
    from runtime.search import SearchOptions

    vocab = min(e.src_vocab_size for e in engines.values())
    rng = np.random.default_rng(0)
    sources = [rng.integers(3, vocab - 1, size=24).tolist() for _ in range(8)]
    options = SearchOptions(max_new_tokens=new_tokens, ignore_eos=True)
    times = {name: {1: [], 8: []} for name in engines}
    for engine in engines.values():
        generate_ids(engine, sources[:1], options)                  # warm-up
    for r in range(rounds):
        order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
        for name, engine in order:
            start = time.perf_counter()
            for _ in range(repeat):
                for source in sources[:3]:
                    generate_ids(engine, [source], options)
            times[name][1].append((time.perf_counter() - start) / 3 / repeat * 1e3)
            start = time.perf_counter()
            for _ in range(repeat):
                generate_ids(engine, sources, options)
            times[name][8].append((time.perf_counter() - start) / repeat * 1e3)
    print(f"{'bundle':<12} {'batch 1 ms':>10} {'batch 8 ms':>10}  (median of {rounds} rounds; each round's figures)")
    for name, t in times.items():
        print(f"{name:<12} {np.median(t[1]):>10.1f} {np.median(t[8]):>10.1f}  "
              f"[{' '.join(f'{x:.0f}' for x in t[1])}] [{' '.join(f'{x:.0f}' for x in t[8])}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("projection", "decode", "arena"))
    ap.add_argument("bundles", nargs="*", help="decode: NAME=BUNDLE (add :nodrop to load it without LookupPages); "
                                               "arena: one BUNDLE")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if args.what == "projection":
        projection(args.rounds or 5)
    elif not args.bundles or (args.what == "arena" and len(args.bundles) != 1):
        ap.error(f"{args.what} needs {'one BUNDLE' if args.what == 'arena' else 'NAME=BUNDLE arguments'}")
    elif args.what == "decode":
        decode(args.bundles, args.rounds or 4)
    else:
        arena(args.bundles[0], args.rounds or 6, args.new_tokens, args.repeat)


if __name__ == "__main__":
    main()
