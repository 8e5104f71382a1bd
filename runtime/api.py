"""The Python API: a bundle as a `Translator` that generates, scores and streams.

    from runtime import Translator

    translator = Translator("out/demo/dates-int8", provider="cpu", threads=2)
    results = translator.generate(["Monday, 30 November 2026", "11/30/26"], beam=4, num_return=2)
    results[0].texts, results[0].scores            # both hypotheses of the first input, best first
    records = translator.score(["11/30/26"], ["2026-11-30"])            # records[0].score: log p(target | source)
    for piece in translator.stream("Nov 30th 2026"):                   # greedy or sampling, piece by piece
        print(piece, end="", flush=True)

Options are passed by name, as `onnxformer generate` takes them as flags and the server as JSON fields: the
target-side ones (`prefix`, `prefix_ids`, `bad_words`, `bad_words_ids`: the parameters of
runtime.request.target_options) go to target_options, every other one to runtime.request.search_options (the
fields of runtime.search.SearchOptions), then Request.build checks them all, once. So an option added there is an
option here, with no change to this module. A mistake raises the runtime's error (InputError, BundleError, ...)
whose message is the line the command line prints after "error: ".

A PyTorch checkpoint gives the same class through toolkit.reference.api.load_checkpoint_translator.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from difflib import get_close_matches
from pathlib import Path
from typing import TypedDict, Unpack

from runtime.bundle import load_bundle
from runtime.errors import BundleError, InputError
from runtime.generate import Engine, Output, generate, to_outputs
from runtime.request import Request, languages, search_options, split, target_options
from runtime.score import score_texts
from runtime.search import SearchOptions
from runtime.session import check_provider
from runtime.stream import stream

TARGET_OPTIONS = tuple(name for name in inspect.signature(target_options).parameters
                       if name not in ("tokenizer", "inputs", "lead"))  # the options target_options turns into ids
LANGUAGE_OPTIONS = ("src_lang", "tgt_lang")          # a multilingual model's languages (runtime.request.languages)
INTERNAL = ("prefix_counted", "start_id")           # SearchOptions fields set by target_options (or the Whisper
                                                     # transcriber), never by a user


class Options(TypedDict, total=False):
    """The options of `generate` and `stream`, typed for checkers and editors: fields of SearchOptions and
    parameters of runtime.request.target_options (any other of theirs is accepted too, untyped). The README's
    table gives the defaults and ranges; what is not given keeps SearchOptions' default."""

    max_new_tokens: int | None      # None: min(64, max_len), less the longest prefix
    beam: int
    num_return: int
    length_penalty: float
    sample: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    repetition_penalty: float
    no_repeat_ngram_size: int
    min_new_tokens: int
    return_logprobs: bool
    ignore_eos: bool
    forced_eos: bool | None                     # end at max_new_tokens with EOS (None: the model's own setting)
    suppress: Sequence[int]                     # target ids never generated
    prefix: str | Sequence[str]                 # target text every output starts with, or one per input
    prefix_ids: Sequence[Sequence[int]]         # target ids each output starts with, one list per input
    bad_words: Sequence[str]                    # target texts never generated
    bad_words_ids: Sequence[Sequence[int]]      # target id sequences never generated
    src_lang: str                               # a multilingual model's source language code (e.g. eng_Latn)
    tgt_lang: str                               # its target language code, forced first and never scored


@dataclass
class Result:
    """One input's returned hypotheses, best first (each a runtime.generate.Output: the record `onnxformer generate
    --json` prints, without `input`)."""

    input: str | list[int]
    hypotheses: list[Output]

    @property
    def texts(self) -> list[str | None]:
        """Each hypothesis's text (None for models without a tokenizer)."""
        return [h.text for h in self.hypotheses]

    @property
    def ids(self) -> list[list[int]]:
        """Each hypothesis's generated ids, EOS excluded (a prefix included)."""
        return [h.ids for h in self.hypotheses]

    @property
    def scores(self) -> list[float]:
        """Each hypothesis's score: its log-probability (beam search: normalized by length ** length_penalty)."""
        return [h.score for h in self.hypotheses]

    @property
    def logprobs(self) -> list[list[float] | None]:
        """Each hypothesis's token log-probabilities, aligned with `ids` (None unless return_logprobs)."""
        return [h.logprobs for h in self.hypotheses]

    @property
    def text(self) -> str | None:
        """The best hypothesis's text."""
        return self.hypotheses[0].text


@dataclass
class ScoreRecord:
    """One scored (source, target) pair: the record `onnxformer score --json` prints."""

    index: int                      # position of the pair in the call
    source: str | list[int]
    target: str | list[int]
    ids: list[int]                  # the target's ids, EOS appended
    token_logprobs: list[float]     # log p(id | source, earlier ids), one per id
    score: float                    # their sum: log p(target | source)


