"""Race onnxformer's Whisper bundles against faster-whisper (CTranslate2) and Optimum (onnxruntime) on identical random
weights: one WhisperForConditionalGeneration directory of a real shape feeds our importer, CTranslate2's converter
and optimum-cli's export; each engine then runs in its own process, under the bench lock, with the same threads:

    .venv/bin/python benchmarks/race_whisper.py [--shape tiny|base|small] [--threads 2] [--build-only]

Three timings an engine (p50 of --repeat after one warm-up): the encoder on one 30 s window; a decode of exactly 64
tokens after the same prompt (<|startoftranscript|><|en|><|transcribe|><|notimestamps|>) over that encoder output, the
end token suppressed / ignored; a whole transcribe of a 60 s clip (seeded noise: greedy, temperature 0 only, no
fallback, no no-speech skip, no timestamps, no VAD, every window's end token suppressed / ignored, so that each window
decodes exactly --max-new-tokens); every engine suppresses the timestamp ids too (random small weights choose them
after <|notimestamps|>, where faster-whisper cuts its windows and transformers its output). Optimum has no transcribe
here: transformers' long-form path needs timestamp tokens. Random weights decode garbage of equal counts: the race
checks the prompts, the decode's count and the transcribe's windows and counts, and prints no ratio when they differ.
Also model MB, RSS loaded, peak RSS.

The directory's vocabulary is Whisper's 51,865 rows: tiny_whisper's byte-level BPE text tokens padded with placeholder
tokens and the empty piece to 50,353 text ids, then the 11 special tokens (three languages) and the 1501 timestamp
tokens, so every shape (embedding, head, softmax) is the real model's. faster-whisper runs from a venv of its own
(out/peers-whisper, or $ONNXFORMER_WHISPER_PEERS: faster-whisper, ctranslate2, transformers 5, torch), Optimum from
race_peers.py's (out/peers/optimum, or $ONNXFORMER_OPTIMUM_ENV: optimum-onnx 0.1, transformers 4.57); each is built
there on first use (race_peers.env_python: FW_PACKAGES' pins, ENVS['optimum']'s).
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
OPTIMUM = Path(os.environ.get("ONNXFORMER_OPTIMUM_ENV") or ROOT / "out" / "peers" / "optimum").absolute()
FW_PACKAGES = ["torch==2.13.0", "faster-whisper==1.2.1", "ctranslate2==4.8.5", "transformers>=5.24,<6"]
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
    the trained ones and the empty piece up to 50,353 text ids, the specials next, the 1501 timestamps last (51,865 in
    all)."""
    from toolkit.testing.tiny_whisper import SPECIALS, TIMESTAMPS, byte_bpe

    byte_bpe(directory, timestamps=False)
    data = json.loads((directory / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    text = VOCAB - len(SPECIALS) - len(TIMESTAMPS)
    for i in range(len(vocab), text - 1):
        vocab[f"<placeholder{i}>"] = i           # no merge reaches them: decodable, never produced by encode
    # the real multilingual vocabulary's empty piece (id 50256 there), last of the text ids: CTranslate2 4.8 reads
    # a Whisper model as multilingual (language and task tokens in faster-whisper's prompt) only when it holds ""
    vocab[""] = text - 1
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
        vocab_size=VOCAB, d_model=s["d_model"], encoder_layers=s["encoder_layers"], decoder_layers=s["decoder_layers"],
        encoder_attention_heads=s["heads"], decoder_attention_heads=s["heads"], encoder_ffn_dim=s["ffn"],
        decoder_ffn_dim=s["ffn"], num_mel_bins=80, max_source_positions=1500, max_target_positions=448, dropout=0.0,
        pad_token_id=gen["pad_token_id"], bos_token_id=gen["bos_token_id"], eos_token_id=gen["eos_token_id"],
        decoder_start_token_id=gen["decoder_start_token_id"], suppress_tokens=gen["suppress_tokens"],
        begin_suppress_tokens=gen["begin_suppress_tokens"])
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    model.generation_config = transformers.GenerationConfig(**gen)
    model.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2))
    transformers.WhisperFeatureExtractor(feature_size=80).save_pretrained(directory)


