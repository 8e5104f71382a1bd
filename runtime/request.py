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
  SOURCE vocabulary (a model may have separate source and target vocabularies). An audio encoder's (Whisper's:
  the engine's feature_shape) inputs are log-mel feature arrays of exactly that shape [n_mels, frames], finite;
  `sequences` then holds them as float32 arrays;
- the options: max_new_tokens in [0, max_len], beam, num_return, length_penalty; token ids the search acts on
  (`suppress`) inside the TARGET vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from numbers import Integral
from typing import Protocol, Sequence

from runtime.errors import InputError, SourceTooLong
from runtime.options import check_options as check_search_options
from runtime.options import ends_with_eos
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
    forced_eos: bool                # targets end with EOS at the length limit unless a request says otherwise
    max_len: int
    # optional (getattr): feature_shape, (n_mels, frames) of an audio encoder's input (runtime.spec.feature_shape);
    # begin_suppress_ids, ids never generated first after the prefix (runtime.spec.begin_suppressed_ids)


def search_options(model: Model, max_new_tokens: int | None = None, **options) -> SearchOptions:
    """SearchOptions from named options (SearchOptions' field names: the CLI's flags, the server's JSON fields);
    max_new_tokens None: min(64, max_len), the one default, less the longest prefix (so that the target fits).
    Values are checked by Request.build."""
    room = model.max_len - max((len(p) for p in options.get("prefix_ids", ())), default=0)
    limit = max(min(DEFAULT_MAX_NEW_TOKENS, room), 0) if max_new_tokens is None else max_new_tokens
    return SearchOptions(max_new_tokens=limit, **options)


def target_options(tokenizer, inputs: int, prefix=None, prefix_ids=None, bad_words=None,
                   bad_words_ids=None, lead: Sequence[int] = ()) -> dict:
    """The SearchOptions fields `prefix_ids` and `bad_words_ids` (tuples of id tuples) from what an edge was given:
    `prefix` a text for every input or a list of texts, one per input; `prefix_ids` id lists, one per input;
    `bad_words` texts; `bad_words_ids` id lists. Texts are encoded on the target side without EOS
    (tokenizer.encode_target). `lead`: ids forced before every prefix (the target language, `languages`), counted
    in beam lengths but never scored (prefix_counted). Only the fields given are returned; the ids are checked by
    Request.build."""
    out = {}
    if prefix is not None and prefix_ids is not None:
        raise InputError("give a prefix as text (prefix) or as ids (prefix_ids), not both")
    if prefix is not None:
        texts = [prefix] * inputs if isinstance(prefix, str) else list(prefix)
        prefix_ids = [encode_target(tokenizer, "prefix", i, text, "prefix_ids") for i, text in enumerate(texts)]
    if lead:
        prefix_ids = [[*lead, *p] for p in (prefix_ids if prefix_ids is not None else [()] * inputs)]
        out["prefix_counted"] = len(lead)
    if prefix_ids is not None:
        out["prefix_ids"] = tuple(tuple(p) for p in prefix_ids)
    if bad_words is not None or bad_words_ids is not None:
        words = [encode_target(tokenizer, "bad_words", i, w, "bad_words_ids") for i, w in enumerate(bad_words or [])]
        out["bad_words_ids"] = tuple(tuple(w) for w in [*(bad_words_ids or []), *words])
    return out


def languages(tokenizer, src_lang: str | None = None, tgt_lang: str | None = None) -> tuple[object, list[int]]:
    """(the tokenizer framing sources in src_lang, the ids forced first on the target for tgt_lang: `lead` of
    target_options) for a request; a model without languages gets (tokenizer, []). A multilingual model needs
    tgt_lang where its target language is chosen per request; src_lang defaults to the one it was imported with.
    InputError for a missing or unknown code, or a language given to a model without languages."""
    codes = tuple(getattr(tokenizer, "languages", ()) or ())
    per_request = bool(codes) and tokenizer.spec.get("target_start") is not None
    for field, code in (("src_lang", src_lang), ("tgt_lang", tgt_lang)):
        if code is not None and not codes:
            raise InputError(f"{field} {code!r} was given, but this model has no languages to choose (it is not "
                             f"multilingual); drop {field} (--{field.replace('_', '-')})")
        if code is not None and code not in codes:
            near = _near(code, codes)
            raise InputError(f"unknown {field} {code!r}" + (f"; did you mean {', '.join(near)}?" if near else "") +
                             f" ({_listed(codes)})")
    if tgt_lang is not None and not per_request:
        raise InputError(f"tgt_lang {tgt_lang!r} was given, but this model's target language is fixed (its decoder "
                         f"start token); drop tgt_lang (--tgt-lang)")
    if per_request and tgt_lang is None:
        raise InputError(f"this model is multilingual: give the target language, tgt_lang (--tgt-lang), e.g. "
                         f"{', '.join(_examples(codes))} ({_listed(codes)})")
    framed = tokenizer.for_source(src_lang) if src_lang is not None else tokenizer
    return framed, (tokenizer.target_start_ids(tgt_lang) if per_request else [])


EXAMPLES = ("deu_Latn", "eng_Latn", "fra_Latn", "de_DE", "en_XX", "fr_XX", "de", "en", "fr")   # shown first


def _examples(codes: Sequence[str]) -> list[str]:
    return [c for c in EXAMPLES if c in codes][:3] or list(codes[:3])


def _near(code: str, codes: Sequence[str]) -> list[str]:
    import difflib

    low = code.lower()
    same = [c for c in codes if c.lower().startswith(low.split("_")[0])]      # deu, de-DE -> deu_Latn, de_DE
    return (same or difflib.get_close_matches(code, codes, n=3, cutoff=0.6))[:3]


