"""Character-level tokenizer stored as tokenizer.json. Numpy-free and torch-free: it ships in every bundle."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.errors import TokenizerError, read_json

SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: pad, bos, eos (ModelConfig's defaults)


class CharTokenizer:
    """Maps each character to one id; ids 0-2 are padding, start and end of sequence."""

    def __init__(self, chars: str | list[str]):
        chars = list(chars)
        if len(set(chars)) != len(chars):
            raise TokenizerError("tokenizer characters must be unique")
        if any(len(c) != 1 for c in chars):
            raise TokenizerError("a character tokenizer takes single characters only")
        self.chars = chars
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._to_id = {c: i + len(SPECIALS) for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Ids of the text's characters (no start/end tokens); unknown characters are an error."""
        unknown = sorted({c for c in text if c not in self._to_id})
        if unknown:
            shown = "".join(unknown[:10])
            raise TokenizerError(
                f"input {text!r} has character(s) outside the vocabulary: {shown!r}; "
                f"remove them (the vocabulary is: {''.join(self.chars)!r})")
        return [self._to_id[c] for c in text]

    def decode(self, ids) -> str:
        """Text of the ids, stopping at end of sequence and skipping padding and start tokens."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i < len(SPECIALS):
                continue
            if i >= self.vocab_size:
                raise TokenizerError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(self.chars[i - len(SPECIALS)])
        return "".join(out)

    def to_dict(self) -> dict:
        return {"type": "char", "specials": list(SPECIALS), "chars": "".join(self.chars)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CharTokenizer":
        path = Path(path)
        data = read_json(path, TokenizerError, "regenerate it", missing="copy it beside the model (or regenerate it)")
        if not isinstance(data, dict) or data.get("type") != "char" or not isinstance(data.get("chars"), str):
            raise TokenizerError(f"{path} is not a character tokenizer (expected type 'char' and a 'chars' string)")
        if list(data.get("specials", SPECIALS)) != list(SPECIALS):
            raise TokenizerError(f"{path} has special tokens {data.get('specials')}, expected {list(SPECIALS)}")
        return cls(data["chars"])