def build(shape: str) -> Path:
    """The shape's folder: hf/ (the original), onnxformer-fp32/-int8 bundles, ct2-fp32/-int8 models, optimum-fp32
    (optimum-cli's export) and optimum-int8 (its ORTQuantizer's dynamic avx512_vnni quantization). Each step is
    skipped when its output is there: --build-only once, then the timed run on a quiet machine."""
    out = WORK / shape
    hf = out / "hf"
    if not (hf / "config.json").exists():
        log(f"building the random {shape} Whisper directory")
        build_directory(shape, hf)
    ox = Path(sys.executable).with_name("onnxformer")
    steps = [("checkpoint", ["import", hf, "--out", out / "checkpoint"]),
             ("onnxformer-export", ["export", out / "checkpoint", "--out", out / "onnxformer-export"]),
             # the parity gate on 8 inputs, not 100: each is a 30 s encoder run and a greedy decode on both bundles
             ("onnxformer-fp32", ["optimize", out / "onnxformer-export", "--out", out / "onnxformer-fp32",
                                  "--samples", "8"]),
             # random weights pass no int8 token gate: the default recipe written unverified (auto would try every
             # recipe, each failing, at minutes apiece on the small shape)
             ("onnxformer-int8", ["optimize", out / "onnxformer-export", "--out", out / "onnxformer-int8",
                                  "--precision", "int8", "--recipe", "default", "--samples", "8",
                                  "--allow-unverified"])]
    for folder, cmd in steps:
        if not (out / folder / ("config.json" if folder == "checkpoint" else "manifest.json")).exists():
            log(f"onnxformer {cmd[0]} -> {folder}")
            sh(ox, *cmd, "--force")
    convert = peer_python("faster-whisper").with_name("ct2-transformers-converter")
    for name, extra in (("ct2-fp32", []), ("ct2-int8", ["--quantization", "int8"])):
        if not (out / name / "model.bin").exists():
            log(f"CTranslate2: ct2-transformers-converter ({name})")
            sh(convert, "--model", hf, "--output_dir", out / name, "--force",
               "--copy_files", "tokenizer.json", "preprocessor_config.json", *extra)
    build_optimum(hf, out)
    return out


def build_optimum(hf: Path, out: Path) -> None:
    """optimum-cli's export (automatic-speech-recognition-with-past) into optimum-fp32, then ORTQuantizer's dynamic
    int8 (avx512_vnni, per tensor) of the two files ORTModelForSpeechSeq2Seq loads into optimum-int8."""
    opt = peer_python("optimum")
    fp32, int8 = out / "optimum-fp32", out / "optimum-int8"
    if not (fp32 / "decoder_model_merged.onnx").exists():
        log("Optimum: optimum-cli export onnx (automatic-speech-recognition-with-past)")
        sh(opt, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", hf, "--task",
           "automatic-speech-recognition-with-past", fp32)
    if not (int8 / "decoder_model_merged.onnx").exists():
        log("Optimum: ORTQuantizer avx512_vnni dynamic int8")
        sh(opt, Path(__file__).resolve(), "--quantize", fp32, int8)


def peer_python(name: str) -> Path:
    """The python of "faster-whisper"'s or "optimum"'s venv, built on first use (race_peers.env_python)."""
    from race_peers import env_python
    return env_python(name, *{"faster-whisper": (PEERS, FW_PACKAGES), "optimum": (OPTIMUM, None)}[name])


