"""Shared fixtures: tiny *trained* toy models (trained once per test session and cached), the example checkpoint.

    def test_something(toy_model_factory):
        model = toy_model_factory()                  # tiny preset, post-norm, dropout 0, trained on the toy task
        model = toy_model_factory(norm="pre")        # any ModelConfig field of the tiny preset can be overridden
        model = toy_model_factory(steps=100)         # fewer steps (distinct cache entry)

The returned model is shared by every test that asks for the same arguments: treat it as read-only
(no training, no load_state_dict, no .to(other device)); copy.deepcopy it when a test must change it.
A trained toy model maps a random id sequence to its reverse shifted by one id, so its greedy outputs
vary with the input (tests on random weights, which emit one token over and over, prove little).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CHECKPOINT = ROOT / "examples" / "dates" / "checkpoint"
TOY_STEPS = 300          # with dropout 0 (and train_toy's lr scale 0.5): every output input-dependent


def pytest_addoption(parser):
    parser.addoption("--weight-bits", choices=("auto", "7", "8"), default="auto",
                     help="int8 weights that optimize's --weight-bits auto picks in this run: auto (this CPU's "
                          "choice: 7 where its int8 kernel saturates 8-bit products, else 8), or 7 / 8 forced, so one "
                          "machine runs the int8 tests as VNNI and non-VNNI CPUs build them (make test-isa)")
    parser.addoption("--toy-seed", type=int, default=0,
                     help="added to every trained toy model's seed: other toy models, as another CPU's kernels train "
                          "(a test whose precondition holds only for one model fails under some --toy-seed)")


def pytest_configure(config):
    """--weight-bits 7|8: optimize's "auto" resolves as on a CPU whose int8 kernel saturates (7) or not (8). Set once,
    before collection, so module-level choices (tests/test_row_activations.BITS) see it too; tests that ask what
    auto picks here call exporters.optimize.int8_saturates, never runtime.session's probe."""
    forced = config.getoption("--weight-bits")
    if forced != "auto":
        import exporters.optimize

        exporters.optimize.int8_saturates = lambda: forced == "7"


def auto_weight_bits() -> int:
    """The bits optimize's --weight-bits auto gives in this run (this CPU's, or --weight-bits forced)."""
    import exporters.optimize

    return 7 if exporters.optimize.int8_saturates() else 8


