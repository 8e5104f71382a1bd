"""CTranslate2 generating for one input of ids, the counterpart of `onnxformer generate BUNDLE --ids IDS`, to measure
its process's peak memory beside ours (run it in the CTranslate2 environment of race_peers.py, under /usr/bin/time -v).

    out/peers/ct2/bin/python benchmarks/ct2_generate.py CT2_MODEL "5 17 29 41 3 2" [int8|default] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    import ctranslate2

    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("ids")
    ap.add_argument("compute_type", nargs="?", default="default")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    vocab = args.model / "shared_vocabulary.json"
    tokens = (json.loads(vocab.read_text()) if vocab.exists()
              else (args.model / "shared_vocabulary.txt").read_text(encoding="utf-8").split("\n")[:-1])
    translator = ctranslate2.Translator(str(args.model), device="cpu", intra_threads=args.threads,
                                        compute_type=args.compute_type)
    out = translator.translate_batch([[tokens[int(i)] for i in args.ids.split()]], beam_size=1,
                                     max_decoding_length=args.new_tokens)
    print(" ".join(out[0].hypotheses[0]))


if __name__ == "__main__":
    main()
