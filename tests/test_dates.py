"""The dates example task: data generator conventions, held-out split, and the shipped example model."""

from __future__ import annotations

import datetime as dt
import json
import re

import numpy as np
import pytest

from toolkit.reference.tasks import dates

# Written by hand (not by the generator): every documented format, edge dates, ordinals, two-digit years.
FIXED = [
    ("Monday, 30 November 2026", "2026-11-30"), ("11/30/26", "2026-11-30"), ("30.11.2026", "2026-11-30"),
    ("Nov 30th 2026", "2026-11-30"), ("2026/11/30", "2026-11-30"), ("November 30, 2026", "2026-11-30"),
    ("30 Nov 2026", "2026-11-30"), ("2026-11-30", "2026-11-30"), ("Mon Nov 30 2026", "2026-11-30"),
    ("30th of November 2026", "2026-11-30"), ("11-30-2026", "2026-11-30"),
    ("1950-01-01", "1950-01-01"), ("Sunday, January 1, 1950", "1950-01-01"), ("1/1/50", "1950-01-01"),
    ("31.12.2049", "2049-12-31"), ("Fri, 31 Dec 2049", "2049-12-31"), ("12/31/49", "2049-12-31"),
    ("29th of February 2024", "2024-02-29"), ("Thu Feb 29 2024", "2024-02-29"), ("02/29/2024", "2024-02-29"),
    ("9.9.99", "1999-09-09"), ("Sept 9th, 1999", "1999-09-09"), ("Thursday, 9 September 1999", "1999-09-09"),
    ("20000101", "2000-01-01"), ("Saturday, January 1, 2000", "2000-01-01"), ("01.01.00", "2000-01-01"),
    ("21st March 1987", "1987-03-21"), ("Mar. 21, 1987", "1987-03-21"), ("3/21/87", "1987-03-21"),
    ("12-12-2012", "2012-12-12"), ("12 DEC 2012", "2012-12-12"), ("Wed, 12 Dec 2012", "2012-12-12"),
    ("July 4, 1963", "1963-07-04"), ("04.07.1963", "1963-07-04"), ("4th of July 1963", "1963-07-04"),
    ("22nd May 2031", "2031-05-22"), ("May 22 2031", "2031-05-22"), ("2031/05/22", "2031-05-22"),
    ("13th August 1976", "1976-08-13"), ("Aug 13, 1976", "1976-08-13"), ("31-Oct-2045", "2045-10-31"),
    ("Tuesday, October 31, 2045", "2045-10-31"), ("2nd of June 1958", "1958-06-02"), ("6/2/1958", "1958-06-02"),
    ("April 3rd, 2019", "2019-04-03"), ("3 April 2019", "2019-04-03"), ("11th November 2008", "2008-11-11"),
    ("28.02.91", "1991-02-28"), ("Jan 23rd 2037", "2037-01-23"), ("Sun, 20 Jul 1969", "1969-07-20"),
]

# an independent reading of each format (strptime after dropping ordinals, "of", commas and abbreviation dots)
PATTERNS = {
    "iso": ["%Y-%m-%d"], "iso_basic": ["%Y%m%d"], "ymd_slash": ["%Y/%m/%d"], "us_slash": ["%m/%d/%Y"],
    "us_slash_short": ["%m/%d/%y"], "us_dash": ["%m-%d-%Y"], "eu_dot": ["%d.%m.%Y"], "eu_dot_short": ["%d.%m.%y"],
    "month_day_year": ["%B %d %Y", "%b %d %Y"], "month_ordinal_year": ["%B %d %Y", "%b %d %Y"],
    "day_month_year": ["%d %B %Y", "%d %b %Y"], "ordinal_month_year": ["%d %B %Y", "%d %b %Y"],
    "day_mon_dash": ["%d-%b-%Y"], "weekday_day_month": ["%d %B %Y", "%d %b %Y"],
    "weekday_month_day": ["%B %d %Y", "%b %d %Y"], "ctime": ["%b %d %Y"], "rfc": ["%d %b %Y"],
}
WEEKDAY_FORMATS = ("weekday_day_month", "weekday_month_day", "ctime", "rfc")


def reference_parse(text: str, fmt: str) -> dt.date:
    """Read a generated text by the documented convention of its format."""
    weekday = None
    if fmt in WEEKDAY_FORMATS:
        weekday, text = re.match(r"([A-Za-z]+),? (.*)", text).groups()
    if fmt not in ("eu_dot", "eu_dot_short"):
        text = re.sub(r"(\d+)(st|nd|rd|th)", r"\1", text).replace(" of ", " ").replace(",", "").replace(".", "")
        text = re.sub(r"\bSept\b", "Sep", text)
    for pattern in PATTERNS[fmt]:
        try:
            parsed = dt.datetime.strptime(text, pattern).date()
        except ValueError:
            continue
        if "%y" in pattern:                                    # the documented rule, not Python's (69-99 -> 19xx)
            yy = parsed.year % 100
            parsed = parsed.replace(year=1900 + yy if yy >= 50 else 2000 + yy)
        if weekday is not None:
            assert parsed.strftime("%A").startswith(weekday), (text, weekday)
        return parsed
    raise AssertionError(f"{text!r} does not read as {fmt}")


