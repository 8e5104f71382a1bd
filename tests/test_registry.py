"""The registry of model families: a family is one module; --format, detection, parity's ORIGINAL and the README
follow from it; a source of an unsupported family exits 2 naming its model_type and the supported families."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from toolkit.apps.cli import main
from toolkit.reference.importers import import_model, original_family
from toolkit.reference.importers.registry import (UNREPRESENTABLE, Family, ImportRefused, detect, families,
                                                  register_family)

ROOT = Path(__file__).resolve().parents[1]

# A family written as a newcomer would: one module, nothing else touched. Its convert is a fixture for the
# registry's plumbing (a tiny random model whose seed comes from the source), not an importer of anything real.
TOY_FAMILY = '''
from toolkit.reference.importers.registry import Converted, Family, register_family
from toolkit.reference.importers.sources import read_json


def convert(path, options):
    from toolkit.reference.config import preset
    from toolkit.reference.model import Transformer

    seed = read_json(path / "config.json")["seed"]
    options.progress(f"toyfam: seed {seed}")
    return Converted(Transformer(preset("tiny", vocab_size=30), seed=seed).eval(), None, {"seed": seed})


FAMILY = register_family(Family(name="toyfam", source="a toy directory", convert=convert, model_types=("toyfam", "umt5"),
                                load_original=lambda path: ("the original", None), original="Toy"))
'''

TOY_SCRIPT = '''
import json, sys
from pathlib import Path

import toolkit.reference.importers as importers
importers.__path__.append(sys.argv[1])                  # the new module, as if it were a file in the package
import toolkit.apps.commands.importer
from toolkit.reference.importers import import_model, original_family
from toolkit.reference.importers.registry import families

result = {"families": list(families()), "torch": "torch" in sys.modules}
from click.testing import CliRunner
from toolkit.apps.cli import main

src, out = Path(sys.argv[2]), Path(sys.argv[3])
runs = {"help": ["import", "--help"], "detected": ["import", str(src), "--out", str(out / "a")],
        "format": ["import", str(src), "--out", str(out / "b"), "--format", "toyfam"],
        "config": ["import", str(src), "--out", str(out / "c"), "--config", str(src / "config.json")]}
for name, args in runs.items():
    r = CliRunner().invoke(main, args)
    result[name] = [r.exit_code, r.stdout, r.stderr]
result["record"] = json.loads((out / "a" / "import.json").read_text())
result["original"] = original_family(src).load_original(src)[0]
print(json.dumps(result))
'''


def test_marian_and_nn_transformer_are_registered():
    found = families()
    assert {"marian", "nn-transformer"} <= set(found) and list(found) == sorted(found)
    marian, nn = found["marian"], found["nn-transformer"]
    assert marian.model_types == ("marian",) and marian.load_original is not None and not marian.takes_config
    assert nn.reads_files and nn.takes_config and nn.load_original is None and not nn.model_types


def test_a_new_family_is_one_module(tmp_path):
    """A module added to the package registers itself; the CLI lists it in --format, detects its directories,
    records it in import.json, refuses --config for it, and parity finds its original; listing the families
    loads no torch. Its model_types win over UNREPRESENTABLE (umt5 here): a family that learns umt5 supersedes it."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "toyfam.py").write_text(TOY_FAMILY)
    src = tmp_path / "toy-model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "umt5", "seed": 7}))
    proc = subprocess.run([sys.executable, "-c", TOY_SCRIPT, str(tmp_path / "pkg"), str(src), str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert "toyfam" in got["families"] and not got["torch"], got
    help_text = " ".join(got["help"][1].split())
    choices = re.search(r"--format \[([^\]]+)\]", help_text).group(1).split("|")
    assert choices == got["families"] and "toyfam: a toy directory" in help_text
    for run in ("detected", "format"):
        code, stdout, stderr = got[run]
        assert code == 0 and "toyfam: seed 7" in stderr and stdout.startswith(f"imported {src}"), got[run]
    assert got["record"] == {"format": "toyfam", "source": str(src), "seed": 7}
    code, _, stderr = got["config"]
    assert code == 2 and "--config is for nn-transformer sources; a toyfam source carries its own config" in stderr
    assert got["original"] == "the original"
    assert not (tmp_path / "out" / "c").exists()


def _config_dir(tmp_path: Path, config: dict) -> Path:
    d = tmp_path / "src"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


SUPPORTED = ("supported: ", "marian (config.json model_type marian)", "nn-transformer (a state-dict file)")


@pytest.mark.parametrize("model_type,lacks", [
    ("umt5", "per-layer relative position buckets"), ("speech_to_text", "an audio encoder"), ("prophetnet", "n-stream self-attention"),
    ("led", "Longformer's sliding-window"), ("switch_transformers", "mixture-of-experts")])
def test_families_the_reference_model_cannot_represent_name_what_is_missing(tmp_path, model_type, lacks):
    src = _config_dir(tmp_path, {"model_type": model_type, "d_model": 32})
    result = CliRunner().invoke(main, ["import", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    err = result.stderr
    assert f"is a {model_type} model, which onnxformer's reference model cannot represent (it lacks {lacks}" in err
    assert all(s in err for s in SUPPORTED) and "--format nn-transformer" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config,message", [
    ({"model_type": "bert"}, "has model_type 'bert', a family onnxformer does not import; "),
    ({"d_model": 512}, "has no model_type, so its family is unknown; "),
])
def test_other_model_types_name_the_type_and_the_supported_families(tmp_path, config, message):
    src = _config_dir(tmp_path, config)
    result = CliRunner().invoke(main, ["import", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert message in result.stderr and all(s in result.stderr for s in SUPPORTED), result.stderr


@pytest.fixture
def ours(tmp_path) -> tuple[Path, Path]:
    """(an onnxformer checkpoint, a directory with a bundle's manifest.json): what import and parity are not."""
    from toolkit.reference.checkpoint import save_checkpoint
    from toolkit.reference.config import preset
    from toolkit.reference.model import Transformer

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")
    return save_checkpoint(tmp_path / "ckpt", Transformer(preset("tiny", vocab_size=30))), bundle


def test_sources_that_are_no_family(tmp_path, ours):
    bundle = ours[1]
    for source, message in ((bundle, "is an onnxformer bundle"), (tmp_path, "has no config.json"),
                            (tmp_path / "nowhere" / "x", "does not exist; pass a model directory, a hub name or a file")):
        with pytest.raises(ImportRefused, match=message):
            detect(source)
    with pytest.raises(ImportRefused, match="unknown format 'nosuch'; choose one of .*marian, .*nn-transformer"):
        import_model(tmp_path, tmp_path / "out", format="nosuch")
    with pytest.raises(ImportRefused, match="does not exist; pass a state dict"):
        import_model(tmp_path / "missing.pt", tmp_path / "out", format="nn-transformer")
    result = CliRunner().invoke(main, ["import", str(tmp_path), "--out", str(tmp_path / "o"), "--format", "nosuch"])
    assert result.exit_code == 2 and "'nosuch' is not one of" in result.output


def test_parity_finds_the_original_through_the_registry(tmp_path, ours):
    ckpt, bundle = ours
    marian = _config_dir(tmp_path, {"model_type": "marian"})
    assert original_family(marian) is families()["marian"]
    assert original_family(ckpt) is None and original_family(bundle) is None
    (tmp_path / "model.pt").write_bytes(b"")
    assert original_family(tmp_path / "model.pt") is None                 # nn-transformer: no original to load
    assert original_family(_config_dir(tmp_path / "u", {"model_type": "umt5"})) is None   # refused by name
    assert original_family(_config_dir(tmp_path / "t", {"model_type": "mt5"})) is families()["t5"]


def test_marian_sources_refuse_config(tmp_path):
    src = _config_dir(tmp_path, {"model_type": "marian"})
    with pytest.raises(ImportRefused, match="--config is for nn-transformer sources; a marian source carries"):
        import_model(src, tmp_path / "out", config_file=tmp_path / "hp.json")


def test_a_clashing_family_is_refused():
    marian = families()["marian"]
    with pytest.raises(ValueError, match="clashes"):
        register_family(Family(name="marian2", source="x", convert=marian.convert, model_types=("marian",)))
    with pytest.raises(ValueError, match="clashes"):
        register_family(marian)
    assert "marian2" not in families()


def test_readme_lists_every_registered_family():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Import: the model families", 1)[1].split("\n#", 1)[0]
    rows = {m.group(1): line for line in section.splitlines() if (m := re.match(r"\| `(\w[\w-]*)` \|", line))}
    assert set(rows) == set(families()), "README's import table and the registry differ"
    for name, family in families().items():
        assert all(f"`{t}`" in rows[name] for t in family.model_types), rows[name]
    assert all(t in section for t in UNREPRESENTABLE)
