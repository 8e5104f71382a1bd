"""Per-step decode time of several bundles of one model (ad-hoc timing for the optimize study; not a test).

    python benchmarks/fusion_step_time.py unfused=out/base fused=out/base-fused int8=out/base-int8 --batches 1,8

Runs the encoder once on a random source, then `--steps` one-token cached decoder steps with greedy tokens,
in sessions configured as the runtime configures them (ORT_ENABLE_ALL). Bundles are measured in turn, round
after round (`--rounds`), so load from other processes spreads evenly; a cell is the median step time of the
best round. `--profile DIR` also writes ORT profiles (one decode run per bundle and batch) for a per-op look.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from runtime.manifest import read_manifest
from runtime.session import SessionConfig, make_session


class Decoder:
    """One bundle's sessions and a cached greedy decode loop that records each step's time."""

    def __init__(self, bundle: Path, profile: Path | None = None, threads: int = 0):
        manifest = read_manifest(bundle)
        self.config = manifest["model"]
        options = SessionConfig(intra_op_threads=threads)
        self.encoder = make_session(bundle / manifest["graphs"]["encoder"]["file"], "cpu", options)
        opts = options.to_ort()
        if profile is not None:
            opts.enable_profiling = True
            opts.profile_file_prefix = str(profile)
        import onnxruntime as ort
        self.decoder = ort.InferenceSession(str(bundle / manifest["graphs"]["decoder"]["file"]), opts,
                                            providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.decoder.get_outputs()]

    def run(self, batch: int, src_len: int, steps: int, seed: int = 0) -> list[float]:
        c = self.config
        rng = np.random.default_rng(seed)
        ids = rng.integers(3, c["vocab_size"], (batch, src_len)).astype(np.int64)
        mask = np.ones_like(ids)
        enc = dict(zip([o.name for o in self.encoder.get_outputs()],
                       self.encoder.run(None, {"input_ids": ids, "attention_mask": mask})))
        heads, head_dim = c["n_heads"], c["d_model"] // c["n_heads"]
        feeds = {"encoder_attention_mask": mask}
        for i in range(c["n_decoder_layers"]):
            empty = np.zeros((batch, heads, 0, head_dim), np.float32)
            feeds.update({f"past_key_values.{i}.decoder.key": empty, f"past_key_values.{i}.decoder.value": empty,
                          f"past_key_values.{i}.encoder.key": enc[f"present.{i}.encoder.key"],
                          f"past_key_values.{i}.encoder.value": enc[f"present.{i}.encoder.value"]})
        tokens = np.full((batch, 1), c["bos_id"], np.int64)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = dict(zip(self.names, self.decoder.run(self.names, {"input_ids": tokens, **feeds})))
            times.append(time.perf_counter() - start)
            for name in self.names[1:]:
                feeds[name.replace("present.", "past_key_values.")] = out[name]
            tokens = out["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        return times

    def end_profiling(self) -> str:
        return self.decoder.end_profiling()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+", help="name=bundle_dir")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--src-len", type=int, default=24)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT's default)")
    parser.add_argument("--profile", type=Path, help="write ORT profiles of one decode run per bundle/batch here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    named = dict(b.split("=", 1) for b in args.bundles)
    batches = [int(b) for b in args.batches.split(",")]
    decoders = {name: Decoder(Path(path), threads=args.threads) for name, path in named.items()}
    for d in decoders.values():                                       # warm up every session and shape
        for b in batches:
            d.run(b, args.src_len, 4)
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for b in batches:
            for name, d in decoders.items():
                median = float(np.median(d.run(b, args.src_len, args.steps)[1:])) * 1e3
                best[(name, b)] = min(best.get((name, b), float("inf")), median)
    if args.json:
        print(json.dumps({f"{n}@{b}": round(v, 3) for (n, b), v in best.items()}, indent=2))
    else:
        print(f"median ms per decoder step (best of {args.rounds} rounds; src_len {args.src_len}, "
              f"{args.steps} steps, past 1..{args.steps}, intra-op threads {args.threads or 'default'})")
        print(f"{'bundle':<16}" + "".join(f"{'batch ' + str(b):>12}" for b in batches))
        for name in decoders:
            print(f"{name:<16}" + "".join(f"{best[(name, b)]:>12.3f}" for b in batches))
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        for name, path in named.items():
            for b in batches:
                d = Decoder(Path(path), args.profile / f"{name}_b{b}", args.threads)
                d.run(b, args.src_len, args.steps)
                print("profile:", d.end_profiling())


if __name__ == "__main__":
    main()
