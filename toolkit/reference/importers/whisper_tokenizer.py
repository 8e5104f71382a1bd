"""Whisper's tokenizer: its tokenizer.json through the Hugging Face tokenizer path (runtime.tokenizer.FastTokenizer),
with the prompt recorded as data in its spec.

    tok = whisper_tokenizer(directory, config)     # None without a tokenizer.json
    tok.spec["decoder_prompt"]   # ["<|{tgt_lang}|>", "<|{task}|>", "<|notimestamps|>"] (multilingual) or
                                 # ["<|notimestamps|>"] (.en models): the tokens forced after <|startoftranscript|>
    tok.languages                # ("en", "zh", ...): the codes of its language tokens ("<|en|>": language_token)

Which languages: generation_config.json's lang_to_id where it has one (is_multilingual false: none), else the special
tokens shaped like <|xx|> or <|xxx|>. Sources are not text (the encoder reads features): no source framing. The
special tokens stay available by id (FastTokenizer.decode skips them in text; runtime/speech.py gives the prompt's).
"""

from __future__ import annotations

import re
from pathlib import Path

from toolkit.reference.config import ModelConfig
from toolkit.reference.importers.registry import ImportRefused
from toolkit.reference.importers.sources import read_json

LANGUAGE = re.compile(r"<\|([a-z]{2,3})\|>")            # <|en|>, <|haw|>: a language token
TASKS = ("transcribe", "translate")
NO_TIMESTAMPS = "<|notimestamps|>"


def language_codes(directory: Path, special: list[str]) -> list[str]:
    """The model's language codes in id order: generation_config.json's lang_to_id, else the special tokens."""
    path = directory / "generation_config.json"
    gen = read_json(path) if path.is_file() else {}
    if gen.get("is_multilingual") is False:
        return []
    if isinstance(gen.get("lang_to_id"), dict):
        ordered = sorted(gen["lang_to_id"].items(), key=lambda kv: kv[1])
        return [m[1] for token, _ in ordered if (m := LANGUAGE.fullmatch(token))]
    return [m[1] for t in special if (m := LANGUAGE.fullmatch(t))]


def whisper_tokenizer(directory: Path, config: ModelConfig):
    """The runtime FastTokenizer of a Whisper directory's tokenizer.json (None without one), its prompt and
    languages in its spec; refused where the end token or a prompt token is missing."""
    from runtime.errors import TokenizerError
    from runtime.tokenizer import FastTokenizer

    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer
        raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as exc:
        raise ImportRefused(f"{directory}/tokenizer.json cannot be read ({str(exc)[:120]}); download it again") \
            from None
    eos, pad = raw.id_to_token(config.eos_id), raw.id_to_token(config.pad_id)
    if eos is None or pad is None:
        raise ImportRefused(f"{directory}/tokenizer.json has no token of the end id {config.eos_id} or pad id "
                            f"{config.pad_id} of config.json; it is not this model's tokenizer")
    special = [t.content for _, t in sorted(raw.get_added_tokens_decoder().items()) if t.special]
    codes = language_codes(directory, special)
    prompt = (["<|{tgt_lang}|>", "<|{task}|>"] if codes else []) + [NO_TIMESTAMPS]
    needed = [NO_TIMESTAMPS, *(f"<|{t}|>" for t in (TASKS if codes else ())), *(f"<|{c}|>" for c in codes)]
    absent = [t for t in needed if raw.token_to_id(t) is None]
    if absent:
        raise ImportRefused(f"{directory}/tokenizer.json lacks Whisper's prompt token(s) {', '.join(absent[:4])}; "
                            f"it is not a Whisper tokenizer")
    spec = {"file": "hf_tokenizer.json.gz", "source_prefix": [], "source_suffix": [], "eos": eos, "pad": pad,
            "languages": codes, "language_token": "<|{lang}|>", "decoder_prompt": prompt,
            "tasks": list(TASKS) if codes else [], "clean_up_tokenization_spaces": False}
    try:
        return FastTokenizer(directory, spec, source=directory / "tokenizer.json")
    except TokenizerError as exc:
        raise ImportRefused(f"{directory}: {exc}") from None


__all__ = ["whisper_tokenizer", "language_codes", "TASKS", "NO_TIMESTAMPS"]
