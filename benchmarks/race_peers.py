"""Race onnxformer against CTranslate2 and Optimum (ONNX Runtime) on identical weights: one Marian directory
feeds our importer, CTranslate2's converter and Optimum's exporter; every engine then generates for the same
inputs in its own environment, under the bench lock, and the tokens are compared with MarianMTModel's.

    .venv/bin/python benchmarks/race_peers.py [--model tiny|opus|nllb-600m|bart-base|t5-small|flan-t5-base|DIR]
        [--batch-sizes 1,8]

Environments are built under out/peers/ (or $ONNXFORMER_PEERS; Optimum pins an older transformers than ours): ct2
(ctranslate2, transformers 5, torch) and optimum (optimum-onnx 0.1, transformers 4.57, torch; accelerate, which its
export's weight de-duplication needs); they are called as `python -m`, so a copied folder works too. Models: "tiny"
is the trained test model (toolkit.testing.tiny_marian TRAINED: outputs vary, so token agreement means something,
and its int8 bundle passes the gate on held-out texts); "opus" the opus-mt-en-de shape with random weights (speed;
every engine generates exactly --new-tokens tokens, EOS ignored; its int8 bundle is written unverified, as random
weights cannot pass a token gate);
"nllb-600m" and "bart-base" those shapes with random weights (toolkit.testing.tiny_families.SHAPES: an M2M100 and a
BART directory, speed as for opus); "t5-small" and "flan-t5-base" those T5 shapes with random weights
(toolkit.testing.tiny_t5.SHAPES: ReLU and a tied head, gated GELU and its own head; 32,128 rows, a 32,100-token
tokenizer; speed as for opus). Each row also gives the size of the engine's model folder and the worker
process's peak resident memory: over the whole run ("peak MB"), and once the first batch size's rounds ran ("peak
b1": loading and batch 1 alone; the workers time the batch sizes in the order given, then run the token pass).

`--shortlist 75` adds four engines on one synthetic vocabulary map (the --always most frequent ids + 75 random
candidates a source token, Marian's conventional sizes; sources then drawn from the whole vocabulary): onnxformer
fp32 and int8 bundles carrying it as their shortlist, and CTranslate2 fp32 and int8 with it as vmap.txt, decoding
with use_vmap. `--build-only` converts everything and stops (conversions need no quiet machine, the timed run
does); `--only LABEL,...` times those engines (and the PyTorch reference) only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("ONNXFORMER_PEERS") or ROOT / "out" / "peers").absolute()
PY = sys.executable
ENVS = {"ct2": ["torch==2.13.0", "ctranslate2==4.8.5", "transformers>=5.24,<6", "sentencepiece"],
        "optimum": ["torch==2.13.0", "optimum-onnx[onnxruntime]==0.1.0", "sentencepiece", "accelerate"]}
LOCK = "/tmp/onnxformer-bench.lock"
REFERENCE = "transformers (PyTorch eager)"     # the engine every other one's tokens are compared with


def log(msg: str) -> None:
    print(f"==> {msg}", file=sys.stderr, flush=True)


def sh(*args, env=None, **kw) -> None:
    subprocess.run([str(a) for a in args], check=True, env=env, **kw)


def env_python(name: str, folder: Path | None = None, packages: list[str] | None = None) -> Path:
    """The python of the environment `name` (folder WORK/name, ENVS[name]'s pins unless given), built when absent."""
    folder, packages = folder or WORK / name, packages or ENVS[name]
    py = folder / "bin" / "python"
    if not py.exists():
        log(f"building the {name} environment in {folder}: {' '.join(packages)}")
        sh("python3.11", "-m", "venv", folder)
        sh(py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *packages)
    return py


def build(model: str, new_tokens: int, optimum: bool = True) -> tuple[Path, Path]:
    """The original directory, and the folder holding every engine's model converted from it."""
    from toolkit.testing.tiny_families import SHAPES
    from toolkit.testing.tiny_t5 import SHAPES as T5_SHAPES

    if model in SHAPES or model in T5_SHAPES:
        marian = WORK / "models" / model / "hf"
        if not (marian / "config.json").exists():
            log(f"building the {model} directory")
            source = ("tiny_families", "random_original") if model in SHAPES else ("tiny_t5", "random_shape")
            sh(PY, "-c", f"from toolkit.testing.{source[0]} import {source[1]}; "
                         f"{source[1]}({model!r}, {str(marian)!r})", cwd=ROOT)
    elif model in ("tiny", "opus"):
        marian = WORK / "models" / ("tiny-trained" if model == "tiny" else model) / "marian"
        if not (marian / "config.json").exists():
            log(f"building the {model} Marian directory")
            fn = "build_tiny_marian(d, **TRAINED)" if model == "tiny" else "random_marian(d)"
            sh(PY, "-c", f"from toolkit.testing.tiny_marian import *; d = {str(marian)!r}; {fn}", cwd=ROOT)
    else:
        marian = Path(model)
    out = marian.parent
    ox = Path(PY).with_name("onnxformer")
    if not (out / "onnxformer-int8" / "manifest.json").exists():
        log("onnxformer: import, export, optimize (fp32 fused, int8)")
        sh(ox, "import", marian, "--out", out / "checkpoint", "--force")
        sh(ox, "export", out / "checkpoint", "--out", out / "onnxformer-export", "--force")
        sh(ox, "optimize", out / "onnxformer-export", "--out", out / "onnxformer-fp32", "--force")
        if model == "tiny":                   # the gate on texts like the model's own (held out from training)
            from toolkit.testing.tiny_marian import held_out
            (out / "gate-texts.txt").write_text("\n".join(held_out(64)) + "\n")
            gate = ["--input", out / "gate-texts.txt", "--samples", "64"]
        else:
            gate = ["--allow-unverified"]    # random weights: no token gate can pass (speed only)
        sh(ox, "optimize", out / "onnxformer-export", "--out", out / "onnxformer-int8", "--precision", "int8", "--force",
           *gate)
    ct2 = env_python("ct2")
    for name, extra in (("ct2-fp32", []), ("ct2-int8", ["--quantization", "int8"])):
        if not (out / name / "model.bin").exists():
            log(f"CTranslate2: convert ({name})")
            sh(ct2, "-m", "ctranslate2.converters.transformers", "--model", marian, "--output_dir", out / name,
               "--force", *extra)
    if optimum and not (out / "optimum" / "encoder_model.onnx").exists():
        log("Optimum: optimum-cli export onnx (text2text-generation-with-past)")
        sh(env_python("optimum"), "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", marian,
           "--task", "text2text-generation-with-past", out / "optimum")
    return marian, out


def inputs(marian: Path, n: int, src_len: int | None, spread: bool = False) -> list[list[int]]:
    """Source ids: the test corpus through MarianTokenizer's rules (tiny), or random pieces + EOS (opus), or
    random ids of the tokenizer's own pieces + EOS (the other families; `spread`: any id of the model's vocabulary,
    as a shortlist race needs sources as varied as real text's)."""
    import numpy as np

    if not (marian / "vocab.json").exists():
        config = json.loads((marian / "config.json").read_text())
        rng = np.random.default_rng(0)
        high = config["vocab_size"] - 1 if spread else 30
        return [rng.integers(4, high, size=src_len - 1).tolist() + [config["eos_token_id"]] for _ in range(n)]
    vocab = json.loads((marian / "vocab.json").read_text())
    if src_len is None:
        from runtime.tokenizer import load_tokenizer
        from toolkit.testing.tiny_marian import held_out
        tok = load_tokenizer(marian.parent / "checkpoint" / "tokenizer.json")
        return [tok.encode(t) for t in held_out(n)]
    rng = np.random.default_rng(0)
    return [rng.integers(2, vocab["<pad>"], size=src_len - 1).tolist() + [vocab["</s>"]] for _ in range(n)]


def shortlisted(out: Path, per_token: int, always: int) -> list[tuple[str, str, Path, dict]]:
    """The shortlist engines: onnxformer's fp32 and int8 bundles carrying one synthetic map (Marian's conventional
    sizes: `always` ids + `per_token` random candidates a source token; benchmarks/shortlist_speed.py), and
    CTranslate2's fp32 and int8 models with the same map as their vocabulary map (vmap.txt: `source<TAB>targets`,
    the empty source for the always-included ones), decoding with use_vmap."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from shortlist_speed import shortlisted_copy, synthetic_map
    from peer_worker import ct2_vocabulary

    config = json.loads((out / "onnxformer-fp32" / "manifest.json").read_text())["model"]
    vocab = config["vocab_size"]
    table = synthetic_map(config.get("src_vocab_size") or vocab, vocab, per_token, always)
    engines = []
    for precision in ("fp32", "int8"):
        target = out / f"onnxformer-{precision}-shortlist"
        if not (target / "manifest.json").exists():
            log(f"onnxformer {precision}: the synthetic shortlist ({per_token} a source token + {always})")
            shortlisted_copy(out / f"onnxformer-{precision}", target, table)
        engines.append((f"onnxformer {precision} + shortlist", PY, "onnxformer", target, {}))
    marian = out / "hf" if (out / "hf").exists() else out / "marian"
    for precision in ("fp32", "int8"):
        source, target = out / f"ct2-{precision}", out / f"ct2-{precision}-vmap"
        if not (target / "vmap.txt").exists():
            log(f"CTranslate2 {precision}: the same map as vmap.txt")
            target.mkdir(exist_ok=True)
            for f in source.iterdir():
                if not (target / f.name).exists():
                    os.link(f, target / f.name)
            pieces = {i: p for p, i in ct2_vocabulary(marian, source).items()}
            lines = ["\t" + " ".join(pieces[int(i)] for i in table.always if int(i) in pieces)]
            for src in range(len(table.offsets) - 1):
                cands = table.candidates[table.offsets[src]:table.offsets[src + 1]]
                if len(cands) and src in pieces:
                    lines.append(pieces[src] + "\t" + " ".join(pieces[int(t)] for t in cands if int(t) in pieces))
            (target / "vmap.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        extra = {"use_vmap": True, **({"compute_type": "int8"} if precision == "int8" else {})}
        engines.append((f"ctranslate2 {precision} + vmap", env_python("ct2"), "ctranslate2", target, extra))
    return engines


def folder_bytes(folder: Path) -> int:
    """The bytes of a model folder's files (the model file itself for a file)."""
    if folder.is_file():
        return folder.stat().st_size
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 32 (tiny), 64 (opus)")
    ap.add_argument("--src-len", type=int, default=None, help="random sources of this length (default for opus: 32)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the rows here too")
    ap.add_argument("--shortlist", type=int, default=0, metavar="PER_TOKEN",
                    help="also race onnxformer with a vocabulary shortlist against CTranslate2 with use_vmap, both on "
                         "one synthetic map of PER_TOKEN candidates a source token (75: Marian's usual); sources are "
                         "then drawn from the whole vocabulary")
    ap.add_argument("--always", type=int, default=100, help="with --shortlist: the always-included targets")
    ap.add_argument("--only", help="comma-separated engine labels to run (default: all)")
    ap.add_argument("--bundle", action="append", default=[], metavar="LABEL=DIR",
                    help="also race this onnxformer bundle (another optimize of the same export), as LABEL")
    ap.add_argument("--no-optimum", action="store_true", help="leave Optimum out (its export of the NLLB-600M "
                    "shape needs more than 13 GiB and a long time)")
    ap.add_argument("--no-reference", action="store_true", help="leave PyTorch eager out (\"= HF\" is then not "
                    "measured): size and peak on a machine too loaded for its threads")
    ap.add_argument("--build-only", action="store_true", help="convert every engine's model, then stop (the "
                    "conversions need no quiet machine; the timed run does)")
    args = ap.parse_args()
    args.error = ap.error
    return args


def engine_list(args: argparse.Namespace, marian: Path, out: Path) -> list[tuple]:
    """(label, python, engine, model folder, spec extras) for every engine this run races."""
    ct2 = env_python("ct2")
    opt = None if args.no_optimum else env_python("optimum")    # its environment only when it races
    engines = [(REFERENCE, ct2, "transformers", marian, {}),
               ("onnxformer fp32", PY, "onnxformer", out / "onnxformer-fp32", {}),
               ("onnxformer int8", PY, "onnxformer", out / "onnxformer-int8", {}),
               ("ctranslate2 fp32", ct2, "ctranslate2", out / "ct2-fp32", {}),
               ("ctranslate2 int8", ct2, "ctranslate2", out / "ct2-int8", {"compute_type": "int8"}),
               ("optimum (onnxruntime) fp32", opt, "optimum", out / "optimum", {})]
    for item in args.bundle:
        label, _, folder = item.partition("=")
        engines.append((label, PY, "onnxformer", Path(folder).absolute(), {}))
    if args.no_optimum:
        engines = [e for e in engines if e[2] != "optimum"]
    if args.no_reference:
        engines = [e for e in engines if e[2] != "transformers"]
    if args.shortlist:
        engines += shortlisted(out, args.shortlist, args.always)
    if args.only and not args.build_only:
        wanted = [w.strip() for w in args.only.split(",")]
        unknown = [w for w in wanted if w not in {e[0] for e in engines}]
        if unknown:
            args.error(f"--only: no engine labelled {', '.join(map(repr, unknown))}; the labels are: "
                       f"{', '.join(e[0] for e in engines)}")
        engines = [e for e in engines if e[0] in wanted or e[0] == REFERENCE]
    return engines


def run_engines(engines: list[tuple], spec: dict, out: Path, threads: int) -> dict[str, dict]:
    """Each engine in its own process under the bench lock; label -> the worker's result."""
    worker = ROOT / "benchmarks" / "peer_worker.py"
    results = {}
    for label, py, engine, model, extra in engines:
        log(f"{label}: {model}")
        f = out / f"race-{engine}-{Path(model).name}.json"
        ef = out / f"race-spec-{Path(model).name}.json"
        ef.write_text(json.dumps({**spec, **extra}))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
        sh("flock", LOCK, py, worker, engine, model, ef, f, env=env, cwd=ROOT)
        results[label] = json.loads(f.read_text())
    return results


def rows_of(results: dict[str, dict], new: int, speed: bool) -> list[dict]:
    """One row an engine: p50 times, tokens/s, agreement with PyTorch's sequences, model and peak MB."""
    ref = results[REFERENCE]["tokens"] if REFERENCE in results else None
    rows = []
    for label, r in results.items():
        same = sum(a == b for a, b in zip(ref, r["tokens"])) / len(ref) if ref else None
        row = {"engine": label, "sequences_equal_to_transformers": same,
               "distinct_reference_outputs": len({tuple(t) for t in ref}) if ref else None,
               "peak_rss_mb": r.get("peak_rss_mb"),
               "model_mb": folder_bytes(Path(r["model"])) / 1e6, "peak_rss_mb_by_phase": r.get("peak_rss_mb_by_phase")}
        for b, times in r["times"].items():
            p50 = statistics.median(times)
            row[f"batch {b} ms"] = p50 * 1000
            row[f"batch {b} tokens/s"] = int(b) * new / p50 if speed else None
        rows.append(row)
    return rows


def print_table(rows: list[dict], sizes: list[int], speed: bool) -> None:
    head = f"{'engine':<28} " + " ".join(f"{'b' + str(b) + ' ms':>10}" for b in sizes) + \
        (" " + " ".join(f"{'b' + str(b) + ' tok/s':>11}" for b in sizes) if speed else "") + f" {'= HF':>7}" + \
        f" {'model MB':>9} {'peak MB':>8} {'peak b' + str(sizes[0]):>8}"
    print(head)
    for row in rows:
        line = f"{row['engine']:<28} " + " ".join(f"{row[f'batch {b} ms']:>10.1f}" for b in sizes)
        if speed:
            line += " " + " ".join(f"{row[f'batch {b} tokens/s']:>11.0f}" for b in sizes)
        first = (row["peak_rss_mb_by_phase"] or {}).get(f"batch {sizes[0]}", float("nan"))
        same = row["sequences_equal_to_transformers"]
        print(line + f" {'-' if same is None else f'{same:.1%}':>7} {row['model_mb']:>9.1f} "
              f"{row['peak_rss_mb']:>8.0f} {first:>8.0f}")


def main() -> None:
    args = parse_args()
    speed = args.model != "tiny"
    new = args.new_tokens or (64 if speed else 32)
    src_len = args.src_len or (32 if speed else None)
    marian, out = build(args.model, new, optimum=not args.no_optimum)
    spec = {"marian": str(marian), "inputs": inputs(marian, args.samples, src_len, spread=args.shortlist > 0),
            "batch_sizes": [int(b) for b in args.batch_sizes.split(",")], "beam": args.beam, "max_new_tokens": new,
            "min_new_tokens": new if speed else 0, "threads": args.threads, "repeat": args.repeat, "warmup": 1}
    (out / "race-inputs.json").write_text(json.dumps(spec))
    engines = engine_list(args, marian, out)
    if args.build_only:
        log(f"built: {', '.join(str(e[3]) for e in engines)}")
        return
    load = os.getloadavg()
    rows = rows_of(run_engines(engines, spec, out, args.threads), new, speed)
    print(f"model {marian} ({'speed: exactly' if speed else 'tokens: at most'} {new} new tokens, beam {args.beam}, "
          f"{args.threads} threads, {args.repeat} rounds; load average before: {load[0]:.2f})")
    print_table(rows, spec["batch_sizes"], speed)
    distinct = rows[0]["distinct_reference_outputs"]
    count = "not run" if distinct is None else f"{distinct} distinct of {len(spec['inputs'])}"
    print(f"reference outputs: {count}; "
          f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
