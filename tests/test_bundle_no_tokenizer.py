"""load_bundle(tokenizer=False): a bundle loaded for callers that feed token ids (the peer race's worker) leaves its
tokenizer out, decodes the same ids, and still refuses a changed tokenizer file (the manifest's hashes); a Hugging
Face tokenizer.json then never reaches the `tokenizers` library (T5's 32,100-piece Unigram vocabulary, parsed, adds
25 MiB resident: benchmarks/RESULTS.md, "T5 against its peers")."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.bundle import load_bundle
from runtime.errors import BundleError
from runtime.generate import generate_ids
from runtime.search import SearchOptions
from toolkit.testing.toy import toy_inputs

ROOT = Path(__file__).resolve().parents[1]


def test_ids_decode_the_same_without_the_tokenizer(toy_exported, toy_model_factory):
    bundle = toy_exported[1]
    seqs = toy_inputs(toy_model_factory().config, 8, seed=3)
    opts = SearchOptions(max_new_tokens=10)
    full, lean = load_bundle(bundle, "cpu"), load_bundle(bundle, "cpu", tokenizer=False)
    assert full.tokenizer is not None and lean.tokenizer is None
    want = [h[0].tokens for h in generate_ids(full.engine, seqs, opts)]
    assert len({tuple(t) for t in want}) > 1                      # outputs that vary: equality means something
    assert [h[0].tokens for h in generate_ids(lean.engine, seqs, opts)] == want


def test_a_changed_tokenizer_is_refused_without_loading_it(toy_exported, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(toy_exported[1], broken)
    name = json.loads((broken / "manifest.json").read_text())["tokenizer"]
    spec = json.loads((broken / name).read_text())
    (broken / name).write_text(json.dumps({**spec, "eos": "x"}))
    with pytest.raises(BundleError, match="was changed"):
        load_bundle(broken, "cpu", tokenizer=False)


CHECK = """
import sys
from runtime.bundle import load_bundle
bundle = load_bundle(sys.argv[1], "cpu", tokenizer=sys.argv[2] == "1")
print(type(bundle.tokenizer).__name__, "tokenizers" in sys.modules)
"""


def test_an_ids_only_load_never_parses_a_hugging_face_tokenizer(nllb_bundle):
    """The tiny NLLB bundle's tokenizer is a Hugging Face tokenizer.json: loaded by default, left out (the library
    not even imported) with tokenizer=False. Each load in a fresh process, whose modules are its own."""
    def load(tokenizer: bool) -> str:
        done = subprocess.run([sys.executable, "-c", CHECK, str(nllb_bundle), "1" if tokenizer else "0"],
                              cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""}, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert load(True) == ["FastTokenizer", "True"]
    assert load(False) == ["NoneType", "False"]
