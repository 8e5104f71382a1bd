#!/usr/bin/env bash
# The prepared GPU check: on a machine with an NVIDIA GPU, run the GPU tests and a short benchmark
# (PyTorch eager on CUDA vs ONNX Runtime CUDA fp32 and fp16, base preset, batch 1 and 32) and a short serving load
# run (onnxformer serve on CUDA + onnxformer loadtest, 64 requests) in under 5 minutes,
# writing everything to the directory given as the first argument.
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# Needs: torch with CUDA, onnx, onnxscript, onnxruntime-gpu, and the serve extra (fastapi, uvicorn, prometheus-client,
# httpx). Where onnxruntime-gpu is not installed, set
# ORT_GPU_WHEEL=/path/to/onnxruntime_gpu-*.whl: it is installed with --no-deps into a private directory put first
# on PYTHONPATH, so it shadows a CPU-only onnxruntime. Runs from a source checkout (no pip install needed).
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$(command -v python3)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$OUT/summary.txt"; }

if [ -n "${ORT_GPU_WHEEL:-}" ]; then
  log "installing $(basename "$ORT_GPU_WHEEL") into $WORK/ortgpu"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/ortgpu" "$ORT_GPU_WHEEL" || exit 2
  export PYTHONPATH="$WORK/ortgpu:$PYTHONPATH"
fi

ofx() { "$PY" -m toolkit.apps.cli "$@"; }

log "environment"
"$PY" - <<'EOF' 2>&1 | tee "$OUT/environment.txt"
import onnxruntime as ort, torch, onnx, onnxscript, platform
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| onnx", onnx.__version__, "| onnxscript", onnxscript.__version__, "| onnxruntime", ort.__version__)
print("ort providers:", ort.get_available_providers())
print("torch device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
assert "CUDAExecutionProvider" in ort.get_available_providers(), "onnxruntime has no CUDA provider: set ORT_GPU_WHEEL"
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "no CUDA execution provider: stopping"; exit 2; }

log "GPU tests (pytest -m gpu)"
"$PY" -m pytest -q -m gpu -p no:cacheprovider "$ROOT/tests/test_gpu.py" 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}
log "GPU tests exit code $tests_rc"

log "base preset: init, export, optimize for CUDA (fused fp32, fp16, fp32 with the static KV cache)"
ofx init --preset base --vocab 8000 --out "$WORK/base" >/dev/null &&
ofx export "$WORK/base" --out "$WORK/base-fp32" >"$OUT/export.log" 2>&1 &&
ofx optimize "$WORK/base-fp32" --out "$WORK/base-fused" --target cuda >"$OUT/optimize-fp32.log" 2>&1 &&
ofx optimize "$WORK/base-fp32" --out "$WORK/base-fp16" --target cuda --precision fp16 >"$OUT/optimize-fp16.log" 2>&1 &&
ofx optimize "$WORK/base-fp32" --out "$WORK/base-static" --target cuda --kv-cache static \
  >"$OUT/optimize-static.log" 2>&1 ||
  { log "export/optimize failed: see $OUT/*.log"; exit 1; }

log "parity on CUDA (fp32 fused, fp16)"
ofx parity "$WORK/base" "$WORK/base-fused" --provider cuda --samples 32 --json >"$OUT/parity-fp32.json"; p32=$?
ofx parity "$WORK/base" "$WORK/base-fp16" --provider cuda --samples 32 --json >"$OUT/parity-fp16.json"; p16=$?
ofx parity "$WORK/base" "$WORK/base-static" --provider cuda --samples 32 --json >"$OUT/parity-static.json"; pst=$?
log "parity exit codes: fp32 $p32, fp16 $p16, fp32 static cache $pst (0 = within tolerance)"

log "benchmark: PyTorch eager CUDA vs ONNX Runtime CUDA fp32 / fused fp32 / fp16, batch 1 and 32"
ofx bench "$WORK/base" "$WORK/base-fp32" "$WORK/base-fused" "$WORK/base-fp16" "$WORK/base-static" \
  --provider cuda --no-nocache \
  --batch-sizes 1,32 --src-len 32 --new-tokens 64 --repeat 3 --json --plot "$OUT/bench.png" >"$OUT/bench.json" \
  2>"$OUT/bench.log"; bench_rc=$?
log "bench exit code $bench_rc"
"$PY" - "$OUT/bench.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
print(f"{'model':<18}{'engine':<14}{'precision':<10}{'cache':<9}{'batch':>6}{'tokens/s':>11}{'p50 ms':>9}{'x first':>8}")
for r in rows:
    name = r["model"].rstrip("/").split("/")[-1]
    print(f"{name:<18}{r['engine']:<14}{r['precision']:<10}{r.get('kv_cache', '-'):<9}{r['batch_size']:>6}"
          f"{r['tokens_per_s']:>11.1f}"
          f"{r['latency_ms_p50']:>9.1f}{r['ratio_to_first']:>8.2f}")
EOF
log "serving on CUDA: onnxformer serve (fused fp32, static KV cache) + a bounded load run (64 requests, 16 clients)"
serve_rc=1
ofx serve "$WORK/base-static" --provider cuda --port 0 --max-batch 32 2>"$OUT/serve.log" &
srv=$!
url=""
for _ in $(seq 1 240); do
  url=$(sed -n 's/^ready: //p' "$OUT/serve.log" | head -1)
  [ -n "$url" ] || ! kill -0 "$srv" 2>/dev/null && break
  sleep 0.5
done
if [ -n "$url" ]; then
  "$PY" -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1] + '/v1/model').read().decode())" \
    "$url" >"$OUT/serve-model.json"
  # the server must run the engine exactly as generate does on CUDA: IO binding, cache kept on the device
  "$PY" -c "import json,sys; e=json.load(open(sys.argv[1]))['engine']; print('server engine:', e); \
sys.exit(0 if e.startswith('ort-cuda-') and ('iobinding' in e or 'static-cache' in e) else 1)" "$OUT/serve-model.json" \
    | tee -a "$OUT/summary.txt"; engine_rc=${PIPESTATUS[0]}
  ofx loadtest "$url" --requests 64 --concurrency 16 --min-new-tokens 8 --max-new-tokens 64 --json \
    >"$OUT/loadtest.json" 2>"$OUT/loadtest.log"; lt_rc=$?
  kill -TERM "$srv"; wait "$srv"; srv_rc=$?
  "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"serve load: {r['ok']}/{r['sent']} ok, \
{r['errors']} errors, {r['lost']} lost, {r['throughput_rps']} req/s, {r['tokens_per_s']} tokens/s, \
p50 {r['latency_ms']['p50']} ms, p99 {r['latency_ms']['p99']} ms, mean batch {r['mean_batch_rows']}\")" \
    "$OUT/loadtest.json" 2>/dev/null | tee -a "$OUT/summary.txt"
  log "serve: engine check $engine_rc, loadtest exit code $lt_rc, server exit code $srv_rc (SIGTERM drain: 0)"
  [ "$engine_rc" -eq 0 ] && [ "$lt_rc" -eq 0 ] && [ "$srv_rc" -eq 0 ] && serve_rc=0
else
  kill "$srv" 2>/dev/null; log "the server did not become ready: see $OUT/serve.log"
fi

log "done: $OUT"
[ "$tests_rc" -eq 0 ] && [ "$p32" -eq 0 ] && [ "$p16" -eq 0 ] && [ "$pst" -eq 0 ] && [ "$bench_rc" -eq 0 ] &&
  [ "$serve_rc" -eq 0 ]
