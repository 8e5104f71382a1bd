#!/usr/bin/env bash
# int8 activation scales, per tensor (the default) vs per row (optimize --activation-scales per-row), in one run:
# decode step at batch 1 and 8 and encoder time (onnxformer bench, bundles interleaved round by round), CPU time
# per token on one thread (benchmarks/cpu_time_per_token.py, which the neighbours' load hardly moves), and on the
# dates model the batch-neighbour dependence and held-out accuracy (benchmarks/batch_neighbours.py).
#
#   bash benchmarks/studies/activation_scales.sh build                                    # bundles, not timed
#   flock /tmp/onnxformer-bench.lock bash benchmarks/studies/activation_scales.sh measure # the measurements
#
# Bundles (under $DIR, default out/activation-scales): dates (examples/dates/checkpoint) fused fp32, int8 and
# int8-row (the gate must pass); base (`onnxformer init --preset base --vocab 8000`, random weights, so
# --allow-unverified) int8 and int8-row with the gate's weight-scale choice (per channel on this model), and
# int8-pt / int8-pt-row with --per-tensor weight scales (the faster kernel setting); base-nbits8 / dates-nbits8:
# the int8-pt / int8 weights as MatMulNBits 8-bit (benchmarks/studies/nbits8_variant.py, the one-kernel batch-invariant
# form, not gated). JSON beside the tables in $DIR.
set -euo pipefail
cd "$(dirname "$0")/../.."
OX=${ONNXFORMER:-.venv/bin/onnxformer}
PY=${PYTHON:-.venv/bin/python}
DIR=${DIR:-out/activation-scales}
THREADS=${THREADS:-2}
step=${1:-}

build() {
  mkdir -p "$DIR"
  [ -d "$DIR/dates-fp32" ] || "$OX" export examples/dates/checkpoint --out "$DIR/dates-fp32"
  [ -d "$DIR/dates-fused" ] || "$OX" optimize "$DIR/dates-fp32" --out "$DIR/dates-fused" --target cpu --precision fp32
  [ -d "$DIR/dates-int8" ] || "$OX" optimize "$DIR/dates-fp32" --out "$DIR/dates-int8" --target cpu --precision int8
  [ -d "$DIR/dates-int8-row" ] || "$OX" optimize "$DIR/dates-fp32" --out "$DIR/dates-int8-row" --target cpu \
      --precision int8 --activation-scales per-row
  [ -d "$DIR/base-checkpoint" ] || "$OX" init --preset base --vocab 8000 --out "$DIR/base-checkpoint"
  [ -d "$DIR/base-fp32" ] || "$OX" export "$DIR/base-checkpoint" --out "$DIR/base-fp32"
  local b=("--target" "cpu" "--precision" "int8" "--allow-unverified")
  [ -d "$DIR/base-int8" ] || "$OX" optimize "$DIR/base-fp32" --out "$DIR/base-int8" "${b[@]}"
  [ -d "$DIR/base-int8-row" ] || "$OX" optimize "$DIR/base-fp32" --out "$DIR/base-int8-row" "${b[@]}" \
      --activation-scales per-row
  [ -d "$DIR/base-int8-pt" ] || "$OX" optimize "$DIR/base-fp32" --out "$DIR/base-int8-pt" "${b[@]}" --per-tensor
  [ -d "$DIR/base-int8-pt-row" ] || "$OX" optimize "$DIR/base-fp32" --out "$DIR/base-int8-pt-row" "${b[@]}" \
      --per-tensor --activation-scales per-row
  [ -d "$DIR/base-nbits8" ] || "$PY" benchmarks/studies/nbits8_variant.py "$DIR/base-int8-pt" "$DIR/base-nbits8"
  [ -d "$DIR/dates-nbits8" ] || "$PY" benchmarks/studies/nbits8_variant.py "$DIR/dates-int8" "$DIR/dates-nbits8"
}

