"""Race onnxformer's Whisper bundles against faster-whisper (CTranslate2) on identical random weights: one
WhisperForConditionalGeneration directory of a real shape feeds our importer and CTranslate2's converter; each engine
then runs in its own process, under the bench lock, with the same threads:

    .venv/bin/python benchmarks/race_whisper.py [--shape tiny|base|small] [--threads 2] [--build-only]

Three timings an engine (p50 of --repeat after one warm-up): the encoder on one 30 s window; a decode of exactly 64
tokens from the transcribe prompt over that encoder output (the end token suppressed / ignored); a whole transcribe of
a 60 s clip (seeded noise: greedy, temperature 0 only, no fallback, no no-speech skip, no timestamps, no VAD, the
same --max-new-tokens a window). Random weights decode garbage of their own length, so the tokens each engine
decoded in the transcribe are reported beside its time. Also the model folder's size and the worker's peak RSS.

The directory's vocabulary is Whisper's 51,865 rows: tiny_whisper's byte-level BPE text tokens padded with
placeholder tokens to 50,353 text ids, then the 11 special tokens (three languages) and the 1501 timestamp tokens,
so every shape (embedding, head, softmax) is the real model's. faster-whisper runs from a venv of its own
(out/peers-whisper, or $ONNXFORMER_WHISPER_PEERS: faster-whisper, ctranslate2, transformers 5, torch).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "out" / "race-whisper"
PEERS = Path(os.environ.get("ONNXFORMER_WHISPER_PEERS") or ROOT / "out" / "peers-whisper").absolute()
LOCK = "/tmp/onnxformer-bench.lock"
VOCAB = 51865
SHAPES = {"tiny": dict(d_model=384, encoder_layers=4, decoder_layers=4, heads=6, ffn=1536),
          "base": dict(d_model=512, encoder_layers=6, decoder_layers=6, heads=8, ffn=2048),
          "small": dict(d_model=768, encoder_layers=12, decoder_layers=12, heads=12, ffn=3072)}
NEW_TOKENS = 64


def log(msg: str) -> None:
    print(f"==> {msg}", file=sys.stderr, flush=True)


def sh(*args, **kw) -> None:
    subprocess.run([str(a) for a in args], check=True, **kw)


def padded_tokenizer(directory: Path) -> dict[str, int]:
    """tiny_whisper's tokenizer.json rewritten with Whisper's layout at its real size: placeholder text pieces after
    the trained ones up to 50,353 text ids, the specials next, the 1501 timestamps last (51,865 in all)."""
    from toolkit.testing.tiny_whisper import SPECIALS, TIMESTAMPS, byte_bpe

    byte_bpe(directory, timestamps=False)
    data = json.loads((directory / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    text = VOCAB - len(SPECIALS) - len(TIMESTAMPS)
    for i in range(len(vocab), text):
        vocab[f"<placeholder{i}>"] = i           # no merge reaches them: decodable, never produced by encode
    added = [{"id": text + k, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": k >= len(SPECIALS), "special": k < len(SPECIALS)}
             for k, t in enumerate((*SPECIALS, *TIMESTAMPS))]
    data["added_tokens"] = added
    (directory / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    ids = {a["content"]: a["id"] for a in added[:len(SPECIALS)]}
    return ids | {"vocab_size": VOCAB, "space": vocab["Ġ"]}


def build_directory(shape: str, directory: Path) -> None:
    """A random WhisperForConditionalGeneration of the shape (transformers' init), its generation config, the
    padded tokenizer and a preprocessor_config.json (faster-whisper reads it), saved to directory."""
    import torch
    import transformers

    from toolkit.testing.tiny_whisper import generation_config

    s = SHAPES[shape]
    directory.mkdir(parents=True, exist_ok=True)
    ids = padded_tokenizer(directory)
    gen = generation_config(ids) | {"max_length": 448}
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=s["d_model"], encoder_layers=s["encoder_layers"],
        decoder_layers=s["decoder_layers"], encoder_attention_heads=s["heads"], decoder_attention_heads=s["heads"],
        encoder_ffn_dim=s["ffn"], decoder_ffn_dim=s["ffn"], num_mel_bins=80, max_source_positions=1500,
        max_target_positions=448, dropout=0.0, pad_token_id=gen["pad_token_id"], bos_token_id=gen["bos_token_id"],
        eos_token_id=gen["eos_token_id"], decoder_start_token_id=gen["decoder_start_token_id"],
        suppress_tokens=gen["suppress_tokens"], begin_suppress_tokens=gen["begin_suppress_tokens"])
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    model.generation_config = transformers.GenerationConfig(**gen)
    model.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2))
    transformers.WhisperFeatureExtractor(feature_size=80).save_pretrained(directory)


def build(shape: str) -> Path:
    """The shape's folder: hf/ (the original), onnxformer-fp32/-int8 bundles, ct2-fp32/-int8 models."""
    out = WORK / shape
    hf = out / "hf"
    if not (hf / "config.json").exists():
        log(f"building the random {shape} Whisper directory")
        build_directory(shape, hf)
    ox = Path(sys.executable).with_name("onnxformer")
    steps = [("checkpoint", ["import", hf, "--out", out / "checkpoint"]),
             ("onnxformer-export", ["export", out / "checkpoint", "--out", out / "onnxformer-export"]),
             ("onnxformer-fp32", ["optimize", out / "onnxformer-export", "--out", out / "onnxformer-fp32"]),
             # random weights pass no token gate: the default recipe written unverified, its gate on few inputs
             # (auto would try every recipe, each failing, at minutes apiece on the small shape)
             ("onnxformer-int8", ["optimize", out / "onnxformer-export", "--out", out / "onnxformer-int8",
                                  "--precision", "int8", "--recipe", "default", "--samples", "8",
                                  "--allow-unverified"])]
    for folder, cmd in steps:
        if not (out / folder / ("config.json" if folder == "checkpoint" else "manifest.json")).exists():
            log(f"onnxformer {cmd[0]} -> {folder}")
            sh(ox, *cmd, "--force")
    for name, extra in (("ct2-fp32", []), ("ct2-int8", ["--quantization", "int8"])):
        if not (out / name / "model.bin").exists():
            log(f"CTranslate2: ct2-transformers-converter ({name})")
            sh(PEERS / "bin" / "ct2-transformers-converter", "--model", hf, "--output_dir", out / name, "--force",
               "--copy_files", "tokenizer.json", "preprocessor_config.json", *extra)
    return out


def timed(fn, repeat: int) -> tuple[float, list[float], object]:
    """(p50 seconds, every round, the last result) of fn() over `repeat` rounds after one warm-up."""
    fn()
    rounds, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        rounds.append(time.perf_counter() - start)
    return statistics.median(rounds), rounds, result


def inputs(seconds: int):
    """(features [80, 3000] of a 30 s window, 60 s of 16 kHz samples): seeded noise, the same for every engine."""
    import numpy as np

    rng = np.random.default_rng(0)
    features = rng.standard_normal((80, 3000)).astype(np.float32) * 0.5
    samples = (rng.standard_normal(seconds * 16000) * 0.1).astype(np.float32)
    return features, samples


def onnxformer_worker(model: str, spec: dict) -> dict:
    """Our bundle: Transcriber.encode, generate over its output (64 tokens, EOS ignored), Transcriber.transcribe."""
    import dataclasses

    from runtime.generate import generate
    from runtime.request import Request
    from runtime.transcribe import Transcriber

    tr = Transcriber(model, provider="cpu", threads=spec["threads"])
    features, samples = inputs(spec["seconds"])
    prompt = tr.prompt("en", "transcribe", False)
    enc_s, enc_r, encoded = timed(lambda: tr.encode(features[None]), spec["repeat"])
    opts = dataclasses.replace(tr.options(prompt, False, max_new_tokens=NEW_TOKENS), ignore_eos=True)
    request = Request.build(tr.engine, [features], None, opts)

    def decode():
        return generate(tr.engine, request, encoded=encoded)[0][0].tokens[len(prompt):]
    dec_s, dec_r, tokens = timed(decode, spec["repeat"])

    def transcribe():
        return tr.transcribe(samples, language="en", beam=1, temperatures=(0.0,), compression_ratio_threshold=None,
                             logprob_threshold=None, no_speech_threshold=None, max_new_tokens=spec["max_new_tokens"])
    tx_s, tx_r, result = timed(transcribe, spec["repeat"])
    decoded = sum(len(s.tokens) for s in result.segments)
    return {"encode": [enc_s, enc_r], "decode": [dec_s, dec_r], "decode_tokens": len(tokens),
            "transcribe": [tx_s, tx_r], "transcribe_tokens": decoded, "windows": len(result.segments)}


def faster_whisper_worker(model: str, spec: dict) -> dict:
    """faster-whisper: model.model.encode, model.model.generate (64 tokens, the end token suppressed), transcribe."""
    import ctranslate2
    import numpy as np
    from faster_whisper import WhisperModel
    from faster_whisper.tokenizer import Tokenizer

    wm = WhisperModel(model, device="cpu", compute_type=spec["compute_type"], cpu_threads=spec["threads"],
                      num_workers=1)
    features, samples = inputs(spec["seconds"])
    tok = Tokenizer(wm.hf_tokenizer, wm.model.is_multilingual, task="transcribe", language="en")
    prompt = [*tok.sot_sequence, tok.no_timestamps]
    view = ctranslate2.StorageView.from_array(np.ascontiguousarray(features[None]))
    enc_s, enc_r, encoded = timed(lambda: wm.model.encode(view, to_cpu=False), spec["repeat"])

    def decode():
        return wm.model.generate(encoded, [prompt], beam_size=1, max_length=len(prompt) + NEW_TOKENS,
                                 suppress_tokens=[tok.eot], suppress_blank=False,
                                 return_no_speech_prob=False)[0].sequences_ids[0]
    dec_s, dec_r, tokens = timed(decode, spec["repeat"])

    def transcribe():
        segments, _ = wm.transcribe(samples, language="en", beam_size=1, temperature=0.0,
                                    condition_on_previous_text=False, without_timestamps=True, vad_filter=False,
                                    compression_ratio_threshold=None, log_prob_threshold=None,
                                    no_speech_threshold=None, max_new_tokens=spec["max_new_tokens"])
        return list(segments)
    tx_s, tx_r, segments = timed(transcribe, spec["repeat"])
    return {"encode": [enc_s, enc_r], "decode": [dec_s, dec_r], "decode_tokens": len(tokens),
            "transcribe": [tx_s, tx_r], "transcribe_tokens": sum(len(s.tokens) for s in segments),
            "windows": len(segments)}


def worker(engine: str, model: str, spec_file: str, out_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    fn = onnxformer_worker if engine == "onnxformer" else faster_whisper_worker
    result = fn(model, spec)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out_file).write_text(json.dumps(result))


def folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


def run_engines(out: Path, args: argparse.Namespace) -> dict[str, dict]:
    """Each engine in its own process (nice 10, the bench lock); label -> its result and model MB."""
    engines = [("onnxformer fp32", sys.executable, "onnxformer", out / "onnxformer-fp32", "float32"),
               ("faster-whisper fp32", PEERS / "bin" / "python", "faster-whisper", out / "ct2-fp32", "float32"),
               ("onnxformer int8", sys.executable, "onnxformer", out / "onnxformer-int8", "int8"),
               ("faster-whisper int8", PEERS / "bin" / "python", "faster-whisper", out / "ct2-int8", "int8")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    results = {}
    for label, py, engine, model, compute in engines:
        log(f"{label}: {model}")
        spec = {"threads": args.threads, "repeat": args.repeat, "seconds": args.seconds, "compute_type": compute,
                "max_new_tokens": args.max_new_tokens}
        spec_file, out_file = out / f"spec-{model.name}.json", out / f"result-{model.name}.json"
        spec_file.write_text(json.dumps(spec))
        sh("flock", LOCK, "nice", "-n", "10", py, Path(__file__).resolve(), "--worker", engine, model, spec_file,
           out_file, env=env, cwd=ROOT)
        results[label] = json.loads(out_file.read_text()) | {"model_mb": folder_mb(model)}
    return results


def table(results: dict[str, dict], args: argparse.Namespace) -> str:
    head = (f"| engine | encoder 30 s (ms) | decode {NEW_TOKENS} tokens (ms) | transcribe {args.seconds} s (s) "
            f"| transcribe tokens (windows) | model MB | peak RSS MB |")
    lines = [head, "|" + "---|" * 7]
    for label, r in results.items():
        lines.append(f"| {label} | {r['encode'][0] * 1000:.0f} | {r['decode'][0] * 1000:.0f} "
                     f"({r['decode_tokens']} tok) | {r['transcribe'][0]:.2f} | {r['transcribe_tokens']} "
                     f"({r['windows']}) | {r['model_mb']:.1f} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def ratios(results: dict[str, dict]) -> str:
    """faster-whisper's time / ours, per precision and timing (> 1: ours faster), and peak RSS ours / theirs."""
    lines = []
    for p in ("fp32", "int8"):
        ours, theirs = results[f"onnxformer {p}"], results[f"faster-whisper {p}"]
        parts = [f"{k} {theirs[k][0] / ours[k][0]:.2f}x" for k in ("encode", "decode", "transcribe")]
        parts.append(f"peak RSS {ours['peak_rss_mb'] / theirs['peak_rss_mb']:.2f} of theirs")
        lines.append(f"- {p}: faster-whisper time / ours: " + ", ".join(parts))
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:6])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="base")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=60, help="the transcribed clip's length")
    ap.add_argument("--max-new-tokens", type=int, default=224, help="a transcribe window's cap, both engines")
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args()
    out = build(args.shape)
    if args.build_only:
        return
    results = run_engines(out, args)
    (out / "race.json").write_text(json.dumps(results, indent=1))
    print(table(results, args))
    print(ratios(results))


if __name__ == "__main__":
    main()