def optimum_quantize(src: str, dst: str) -> None:
    """(In the Optimum venv.) The encoder and the merged decoder of src quantized into dst under their own names,
    the other files but the unmerged decoders copied."""
    import shutil

    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    config = AutoQuantizationConfig.avx512_vnni(is_static=False, per_channel=False)
    tmp = Path(dst + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name in ("encoder_model.onnx", "decoder_model_merged.onnx"):
        ORTQuantizer.from_pretrained(src, file_name=name).quantize(save_dir=tmp, quantization_config=config)
        (tmp / name.replace(".onnx", "_quantized.onnx")).rename(tmp / name)     # the names from_pretrained loads
    for f in Path(src).iterdir():
        if f.suffix != ".onnx" and not (tmp / f.name).exists():
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
def timed(fn, repeat: int) -> tuple[float, list[float], object]:
    """(p50 s, every round, the last result) of fn() over `repeat` rounds after a warm-up; each result freed first."""
    result, rounds = fn(), []                                # the warm-up
    for _ in range(repeat):
        result = None
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
    """Our bundle: Transcriber.encode, generate over its output (64 tokens), Transcriber.transcribe; EOS ignored."""
    import dataclasses
    from runtime.generate import generate
    from runtime.request import Request
    from runtime.transcribe import Transcriber

    tr = Transcriber(model, provider="cpu", threads=spec["threads"])
    loaded = rss_mb()
    features, samples = inputs(spec["seconds"])
    prompt = tr.prompt("en", "transcribe", False)
    enc_s, enc_r, encoded = timed(lambda: tr.encode(features[None]), spec["repeat"])
    stamps = tuple(range(tr.timestamp_begin, tr.engine.vocab_size))   # no timestamps asked: none decoded
    opts = dataclasses.replace(tr.options(prompt, False, max_new_tokens=NEW_TOKENS), ignore_eos=True, suppress=stamps)
    request = Request.build(tr.engine, [features], None, opts)

    def decode():
        return generate(tr.engine, request, encoded=encoded)[0][0].tokens[len(prompt):]
    dec_s, dec_r, tokens = timed(decode, spec["repeat"])
    del encoded, request                                     # the decode part's input; transcribe encodes its own
    window_options = tr.options
    tr.options = lambda *a, **k: dataclasses.replace(window_options(*a, **k), ignore_eos=True, suppress=stamps)

    def transcribe():
        return tr.transcribe(samples, language="en", beam=1, temperatures=(0.0,), compression_ratio_threshold=None,
                             logprob_threshold=None, no_speech_threshold=None, max_new_tokens=spec["max_new_tokens"])
    tx_s, tx_r, result = timed(transcribe, spec["repeat"])
    return {"loaded_rss_mb": loaded, "prompt": [tr.engine.bos_id, *prompt], "encode": [enc_s, enc_r],
            "decode": [dec_s, dec_r], "decode_ids": list(tokens), "transcribe": [tx_s, tx_r],
            "window_tokens": windows_of((s.seek, len(s.tokens)) for s in result.segments)}


def rss_mb() -> float:
    """The process's resident memory now (the model loaded: what it holds before any input)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def windows_of(pairs) -> list[int]:
    """The tokens each window decoded, from (seek, tokens) of every segment (segments of a window share its seek)."""
    counts: dict[int, int] = {}
    for seek, n in pairs:
        counts[seek] = counts.get(seek, 0) + n
    return [counts[k] for k in sorted(counts)]


def faster_whisper_worker(model: str, spec: dict) -> dict:
    """faster-whisper: encode, generate (64 tokens), transcribe; end token suppressed. CTranslate2's Whisper
    generate stops at max_length // 2 new tokens whatever the prompt (OpenAI's sample_len; 4.8.5: max_length 66,
    128, 448 give 33, 64, 224): both are asked for twice the tokens wanted (transcribe: less the prompt)."""
    import ctranslate2
    import numpy as np
    from faster_whisper import WhisperModel
    from faster_whisper.tokenizer import Tokenizer

    wm = WhisperModel(model, device="cpu", compute_type=spec["compute_type"], cpu_threads=spec["threads"],
                      num_workers=1)
    loaded = rss_mb()
    features, samples = inputs(spec["seconds"])
    tok = Tokenizer(wm.hf_tokenizer, wm.model.is_multilingual, task="transcribe", language="en")
    prompt = [*tok.sot_sequence, tok.no_timestamps]
    stamps = list(range(tok.timestamp_begin, VOCAB))                  # no timestamps asked: none decoded
    view = ctranslate2.StorageView.from_array(np.ascontiguousarray(features[None]))
    enc_s, enc_r, encoded = timed(lambda: wm.model.encode(view, to_cpu=False), spec["repeat"])

    def decode():
        return wm.model.generate(encoded, [prompt], beam_size=1, max_length=2 * NEW_TOKENS,
                                 suppress_tokens=[tok.eot, *stamps], suppress_blank=False,
                                 return_no_speech_prob=False)[0].sequences_ids[0]
    dec_s, dec_r, tokens = timed(decode, spec["repeat"])
    del encoded                                              # the decode part's input; transcribe encodes its own

    def transcribe():
        segments, _ = wm.transcribe(samples, language="en", beam_size=1, temperature=0.0,
                                    condition_on_previous_text=False, without_timestamps=True, vad_filter=False,
                                    compression_ratio_threshold=None, log_prob_threshold=None,
                                    no_speech_threshold=None, suppress_tokens=[-1, tok.eot, *stamps],
                                    max_new_tokens=2 * spec["max_new_tokens"] - len(prompt))
        return list(segments)
    tx_s, tx_r, segments = timed(transcribe, spec["repeat"])
    return {"loaded_rss_mb": loaded, "prompt": prompt, "encode": [enc_s, enc_r], "decode": [dec_s, dec_r],
            "decode_ids": list(tokens), "transcribe": [tx_s, tx_r],
            "window_tokens": windows_of((s.seek, len(s.tokens)) for s in segments)}


def optimum_worker(model: str, spec: dict) -> dict:
    """Optimum's ORTModelForSpeechSeq2Seq (onnxruntime, the merged decoder): its encoder, and generate over its output
    (min_new_tokens = max_new_tokens = 64). No transcribe: transformers' long-form path needs timestamp tokens."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from optimum.onnxruntime import ORTModelForSpeechSeq2Seq

    torch.set_num_threads(1)     # torch only runs the logits processors here: its pool must not fight ORT's
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = spec["threads"], 1
    hf = ORTModelForSpeechSeq2Seq.from_pretrained(model, session_options=so, provider="CPUExecutionProvider")
    loaded = rss_mb()
    features, _ = inputs(spec["seconds"])
    x = torch.from_numpy(np.ascontiguousarray(features[None]))
    enc_s, enc_r, encoded = timed(lambda: hf.encoder(input_features=x, attention_mask=None), spec["repeat"])
    gc = hf.generation_config
    suppress = [*(gc.suppress_tokens or []), *range(gc.no_timestamps_token_id + 1, VOCAB)]   # no timestamps decoded
    def decode():
        with torch.no_grad():
            return hf.generate(encoder_outputs=encoded, language="en", task="transcribe", return_timestamps=False,
                               num_beams=1, do_sample=False, min_new_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS,
                               suppress_tokens=suppress)
    dec_s, dec_r, out = timed(decode, spec["repeat"])
    prompt = [gc.decoder_start_token_id, gc.lang_to_id["<|en|>"], gc.task_to_id["transcribe"],
              gc.no_timestamps_token_id]
    ids = out[0].tolist()
    ids = ids[len(prompt):] if ids[:len(prompt)] == prompt else ids      # some versions return the prompt too
    return {"loaded_rss_mb": loaded, "prompt": prompt, "encode": [enc_s, enc_r], "decode": [dec_s, dec_r],
            "decode_ids": ids}


