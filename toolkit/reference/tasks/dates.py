"""The `dates` example task: normalize a date written in common English and numeric formats to ISO 8601.

    "Monday, 30 November 2026", "11/30/26", "30.11.2026", "Nov 30th 2026"  ->  "2026-11-30"

Conventions, one per separator, so that no numeric format is ambiguous:
    slashes, year last     M/D/Y   (US)          11/30/2026, 11/30/26, 1/5/2026
    slashes, 4-digit year first  Y/M/D           2026/11/30
    dashes, 4-digit year first   Y-M-D (ISO)     2026-11-30;  no separator: 20261130
    dashes, year last      M-D-Y   (US)          11-30-2026 (4-digit year only)
    dots                   D.M.Y   (European)    30.11.2026, 30.11.26
Two-digit years: 50-99 -> 1950-1999, 00-49 -> 2000-2049 (the task's range is 1950-2049).
Month names: full ("November"), three letters ("Nov", "Nov.", "NOV"), and "Sept"; weekdays are
ignored by the model's target but always written correctly in the generated data.

Data: dates from 1950-01-01 to 2049-12-31. A fixed seed picks 1,000 held-out dates; training
examples are drawn only from the other dates, so held-out accuracy measures generalization to
unseen dates (each rendered in a random format).
"""

from __future__ import annotations

import datetime as dt
from typing import Callable, Iterator, Sequence

import numpy as np

from runtime.tokenizer import CharTokenizer

FIRST_DAY, LAST_DAY = dt.date(1950, 1, 1), dt.date(2049, 12, 31)
N_DAYS = (LAST_DAY - FIRST_DAY).days + 1                  # 36,525 dates
HELD_OUT_SEED, HELD_OUT_SIZE = 20261130, 1000
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
# every character any format can produce, plus the rest of the alphabet (unusual casing tokenizes, too)
CHARS = "0123456789 ,./-" + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MAX_SOURCE_LEN = 48                                       # longest input the example model accepts
TARGET_LEN = 10                                           # "YYYY-MM-DD"

Rng = np.random.Generator


def expand_year(yy: int) -> int:
    """The two-digit-year rule: 50-99 -> 19yy, 00-49 -> 20yy."""
    return 1900 + yy if yy >= 50 else 2000 + yy


def iso(d: dt.date) -> str:
    return d.isoformat()


# --- pieces ---------------------------------------------------------------------------------------

def _num(n: int, rng: Rng, pad_prob: float = 0.5) -> str:
    """A day or month number, zero-padded or not."""
    return f"{n:02d}" if n < 10 and rng.random() < pad_prob else str(n)


