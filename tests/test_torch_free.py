"""A bundle runs where torch, onnx and onnxscript cannot be imported: the runtime API and `onnxformer generate`.

Each check runs in a subprocess whose sitecustomize (on PYTHONPATH) puts a sys.meta_path finder in front
that raises ImportError for torch, onnx and onnxscript and records every attempt; at exit it writes which
of them were attempted or ended up in sys.modules. The results must equal PyTorch's, computed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.generate import generate_ids, to_outputs
from runtime.search import SearchOptions
from runtime.tokenizer import CharTokenizer
from toolkit.reference.checkpoint import load_checkpoint
from toolkit.reference.torch_engine import TorchEngine

ROOT = Path(__file__).resolve().parents[1]
ONNXFORMER = Path(sys.executable).with_name("onnxformer")

SITECUSTOMIZE = '''
import atexit, json, os, sys

BLOCKED = ("torch", "onnx", "onnxscript")
attempts = []

class Block:
    """Refuse the packages a deployed runtime does not have."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            attempts.append(name)
            raise ImportError(f"{name} is blocked in this test (torch-free runtime)")
        return None

sys.meta_path.insert(0, Block())

@atexit.register
def report():
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    with open(os.environ["BLOCK_REPORT"], "w") as f:
        json.dump({"attempts": attempts, "loaded": loaded}, f)
'''

RUNTIME_SCRIPT = '''
import json, sys
from runtime.bundle import load_bundle
from runtime.generate import generate_ids
from runtime.search import SearchOptions

bundle = load_bundle(sys.argv[1], provider="auto")
seqs = json.loads(sys.argv[2])
result = {"provider": bundle.provider}
for beam in (1, 3):
    for iob in (False, True):
        engine = load_bundle(sys.argv[1], provider="cpu", io_binding=iob).engine
        hyps = generate_ids(engine, seqs, SearchOptions(max_new_tokens=12, beam=beam, num_return=beam))
        result[f"beam{beam}-{iob}"] = [[h.tokens for h in per] for per in hyps]
print(json.dumps(result))
'''


def run_blocked(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """Run a command with torch/onnx/onnxscript blocked; returns the process and the block report."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "BLOCK_REPORT": str(report)}
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert report.exists(), f"the blocker did not run:\n{proc.stderr}"
    return proc, json.loads(report.read_text())


def test_blocker_really_blocks(tmp_path):
    proc, report = run_blocked([sys.executable, "-c", "import torch"], tmp_path)
    assert proc.returncode != 0 and "blocked in this test" in proc.stderr
    assert report == {"attempts": ["torch"], "loaded": []}


def test_runtime_api_generates_without_torch(toy_exported, tmp_path):
    checkpoint, bundle = toy_exported
    seqs = [[5, 6, 7], [30, 31, 32, 33, 34, 35], [9]]
    proc, report = run_blocked([sys.executable, "-c", RUNTIME_SCRIPT, str(bundle), json.dumps(seqs)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert report == {"attempts": [], "loaded": []}                 # not even tried
    result = json.loads(proc.stdout)
    assert result["provider"] in ("cpu", "cuda")
    model = load_checkpoint(checkpoint).model
    for beam in (1, 3):
        hyps = generate_ids(TorchEngine(model), seqs, SearchOptions(max_new_tokens=12, beam=beam, num_return=beam))
        expected = [[h.tokens for h in per] for per in hyps]
        assert result[f"beam{beam}-False"] == expected
        assert result[f"beam{beam}-True"] == expected


@pytest.mark.parametrize("beam", [1, 4])
def test_generate_cli_without_torch(toy_exported, tmp_path, beam):
    checkpoint, bundle = toy_exported
    texts = ["hello", "Ab3", "zz"]
    proc, report = run_blocked([str(ONNXFORMER), "generate", str(bundle), *texts, "--beam", str(beam),
                                "--ids", "5 6 7", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert report["loaded"] == []
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    ckpt = load_checkpoint(checkpoint)
    tokenizer = CharTokenizer.load(Path(bundle) / "tokenizer.json")
    seqs = [tokenizer.encode(t) for t in texts] + [[5, 6, 7]]
    expected = to_outputs(generate_ids(TorchEngine(ckpt.model), seqs, SearchOptions(max_new_tokens=64, beam=beam)),
                          tokenizer.eos_id, tokenizer)
    assert [(o["index"], o["ids"], o["text"]) for o in lines] == [(o.index, o.ids, o.text) for o in expected]


def test_generate_cli_bad_input_exits_2_without_torch(toy_exported, tmp_path):
    proc, report = run_blocked([str(ONNXFORMER), "generate", str(toy_exported[1]), "--ids", "5 99"], tmp_path)
    assert proc.returncode == 2 and report["loaded"] == []
    assert proc.stderr.count("\n") == 1 and "outside the source vocabulary" in proc.stderr


def test_python_api_example_without_torch(toy_exported, tmp_path):
    """The Python API (runtime.Translator), as examples/python/translate_file.py uses it, runs without torch."""
    (tmp_path / "in.txt").write_text("hello\nAb3\n")
    example = ROOT / "examples" / "python" / "translate_file.py"
    proc, report = run_blocked([sys.executable, str(example), str(toy_exported[1]), str(tmp_path / "in.txt"),
                                "--provider", "cpu"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert report == {"attempts": [], "loaded": []}
    lines = proc.stdout.splitlines()
    assert len(lines) == 6 and lines[0] == "hello" and lines[3] == "Ab3" and lines[1].startswith("  1. ")


AUDIO_SCRIPT = '''
import json, sys
import numpy as np, soundfile
from runtime.audio import batch_features, features_for, load_audio

t = np.arange(44100) / 44100
soundfile.write(sys.argv[1], np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 900 * t)], 1) * 0.3, 44100)
audio = load_audio(sys.argv[1])
print(json.dumps({"samples": audio.shape, "features": features_for(sys.argv[1], 128).shape,
                  "batch": batch_features([audio, audio[:8000]], 80).shape}))
'''


def test_audio_front_end_without_torch(tmp_path):
    """runtime.audio reads, resamples and computes Whisper's log-mel with torch, onnx and onnxscript blocked."""
    pytest.importorskip("soundfile")
    pytest.importorskip("soxr")
    proc, report = run_blocked([sys.executable, "-c", AUDIO_SCRIPT, str(tmp_path / "clip.wav")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert report == {"attempts": [], "loaded": []}
    assert json.loads(proc.stdout) == {"samples": [16000], "features": [1, 128, 3000], "batch": [2, 80, 3000]}
