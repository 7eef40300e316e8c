# The fused step's suites, sourced by experiments/gpu.sh (its helpers: bench, t, variant, vs_compile, variants,
# D_STEP): launch, grid and tile variants, the kernels' own checks (split-K, k-major tiles, mxfp4 loads, the shared
# expert's stream), the per-family table, the GEMV. Run them through gpu.sh: bash experiments/gpu.sh <suite>.
suite_step_variants() {  # the fused step's launch/tile variants against the default step, logits compared bit for bit
  bench step_variants
  if [ -n "${VARIANTS:-}" ]; then
    variant qwen3 qwen3_30b_a3b 12 --batch 1 8 --variants $VARIANTS
    variant mixtral mixtral_8x7b 8 --batch 1 --variants $VARIANTS
    variant qwen15 qwen1_5_moe_a2_7b 24 --batch 1 --variants $VARIANTS
    return
  fi
  variant qwen3 qwen3_30b_a3b 12 --batch 1 8 --variants $D_STEP $D_STEP+up_n=16 $D_STEP+up_n=16+up_k=256 \
    $D_STEP+down_n=32+down_k=64
  variant mixtral mixtral_8x7b 8 --batch 1 --variants $D_STEP
  variant qwen15 qwen1_5_moe_a2_7b 24 --batch 1 --variants $D_STEP $D_STEP+up_n=16
}
suite_preload() {  # weights loaded before each kernel's PDL wait (the default) against after it (pre=0), alternated, bs 1 and 8
  bench preload
  local spec preset layers tag w
  for spec in "qwen3_30b_a3b 48 qwen3_48_fp8_block fp8_block" "qwen3_30b_a3b 12 qwen3_12 full" \
              "qwen1_5_moe_a2_7b 24 qwen1_5_24 full" "olmoe_1b_7b 16 olmoe_16 full"; do
    read -r preset layers tag w <<< "$spec"
    variant "$tag" "$preset" "$layers" --weights "$w" --batch 1 8 --repeats 3 \
      --variants $D_STEP+pre=0 $D_STEP $D_STEP+pre=0+pre=0 $D_STEP+pre=1
  done
}
suite_down_tiles() {  # the MoE down kernel's columns at 16-64 rows: Qwen3-30B-A3B (24 layers: FP8 + fp8_dynamic, FP8 weight-only; 12 layers bf16), OLMoE and Qwen1.5 bf16 at bs 64, the FP8 step's profile at bs 64
  bench down_tiles
  local D_NO=slot+overlap+router+gemv  # PDL off
  variant qwen3_24_a8 qwen3_30b_a3b 24 --weights fp8_block --activations fp8_dynamic --batch 64 32 16 --repeats 3 \
    --variants $D_STEP $D_NO $D_STEP+down_n=64 $D_STEP+down_n=128 $D_STEP+down_n=256 $D_STEP+block_m=32
  variant qwen3_24_w8 qwen3_30b_a3b 24 --weights fp8_block --batch 64 32 --repeats 3 \
    --variants $D_STEP $D_STEP+down_n=64 $D_STEP+down_n=128 $D_STEP+down_n=256
  variant qwen3_12 qwen3_30b_a3b 12 --batch 64 32 --repeats 3 --variants $D_STEP $D_STEP+down_n=64 $D_STEP+down_n=256
  variant olmoe_16 olmoe_1b_7b 16 --batch 64 --repeats 3 --variants $D_STEP $D_STEP+down_n=64
  variant qwen1_5_24 qwen1_5_moe_a2_7b 24 --batch 64 --repeats 3 --variants $D_STEP $D_STEP+down_n=128
  variant qwen3_24_a8_profile qwen3_30b_a3b 24 --weights fp8_block --activations fp8_dynamic --batch 64 --repeats 3 \
    --variants $D_STEP $D_NO --profile $D_NO
}
suite_gpt_oss_router() {  # GPT-OSS's router in norm_route against add_rmsnorm + GEMM + router kernel, its MoE down columns at bs 1 / 8 / 16 (12 layers, bf16 and mxfp4), capacity+fused beside; the per-kernel profile; the router's GPU tests
  bench gpt_oss_router
  local D_NO=slot+overlap+router+gemv D_NR=slot+overlap+gemv+pdl  # PDL off; the router unfused
  t gpu_tests.log python3 -m pytest -q -m gpu tests/test_fast_gpu.py -k "norm_route or gpt_oss" | \
    grep -E "passed|failed|FAILED" | tail -4
  variant router_gpt_oss_20b gpt_oss_20b 12 --batch 1 8 16 --repeats 3 --variants $D_STEP $D_NR \
    $D_STEP+down_n=32 $D_STEP+down_n=64 $D_STEP+down_n=128
  variant router_gpt_oss_120b gpt_oss_120b 12 --weights mxfp4 --batch 1 8 --repeats 3 --variants $D_STEP $D_NR
  variant profile_gpt_oss_20b gpt_oss_20b 12 --batch 1 8 --repeats 3 --variants $D_STEP $D_NO --profile $D_NO
  t capacity_gpt_oss_20b.log vs_compile --preset gpt_oss_20b --num-layers 12 --batch 1 8 --buckets 1 8 \
    --strategies full+fused capacity+fused --skip-hf-generate --skip-compile --repeats 2 --new-tokens 16 \
    --out "$D/capacity_gpt_oss_20b.md" --json "$D/capacity_gpt_oss_20b.json" | grep -E "own floor|failed|Error"
}
suite_table() {  # the default fused step at bs 1 and 8 on every family's real shape, one process each (the table in docs/results.md, "What moved the fused step")
  bench table
  local spec preset layers
  for spec in "qwen1_5_moe_a2_7b 24" "qwen3_30b_a3b 12" "olmoe_1b_7b 16" "glm4_5_air 8" "mixtral_8x7b 8" \
              "deepseek_v2_lite 27" "gpt_oss_20b 12" "deepseek_v3 8" "kimi_k2 4"; do
    read -r preset layers <<< "$spec"
    variant "${preset}_$layers" "$preset" "$layers" --batch 1 8 --repeats 3 --variants $D_STEP
  done
}
suite_norm_route() {  # norm_route's tiles at bs 1 and 8 (moecg.kernels.tiles.NormRouteTiles): its top-k a warp a row (rk=1), 4 warps, one expert a one-warp program; its GPU tests
  bench norm_route
  t gpu_tests.log python3 -m pytest -q -m gpu tests/test_fast_gpu.py -k norm_route | grep -E "passed|failed|FAILED" | tail -4
  local spec preset layers
  for spec in "qwen3_30b_a3b 12" "olmoe_1b_7b 16"; do
    read -r preset layers <<< "$spec"
    variant "$preset" "$preset" "$layers" --batch 1 8 --repeats 3 --variants $D_STEP $D_STEP+rk=1 $D_STEP+rw=4 \
      $D_STEP+rw=1+rb=1
  done
  variant gpt_oss_20b gpt_oss_20b 12 --batch 1 --repeats 3 --variants $D_STEP $D_STEP+rw=4
  variant mixtral_8x7b mixtral_8x7b 8 --batch 1 --repeats 3 --variants $D_STEP $D_STEP+rw=4
}
suite_split_k() {  # the split-K kernels as compiled since a24efe6 (pipelined loads): the up GEMM split at bs 1 on four shapes, the down GEMM split on Mixtral and GPT-OSS at bs 1, the o projection split in bf16 and block-FP8 at bs 1 and 8; their GPU tests
  bench split_k
  t gpu_tests.log python3 -m pytest -q -m gpu tests/test_fast_gpu.py tests/test_weights_gpu.py \
    -k "moe_kernel_matches or split_k_partial" | grep -E "passed|failed|FAILED" | tail -4
  variant up_qwen3_30b_a3b qwen3_30b_a3b 12 --batch 1 --repeats 3 --variants $D_STEP $D_STEP+up_split=2 \
    $D_STEP+up_split=3 $D_STEP+up_split=4
  local spec preset layers
  for spec in "olmoe_1b_7b 16" "deepseek_v2_lite 27" "qwen1_5_moe_a2_7b 24"; do
    read -r preset layers <<< "$spec"
    variant "up_$preset" "$preset" "$layers" --batch 1 --repeats 3 --variants $D_STEP $D_STEP+up_split=2
  done
  variant down_mixtral_8x7b mixtral_8x7b 8 --batch 1 --repeats 3 --variants $D_STEP $D_STEP+split2 $D_STEP+split4
  variant down_gpt_oss_20b gpt_oss_20b 12 --batch 1 --repeats 3 --variants $D_STEP $D_STEP+split2 \
    $D_STEP+down_n=64+split2
  variant o_qwen3_30b_a3b qwen3_30b_a3b 12 --batch 1 8 --repeats 3 --variants $D_STEP $D_STEP+ok=2 $D_STEP+ok=4
  variant o_qwen3_48_fp8_block qwen3_30b_a3b 48 --weights fp8_block --batch 1 8 --repeats 3 --variants $D_STEP \
    $D_STEP+ok=2 $D_STEP+ok=4
}
suite_kmajor() {  # HF's transposed bf16 experts (GPT-OSS) and MLA's W_UK heads on k-major weight tiles (pipelined loads): GPT-OSS-20B at bs 1 / 8 / 16 with its tile variants, capacity+fused beside, the MLA shapes at bs 1 and 8; their GPU tests (with OLD=<the package before>: the same in old/)
  bench kmajor
  t gpu_tests.log python3 -m pytest -q -m gpu tests/test_fast_gpu.py tests/test_capacity_kernel_gpu.py \
    -k "gpt_oss or transposed or head or mla or capacity" | grep -E "passed|failed|FAILED" | tail -4
  variant gpt_oss_20b gpt_oss_20b 12 --batch 1 8 16 --repeats 3 --variants $D_STEP $D_STEP+down_n=64 \
    $D_STEP+down_n=128 $D_STEP+up_n=64 $D_STEP+stages=4
  t capacity_gpt_oss_20b.log vs_compile --preset gpt_oss_20b --num-layers 12 --batch 1 8 --buckets 1 8 \
    --strategies full+fused capacity+fused --skip-hf-generate --skip-compile --repeats 2 --new-tokens 16 \
    --out "$D/capacity_gpt_oss_20b.md" --json "$D/capacity_gpt_oss_20b.json" | grep -E "own floor|failed|Error"
  local spec preset layers
  for spec in "deepseek_v3 6" "kimi_k2 4" "deepseek_v2_lite 27"; do
    read -r preset layers <<< "$spec"
    variant "$preset" "$preset" "$layers" --batch 1 8 --repeats 3 --variants $D_STEP
  done
}
suite_mx_loads() {  # mxfp4 one-row expert tiles with 16-byte weight loads (b9bd006): GPT-OSS-120B and -20B in mxfp4, 12 layers, bs 1 / 8 / 16, dropless and capacity; their GPU tests (OLD=<b9bd006^'s package>: before, bit for bit)
  bench mx_loads
  t gpu_tests.log python3 -m pytest -q -m gpu tests/test_weights_gpu.py -k "mxfp4" | grep -E "passed|failed|FAILED" | tail -4
  local m
  for m in gpt_oss_120b gpt_oss_20b; do
    variant "$m" "$m" 12 --weights mxfp4 --batch 1 8 16 --repeats 3 --variants $D_STEP
  done
  t capacity_gpt_oss_120b.log vs_compile --preset gpt_oss_120b --num-layers 12 --weights mxfp4 --batch 1 8 \
    --buckets 1 8 --strategies full+fused capacity+fused --skip-hf-generate --skip-compile --repeats 2 \
    --out "$D/capacity_gpt_oss_120b.md" --json "$D/capacity_gpt_oss_120b.json" | grep -E "own floor|failed|Error"
}
suite_side() {  # the shared expert's gate/up GEMM on the side stream beside the fp32 router (moecg.fast.step.SHARED_GEMM_ON_SIDE, variant `side`): DeepSeek-V2-Lite, DeepSeek-V3, Kimi-K2, GLM-4.5-Air at bs 1 and 8; its GPU test
  bench side
  t gpu_tests.log python3 -m pytest -q -m gpu tests/test_latent_gpu.py -k "side_stream" | grep -E "passed|failed|FAILED" | tail -4
  local spec preset layers
  for spec in "deepseek_v2_lite 27" "glm4_5_air 8" "deepseek_v3 6" "kimi_k2 4"; do
    read -r preset layers <<< "$spec"
    variant "${preset}_$layers" "$preset" "$layers" --batch 1 8 --repeats 3 --variants ${D_STEP/+side/} $D_STEP
  done
}
suite_row_grid() {  # mxfp4 experts on one-row tiles (row grid) against tl.dot_scaled and 32 x 64 columns, GPT-OSS 12 layers, bs 1-64; its GPU tests
  bench row_grid
  t gpu_tests.log python3 -m pytest -q -m gpu tests/test_weights_gpu.py tests/test_act_gpu.py \
    -k "mxfp4 or cuda_cores or moe_and_capacity" | grep -E "passed|failed|FAILED" | tail -4
  local m T32=block_m=1+up_n=32+down_n=64+up_k=128+down_k=128+stages=4 DOT=block_m=16+up_n=64+down_n=64+up_k=128+down_k=128+stages=4
  for m in gpt_oss_120b gpt_oss_20b; do
    variant "$m" "$m" 12 --weights mxfp4 --batch 1 2 4 8 16 64 --repeats 3 --variants $D_STEP $D_STEP+grid=slot \
      $D_STEP+$T32 $D_STEP+$DOT
  done
}
suite_capacity_tiles() {  # the capacity kernels alone at the table's tiles for C against the bf16 rule for T; GPT-OSS-120B (mxfp4, 12 layers) and GLM-4.5-Air (fp8_block, 8 layers) capacity steps
  bench capacity_tiles
  local k="python3 experiments/bench_weights_kernels.py --skip-gemv --ops capacity_experts --table-only --copies 3"
  t kernels_gpt_oss_120b.log $k --hidden 2880 --inter 2880 --experts 128 --top-k 4 --formats mxfp4 --tokens 1 8 64 \
    --out "$D/kernels_gpt_oss_120b.md" --json "$D/kernels_gpt_oss_120b.json" | tail -1
  t kernels_qwen3.log $k --formats fp8_block mxfp4 --tokens 1 8 --out "$D/kernels_qwen3.md" --json "$D/kernels_qwen3.json" | tail -1
  t kernels_glm.log $k --hidden 4096 --inter 1408 --top-k 8 --formats fp8_block --tokens 1 8 --out "$D/kernels_glm.md" \
    --json "$D/kernels_glm.json" | tail -1
  local spec preset layers w bss
  for spec in "gpt_oss_120b 12 mxfp4 1,8,64" "glm4_5_air 8 fp8_block 1,8"; do
    read -r preset layers w bss <<< "$spec"
    t "step_$preset.log" vs_compile --preset "$preset" --num-layers "$layers" --weights "$w" --batch ${bss//,/ } \
      --buckets ${bss//,/ } --strategies full+fused capacity+fused --skip-hf-generate --skip-compile --repeats 2 \
      --out "$D/step_$preset.md" --json "$D/step_$preset.json" | grep -E "own floor|failed|Error" | head -4
  done
}
suite_activations() {  # fp8_dynamic activations (model.activations): their GPU tests, then Qwen3-30B-A3B (48 layers, fp8_block) at bs 1 and 8 with full and fp8_dynamic inputs, alternated
  bench activations
  t gpu_tests.log python3 -m pytest -q -s -m gpu tests/test_act_gpu.py | grep -E "agreement|passed|failed|FAILED" | tail -12
  local a r
  for r in 1 2; do for a in full fp8_dynamic; do
    variant "qwen3_48_fp8_${a}_$r" qwen3_30b_a3b 48 --weights fp8_block --activations "$a" --batch 1 8 --repeats 3 \
      --variants $D_STEP
  done; done
  for a in full fp8_dynamic; do  # each kernel's own time (PDL off), 12 layers
    t "profile_qwen3_12_fp8_${a}_bs8.txt" python3 experiments/profile_step.py --preset qwen3_30b_a3b --num-layers 12 \
      --batch 8 --weights fp8_block --activations "$a" --pdl 0 | head -16
  done
}
suite_gemv() {  # the qkv / o projections at T 1-16: cuBLAS against the Triton GEMV over a grid of tiles, plain launches
  bench gemv
  t gpu_tests_gemv.log python3 -m pytest -q -m gpu tests -k gemv | tail -3
  t gemv.log python3 experiments/bench_gemv.py --pdl 0 --out "$D/gemv.md" --json "$D/gemv.json" | grep -E "^\| [a-z]|failed"
}
