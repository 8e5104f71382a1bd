"""Tokenizers stored as tokenizer.json: characters, or SentencePiece with a vocabulary (Marian), both typed by the
Tokenizer protocol. Torch-free: they ship in bundles."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Protocol, runtime_checkable

from runtime.errors import TokenizerError, read_json

SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: pad, bos, eos (ModelConfig's defaults)


@runtime_checkable
class Tokenizer(Protocol):
    """What every tokenizer of a bundle or checkpoint offers (CharTokenizer, SentencePieceTokenizer)."""

    pad_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int:
        """Ids the decoder may produce (the target vocabulary)."""

    @property
    def src_vocab_size(self) -> int:
        """Ids encode() may give (the source vocabulary)."""

    @property
    def files(self) -> list[str]:
        """The tokenizer's files besides tokenizer.json, as names inside its directory."""

    def encode(self, text: str) -> list[int]:
        """Source ids of a text."""

    def decode(self, ids) -> str:
        """Text of target ids, special tokens skipped."""

    def to_dict(self) -> dict:
        """The content of tokenizer.json."""

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json at path (and its files beside it)."""


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

    @property
    def src_vocab_size(self) -> int:
        """One vocabulary for both sides."""
        return self.vocab_size

    @property
    def files(self) -> list[str]:
        """None: the characters are in tokenizer.json itself."""
        return []

    def encode(self, text: str) -> list[int]:
        """Ids of the text's characters (no start/end tokens); unknown characters are an error."""
        unknown = sorted({c for c in text if c not in self._to_id})
        if unknown:
            shown = "".join(unknown[:10])
            raise TokenizerError(
                f"input {text!r} has character(s) outside the vocabulary: {shown!r}; "
                f"remove them (the vocabulary is: {''.join(self.chars)!r})")
        return [self._to_id[c] for c in text]

    def encode_target(self, text: str) -> list[int]:
        """Target ids of a text (a prefix, a banned word): one vocabulary for both sides, so encode's ids."""
        return self.encode(text)

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
    def load(cls, path: str | Path, data=None) -> "CharTokenizer":
        path = Path(path)
        data = read_json(path, TokenizerError, "regenerate it") if data is None else data
        if not isinstance(data, dict) or data.get("type") != "char" or not isinstance(data.get("chars"), str):
            raise TokenizerError(f"{path} is not a character tokenizer (expected type 'char' and a 'chars' string)")
        if list(data.get("specials", SPECIALS)) != list(SPECIALS):
            raise TokenizerError(f"{path} has special tokens {data.get('specials')}, expected {list(SPECIALS)}")
        return cls(data["chars"])


