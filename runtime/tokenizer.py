"""Tokenizers stored as tokenizer.json: characters, SentencePiece with a vocabulary (Marian), a Hugging Face
tokenizer.json (BART, mBART, NLLB, Pegasus, T5), or bytes (ByT5: runtime/byte_tokenizer.py), all typed by the
Tokenizer protocol. Torch-free: they ship in
bundles."""

from __future__ import annotations

import copy
import gzip
import json
import re
import shutil
from pathlib import Path
from typing import Protocol, runtime_checkable

from runtime.errors import TokenizerError, read_json

SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: pad, bos, eos (ModelConfig's defaults)


@runtime_checkable
class Tokenizer(Protocol):
    """What every tokenizer of a bundle or checkpoint offers (CharTokenizer, SentencePieceTokenizer,
    FastTokenizer)."""

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


def read_tokenizer_json(path: Path) -> str:
    """The text of a Hugging Face tokenizer.json, stored as is or gzip-compressed (a name ending in .gz: bundles
    since the compact tokenizer, a third of a Unigram model's vocabulary file at most; older bundles keep theirs)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"cannot read {path} ({exc.strerror or exc}); copy the model's tokenizer.json again") \
            from None
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise TokenizerError(f"{path} is not a gzip-compressed tokenizer.json ({exc}); re-import the model") \
                from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenizerError(f"{path} is not UTF-8 text; copy the model's tokenizer.json again") from None


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
    """The tokenizer described by a tokenizer.json: a CharTokenizer, SentencePieceTokenizer, FastTokenizer or
    ByteTokenizer (runtime/byte_tokenizer.py: ByT5's)."""
    from runtime.byte_tokenizer import ByteTokenizer

    path = Path(path)
    data = read_json(path, TokenizerError, "regenerate it")
    kind = data.get("type") if isinstance(data, dict) else None
    if kind == ByteTokenizer.TYPE:
        return ByteTokenizer(data)
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
    if kind == FastTokenizer.TYPE:
        name = data.get("file")
        if not isinstance(name, str) or Path(name).name != name or not all(isinstance(data.get(k), str)
                                                                         for k in ("eos", "pad")):
            raise TokenizerError(f"{path} needs 'file' (a file name beside it), 'eos' and 'pad'; re-import the model")
        return FastTokenizer(path.parent, data)
    return CharTokenizer.load(path, data)


def tokenizer_files(tokenizer: Tokenizer) -> list[str]:
    """Names of a tokenizer's files besides tokenizer.json (none for a character tokenizer)."""
    return list(tokenizer.files)


class FastTokenizer:
    """A Hugging Face fast tokenizer (its tokenizer.json, read by the `tokenizers` library, never transformers; the
    `type` "hf-tokenizers" of our tokenizer.json, loaded by load_tokenizer like the others):
    BART's byte-level BPE, the SentencePiece-derived tokenizers of NLLB, mBART and Pegasus.

    The original's file is kept beside our tokenizer.json as spec["file"] (`source`: where it is read from
    before it is saved there, an imported model's own tokenizer.json). How a source is
    framed is data, not code: spec["source_prefix"] and spec["source_suffix"] are token lists put around the
    text's tokens, where "{src_lang}" stands for spec["src_lang"] (NLLB: ["{src_lang}"] + tokens + ["</s>"];
    mBART-cc25: tokens + ["</s>", "{src_lang}"]; BART: ["<s>"] + tokens + ["</s>"]). decode() skips special
    tokens (the forced target-language token among them).

    A multilingual model's languages are data too: spec["languages"] lists its codes (NLLB's "deu_Latn", mBART's
    "de_DE"), each the token spec["language_token"] names ("{lang}", the default: the code is the token), and
    spec["target_start"] the tokens forced after the decoder start token, where "{tgt_lang}" stands for the target
    language (NLLB, mBART-50: ["{tgt_lang}"]; absent where the target language is not chosen per request).
    for_source(code) is this tokenizer framing sources in another language; target_start_ids(code) the forced ids.
    """

    TYPE = "hf-tokenizers"

    def __init__(self, directory: str | Path, spec: dict, source: str | Path | None = None):
        self.directory, self.spec = Path(directory), dict(spec)
        self.source = Path(source) if source is not None else self.directory / spec["file"]
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError("this model's tokenizer needs the tokenizers package; pip install tokenizers") \
                from None
        text = read_tokenizer_json(self.source)
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as exc:                        # the library raises its own Exception for bad files
            first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
            raise TokenizerError(f"{self.source} is not a Hugging Face tokenizer.json ({first}); copy the model's "
                                 f"tokenizer.json again") from None
        self.languages = tuple(spec.get("languages") or ())
        if not all(isinstance(c, str) for c in self.languages) or not isinstance(spec.get("target_start", []), list):
            raise TokenizerError(f"tokenizer languages must be a list of codes and target_start a list of tokens, got "
                                 f"{spec.get('languages')!r} and {spec.get('target_start')!r}; re-import the model")
        self._frame(spec.get("src_lang"))
        self.eos_id, self.pad_id = (self._ids([spec[k]], k)[0] for k in ("eos", "pad"))
        self.clean_up = bool(spec.get("clean_up_tokenization_spaces", False))

    def _frame(self, src_lang) -> None:
        self.src_lang = src_lang
        names = {"{src_lang}": self.language_token(src_lang)}
        self.prefix, self.suffix = (self._ids(self.spec.get(k, []), k, names) for k in ("source_prefix",
                                                                                     "source_suffix"))

    def language_token(self, code) -> str:
        """The token of a language code (spec["language_token"], "{lang}" by default: the code itself)."""
        return str(self.spec.get("language_token", "{lang}")).replace("{lang}", str(code))

    def for_source(self, src_lang: str) -> "FastTokenizer":
        """This tokenizer framing sources in language `src_lang` (one of self.languages; runtime.request checks)."""
        other = copy.copy(self)
        other._frame(src_lang)
        return other

    def target_start_ids(self, tgt_lang: str | None) -> list[int] | None:
        """The ids forced after the decoder start for target language tgt_lang (spec["target_start"]); None when
        the target language is not chosen per request."""
        if "target_start" not in self.spec:
            return None
        return self._ids(self.spec["target_start"], "target_start", {"{tgt_lang}": self.language_token(tgt_lang)})

    def _ids(self, tokens, key: str, names: dict | None = None) -> list[int]:
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError(f"tokenizer {key} must be a list of tokens, got {tokens!r}; re-import the model")
        ids = []
        for token in tokens:
            for name, value in (names or {}).items():
                token = token.replace(name, value)
            i = self._tok.token_to_id(token)
            if i is None:
                raise TokenizerError(f"{self.source} has no token {token!r} (tokenizer "
                                     f"{key}); re-import the model or choose a source language it has")
            ids.append(i)
        return ids

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def src_vocab_size(self) -> int:
        """One vocabulary for both sides."""
        return self.vocab_size

    @property
    def files(self) -> list[str]:
        return [self.spec["file"]]

    def encode(self, text: str) -> list[int]:
        """Source ids of a text: the framing's prefix, the text's tokens, the framing's suffix."""
        return self.prefix + self._tok.encode(text, add_special_tokens=False).ids + self.suffix

    def special_tokens(self) -> list[str]:
        """The original's special added tokens, in id order (an importer finds language codes among them)."""
        return [t.content for _, t in sorted(self._tok.get_added_tokens_decoder().items()) if t.special]

    def encode_target(self, text: str) -> list[int]:
        """Target ids of a text (a prefix, a banned word): its tokens, no framing (one vocabulary for both sides)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """Text of target ids, special tokens skipped. Ids past the tokenizer's last token decode to nothing, as
        `tokenizers` and transformers decode them: a model may have more rows than tokens (T5's checkpoints: 32128
        rows, 32100 tokens) and its search may pick one; a negative id is an error."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if i < 0]
        if bad:
            raise TokenizerError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        text = self._tok.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=True)
        return _clean_up_spaces(text) if self.clean_up else text

    def to_dict(self) -> dict:
        return dict(self.spec, type=self.TYPE)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json at path and copy the original's file beside it."""
        path = Path(path)
        target = path.parent / self.spec["file"]
        if self.source.resolve() != target.resolve():
            if target.suffix == ".gz" and self.source.suffix != ".gz":
                # mtime 0: the same tokenizer gives the same bytes (the manifest hashes them)
                target.write_bytes(gzip.compress(self.source.read_bytes(), compresslevel=9, mtime=0))
            elif target.suffix != ".gz" and self.source.suffix == ".gz":
                target.write_bytes(gzip.decompress(self.source.read_bytes()))
            else:
                shutil.copyfile(self.source, target)
        path.write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=2) + "\n")
