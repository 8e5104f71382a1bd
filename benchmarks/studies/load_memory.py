"""Where a race worker's resident memory goes, step by step: imports, tokenizer, each session, each batch size.

    .venv/bin/python benchmarks/studies/load_memory.py BUNDLE SPEC [--tokenizer] [--entry KEY=VALUE ...]
    out/peers/ct2/bin/python benchmarks/studies/load_memory.py CT2_DIR SPEC --ctranslate2 [--compute-type int8]

BUNDLE is an onnxformer bundle, SPEC a race spec that benchmarks/race_peers.py wrote beside it (race-spec-*.json:
inputs, batch sizes, new tokens, threads). One fresh process prints VmRSS, VmHWM, RssAnon and RssFile (MiB) after
each step: Python, numpy, onnxruntime and the runtime imported; the tokenizer (--tokenizer: load_bundle's default;
the race's worker loads none); each session made (load_bundle's own calls, reported as they return); then one
generation per batch size in the order given, then the same again (what the first pass left is what a second one
reuses). --entry adds an ONNX Runtime session config entry to both sessions (e.g.
session.use_device_allocator_for_initializers=1). --ctranslate2 runs the same steps for a CTranslate2 model
directory (ids given as its vocabulary's pieces, as benchmarks/peer_worker.py does), in an environment that has it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def report(step: str, seconds: float | None = None) -> None:
    """One line: this process's resident memory by kind after `step` (MiB), and its time when given."""
    mem = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in FIELDS:
                mem[key] = int(value.split()[0]) / 1024
    took = f"{seconds * 1e3:>9.0f}" if seconds is not None else ""
    print(f"{step:<22} " + " ".join(f"{mem[k]:>8.0f}" for k in FIELDS) + took, flush=True)


def onnxformer(bundle: str, spec: dict, tokenizer: bool, entries: dict[str, str]):
    """Load the bundle as the race's worker does (tokenizer: as load_bundle's default does), reporting each step;
    the run(seqs) function."""
    import numpy  # noqa: F401
    report("numpy")
    import onnxruntime  # noqa: F401
    report("onnxruntime")
    import runtime.bundle as bundles
    from runtime.generate import generate_ids
    from runtime.search import SearchOptions
    from runtime.session import SessionConfig
    report("runtime")

    def reported(fn, label):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            report(label(args))
            return out
        return call

    bundles.make_session = reported(bundles.make_session, lambda a: f"session {Path(str(a[0])).stem}")
    bundles._tokenizer = reported(bundles._tokenizer, lambda a: "tokenizer")
    to_ort = SessionConfig.to_ort

    def with_entries(config):
        options = to_ort(config)
        for key, value in entries.items():
            options.add_session_config_entry(key, value)
        return options

    SessionConfig.to_ort = with_entries
    engine = bundles.load_bundle(bundle, "cpu", threads=spec["threads"], tokenizer=tokenizer).engine
    report("loaded")
    opts = SearchOptions(max_new_tokens=spec["max_new_tokens"], beam=spec["beam"], suppress=(engine.pad_id,),
                         ignore_eos=spec["min_new_tokens"] >= spec["max_new_tokens"])
    return lambda seqs: generate_ids(engine, seqs, opts)


def ctranslate2(model: str, spec: dict, compute_type: str):
    """A CTranslate2 translator of the model directory, reporting its import and load; the run(seqs) function."""
    import ctranslate2
    report("ctranslate2")
    translator = ctranslate2.Translator(model, device="cpu", intra_threads=spec["threads"], inter_threads=1,
                                        compute_type=compute_type)
    pieces = json.loads((Path(model) / "shared_vocabulary.json").read_text())
    report("loaded")
    new = spec["max_new_tokens"]
    return lambda seqs: translator.translate_batch([[pieces[i] for i in s] for s in seqs], beam_size=spec["beam"],
                                                   max_decoding_length=new, min_decoding_length=spec["min_new_tokens"],
                                                   suppress_sequences=[["<pad>"]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("spec", type=Path)
    ap.add_argument("--tokenizer", action="store_true", help="load the bundle's tokenizer too")
    ap.add_argument("--entry", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--ctranslate2", action="store_true", help="MODEL is a CTranslate2 directory")
    ap.add_argument("--compute-type", default="default", help="with --ctranslate2")
    args = ap.parse_args()
    bad = [e for e in args.entry if "=" not in e]
    if bad:
        ap.error(f"--entry takes KEY=VALUE, got {', '.join(bad)}")
    sys.path.insert(0, str(ROOT))
    spec = json.loads(args.spec.read_text())
    print(f"{'after':<22} " + " ".join(f"{k:>8}" for k in FIELDS) + f"{'ms':>9}   (MiB)")
    report("python")
    if args.ctranslate2:
        run = ctranslate2(args.model, spec, args.compute_type)
    else:
        run = onnxformer(args.model, spec, args.tokenizer, dict(e.split("=", 1) for e in args.entry))
    for again in ("", " again"):
        for b in spec["batch_sizes"]:
            start = time.perf_counter()
            run(spec["inputs"][:b])
            report(f"batch {b}{again}", time.perf_counter() - start)


if __name__ == "__main__":
    main()
