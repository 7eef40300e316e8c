#!/usr/bin/env bash
# Issue 14 on one H200, final round B: the fused step with every change on (slot grid, shared expert on its own
# stream, PDL, norm_route, in-kernel attention merge) per shape, in one process each, with the floor column and
# capture of every bucket 1-64; the trained stdlib models' agreement with HF eager; the whole-depth shapes.
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_final_b.sh OUTDIR
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_final}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -m pytest -q -m gpu tests/test_fast_gpu.py -k norm_route 2>&1 | tail -2 | tee "$OUT/gpu_tests_norm_route.log"
source experiments/h200_issue14_lib.sh  # step()
step qwen1_5_moe_a2_7b 24 full+fused capacity+fused
step mixtral_8x7b 8 full+fused capacity+fused
step qwen3_30b_a3b 12 full+fused capacity+fused
python3 experiments/fidelity_fused.py --preset mixtral_stdlib qwen2_moe_stdlib --backend triton --device cuda 2>&1 \
  | tee "$OUT/stdlib_fidelity.log" | tail -8
step qwen3_30b_a3b 48 full+fused
step mixtral_8x7b 32 full+fused
exit 0
