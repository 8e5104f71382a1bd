"""benchmarks/service_load.py, small: two bundles in one server, 8 clients over the three APIs and both models, every
answer equal to `onnxformer generate`'s (slow: it builds the tiny Marian bundle, and starts three servers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_bundles_under_load_answer_as_generate(dates_bundle, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("transformers")
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "service_load.py"), "--dates",
                             str(dates_bundle), "--work", str(tmp_path), "--clients", "8", "--requests", "3",
                             "--duration", "300", "--json", str(out)], capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(out.read_text())
    for setup in ("one_process", "two_processes"):
        run = report[setup]
        assert run["apis"]["all"]["sent"] == run["apis"]["all"]["ok"] == 24 and run["exit"] == [0] * len(run["exit"])
        assert all(run["apis"][api]["ok"] > 0 for api in ("libretranslate", "deepl", "generate"))
    assert report["two_processes"]["rss_mb"]["warm"]["dates"]["rss"] > 0
    assert report["one_process"]["rss_mb"]["warm_sum"] < report["two_processes"]["rss_mb"]["warm_sum"]
