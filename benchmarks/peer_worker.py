"""One engine of the peer race (benchmarks/race_peers.py), run inside that engine's own environment.

    python benchmarks/peer_worker.py ENGINE MODEL INPUTS.json OUT.json

ENGINE is onnxformer (MODEL: a bundle), ctranslate2 (MODEL: a converted directory; --compute-type),
optimum (MODEL: an optimum-cli export directory) or transformers (MODEL: the original directory; the reference).
INPUTS.json: {"marian": DIR (the original save_pretrained directory: Marian, or any family with a config.json),
"inputs": [[ids]], "batch_sizes": [1, 8], "beam": 1, "max_new_tokens": N, "min_new_tokens": M, "threads": T,
"repeat": R, "warmup": W}, plus per engine "compute_type" (ctranslate2) and "use_vmap" (ctranslate2: decode with
the model folder's vmap.txt). Writes {"tokens": [[ids] per input, EOS dropped], "times": {batch: [seconds per
round]}, "peak_rss_mb": the process's peak resident memory, "peak_rss_mb_by_phase": {"loaded": ..., "batch B": the
peak once batch B's rounds ran (batch sizes in the order given, so the first one's peak is that of loading and that
batch alone), "tokens": the peak at the end}}: every round generates for the first `batch` inputs; the token pass
over all inputs (64 at a time) runs after the timed rounds, so that it does not set the smaller batches' peaks.
onnxformer loads its bundle without the tokenizer (ids in and out, as every other engine here is fed).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def batches(inputs, size):
    return [inputs[i:i + size] for i in range(0, len(inputs), size)]


def special_ids(original: Path) -> tuple[int, int, int]:
    """(eos, pad, decoder start) of the original model: Marian's from its vocab.json (decoding starts at <pad>),
    other families' from config.json."""
    if (original / "vocab.json").exists():
        vocab = json.loads((original / "vocab.json").read_text())
        return vocab["</s>"], vocab["<pad>"], vocab["<pad>"]
    config = json.loads((original / "config.json").read_text())
    return config["eos_token_id"], config["pad_token_id"], config["decoder_start_token_id"]


def ct2_vocabulary(original: Path, model: Path) -> dict[str, int]:
    """piece -> id: Marian's vocab.json (its converter drops <pad>, so the converted list is shifted), else the
    converted model's own vocabulary, one token per embedding row."""
    if (original / "vocab.json").exists():
        return json.loads((original / "vocab.json").read_text())
    if (model / "shared_vocabulary.json").exists():
        tokens = json.loads((model / "shared_vocabulary.json").read_text())
    else:
        tokens = (model / "shared_vocabulary.txt").read_text(encoding="utf-8").split("\n")[:-1]
    return {p: i for i, p in enumerate(tokens)}


def engine_fn(engine: str, model: str, spec: dict):
    """The engine's run(seqs) -> token lists, with the spec's search settings."""
    ids = special_ids(Path(spec["marian"]))
    if engine == "onnxformer":
        return onnxformer_fn(model, spec, ids)
    if engine == "ctranslate2":
        return ctranslate2_fn(model, spec)
    return transformers_fn(engine, model, spec, ids)


def onnxformer_fn(model: str, spec: dict, ids: tuple[int, int, int]):
    from runtime.bundle import load_bundle
    from runtime.generate import generate_ids
    from runtime.search import SearchOptions

    eos, pad, _ = ids
    eng = load_bundle(model, provider="cpu", threads=spec["threads"], tokenizer=False).engine
    # pad suppressed as the other engines are told to (bad_words_ids, suppress_sequences): T5 starts decoding
    # from pad, and a random T5 picks it again every step unless it is banned (Marian's bundles ban it already)
    opts = SearchOptions(max_new_tokens=spec["max_new_tokens"], beam=spec["beam"],
                         ignore_eos=spec["min_new_tokens"] >= spec["max_new_tokens"], suppress=(pad,))

    def run(seqs):
        return [[t for t in h[0].tokens if t != eos] for h in generate_ids(eng, seqs, opts)]
    return run


