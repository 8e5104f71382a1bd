"""ByT5's tokenizer: UTF-8 bytes as ids, no vocabulary file (our tokenizer.json's `type` "bytes").

    id = byte + offset                 # offset 3: <pad> 0, </s> 1, <unk> 2 come first
    "héllo" -> [107, 198, 172, 111, 111, 114, 1]       # é is two bytes; </s> ends every source

As transformers' ByT5Tokenizer does it: the text is first split on its added tokens (the specials and the
<extra_id_N> sentinels, each one id), a token marked lstrip / rstrip swallowing the whitespace before / after it;
the pieces between become bytes; </s> is appended unless the ids already end with it. decode() skips the special
ids and joins the rest's bytes, dropping what is not valid UTF-8. Torch-free and dependency-free: it ships in
bundles.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from runtime.errors import TokenizerError
from runtime.tokenizer import _clean_up_spaces

BYTES = 256


class ByteTokenizer:
    """UTF-8 bytes shifted by spec["offset"], with spec["added"] tokens ({content, id, lstrip, rstrip, special})."""

    TYPE = "bytes"

    def __init__(self, spec: dict):
        self.spec = dict(spec)
        added = spec.get("added")
        if not isinstance(spec.get("offset"), int) or not isinstance(added, list) or not all(
                isinstance(a, dict) and isinstance(a.get("content"), str) and isinstance(a.get("id"), int)
                for a in added):
            raise TokenizerError("a byte tokenizer needs 'offset' (an integer) and 'added' (tokens with content and "
                                 "id); re-import the model")
        self.offset = spec["offset"]
        self.added = {a["content"]: a for a in added}
        self.special_ids = {a["id"] for a in added if a.get("special", True)}
        self.eos_id, self.pad_id = (self._id(spec.get(k), k) for k in ("eos", "pad"))
        names = sorted(self.added, key=len, reverse=True)             # the longest token first, as a trie matches
        self._split = re.compile("|".join(re.escape(n) for n in names)) if names else None

    def _id(self, token, key: str) -> int:
        if token not in self.added:
            raise TokenizerError(f"byte tokenizer {key} {token!r} is not one of its added tokens; re-import the model")
        return self.added[token]["id"]

    @property
    def vocab_size(self) -> int:
        return max(self.offset + BYTES, *(a["id"] + 1 for a in self.added.values()))

    @property
    def src_vocab_size(self) -> int:
        """One vocabulary for both sides."""
        return self.vocab_size

    @property
    def files(self) -> list[str]:
        """None: bytes need no vocabulary."""
        return []

    def pieces(self, text: str) -> list[str | int]:
        """The text split on added tokens: strings between them, and each added token's id."""
        if self._split is None:
            return [text]
        out: list[str | int] = []
        rest = 0
        for match in self._split.finditer(text):
            token = self.added[match.group()]
            before = text[rest:match.start()]
            out += [before.rstrip() if token.get("lstrip") else before, token["id"]]
            rest = match.end()
            if token.get("rstrip"):
                rest += len(text[rest:]) - len(text[rest:].lstrip())
        return out + [text[rest:]]

    def encode_target(self, text: str) -> list[int]:
        """Ids of a text: its added tokens and bytes, no end token."""
        ids: list[int] = []
        for piece in self.pieces(text):
            ids += [piece] if isinstance(piece, int) else [b + self.offset for b in piece.encode("utf-8")]
        return ids

    def encode(self, text: str) -> list[int]:
        """Source ids of a text, ending with </s> (not added twice where the text ends with it)."""
        ids = self.encode_target(text)
        return ids if ids and ids[-1] == self.eos_id else ids + [self.eos_id]

    def decode(self, ids) -> str:
        """Text of target ids: special ids skipped, the bytes of the rest, invalid UTF-8 dropped."""
        by_id = {a["id"]: a["content"] for a in self.added.values()}
        out = b""
        for i in (int(i) for i in ids):
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            if i in self.special_ids:
                continue
            if i in by_id:
                out += by_id[i].encode("utf-8")
            elif self.offset <= i < self.offset + BYTES:
                out += bytes([i - self.offset])
        text = out.decode("utf-8", errors="ignore")
        return _clean_up_spaces(text) if self.spec.get("clean_up_tokenization_spaces") else text

    def to_dict(self) -> dict:
        return dict(self.spec, type=self.TYPE)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=2) + "\n")
