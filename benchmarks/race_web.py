"""Race the onnxformer page (`onnxformer web`) against transformers.js in one headless Chromium: the same random
Marian directory feeds our importer and Optimum's exporter; both pages run greedy search on the WASM execution
provider with the same thread count, on the same source ids, for exactly --new-tokens new tokens (EOS suppressed
until then on both sides), batch 1; each page's downloaded bytes are counted.

    .venv/bin/python benchmarks/race_web.py [--shape tiny|small|opus] [--threads 1] [--new-tokens 32]
        [--sentences 5] [--rounds 3] [--build-only] [--json FILE]

Shapes (random weights, toolkit.testing.tiny_marian.random_marian): "opus" opus-mt-en-de's (d_model 512, 6 + 6
layers, 8 heads, FFN 2048, 58,101 tokens), "small" (256, 3 + 3, 4 heads, FFN 1024, 8,000 tokens), "tiny" (32,
2 + 2, 4 heads, FFN 64, 600 tokens: a quick check of the harness). Ours: onnxformer import, export, optimize
--target wasm (fp32; int8 --recipe default --allow-unverified: random weights pass no token gate), onnxformer
web; --cpu-int8 adds the int8 bundle made for --target cpu. The peer: a venv out/peers-web (optimum-onnx
0.1 with its transformers 4.57 and onnxruntime, torch 2.13) runs `optimum-cli export onnx --task
text2text-generation-with-past`, its graphs then quantized as transformers.js' q8 files are (dynamic, int8
weights, subgraphs too) into onnx/*_quantized.onnx; its page (benchmarks/web/peer.html) loads
@huggingface/transformers (benchmarks/web/package.json, npm ci) from its own folder with remote models off.
Ids go in on both sides (no tokenizer runs in the timed part): random pieces of the vocabulary + EOS.
Timed: each page's whole generate (encoder and every decoder step) per sentence, in the page (performance.now);
the pages take turns, round by round, after a warm-up round; tokens/s is the p50 over rounds x sentences.
Bytes: every response body the page received (Playwright's request sizes), and what the local server sent.
Our side needs the page to load a SentencePiece (Marian) bundle: `onnxformer web` refuses one until the page's
Marian tokenizer lands (branch wt-webtok); no tokenizer runs in the race itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORK = Path(os.environ.get("ONNXFORMER_WEB_RACE") or ROOT / "out" / "web-race").absolute()
PEERS = ROOT / "out" / "peers-web"
PEER_PACKAGES = ["torch==2.13.0", "optimum-onnx[onnxruntime]==0.1.0", "sentencepiece", "accelerate"]
WEB = ROOT / "benchmarks" / "web"
PY = sys.executable
LOCK = "/tmp/onnxformer-bench.lock"
SHAPES = {
    "opus": dict(vocab_size=58101),
    "small": dict(vocab_size=8000, d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024),
    "tiny": dict(vocab_size=600, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128),
}
# transformers.js' own (WASM) build of onnxruntime-web: the files its page loads, from its pinned dependency
PEER_ORT = ("ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")


def log(msg: str) -> None:
    print(f"==> {msg}", file=sys.stderr, flush=True)


def sh(*args, **kw) -> None:
    subprocess.run([str(a) for a in args], check=True, **kw)


def peer_python() -> Path:
    py = PEERS / "bin" / "python"
    if not py.exists():
        log(f"building the peer environment {PEERS}: {' '.join(PEER_PACKAGES)}")
        sh("python3.11", "-m", "venv", PEERS)
        sh(py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *PEER_PACKAGES)
    return py


def npm_ci(folder: Path, marker: Path) -> None:
    if not marker.exists():
        log(f"npm ci in {folder}")
        sh("npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", cwd=folder)


def build_ours(marian: Path, out: Path) -> dict[str, Path]:
    """Our two sites (fp32, int8) from the Marian directory, through the command line (each step once)."""
    ox = Path(PY).with_name("onnxformer")
    # random weights pass no token gate, so auto's pick among the int8 recipes would mean nothing: the default one
    # (per-tensor activation ranges), as the peer's q8 files have
    int8 = ("--precision", "int8", "--recipe", "default", "--allow-unverified")
    steps = [("checkpoint", "import", marian), ("export", "export", out / "checkpoint"),
             ("bundle-fp32", "optimize", out / "export", "--target", "wasm"),
             ("bundle-int8", "optimize", out / "export", "--target", "wasm", *int8),
             ("bundle-int8-cpu", "optimize", out / "export", "--target", "cpu", *int8)]
    steps += [(f"site-{p}", "web", out / f"bundle-{p}") for p in ("fp32", "int8", "int8-cpu")]
    for name, command, *rest in steps:
        if not (out / name).is_dir():
            log(f"onnxformer {command} -> {out / name}")
            sh(ox, command, *rest, "--out", out / name)
    return {p: out / f"site-{p}" for p in ("fp32", "int8", "int8-cpu")}


QUANTIZE = """
import sys
from onnxruntime.quantization import QuantType, quantize_dynamic
for name in ("encoder_model", "decoder_model_merged"):
    # transformers.js' scripts/quantize.py, mode q8 without Conv: dynamic, QInt8 weights, per tensor, full range,
    # every integer-op kind, inside the merged decoder's If branches too
    quantize_dynamic(f"{sys.argv[1]}/{name}.onnx", f"{sys.argv[1]}/{name}_quantized.onnx", per_channel=False,
                     reduce_range=False, weight_type=QuantType.QInt8,
                     extra_options={"EnableSubgraph": True, "MatMulConstBOnly": True})
