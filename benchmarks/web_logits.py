"""Why the page's ids differ from the runtime's: the same bundle's logits on onnxruntime-web's WASM build (in Node,
one thread, fed as the page feeds) against the native CPU EP's, step by step along the runtime's own greedy
outputs, beside each step's top-1 margin; and the page's own search (its onnxformer.js in Node) on WASM and, with
--ort-node, on the native kernels, against runtime.Translator's ids.

    .venv/bin/python benchmarks/web_logits.py BUNDLE [--texts 32] [--tgt-lang deu_Latn] [--max-new 24]
        [--ort-node DIR] [--json FILE]

Inputs: the first --texts of toolkit.testing.tiny_families.held_out (the tiny NLLB's and mBART's sentences).
Reported: the largest |logit difference| WASM - native over the steps the runtime scored, the steps over 1e-3,
the smallest top-1 - top-2 margin (native), the steps whose margin is under twice their difference, the steps
whose argmax differs (first per input, with its margin); the encoders' largest cross key/value difference.
--ort-node: the folder of an onnxruntime-node package of onnxruntime-web's version (npm install --ignore-scripts
onnxruntime-node@VERSION in a scratch folder; its CPU binding ships in the package). Needs node and
toolkit/apps/web's node_modules (npm ci).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
IN_NODE = ROOT / "benchmarks" / "web" / "in_node.mjs"


def node(*args: str) -> str:
    done = subprocess.run(["node", str(IN_NODE), *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"node {IN_NODE.name} {args[0]} failed: {done.stderr.strip()[-800:]}")
    return done.stdout


def wasm_logits(bundle: Path, jobs: list[dict]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "jobs.json").write_text(json.dumps(jobs))
        node("logits", str(bundle), str(Path(tmp) / "jobs.json"), str(Path(tmp) / "out.json"))
        runs = json.loads((Path(tmp) / "out.json").read_text())
    return [{"cross": [np.array(x, np.float32) for x in r["cross"]], "logits": np.array(r["logits"], np.float32)}
            for r in runs]


def native_logits(bundle: Path, jobs: list[dict]) -> list[dict]:
    """The same feeds on the native CPU EP (one thread), as in_node.mjs builds them."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    c, opts = manifest["model"], ort.SessionOptions()
    opts.intra_op_num_threads = 1
    enc, dec = (ort.InferenceSession(str(bundle / manifest["graphs"][g]["file"]), opts,
                                     providers=["CPUExecutionProvider"]) for g in ("encoder", "decoder"))
    dynamic, heads = manifest.get("decoder_layout", "dynamic") == "dynamic", c["n_heads"]
    shared = manifest.get("decoder_layout") == "static-shared"
    head_dim = c.get("d_kv") or c["d_model"] // heads
    names = lambda kind, side: [f"{kind}.{i}.{side}.{kv}" for i in range(c["n_decoder_layers"])  # noqa: E731
                                for kv in ("key", "value")]
    enc_out, dec_out, runs = [o.name for o in enc.get_outputs()], [o.name for o in dec.get_outputs()], []
    for job in jobs:
        src = np.array([job["src"]], np.int64)
        cross = dict(zip(enc_out, enc.run(None, {"input_ids": src, "attention_mask": np.ones_like(src)})))
        cross = [cross[n] for n in names("present", "encoder")]
        cache = [np.zeros((1, heads, 0 if dynamic else job["capacity"], head_dim), np.float32)] * len(cross)
        steps = []
        for p, token in enumerate([c["bos_id"], *job["tokens"]]):
            feeds = {"input_ids": np.array([[token]], np.int64), "position_ids": np.array([[p]], np.int64),
                     "encoder_attention_mask": np.ones_like(src)}
            if dynamic:
                feeds["decoder_attention_mask"] = np.ones((1, p), np.int64)
            else:                                   # static-shared also takes the key mask over its buffer
                feeds["past_sequence_length"] = np.array([p], np.int32)
                if shared:
                    feeds["decoder_attention_mask"] = np.ones((1, job["capacity"]), np.int64)
            feeds |= dict(zip(names("past_key_values", "decoder"), cache))
            feeds |= dict(zip(names("past_key_values", "encoder"), cross))
            out = dict(zip(dec_out, dec.run(None, feeds)))
            cache = [out[n] for n in names("present", "decoder")]
            steps.append(out["logits"].reshape(-1))
        runs.append({"cross": [x.ravel() for x in cross], "logits": np.array(steps)})
    return runs


