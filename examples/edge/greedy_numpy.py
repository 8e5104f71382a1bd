"""Greedy decoding from an onnxformer bundle with numpy and onnxruntime only (no onnxformer import).

    python greedy_numpy.py BUNDLE "Nov 30th 2026" "30.11.26"       # one line per input, like `onnxformer generate`
    python greedy_numpy.py BUNDLE --ids "5 6 7"                     # token ids in, ids out (models without text)

For applications that embed the graphs themselves: everything needed is in the bundle's manifest.json
(model config, graph files, every file's sha256) and tokenizer.json. On the CPU it runs the ORT-format graphs
(.ort) when the bundle lists them, else the .onnx graphs, as onnxformer does.
"""

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

SPECIALS = 3                               # tokenizer ids 0, 1, 2: <pad>, <s>, </s>
FORMAT_VERSION = 3                         # manifest.json's format_version (3: it declares "decoder_layout")


def load(bundle: Path, use_ort_format: bool = True):
    """Manifest, encoder and decoder sessions (hashes checked), and the tokenizer's characters (or None)."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    if manifest.get("format_version") != FORMAT_VERSION:            # the manifest fields this script reads
        raise SystemExit(f"{bundle} is a format {manifest.get('format_version')} bundle; this script reads format "
                         f"{FORMAT_VERSION}: re-export the bundle with this onnxformer")
    for name, entry in manifest["files"].items():                  # every file of the bundle, graphs and tokenizer
        if hashlib.sha256((bundle / name).read_bytes()).hexdigest() != entry["sha256"]:
            raise SystemExit(f"{bundle / name} does not match its sha256 in manifest.json; copy the bundle again")
    sessions = {}
    for name in ("encoder", "decoder"):
        entry = (manifest.get("ort_graphs") or {}).get(name) if use_ort_format else None
        entry = entry or manifest["graphs"][name]
        sessions[name] = ort.InferenceSession(str(bundle / entry["file"]), providers=["CPUExecutionProvider"])
    chars = None
    if manifest.get("tokenizer"):
        chars = json.loads((bundle / manifest["tokenizer"]).read_text())["chars"]
    return manifest, sessions["encoder"], sessions["decoder"], chars


def greedy(encoder, decoder, config: dict, layout: str, sources: list[list[int]],
           max_new_tokens: int) -> list[list[int]]:
    """Greedy search over a right-padded batch, as onnxformer runs it; each result stops before EOS. layout: the
    manifest's decoder_layout, "dynamic", "static-per-row" or "static-shared"."""
    batch, width = len(sources), max(len(s) for s in sources)
    ids = np.full((batch, width), config["pad_id"], dtype=np.int64)          # [B, S]
    mask = np.zeros((batch, width), dtype=np.int64)                          # 1 = token, 0 = padding
    for row, seq in enumerate(sources):
        ids[row, :len(seq)], mask[row, :len(seq)] = seq, 1
    # 1. the encoder runs once: hidden states and every decoder layer's cross-attention K/V [B, H, S, Dh]
    enc_names = [o.name for o in encoder.get_outputs()]
    encoded = dict(zip(enc_names, encoder.run(None, {"input_ids": ids, "attention_mask": mask})))
    # 2. decoder inputs: past_key_values.{i}.encoder.* = the encoder's present.{i}.encoder.*; self-attention
    #    caches start empty: past_len 0, or, for a static-cache decoder (manifest "decoder_layout": "static-per-row"
    #    or "static-shared"), a zeroed [B, H, max_len, Dh] buffer and past_sequence_length 0
    head_dim = config["d_model"] // config["n_heads"]
    static = layout != "dynamic"
    cache_len = config["max_len"] if static else 0
    empty = np.zeros((batch, config["n_heads"], cache_len, head_dim), dtype=np.float32)
    feeds = {i.name: encoded.get(i.name.replace("past_key_values.", "present."), empty)
             for i in decoder.get_inputs() if i.name.startswith("past_key_values.")}
    out_names = [o.name for o in decoder.get_outputs()]                      # logits, present.{i}.decoder.*
    tokens = np.full(batch, config["bos_id"], dtype=np.int64)
    live = np.arange(batch)                                                  # the input each row belongs to
    results = [[] for _ in sources]
    for step in range(max_new_tokens):
        # 3. one cached step: the newest token in, logits [N, 1, V] and the self-attention caches out (grown by
        #    one position, or the static buffers with position `step` written; onnxformer's runtime binds each
        #    static buffer as both input and output with IO binding, so nothing is copied)
        #    Each row's position and which cached slots are real tokens (position_ids [N, 1],
        #    decoder_attention_mask [N, past_len or cache_len]): every row here sits at position `step` with all of
        #    its slots real. A "static-per-row" cache (CPU bundles) keeps one filled length per row
        #    (past_sequence_length [N]) and takes no key mask; a "static-shared" one (CUDA bundles) has one length
        #    for all rows ([1]) and the mask
        if static:
            per_row = layout == "static-per-row"
            feeds["past_sequence_length"] = np.full(len(tokens) if per_row else 1, step, dtype=np.int32)
        feeds["position_ids"] = np.full((len(tokens), 1), step, dtype=np.int64)
        if layout != "static-per-row":
            feeds["decoder_attention_mask"] = np.ones((len(tokens), cache_len or step), dtype=np.int64)
        logits, *presents = decoder.run(out_names, {"input_ids": tokens[:, None],
                                                    "encoder_attention_mask": mask, **feeds})
        tokens = logits[:, -1].argmax(-1).astype(np.int64)
        alive = tokens != config["eos_id"]
        for row in np.flatnonzero(alive):
            results[live[row]].append(int(tokens[row]))
        if not alive.any():
            break
        # 4. this step's presents are the next step's pasts; rows that produced EOS leave the batch (int8
        #    graphs quantize activations per tensor, so the batch's rows are part of every row's numbers)
        feeds.update({n.replace("present.", "past_key_values."): v for n, v in zip(out_names[1:], presents)})
        if not alive.all():
            feeds = {name: value[alive] if value.ndim == 4 else value for name, value in feeds.items()}
            mask, live, tokens = mask[alive], live[alive], tokens[alive]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("texts", nargs="*")
    parser.add_argument("--ids", action="append", default=[], help='token ids of one input, e.g. "5 6 7"')
    parser.add_argument("--max-new-tokens", type=int, help="default: min(64, the model's max_len)")
    parser.add_argument("--onnx", action="store_true", help="run the .onnx graphs even when .ort graphs are listed")
    args = parser.parse_args()
    manifest, encoder, decoder, chars = load(args.bundle, use_ort_format=not args.onnx)
    config = manifest["model"]
    if args.texts and chars is None:
        raise SystemExit("this bundle has no tokenizer.json; pass token ids with --ids")
    to_id = {c: i + SPECIALS for i, c in enumerate(chars or "")}
    unknown = sorted({c for text in args.texts for c in text if c not in to_id})
    if unknown:
        raise SystemExit(f"character(s) {''.join(unknown)!r} are not in the vocabulary {chars!r}")
    sources = [[to_id[c] for c in text] for text in args.texts] + [[int(t) for t in s.split()] for s in args.ids]
    if not sources or not all(sources):
        raise SystemExit("pass at least one non-empty TEXT or --ids")
    limit = min(64, config["max_len"]) if args.max_new_tokens is None else args.max_new_tokens
    for out in greedy(encoder, decoder, config, manifest["decoder_layout"], sources, limit):
        print("".join(chars[t - SPECIALS] for t in out if t >= SPECIALS) if chars is not None
              else " ".join(map(str, out)))


if __name__ == "__main__":
    main()