def readings(text: str) -> dict[str, dt.date]:
    """The dates of the task's range that `text` reads as, by format (the formats whose convention it follows;
    the reference reading is lenient, e.g. "28.02.91" would be 2802-09-01 as iso_basic, outside the range)."""
    found = {}
    for fmt in dates.FORMATS:
        try:
            d = reference_parse(text, fmt)
        except (AssertionError, AttributeError):           # not this format (or a weekday that does not match)
            continue
        if dates.FIRST_DAY <= d <= dates.LAST_DAY:
            found[fmt] = d
    return found


def test_fixed_list_maps_each_text_to_its_iso_date_and_covers_every_format():
    assert len(FIXED) == 50
    tok = dates.make_tokenizer()
    covered = set()
    for text, target in FIXED:
        assert len(tok.encode(text)) <= dates.MAX_SOURCE_LEN
        found = readings(text)
        assert found, f"{text!r} follows no documented format"
        assert set(found.values()) == {dt.date.fromisoformat(target)}, (text, target, found)
        covered |= set(found)
    assert covered == set(dates.FORMATS), f"no hand-written example for {set(dates.FORMATS) - covered}"


@pytest.mark.parametrize("fmt", sorted(dates.FORMATS))
def test_generated_examples_follow_the_documented_convention(fmt):
    rng = np.random.default_rng(0)
    tok = dates.make_tokenizer()
    for idx in rng.choice(dates.N_DAYS, size=300, replace=False):
        d = dates.day(idx)
        text = dates.render(d, fmt, rng)
        assert reference_parse(text, fmt) == d, text
        assert len(tok.encode(text)) <= dates.MAX_SOURCE_LEN


def test_two_digit_year_rule():
    assert [dates.expand_year(y) for y in (0, 26, 49, 50, 87, 99)] == [2000, 2026, 2049, 1950, 1987, 1999]


def test_ordinals():
    assert [dates.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 30, 31)] == \
        ["1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "30th", "31st"]


def test_held_out_set_is_fixed_and_disjoint_from_training():
    held = dates.held_out_days()
    assert len(held) == len(set(held.tolist())) == dates.HELD_OUT_SIZE
    assert np.array_equal(held, dates.held_out_days())
    assert not set(held.tolist()) & set(dates.training_days().tolist())
    assert len(held) + len(dates.training_days()) == dates.N_DAYS
    examples = dates.held_out_examples()
    assert examples == dates.held_out_examples()
    assert {t for _, t in examples} == {dates.iso(dates.day(i)) for i in held}
    for pattern in (r"\d{4}-\d\d-\d\d", r"\d{8}", r"\d{4}/\d\d/\d\d", r"\d\d-[A-Za-z]{3}-\d{4}"):   # formats cycle:
        assert 40 <= sum(bool(re.fullmatch(pattern, s)) for s, _ in examples) <= 80, pattern  # ~1000/17 each


def test_training_batches_never_hold_held_out_dates():
    tok = dates.make_tokenizer()
    held = {dates.iso(dates.day(i)) for i in dates.held_out_days()}
    batches = dates.date_batches(tok, 64, seed=0)
    seen = set()
    for _ in range(20):
        src, mask, tgt = next(batches)
        assert src.shape[0] == tgt.shape[0] == 64 and (mask == (src != 0)).all()
        assert (tgt[:, 0] == tok.bos_id).all()
        seen |= {tok.decode(row[1:].tolist()) for row in tgt}
    assert len(seen) > 1000 and not seen & held


def test_example_checkpoint_normalizes_the_fixed_list(dates_checkpoint):
    from toolkit.reference.torch_engine import TorchEngine

    engine = TorchEngine(dates_checkpoint.model)
    predicted = dates.normalize(engine, dates_checkpoint.tokenizer, [t for t, _ in FIXED])
    wrong = [(t, p, e) for (t, e), p in zip(FIXED, predicted) if p != e]
    assert len(wrong) <= 1, wrong


def test_example_checkpoint_reaches_its_recorded_held_out_accuracy(dates_checkpoint):
    from toolkit.reference.torch_engine import TorchEngine

    record = json.loads((dates_checkpoint.path / "training.json").read_text())
    accuracy = dates.dates_accuracy(TorchEngine(dates_checkpoint.model), dates_checkpoint.tokenizer,
                                    dates.held_out_examples())
    assert accuracy >= 0.98
    assert accuracy == pytest.approx(record["held_out"]["exact_match"], abs=0.002)
    assert dates_checkpoint.config == dates.dates_config()
    size = sum(p.stat().st_size for p in dates_checkpoint.path.iterdir())
    assert size < 5e6


@pytest.mark.slow
def test_the_recipe_reaches_98_percent_from_scratch():
    _, _, record = dates.train_dates(eval_every=0)
    assert record["held_out"]["exact_match"] >= 0.98
