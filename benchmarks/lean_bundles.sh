#!/usr/bin/env bash
# Size, peak resident memory of `onnxformer generate` (batch 1, 64 new tokens) and decode step time of int8/int4
# bundles side by side, in one run (issue 16's targets). Run it under the shared lock:
#
#   flock /tmp/onnxformer-bench.lock bash benchmarks/lean_bundles.sh NAME=BUNDLE... [-- BENCH_OPTIONS]
#   e.g. bash benchmarks/lean_bundles.sh before=out/base-int8-before int8=out/base-int8 int4=out/base-int4
#
# Size: every file of the bundle (MB = 10^6 bytes). Memory: the maximum resident set size /usr/bin/time reports for
# `onnxformer generate BUNDLE --ids ... --max-new-tokens 64` (24 source tokens, EOS can stop it early; the
# same ids for every bundle), the smallest of 3 runs. Speed: `onnxformer bench` over all bundles in one run
# (interleaved rounds, EOS suppressed: exactly 64 steps).
set -euo pipefail
cd "$(dirname "$0")/.."
OX=${ONNXFORMER:-.venv/bin/onnxformer}
NAMES=() ; PATHS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do NAMES+=("${1%%=*}"); PATHS+=("${1#*=}"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#PATHS[@]} -gt 0 ] || { echo "usage: benchmarks/lean_bundles.sh NAME=BUNDLE... [-- BENCH_OPTIONS]" >&2; exit 2; }
echo "load average before: $(uptime | sed 's/.*load average: //')"
VOCAB=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1] + '/manifest.json'))['model']['vocab_size'])" "${PATHS[0]}")
IDS=$(python3 -c "import random; random.seed(1); print(' '.join(str(random.randrange(3, $VOCAB)) for _ in range(24)))")
printf "%-10s %-9s %10s %14s\n" bundle precision "size MB" "generate RSS MiB"
for i in "${!PATHS[@]}"; do
  p=${PATHS[$i]}
  size=$(python3 -c "import sys,pathlib; print(f'{sum(f.stat().st_size for f in pathlib.Path(sys.argv[1]).iterdir() if f.is_file())/1e6:.2f}')" "$p")
  prec=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1] + '/manifest.json'))['precision'])" "$p")
  best=
  for _ in 1 2 3; do
    kb=$( { /usr/bin/time -f "%M" "$OX" generate "$p" --ids "$IDS" --max-new-tokens 64 --provider cpu > /dev/null; } 2>&1 | tail -1)
    [ -z "$best" ] || [ "$kb" -lt "$best" ] && best=$kb
  done
  printf "%-10s %-9s %10s %14.1f\n" "${NAMES[$i]}" "$prec" "$size" "$(echo "$best / 1024" | bc -l)"
done
"$OX" bench "${PATHS[@]}" --batch-sizes 1,8 --new-tokens 64 --provider cpu "$@"
echo "load average after: $(uptime | sed 's/.*load average: //')"
