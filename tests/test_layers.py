"""The import direction of shared/design.md's Layers, checked on every import statement (lazy ones included).

The layers are the folders, from the floor up (LAYERS): runtime/ (numpy + onnxruntime, sentencepiece or
tokenizers, soundfile and soxr for audio) -> toolkit/reference/ (config, model, checkpoint, importers, tasks; torch) -> toolkit/testing/
(builders of test models) -> toolkit/parity/ -> exporters/ -> toolkit/apps/ (command line, server, bench,
demo). A module may import its own layer and the layers below it, never one above; library code never imports
toolkit.apps.commands. Every module lives in one of these folders: a file directly under toolkit/ has no layer
and fails the test.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("runtime", "toolkit.reference", "toolkit.testing", "toolkit.parity", "exporters", "toolkit.apps")
RUNTIME_THIRD_PARTY = {"numpy", "onnxruntime", "sentencepiece", "tokenizers",
                       "soundfile", "soxr"}        # runtime.audio reads and resamples audio files (the audio extra)
COMMANDS = "toolkit.apps.commands"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> str | None:
    """The layer (folder) of one of our modules; "toolkit" for the package itself and anything outside the
    layer folders; None for anything that is not ours (stdlib, third party)."""
    for layer in LAYERS:
        if within(name, layer):
            return layer
    return "toolkit" if within(name, "toolkit") else None


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in a file, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from toolkit import commands` imports toolkit.apps.commands: count the names too
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
            found.append((node.lineno, base))
    return found


def sources() -> list[Path]:
    return sorted(p for d in ("runtime", "toolkit", "exporters") for p in (ROOT / d).rglob("*.py"))


def violations(path: Path) -> list[str]:
    me = module_name(path)
    mine = layer_of(me)
    if mine == "toolkit":
        return [] if me == "toolkit" else [f"{path.relative_to(ROOT)} lies outside the layer folders "
                                           f"({', '.join(LAYERS)}): move it into the folder of its layer"]
    bad = []
    for line, name in imports(path):
        where = f"{path.relative_to(ROOT)}:{line} imports {name}"
        theirs = layer_of(name)
        if mine == "runtime" and theirs is None:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in RUNTIME_THIRD_PARTY and top != "__future__":
                bad.append(f"{where}: runtime imports only numpy, onnxruntime, sentencepiece, tokenizers, soundfile and soxr")
        if theirs in LAYERS and LAYERS.index(theirs) > LAYERS.index(mine):
            bad.append(f"{where}: {mine} may not import {theirs} (an arrow running up)")
        if within(name, COMMANDS) and not (within(me, COMMANDS) or me == "toolkit.apps.cli"):
            bad.append(f"{where}: library code never imports toolkit.apps.commands")
    return bad


def test_every_import_runs_downward():
    bad = [v for path in sources() for v in violations(path)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module, line, expected", [
    ("runtime/x.py", "import torch", "runtime imports only"),
    ("runtime/x.py", "from toolkit.reference.config import ModelConfig", "runtime may not import toolkit.reference"),
    ("toolkit/reference/model.py", "from exporters.export import export_checkpoint",
     "toolkit.reference may not import exporters"),
    ("toolkit/reference/x.py", "from toolkit.testing.toy import toy_batches", "may not import toolkit.testing"),
    ("toolkit/parity/x.py", "from exporters import optimize", "toolkit.parity may not import exporters"),
    ("exporters/x.py", "from toolkit.apps.commands._common import friendly", "exporters may not import toolkit.apps"),
    ("exporters/x.py", "from toolkit.apps import commands", "exporters may not import toolkit.apps"),
    ("toolkit/apps/bench/x.py", "from toolkit.apps.commands.bench import command", "library code never imports"),
    ("toolkit/stray.py", "import numpy", "outside the layer folders"),
])
def test_the_check_catches_an_upward_arrow(tmp_path, monkeypatch, module, line, expected):
    """The checker itself can fail: each forbidden arrow, written into a scratch tree, is reported."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path = tmp_path / module
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"def f():\n    {line}\n")
    assert any(expected in v for v in violations(path)), violations(path)


def test_the_layers_are_the_folders():
    """LAYERS names exactly the package folders there are: a new folder must be given its place."""
    folders = {"runtime", "exporters"} | {f"toolkit.{p.name}" for p in (ROOT / "toolkit").iterdir()
                                          if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS), folders ^ set(LAYERS)
