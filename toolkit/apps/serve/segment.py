"""Long texts: split into sentences, and sentences into pieces that fit the model, then join the translations.

    plan = plan_texts(["Monday, 30 November 2026. Then 11/30/26."], tokenizer, max_len=48, lang="en")
    plan.rows                      # token ids of every piece to translate, all texts' pieces in one list
    plan.join(translated_rows)     # one string per text: the pieces' translations with the original whitespace

A model translates sentences: it was trained on them, and its source length (max_len tokens) bounds what it can
read. A text longer than a sentence is cut into sentences with sentencex (Wikimedia's rule-based segmenter: about
300 languages through its fallback chains, abbreviation lists per language, no model to download, no dependency,
a small compiled wheel), and every sentence of every text decodes in one batch. The whitespace around and between
sentences is kept as it was and put back around their translations. A sentence still longer than max_len tokens
is cut at whitespace into pieces that fit, and a single word longer than that at token boundaries: nothing is
truncated, every character of the input is translated in some piece.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SPACE = re.compile(r"\s+")
_EDGES = re.compile(r"^(\s*)(.*?)(\s*)$", re.DOTALL)


@dataclass
class Plan:
    """The pieces of a batch of texts: `rows` to translate, and per text the template that joins them."""

    rows: list[list[int]]
    templates: list[list[str | int]]        # literal text, or the index of a row whose translation goes there

    def join(self, translations: list[str]) -> list[str]:
        """One text per input: its template with every row index replaced by that row's translation."""
        return ["".join(part if isinstance(part, str) else translations[part] for part in template)
                for template in self.templates]


def sentences(text: str, lang: str | None) -> list[str]:
    """The text's sentences with their surrounding whitespace ("".join gives the text back)."""
    from sentencex import segment

    parts = list(segment(lang or "en", text))
    if "".join(parts) != text:                  # the segmenter lost characters: keep the text whole
        return [text]
    return parts


def plan_texts(texts: list[str], tokenizer, max_len: int, lang: str | None = None) -> Plan:
    """Rows and templates for `texts`: sentences (sentencex, rules of `lang`), each cut to fit max_len tokens."""
    plan = Plan([], [])
    for text in texts:
        template: list[str | int] = []
        for sentence in sentences(text, lang):
            lead, core, trail = _EDGES.match(sentence).groups()
            template.append(lead)
            if core:
                template.extend(_fit(core, tokenizer, max_len, plan.rows))
            template.append(trail)
        plan.templates.append([part for part in template if part != ""])
    return plan


def _fit(sentence: str, tokenizer, max_len: int, rows: list[list[int]]) -> list[str | int]:
    """Template parts for one sentence, appending its rows: whole if it fits, else whitespace-separated pieces
    packed up to max_len tokens each, and a word longer than max_len cut into max_len-token rows."""
    ids = tokenizer.encode(sentence)
    if len(ids) <= max_len:
        rows.append(ids)
        return [len(rows) - 1]
    words = _SPACE.split(sentence)
    gaps = _SPACE.findall(sentence)
    parts: list[str | int] = []
    piece = ""
    for i, word in enumerate(words):
        candidate = word if not piece else piece + gaps[i - 1] + word
        if piece and len(tokenizer.encode(candidate)) > max_len:
            parts += _fit(piece, tokenizer, max_len, rows) + [gaps[i - 1]]
            piece = word
        else:
            piece = candidate
        if len(tokenizer.encode(piece)) > max_len:                # one word over max_len: cut at token boundaries
            word_ids = tokenizer.encode(piece)
            for start in range(0, len(word_ids), max_len):
                rows.append(word_ids[start:start + max_len])
                parts.append(len(rows) - 1)
            piece = ""
            if i < len(gaps):
                parts.append(gaps[i])
    if piece:
        parts += _fit(piece, tokenizer, max_len, rows)
    return parts