def compare(bundle: Path, texts: list[str], tgt_lang: str | None, max_new: int) -> dict:
    """Teacher-forced along the runtime's greedy ids: WASM - native logits and the margins, per scored step."""
    from runtime.api import Translator

    translator = Translator(bundle, provider="cpu")
    tok, langs = translator.tokenizer, {"tgt_lang": tgt_lang} if tgt_lang else {}
    lead = len((tok.target_start_ids(tgt_lang) or []) if hasattr(tok, "target_start_ids") else [])
    hyps = [r.hypotheses[0].ids for r in translator.generate(texts, batch_size=1, max_new_tokens=max_new, **langs)]
    jobs = [{"src": tok.encode(t), "tokens": h, "capacity": max_new + lead} for t, h in zip(texts, hyps)]
    web, native = wasm_logits(bundle, jobs), native_logits(bundle, jobs)
    diffs, margins, flips = [], [], []
    for i, (w, n, h) in enumerate(zip(web, native, hyps)):
        wl, nl = w["logits"][lead:len(h) + 1], n["logits"][lead:len(h) + 1]   # the scored steps (EOS's too)
        d, top = np.abs(wl - nl).max(axis=1), np.sort(nl, axis=1)
        diffs.append(d)
        margins.append(top[:, -1] - top[:, -2])
        flipped = np.flatnonzero(wl.argmax(axis=1) != nl.argmax(axis=1))
        if flipped.size:
            s = int(flipped[0])
            flips.append({"input": i, "step": s, "native": int(nl[s].argmax()), "wasm": int(wl[s].argmax()),
                          "margin": float(margins[-1][s]), "difference": float(d[s])})
    d, m = np.concatenate(diffs), np.concatenate(margins)
    cross = max(float(np.abs(a - b).max()) for w, n in zip(web, native) for a, b in zip(w["cross"], n["cross"]))
    return {"bundle": str(bundle), "inputs": len(texts), "distinct_outputs": len({tuple(h) for h in hyps}),
            "scored_steps": int(d.size), "max_logit_difference": float(d.max()),
            "steps_over_1e-3": int((d > 1e-3).sum()), "min_margin": float(m.min()),
            "median_margin": float(np.median(m)),
            "steps_margin_under_2x_difference": int((m < 2 * d).sum()), "argmax_flips": flips,
            "max_cross_difference": cross}


def page_search(bundle: Path, texts: list[str], tgt_lang: str | None, max_new: int, ort_node: str | None) -> dict:
    """The page's onnxformer.js in Node (WASM, or native with ort_node): inputs whose ids equal the runtime's."""
    from runtime.api import Translator
    from toolkit.apps.web import site as web

    beams, langs = (1, 4), {"tgt_lang": tgt_lang} if tgt_lang else {}
    translator, result = Translator(bundle, provider="cpu"), {}
    with tempfile.TemporaryDirectory() as tmp:
        site = web.write_site(bundle, Path(tmp) / "site")
        requests = [{"texts": texts, "beam": b, "maxNewTokens": max_new, **({"tgtLang": tgt_lang} if tgt_lang else {})}
                    for b in beams]
        (Path(tmp) / "requests.json").write_text(json.dumps(requests))
        for kernels, extra in (("wasm", []), ("native", [ort_node] if ort_node else None)):
            if extra is None:
                continue
            answers = json.loads(node("page", str(site), str(Path(tmp) / "requests.json"), *extra))["answers"]
            for beam, got in zip(beams, answers):
                want = [r.hypotheses[0].ids for r in translator.generate(texts, batch_size=1, beam=beam,
                                                                          max_new_tokens=max_new, **langs)]
                result[f"{kernels} beam {beam}"] = [i for i, (a, w) in enumerate(zip(got, want)) if a["ids"] != w]
    return result


def main() -> None:
    from toolkit.testing.tiny_families import held_out

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--texts", type=int, default=32)
    ap.add_argument("--tgt-lang", default=None)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--ort-node", default=None, help="an onnxruntime-node package folder: the page's search on it")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    texts = held_out(args.texts)
    report = compare(args.bundle, texts, args.tgt_lang, args.max_new)
    report["page_inputs_differing"] = page_search(args.bundle, texts, args.tgt_lang, args.max_new, args.ort_node)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
