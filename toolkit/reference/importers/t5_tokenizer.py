"""The tokenizer of a T5 directory, as the runtime keeps it (registers no family: t5.py's convert calls it).

    tokenizer.json                    -> FastTokenizer, sources framed `tokens </s>` (bart.family_tokenizer)
    spiece.model only (mT5, older t5) -> converted offline by transformers' T5Tokenizer into a tokenizer.json
    ByT5Tokenizer (no vocabulary)     -> runtime.byte_tokenizer.ByteTokenizer, its added tokens as data
"""

from __future__ import annotations

from pathlib import Path

from toolkit.reference.config import ModelConfig
from toolkit.reference.importers.registry import ImportRefused
from toolkit.reference.importers.sources import quiet_from_pretrained, read_json, require_transformers

BYTE_TOKENIZERS = ("ByT5Tokenizer",)


def tokenizer_class(directory: Path) -> str:
    """tokenizer_config.json's tokenizer_class without "Fast" ("" without one)."""
    path = directory / "tokenizer_config.json"
    return str(read_json(path).get("tokenizer_class") or "").removesuffix("Fast") if path.is_file() else ""


def t5_tokenizer(directory: Path, config: ModelConfig, work: Path):
    """The runtime tokenizer of a T5 directory (None without one), its eos and pad ids checked against config's."""
    from toolkit.reference.importers.bart import family_tokenizer

    directory = Path(directory)
    if tokenizer_class(directory) in BYTE_TOKENIZERS:
        tok = byte_tokenizer(directory)
    elif (directory / "tokenizer.json").is_file():
        tok = family_tokenizer(directory, config)
    elif (directory / "spiece.model").is_file():
        tok = family_tokenizer(directory, config, converted(directory, work))
    else:
        return None
    if (tok.eos_id, tok.pad_id) != (config.eos_id, config.pad_id):
        raise ImportRefused(f"{directory}: the tokenizer's eos and pad ids ({tok.eos_id}, {tok.pad_id}) differ from "
                            f"config.json's ({config.eos_id}, {config.pad_id})")
    return tok


def converted(directory: Path, work: Path) -> Path:
    """A tokenizer.json made offline from spiece.model by transformers' T5Tokenizer, in work/; its directory."""
    transformers = require_transformers(f"importing {directory}'s spiece.model (no tokenizer.json beside it)")
    try:
        tok = quiet_from_pretrained(transformers.T5Tokenizer.from_pretrained, directory)
    except Exception as exc:                         # a broken or foreign SentencePiece file
        raise ImportRefused(f"{directory}/spiece.model cannot be read as T5's SentencePiece model ({exc})") from None
    out = work / "t5-tokenizer"
    tok.save_pretrained(str(out))
    if not (out / "tokenizer.json").is_file():
        raise ImportRefused(f"{directory}: transformers wrote no tokenizer.json for spiece.model")
    return out


def byte_tokenizer(directory: Path):
    """ByT5's tokenizer: its added tokens (specials and sentinels, with their ids and stripping) read by
    transformers' ByT5Tokenizer, bytes shifted past the specials."""
    from runtime.byte_tokenizer import ByteTokenizer
    from runtime.errors import TokenizerError

    transformers = require_transformers(f"importing {directory}'s ByT5 tokenizer")
    theirs = quiet_from_pretrained(transformers.ByT5Tokenizer.from_pretrained, directory)
    special = set(theirs.all_special_ids)
    added = [{"content": t.content, "id": i, "lstrip": bool(t.lstrip), "rstrip": bool(t.rstrip),
              "special": i in special} for i, t in sorted(theirs.added_tokens_decoder.items())]
    spec = {"offset": theirs.offset, "added": added, "eos": str(theirs.eos_token), "pad": str(theirs.pad_token),
            "clean_up_tokenization_spaces": bool(getattr(theirs, "clean_up_tokenization_spaces", False))}
    try:
        return ByteTokenizer(spec)
    except TokenizerError as exc:
        raise ImportRefused(f"{directory}: {exc}") from None