def worker(engine: str, model: str, spec_file: str, out_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    fn = {"onnxformer": onnxformer_worker, "faster-whisper": faster_whisper_worker, "optimum": optimum_worker}[engine]
    result = fn(model, spec)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out_file).write_text(json.dumps(result))


def model_mb(folder: Path) -> float:
    """The files the engine loads: Optimum's folder also holds the unmerged decoders it does not read."""
    skip = {"decoder_model.onnx", "decoder_with_past_model.onnx"}
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name not in skip) / 1e6


def engines(out: Path) -> list[tuple[str, Path, str, Path, str]]:
    """(label, python, engine, model folder, compute type) of every engine, ours first at each precision."""
    fw, opt = peer_python("faster-whisper"), peer_python("optimum")
    return [("onnxformer fp32", Path(sys.executable), "onnxformer", out / "onnxformer-fp32", "float32"),
            ("faster-whisper fp32", fw, "faster-whisper", out / "ct2-fp32", "float32"),
            ("optimum fp32", opt, "optimum", out / "optimum-fp32", "float32"),
            ("onnxformer int8", Path(sys.executable), "onnxformer", out / "onnxformer-int8", "int8"),
            ("faster-whisper int8", fw, "faster-whisper", out / "ct2-int8", "int8"),
            ("optimum int8", opt, "optimum", out / "optimum-int8", "int8")]


