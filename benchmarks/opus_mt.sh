#!/usr/bin/env bash
# The opus-mt-en-de shape (vocab 58101, d_model 512, 6+6 layers, 8 heads, FFN 2048, swish, tied embeddings) with
# random weights, through the real import path: a Marian directory (toolkit/testing/tiny_marian.random_marian) ->
# onnxformer import -> export -> optimize fp32 (fused) and int8 -> bench against PyTorch eager with KV cache in
# one run. Writes benchmarks/opus-mt.json (tables to stdout); models go to $WORK (default out/bench/opus-mt).
#
#   REPEAT=3 WARMUP=1 THREADS=2 BATCH_SIZES=1,8 SRC_LEN=32 NEW_TOKENS=64 bash benchmarks/opus_mt.sh
# The measurements (bench, projection profile) run under the shared lock /tmp/onnxformer-bench.lock.
set -euo pipefail
cd "$(dirname "$0")/.."
OX=${ONNXFORMER:-.venv/bin/onnxformer}
PY=${PYTHON:-.venv/bin/python}
WORK=${WORK:-out/bench/opus-mt}
RESULTS=${RESULTS:-benchmarks}
start=$SECONDS
log() { printf '==> [%4ds] %s\n' $((SECONDS - start)) "$*" >&2; }
mkdir -p "$WORK"
if [[ ! -f "$WORK/marian/config.json" ]]; then
    log "random-weight Marian directory of the opus-mt-en-de shape"
    "$PY" -c "from toolkit.testing.tiny_marian import random_marian; random_marian('$WORK/marian')"
fi
log "import, export, optimize"
"$OX" import "$WORK/marian" --out "$WORK/checkpoint" --force
"$OX" export "$WORK/checkpoint" --out "$WORK/fp32-unfused" --force
"$OX" optimize "$WORK/fp32-unfused" --out "$WORK/fp32-fused" --target cpu --precision fp32 --force
"$OX" optimize "$WORK/fp32-unfused" --out "$WORK/int8" --target cpu --precision int8 --force \
    --allow-unverified                       # random weights: the int8 gate cannot pass (speed only)
log "bench (uptime: $(uptime))"
flock /tmp/onnxformer-bench.lock "$OX" bench "$WORK/checkpoint" "$WORK/fp32-fused" "$WORK/int8" --batch-sizes "${BATCH_SIZES:-1,8}" \
    --src-len "${SRC_LEN:-32}" --new-tokens "${NEW_TOKENS:-64}" --threads "${THREADS:-2}" --repeat "${REPEAT:-3}" \
    --warmup "${WARMUP:-1}" --provider cpu --no-nocache --step-profile --save "$RESULTS/opus-mt.json"
log "output projection share of a step (uptime: $(uptime))"
flock /tmp/onnxformer-bench.lock "$PY" benchmarks/projection_share.py "$WORK/fp32-fused" "$WORK/int8" \
    --batch-sizes "${BATCH_SIZES:-1,8}" --threads "${THREADS:-2}"
log "done (uptime: $(uptime))"
