"""The Python API (runtime.api.Translator) on the toy bundle: generate, score and stream give what the command line
and the runtime give for the same options, its errors are the command line's lines, the checkpoint counterpart
gives the bundle's tokens, and the example translates a file end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from click.testing import CliRunner

from runtime import Result, ScoreRecord, Translator
from runtime.api import LANGUAGE_OPTIONS, TARGET_OPTIONS, Options
from runtime.errors import BundleError, InputError, TokenizerError
from runtime.search import SearchOptions
from toolkit.apps.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "python" / "translate_file.py"
TEXTS = ["hello", "Ab3", "zzyx", "QRSTuv"]
OPTIONS = {                                         # each: a search path of its own, with the controls it takes
    "greedy": {},
    "beam": {"beam": 4, "num_return": 2, "return_logprobs": True},
    "sample": {"sample": True, "seed": 7, "num_return": 3, "top_k": 8, "temperature": 1.5},
    "prefix": {"prefix": "ab", "max_new_tokens": 12, "no_repeat_ngram_size": 2},
    "bad_words": {"beam": 3, "bad_words": ["a", "xy"], "min_new_tokens": 3, "length_penalty": 0.6},
    "forced_eos": {"forced_eos": True, "max_new_tokens": 5, "return_logprobs": True},
}


@pytest.fixture(scope="module")
def translator(toy_exported) -> Translator:
    return Translator(toy_exported[1], provider="cpu")


def cli(*args) -> CliRunner:
    return CliRunner().invoke(main, [str(a) for a in args])


def flags(options: dict) -> list[str]:
    """The command line's flags for named options (the flag of option `foo_bar` is --foo-bar)."""
    out = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        else:
            out += [flag, ",".join(value) if isinstance(value, list) else str(value)]
    return out


def scores(results: list[Result]) -> list[float]:
    return [s for r in results for s in r.scores]


def records(results: list[Result]) -> list[dict]:
    """The API's results as `onnxformer generate --json` records."""
    return [{"input": r.input, **h.to_dict()} for r in results for h in r.hypotheses]


@pytest.mark.parametrize("name", OPTIONS)
def test_generate_equals_the_command_line(translator, toy_exported, name):
    options = OPTIONS[name]
    results = translator.generate(TEXTS, **options)
    got = cli("generate", toy_exported[1], *TEXTS, "--json", "--provider", "cpu", *flags(options))
    assert got.exit_code == 0, got.output
    assert records(results) == [json.loads(line) for line in got.stdout.splitlines()]
    want = options.get("num_return", 1)
    assert [len(r.hypotheses) for r in results] == [want] * len(TEXTS)
    assert len({r.text for r in results}) == len(TEXTS)                    # outputs that vary with the input
    if name == "prefix":
        assert all(r.text.startswith("ab") for r in results)
    if name == "forced_eos":                                           # every output ended, some at the limit
        assert all(h.finished for r in results for h in r.hypotheses)
        assert any(len(r.ids[0]) == options["max_new_tokens"] - 1 for r in results)


def test_result_fields_and_ids_inputs(translator):
    ids = [translator.tokenizer.encode(t) for t in TEXTS]
    by_text = translator.generate(TEXTS, beam=4, num_return=2, return_logprobs=True)
    by_ids = translator.generate(ids, beam=4, num_return=2, return_logprobs=True)
    for text_result, id_result, source in zip(by_text, by_ids, ids):
        assert id_result.input == source and id_result.ids == text_result.ids
        assert id_result.texts == text_result.texts and id_result.text == text_result.texts[0]
        assert id_result.scores == [h.score for h in id_result.hypotheses]
        assert id_result.scores[0] >= id_result.scores[1]
        assert [len(lp) for lp in id_result.logprobs] == [len(i) for i in id_result.ids]
    assert translator.generate(TEXTS[:1])[0].logprobs == [None]


def test_batch_size_gives_the_same_results(translator):
    prefixes = ["a", "", "bc", "d"]                                     # per-input options are cut with the inputs
    whole = translator.generate(TEXTS, beam=4, num_return=2, prefix=prefixes)
    for size in (1, 3):
        parts = translator.generate(TEXTS, beam=4, num_return=2, prefix=prefixes, batch_size=size)
        assert [(r.input, r.ids, [h.index for h in r.hypotheses]) for r in parts] == \
            [(r.input, r.ids, [h.index for h in r.hypotheses]) for r in whole]
        assert scores(parts) == pytest.approx(scores(whole), abs=1e-4)
    assert [r.text[:len(p)] for r, p in zip(whole, prefixes)] == prefixes
    with pytest.raises(InputError, match="batch size must be at least 1, got 0"):
        translator.generate(TEXTS, batch_size=0)


def test_score_equals_the_command_line(translator, toy_exported, tmp_path):
    targets = [r.text for r in translator.generate(TEXTS)]
    targets[1] = targets[1][::-1]                                       # one that the model finds unlikely
    (tmp_path / "src.txt").write_text("\n".join(TEXTS) + "\n")
    (tmp_path / "tgt.txt").write_text("\n".join(targets) + "\n")
    got = cli("score", toy_exported[1], "--source", tmp_path / "src.txt", "--target", tmp_path / "tgt.txt",
              "--json", "--provider", "cpu")
    assert got.exit_code == 0, got.output
    scored = translator.score(TEXTS, targets)
    assert [asdict(r) for r in scored] == [json.loads(line) for line in got.stdout.splitlines()]
    assert isinstance(scored[0], ScoreRecord) and scored[1].score < scored[0].score
    tok = translator.tokenizer
    by_ids = translator.score([tok.encode(t) for t in TEXTS], [tok.encode_target(t) for t in targets])
    assert [(r.ids, r.token_logprobs, r.score) for r in by_ids] == [(r.ids, r.token_logprobs, r.score) for r in scored]


