"""onnxformer bench on tiny models: report shape, exact token counts, ratios, plot, memory probes, bad input.

No timing assertions: the machine is shared, so only what must hold whatever the speed is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from toolkit.apps.bench import probe
from toolkit.apps.bench import report as bench_report
from toolkit.reference.checkpoint import save_checkpoint
from toolkit.apps.cli import main
from toolkit.reference.config import preset
from toolkit.reference.model import Transformer

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("model", "engine", "precision", "fused", "batch_size", "tokens_per_s", "latency_ms_p50", "latency_ms_p90",
            "roofline_fraction", "ratio_to_first", "encoder_ms", "step_ms", "peak_rss_mb", "rss_growth_mb",
            "model_mb", "roofline_bound", "tokens_generated")
NEW_TOKENS = 5
FAST = ["--repeat", "1", "--warmup", "0", "--src-len", "6", "--new-tokens", str(NEW_TOKENS), "--threads", "1"]


def cli(*args, env=None) -> subprocess.CompletedProcess:
    """Run `onnxformer ARGS` in a fresh interpreter, as a user would."""
    return subprocess.run([sys.executable, "-m", "toolkit.apps.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny random checkpoint and its fp32 bundle (exported without the parity gate, to stay fast)."""
    from exporters.export import export_checkpoint

    root = tmp_path_factory.mktemp("bench")
    ckpt = save_checkpoint(root / "tiny-ckpt", Transformer(preset("tiny", max_len=24), seed=3))
    bundle = export_checkpoint(ckpt, root / "tiny-bundle", check_parity=False)
    return ckpt, bundle


@pytest.fixture(scope="module")
def run(models, tmp_path_factory):
    """One benchmark of checkpoint and bundle at batch sizes 1 and 3, with --json, --plot and --step-profile."""
    ckpt, bundle = models
    out = tmp_path_factory.mktemp("bench-out")
    proc = cli("bench", str(ckpt), str(bundle), "--batch-sizes", "1,3", *FAST, "--step-profile", "--json",
               "--plot", str(out / "chart.png"), "--save", str(out / "report.json"))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), out


def test_rows_have_every_engine_and_the_required_keys(run):
    report, _ = run
    engines = [(Path(r["model"]).name, r["engine"], r["batch_size"]) for r in report["rows"]]
    assert engines == [("tiny-ckpt", "torch-cache", 1), ("tiny-ckpt", "torch-nocache", 1), ("tiny-bundle", "cpu", 1),
                       ("tiny-ckpt", "torch-cache", 3), ("tiny-ckpt", "torch-nocache", 3), ("tiny-bundle", "cpu", 3)]
    for row in report["rows"]:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, f"{row['engine']} lacks {missing}"
        assert row["tokens_per_s"] > 0 and row["latency_ms_p90"] >= row["latency_ms_p50"] > 0
        assert row["roofline_bound"] in ("memory", "compute") and row["roofline_fraction"] > 0
        assert row["peak_rss_mb"] > 0 and row["model_mb"] > 0
    s = report["settings"]
    assert (s["batch_sizes"], s["new_tokens"], s["src_len"], s["threads"], s["repeat"]) == ([1, 3], NEW_TOKENS, 6, 1, 1)
    assert report["machine"]["bandwidth_gbs"] > 0 and report["machine"]["gemm_gflops"] > 0


def test_every_engine_generates_exactly_new_tokens(run):
    report, _ = run
    for row in report["rows"]:
        assert row["tokens_generated"] == row["tokens_generated_max"] == NEW_TOKENS, row["engine"]


def test_ratio_to_first_is_relative_to_the_first_models_first_engine(run):
    report, _ = run
    for batch in (1, 3):
        rows = [r for r in report["rows"] if r["batch_size"] == batch]
        assert rows[0]["ratio_to_first"] == 1.0
        for r in rows:
            assert r["ratio_to_first"] == pytest.approx(r["tokens_per_s"] / rows[0]["tokens_per_s"], rel=1e-2)


def test_precision_fusion_and_weights_come_from_the_model(run, models):
    report, _ = run
    by_engine = {(r["engine"], r["batch_size"]): r for r in report["rows"]}
    torch_row, ort_row = by_engine["torch-cache", 1], by_engine["cpu", 1]
    assert (ort_row["precision"], ort_row["fused"], ort_row["torch_loaded"]) == ("fp32", False, False)
    expected = probe.torch_step_weight_bytes(Transformer(preset("tiny", max_len=24)))
    assert torch_row["weight_mb_per_step"] == pytest.approx(expected / 2**20, abs=0.01)
    # the exported decoder holds the same weights (the embedding table only as a lookup and the output matrix)
    assert ort_row["weight_mb_per_step"] == pytest.approx(torch_row["weight_mb_per_step"], rel=0.05)


