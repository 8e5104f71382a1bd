"""Translate a text file in batches with beam search (beam 4), printing the two best hypotheses of each line and
their scores, with the Python API (runtime.Translator).

    python examples/python/translate_file.py out/demo/dates-int8 examples/python/dates.txt --batch-size 4

A mistake (a missing bundle, a line the model cannot read, a bad option) stops it with the one-line message
`onnxformer generate` prints, and its exit status (2).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from itertools import islice

from runtime import Translator
from runtime.errors import OnnxformerError


def batches(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    """Consecutive lists of at most `size` lines: the file is read as it is translated, never all at once."""
    it = iter(lines)
    while batch := list(islice(it, size)):
        yield batch


def translate_file(translator: Translator, path: str, batch_size: int) -> None:
    with open(path, encoding="utf-8") as f:
        lines = (line.rstrip("\n") for line in f if line.strip())          # blank lines are no input
        for batch in batches(lines, batch_size):
            for result in translator.generate(batch, beam=4, num_return=2):
                print(result.input)
                for rank, (text, score) in enumerate(zip(result.texts, result.scores), 1):
                    print(f"  {rank}. {score:8.4f}  {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", help="a bundle directory (e.g. out/demo/dates-int8 after `make demo`)")
    parser.add_argument("input", help="a UTF-8 text file, one input a line")
    parser.add_argument("--batch-size", type=int, default=16, help="lines translated together")
    parser.add_argument("--provider", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--threads", type=int, help="intra-op threads (default: ONNX Runtime's choice)")
    args = parser.parse_args()
    try:
        translator = Translator(args.bundle, provider=args.provider, threads=args.threads)
        translate_file(translator, args.input, args.batch_size)
    except OnnxformerError as exc:                                      # the runtime's one-line errors
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except OSError as exc:
        print(f"error: cannot read {args.input}: {exc.strerror or exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
