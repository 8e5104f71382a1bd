"""benchmarks/race_whisper.py's guard: the race prints no speed ratio unless every engine did the same work (the
decode's token count after one prompt, the transcribe's windows and their token counts). Pure logic, no model."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("race_whisper", ROOT / "benchmarks" / "race_whisper.py")
race = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(race)

PROMPT = [50354, 50355, 50359, 50363]


def result(decoded=64, windows=(224, 224), prompt=PROMPT):
    r = {"prompt": list(prompt), "decode_ids": list(range(decoded))}
    return r if windows is None else r | {"window_tokens": list(windows)}


def test_equal_work_passes():
    results = {"onnxformer fp32": result(), "faster-whisper fp32": result(), "optimum fp32": result(windows=None)}
    assert race.unequal_work(results, 64, 224) == []


def test_short_decode_is_refused():
    # faster-whisper's first run: max_length = prompt + 64 decoded 33 (CTranslate2 stops at max_length // 2)
    problems = race.unequal_work({"onnxformer int8": result(), "faster-whisper int8": result(decoded=33)}, 64, 224)
    assert problems == ["faster-whisper int8 decoded 33 tokens, not 64"]


def test_short_or_missing_windows_are_refused():
    problems = race.unequal_work({"a": result(), "b": result(windows=(113, 113))}, 64, 224)
    assert problems == ["b's transcribe windows decoded [113, 113], not 224 each"]
    problems = race.unequal_work({"a": result(), "b": result(windows=(224,))}, 64, 224)
    assert len(problems) == 1 and "window counts differ" in problems[0]
    assert race.unequal_work({"a": result(windows=())}, 64, 224) == ["a's transcribe windows decoded [], not 224 each"]


def test_prompts_must_match():
    problems = race.unequal_work({"a": result(), "b": result(prompt=[50354, 50363])}, 64, 224)
    assert len(problems) == 1 and "prompts differ" in problems[0]


def test_windows_of_sums_a_windows_segments():
    assert race.windows_of([(0, 100), (0, 124), (3000, 224)]) == [224, 224]
    assert race.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
