#!/usr/bin/env bash
# Issue 14 on one H200, session 5, round D: the floor table (bench_vs_compile.py, one process per shape) with the final
# tables (GEMV on Qwen1.5's shapes, add_rmsnorm at 16 warps for D <= 2048), and the op tests.
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_s5d.sh OUTDIR
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_s5/final}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -m pytest -q -m gpu tests/test_fast_gpu.py -k "norm_rope_attn_route or fused_full_capture" 2>&1 | tail -2 \
  | tee "$OUT/gpu_tests.log"
source experiments/h200_issue14_lib.sh  # step()
step qwen1_5_moe_a2_7b 24 full+fused
step qwen3_30b_a3b 12 full+fused
step mixtral_8x7b 8 full+fused
step qwen3_30b_a3b 48 full+fused
step mixtral_8x7b 32 full+fused
exit 0
