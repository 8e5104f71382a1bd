"""Long runs (slow): 10,000 requests through one engine without memory growth, and kill -9 at random points of
export and optimize never leaving a partial bundle at --out (leftovers are removed by the next run)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.bundle import load_bundle
from runtime.manifest import read_manifest, verify_hashes
from toolkit.reference.outdir import STAGING

ROOT = Path(__file__).resolve().parents[1]
ONNXFORMER = Path(sys.executable).parent / "onnxformer"
KILLS = 10                       # kill -9 mid-run, per command


@pytest.fixture(scope="module")
def static_bundle(toy_exported, tmp_path_factory):
    from exporters.optimize import optimize_bundle

    out, _ = optimize_bundle(toy_exported[1], tmp_path_factory.mktemp("soak") / "fused", target="cpu")
    assert read_manifest(out)["kv_cache"] == "static"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dynamic", "static"])
def test_ten_thousand_requests_do_not_grow_memory(toy_exported, static_bundle, tmp_path, which):
    """Mixed batch sizes (1-8), greedy and beam (2, 4), 1-16 new tokens, in a fresh process: RSS after warm-up
    (1,000 requests) grows less than 5% over the next 9,000. The curve is printed and kept as JSON."""
    bundle = toy_exported[1] if which == "dynamic" else static_bundle
    out = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, ROOT / "benchmarks" / "soak.py", bundle, "--requests", "10000",
                             "--json", out], capture_output=True, text=True, timeout=900)
    print(result.stdout)
    record = json.loads(out.read_text())
    assert record["requests"] == 10_000 and len(record["curve"]) == 40 and record["kv_cache"] == which
    assert result.returncode == 0 and record["growth"] < 0.05, result.stdout + result.stderr


def staged(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if f".{STAGING}-" in p.name]


def complete_or_absent(out: Path) -> str:
    """'absent', or 'complete' after checking every file of the bundle and loading it; anything else fails."""
    if not out.exists():
        return "absent"
    manifest = read_manifest(out)                  # a partial bundle has no manifest or a mismatching file
    verify_hashes(out, manifest)
    assert sorted(p.name for p in out.iterdir()) == sorted(["manifest.json", *manifest["files"]])
    load_bundle(out, provider="cpu")
    return "complete"


def kill_at_random(args: list, seconds: float, rng) -> tuple[float, bool]:
    """Run the command and kill -9 it (its whole process group) after a random time; (time, whether killed)."""
    proc = subprocess.Popen([str(ONNXFORMER), *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    at = float(rng.uniform(0.2, seconds))
    try:
        proc.wait(timeout=at)
        return at, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return at, True


@pytest.mark.slow
@pytest.mark.parametrize("command", ["export", "optimize"])
def test_kill_9_at_random_points_never_leaves_a_partial_bundle(toy_exported, tmp_path, command):
    """Ten kill -9 at random moments of a run, half of them replacing an existing bundle with --force: --out is always
    absent or a complete bundle (with --force: the old or the new one, never neither nor a mix), and the next
    run removes what the killed ones left behind."""
    ckpt, bundle = toy_exported
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    args = ["export", ckpt, "--out", out] if command == "export" else ["optimize", bundle, "--out", out]
    times = []
    for force in ([], ["--force"]):                  # the second (warm) run is the one the kills race against
        t0 = time.perf_counter()
        subprocess.run([str(ONNXFORMER), *map(str, args), *force], check=True, capture_output=True, timeout=600)
        times.append(time.perf_counter() - t0)
    full = min(times)
    complete = Path(shutil.copytree(out, tmp_path / "complete"))
    rng = np.random.default_rng(13)
    trials = []
    while sum(t[2] for t in trials) < KILLS and len(trials) < 3 * KILLS:
        forced = len(trials) % 2 == 1
        shutil.rmtree(out, ignore_errors=True)
        if forced:
            shutil.copytree(complete, out)
        t0 = time.perf_counter()
        at, killed = kill_at_random(args + (["--force"] if forced else []), full * 0.9, rng)
        if not killed:                               # it finished first (the machine got faster): aim earlier
            full = min(full, time.perf_counter() - t0)
        state = complete_or_absent(out)
        assert not forced or state == "complete", f"trial {len(trials)}: --force killed at {at:.1f} s lost the old bundle"
        trials.append((round(at, 1), forced, killed, state, len(staged(work))))
    print(f"{command}: a full run takes {full:.1f} s; (kill at s, --force, killed, --out after, leftovers): {trials}")
    assert sum(t[2] for t in trials) >= KILLS                                # ten killed mid-run
    assert any(t[4] for t in trials), "no kill left a temporary directory: none tested the cleanup"
    subprocess.run([str(ONNXFORMER), *map(str, args), "--force"], check=True, capture_output=True, timeout=600)
    assert complete_or_absent(out) == "complete" and staged(work) == []      # every kill's leftovers removed
