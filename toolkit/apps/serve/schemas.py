"""Request and answer bodies of the HTTP API, and the limits a server puts on a request.

A request body is checked in two steps: its shape and types here (pydantic, strict: no string for a number,
no unknown field), then its values against the server's limits and the model (`Limits.request`: the same
`runtime.request.Request.build` as `onnxformer generate`), so both say the same thing about the same mistake.
Every field but `model`, `inputs`, `ids`, `stream` and the target-side ones (TARGET: `prefix`, `prefix_ids`,
`bad_words`, `bad_words_ids`, turned into SearchOptions fields by runtime.request.target_options, as on the command
line) is a runtime.search.SearchOptions field of the same name: a new search option is one field here, passed on by
name. `src_lang` and `tgt_lang` (a multilingual model's codes) go to runtime.request.languages, as
--src-lang/--tgt-lang.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.errors import InputError
from runtime.request import Request, languages, search_options, target_options
from runtime.stream import check_streamable
from toolkit.apps.segment import Plan, plan_texts

TARGET = ("prefix", "prefix_ids", "bad_words", "bad_words_ids")   # fields given to runtime.request.target_options


class GenerateRequest(BaseModel):
    """POST /v1/generate: texts (`inputs`) or token id lists (`ids`), and the search options."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="the served model to use (required when the server serves several)")
    inputs: list[str] | None = Field(None, description="texts to generate from (the bundle needs a tokenizer)")
    ids: list[list[int]] | None = Field(None, description="token id lists to generate from")
    beam: int = Field(1, description="beam width (1 = greedy)")
    max_new_tokens: int | None = Field(None, description="most tokens generated per input [default: min(64, max_len)]")
    num_return: int = Field(1, description="hypotheses returned per input (<= beam)")
    length_penalty: float = Field(1.0, description="beam scores are log-prob / length ** this")
    ignore_eos: bool = Field(False, description="never stop at EOS: generate exactly max_new_tokens (benchmarks)")
    forced_eos: bool | None = Field(None, description="end an output that reaches max_new_tokens with the end token "
                                                      "(transformers' forced_eos_token_id) [default: the model's own]")
    sample: bool = Field(False, description="draw each token at random instead of taking the most likely")
    temperature: float = Field(1.0, description="sampling: logits / temperature")
    top_k: int = Field(0, description="sampling: only the k most likely tokens (0 = all)")
    top_p: float = Field(1.0, description="sampling: the most likely tokens reaching this probability (1 = all)")
    seed: int | None = Field(None, description="sampling: the seed (reproducible draws; default fresh entropy)")
    repetition_penalty: float = Field(1.0, description="> 1 makes tokens already generated less likely")
    no_repeat_ngram_size: int = Field(0, description="no n-gram of this size occurs twice in an output (0 = off)")
    min_new_tokens: int = Field(0, description="no end token before this many new tokens")
    return_logprobs: bool = Field(False, description="each record carries `logprobs`, one per returned id")
    shortlist: bool = Field(True, description="decode on the bundle's vocabulary shortlist where it has one (false: "
                                              "the whole vocabulary)")
    prefix: str | list[str] | None = Field(None, description="target text every output starts with, or one per input")
    prefix_ids: list[list[int]] | None = Field(None, description="target ids each output starts with, one list per "
                                                                 "input")
    bad_words: list[str] | None = Field(None, description="target texts never generated")
    bad_words_ids: list[list[int]] | None = Field(None, description="target id sequences never generated")
    src_lang: str | None = Field(None, description="a multilingual model's source language code, e.g. fra_Latn "
                                                   "[default: the one it was imported with]")
    tgt_lang: str | None = Field(None, description="a multilingual model's target language code, e.g. deu_Latn "
                                                   "(required by NLLB and mBART-50 bundles)")
    split: bool = Field(False, description="cut each text into sentences (and those into pieces that fit the "
                                           "model), decode them in one batch and join their outputs with the "
                                           "text's whitespace, as /translate, /v2/translate and `onnxformer "
                                           "generate` do (not with stream)")
    stream: bool = Field(False, description="answer text/event-stream: an event per step with each input's new ids "
                                            "and text, then a final one with the outputs (greedy or sample, "
                                            "num_return 1)")

    def options(self) -> dict:
        """The search options it names (SearchOptions' fields), for runtime.request.search_options; the TARGET
        fields go to runtime.request.target_options."""
        return self.model_dump(exclude={"model", "inputs", "ids", "stream", "split", "src_lang", "tgt_lang", *TARGET})

    def check(self) -> None:
        if (self.inputs is None) == (self.ids is None):
            raise ValueError('give exactly one of "inputs" (texts) and "ids" (token id lists)')


