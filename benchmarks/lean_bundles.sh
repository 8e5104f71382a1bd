#!/usr/bin/env bash
# Size, peak resident memory of `onnxformer generate` (batch 1, 64 new tokens) and decode step time of int8/int4
# bundles side by side, in one run (what the lean-bundle targets are judged by). Run it under the shared lock:
#
#   flock /tmp/onnxformer-bench.lock bash benchmarks/lean_bundles.sh NAME=BUNDLE[@PROGRAM]... [-- BENCH_OPTIONS]
#   e.g. bash benchmarks/lean_bundles.sh before=out/base-int8-before int8=out/base-int8 int4=out/base-int4
#
# PROGRAM (optional, per bundle): the command that runs `generate` for the memory column instead of this tree's
# onnxformer, e.g. a wrapper around another checkout, to compare the runtime's code before and after a change.
#
# Size: every file of the bundle (MB = 10^6 bytes). Memory: the maximum resident set size /usr/bin/time reports for
# `onnxformer generate BUNDLE --ids ... --max-new-tokens 64` (24 source tokens, EOS can stop it early; the
# same ids for every bundle), the smallest of 3 runs. Speed: `onnxformer bench` over all bundles in one run
# (interleaved rounds, EOS suppressed: exactly 64 steps).
set -euo pipefail
cd "$(dirname "$0")/.."
OX=${ONNXFORMER:-.venv/bin/onnxformer}
NAMES=() ; PATHS=()
PROGS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  NAMES+=("${1%%=*}"); spec=${1#*=}
  if [[ $spec == *@* ]]; then PATHS+=("${spec%%@*}"); PROGS+=("${spec#*@}"); else PATHS+=("$spec"); PROGS+=("$OX"); fi
  shift
done
[ "${1:-}" = "--" ] && shift
[ ${#PATHS[@]} -gt 0 ] || { echo "usage: benchmarks/lean_bundles.sh NAME=BUNDLE[@PROGRAM]... [-- BENCH_OPTIONS]" >&2; exit 2; }
TOK=$(mktemp); trap 'rm -f "$TOK"' EXIT
echo "load average before: $(uptime | sed 's/.*load average: //')"
VOCAB=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1] + '/manifest.json'))['model']['vocab_size'])" "${PATHS[0]}")
IDS=$(python3 -c "import random; random.seed(1); print(' '.join(str(random.randrange(3, $VOCAB)) for _ in range(24)))")
printf "%-14s %-9s %10s %10s %17s  %s\n" bundle precision "size MB" "size MiB" "generate RSS MiB" "tokens (md5)"
for i in "${!PATHS[@]}"; do
  p=${PATHS[$i]}
  size=$(python3 -c "import sys,pathlib; b=sum(f.stat().st_size for f in pathlib.Path(sys.argv[1]).iterdir() if f.is_file()); print(f'{b/1e6:.2f} {b/2**20:.1f}')" "$p")
  prec=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1] + '/manifest.json'))['precision'])" "$p")
  best=
  for _ in 1 2 3; do
    kb=$( { /usr/bin/time -f "%M" ${PROGS[$i]} generate "$p" --ids "$IDS" --max-new-tokens 64 --provider cpu > "$TOK"; } 2>&1 | tail -1)
    [ -z "$best" ] || [ "$kb" -lt "$best" ] && best=$kb
  done
  printf "%-14s %-9s %10s %10s %17.1f  %s\n" "${NAMES[$i]}" "$prec" ${size} "$(echo "$best / 1024" | bc -l)" "$(md5sum < "$TOK" | cut -c1-8)"
done
"$OX" bench "${PATHS[@]}" --batch-sizes 1,8 --new-tokens 64 --provider cpu "$@"
echo "load average after: $(uptime | sed 's/.*load average: //')"
