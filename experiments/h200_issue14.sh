#!/usr/bin/env bash
# Issue 14, capacity on equal kernels, on one H200 (about 7 minutes): the GPU tests of the Triton capacity kernels
# and of the dropless kernels they share their GEMM tiles with; the MoE-layer microbenchmark as the fused step calls
# the experts (dropless torch, fused, capacity's Triton kernels at cf 1.0 / 1.25, each with its HBM floor); then the
# whole fused step, capacity+fused vs full+fused, at bs 1 and 8 on the three shapes (issue 14's depths), with the
# dropless floor and capacity's floor (every expert's weights).
#   MOECG_GIT_SHA=$(git rev-parse --short HEAD) bash experiments/h200_issue14.sh OUTDIR [tests|dispatch|step|all]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_capacity}
WHAT=${2:-all}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  >> "$OUT/gpu.txt" 2>&1
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then  # ~2-3 min, most of it Triton compiles
  python3 -m pytest -q -s -m gpu tests/test_capacity_kernel_gpu.py \
    "tests/test_fast_gpu.py::test_moe_kernel_matches_reference_and_counts" \
    "tests/test_fast_gpu.py::test_moe_kernel_gpt_oss_experts" \
    "tests/test_fast_gpu.py::test_fused_full_capture_matches_hf_eager" \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|FAILED|agreement|logit diff" | tail -40
fi
if [ "$WHAT" = dispatch ] || [ "$WHAT" = all ]; then  # ~1 min: one layer per shape
  python3 experiments/bench_dispatch.py --preset qwen1_5_moe_a2_7b mixtral_8x7b qwen3_30b_a3b --batch 1 8 \
    --scope experts fused --only dropless fused capacity-1.0 capacity-1.25 --repeats 10 \
    --out "$OUT/dispatch.md" --json "$OUT/dispatch.json" 2>&1 | tee "$OUT/dispatch.log" | tail -30
fi
if [ "$WHAT" = step ] || [ "$WHAT" = all ]; then  # ~3 min
  for spec in "qwen1_5_moe_a2_7b 24" "mixtral_8x7b 8" "qwen3_30b_a3b 12"; do
    read -r preset layers <<< "$spec"
    python3 experiments/bench_vs_compile.py --preset "$preset" --num-layers "$layers" --batch 1 8 \
      --strategies full+fused capacity+fused --skip-hf-generate --skip-compile --repeats 2 \
      --out "$OUT/step_${preset}.md" --json "$OUT/step_${preset}.json" 2>&1 | tee "$OUT/step_${preset}.log" \
      | grep -E "^\| [0-9]|own floor|failed" || echo "step $preset failed: $(tail -1 "$OUT/step_${preset}.log")"
  done
fi
