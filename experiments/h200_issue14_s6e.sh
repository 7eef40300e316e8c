#!/usr/bin/env bash
# Issue 14 on one H200, session 6, round E: the routers' shared top-k (one packed int64 max per pick instead of a max
# and a min), against the previous commit's package (OLD); MoE tiles with more programs at bs 1 (up_n 16).
#   MOECG_GIT_SHA=<sha> OLD=.gpu/old bash experiments/h200_issue14_s6e.sh OUTDIR
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_s6/topk}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
D=slot+overlap+router+gemv+pdl
source experiments/h200_issue14_lib.sh  # variants(), old()
python3 -m pytest -q -m gpu tests/test_fast_gpu.py -k "route or fused_full_capture or families" 2>&1 | tail -2 \
  | tee "$OUT/gpu_tests.log"
variants qwen3 qwen3_30b_a3b 12 --batch 1 8 --variants $D $D+up_n=16 $D+up_n=16+up_k=256 $D+down_n=32+down_k=64
old qwen3_old qwen3_30b_a3b 12 --batch 1 8 --variants $D
variants mixtral mixtral_8x7b 8 --batch 1 --variants $D
old mixtral_old mixtral_8x7b 8 --batch 1 --variants $D
variants qwen15 qwen1_5_moe_a2_7b 24 --batch 1 --variants $D $D+up_n=16
old qwen15_old qwen1_5_moe_a2_7b 24 --batch 1 --variants $D
exit 0