def test_sampling_in_batches_draws_what_one_batch_draws(translator):
    """generate(batch_size=2) with sampling: each input is seeded by its position in the whole call."""
    options = {"sample": True, "seed": 11, "num_return": 2, "top_k": 20}
    whole = translator.generate(TEXTS, **options)
    parts = translator.generate(TEXTS, batch_size=2, **options)
    assert [[h.ids for h in r.hypotheses] for r in parts] == [[h.ids for h in r.hypotheses] for r in whole]
    assert len({tuple(h.ids) for r in whole for h in r.hypotheses}) > len(TEXTS)     # draws that vary


@pytest.mark.parametrize("options", [{}, {"sample": True, "seed": 3}, {"prefix": "ab", "repetition_penalty": 1.3}])
def test_stream_joins_to_the_generated_text(translator, options):
    for text in TEXTS:
        pieces = list(translator.stream(text, **options))
        assert "".join(pieces) == translator.generate([text], **options)[0].text and len(pieces) > 1


@pytest.mark.parametrize("options", [{"beam": 0}, {"temperature": 0.5}, {"num_return": 3, "beam": 2},
                                     {"max_new_tokens": 10_000}, {"bad_words": [" "]}, {"top_p": 1.5, "sample": True}])
def test_errors_carry_the_command_lines_message(translator, toy_exported, options):
    with pytest.raises(InputError) as raised:
        translator.generate(TEXTS, **options)
    got = cli("generate", toy_exported[1], *TEXTS, "--provider", "cpu", *flags(options))
    assert got.exit_code == 2 and got.stderr == f"error: {raised.value}\n"


def test_input_errors(translator, toy_exported):
    got = cli("generate", toy_exported[1], "hello", "a?b", "--provider", "cpu")
    with pytest.raises(TokenizerError) as raised:
        translator.generate(["hello", "a?b"])
    assert got.exit_code == 2 and got.stderr == f"error: {raised.value}\n"
    with pytest.raises(InputError, match=r"unknown option 'beem' \(did you mean 'beam'\?\)"):
        translator.generate(TEXTS, beem=4)
    with pytest.raises(InputError, match="wrap one text in a list"):
        translator.generate("hello")
    for junk in (["hello", None], [[5, 6.5]], [["hello"]]):
        with pytest.raises(InputError, match=r"input \d is neither a text nor a list of token ids \(integers\)"):
            translator.generate(junk)
    with pytest.raises(InputError, match="target 1 is neither a text nor a list of token ids"):
        translator.score(["hello", "Ab3"], ["olleh", [5, "6"]])
    with pytest.raises(InputError, match="beam search .* knows its best hypothesis only at the end"):
        translator.stream("hello", beam=2)
    with pytest.raises(BundleError, match="is a checkpoint, not a bundle"):
        Translator(toy_exported[0])


def test_options_name_only_accepted_options():
    """Options (the type of **options) names SearchOptions' fields, target_options' parameters and the languages,
    nothing else; an option added there is accepted at once (passed on by name) and typed once it is added to
    Options."""
    accepted = {f for f in SearchOptions.__dataclass_fields__} | set(TARGET_OPTIONS) | set(LANGUAGE_OPTIONS)
    assert set(Options.__annotations__) <= accepted
    typed = set(Options.__annotations__)
    assert {"beam", "num_return", "sample", "seed", "prefix", "bad_words_ids", "return_logprobs"} <= typed


def test_checkpoint_translator_gives_the_bundles_tokens(translator, toy_exported):
    from toolkit.reference.api import load_checkpoint_translator

    reference = load_checkpoint_translator(toy_exported[0], provider="cpu")
    assert reference.provider == "cpu" and "TorchEngine" in repr(reference)
    for options in (OPTIONS["greedy"], OPTIONS["beam"], OPTIONS["sample"]):
        want, got = translator.generate(TEXTS, **options), reference.generate(TEXTS, **options)
        assert [r.ids for r in got] == [r.ids for r in want]
        assert scores(got) == pytest.approx(scores(want), abs=1e-4)
    assert list(reference.stream(TEXTS[0])) == list(translator.stream(TEXTS[0]))


def example(*args) -> subprocess.CompletedProcess:
    """Run examples/python/translate_file.py as a user does, with this tree's runtime."""
    return subprocess.run([sys.executable, str(EXAMPLE), *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_example_translates_a_file(translator, toy_exported, tmp_path):
    lines = [*TEXTS, "", "abcdef"]                                      # a blank line is skipped
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    run = example(toy_exported[1], tmp_path / "in.txt", "--batch-size", "2", "--provider", "cpu")
    assert run.returncode == 0, run.stderr
    expected = []
    for r in translator.generate([t for t in lines if t], beam=4, num_return=2):
        expected += [r.input] + [f"  {k}. {s:8.4f}  {t}" for k, (t, s) in enumerate(zip(r.texts, r.scores), 1)]
    assert run.stdout.splitlines() == expected
    (tmp_path / "bad.txt").write_text("hello\na?b\n")
    run = example(toy_exported[1], tmp_path / "bad.txt")
    assert run.returncode == 2 and run.stderr.startswith("error: ") and run.stderr.count("\n") == 1, run.stderr