def _yy(d: dt.date) -> str:
    return f"{d.year % 100:02d}"


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st, 22nd, 23rd, 31st."""
    suffix = "th" if 11 <= n % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _month(d: dt.date, rng: Rng) -> str:
    """Full name (half the time), or an abbreviation: Nov, Nov., NOV, Sept."""
    full = MONTHS[d.month - 1]
    r = rng.random()
    if r < 0.5:
        return full
    if d.month == 9 and r < 0.6:
        return "Sept"
    short = full[:3]
    if r < 0.7:
        return short + "." if short != full else short                   # "Nov.", but never "May."
    return short.upper() if r < 0.8 else short


def _abbr(d: dt.date) -> str:
    return MONTHS[d.month - 1][:3]


def _weekday(d: dt.date, rng: Rng) -> str:
    name = WEEKDAYS[d.weekday()]
    return name if rng.random() < 0.6 else name[:3]


# --- formats: name -> renderer; the README's table lists one example of each ----------------------

FORMATS: dict[str, Callable[[dt.date, Rng], str]] = {
    "iso":                lambda d, r: d.isoformat(),                                            # 2026-11-30
    "iso_basic":          lambda d, r: d.strftime("%Y%m%d"),                                     # 20261130
    "ymd_slash":          lambda d, r: f"{d.year}/{d.month:02d}/{d.day:02d}",                    # 2026/11/30
    "us_slash":           lambda d, r: f"{_num(d.month, r)}/{_num(d.day, r)}/{d.year}",          # 11/30/2026
    "us_slash_short":     lambda d, r: f"{_num(d.month, r)}/{_num(d.day, r)}/{_yy(d)}",          # 11/30/26
    "us_dash":            lambda d, r: f"{d.month:02d}-{d.day:02d}-{d.year}",                    # 11-30-2026
    "eu_dot":             lambda d, r: f"{_num(d.day, r)}.{_num(d.month, r)}.{d.year}",          # 30.11.2026
    "eu_dot_short":       lambda d, r: f"{_num(d.day, r)}.{_num(d.month, r)}.{_yy(d)}",          # 30.11.26
    "month_day_year":     lambda d, r: f"{_month(d, r)} {d.day}{',' if r.random() < 0.7 else ''} {d.year}",
    "month_ordinal_year": lambda d, r: f"{_month(d, r)} {ordinal(d.day)}{',' if r.random() < 0.5 else ''} {d.year}",
    "day_month_year":     lambda d, r: f"{_num(d.day, r, 0.2)} {_month(d, r)} {d.year}",         # 30 Nov 2026
    "ordinal_month_year": lambda d, r: f"{ordinal(d.day)}{' of' if r.random() < 0.5 else ''} {_month(d, r)} {d.year}",
    "day_mon_dash":       lambda d, r: f"{d.day:02d}-{_abbr(d).upper() if r.random() < 0.5 else _abbr(d)}-{d.year}",
    "weekday_day_month":  lambda d, r: f"{_weekday(d, r)}, {d.day} {_month(d, r)} {d.year}",     # Monday, 30 November 2026
    "weekday_month_day":  lambda d, r: f"{_weekday(d, r)}, {_month(d, r)} {d.day}, {d.year}",    # Monday, November 30, 2026
    "ctime":              lambda d, r: f"{WEEKDAYS[d.weekday()][:3]} {_abbr(d)} {d.day:02d} {d.year}",  # Mon Nov 30 2026
    "rfc":                lambda d, r: f"{WEEKDAYS[d.weekday()][:3]}, {d.day:02d} {_abbr(d)} {d.year}",  # Mon, 30 Nov 2026
}


def render(d: dt.date, fmt: str, rng: Rng) -> str:
    """The date written in format `fmt` (random variants drawn from rng)."""
    return FORMATS[fmt](d, rng)


def day(index: int) -> dt.date:
    return FIRST_DAY + dt.timedelta(days=int(index))


def held_out_days(seed: int = HELD_OUT_SEED, size: int = HELD_OUT_SIZE) -> np.ndarray:
    """Indices (days since 1950-01-01) of the held-out dates, never used for training."""
    return np.sort(np.random.default_rng(seed).choice(N_DAYS, size=size, replace=False))


def training_days(seed: int = HELD_OUT_SEED) -> np.ndarray:
    """Indices of every date not held out."""
    return np.setdiff1d(np.arange(N_DAYS), held_out_days(seed))


def make_examples(days: np.ndarray, seed: int) -> list[tuple[str, str]]:
    """(source, ISO target) pairs, one per day, formats cycling in a seeded shuffled order."""
    rng = np.random.default_rng(seed)
    names = list(FORMATS)
    out = []
    for i, idx in enumerate(days):
        if i % len(names) == 0:
            rng.shuffle(names)
        d = day(idx)
        out.append((render(d, names[i % len(names)], rng), iso(d)))
    return out


def held_out_examples() -> list[tuple[str, str]]:
    """The 1,000 held-out (source, target) pairs: fixed dates, every format about equally often."""
    return make_examples(held_out_days(), seed=HELD_OUT_SEED + 1)


def owns(tokenizer) -> bool:
    """Whether a tokenizer is this task's: the dates model's vocabulary is exactly CHARS."""
    return "".join(getattr(tokenizer, "chars", ())) == CHARS


def parity_inputs(tokenizer, max_len: int, samples: int) -> list[list[int]]:
    """Up to `samples` held-out sources (of the 1,000) as token ids, those that fit max_len: parity's inputs."""
    texts = [src for src, _ in held_out_examples()]
    return [tokenizer.encode(t) for t in texts if len(t) <= max_len][:samples]


def make_tokenizer() -> CharTokenizer:
    """Digits, the separators " ,./-" and both cases of the alphabet: 67 characters, 70 ids with the specials."""
    return CharTokenizer(CHARS)


def date_batches(tokenizer: CharTokenizer, batch: int, seed: int) -> Iterator:
    """Endless training batches (src [B, S], mask [B, S], BOS + target + EOS [B, T]) of non-held-out dates."""
    from toolkit.reference.train import pad_targets

    rng = np.random.default_rng(seed)
    pool, names = training_days(), list(FORMATS)
    weights = np.array([RECIPE["format_weights"].get(n, 1.0) for n in names])
    bos, eos, pad = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
    while True:
        days = rng.choice(pool, size=batch)
        fmts = rng.choice(len(names), size=batch, p=weights / weights.sum())
        pairs = [(render(day(i), names[f], rng), iso(day(i))) for i, f in zip(days, fmts)]
        src = pad_targets([tokenizer.encode(s) for s, _ in pairs], pad)
        tgt = pad_targets([[bos] + tokenizer.encode(t) + [eos] for _, t in pairs], pad)
        yield src, (src != pad).long(), tgt


