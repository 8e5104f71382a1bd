#!/usr/bin/env bash
# The RESULTS.md benchmark set (`make bench`). For two models, the paper's base preset with vocab 8000
# (random weights) and the trained dates example, it builds the unfused fp32 export, the fused fp32 and
# the fused int8 bundles (static KV cache, optimize's CPU default) and, to show what the static cache buys,
# fused fp32 and int8 with the exported dynamic cache; then it benchmarks PyTorch (torch-cache,
# torch-nocache) and the five bundles side by side. The base set also profiles one decode step at past
# length 8 vs 255 (batch 1).
#
# Writes benchmarks/base.json, base.png, dates.json, dates.png (tables go to stdout).
# Intermediate models go to $WORK (default out/bench, ignored by git).
#
# Environment overrides (defaults = the RESULTS.md settings):
#   REPEAT=5 WARMUP=1 THREADS=2 BATCH_SIZES=1,8 SRC_LEN=32 NEW_TOKENS=64
#   DATES=examples/dates/checkpoint   (set DATES= to skip the dates set)
#   ONNXFORMER=.venv/bin/onnxformer WORK=out/bench RESULTS=benchmarks
# e.g. a quick end-to-end check:  REPEAT=1 WARMUP=0 bash benchmarks/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."

OX=${ONNXFORMER:-.venv/bin/onnxformer}
WORK=${WORK:-out/bench}
RESULTS=${RESULTS:-benchmarks}
DATES=${DATES-examples/dates/checkpoint}
BENCH_ARGS=(--batch-sizes "${BATCH_SIZES:-1,8}" --src-len "${SRC_LEN:-32}" --new-tokens "${NEW_TOKENS:-64}"
            --threads "${THREADS:-2}" --repeat "${REPEAT:-5}" --warmup "${WARMUP:-1}" --provider cpu)

if [[ -n "$DATES" && ! -f "$DATES/config.json" ]]; then
    echo "error: the dates checkpoint $DATES is missing; train it with" \
         "'onnxformer train --task dates --out $DATES', or set DATES= to skip the dates set" >&2
    exit 2
fi

start=$SECONDS
log() { printf '==> [%4ds] %s\n' $((SECONDS - start)) "$*" >&2; }

# bundles NAME CHECKPOINT [int8 options]: NAME-fp32-unfused (export); NAME-fp32-fused and NAME-int8 (optimize,
# static KV cache); NAME-fp32-fused-dynamic and NAME-int8-dynamic (optimize --kv-cache dynamic). The random-weight
# base model emits one output for every input, so its int8 gate is inconclusive: it is written --allow-unverified
# (speed only); the trained dates model's int8 bundles must pass the gate.
VARIANTS=(fp32-unfused fp32-fused-dynamic fp32-fused int8-dynamic int8)
bundles() {
    local name=$1 ckpt=$2 dir=$WORK/$1 v int8=("${@:3}")
    log "$name: export and optimize $ckpt into $dir"
    for v in "${VARIANTS[@]}"; do rm -rf "${dir:?}/$name-$v"; done
    mkdir -p "$dir"
    "$OX" export "$ckpt" --out "$dir/$name-fp32-unfused"
    "$OX" optimize "$dir/$name-fp32-unfused" --out "$dir/$name-fp32-fused" --target cpu --precision fp32
    "$OX" optimize "$dir/$name-fp32-unfused" --out "$dir/$name-int8" --target cpu --precision int8 "${int8[@]}"
    "$OX" optimize "$dir/$name-fp32-unfused" --out "$dir/$name-fp32-fused-dynamic" --target cpu --precision fp32 \
        --kv-cache dynamic
    "$OX" optimize "$dir/$name-fp32-unfused" --out "$dir/$name-int8-dynamic" --target cpu --precision int8 "${int8[@]}" \
        --kv-cache dynamic
}

# bench NAME CHECKPOINT [extra bench options]
bench() {
    local name=$1 ckpt=$2 dir=$WORK/$1
    shift 2
    log "$name: bench (${BENCH_ARGS[*]} $*)"
    local models=() v
    for v in "${VARIANTS[@]}"; do models+=("$dir/$name-$v"); done
    "$OX" bench "$ckpt" "${models[@]}" "${BENCH_ARGS[@]}" \
        --save "$RESULTS/$name.json" --plot "$RESULTS/$name.png" "$@"
}

mkdir -p "$WORK" "$RESULTS"
log "base: random-weight checkpoint (preset base, vocab 8000)"
"$OX" init --preset base --vocab 8000 --out "$WORK/base/base-checkpoint" --force
bundles base "$WORK/base/base-checkpoint" --allow-unverified
bench base "$WORK/base/base-checkpoint" --step-profile

if [[ -n "$DATES" ]]; then
    bundles dates "$DATES"
    # the example model serves at most 48 tokens each way: a date is ~25 characters in, 11 tokens out
    bench dates "$DATES" --src-len "${DATES_SRC_LEN:-24}" --new-tokens "${DATES_NEW_TOKENS:-16}"
fi
log "done: results in $RESULTS/ (base${DATES:+, dates}: .json and .png)"