"""


def build_peer(marian: Path, out: Path) -> Path:
    """transformers.js' site: its page, its library and runtime, and models/marian (Optimum's export, q8 too)."""
    site = out / "site-peer"
    onnx = site / "models" / "marian" / "onnx"
    npm_ci(WEB, WEB / "node_modules" / "@huggingface" / "transformers" / "dist" / "transformers.min.js")
    if not (onnx / "decoder_model_merged_quantized.onnx").exists():
        py, export = peer_python(), out / "optimum"
        if not (export / "decoder_model_merged.onnx").exists():
            log("Optimum: optimum-cli export onnx --task text2text-generation-with-past")
            sh(py, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", marian, "--task",
               "text2text-generation-with-past", export)
        onnx.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "generation_config.json"):
            shutil.copy2(export / name, onnx.parent / name)
        for f in export.iterdir():
            if f.name.startswith(("encoder_model.onnx", "decoder_model_merged.onnx")):
                shutil.copy2(f, onnx / f.name)
        log("quantizing Optimum's graphs as transformers.js' q8 files")
        sh(py, "-c", QUANTIZE, onnx)
    dist = WEB / "node_modules" / "@huggingface" / "transformers" / "dist"
    ort = WEB / "node_modules" / "onnxruntime-web" / "dist"
    for src in (WEB / "peer.html", WEB / "peer.js", dist / "transformers.min.js", *(ort / f for f in PEER_ORT)):
        shutil.copy2(src, site / src.name)
    return site


def build(shape: str) -> tuple[Path, dict[str, Path]]:
    """The Marian directory of `shape` and every site: ours fp32 / int8 and the peer's."""
    from toolkit.testing.tiny_marian import random_marian

    out = WORK / shape
    marian = out / "marian"
    if not (marian / "config.json").exists():
        log(f"building the {shape} Marian directory (random weights)")
        random_marian(marian, **SHAPES[shape])
    sites = build_ours(marian, out)
    sites["peer"] = build_peer(marian, out)
    return marian, sites


def serve(site: Path) -> tuple[str, dict]:
    """Serve `site` on a free port (COOP/COEP as onnxformer web --serve); its origin, and the body bytes sent."""
    import functools
    import http.server

    from toolkit.apps.web.site import _Handler

    sent = {"bytes": 0, "missing": []}

    class Counting(_Handler):
        def send_header(self, keyword, value):
            if keyword == "Content-Length":
                sent["bytes"] += int(value)
            super().send_header(keyword, value)

        def send_error(self, code, *args, **kw):
            sent["missing"].append(f"{code} {self.path}")
            super().send_error(code, *args, **kw)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Counting, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", sent


def sources(marian: Path, n: int, length: int) -> list[list[int]]:
    """n random source sequences of `length` ids: pieces of the vocabulary (not the specials), then EOS."""
    import numpy as np

    config = json.loads((marian / "config.json").read_text())
    rng = np.random.default_rng(0)
    return [rng.integers(2, config["pad_token_id"], size=length - 1).tolist() + [config["eos_token_id"]]
            for _ in range(n)]


