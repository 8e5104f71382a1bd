"""Request and answer bodies of the HTTP API, and the limits a server puts on a request.

A request body is checked in two steps: its shape and types here (pydantic, strict: no string for a number,
no unknown field), then its values against the model and the server's limits (`Limits.check`, using the same
`runtime.generate.check_request` as `onnxformer generate`), so both say the same thing about the same mistake.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.errors import InputError
from runtime.generate import check_request
from runtime.search import SearchOptions


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


class Record(BaseModel):
    """One returned hypothesis: the record `onnxformer generate --json` prints."""

    input: str | list[int]
    index: int
    rank: int
    text: str | None
    ids: list[int]
    score: float
    finished: bool


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

    def check(self, request: GenerateRequest, sequences: list[list[int]], vocab_size: int,
              max_len: int) -> SearchOptions:
        """The request's SearchOptions, or an InputError naming the bad value and the allowed range."""
        if len(sequences) > self.max_inputs:
            raise InputError(f"too many inputs: {len(sequences)}, this server takes at most {self.max_inputs} "
                             f"in one request; split the request")
        if not 1 <= request.beam <= self.max_beam:
            raise InputError(f"beam must be between 1 and {self.max_beam}, got {request.beam}")
        max_new = min(64, max_len) if request.max_new_tokens is None else request.max_new_tokens
        opts = SearchOptions(max_new_tokens=max_new, beam=request.beam, num_return=request.num_return,
                             length_penalty=request.length_penalty, ignore_eos=request.ignore_eos)
        check_request(sequences, opts, vocab_size, max_len)
        return opts


def parse_request(body: bytes) -> GenerateRequest:
    """The request from a JSON body; a ValueError with one line naming the problem otherwise."""
    try:
        request = GenerateRequest.model_validate_json(body)
    except ValidationError as exc:
        raise ValueError(describe(exc)) from None
    if (request.inputs is None) == (request.ids is None):
        raise ValueError('give exactly one of "inputs" (texts) and "ids" (token id lists)')
    return request


def describe(exc: ValidationError) -> str:
    """One line for the first problem pydantic found: which field, what is wrong, what it should be."""
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    kind = err["type"]
    if kind == "json_invalid":
        return f"the body is not valid JSON ({err['ctx'].get('error', 'parse error')}); send a JSON object"
    if kind == "extra_forbidden":
        known = ", ".join(GenerateRequest.model_fields)
        return f"unknown field {where!r}; the fields are: {known}"
    if kind in ("model_type", "model_attributes_type"):
        return "the body must be a JSON object such as {\"inputs\": [\"text\"]}"
    return f"field {where!r}: {err['msg']} (got {_short(err.get('input'))})"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