def _listed(codes: Sequence[str]) -> str:
    return f"{len(codes)} codes: onnxformer inspect BUNDLE lists them"


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
        at most opts.max_new_tokens. The model's own suppressed ids join opts.suppress, and an unset forced_eos
        becomes the model's own (its forced_eos; off with ignore_eos)."""
        inputs = list(inputs)
        opts = search_options(model) if opts is None else opts
        forced = ends_with_eos(opts, getattr(model, "forced_eos", False)) if opts.forced_eos is None else opts.forced_eos
        begin = tuple(sorted({*opts.begin_suppress, *getattr(model, "begin_suppress_ids", ())}))
        opts = replace(opts, suppress=tuple(sorted({*opts.suppress, *model.suppress_ids})), forced_eos=forced,
                       begin_suppress=begin)
        shape = getattr(model, "feature_shape", None)
        if shape is None:
            sequences = encode_inputs(inputs, tokenizer)
            check_sources(sequences, model)
        else:
            sequences = feature_inputs(inputs, shape)
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
        request whose inputs have different prefixes (prefix_ids) or that samples (each input's generator is seeded
        by its index in its request) decodes alone: its key is its own. Inputs that share one prefix (a target
        language) batch with other requests' inputs of that prefix."""
        prefixes = set(self.opts.prefix_ids)
        if len(prefixes) > 1 or self.opts.sample:
            return ("alone", id(self))
        own = (*PER_INPUT, "prefix_ids") if self.opts.beam == 1 else ("prefix_ids",)
        key = tuple((f.name, getattr(self.opts, f.name)) for f in fields(self.opts) if f.name not in own)
        return key + (("prefix", next(iter(prefixes), None)),)


def merge(requests: Sequence[Request]) -> Request:
    """One request of the inputs of validated requests with equal batch keys, in order, each with its limit."""
    first = requests[0]
    if any(r.batch_key != first.batch_key for r in requests):
        raise ValueError("only requests with equal batch keys decode together")
    limits = [n for r in requests for n in r.limits]
    prefixes = tuple(p for r in requests for p in r.opts.prefix_ids)        # one shared prefix (batch_key)
    opts = replace(first.opts, max_new_tokens=max(limits), prefix_ids=prefixes)
    return Request([x for r in requests for x in r.inputs], [s for r in requests for s in r.sequences], opts, limits)


def split(request: Request, size: int) -> list[Request]:
    """A validated request cut into requests of at most `size` inputs, in order (the inverse of `merge`): each
    keeps its inputs' limits and their share of the options given one per input (PER_INPUT_OPTIONS). A sampling
    request's parts name their inputs' positions in the whole (opts.seed_index), so each input draws what it
    draws unsplit, whatever `size`."""
    from runtime.processors import seed_index

    if size < 1:
        raise InputError(f"batch size must be at least 1, got {size}")
    parts = []
    for start in range(0, len(request.sequences), size):
        end = start + size
        own = {name: getattr(request.opts, name)[start:end] for name in PER_INPUT_OPTIONS
               if getattr(request.opts, name)}
        if request.opts.sample:
            own["seed_index"] = tuple(seed_index(request.opts, i)
                                      for i in range(start, min(end, len(request.sequences))))
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


def feature_inputs(inputs: list, shape: tuple[int, int]) -> list:
    """An audio encoder's inputs as float32 arrays [n_mels, frames]; InputError naming the input, its shape and the
    one the model takes (Whisper pads or cuts every input to 30 s: 3000 frames)."""
    import numpy as np

    if len(inputs) == 0:
        raise InputError("no inputs given; pass at least one log-mel feature array to generate from")
    out = []
    for i, item in enumerate(inputs):
        if isinstance(item, (str, bytes)):
            raise InputError(f"input {i} is text, but this model reads audio: pass log-mel features "
                             f"[{shape[0]}, {shape[1]}] (float32)")
        try:
            array = np.asarray(item, dtype=np.float32)
        except (TypeError, ValueError):
            raise InputError(f"input {i} is not an array of numbers; pass log-mel features "
                             f"[{shape[0]}, {shape[1]}]") from None
        if array.shape != tuple(shape):
            raise InputError(f"input {i} has shape {list(array.shape)}, but this model takes log-mel features of shape "
                             f"[{shape[0]}, {shape[1]}] (n_mels, frames); pad or cut the audio to {shape[1]} frames")
        if not np.isfinite(array).all():
            raise InputError(f"input {i} holds NaN or infinite values; pass finite log-mel features")
        out.append(array)
    return out


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
            raise SourceTooLong(f"input {i} has {len(seq)} tokens, more than the model's maximum source length "
                                f"{model.max_len}; shorten or split it", i, len(seq), model.max_len)
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
    check_target_ids("begin-suppressed", opts.begin_suppress, model)


def check_target_ids(what: str, ids: Sequence[int], model: Model) -> None:
    """Token ids an option gives the search (generated, banned, forced) must be target ids."""
    bad = [int(t) for t in ids if not 0 <= int(t) < model.vocab_size]
    if bad:
        raise InputError(f"{what} token id(s) {bad[:5]} are outside the target vocabulary of {model.vocab_size} "
                         f"ids; use target ids 0..{model.vocab_size - 1}")


__all__ = ["Request", "search_options", "target_options", "languages", "encode_target", "merge", "split",
           "differing", "encode_inputs", "feature_inputs", "token_ids", "check_sources", "check_options", "check_target_ids",
           "DEFAULT_MAX_NEW_TOKENS", "PER_INPUT", "PER_INPUT_OPTIONS"]