def test_step_profile_reports_both_past_lengths(run):
    report, _ = run
    profiles = report["step_profile"]
    assert [p["engine"] for p in profiles] == ["torch-cache", "cpu"]      # cached engines only
    for p in profiles:
        assert list(p["step_ms_at_past"]) == ["8", "23"]                    # 256 clipped to max_len - 1
        assert p["ratio"] > 0 and p["new_tokens"] == 24


def test_plot_and_saved_report_are_written(run):
    report, out = run
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "report.json").read_text())["rows"] == report["rows"]


def test_table_is_printed_without_json(models):
    ckpt, _ = models
    proc = cli("bench", str(ckpt), "--batch-sizes", "2", "--no-nocache", *FAST)
    assert proc.returncode == 0, proc.stderr
    assert "torch-cache" in proc.stdout and "torch-nocache" not in proc.stdout and "tok/s" in proc.stdout


def test_bundle_bench_runs_with_only_numpy_onnxruntime_and_click(models, tmp_path):
    """torch, onnx, rich and matplotlib are shadowed by packages that refuse to import: plain progress and table."""
    _, bundle = models
    blocked = tmp_path / "blocked"
    for name in ("torch", "onnx", "rich", "matplotlib"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked in this test')\n")
    env = dict(os.environ, PYTHONPATH=str(blocked))
    proc = cli("bench", str(bundle), "--batch-sizes", "1", *FAST, "--save", str(tmp_path / "r.json"), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stdout and "[1/" in proc.stderr                 # plain table, plain progress lines
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert (row["engine"], row["tokens_generated"], row["torch_loaded"]) == ("cpu", NEW_TOKENS, False)
    assert row["weight_source"] == "decoder file size"


@pytest.mark.parametrize("args, message", [
    (["does/not/exist"], "does not exist"),
    (["{ckpt}", "--batch-sizes", "1,x"], "comma-separated list of positive integers"),
    (["{ckpt}", "--batch-sizes", "0"], "comma-separated list of positive integers"),
    (["{ckpt}", "--new-tokens", "25"], "lower --src-len"),
    (["{ckpt}", "--plot", "no/such/dir/x.png"], "directory does not exist"),
])
def test_bad_input_exits_2_with_one_line(models, args, message):
    ckpt, _ = models
    result = CliRunner().invoke(main, ["bench", *(a.format(ckpt=ckpt) for a in args)])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_engine_load_errors_come_back_as_user_errors(models):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("CUDA is available here, so --provider cuda is not an error")
    _, bundle = models
    proc = cli("bench", str(bundle), "--provider", "cuda", *FAST)
    assert proc.returncode == 2
    assert "CUDAExecutionProvider is not available" in proc.stderr and "Traceback" not in proc.stderr


def test_peak_rss_sees_an_allocation_and_resets():
    if not probe.reset_peak():                                      # earlier tests may have left a higher peak
        pytest.skip("this kernel cannot reset the peak-RSS mark (/proc/self/clear_refs)")
    before = probe.peak_rss_bytes()
    block = np.ones(64 << 20, dtype=np.uint8)                       # 64 MiB, touched
    assert probe.peak_rss_bytes() >= before + (60 << 20)
    del block
    assert probe.reset_peak()
    assert probe.peak_rss_bytes() < before + (32 << 20)


def test_roofline_picks_the_larger_bound():
    config = preset("base", vocab_size=8000).to_dict()
    machine = {"bandwidth_gbs": 10.0, "gemm_gflops": 100.0}
    weights = 100 * 10**6
    small = bench_report.roofline(config, weights, batch=1, past=10, src_len=32, step_s=0.02, machine=machine)
    assert small["roofline_bound"] == "memory"
    assert small["bound_ms"] == pytest.approx((weights + bench_report.step_cache_bytes(config, 1, 10, 32)) / 1e10 * 1e3, rel=1e-3)
    assert small["roofline_fraction"] == pytest.approx(small["bound_ms"] / 20, rel=1e-3)
    big = bench_report.roofline(config, weights, batch=64, past=10, src_len=32, step_s=0.02, machine=machine)
    assert big["roofline_bound"] == "compute"
    # per token: 6 layers x (6 d^2 + 2 d d_ff) + vocab x d multiply-adds, plus attention over 11 + 32 keys
    d, f = 512, 2048
    macs = 6 * (6 * d * d + 2 * d * f) + 8000 * d + 6 * 2 * d * (11 + 32)
    assert bench_report.step_flops(config, 64, 10, 32) == 2 * 64 * macs