class SentencePieceTokenizer:
    """SentencePiece pieces, vocabulary ids: the tokenizer of Marian (opus-mt) models, matching MarianTokenizer.

    Pieces come from the model's SentencePiece files (source.spm, target.spm); ids from its vocabulary
    (vocab.json, and target_vocab.json when the two sides have their own), never SentencePiece's ids.
    encode() gives the source ids of a text: special tokens written in the text are kept whole, a leading
    `>>xx<<` target-language token is kept whole, pieces outside the vocabulary become unk, EOS is appended.
    decode() gives the text of target ids, skipping special tokens. The `sentencepiece` package is imported
    only here, when a model has such a tokenizer.
    """

    TYPE = "sentencepiece"

    def __init__(self, directory: str | Path, spec: dict):
        self.directory, self.spec = Path(directory), dict(spec)
        try:
            import sentencepiece
        except ImportError:
            raise TokenizerError("this model's tokenizer is SentencePiece, but the sentencepiece package is not "
                                 "installed; pip install sentencepiece (it comes with onnxformer[cpu])") from None
        self.source_vocab = _read_vocab(self.directory / spec["vocab"])
        separate = bool(spec.get("target_vocab"))
        self.target_vocab = _read_vocab(self.directory / spec["target_vocab"]) if separate else self.source_vocab
        self._spm = {}
        for side in ("source_spm", "target_spm"):
            processor = sentencepiece.SentencePieceProcessor()
            path = self.directory / spec[side]
            try:
                processor.Load(str(path))
            except (OSError, RuntimeError) as exc:
                raise TokenizerError(f"{path} is not a SentencePiece model ({str(exc).splitlines()[0][:120]}); "
                                     f"copy the model's {spec[side]} again") from None
            self._spm[side] = processor
        self.decode_spm = self._spm["target_spm" if separate else "source_spm"]   # as MarianTokenizer decodes
        self.specials = [spec["eos"], spec["unk"], spec["pad"], *([spec["bos"]] if spec.get("bos") else []),
                         *spec.get("additional_special_tokens", [])]
        for token in (spec["eos"], spec["unk"], spec["pad"]):
            if token not in self.source_vocab:
                raise TokenizerError(f"{self.directory / spec['vocab']} lacks the special token {token!r}; "
                                     f"pass the model's own vocab.json")
        self.eos_id, self.unk_id = self.source_vocab[spec["eos"]], self.source_vocab[spec["unk"]]
        self.pad_id = self.target_vocab.get(spec["pad"], self.source_vocab[spec["pad"]])
        self._target_tokens = {i: t for t, i in self.target_vocab.items()}
        self._skip = {self.source_vocab.get(t, self.unk_id) for t in self.specials}   # MarianTokenizer's ids
        by_length = sorted(self.specials, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(t) for t in by_length) + ")")
        self.clean_up = bool(spec.get("clean_up_tokenization_spaces", False))

    @property
    def vocab_size(self) -> int:
        """Ids the decoder may produce (the target vocabulary)."""
        return max(self.target_vocab.values()) + 1

    @property
    def src_vocab_size(self) -> int:
        return max(self.source_vocab.values()) + 1

    @property
    def files(self) -> list[str]:
        """The tokenizer's files besides tokenizer.json, as names inside its directory."""
        return [self.spec[k] for k in ("source_spm", "target_spm", "vocab", "target_vocab") if self.spec.get(k)]

    def pieces(self, text: str) -> list[str]:
        """The source pieces of a text, special tokens and a leading language token kept whole."""
        out = []
        for chunk in self._split.split(text):
            if not chunk:
                continue
            if chunk in self.specials:
                out.append(chunk)
                continue
            if chunk.startswith(">>") and (end := chunk.find("<<")) != -1:
                out.append(chunk[:end + 2])
                chunk = chunk[end + 2:]
            out += self._spm["source_spm"].encode(chunk, out_type=str)
        return out

    def encode(self, text: str) -> list[int]:
        """Source ids of a text, EOS appended (the encoder's input); BOS first where the model was trained so
        (prepend_bos: the PyTorch tutorial's sources)."""
        ids = [self.source_vocab.get(p, self.unk_id) for p in self.pieces(text)] + [self.eos_id]
        return [self.source_vocab[self.spec["bos"]], *ids] if self.spec.get("prepend_bos") else ids

    def encode_target(self, text: str) -> list[int]:
        """Target ids of a text (a prefix, a banned word): target pieces, target vocabulary ids (unk outside it),
        no EOS (a prefix is the start of a target; the search appends the end)."""
        unk = self.target_vocab.get(self.spec["unk"], self.unk_id)
        return [self.target_vocab.get(p, unk) for p in self._spm["target_spm"].encode(text, out_type=str)]

    def decode(self, ids) -> str:
        """Text of target ids, special tokens skipped."""
        tokens = []
        for i in ids:
            i = int(i)
            if i in self._skip:
                continue
            token = self._target_tokens.get(i)
            if token is None:                                   # as MarianTokenizer: fall back to the spm piece
                token = self.decode_spm.IdToPiece(i) if 0 <= i < self.decode_spm.GetPieceSize() else ""
                token = token or self.spec["unk"]
            tokens.append(token)
        text = self.decode_spm.decode_pieces(tokens).replace("\u2581", " ").strip()
        return _clean_up_spaces(text) if self.clean_up else text

    def to_dict(self) -> dict:
        return dict(self.spec, type=self.TYPE)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json at path and copy the tokenizer's files beside it."""
        path = Path(path)
        for name in self.files:
            if (self.directory / name).resolve() != (path.parent / name).resolve():
                shutil.copyfile(self.directory / name, path.parent / name)
        path.write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=2) + "\n")


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization (applied only where the model's tokenizer config asks for it)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _read_vocab(path: Path) -> dict[str, int]:
    data = read_json(path, TokenizerError, "copy the model's vocabulary file again")
    if not isinstance(data, dict) or not data or not all(isinstance(v, int) and v >= 0 for v in data.values()):
        raise TokenizerError(f"{path} is not a vocabulary (a JSON object of piece -> id)")
    return data


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer described by a tokenizer.json: a CharTokenizer or a SentencePieceTokenizer."""
    path = Path(path)
    data = read_json(path, TokenizerError, "regenerate it")
    kind = data.get("type") if isinstance(data, dict) else None
    if kind == SentencePieceTokenizer.TYPE:
        needed = ("source_spm", "target_spm", "vocab", "eos", "unk", "pad")
        missing = [k for k in needed if not isinstance(data.get(k), str)]
        if missing:
            raise TokenizerError(f"{path} lacks {', '.join(missing)}; re-import the model")
        for key in ("source_spm", "target_spm", "vocab", "target_vocab"):
            name = data.get(key)
            if name is not None and (not isinstance(name, str) or Path(name).name != name):
                raise TokenizerError(f"{path}: {key} must be a file name beside it, got {name!r}")
        return SentencePieceTokenizer(path.parent, data)
    return CharTokenizer.load(path, data)


def tokenizer_files(tokenizer: Tokenizer) -> list[str]:
    """Names of a tokenizer's files besides tokenizer.json (none for a character tokenizer)."""
    return list(tokenizer.files)