measure() {
  for b in dates-fused dates-int8 dates-int8-row dates-nbits8 base-int8 base-int8-row base-int8-pt base-int8-pt-row \
      base-nbits8; do
    [ -f "$DIR/$b/manifest.json" ] || { echo "error: $DIR/$b is missing; run 'bash $0 build' first" >&2; exit 2; }
  done
  echo "load average before: $(uptime | sed 's/.*load average: //')  ($(date -u +%H:%M:%S) UTC)"
  echo "== base, vocab 8000: onnxformer bench (batch 1, 8, 32; 32 source tokens, 64 new tokens, $THREADS threads)"
  "$OX" bench "$DIR/base-int8" "$DIR/base-int8-row" "$DIR/base-int8-pt" "$DIR/base-int8-pt-row" "$DIR/base-nbits8" \
      --batch-sizes 1,8,32 --new-tokens 64 --provider cpu --threads "$THREADS" --repeat 5 --save "$DIR/bench-base.json"
  echo "load average: $(uptime | sed 's/.*load average: //')"
  echo "== dates: onnxformer bench (24 source tokens, 16 new tokens)"
  "$OX" bench "$DIR/dates-int8" "$DIR/dates-int8-row" --batch-sizes 1,8,32 --src-len 24 --new-tokens 16 \
      --provider cpu --threads "$THREADS" --repeat 5 --save "$DIR/bench-dates.json"
  echo "load average: $(uptime | sed 's/.*load average: //')"
  echo "== CPU time per token, one thread (base: 24 source tokens, 64 new tokens; dates: 16)"
  "$PY" benchmarks/cpu_time_per_token.py "$DIR/base-int8" "$DIR/base-int8-row" "$DIR/base-int8-pt" \
      "$DIR/base-int8-pt-row" "$DIR/base-nbits8" --rounds 7
  "$PY" benchmarks/cpu_time_per_token.py "$DIR/dates-int8" "$DIR/dates-int8-row" --rounds 7 --new-tokens 16
  echo "load average: $(uptime | sed 's/.*load average: //')"
  echo "== dates held-out set: batch neighbours (1,000 dates alone and in 8 random batches of 32) and accuracy"
  "$PY" benchmarks/batch_neighbours.py "$DIR/dates-fused" "$DIR/dates-int8" "$DIR/dates-int8-row" "$DIR/dates-nbits8" \
      --threads "$THREADS" --contexts 8 | tee "$DIR/batch-neighbours.txt"
  echo "== the same, batches of one source length only (no padding in a batch)"
  "$PY" benchmarks/batch_neighbours.py "$DIR/dates-fused" "$DIR/dates-int8" "$DIR/dates-int8-row" "$DIR/dates-nbits8" \
      --threads "$THREADS" --contexts 8 --same-length | tee "$DIR/batch-neighbours-same-length.txt"
  echo "== the gate's int8 record (greedy tokens equal to the source bundle, held-out exact match)"
  for b in dates-int8 dates-int8-row base-int8 base-int8-row base-int8-pt base-int8-pt-row; do
    "$PY" -c "import json,sys; m=json.load(open(sys.argv[1]+'/manifest.json')); p=m['parity']; g=p['generation']; \
a=p.get('accuracy') or {}; o=m['source']['options']; acts=o.get('activation_scales') or 'per-tensor'; \
print(f\"{sys.argv[2]:<18} weights {'per-channel' if o['per_channel'] else 'per-tensor':<12} activations {acts:<10} \
tokens equal {g['tokens_equal']:.2%} ({g['samples']} inputs)  accuracy {a.get('candidate', float('nan')):.2%}  verdict {p['verdict']}\")" \
      "$DIR/$b" "$b"
  done
  echo "load average after: $(uptime | sed 's/.*load average: //')  ($(date -u +%H:%M:%S) UTC)"
}

case "$step" in
  build) build ;;
  measure) measure ;;
  *) echo "usage: bash benchmarks/studies/activation_scales.sh build|measure (measure under flock /tmp/onnxformer-bench.lock)" >&2
     exit 2 ;;
esac
