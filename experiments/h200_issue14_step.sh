#!/usr/bin/env bash
# Issue 14, the batch-1 step on one H200: GPU tests of the MoE kernels' slot grid, split-K down GEMM and PDL launches
# and of whole captured fused models (shared expert on its own stream); then bench_step_variants.py per shape.
#   MOECG_GIT_SHA=<sha> bash experiments/h200_issue14_step.sh OUTDIR [tests|qwen3|qwen15|mixtral|deep|all]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_step}
WHAT=${2:-all}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  >> "$OUT/gpu.txt" 2>&1
has() { [ "$WHAT" = all ] || [[ ",$WHAT," == *",$1,"* ]]; }
if has tests; then
  python3 -m pytest -q -s -m gpu "tests/test_fast_gpu.py::test_moe_kernel_matches_reference_and_counts" \
    "tests/test_fast_gpu.py::test_fused_full_capture_matches_hf_eager" tests/test_capacity_kernel_gpu.py \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|FAILED|agreement" | tail -30
fi
run() {  # preset layers tag [extra args]
  local preset=$1 layers=$2 tag=$3; shift 3
  python3 experiments/bench_step_variants.py --preset "$preset" --num-layers "$layers" "$@" \
    --out "$OUT/variants_${tag}.md" --json "$OUT/variants_${tag}.json" 2>&1 | tee "$OUT/variants_${tag}.log" \
    | grep -vE "^\{" | tail -60
}
has qwen3 && run qwen3_30b_a3b 12 qwen3 --profile slot+overlap+pdl
has qwen15 && run qwen1_5_moe_a2_7b 24 qwen15 --profile slot+overlap+pdl
has mixtral && run mixtral_8x7b 8 mixtral --variants base slot slot+split2 slot+pdl slot+pdl+split2
has deep && { run qwen3_30b_a3b 48 qwen3_48 --variants base slot+overlap+pdl slot+overlap+pdl+split2;
              run mixtral_8x7b 32 mixtral_32 --variants base slot+pdl slot+pdl+split2; }
exit 0