def run_engines(out: Path, args: argparse.Namespace) -> dict[str, dict]:
    """Each engine in its own process (nice 10, the bench lock); label -> its result and model MB."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    results = {}
    for label, py, engine, model, compute in engines(out):
        log(f"{label}: {model}")
        spec = {"threads": args.threads, "repeat": args.repeat, "seconds": args.seconds, "compute_type": compute,
                "max_new_tokens": args.max_new_tokens}
        spec_file, out_file = out / f"spec-{model.name}.json", out / f"result-{model.name}.json"
        spec_file.write_text(json.dumps(spec))
        sh("flock", LOCK, "nice", "-n", "10", py, Path(__file__).resolve(), "--worker", engine, model, spec_file,
           out_file, env=env, cwd=ROOT)
        results[label] = json.loads(out_file.read_text()) | {"model_mb": model_mb(model)}
    return results


def unequal_work(results: dict[str, dict], new_tokens: int, max_new_tokens: int) -> list[str]:
    """Why the timings are not comparable, [] when they are: every engine's decode must yield exactly new_tokens
    ids after the same prompt, and every transcribe the same windows of exactly max_new_tokens each."""
    problems = []
    prompts = {tuple(r["prompt"]) for r in results.values()}
    if len(prompts) > 1:
        problems.append(f"the engines' prompts differ: {sorted(prompts)}")
    for label, r in results.items():
        if len(r["decode_ids"]) != new_tokens:
            problems.append(f"{label} decoded {len(r['decode_ids'])} tokens, not {new_tokens}")
    windows = {label: r["window_tokens"] for label, r in results.items() if "window_tokens" in r}
    for label, w in windows.items():
        if not w or any(n != max_new_tokens for n in w):
            problems.append(f"{label}'s transcribe windows decoded {w}, not {max_new_tokens} each")
    if len({len(w) for w in windows.values()}) > 1:
        problems.append(f"the transcribes' window counts differ: {windows}")
    return problems


def table(results: dict[str, dict], args: argparse.Namespace) -> str:
    head = (f"| engine | encoder 30 s (ms) | decode {NEW_TOKENS} tokens (ms) | ms / token | transcribe "
            f"{args.seconds} s (s) | windows x tokens | model MB | RSS loaded / peak MB |")
    lines = [head, "|" + "---|" * 8]
    for label, r in results.items():
        w = r.get("window_tokens")
        tx = f"{r['transcribe'][0]:.2f} | {len(w)} x {w[0]}" if w else "n/a | n/a"
        lines.append(f"| {label} | {r['encode'][0] * 1000:.0f} | {r['decode'][0] * 1000:.0f} | "
                     f"{r['decode'][0] * 1000 / len(r['decode_ids']):.1f} | {tx} | {r['model_mb']:.1f} | "
                     f"{r['loaded_rss_mb']:.0f} / {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def agreement(ours: list[int], theirs: list[int]) -> int:
    """How many leading decode ids two engines share (same weights, same prompt: fp32 should share most)."""
    n = 0
    for a, b in zip(ours, theirs):
        if a != b:
            break
        n += 1
    return n


def ratios(results: dict[str, dict]) -> str:
    """Each peer's time / ours, per precision and timing (> 1: ours faster), peak RSS ours / theirs, and the
    leading decode ids it shares with ours."""
    lines = []
    for p in ("fp32", "int8"):
        ours = results[f"onnxformer {p}"]
        for peer in ("faster-whisper", "optimum"):
            theirs = results[f"{peer} {p}"]
            parts = [f"{k} {theirs[k][0] / ours[k][0]:.2f}x" for k in ("encode", "decode", "transcribe")
                     if k in theirs]
            parts.append(f"peak RSS {ours['peak_rss_mb'] / theirs['peak_rss_mb']:.2f} of theirs")
            parts.append(f"decode ids shared {agreement(ours['decode_ids'], theirs['decode_ids'])}/{NEW_TOKENS}")
            lines.append(f"- {p}: {peer} time / ours: " + ", ".join(parts))
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:6])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--quantize":
        optimum_quantize(*sys.argv[2:4])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="base")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=60, help="the transcribed clip's length")
    ap.add_argument("--max-new-tokens", type=int, default=224,
                    help="every transcribe window's token count (EOS ignored), both engines; at most 224")
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args()
    if not 1 <= args.max_new_tokens <= 224:
        ap.error(f"--max-new-tokens {args.max_new_tokens}: give 1 to 224 (faster-whisper's windows stop at 224)")
    out = build(args.shape)
    if args.build_only:
        return
    results = run_engines(out, args)
    (out / "race.json").write_text(json.dumps(results, indent=1))
    print(table(results, args))
    problems = unequal_work(results, NEW_TOKENS, args.max_new_tokens)
    if problems:
        print("unequal work, no ratios:\n" + "\n".join(f"- {p}" for p in problems))
        raise SystemExit(1)
    print(ratios(results))


if __name__ == "__main__":
    main()
