"""`onnxformer score` on the dates example: records, sums, checkpoint against bundle, one-line errors; and
generate's logprobs are the scores of what it generated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from toolkit.apps.cli import main

ROOT = Path(__file__).resolve().parents[1]
DATES = str(ROOT / "examples" / "dates" / "checkpoint")
SOURCES = ["Monday, 30 November 2026", "Friday, 1 May 1998", "3/4/05"]
TARGETS = ["2026-11-30", "1998-05-02", ""]                       # right, one digit off, the end token alone


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    (root / "src.txt").write_text("\n".join(SOURCES) + "\n")
    (root / "tgt.txt").write_text("\n".join(TARGETS) + "\n")
    return root / "src.txt", root / "tgt.txt"


def scores(model, files, *extra) -> list[dict]:
    result = run("score", model, "--source", files[0], "--target", files[1], "--provider", "cpu", *extra)
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()] if "--json" in extra else result.stdout


def test_score_records_sum_and_bundle_equals_checkpoint(files, dates_bundle):
    records = scores(DATES, files, "--json")
    assert [(r["index"], r["source"], r["target"]) for r in records] == list(zip(range(3), SOURCES, TARGETS))
    for r in records:
        assert r["ids"][-1] == 2 and len(r["token_logprobs"]) == len(r["ids"]) == len(r["target"]) + 1
        assert r["score"] == pytest.approx(sum(r["token_logprobs"]), abs=1e-9)
    assert records[0]["score"] > records[1]["score"] and len({round(r["score"], 3) for r in records}) == 3
    for got, want in zip(scores(dates_bundle, files, "--json"), records):
        assert got["ids"] == want["ids"] and got["score"] == pytest.approx(want["score"], abs=1e-4)
    lines = scores(DATES, files).splitlines()
    assert [float(x) for x in lines] == pytest.approx([r["score"] for r in records], abs=1e-6)


def test_generate_logprobs_are_the_scores_of_its_output(files):
    result = run("generate", DATES, *SOURCES, "--json", "--return-logprobs")
    generated = [json.loads(line) for line in result.stdout.splitlines()]
    targets = files[0].parent / "generated.txt"
    targets.write_text("\n".join(r["text"] for r in generated) + "\n")
    for gen, scored in zip(generated, scores(DATES, (files[0], targets), "--json")):
        assert scored["ids"][:-1] == gen["ids"]
        assert scored["token_logprobs"][:-1] == pytest.approx(gen["logprobs"], abs=1e-5)


def test_score_bad_input_is_one_line_exit_2(files, tmp_path):
    (tmp_path / "two.txt").write_text("a\nb\n")
    (tmp_path / "bad.txt").write_text("2026-11-30\n@\n\n")
    for args, phrase in [(["--target", tmp_path / "two.txt"], "--source has 3 lines and --target 2"),
                         (["--target", tmp_path / "bad.txt"], "'@'"),
                         (["--target", tmp_path / "missing.txt"], "cannot read --target")]:
        result = run("score", DATES, "--source", files[0], *args)
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        err = result.stderr.strip()
        assert err.startswith("error:") and "\n" not in err and phrase in err, err
