"""Long texts: split into sentences, and sentences into pieces that fit the model, then join the translations.

    plan = plan_texts(["Monday, 30 November 2026. Then 11/30/26."], tokenizer, max_len=48, lang="en")
    plan.rows                      # token ids of every piece to translate, all texts' pieces in one list
    plan.join(translated_rows)     # one string per text: the pieces' translations with the original whitespace
    plan.join_records(recs, inputs)     # generate's records of the rows -> one record per input and rank

A model translates sentences: it was trained on them, and its source length (max_len tokens) bounds what it can
read. A text longer than a sentence is cut into sentences with sentencex (Wikimedia's rule-based segmenter: about
300 languages through its fallback chains, abbreviation lists per language, no model to download, no dependency,
a small compiled wheel), and every sentence of every text decodes in one batch. The whitespace around and between
sentences is kept as it was and put back around their translations. A sentence still longer than max_len tokens
is cut at whitespace into pieces that fit, and a single word longer than that at token boundaries: nothing is
truncated, every character of the input is translated in some piece. The server's compatible APIs and
`onnxformer generate` (unless --no-split) plan their texts here; sentencex is imported only when a text is split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from runtime.errors import InputError
from toolkit.apps.languages import client_code, model_client_code

_SPACE = re.compile(r"\s+")
_EDGES = re.compile(r"^(\s*)(.*?)(\s*)$", re.DOTALL)


@dataclass
class Plan:
    """The pieces of a batch of texts: `rows` to translate, and per text the template that joins them."""

    rows: list[list[int]]
    templates: list[list[str | int]]        # literal text, or the index of a row whose translation goes there
    cut: list[tuple[int, int, int]] = field(default_factory=list)   # (text, its sentence's tokens, pieces) per
                                            # sentence over max_len, cut into pieces that fit (callers say so)

    def per_row(self, options: dict, lead=()) -> None:
        """Turn per-input target options into per-row ones, in place: an input's prefix (`prefix_ids`, which starts
        with the forced `lead`, a target-language token) starts its first piece only; every later piece still
        starts with `lead`."""
        if "prefix_ids" in options:
            options["prefix_ids"] = tuple(self.first_rows(list(options["prefix_ids"]), tuple(lead)))

    def join(self, translations: list[str]) -> list[str]:
        """One text per input: its template with every row index replaced by that row's translation."""
        return ["".join(part if isinstance(part, str) else translations[part] for part in template)
                for template in self.templates]

    def first_rows(self, values: list, rest) -> list:
        """A value per row: the input's value (one per input) on its first row, `rest` on the rows after it
        (a forced target prefix starts the first piece's translation only)."""
        out = [rest] * len(self.rows)
        for value, template in zip(values, self.templates):
            rows = [part for part in template if isinstance(part, int)]
            if rows:
                out[rows[0]] = value
        return out

    def join_records(self, recs: list[dict], inputs: list) -> list[dict]:
        """generate's records of the rows (runtime.generate.records) -> one record per input and rank: the k-th
        hypotheses of its rows joined by its template (text), concatenated (ids, logprobs), their scores summed
        (for greedy and sampling: the log-probability of the joined ids), finished when all of them are."""
        by_row: dict[int, dict[int, dict]] = {}
        for rec in recs:
            by_row.setdefault(rec["index"], {})[rec["rank"]] = rec
        out = []
        for index, template in enumerate(self.templates):
            rows = [part for part in template if isinstance(part, int)]
            for rank in range(min((len(by_row[r]) for r in rows), default=1)):
                parts = [by_row[r][rank] for r in rows]
                texts = all(p["text"] is not None for p in parts)
                out.append({"input": inputs[index], "index": index, "rank": rank,
                            "text": "".join(p if isinstance(p, str) else by_row[p][rank]["text"] for p in template)
                            if texts else None,
                            "ids": [t for p in parts for t in p["ids"]],
                            "score": round(sum(p["score"] for p in parts), 6),
                            "finished": all(p["finished"] for p in parts),
                            **({"logprobs": [x for p in parts for x in p["logprobs"]]}
                               if parts and "logprobs" in parts[0] else {})})
        return out


def sentences(text: str, lang: str | None) -> list[str]:
    """The text's sentences with their surrounding whitespace ("".join gives the text back). `lang`: the text's
    language, a client's code (en, DE, pt-BR) or a model's own (eng_Latn, de_DE), whose rules (abbreviations) apply;
    None: English's."""
    try:
        from sentencex import segment
    except ImportError:
        raise InputError("splitting texts into sentences needs the sentencex package: pip install sentencex (it comes "
                         "with onnxformer[cpu]), or keep every text whole (generate --no-split)") from None

    parts = list(segment(rules_language(lang), text))
    if "".join(parts) != text:                  # the segmenter lost characters: keep the text whole
        return [text]
    return parts


def rules_language(lang: str | None) -> str:
    """The ISO 639-1 code (zh-hant kept) whose sentence rules apply to text in `lang` (toolkit/apps/languages.py)."""
    if not lang:
        return "en"
    return model_client_code(lang) or client_code(lang)


def plan_texts(texts: list, tokenizer, max_len: int, lang: str | None = None) -> Plan:
    """Rows and templates for `texts`: sentences (sentencex, rules of `lang`), each cut to fit max_len tokens; an
    input of token ids (a list) is one row as it is."""
    plan = Plan([], [])
    for text in texts:
        if not isinstance(text, str):
            plan.rows.append(list(text))
            plan.templates.append([len(plan.rows) - 1])
            continue
        template: list[str | int] = []
        for sentence in sentences(text, lang):
            lead, core, trail = _EDGES.match(sentence).groups()
            template.append(lead)
            if core:
                before = len(plan.rows)
                template.extend(_fit(core, tokenizer, max_len, plan.rows))
                if len(plan.rows) - before > 1:
                    plan.cut.append((len(plan.templates), len(tokenizer.encode(core)), len(plan.rows) - before))
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