def copy_with_manifest(bundle: Path, dest: Path, **fields) -> Path:
    """A copy of a bundle whose manifest.json has the given top-level fields replaced (a broken or lying bundle)."""
    import json
    import shutil

    if not dest.exists():
        shutil.copytree(bundle, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest.update(fields)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def with_ort_graphs(bundle: Path, dest: Path) -> Path:
    """A copy of a finished bundle with ORT-format graphs added, staged as `optimize --ort-format` stages them."""
    import json
    import shutil

    from exporters.bundle import stage_bundle, write_manifest
    from exporters.ort_format import add_ort_format

    manifest = json.loads((bundle / "manifest.json").read_text())
    with stage_bundle(dest) as tmp:
        for name in manifest["files"]:                      # every file the bundle holds
            shutil.copyfile(bundle / name, tmp / name)
        add_ort_format(tmp, manifest)
        write_manifest(tmp, manifest)
    return dest


@pytest.fixture(scope="session")
def toy_model_factory(pytestconfig):
    """A function (steps=300, seed=0, **config_overrides) -> trained tiny Transformer in eval mode, cached."""
    from toolkit.reference.config import preset
    from toolkit.testing.toy import train_toy

    cache, shift = {}, pytestconfig.getoption("--toy-seed")

    def make(steps: int = TOY_STEPS, seed: int = 0, **overrides):
        seed += shift
        # dropout slows a tiny model's learning (it is off in eval anyway)
        config = preset("tiny", **{"dropout": 0.0, **overrides})
        key = (steps, seed, config)                  # equal configs share one model, however they were spelled
        if key not in cache:
            import torch

            threads = torch.get_num_threads()
            torch.set_num_threads(1)                # tiny models train faster on one thread (and share the CPU)
            try:
                with torch.enable_grad():           # callers may be inside torch.no_grad()
                    cache[key] = train_toy(config, steps=steps, seed=seed)
            finally:
                torch.set_num_threads(threads)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def toy_model(toy_model_factory):
    """The default trained toy model (tiny preset, post-norm)."""
    return toy_model_factory()


@pytest.fixture(scope="session")
def dates_checkpoint():
    """The shipped example checkpoint, loaded once (skipped with a clear reason if it is missing)."""
    if not (EXAMPLE_CHECKPOINT / "config.json").exists():
        pytest.fail(f"the example checkpoint {EXAMPLE_CHECKPOINT} is missing; "
                    f"see examples/dates/README.md for the command that trains it")
    from toolkit.reference.checkpoint import load_checkpoint

    return load_checkpoint(EXAMPLE_CHECKPOINT)


@pytest.fixture(scope="session")
def dates_bundle(tmp_path_factory):
    """The example checkpoint exported once (fp32 bundle); read-only."""
    from exporters.export import export_checkpoint

    return export_checkpoint(EXAMPLE_CHECKPOINT, tmp_path_factory.mktemp("dates_bundle") / "dates")


# --- added by the runtime helper (issue 4): toy models whose outputs vary across inputs AND positions (dropout 0),
# and one exported toy bundle shared by the runtime, torch-free, parity and edge tests.

TOY_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ012345678"   # 61 chars: ids 3..63 of the tiny vocab


@pytest.fixture(scope="session")
def toy_exported(toy_model_factory, tmp_path_factory):
    """(checkpoint dir, bundle dir) of toy_model_factory(), with a 61-character tokenizer so text inputs work too.

    Exported once per test session (with the export's parity gate). Treat both directories as read-only:
    copy them (shutil.copytree) before tampering.
    """
    from exporters.export import export_checkpoint
    from runtime.tokenizer import CharTokenizer
    from toolkit.reference.checkpoint import save_checkpoint

    model = toy_model_factory()
    root = tmp_path_factory.mktemp("toy_exported")
    tokenizer = CharTokenizer(TOY_CHARS)
    assert tokenizer.vocab_size == model.config.vocab_size
    checkpoint = save_checkpoint(root / "checkpoint", model, tokenizer)
    bundle = export_checkpoint(checkpoint, root / "bundle")
    return checkpoint, bundle


@pytest.fixture(scope="session")
def multilingual(tmp_path_factory):
    """A function name -> (original directory, transformers model, its tokenizer, imported checkpoint) of the tiny
    NLLB ("nllb") and mBART-50 ("mbart50") models, each built and imported once per session; read-only. Their
    weights (matrix scale 0.6) give outputs that vary with the input and the target language, and float32 logits
    close enough to pass export's parity gate."""
    from toolkit.reference.importers import import_model
    from toolkit.testing.tiny_families import tiny_multilingual

    made = {}

    def make(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(f"multilingual_{name}")
            model, tokenizer = tiny_multilingual(name, root / name, seed=4, matrix=0.6)
            made[name] = (root / name, model, tokenizer, import_model(root / name, root / "checkpoint"))
        return made[name]
    return make


@pytest.fixture(scope="session")
def nllb_bundle(multilingual, tmp_path_factory):
    """The tiny NLLB checkpoint of `multilingual` exported once (fp32 bundle); read-only."""
    from exporters.export import export_checkpoint

    return export_checkpoint(multilingual("nllb")[3], tmp_path_factory.mktemp("nllb_bundle") / "nllb")


@pytest.fixture(scope="session")
def t5_exported(tmp_path_factory):
    """(checkpoint dir, fp32 bundle dir) of a random tiny T5 v1.1 (toolkit.testing.tiny_t5.random_t5), imported and
    exported by the command line once per session; read-only. Its untied head gives greedy outputs that vary with
    the input (tests that compare tokens assert it)."""
    from click.testing import CliRunner

    from toolkit.apps.cli import main
    from toolkit.testing.tiny_t5 import random_t5

    pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("t5_exported")
    random_t5("v1.1", root / "src")
    for args in (["import", str(root / "src"), "--out", str(root / "ckpt")],
                 ["export", str(root / "ckpt"), "--out", str(root / "bundle")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    return root / "ckpt", root / "bundle"
