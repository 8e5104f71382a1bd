"""The reference-side commands (init, train, generate on checkpoints): happy paths and one-line errors, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from toolkit.apps.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CHECKPOINT = ROOT / "examples" / "dates" / "checkpoint"
DATES = str(EXAMPLE_CHECKPOINT)


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def assert_user_error(result, *phrases):
    """Exit 2, one line on stderr naming the problem, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit)                  # a clean exit, not an uncaught exception
    err = result.stderr.strip()
    assert "\n" not in err and err.startswith("error:"), err
    assert "Traceback" not in result.output
    for phrase in phrases:
        assert phrase in err, (phrase, err)


@pytest.fixture(scope="module")
def id_model(tmp_path_factory):
    """A random-weight tiny checkpoint without a tokenizer."""
    out = tmp_path_factory.mktemp("init") / "tiny"
    result = run("init", "--preset", "tiny", "--out", out, "--seed", "1")
    assert result.exit_code == 0, result.output
    return out


def test_init_writes_a_loadable_checkpoint(id_model):
    from toolkit.reference.checkpoint import load_checkpoint

    ckpt = load_checkpoint(id_model)
    assert ckpt.config.d_model == 32 and ckpt.tokenizer is None


def test_init_refuses_bad_sizes_and_existing_output(id_model, tmp_path):
    assert_user_error(run("init", "--preset", "tiny", "--heads", "5", "--out", tmp_path / "x"), "not divisible")
    assert_user_error(run("init", "--preset", "tiny", "--out", id_model), "already exists", "--force")
    assert not (tmp_path / "x").exists()


def test_generate_the_example_date():
    result = run("generate", DATES, "Monday, 30 November 2026")
    assert result.exit_code == 0, result.output
    assert result.stdout == "2026-11-30\n"


def test_generate_prints_one_line_per_input_in_order(tmp_path):
    (tmp_path / "in.txt").write_text("30.11.2026\nJuly 4, 1963\n")
    result = run("generate", DATES, "11/30/26", "2031/05/22", "--input", tmp_path / "in.txt")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["2026-11-30", "2031-05-22", "2026-11-30", "1963-07-04"]
    result = run("generate", DATES, "--input", "-", input="1950-01-01\n")
    assert result.stdout == "1950-01-01\n"


