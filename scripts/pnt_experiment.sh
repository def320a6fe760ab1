#!/usr/bin/env bash
# The PNT experiment of docs/RESULTS.md: every preset, one budget, one tokenizer, one core.
# Usage: scripts/pnt_experiment.sh [OUT=runs/exp] ; extra seeds: SEEDS="1 2" ARCHS="..." scripts/pnt_experiment.sh
# Ternary QAT rows: EXTRA=--ternary scripts/pnt_experiment.sh runs/exp-ternary
set -euo pipefail
OUT=${1:-runs/exp}
DATA=${DATA:-/work/shared/data/stories.jsonl.xz}
STEPS=${STEPS:-200}
ARCHS=${ARCHS:-"arch1 arch2_4_combined arch2_4_sync arch3 arch4_async_experts arch5"}
SEEDS=${SEEDS:-0}
EXTRA=${EXTRA:-}
export PYTHONPATH=src OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
for seed in $SEEDS; do
  for arch in $ARCHS; do
    run="$OUT/$arch-s$seed"
    [ -f "$run/final.json" ] && continue
    python -m cflow train --arch "$arch" --data "$DATA" --tokenizer "$OUT/tokenizer.json" --vocab-size 4096 \
      --d-model 96 --n-layer 6 --n-head 4 --n-kv-head 2 --d-ff 384 --n-expert 8 --top-k 2 --d-expert 96 \
      --seq-len 128 --batch 8 --steps "$STEPS" --warmup 20 --lr 3e-3 --seed "$seed" --threads 1 \
      --log-every 10 --final-eval-batches 0 --ckpt-every 50 --resume --quiet --out "$run" $EXTRA
  done
done