class Translator:
    """A loaded model that generates, scores and streams: a bundle (ONNX Runtime), or any runtime.generate.Engine
    with its tokenizer (`from_engine`; a PyTorch checkpoint: toolkit.reference.api.load_checkpoint_translator).
    A call keeps its decoding state to itself, so a bundle's translator serves several threads (runtime.ort_engine),
    as the server's engine does."""

    engine: Engine
    tokenizer: object | None        # runtime.tokenizer.Tokenizer; None for models that read and write ids only

    def __init__(self, path: str | Path, provider: str = "auto", threads: int | None = None, **bundle_options):
        """Load the bundle directory `path` (runtime.bundle.load_bundle: provider "auto", "cpu" or "cuda"; threads:
        intra-op threads; any other load_bundle option by name, e.g. io_binding). BundleError when it is missing,
        changed or not a bundle; ProviderError for a provider that is not available."""
        check_provider(provider, threads)
        path = Path(path)
        if (path / "config.json").exists() and not (path / "manifest.json").exists():
            raise BundleError(f"{path} is a checkpoint, not a bundle; load it with toolkit.reference.api."
                              f"load_checkpoint_translator, or export it (onnxformer export {path} --out BUNDLE)")
        self.bundle = load_bundle(path, provider=provider, threads=threads, **bundle_options)
        self.engine, self.tokenizer, self.provider = self.bundle.engine, self.bundle.tokenizer, self.bundle.provider

    @classmethod
    def from_engine(cls, engine: Engine, tokenizer=None, provider: str = "cpu") -> "Translator":
        """A translator over an engine that is already loaded (what `provider` runs it, for display)."""
        translator = cls.__new__(cls)
        translator.bundle, translator.engine, translator.tokenizer = None, engine, tokenizer
        translator.provider = provider
        return translator

    def options(self, inputs: int, **options: Unpack[Options]) -> SearchOptions:
        """The SearchOptions of named options for `inputs` inputs: the target-side ones through target_options, then
        search_options (the default max_new_tokens). Request.build checks the values."""
        return self._prepared(inputs, options)[1]

    def _prepared(self, inputs: int, options: dict) -> tuple[object, SearchOptions]:
        """(the tokenizer framed for src_lang, the SearchOptions) of named options: the languages through
        runtime.request.languages, the target-side options through target_options (the target language's forced
        ids first), the rest through search_options."""
        known = [*(f.name for f in fields(SearchOptions) if f.name not in INTERNAL), *TARGET_OPTIONS,
                 *LANGUAGE_OPTIONS]
        unknown = sorted(set(options) - set(known))
        if unknown:
            close = get_close_matches(unknown[0], known, n=1)
            raise InputError(f"unknown option {unknown[0]!r}{f' (did you mean {close[0]!r}?)' if close else ''}; "
                             f"the options are {', '.join(known)}")
        framed, lead = languages(self.tokenizer, *(options.pop(name, None) for name in LANGUAGE_OPTIONS))
        target = {name: options.pop(name) for name in TARGET_OPTIONS if name in options}
        return framed, search_options(self.engine, **options, **target_options(framed, inputs, lead=lead, **target))

    def request(self, inputs: Sequence[str] | Sequence[Sequence[int]], **options: Unpack[Options]) -> Request:
        """The validated request of `generate` (runtime.request.Request): InputError naming a bad input or option."""
        if isinstance(inputs, str):
            raise InputError("inputs must be a list of texts or token id lists; wrap one text in a list: [text]")
        inputs = list(inputs)
        framed, opts = self._prepared(len(inputs), options)
        return Request.build(self.engine, inputs, framed, opts)

    def generate(self, inputs: Sequence[str] | Sequence[Sequence[int]], *, batch_size: int | None = None,
                 **options: Unpack[Options]) -> list[Result]:
        """Generate for each input (a text, or source token ids): one Result per input, in order, each with
        `num_return` hypotheses, best first. The whole call is checked before any decoding; `batch_size` then
        decodes at most that many inputs at a time (None: all at once), with the same results in fp32, sampling
        included (each input's draws are seeded by its position in the whole call; int8: an activation range spans
        a batch, so scores, and close hypotheses, depend on batch neighbours)."""
        request = self.request(inputs, **options)
        results: list[Result] = []
        for part in split(request, len(request.inputs) if batch_size is None else batch_size):
            outputs = to_outputs(generate(self.engine, part), self.engine.eos_id, self.tokenizer)
            start = len(results)
            results += [Result(source, [replace(out, index=start + i) for out in outputs if out.index == i])
                        for i, source in enumerate(part.inputs)]
        return results

    def score(self, sources: Sequence[str] | Sequence[Sequence[int]],
              targets: Sequence[str] | Sequence[Sequence[int]], *, src_lang: str | None = None,
              tgt_lang: str | None = None) -> list[ScoreRecord]:
        """Score each target given its source (texts, or token id lists), teacher-forced, in one batch: one
        ScoreRecord per pair, in order (runtime.score.score_texts, as `onnxformer score --json`); a multilingual
        model's target language is fed first and not scored."""
        if isinstance(sources, str) or isinstance(targets, str):
            raise InputError("sources and targets must be lists; wrap one text in a list: [text]")
        records = score_texts(self.engine, self.tokenizer, sources, targets, src_lang, tgt_lang)
        return [ScoreRecord(**record) for record in records]

    def stream(self, source: str | Sequence[int], **options: Unpack[Options]) -> Iterator[str]:
        """The text of one output (greedy or sampling) piece by piece as it is generated; the pieces joined are
        `generate`'s text for the same input and options (runtime.stream). Checked before the first piece."""
        framed, opts = self._prepared(1, options)
        return stream(self.engine, framed, source, opts)

    def __repr__(self) -> str:
        where = self.bundle.path if self.bundle is not None else type(self.engine).__name__
        return f"Translator({str(where)!r}, provider={self.provider!r})"


__all__ = ["Translator", "Result", "ScoreRecord", "Options", "TARGET_OPTIONS", "LANGUAGE_OPTIONS"]
