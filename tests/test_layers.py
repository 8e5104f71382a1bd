"""The import direction of shared/design.md's Layers, checked on every import statement (lazy ones included).

From the floor up: runtime (numpy + onnxruntime, sentencepiece) -> toolkit's reference side (config, model,
checkpoint, tasks, importers, torch generation) -> toolkit.parity -> exporters -> toolkit's top (bench, demo,
engines, plot, server, cli, commands). A module may import its own layer and the layers below it, never one
above; library code never imports toolkit.commands. A new toolkit module is reference side unless it is
listed in TOP below (add it there when it is a command-line, serving or comparison tool).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("toolkit.bench", "toolkit.demo", "toolkit.engines", "toolkit.plot", "toolkit.server", "toolkit.serve",
       "toolkit.cli", "toolkit.commands")
RUNTIME_THIRD_PARTY = {"numpy", "onnxruntime", "sentencepiece"}
LAYERS = ("runtime", "reference", "parity", "exporters", "top")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> str | None:
    """The layer of one of our modules, None for anything else (stdlib, third party)."""
    if within(name, "runtime"):
        return "runtime"
    if within(name, "exporters"):
        return "exporters"
    if within(name, "toolkit.parity"):
        return "parity"
    if any(within(name, top) for top in TOP):
        return "top"
    if within(name, "toolkit"):
        return "reference"
    return None


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
            # `from toolkit import commands` imports toolkit.commands: count the names too
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
            found.append((node.lineno, base))
    return found


def sources() -> list[Path]:
    return sorted(p for d in ("runtime", "toolkit", "exporters") for p in (ROOT / d).rglob("*.py"))


def violations(path: Path) -> list[str]:
    me = module_name(path)
    mine = layer_of(me)
    bad = []
    for line, name in imports(path):
        where = f"{path.relative_to(ROOT)}:{line} imports {name}"
        theirs = layer_of(name)
        if mine == "runtime" and theirs is None:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in RUNTIME_THIRD_PARTY and top != "__future__":
                bad.append(f"{where}: runtime imports only numpy, onnxruntime and sentencepiece")
        if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
            bad.append(f"{where}: {mine} may not import {theirs} (an arrow running up)")
        if within(name, "toolkit.commands") and not (within(me, "toolkit.commands") or me == "toolkit.cli"):
            bad.append(f"{where}: library code never imports toolkit.commands")
    return bad


def test_every_import_runs_downward():
    bad = [v for path in sources() for v in violations(path)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module, line, expected", [
    ("runtime/x.py", "import torch", "runtime imports only"),
    ("runtime/x.py", "from toolkit.config import ModelConfig", "runtime may not import reference"),
    ("toolkit/model.py", "from exporters.export import export_checkpoint", "reference may not import exporters"),
    ("toolkit/parity/x.py", "from exporters import optimize", "parity may not import exporters"),
    ("exporters/x.py", "from toolkit.commands._common import friendly", "exporters may not import top"),
    ("exporters/x.py", "from toolkit import commands", "exporters may not import top"),
    ("toolkit/bench.py", "from toolkit.commands.bench import command", "library code never imports"),
])
def test_the_check_catches_an_upward_arrow(tmp_path, monkeypatch, module, line, expected):
    """The checker itself can fail: each forbidden arrow, written into a scratch tree, is reported."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path = tmp_path / module
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"def f():\n    {line}\n")
    assert any(expected in v for v in violations(path)), violations(path)