def test_generate_json_beam_and_num_return():
    result = run("generate", DATES, "30 Nov 2026", "Sept 9th, 1999", "--beam", "3", "--num-return", "2", "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["input"], r["index"], r["rank"]) for r in rows] == \
        [("30 Nov 2026", 0, 0), ("30 Nov 2026", 0, 1), ("Sept 9th, 1999", 1, 0), ("Sept 9th, 1999", 1, 1)]
    assert set(rows[0]) == {"input", "index", "rank", "text", "ids", "score", "finished"}
    assert rows[0]["text"] == "2026-11-30" and rows[2]["text"] == "1999-09-09"
    assert rows[0]["score"] >= rows[1]["score"] and rows[0]["text"] != rows[1]["text"]
    plain = run("generate", DATES, "30 Nov 2026", "--beam", "3", "--num-return", "2", "--length-penalty", "0.5")
    assert plain.exit_code == 0 and plain.stdout.count("\n") == 1 and plain.stdout.startswith("2026-11-30\t")


def test_generate_ids_on_a_text_model_and_on_an_id_model(id_model):
    from runtime.tokenizer import CharTokenizer

    tok = CharTokenizer.load(EXAMPLE_CHECKPOINT / "tokenizer.json")
    ids = " ".join(map(str, tok.encode("30.11.2026")))
    result = run("generate", DATES, "--ids", ids, "--max-new-tokens", "11")
    assert result.exit_code == 0 and result.stdout == "2026-11-30\n", result.output
    result = run("generate", id_model, "--ids", "5 6 7", "--ids", "8,9", "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(1 <= len(line.split()) <= 4 for line in lines)
    assert all(t.isdigit() for line in lines for t in line.split())
    rows = [json.loads(x) for x in run("generate", id_model, "--ids", "5 6 7", "--json").stdout.splitlines()]
    assert rows[0]["input"] == [5, 6, 7] and rows[0]["text"] is None


def test_generate_on_max_new_tokens_zero_prints_empty_lines():
    result = run("generate", DATES, "30.11.2026", "1/1/50", "--max-new-tokens", "0")
    assert result.exit_code == 0 and result.stdout == "\n\n"


@pytest.mark.parametrize("args, phrases", [
    (["generate", "nowhere", "x"], ["does not exist", "checkpoint", "bundle"]),
    (["generate", DATES, "30 Nov 2026 @"], ["outside the vocabulary", "'@'"]),
    (["generate", DATES, "Monday, 30 November 2026" * 3, "--no-split"], ["maximum source length 48"]),
    (["generate", DATES, ""], ["input 0 is empty"]),
    (["generate", DATES], ["no inputs given"]),
    (["generate", DATES, "--ids", "5 x 7"], ["not a list of integers"]),
    (["generate", DATES, "--ids", "5 999"], ["outside the source vocabulary of"]),
    (["generate", DATES, "x", "--beam", "2", "--num-return", "3"], ["between 1 and the beam width"]),
    (["generate", DATES, "x", "--max-new-tokens", "500"], ["max new tokens"]),
    (["generate", DATES, "x", "--threads", "0"], ["threads"]),
    (["generate", DATES, "x", "--top-p", "0.5"], ["top_p shapes sampling only"]),
    (["generate", DATES, "x", "--sample", "--top-p", "2"], ["top_p must be a number in (0, 1]"]),
    (["generate", DATES, "x", "--sample", "--temperature", "0"], ["temperature must be"]),
    (["generate", DATES, "x", "--sample", "--seed", "-1"], ["seed must be"]),
    (["generate", DATES, "x", "--repetition-penalty", "0"], ["repetition_penalty must be"]),
    (["generate", DATES, "x", "--no-repeat-ngram-size", "-1"], ["no_repeat_ngram_size must be"]),
    (["generate", DATES, "x", "--min-new-tokens", "99"], ["min_new_tokens must be"]),
    (["generate", DATES, "x", "--bad-words-ids", "5;999"], ["bad_words_ids[1]", "999"]),
    (["generate", DATES, "x", "--bad-words-ids", "5;"], ["--bad-words-ids got an empty list"]),
    (["generate", DATES, "x", "--bad-words", "1,@"], ["outside the vocabulary", "'@'"]),
    (["generate", DATES, "x", "--bad-words", "1,"], ["bad_words[1] is blank"]),
    (["generate", DATES, "x", "--prefix-ids", "5 x"], ["--prefix-ids", "not a list of integers"]),
    (["generate", DATES, "x", "--prefix-ids", "2"], ["prefix_ids[0] holds the end token 2"]),
    (["generate", DATES, "x", "--prefix", "1", "--prefix-ids", "5"], ["one of --prefix, --prefix-ids"]),
    (["generate", DATES, "x", "y", "--prefix-file", "-"], ["--prefix-file - has no text lines"]),
])
def test_generate_bad_input_is_one_line_exit_2(args, phrases):
    assert_user_error(run(*args), *phrases)


def test_generate_text_on_a_model_without_tokenizer(id_model):
    assert_user_error(run("generate", id_model, "hello"), "no tokenizer", "--ids")
    assert_user_error(run("generate", id_model, "--ids", "5 6", "--prefix", "ab"), "prefix is text", "prefix_ids")


def records_of(*args, input=None) -> list[dict]:
    result = run("generate", DATES, *args, "--json", input=input)
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_generate_decoding_flags():
    """Each flag reaches the search: a prefix is forced, banned words never appear, logprobs align with the ids
    (their values: tests/test_score_cli.py), a seed makes sampling reproducible and other seeds draw otherwise."""
    texts = ["Monday, 30 November 2026", "Friday, 1 May 1998", "3/4/05"]
    plain = records_of(*texts, "--return-logprobs")
    assert all(len(r["logprobs"]) == len(r["ids"]) for r in plain)
    assert "logprobs" not in records_of(texts[0])[0]
    forced = records_of(*texts, "--prefix", "19")
    assert all(r["text"].startswith("19") for r in forced) and forced[1]["text"] == plain[1]["text"]
    assert [r["text"][:2] for r in records_of(*texts, "--prefix-file", "-", input="20\n\n07\n")] == \
        ["20", plain[1]["text"][:2], "07"]
    assert_user_error(run("generate", DATES, *texts, "--prefix-file", "-", input="20\n"), "has 1 lines for 3 inputs")
    banned = records_of(*texts, "--bad-words", "11,-0")
    assert plain[0]["text"] == "2026-11-30" and all("11" not in r["text"] and "-0" not in r["text"] for r in banned)
    by_ids = records_of(*texts, "--bad-words-ids", "4 4;17 3")                  # "11" and "-0" as ids
    assert [r["ids"] for r in by_ids] == [r["ids"] for r in banned]
    sampled = [records_of(*texts, "--sample", "--seed", str(seed), "--temperature", "3") for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]
    short = records_of(texts[2], "--min-new-tokens", "12", "--max-new-tokens", "12")
    assert len(short[0]["ids"]) == 12


def test_generate_on_broken_model_directories(tmp_path, id_model):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_user_error(run("generate", empty, "x"), "neither a checkpoint", "manifest.json")
    (tmp_path / "file").write_text("x")
    assert_user_error(run("generate", tmp_path / "file", "x"), "not a directory")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert_user_error(run("generate", broken, "--ids", "5"), "config.json is not valid JSON")
    (broken / "config.json").write_text((id_model / "config.json").read_text())
    assert_user_error(run("generate", broken, "--ids", "5"), "no weights")
    (tmp_path / "in.txt").write_text("30.11.2026\n\n1/1/50\n")
    assert_user_error(run("generate", DATES, "--input", tmp_path / "in.txt"), "line 2 is blank")
    assert_user_error(run("generate", DATES, "--input", tmp_path / "missing.txt"), "cannot read --input")


def test_generate_on_a_bad_bundle_is_a_one_line_error(tmp_path):
    (tmp_path / "manifest.json").write_text('{"format": "something-else"}')
    result = run("generate", tmp_path, "x")
    assert_user_error(result)


def test_checkpoint_and_bundle_print_the_same(toy_exported):
    checkpoint, bundle = toy_exported
    args = ["abc", "Zyx12", "q", "--ids", "5 6 7 8", "--beam", "2", "--num-return", "2", "--provider", "cpu"]
    for extra in ([], ["--json"]):
        a, b = run("generate", checkpoint, *args, *extra), run("generate", bundle, *args, *extra)
        assert a.exit_code == b.exit_code == 0, (a.output, b.output)
        if extra:
            rows_a, rows_b = [[json.loads(x) for x in r.stdout.splitlines()] for r in (a, b)]
            assert [{**r, "score": None} for r in rows_a] == [{**r, "score": None} for r in rows_b]
            assert [r["score"] for r in rows_a] == pytest.approx([r["score"] for r in rows_b], abs=1e-3)
        else:
            assert a.stdout == b.stdout and len(a.stdout.splitlines()) == 4


def test_generate_cuda_without_cuda_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert_user_error(run("generate", DATES, "1/1/50", "--provider", "cuda"), "cuda")


def test_the_cli_and_generate_do_not_import_torch():
    code = ("import sys, toolkit.apps.cli, toolkit.apps.engines, toolkit.apps.commands.generate, toolkit.apps.commands.train; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_a_command_imports_only_its_own_module_and_help_lists_every_command():
    """The group loads a command's module when it runs (issue 16: generate's resident memory); --help lists all."""
    code = ("import sys\nfrom toolkit.apps.cli import main\ntry:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
            "mods = sorted(m for m in sys.modules if m.startswith('toolkit.apps.commands.') and m != 'toolkit.apps.commands._common')\n"
            "assert mods == ['toolkit.apps.commands.generate'], mods\n"
            "assert 'importlib.metadata' not in sys.modules, 'importlib.metadata was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    result = run("--help")
    listed = result.stdout.split("Commands:", 1)[1].split()
    names = ["bench", "demo", "export", "generate", "import", "init", "inspect", "loadtest", "optimize", "parity",
             "score", "serve", "train"]
    assert result.exit_code == 0 and [w for w in listed if w in names] == names
    version = run("--version")
    assert version.exit_code == 0 and ", version " in version.stdout


def test_train_end_to_end_with_few_steps(tmp_path):
    from toolkit.reference.checkpoint import load_checkpoint

    out = tmp_path / "dates"
    result = run("train", "--task", "dates", "--out", out, "--steps", "3", "--eval-every", "2", "--seed", "1")
    assert result.exit_code == 0, result.output
    assert "step      2/3" in result.stdout and "held-out" in result.stdout and f"wrote {out}" in result.stdout
    ckpt = load_checkpoint(out)
    assert ckpt.tokenizer is not None and ckpt.tokenizer.encode("30 Nov 2026")
    record = json.loads((out / "training.json").read_text())
    assert record["steps"] == 3 and record["seed"] == 1 and record["recipe"]["batch"] == 64
    assert 0.0 <= record["held_out"]["exact_match"] <= 1.0 and record["held_out"]["size"] == 1000
    assert [h["step"] for h in record["history"]] == [2, 3]
    assert_user_error(run("train", "--out", out, "--steps", "3"), "already exists", "--force")
    result = run("train", "--out", out, "--steps", "1", "--eval-every", "0", "--force")
    assert result.exit_code == 0 and json.loads((out / "training.json").read_text())["steps"] == 1