class Pair(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    source: str
    target: str


class ScoreRequest(BaseModel):
    """POST /v1/score: (source, target) pairs as `pairs`, as `source` and `target` text lists, or as `source_ids`
    and `target_ids` token id lists (a target without the end token: it is appended)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="the served model to use (required when the server serves several)")
    pairs: list[Pair] | None = Field(None, description='[{"source": text, "target": text}, ...]')
    source: list[str] | None = Field(None, description="source texts (with `target`: one target per source)")
    target: list[str] | None = Field(None, description="target texts, the i-th scored given the i-th source")
    source_ids: list[list[int]] | None = Field(None, description="source token id lists (with `target_ids`)")
    target_ids: list[list[int]] | None = Field(None, description="target token id lists, without the end token")
    src_lang: str | None = Field(None, description="a multilingual model's source language code [default: the one "
                                                   "it was imported with]")
    tgt_lang: str | None = Field(None, description="a multilingual model's target language code: fed first, not "
                                                   "scored (required by NLLB and mBART-50 bundles)")

    def check(self) -> None:
        forms = [self.pairs is not None, self.source is not None or self.target is not None,
                 self.source_ids is not None or self.target_ids is not None]
        if sum(forms) != 1:
            raise ValueError('give exactly one of "pairs", "source" with "target", and "source_ids" with '
                             '"target_ids"')
        sources, targets = self.sides()
        if sources is None or targets is None:
            raise ValueError('"source" needs "target" (and "source_ids" needs "target_ids"): one target per source')

    def sides(self) -> tuple[list, list]:
        """(sources, targets): texts, or token id lists."""
        if self.pairs is not None:
            return [p.source for p in self.pairs], [p.target for p in self.pairs]
        if self.source is not None or self.target is not None:
            return self.source, self.target
        return self.source_ids, self.target_ids


class Record(BaseModel):
    """One returned hypothesis: the record `onnxformer generate --json` prints."""

    input: str | list[int]
    index: int
    rank: int
    text: str | None
    ids: list[int]
    score: float
    finished: bool
    logprobs: list[float] | None = Field(None, description="with return_logprobs only: one per id")


class GenerateResponse(BaseModel):
    outputs: list[Record]
    queue_ms: float = Field(description="time the request waited before its batch started")
    total_ms: float = Field(description="time from arrival to answer")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; the server refuses more with a 4xx naming the limit."""

    max_inputs: int = 32            # inputs in one request (the server's --max-batch)
    max_beam: int = 8
    max_body_bytes: int = 1 << 20   # request body size (413 above it)

    def request(self, body: GenerateRequest, model, tokenizer) -> tuple[Request, Plan | None]:
        """The validated request and, with "split", the Plan that joins its rows' records back into one per input
        (toolkit.apps.segment, as `onnxformer generate` plans them); an InputError naming the bad value and the
        allowed range."""
        inputs = body.inputs if body.inputs is not None else body.ids
        if len(inputs) > self.max_inputs:
            raise InputError(f"too many inputs: {len(inputs)}, this server takes at most {self.max_inputs} "
                             f"in one request; split the request")
        if not 1 <= body.beam <= self.max_beam:
            raise InputError(f"beam must be between 1 and {self.max_beam}, got {body.beam}")
        if body.split and body.stream:
            raise InputError('"split" decodes a text\'s sentences as separate rows, which "stream" does not send; '
                             'stream without split (one sentence an input), or split without stream')
        tokenizer, lead = languages(tokenizer, body.src_lang, body.tgt_lang)
        targets = target_options(tokenizer, len(inputs), lead=lead, **{name: getattr(body, name) for name in TARGET})
        plan = None
        if body.split and body.inputs is not None and tokenizer is not None:
            plan = plan_texts(list(inputs), tokenizer, model.max_len, body.src_lang)
            inputs = plan.rows
            if len(inputs) > self.max_inputs:
                raise InputError(f"too many sentences: the texts split into {len(inputs)} pieces, this server "
                                 f"decodes at most {self.max_inputs} in one request; send fewer texts at once")
            plan.per_row(targets, lead)
        request = Request.build(model, inputs, tokenizer, search_options(model, **body.options(), **targets))
        if body.stream:
            check_streamable(request.opts)
        return request, plan


def parse_request(body: bytes, schema=GenerateRequest):
    """The request (a GenerateRequest, or ScoreRequest) from a JSON body; a ValueError with one line naming the
    problem otherwise."""
    try:
        request = schema.model_validate_json(body)
    except ValidationError as exc:
        raise ValueError(describe(exc, schema)) from None
    request.check()
    return request


def describe(exc: ValidationError, schema=GenerateRequest) -> str:
    """One line for the first problem pydantic found: which field, what is wrong, what it should be."""
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    kind = err["type"]
    if kind == "json_invalid":
        return f"the body is not valid JSON ({err['ctx'].get('error', 'parse error')}); send a JSON object"
    if kind == "extra_forbidden":
        known = ", ".join(schema.model_fields)
        return f"unknown field {where!r}; the fields are: {known}"
    if kind in ("model_type", "model_attributes_type"):
        return "the body must be a JSON object such as {\"inputs\": [\"text\"]}"
    return f"field {where!r}: {err['msg']} (got {_short(err.get('input'))})"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