def ctranslate2_fn(model: str, spec: dict):
    import ctranslate2

    vocab = ct2_vocabulary(Path(spec["marian"]), Path(model))
    pieces = {i: p for p, i in vocab.items()}
    translator = ctranslate2.Translator(model, device="cpu", intra_threads=spec["threads"], inter_threads=1,
                                        compute_type=spec.get("compute_type", "default"))
    ct2_vocab = set(json.loads((Path(model) / "shared_vocabulary.json").read_text()))
    suppress = [["<pad>"]] if "<pad>" in ct2_vocab else None     # its Marian converter drops <pad>

    def run(seqs):
        out = translator.translate_batch([[pieces[i] for i in s] for s in seqs], beam_size=spec["beam"],
                                         max_decoding_length=spec["max_new_tokens"],
                                         min_decoding_length=spec["min_new_tokens"], length_penalty=1.0,
                                         suppress_sequences=suppress, use_vmap=spec.get("use_vmap", False))
        return [[vocab.get(p, -1) for p in r.hypotheses[0]] for r in out]
    return run


def transformers_fn(engine: str, model: str, spec: dict, ids: tuple[int, int, int]):
    """PyTorch eager (engine "transformers") or Optimum's onnxruntime model (engine "optimum")."""
    import torch
    from transformers import GenerationConfig

    eos, pad, start = ids
    threads, new, low = spec["threads"], spec["max_new_tokens"], spec["min_new_tokens"]
    torch.set_num_threads(threads)
    if engine == "optimum":
        import onnxruntime as ort
        from optimum.onnxruntime import ORTModelForSeq2SeqLM

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        hf = ORTModelForSeq2SeqLM.from_pretrained(model, session_options=so, provider="CPUExecutionProvider")
    else:
        from transformers import AutoModelForSeq2SeqLM

        hf = AutoModelForSeq2SeqLM.from_pretrained(model).eval()
    # the settings in full, as toolkit.parity.original.hf_generate: the model's own generation_config.json
    # (num_beams, max_length, ...) must not leak in
    gc = GenerationConfig(num_beams=spec["beam"], max_new_tokens=new, min_new_tokens=low or None, do_sample=False,
                          early_stopping="never", length_penalty=1.0, bad_words_ids=[[pad]], forced_eos_token_id=None,
                          forced_bos_token_id=None, decoder_start_token_id=start, eos_token_id=eos, pad_token_id=pad,
                          num_return_sequences=1, no_repeat_ngram_size=0, repetition_penalty=1.0, use_cache=True)

    def run(seqs):
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        with torch.no_grad():
            gen = hf.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        return [row[: row.index(eos)] if eos in row else row for row in gen[:, 1:].tolist()]
    return run


def peak_mb() -> float:
    """This process's peak resident memory so far, MB (2**20 bytes; Linux's ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    engine, model, inputs_file, out_file = sys.argv[1:5]
    spec = json.loads(Path(inputs_file).read_text())
    run = engine_fn(engine, model, spec)
    inputs = spec["inputs"]
    phases = {"loaded": peak_mb()}
    times = {}
    for b in spec["batch_sizes"]:
        for _ in range(spec["warmup"]):
            run(inputs[:b])
        rounds = []
        for _ in range(spec["repeat"]):
            start = time.perf_counter()
            run(inputs[:b])
            rounds.append(time.perf_counter() - start)
        times[str(b)] = rounds
        phases[f"batch {b}"] = peak_mb()
    tokens = [t for chunk in batches(inputs, 64) for t in run(chunk)]
    phases["tokens"] = peak_mb()
    Path(out_file).write_text(json.dumps({"engine": engine, "model": model, "tokens": tokens, "times": times,
                                          "peak_rss_mb": peak_mb(), "peak_rss_mb_by_phase": phases}))


if __name__ == "__main__":
    main()
