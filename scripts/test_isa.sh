#!/usr/bin/env bash
# The fast suite (`make test`'s) under every instruction set this CPU can stand in for, so that a test whose
# precondition holds only on one CPU's numerics fails here, not on a user's machine.
#
#   bash scripts/test_isa.sh [OUT_DIR]            # make test-isa; OUT_DIR defaults to out/test-isa
#   SETTINGS="avx2 bits7" bash scripts/test_isa.sh   # only some of the settings below
#   TESTS="tests/test_layers.py tests/test_runtime.py" bash scripts/test_isa.sh   # only these files (default: all)
#
# Settings (each one whole run of the fast suite, in its own process):
#   default, avx2, avx512   torch's kernels forced to that instruction set: ATen's (ATEN_CPU_CAPABILITY) and MKL's
#                           and oneDNN's (MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA), as on a CPU that has no more;
#                           the toy models the tests train are then other models, as on another machine. avx2 and
#                           avx512 only where this CPU has them.
#   bits7, bits8            int8 bundles built with --weight-bits 7 or 8 forced (tests/conftest.py's --weight-bits):
#                           what optimize picks on CPUs whose int8 kernel saturates (x86 without VNNI) and on the
#                           others. bits8 only where this CPU's int8 kernel does not saturate 8-bit products (there
#                           8-bit weights are wrong by design, and load_bundle says so).
# Writes OUT_DIR/SETTING.log per run and OUT_DIR/summary.txt (one line a setting: its environment and pytest's
# counts). Exit 0 when every run passed, 1 when one failed.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-out/test-isa}
mkdir -p "$OUT" || { echo "test_isa: cannot create $OUT; choose another OUT_DIR" >&2; exit 2; }
PY=.venv/bin/python
[ -x "$PY" ] || { echo "test_isa: $PY is missing; run make install first" >&2; exit 2; }

flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { for f in "$@"; do [[ " $flags " == *" $f "* ]] || return 1; done; }
saturates=$($PY -c "from runtime.session import int8_saturates; print(int(int8_saturates()))")

available="default"
has avx2 fma && available+=" avx2"
has avx512f avx512bw avx512vl avx512dq && available+=" avx512"
available+=" bits7"
[ "$saturates" = 0 ] && available+=" bits8"

env_of() {            # the environment and pytest arguments of one setting
  case $1 in
    default) echo "ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41" ;;
    avx2)    echo "ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2" ;;
    avx512)  echo "ATEN_CPU_CAPABILITY=avx512 MKL_ENABLE_INSTRUCTIONS=AVX512 ONEDNN_MAX_CPU_ISA=AVX512_CORE" ;;
    bits7)   echo "-- --weight-bits 7" ;;
    bits8)   echo "-- --weight-bits 8" ;;
  esac
}

settings=${SETTINGS:-$available}
for s in $settings; do
  [[ " $available " == *" $s "* ]] || { echo "test_isa: '$s' is not available on this CPU (available: $available)" >&2; exit 2; }
done

: > "$OUT/summary.txt"
failed=0
i=0; n=$(wc -w <<< "$settings")
for s in $settings; do
  i=$((i + 1))
  spec=$(env_of "$s"); vars=${spec%%--*}; args=""
  [[ $spec == *--* ]] && args=${spec#*-- }
  echo "==> [$i/$n] $s: ${vars:-(the kernels of this CPU)} ${args}"
  start=$(date +%s)
  env $vars "$PY" -m pytest -q -p no:cacheprovider -m "not gpu and not slow" $args ${TESTS:-} > "$OUT/$s.log" 2>&1
  rc=$?
  counts=$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$OUT/$s.log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
  line=$(printf '%-8s rc=%s %4ss  %s  [%s]' "$s" "$rc" "$(( $(date +%s) - start ))" "${counts:-no summary line}" "${vars}${args}")
  echo "$line" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || { failed=1; grep -E '^FAILED|^ERROR' "$OUT/$s.log" | head -20; }
done
echo "test_isa: $(grep -c 'rc=0' "$OUT/summary.txt") of $n settings passed (logs in $OUT)"
exit $failed
