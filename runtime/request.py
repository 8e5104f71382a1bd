"""One generation request: inputs and search options, validated once against the model, then never rebuilt.

    opts = search_options(engine, beam=4, max_new_tokens=None)       # None: the one default, min(64, max_len)
    request = Request.build(engine, ["Monday, 30 November 2026"], tokenizer, opts)   # InputError if bad
    hyps = runtime.generate.generate(engine, request)

Every edge builds its requests here: the command line, the HTTP server (before a request is queued, so a bad one
never reaches a batch), Ray, and Python's runtime.generate.generate_ids. Nothing downstream copies options field by
field: a scheduler batches requests whose `batch_key` is equal (every search option except the ones an input keeps
for itself) and `merge`s them into one request, each input keeping its own limit.

What is checked, once:
- the inputs: at least one; none empty (a blank text included); at most max_len tokens; source ids inside the
  SOURCE vocabulary (a model may have separate source and target vocabularies);
- the options: max_new_tokens in [0, max_len], beam, num_return, length_penalty; token ids the search acts on
  (`suppress`) inside the TARGET vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from numbers import Integral
from typing import Protocol, Sequence

from runtime.errors import InputError
from runtime.options import check_options as check_search_options
from runtime.search import SearchOptions

DEFAULT_MAX_NEW_TOKENS = 64          # most new tokens when a request names none (capped at the model's max_len)
PER_INPUT = ("max_new_tokens",)      # greedy options each input of a merged batch keeps for itself (`limits`)
PER_INPUT_OPTIONS = ("prefix_ids",)  # SearchOptions fields that give one value per input (cut by `split`)


class Model(Protocol):
    """What validation needs of an engine (runtime.generate.Engine has it all)."""

    vocab_size: int                 # target vocabulary (logits)
    src_vocab_size: int             # source vocabulary (input ids)
    suppress_ids: tuple[int, ...]   # ids the model never generates
    eos_id: int                     # the end token (options may not ban it alone or hold it in a prefix)
    max_len: int


def search_options(model: Model, max_new_tokens: int | None = None, **options) -> SearchOptions:
    """SearchOptions from named options (SearchOptions' field names: the CLI's flags, the server's JSON fields);
    max_new_tokens None: min(64, max_len), the one default, less the longest prefix (so that the target fits).
    Values are checked by Request.build."""
    room = model.max_len - max((len(p) for p in options.get("prefix_ids", ())), default=0)
    limit = max(min(DEFAULT_MAX_NEW_TOKENS, room), 0) if max_new_tokens is None else max_new_tokens
    return SearchOptions(max_new_tokens=limit, **options)


def target_options(tokenizer, inputs: int, prefix=None, prefix_ids=None, bad_words=None,
                   bad_words_ids=None) -> dict:
    """The SearchOptions fields `prefix_ids` and `bad_words_ids` (tuples of id tuples) from what an edge was given:
    `prefix` a text for every input or a list of texts, one per input; `prefix_ids` id lists, one per input;
    `bad_words` texts; `bad_words_ids` id lists. Texts are encoded on the target side without EOS
    (tokenizer.encode_target). Only the fields given are returned; the ids are checked by Request.build."""
    out = {}
    if prefix is not None and prefix_ids is not None:
        raise InputError("give a prefix as text (prefix) or as ids (prefix_ids), not both")
    if prefix is not None:
        texts = [prefix] * inputs if isinstance(prefix, str) else list(prefix)
        prefix_ids = [encode_target(tokenizer, "prefix", i, text, "prefix_ids") for i, text in enumerate(texts)]
    if prefix_ids is not None:
        out["prefix_ids"] = tuple(tuple(p) for p in prefix_ids)
    if bad_words is not None or bad_words_ids is not None:
        words = [encode_target(tokenizer, "bad_words", i, w, "bad_words_ids") for i, w in enumerate(bad_words or [])]
        out["bad_words_ids"] = tuple(tuple(w) for w in [*(bad_words_ids or []), *words])
    return out


def encode_target(tokenizer, what: str, i: int, text: str, ids_field: str) -> list[int]:
    """Target ids of the i-th text of option `what`; InputError when the tokenizer cannot encode target text."""
    if not isinstance(text, str):
        raise InputError(f"{what}[{i}] must be a text, got {text!r}")
    if what == "bad_words" and not text.strip():
        raise InputError(f"{what}[{i}] is blank; give words to ban, or drop it")
    if tokenizer is None or not hasattr(tokenizer, "encode_target"):
        raise InputError(f"{what} is text, but this model's tokenizer cannot encode target text; pass target token "
                         f"ids instead ({ids_field})")
    return tokenizer.encode_target(text)


@dataclass(frozen=True, eq=False)
class Request:
    """Validated inputs and options. Build it with Request.build (or merge validated ones); never by hand."""

    inputs: list                    # as given: texts or token id lists (answers echo them)
    sequences: list[list[int]]      # each input's source token ids
    opts: SearchOptions             # the search's options (a merged request: max_new_tokens = the largest limit)
    limits: list[int]               # each input's own max_new_tokens

    @classmethod
    def build(cls, model: Model, inputs: Sequence, tokenizer=None, opts: SearchOptions | None = None,
              limits: Sequence[int] | None = None) -> "Request":
        """Encode and check `inputs` (texts, or token id lists) for `model`; InputError naming the input or option
        and the fix. `opts` default: search_options(model). `limits`: each input's own max_new_tokens (greedy),
        at most opts.max_new_tokens. The model's own suppressed ids join opts.suppress."""
        inputs = list(inputs)
        opts = search_options(model) if opts is None else opts
        opts = replace(opts, suppress=tuple(sorted({*opts.suppress, *model.suppress_ids})))
        sequences = encode_inputs(inputs, tokenizer)
        check_sources(sequences, model)
        check_options(opts, model, len(sequences))
        limits = [opts.max_new_tokens] * len(sequences) if limits is None else [int(n) for n in limits]
        if len(limits) != len(sequences) or any(not 0 <= n <= opts.max_new_tokens for n in limits) or \
                (opts.beam != 1 and len(set(limits)) > 1):
            raise ValueError("limits must give one max_new_tokens per input, each in [0, opts.max_new_tokens] "
                             "(beam search: all equal)")
        return cls(inputs, sequences, opts, limits)

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys decode in one search: every option but those an input keeps for itself. A
        request with per-input options (prefix_ids) or sampling (each input's generator is seeded by its index in
        its request) decodes alone: its key is its own."""
        if self.opts.prefix_ids or self.opts.sample:
            return ("alone", id(self))
        own = PER_INPUT if self.opts.beam == 1 else ()
        return tuple((f.name, getattr(self.opts, f.name)) for f in fields(self.opts) if f.name not in own)


def merge(requests: Sequence[Request]) -> Request:
    """One request of the inputs of validated requests with equal batch keys, in order, each with its limit."""
    first = requests[0]
    if any(r.batch_key != first.batch_key for r in requests):
        raise ValueError("only requests with equal batch keys decode together")
    limits = [n for r in requests for n in r.limits]
    opts = replace(first.opts, max_new_tokens=max(limits))
    return Request([x for r in requests for x in r.inputs], [s for r in requests for s in r.sequences], opts, limits)


def split(request: Request, size: int) -> list[Request]:
    """A validated request cut into requests of at most `size` inputs, in order (the inverse of `merge`): each
    keeps its inputs' limits and their share of the options given one per input (PER_INPUT_OPTIONS). Sampling
    seeds each input's draws by its position in its own request, so sampled draws depend on `size`."""
    if size < 1:
        raise InputError(f"batch size must be at least 1, got {size}")
    parts = []
    for start in range(0, len(request.sequences), size):
        end = start + size
        own = {name: getattr(request.opts, name)[start:end] for name in PER_INPUT_OPTIONS
               if getattr(request.opts, name)}
        parts.append(Request(request.inputs[start:end], request.sequences[start:end], replace(request.opts, **own),
                             request.limits[start:end]))
    return parts


def differing(opts: SearchOptions, base: SearchOptions, own: Sequence[str] = ()) -> list[str]:
    """The options of `opts` that differ from `base`, other than `own` ones (what a batch row keeps for itself)."""
    return [f.name for f in fields(opts) if f.name not in own and getattr(opts, f.name) != getattr(base, f.name)]


def encode_inputs(inputs: list, tokenizer) -> list[list[int]]:
    """Token ids of every input; text needs a tokenizer, and a blank text is no input."""
    seqs = []
    for i, item in enumerate(inputs):
        if not isinstance(item, str):
            seqs.append(token_ids("input", i, item))
        elif not item.strip():
            raise InputError(f"input {i} is empty; every input needs at least one token (a text that is not blank)")
        elif tokenizer is None:
            raise InputError(f"input {i} is text, but this model has no tokenizer (tokenizer.json); pass token ids "
                             f"instead (--ids \"5 6 7\" on the command line, \"ids\" in a server request)")
        else:
            seqs.append(tokenizer.encode(item))
    return seqs


def token_ids(what: str, i: int, item) -> list[int]:
    """The i-th `what` (input, target) given as token ids, as a list; InputError when it is not a list of integers
    (a Python caller's mistake: the command line and the server give nothing else)."""
    ids = list(item) if hasattr(item, "__iter__") and not isinstance(item, (str, bytes)) else None
    if ids is None or any(isinstance(t, bool) or not isinstance(t, Integral) for t in ids):
        raise InputError(f"{what} {i} is neither a text nor a list of token ids (integers): {item!r:.80}; pass "
                         f"texts or id lists")
    return ids


def check_sources(sequences: Sequence[Sequence[int]], model: Model) -> None:
    """Refuse source ids the encoder cannot take, naming the input and the fix; nothing is silently truncated."""
    if len(sequences) == 0:
        raise InputError("no inputs given; pass at least one text (or --ids) to generate from")
    vocab = model.src_vocab_size
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise InputError(f"input {i} is empty; every input needs at least one token")
        if len(seq) > model.max_len:
            raise InputError(f"input {i} has {len(seq)} tokens, more than the model's maximum source length "
                             f"{model.max_len}; shorten or split it")
        bad = [int(t) for t in seq if not 0 <= int(t) < vocab]
        if bad:
            raise InputError(f"input {i} has token id(s) {bad[:5]} outside the source vocabulary of {vocab} ids; "
                             f"use source ids 0..{vocab - 1}")


def check_options(opts: SearchOptions, model: Model, inputs: int = 1) -> None:
    """Refuse options the search cannot honour on this model for `inputs` inputs, naming the option and its range
    (runtime.options.check_options, the one check of every decoding control), and suppressed ids outside the target
    vocabulary."""
    check_search_options(opts, inputs, model.vocab_size, model.max_len, model.eos_id)
    check_target_ids("suppressed", opts.suppress, model)


def check_target_ids(what: str, ids: Sequence[int], model: Model) -> None:
    """Token ids an option gives the search (generated, banned, forced) must be target ids."""
    bad = [int(t) for t in ids if not 0 <= int(t) < model.vocab_size]
    if bad:
        raise InputError(f"{what} token id(s) {bad[:5]} are outside the target vocabulary of {model.vocab_size} "
                         f"ids; use target ids 0..{model.vocab_size - 1}")


__all__ = ["Request", "search_options", "target_options", "encode_target", "merge", "split", "differing",
           "encode_inputs", "token_ids", "check_sources", "check_options", "check_target_ids",
           "DEFAULT_MAX_NEW_TOKENS", "PER_INPUT", "PER_INPUT_OPTIONS"]
