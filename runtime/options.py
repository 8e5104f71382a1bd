"""A search's options and its result, and the one check of every option.

    opts = SearchOptions(max_new_tokens=32, beam=4)       # the defaults are plain greedy search
    check_options(opts, inputs, vocab_size, max_len, eos)   # InputError naming the option and its range

runtime.search re-exports these names: SearchOptions is the one options dataclass; every control is a field.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.errors import InputError


@dataclass
class Hypothesis:
    """One generated sequence: token ids (without the start token, with EOS if reached) and its score."""

    tokens: list[int]
    score: float                  # sum of chosen tokens' log-probabilities, divided by len ** length_penalty (beam)
    finished: bool = True         # ended with EOS (False: stopped at max_new_tokens)
    logprobs: list[float] | None = None   # return_logprobs: each token's log-probability under the model


@dataclass
class SearchOptions:
    """Every control of one search (validated by `check_options`). The defaults are plain greedy search."""

    max_new_tokens: int = 64      # tokens chosen after the prefix
    beam: int = 1                 # 1 = greedy (or sampling)
    length_penalty: float = 1.0   # beam scores are log-prob / len ** length_penalty
    num_return: int = 1           # hypotheses returned per input (<= beam; sampling: that many samples)
    ignore_eos: bool = False      # never stop at EOS (benchmarks: every engine does the same work)
    forced_eos: bool | None = None  # a target reaching max_new_tokens ends with EOS, forced and not scored
                                    # (transformers' forced_eos_token_id); None: the model's own (Request.build)
    suppress: tuple[int, ...] = ()  # token ids never generated (the model's, e.g. Marian's pad; set by generate_ids)
    begin_suppress: tuple[int, ...] = ()  # ids not generated as the first token after the prefix (Whisper's
                                          # begin_suppress_tokens; the model's, set by Request.build)
    timestamps: int | None = None   # Whisper: the id of <|0.00|>, the first timestamp token: timestamp rules on
                                    # (runtime.processors.timestamp_rules); None = off
    max_initial_timestamp: int | None = None   # with timestamps: the first timestamp's largest index (50 = 1.00 s)
    sample: bool = False          # draw each token at random from the (warped) distribution instead of the best
    temperature: float = 1.0      # sampling: logits / temperature
    top_k: int = 0                # sampling: only the k most likely tokens (0 = all)
    top_p: float = 1.0            # sampling: only the most likely tokens whose probability reaches top_p (1 = all)
    seed: int | None = None       # sampling: the request's seed (None: fresh entropy, not reproducible)
    repetition_penalty: float = 1.0   # > 1 makes tokens already in the target less likely (transformers' rule)
    no_repeat_ngram_size: int = 0     # no n-gram of this size occurs twice in a target (0 = off)
    min_new_tokens: int = 0           # EOS is not chosen before this many tokens after the prefix
    bad_words_ids: tuple[tuple[int, ...], ...] = ()   # token sequences never generated
    prefix_ids: tuple[tuple[int, ...], ...] = ()      # per input: the target's first tokens, forced (() = none)
    prefix_counted: int = 0           # leading prefix tokens beam lengths count (a forced target-language token)
    start_id: int | None = None       # the decoder's first input token (None: the model's decoder start token;
                                      # Whisper's <|startofprev|> before a text prompt: runtime.transcribe)
    return_logprobs: bool = False     # give each hypothesis its tokens' log-probabilities
    shortlist: bool = True            # decode on the bundle's vocabulary shortlist, where it has one
    seed_index: tuple[int, ...] = ()  # sampling, per input: the index its generator is seeded by (() = its position
                                      # here; a part of a split request gives its inputs' positions in the whole)


MAX_LENGTH_PENALTY = 10.0            # |length_penalty| above this overflows len ** lp and means nothing anyway
MAX_SAMPLES = 64                     # samples per input (num_return with sample)
MAX_TEMPERATURE = MAX_PENALTY = 100.0
SEED_RANGE = 2 ** 63                 # seeds are ints in [0, 2**63)


def check_options(opts: SearchOptions, inputs: int, vocab_size: int, max_len: int, eos: int) -> None:
    """Refuse options the search cannot honour for `inputs` inputs to a model of this target vocabulary size,
    max_len and end token: InputError naming the option and its range. The one check of every option."""
    if not 0 <= opts.max_new_tokens <= max_len:
        raise InputError(f"max new tokens must be between 0 and the model's maximum length {max_len}, "
                         f"got {opts.max_new_tokens}")
    if opts.beam < 1:
        raise InputError(f"beam width must be at least 1, got {opts.beam}")
    lp = opts.length_penalty
    if not isinstance(lp, (int, float)) or not -MAX_LENGTH_PENALTY <= lp <= MAX_LENGTH_PENALTY:   # NaN fails too
        raise InputError(f"length penalty must be a number between {-MAX_LENGTH_PENALTY:g} and "
                         f"{MAX_LENGTH_PENALTY:g} (1.0 divides a beam's log-probability by its length), got {lp!r}")
    for name in ("sample", "return_logprobs", "ignore_eos", "shortlist"):
        if not isinstance(getattr(opts, name), (bool, np.bool_)):
            raise InputError(f"{name} must be true or false, got {getattr(opts, name)!r}")
    if opts.forced_eos is not None and not isinstance(opts.forced_eos, (bool, np.bool_)):
        raise InputError(f"forced_eos must be true, false or unset (the model's own), got {opts.forced_eos!r}")
    if opts.forced_eos and opts.ignore_eos:
        raise InputError("forced_eos ends a target with EOS at the length limit, ignore_eos never lets it end: "
                         "give one of them")
    _check_sampling(opts, inputs, vocab_size)
    _number("repetition_penalty", opts.repetition_penalty, 0, MAX_PENALTY, low_open=True, what="1 is off")
    _number("no_repeat_ngram_size", opts.no_repeat_ngram_size, 0, max_len, integer=True, what="0 is off")
    _number("min_new_tokens", opts.min_new_tokens, 0, max_len, integer=True)
    for i, seq in enumerate(opts.bad_words_ids):
        _ids(f"bad_words_ids[{i}]", seq, vocab_size, empty=False)
        if list(seq) == [eos]:
            raise InputError(f"bad_words_ids[{i}] bans the end token {eos} alone, so no target could end; "
                             f"use min_new_tokens to delay it")
    _check_prefixes(opts, inputs, vocab_size, max_len, eos)
    if opts.start_id is not None:
        _number("start_id", opts.start_id, 0, vocab_size - 1, integer=True, what="the decoder's first input token")
    _check_timestamps(opts, vocab_size, eos)


def _check_timestamps(opts: SearchOptions, vocab_size: int, eos: int) -> None:
    """timestamps: an id past the end token, inside the vocabulary; max_initial_timestamp only with it."""
    if opts.timestamps is None:
        if opts.max_initial_timestamp is not None:
            raise InputError("max_initial_timestamp limits the first timestamp; set timestamps too (or drop it)")
        return
    _number("timestamps", opts.timestamps, eos + 2, vocab_size - 1, integer=True,
            what="the id of the first timestamp token, after <|notimestamps|>")
    if opts.max_initial_timestamp is not None:
        _number("max_initial_timestamp", opts.max_initial_timestamp, 0, vocab_size, integer=True)


def _check_sampling(opts: SearchOptions, inputs: int, vocab_size: int) -> None:
    """With sample: the sampling options in range; without it: num_return within the beam, no sampling option set."""
    if opts.sample:
        if opts.beam != 1:
            raise InputError(f"sample draws one token at a time (beam 1), got beam {opts.beam}; drop beam or sample")
        _number("num_return", opts.num_return, 1, MAX_SAMPLES, integer=True, what="with sample: samples per input")
        _number("temperature", opts.temperature, 0, MAX_TEMPERATURE, low_open=True)
        _number("top_k", opts.top_k, 0, vocab_size, integer=True, what="0 keeps every token")
        _number("top_p", opts.top_p, 0, 1, low_open=True, what="1 keeps every token")
        if opts.seed is not None:
            _number("seed", opts.seed, 0, SEED_RANGE - 1, integer=True)
        if opts.seed_index:
            if len(opts.seed_index) != inputs:
                raise InputError(f"seed_index must give one index per input ({inputs}), got {len(opts.seed_index)}")
            for i, index in enumerate(opts.seed_index):
                _number(f"seed_index[{i}]", index, 0, SEED_RANGE - 1, integer=True)
    else:
        if not 1 <= opts.num_return <= opts.beam:
            raise InputError(f"number of returned hypotheses ({opts.num_return}) must be between 1 and the beam "
                             f"width ({opts.beam})")
        unset = (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("seed", None), ("seed_index", ()))
        for name, default in unset:
            if getattr(opts, name) != default:
                raise InputError(f"{name} shapes sampling only; set sample (or leave {name} at {default})")


def _check_prefixes(opts: SearchOptions, inputs: int, vocab_size: int, max_len: int, eos: int) -> None:
    """prefix_ids: one per input, token ids in the vocabulary, no end token, room left for the new tokens."""
    if opts.prefix_counted and not opts.prefix_ids:
        raise InputError(f"prefix_counted ({opts.prefix_counted}) counts prefix tokens, but there is no prefix_ids")
    if opts.prefix_ids:
        if len(opts.prefix_ids) != inputs:
            raise InputError(f"prefix_ids must give one prefix per input ({inputs}), got {len(opts.prefix_ids)}; "
                             f"use an empty prefix for inputs without one")
        if opts.max_new_tokens == 0:
            raise InputError("prefix_ids need max_new_tokens of at least 1 (the tokens chosen after the prefix)")
        for i, prefix in enumerate(opts.prefix_ids):
            _ids(f"prefix_ids[{i}]", prefix, vocab_size, empty=True)
            if eos in prefix:
                raise InputError(f"prefix_ids[{i}] holds the end token {eos}; a prefix is the start of a target, "
                                 f"without it")
            if not 0 <= opts.prefix_counted <= len(prefix):
                raise InputError(f"prefix_counted must be between 0 and the length of prefix_ids[{i}] "
                                 f"({len(prefix)}), got {opts.prefix_counted!r}")
            if len(prefix) + opts.max_new_tokens > max_len:
                raise InputError(f"prefix_ids[{i}] has {len(prefix)} tokens: with max_new_tokens "
                                 f"{opts.max_new_tokens} the target passes the model's maximum length "
                                 f"{max_len}; shorten the prefix or lower max_new_tokens")


def _number(name: str, value, low, high, integer: bool = False, low_open: bool = False, what: str = "") -> None:
    """InputError unless value is an integer (or number) in [low, high] ((low, high] with low_open)."""
    ok = isinstance(value, (int, np.integer)) if integer else isinstance(value, (int, float, np.number))
    ok = ok and not isinstance(value, bool) and (value > low if low_open else value >= low) and value <= high
    if not ok:                                                         # NaN too: every comparison fails
        raise InputError(f"{name} must be {'an integer' if integer else 'a number'} in {'(' if low_open else '['}"
                         f"{low:g}, {high if integer else f'{high:g}'}]{f' ({what})' if what else ''}, got {value!r}")


def _ids(name: str, ids, vocab_size: int, empty: bool) -> None:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__") or (not empty and len(ids) == 0):
        raise InputError(f"{name} must be a {'' if empty else 'non-empty '}list of token ids, got {ids!r}")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size]
    if bad:
        raise InputError(f"{name} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size}); "
                         f"use ids below {vocab_size}")


def ends_with_eos(opts: SearchOptions, default: bool = False) -> bool:
    """Whether a target that reaches its limit ends with a forced EOS: opts.forced_eos, or where it is unset the
    model's `default` (never with ignore_eos)."""
    return bool(default if opts.forced_eos is None else opts.forced_eos) and not opts.ignore_eos


def start_token(opts: SearchOptions, bos: int) -> int:
    """The token a search feeds the decoder first: opts.start_id, or the model's decoder start token `bos`."""
    return bos if opts.start_id is None else int(opts.start_id)


def max_steps(opts: SearchOptions) -> int:
    """The most decoder steps a search takes: the longest prefix, then max_new_tokens."""
    return opts.max_new_tokens + max((len(p) for p in opts.prefix_ids), default=0)


def rows_per_input(opts: SearchOptions) -> int:
    """How many decoder rows each input takes: its beams, or its samples."""
    return opts.num_return if opts.sample else opts.beam
