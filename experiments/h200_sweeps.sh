#!/usr/bin/env bash
# The H200 reference sweeps behind experiments/results/h200/ (layers cut to fit a 10-minute device call).
#   MOECG_GIT_SHA=$(git rev-parse --short HEAD) bash experiments/h200_sweeps.sh OUTDIR   (sha: the copy has no .git)
set -u
OUT=${1:-experiments/results/h200}
mkdir -p "$OUT"
COMMON="new_tokens=16 prompt_len=32 measure.repeats=2 isolate=false"
python3 -m moecg.run experiment=strategy_matrix model=qwen1_5_moe_a2_7b model.num_layers=4 $COMMON \
  hydra.sweep.dir="$OUT/strategy_matrix_qwen1_5_moe_a2_7b_L4"
python3 -m moecg.run experiment=strategy_matrix model=mixtral_8x7b model.num_layers=2 $COMMON \
  hydra.sweep.dir="$OUT/strategy_matrix_mixtral_8x7b_L2"
python3 -m moecg.run experiment=capacity_sweep model=qwen1_5_moe_a2_7b model.num_layers=4 batch_size=8,32,64 \
  measure.eager_baseline=false $COMMON hydra.sweep.dir="$OUT/capacity_sweep_qwen1_5_moe_a2_7b_L4"
python3 -m moecg.run experiment=capacity_sweep model=mixtral_8x7b model.num_layers=2 batch_size=8,32,64 \
  measure.eager_baseline=false $COMMON hydra.sweep.dir="$OUT/capacity_sweep_mixtral_8x7b_L2"
