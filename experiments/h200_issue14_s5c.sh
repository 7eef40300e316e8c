#!/usr/bin/env bash
# Issue 14 on one H200, session 5, round C: the precompile pass compiling while the dry pass records (Precompiler),
# capture time at capture.warmup 3 and 1; add_rmsnorm's warps at the step (tiles.norm_warps).
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_s5c.sh OUTDIR [tests,capture,norm]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_s5}
WHAT=${2:-tests,capture,norm}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
has() { [[ ",$WHAT," == *",$1,"* ]]; }
if has tests; then
  python3 -m pytest -q -m gpu tests/test_fast_gpu.py -k "precompile or gemv or norm_rope" 2>&1 | tail -2 \
    | tee "$OUT/gpu_tests_c.log"
fi
if has capture; then
  for w in 3 1; do
    python3 experiments/capture_time.py --preset qwen1_5_moe_a2_7b --warmup $w --out "$OUT/capture_time_c_w$w.md" \
      --json "$OUT/capture_time_c_w$w.json" 2>&1 | tee "$OUT/capture_time_c_w$w.log" | grep -E "^\| (cold|warm)|target"
  done
fi
if has norm; then
  for spec in "qwen3_30b_a3b 12 qwen3" "qwen1_5_moe_a2_7b 24 qwen15"; do
    read -r preset layers tag <<< "$spec"
    python3 experiments/bench_step_variants.py --preset "$preset" --num-layers "$layers" --batch 1 8 \
      --variants slot+overlap+router+pdl+gemv slot+overlap+router+pdl+gemv+nw=8 slot+overlap+router+pdl+gemv+nw=16 \
      --out "$OUT/variants_${tag}_norm.md" --json "$OUT/variants_${tag}_norm.json" 2>&1 \
      | tee "$OUT/variants_${tag}_norm.log" | grep -E "^\| [0-9]"
  done
fi
exit 0