def normalize(engine, tokenizer: CharTokenizer, texts: Sequence[str], batch_size: int = 250,
              beam: int = 1) -> list[str]:
    """The model's ISO date for each text (greedy or beam search), through any runtime.generate Engine."""
    from runtime.generate import generate_ids
    from runtime.search import SearchOptions

    opts = SearchOptions(max_new_tokens=TARGET_LEN + 1, beam=beam)
    out = []
    for start in range(0, len(texts), batch_size):
        seqs = [tokenizer.encode(t) for t in texts[start:start + batch_size]]
        out += [tokenizer.decode(h[0].tokens) for h in generate_ids(engine, seqs, opts)]
    return out


def dates_accuracy(engine, tokenizer: CharTokenizer, examples: Sequence[tuple[str, str]], batch_size: int = 250) -> float:
    """Exact-match accuracy (greedy) of the engine on (source, target) pairs."""
    predicted = normalize(engine, tokenizer, [s for s, _ in examples], batch_size)
    return sum(p == t for p, (_, t) in zip(predicted, examples)) / max(len(examples), 1)


def accuracy(engine, tokenizer: CharTokenizer, samples: int) -> float:
    """The task metric (toolkit.reference.tasks.task_accuracy): greedy exact match on the first `samples` held-out dates."""
    return dates_accuracy(engine, tokenizer, held_out_examples()[:samples])


# --- the training recipe ----------------------------------------------------------------------------

RECIPE = {
    "model": {"d_model": 128, "n_heads": 4, "n_encoder_layers": 2, "n_decoder_layers": 2, "d_ff": 256,
              "max_len": MAX_SOURCE_LEN, "dropout": 0.05},
    "batch": 64, "steps": 4000, "warmup": 300, "lr_scale": 1.0, "label_smoothing": 0.1, "eval_every": 250,
    # formats drawn twice as often as the rest: the long, worded ones, where a single-digit day or a year far
    # from the start is easiest to misread
    "format_weights": {"month_day_year": 2.0, "month_ordinal_year": 2.0, "day_month_year": 2.0,
                       "ordinal_month_year": 2.0, "weekday_day_month": 2.0, "weekday_month_day": 2.0},
}


def dates_config(**overrides):
    """The example model's ModelConfig (vocabulary from the dates tokenizer)."""
    from toolkit.reference.config import ModelConfig

    return ModelConfig(vocab_size=make_tokenizer().vocab_size, **{**RECIPE["model"], **overrides})


def train_dates(steps: int = RECIPE["steps"], seed: int = 0, eval_every: int = RECIPE["eval_every"],
                on_progress: Callable[[dict], None] | None = None, config=None):
    """Train the example model; returns (model, tokenizer, training record with the final held-out accuracy).

    on_progress receives {"step", "loss", "elapsed_s"} each step and, every `eval_every` steps and at
    the end, also "accuracy" (exact match on the 1,000 held-out dates).
    """
    import time

    import torch

    from toolkit.reference.model import Transformer
    from toolkit.reference.torch_engine import TorchEngine
    from toolkit.reference.train import train_steps

    tokenizer, config = make_tokenizer(), config or dates_config()
    model, held_out, t0 = Transformer(config, seed=seed), held_out_examples(), time.perf_counter()
    history = []

    def evaluate() -> float:
        acc = dates_accuracy(TorchEngine(model), tokenizer, held_out)   # TorchEngine puts the model in eval mode
        model.train()
        return acc

    def on_step(step: int, loss: float) -> None:
        info = {"step": step, "loss": loss, "elapsed_s": time.perf_counter() - t0}
        if eval_every and step % eval_every == 0 and step != steps:
            info["accuracy"] = evaluate()
            history.append({k: round(v, 4) for k, v in info.items()})
        if on_progress is not None:
            on_progress(info)

    loss = train_steps(model, date_batches(tokenizer, RECIPE["batch"], seed), steps, warmup=RECIPE["warmup"],
                       lr_scale=RECIPE["lr_scale"], label_smoothing=RECIPE["label_smoothing"], seed=seed,
                       on_step=on_step)
    train_s = time.perf_counter() - t0
    accuracy = dates_accuracy(TorchEngine(model), tokenizer, held_out)
    final = {"step": steps, "loss": loss, "elapsed_s": time.perf_counter() - t0, "accuracy": accuracy}
    history.append({k: round(v, 4) for k, v in final.items()})
    if on_progress is not None:
        on_progress(final)
    record = {
        "task": "dates", "seed": seed, "steps": steps, "recipe": {**RECIPE, "steps": steps},
        "config": config.to_dict(), "parameters": model.num_parameters(),
        "held_out": {"size": len(held_out), "seed": HELD_OUT_SEED, "exact_match": accuracy},
        "final_loss": loss, "train_seconds": round(train_s, 1),   # wall time of the steps and periodic evaluations
        "torch": torch.__version__, "history": history,
    }
    return model.eval(), tokenizer, record
