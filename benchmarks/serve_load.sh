#!/usr/bin/env bash
# Serving load figures for RESULTS.md: the base int8 bundle (benchmarks/run.sh builds it) behind `onnxformer serve`,
# 32 concurrent clients, mixed output lengths (8-128 new tokens, EOS suppressed), one run per server setting:
# one request at a time (--max-batch 1), request-level batching (--max-batch 32 --batching request) and in-flight
# batching (--max-batch 32 --batching inflight), in that order, in one command. Each run is bounded (REQUESTS
# requests, DURATION seconds) and stops by itself; the server gets SIGTERM after it and must exit 0.
#
#   flock /tmp/onnxformer-bench.lock bash benchmarks/serve_load.sh [BUNDLE]     (default out/bench/base/base-int8)
#
# A bundle whose manifest does not declare the per-row static cache (decoder_layout "static-per-row"; an older
# format, or another layout) cannot batch in-flight: it is rebuilt first from the base checkpoint beside it (CHECKPOINT, default BUNDLE/../base-checkpoint;
# export, then optimize --precision int8 --allow-unverified as benchmarks/run.sh does for the random-weight base).
#
# Writes benchmarks/serve_load.json (one report per setting) and prints a table row per setting.
set -euo pipefail
cd "$(dirname "$0")/.."
OX=${ONNXFORMER:-.venv/bin/onnxformer}
BUNDLE=${1:-out/bench/base/base-int8}
REQUESTS=${REQUESTS:-256}
CLIENTS=${CLIENTS:-32}
THREADS=${THREADS:-2}
DURATION=${DURATION:-300}
OUT=${OUT:-benchmarks/serve_load.json}
SETTINGS=${SETTINGS:-"one-at-a-time:--max-batch 1 --batching request|request-level:--max-batch 32 --batching request|in-flight:--max-batch 32 --batching inflight"}
[ -f "$BUNDLE/manifest.json" ] || { echo "error: $BUNDLE is not a bundle; build it with benchmarks/run.sh" >&2; exit 2; }
per_row=$("${PYTHON:-.venv/bin/python}" -c 'import json, sys
print(int(json.load(open(sys.argv[1])).get("decoder_layout") == "static-per-row"))' "$BUNDLE/manifest.json")
if [ "$per_row" != 1 ]; then
  CHECKPOINT=${CHECKPOINT:-$(dirname "$BUNDLE")/base-checkpoint}
  [ -d "$CHECKPOINT" ] || { echo "error: $BUNDLE is not a per-row static-cache bundle and $CHECKPOINT is missing; rebuild it with benchmarks/run.sh" >&2; exit 2; }
  echo "rebuilding $BUNDLE from $CHECKPOINT (its manifest declares no per-row static cache)" >&2
  "$OX" export "$CHECKPOINT" --out "$BUNDLE.fp32-unfused" --force
  "$OX" optimize "$BUNDLE.fp32-unfused" --out "$BUNDLE" --target cpu --precision int8 --allow-unverified --force
  rm -rf "$BUNDLE.fp32-unfused"
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "load: $(uptime)" >&2
IFS='|' read -ra RUNS <<< "$SETTINGS"
for run in "${RUNS[@]}"; do
  name=${run%%:*}; args=${run#*:}
  # shellcheck disable=SC2086
  "$OX" serve "$BUNDLE" --port 0 --threads "$THREADS" --provider cpu $args 2>"$WORK/$name.log" &
  srv=$!
  url=""
  for _ in $(seq 1 600); do
    url=$(sed -n 's/^ready: //p' "$WORK/$name.log" | head -1)
    if [ -n "$url" ] || ! kill -0 "$srv" 2>/dev/null; then break; fi
    sleep 0.2
  done
  [ -n "$url" ] || { cat "$WORK/$name.log" >&2; exit 1; }
  rc=0
  "$OX" loadtest "$url" --requests "$REQUESTS" --concurrency "$CLIENTS" --min-new-tokens 8 --max-new-tokens 128 \
    --duration "$DURATION" --json --save "$WORK/$name.json" >/dev/null || rc=$?
  kill -TERM "$srv"; wait "$srv" || { echo "error: server ($name) did not exit 0 after SIGTERM" >&2; exit 1; }
  echo "$name: loadtest exit $rc; $(tail -1 "$WORK/$name.log")" >&2
done
"${PYTHON:-.venv/bin/python}" - "$OUT" "$WORK" "${RUNS[@]}" <<'PY'
import json, subprocess, sys
out, work, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
reports = {r.split(":")[0]: json.load(open(f"{work}/{r.split(':')[0]}.json")) for r in runs}
first = next(iter(reports.values()))
json.dump({"uptime_before_write": load, "reports": reports}, open(out, "w"), indent=2)
print(f"{'setting':<16}{'sent':>6}{'ok':>6}{'err':>5}{'lost':>5}{'req/s':>8}{'tok/s':>8}{'p50 ms':>9}{'p90 ms':>9}"
      f"{'p99 ms':>9}{'batch':>7}{'x first':>8}")
for name, r in reports.items():
    lat = r["latency_ms"]
    print(f"{name:<16}{r['sent']:>6}{r['ok']:>6}{r['errors']:>5}{r['lost']:>5}{r['throughput_rps']:>8.2f}"
          f"{r['tokens_per_s']:>8.0f}{lat['p50']:>9.0f}{lat['p90']:>9.0f}{lat['p99']:>9.0f}{r['mean_batch_rows']:>7.2f}"
          f"{r['throughput_rps'] / first['throughput_rps']:>8.2f}")
if "in-flight" in reports and "request-level" in reports:
    a, b = reports["in-flight"], reports["request-level"]
    print(f"in-flight / request-level: throughput {a['throughput_rps'] / b['throughput_rps']:.2f}x, "
          f"p99 {a['latency_ms']['p99'] / b['latency_ms']['p99']:.2f}x, p50 {a['latency_ms']['p50'] / b['latency_ms']['p50']:.2f}x")
print(load)
PY
