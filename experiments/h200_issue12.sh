#!/usr/bin/env bash
# Issue 12 on one H200: moecg's serving against transformers' continuous batching and the exactness of continuous
# batching (bench_serving.py), and what per-row positions cost on the fused step plus GPU idle between decode steps
# (bench_ragged_cost.py); Qwen1.5-MoE shape, 24 layers.
#   bash experiments/h200_issue12.sh OUTDIR [serving|cost|all]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue12}
WHAT=${2:-all}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if [ "$WHAT" = serving ] || [ "$WHAT" = all ]; then
  timeout ${SERVING_TIMEOUT:-300} python3 experiments/bench_serving.py --variants ${VARIANTS:-full capacity full+fused} \
    --out "$OUT" ${SERVING_ARGS:-} 2>&1 | tee "$OUT/serving.log" | grep -vE "warn|^\s*$" | tail -30
fi
if [ "$WHAT" = cost ] || [ "$WHAT" = all ]; then
  timeout ${COST_TIMEOUT:-90} python3 experiments/bench_ragged_cost.py --batch 8 32 --out "$OUT/ragged_cost.md" \
    --json "$OUT/ragged_cost.json" 2>&1 | tee "$OUT/ragged_cost.log" | tail -8
fi