def race(sites: dict[str, Path], srcs: list[list[int]], new: int, threads: int, rounds: int,
         cpu_int8: bool) -> dict:
    """Every page in one Chromium (benchmarks/web/race.mjs, under the bench lock): label -> its results."""
    pages, served = [], {}
    for label, site, page, api, query in (
            ("onnxformer fp32", sites["fp32"], "index.html", "onnxformer", ""),
            ("transformers.js fp32", sites["peer"], "peer.html", "peer", "&dtype=fp32"),
            ("onnxformer int8", sites["int8"], "index.html", "onnxformer", ""),
            ("transformers.js q8", sites["peer"], "peer.html", "peer", "&dtype=q8"),
            *([("onnxformer int8 --target cpu", sites["int8-cpu"], "index.html", "onnxformer", "")] if cpu_int8
              else [])):
        origin, served[label] = serve(site)           # one origin a page: its requests are its own
        pages.append({"label": label, "url": f"{origin}/{page}?threads={threads}{query}", "api": api})
    config = WORK / "race-config.json"
    config.write_text(json.dumps({"pages": pages, "sources": srcs, "maxNewTokens": new, "minNewTokens": new,
                                  "rounds": rounds}))
    out = WORK / "race-out.json"
    sh("flock", LOCK, "node", WEB / "race.mjs", config, out, cwd=WEB)
    results = json.loads(out.read_text())
    for label, r in results.items():
        r["served_bytes"], r["missing"] = served[label]["bytes"], served[label]["missing"]
    return results


def rows_of(results: dict, new: int) -> list[dict]:
    """One row a page: p50 tokens/s over rounds x sources, bytes, and its ids against the other side's."""
    rows = []
    for label, r in results.items():
        times = [ms for per_round in r["ms"] for ms in per_round]
        lengths = {len(ids) for ids in r["ids"]}
        if lengths != {new}:
            raise SystemExit(f"{label} gave {sorted(lengths)} new tokens, not exactly {new}")
        rows.append({"page": label, "tokens/s p50": new / (statistics.median(times) / 1000),
                     "ms p50": statistics.median(times), "ms min": min(times), "ms max": max(times),
                     "page bytes": r["bytes"], "served bytes": r["served_bytes"], "requests": len(r["requests"]),
                     "load ms": r["loadMs"], "crossOriginIsolated": r["crossOriginIsolated"],
                     "missing": r["missing"], "ids": r["ids"]})
    for ours, peer in (("onnxformer fp32", "transformers.js fp32"), ("onnxformer int8", "transformers.js q8"),
                       ("onnxformer int8 --target cpu", "transformers.js q8")):
        a, b = next((x for x in rows if x["page"] == ours), None), next(x for x in rows if x["page"] == peer)
        if a is None:
            continue
        a["speed vs peer"] = a["tokens/s p50"] / b["tokens/s p50"]
        a["bytes vs peer"] = a["page bytes"] / b["page bytes"]
        a["ids equal to peer"] = sum(x == y for x, y in zip(a["ids"], b["ids"])) / len(a["ids"])
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'page':<29} {'tok/s p50':>9} {'ms p50':>8} {'x peer':>7} {'MB down':>8} {'x peer':>7} "
          f"{'ids = peer':>10} {'load s':>7}")
    for r in rows:
        ratio = (f"{r['speed vs peer']:>7.2f}", f"{r['bytes vs peer']:>7.2f}", f"{r['ids equal to peer']:>10.0%}") \
            if "speed vs peer" in r else (f"{'':>7}", f"{'':>7}", f"{'':>10}")
        print(f"{r['page']:<29} {r['tokens/s p50']:>9.1f} {r['ms p50']:>8.1f} {ratio[0]} {r['page bytes'] / 1e6:>8.2f} "
              f"{ratio[1]} {ratio[2]} {r['load ms'] / 1000:>7.1f}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--threads", type=int, default=1, help="WASM threads, both pages")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--src-len", type=int, default=16, help="source ids a sentence, EOS included")
    ap.add_argument("--sentences", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-int8", action="store_true", help="also race our int8 bundle made for --target cpu (its "
                    "projection as sliced QGemms over the tied table, which the WASM build runs slowly)")
    ap.add_argument("--build-only", action="store_true", help="build the sites, then stop")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    marian, sites = build(args.shape)
    if args.build_only:
        log(f"built: {', '.join(map(str, sites.values()))}")
        return
    srcs = sources(marian, args.sentences, args.src_len)
    load = os.getloadavg()
    rows = rows_of(race(sites, srcs, args.new_tokens, args.threads, args.rounds, args.cpu_int8), args.new_tokens)
    print(f"shape {args.shape} ({marian}); batch 1, greedy, exactly {args.new_tokens} new tokens from {args.src_len} "
          f"source ids, {args.sentences} sentences x {args.rounds} rounds after a warm-up, {args.threads} WASM "
          f"threads; load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print_table(rows)
    for r in rows:
        if r["missing"] or not r["crossOriginIsolated"]:
            print(f"  {r['page']}: not found {r['missing']}, crossOriginIsolated {r['crossOriginIsolated']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
