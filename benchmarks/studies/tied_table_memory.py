"""Why an int8 bundle's 8-bit embedding table is resident twice, and what the two ways out would cost.

    .venv/bin/python benchmarks/studies/tied_table_memory.py INT8_BUNDLE [--new-tokens 64] [--repeat 15]

1. Dropping the mapped table's pages after both sessions are made (madvise MADV_DONTNEED on the bundle's shared
   mapping of weights.data): resident memory after loading, after the drop, after a batch-1 and a batch-8 run of
   random source ids (the random model's output ids span the vocabulary). The token lookup reads one column of the
   [D, V] table per token, which touches every row: the pages come back.
2. The tied projection without prepacking: com.microsoft.DynamicQuantizeMatMul over the bundle's [D, V] shape with
   B a constant (onnxruntime prepacks it into memory of its own: the second copy) and with B a graph input (read
   in place each call, as a mapped table would be): best and median ms at batch 1 and 8, 2 threads.
"""

from __future__ import annotations

import argparse
import mmap
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from optimize_memory import rss  # noqa: E402

FIELDS = ("VmRSS", "RssAnon", "RssFile")


def residency(bundle: str, new_tokens: int) -> tuple[int, int]:
    """Part 1; returns the table's shape (D, V)."""
    import runtime.bundle as B
    from runtime.generate import generate_ids
    from runtime.search import SearchOptions

    mappings, real = [], B._mapped_tensors

    def spy(*args, **kwargs):                 # keep the mmap objects behind the shared tensors
        arrays = real(*args, **kwargs)
        for array in arrays.values():
            base = array
            while not isinstance(base, mmap.mmap):
                base = base.obj if isinstance(base, memoryview) else base.base
            mappings.append(base)
        return arrays

    B._mapped_tensors = spy

    def show(stage: str) -> None:
        values = rss(FIELDS, unit=1024 ** 2)
        print(f"  {stage:<26}" + "".join(f"{values[k]:>10.1f}" for k in FIELDS))

    print(f"  {'stage (MiB)':<26}" + "".join(f"{k:>10}" for k in FIELDS))
    loaded = B.load_bundle(bundle, "cpu")
    show("both sessions made")
    for mapping in {id(m): m for m in mappings}.values():
        mapping.madvise(mmap.MADV_DONTNEED)
    show("mapped pages dropped")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(5, 1000, 32).tolist() for _ in range(8)]
    opts = SearchOptions(max_new_tokens=new_tokens, ignore_eos=True)
    generate_ids(loaded.engine, seqs[:1], opts)
    show(f"{new_tokens} tokens, batch 1")
    generate_ids(loaded.engine, seqs, opts)
    show(f"{new_tokens} tokens, batch 8")
    table = next(t for t in loaded.manifest["shared_weights"]["tensors"] if t["name"].endswith(".int8_t"))
    return tuple(table["shape"])


def projection(d: int, v: int, repeat: int) -> None:
    """Part 2."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    table = rng.integers(-64, 65, size=(d, v), dtype=np.int8)

    def session(constant: bool) -> ort.InferenceSession:
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", d])]
        inits = [numpy_helper.from_array(np.array(1.0, np.float32), "s")]
        if constant:
            inits.append(numpy_helper.from_array(table, "B"))
        else:
            inputs.append(helper.make_tensor_value_info("B", TensorProto.INT8, [d, v]))
        graph = helper.make_graph([helper.make_node("DynamicQuantizeMatMul", ["x", "B", "s"], ["y"],
                                                    domain="com.microsoft")], "projection", inputs,
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", v])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    packed, in_place = session(True), session(False)
    for m in (1, 8):
        x = rng.normal(size=(m, d)).astype(np.float32)
        runs = {"prepacked (constant B)": lambda: packed.run(None, {"x": x}),
                "read in place (B an input)": lambda: in_place.run(None, {"x": x, "B": table})}
        assert np.array_equal(*(run()[0] for run in runs.values()))
        times = {name: [] for name in runs}
        for _ in range(repeat):                        # interleaved
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        for name, t in times.items():
            print(f"  batch {m}, {name:<28} best {min(t) * 1e3:8.2f} ms   median {np.median(t) * 1e3:8.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    print("1. the mapped table's pages dropped after loading")
    d, v = residency(args.bundle, args.new_tokens)
    print(f"2. the tied projection [m, {d}] x [{d}, {v}] int8, 2 threads")
    projection(d, v, args.repeat)


if __name__ == "__main__":
    main()
