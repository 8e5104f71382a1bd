"""Whisper's decoder prompt: the tokens forced after <|startoftranscript|> (the model's decoder start token).

    prefix = prompt_ids(tokenizer, language="en", task="transcribe")   # [<|en|>, <|transcribe|>, <|notimestamps|>]
    opts = SearchOptions(max_new_tokens=64, prefix_ids=(tuple(prefix),) * len(features))

The prompt is the tokenizer's data (spec["decoder_prompt"], written at import by
toolkit/reference/importers/whisper_tokenizer.py): a multilingual model's is [<|lang|>, <|task|>, <|notimestamps|>],
an English-only model's [<|notimestamps|>]. Language detection and timestamps are not done here.
"""

from __future__ import annotations

from runtime.errors import InputError


def prompt_ids(tokenizer, language: str | None = None, task: str = "transcribe") -> list[int]:
    """The forced prefix ids of a Whisper tokenizer for this language and task; InputError naming the choices for
    a missing or unknown language or task, or a tokenizer without a prompt (not a Whisper model's)."""
    spec = getattr(tokenizer, "spec", None) or {}
    prompt = spec.get("decoder_prompt")
    if prompt is None:
        raise InputError("this model's tokenizer has no Whisper decoder prompt; import a Whisper model")
    codes, tasks = tuple(tokenizer.languages), tuple(spec.get("tasks") or ())
    multilingual = any("{tgt_lang}" in t for t in prompt)
    if not multilingual and language not in (None, "en"):
        raise InputError(f"this Whisper model is English-only; drop language {language!r} (or give 'en')")
    if multilingual and language not in codes:
        shown = ", ".join(codes[:8]) + (", ..." if len(codes) > 8 else "")
        raise InputError(f"give the audio's language, one of {len(codes)} codes ({shown}); got {language!r}")
    if multilingual and task not in tasks:
        raise InputError(f"task must be one of {', '.join(tasks)}, got {task!r}")
    names = {"{tgt_lang}": str(language), "{task}": task}
    return tokenizer._ids(list(prompt), "decoder_prompt", names)


__all__ = ["prompt_ids"]
