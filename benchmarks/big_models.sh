#!/usr/bin/env bash
# A real shape with random weights through the whole path, each step's peak resident memory measured
# (benchmarks/step_memory.py: the peak, and how much of it was anonymous and file-backed): build the save_pretrained
# directory (toolkit.testing.tiny_families.SHAPES), import, export, optimize fp32 and int8 (random weights pass no token gate: --allow-unverified), then generate 16 tokens with the
# Python API (a random model with tied embeddings ends at once: min_new_tokens).
#
#   SHAPE=nllb-600m WORK=/tmp/big bash benchmarks/big_models.sh   # $WORK/models/$SHAPE/{hf,checkpoint,onnxformer-*}
#   STEPS="generate-fp32 generate-int8" SHAPE=... bash benchmarks/big_models.sh   # only these steps (default: all)
#
# The folder names are race_peers.py's: `race_peers.py --model $SHAPE` with ONNXFORMER_PEERS=$WORK reuses them.
#
# Prints one line per step: seconds, peak RSS (anonymous, file-backed), and the size of what it wrote.
set -euo pipefail
SHAPE=${SHAPE:-nllb-600m}
WORK=${WORK:-out/peers}
PY=${PY:-.venv/bin/python}
D=$WORK/models/$SHAPE
OX="$PY -m toolkit.apps.cli"
mkdir -p "$D"

case $SHAPE in            # multilingual shapes generate into a target language (generate refuses without one)
  nllb-*) TGT=deu_Latn ;;
  mbart-large-50) TGT=de_DE ;;
  *) TGT= ;;
esac

step() {   # step NAME OUTPUT COMMAND...: run it under benchmarks/step_memory.py, report wall time, peak RSS (and
           # its anonymous and file-backed parts) and output size
  local name=$1 out=$2; shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
  $PY benchmarks/step_memory.py --label "$name" -- "$@" > "$D/$name.log" 2>&1 || { tail -20 "$D/$name.log"; exit 1; }
  echo "$(tail -1 "$D/$name.log"), $(du -sh --apparent-size "$out" | cut -f1) written"
}

[ -f "$D/hf/config.json" ] || step build "$D" $PY -c \
  "from toolkit.testing.tiny_families import random_original; random_original('$SHAPE', '$D/hf')"
step import "$D/checkpoint" $OX import "$D/hf" --out "$D/checkpoint" --force
step export "$D/onnxformer-export" $OX export "$D/checkpoint" --out "$D/onnxformer-export" --force
step optimize-fp32 "$D/onnxformer-fp32" $OX optimize "$D/onnxformer-export" --out "$D/onnxformer-fp32" --force \
  --samples 8 --allow-unverified
step optimize-int8 "$D/onnxformer-int8" $OX optimize "$D/onnxformer-export" --out "$D/onnxformer-int8" \
  --precision int8 --force --samples 8 --allow-unverified
# the Python API, ids out: the random model's ids lie past the small test tokenizer, which `generate` refuses to print
for b in fp32 int8; do
  step "generate-$b" "$D/onnxformer-$b" $PY -c "
from runtime import Translator
from runtime.generate import generate
lang = dict(tgt_lang='$TGT') if '$TGT' else {}
t = Translator('$D/onnxformer-$b', threads=2)
ids = generate(t.engine, t.request([[5, 17, 29, 41, 3, 2]], max_new_tokens=16, min_new_tokens=16, **lang))[0][0].tokens
print(len(ids), 'tokens:', *ids)"
done
