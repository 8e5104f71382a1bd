#!/usr/bin/env bash
# Deploy the example model to a CPU edge device: export and optimize on the workstation, copy the bundle, run it
# with the minimal install. The "device" here is a fresh virtual environment holding only onnxformer[cpu]
# (numpy, onnxruntime, click, rich: no PyTorch, no onnx); on a real device, copy the wheel and the bundle over.
#
#   bash examples/edge/run_edge.sh                      # the example model, into out/edge
#   CKPT=path/to/checkpoint OUT=out/mine bash examples/edge/run_edge.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

CKPT=${CKPT:-examples/dates/checkpoint}
OUT=${OUT:-out/edge}
ONNXFORMER=${ONNXFORMER:-.venv/bin/onnxformer}       # the workstation install (make install)
PYTHON=${PYTHON:-.venv/bin/python}

echo "== 1. workstation: export (fp32, parity-checked), then fuse + int8 + ORT-format graphs"
"$ONNXFORMER" export "$CKPT" --out "$OUT/fp32" --force
"$ONNXFORMER" optimize "$OUT/fp32" --out "$OUT/bundle" --target cpu --precision int8 --ort-format --force
"$ONNXFORMER" inspect "$OUT/bundle"
du -sh "$OUT/fp32" "$OUT/bundle"

echo "== 2. the device: a plain venv with only onnxformer[cpu], and a copy of the bundle"
rm -rf "$OUT/device"
mkdir -p "$OUT/device/src"                                             # build the wheel from a copy: the
cp -r pyproject.toml README.md toolkit runtime exporters "$OUT/device/src"  # repository stays clean
"$PYTHON" -m pip wheel -q --no-deps -w "$OUT/device/wheels" "$OUT/device/src"   # or: pip install "onnxformer[cpu]"
python3 -m venv "$OUT/device/venv"
"$OUT/device/venv/bin/pip" install -q "$(ls "$OUT"/device/wheels/onnxformer-*.whl)[cpu]"
cp -r "$OUT/bundle" "$OUT/device/dates"                                # on a real device: scp -r
if "$OUT/device/venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "unexpected: torch is importable on the device" >&2; exit 1
fi

echo "== 3. run it there: onnxformer, then the numpy-only script (no onnxformer import)"
"$OUT/device/venv/bin/onnxformer" generate "$OUT/device/dates" "Monday, 30 November 2026" "11/30/26" "30.11.2026"
"$OUT/device/venv/bin/python" examples/edge/greedy_numpy.py "$OUT/device/dates" "Nov 30th 2026" "1999-02-03"
"$OUT/device/venv/bin/onnxformer" bench "$OUT/device/dates" --batch-sizes 1 --new-tokens 16 --repeat 3
"$OUT/device/venv/bin/onnxformer" export "$CKPT" --out "$OUT/device/nope" || echo "(as expected: export needs the export extra)"
