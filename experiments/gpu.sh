#!/usr/bin/env bash
# The GPU runner: named benchmark suites, each writing its logs and outputs under $OUT/<benchmark>/ through tee (so a
# run cut short still leaves what it measured). From the project root:
#   bash experiments/gpu.sh <suite> [<suite>...]      e.g.  bash experiments/gpu.sh tests floor
#   bash experiments/gpu.sh list                      the suites, their results folders and what they run
# Environment:
#   OUT=<dir>            results root (default experiments/results); a suite writes $OUT/<benchmark>/ and gpu.txt there
#   OLD=<dir>            a folder holding an older commit's moecg/ package (below): every suite runs a second time with
#                        it first on PYTHONPATH, into $OUT/<benchmark>/old/, so before and after share one host; its
#                        step variants also say whether their logits equal the new pass's first variant's bits
#                          mkdir -p .gpu/old && git archive <sha> moecg | tar -x -C .gpu/old \
#                            --exclude=moecg/checkpoints   # the stdlib weights: 25 MB of the 64 a call carries
#   MOECG_GIT_SHA=<sha>  the commit the results record (default: git rev-parse --short HEAD where there is a .git;
#                        a copy shipped to a GPU machine has none, so pass it); OLD_SHA=<sha> for the OLD pass
#   PACK=<file.tgz>      $OUT packed into one tarball after each logged command (kept up to date: a run cut short
#                        still leaves what it measured), for machines that return only a few files
#   WHEELS=<dir>         wheels installed into /tmp/site first when the folder holds any (default .whl: the packages
#                        the H200 image lacks, built by make_wheelhouse.sh); WHEELS= skips the install
# Suite knobs (defaults are the settings of the committed results): TESTS / TEST_K (pytest paths, -k; `tests`), VARIANTS
# (`step_variants`), EPS / MODELS / BATCH / RUN_BATCH / STRATEGIES (`ep`), PROJ_MODELS / PROJ_TIMEOUT (`ep_projection`),
# TRAIN_MODELS / MINUTES (`train_stdlib`), FORMATS (`weights`), STDLIB_MODELS (`fidelity`, `serving_stdlib`), MLA_ATTN_ARGS (`mla_attn`), WARMUPS (`capture`: capture.warmup values), SERVING_TIMEOUT / SERVING_ARGS / COST_TIMEOUT, BENCH_TIMEOUT (`vs_compile_families`, `weights_whole`), LONG_SPECS (`long_context`: "preset layers bs,bs;..." ), WHOLE_MODELS / WHOLE_BATCH (`weights_whole`: preset:format ..., batch sizes).
set -u -o pipefail
OUT=${OUT:-experiments/results}
LOGITS=${LOGITS:-${TMPDIR:-/tmp}/moecg_logits}  # the variants' first logits (torch.save), compared bit for bit by OLD
PASS=new  # or old: the OLD package's pass

# -- helpers -------------------------------------------------------------------------------------------------------
# bench NAME: this suite's output folder D ($OUT/NAME, or $OUT/NAME/old in the OLD pass) and its gpu.txt (machine,
# versions, commit).
bench() {
  D=$OUT/$1
  [ "$PASS" = old ] && D=$D/old
  mkdir -p "$D"
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)" 2>&1
    echo "commit $MOECG_GIT_SHA"; } > "$D/gpu.txt"
}
# t FILE CMD...: run CMD, its stdout and stderr into $D/FILE and on to the console filter after it (tee -p: a filter
# that stops early, as head does, does not cut the log short).
t() { local f=$1 rc; shift; "$@" 2>&1 | tee -p "$D/$f"; rc=${PIPESTATUS[0]}; pack; return "$rc"; }
# pack: with PACK=<file.tgz> (outside $OUT), $OUT as one tarball again after each logged command, for hosts that
# return only a few files of a run (or of one cut short)
pack() { [ -z "${PACK:-}" ] || tar czf "$PACK" -C "$OUT" . ; }
vs_compile() { python3 experiments/bench_vs_compile.py "$@"; }
variants() { python3 experiments/bench_step_variants.py "$@"; }

# step PRESET LAYERS STRATEGIES...: one shape's floor row at bs 1 and 8 (bench_vs_compile.py, one process)
step() {
  local preset=$1 layers=$2; shift 2
  t "step_${preset}_${layers}.log" vs_compile --preset "$preset" --num-layers "$layers" --batch 1 8 --strategies "$@" \
    --skip-hf-generate --skip-compile --repeats 2 --out "$D/step_${preset}_${layers}.md" \
    --json "$D/step_${preset}_${layers}.json" | grep -E "own floor|failed|Error" | head -4
}
# variant TAG PRESET LAYERS ARGS...: bench_step_variants on one shape, outputs variants_TAG.{md,json,log}
# The first variant's logits are kept outside $OUT (LOGITS); with OLD, the old pass compares its rows with the new
# pass's bits (the rows' "saved" column).
variant() {
  local tag=$1 preset=$2 layers=$3; shift 3
  local lg=$LOGITS/${D#"$OUT"/}; lg=${lg%/old}/$tag.pt
  mkdir -p "$(dirname "$lg")"
  local keep=(--save-logits "$lg")
  [ "$PASS" = old ] && keep=() && [ -f "$lg" ] && keep=(--against-logits "$lg")
  t "variants_$tag.log" variants --preset "$preset" --num-layers "$layers" "$@" "${keep[@]}" \
    --out "$D/variants_$tag.md" --json "$D/variants_$tag.json" | grep -E "^\| [0-9]|failed"
}
D_STEP=slot+overlap+side+router+gemv+pdl  # every default switch of the fused step

# -- suites: suite_NAME, each starting with `bench FOLDER` ---------------------------------------------------------
suite_tests() {  # the project's GPU tests (pytest -m gpu)
  bench gpu_tests
  t gpu_tests.log python3 -m pytest -q -s -m gpu ${TESTS:-tests} ${TEST_K:+-k "$TEST_K"} | grep -E "passed|failed|error|FAILED" | tail -8
}
suite_floor() {  # the floor table: the fused step at bs 1 and 8 on the real-shape presets, capacity+fused beside dropless
  bench floor
  step qwen1_5_moe_a2_7b 24 full+fused capacity+fused
  step qwen3_30b_a3b 12 full+fused capacity+fused
  step mixtral_8x7b 8 full+fused capacity+fused
  step qwen3_30b_a3b 48 full+fused
  step mixtral_8x7b 32 full+fused
}
suite_weights() {  # weight formats: the quantized kernels' GPU tests and times, then Qwen3-30B-A3B (48 layers) at bs 1 and 8 per format
  bench weights
  t gpu_tests.log python3 -m pytest -q -s -m gpu tests/test_weights_gpu.py | grep -E "agreement|passed|failed|FAILED" | tail -12
  t kernels.log python3 experiments/bench_weights_kernels.py --out "$D/kernels.md" --json "$D/kernels.json" | tail -1
  local w
  for w in ${FORMATS:-full fp8_block}; do
    t "step_qwen3_30b_a3b_48_$w.log" vs_compile --preset qwen3_30b_a3b --num-layers 48 --weights "$w" --batch 1 8 \
      --buckets 1 8 --strategies full+fused capacity+fused --skip-hf-generate --skip-compile --repeats 2 \
      --out "$D/step_qwen3_30b_a3b_48_$w.md" --json "$D/step_qwen3_30b_a3b_48_$w.json" | grep -E "own floor|failed|Error" | head -4
  done
}
suite_weights_whole() {  # GPT-OSS-120B in mxfp4 and GLM-4.5-Air in fp8_block, whole, on one GPU: the fused full and capacity steps at bs 1 and 8, capacity factors 0.5-2 with their drops
  bench weights_whole
  local mw m w
  for mw in ${WHOLE_MODELS:-gpt_oss_120b:mxfp4 glm4_5_air:fp8_block}; do
    m=${mw%%:*} w=${mw#*:}
    t "step_${m}_$w.log" timeout ${BENCH_TIMEOUT:-580} python3 experiments/bench_vs_compile.py --preset "$m" --weights "$w" \
      --batch ${WHOLE_BATCH:-1 8} --buckets ${WHOLE_BATCH:-1 8} --strategies full+fused capacity+fused@0.5 capacity+fused@1.0 capacity+fused \
      capacity+fused@1.5 capacity+fused@2.0 --skip-hf-generate --skip-compile --repeats 2 \
      --out "$D/step_${m}_$w.md" --json "$D/step_${m}_$w.json" | grep -E "own floor|decode drops|failed|Error" | head -6
  done
}
suite_weights_o_split() {  # the o projection split K ways into the norm after it, on the fp8_block step: Qwen3-30B-A3B (48 layers), bs 1 and 8
  bench weights_o_split
  variant qwen3_30b_a3b_48_fp8_block qwen3_30b_a3b 48 --weights fp8_block --batch 1 8 --repeats 3 \
    --variants $D_STEP $D_STEP+ok=2 $D_STEP+ok=4 $D_STEP+ok=8
}
suite_long_context() {  # 30k-token prompt, 32k-slot cache, 4096-token prefill chunks; Qwen1.5 bs 1 only (103 GB of KV at bs 8)
  bench long_context
  local spec preset layers bss specs
  IFS=';' read -ra specs <<< "${LONG_SPECS:-qwen3_30b_a3b 12 1,8;mixtral_8x7b 8 1,8;qwen1_5_moe_a2_7b 24 1;deepseek_v2_lite 27 1,8}"
  for spec in "${specs[@]}"; do
    read -r preset layers bss <<< "$spec"
    t "long_${preset}.log" vs_compile --preset "$preset" --num-layers "$layers" --batch ${bss//,/ } \
      --prompt-len 30000 --new-tokens 16 --cache-len 32768 --buckets ${bss//,/ } --prefill-chunk 4096 \
      --skip-compile --skip-hf-generate --strategies full+fused --repeats 1 \
      --out "$D/long_${preset}.md" --json "$D/long_${preset}.json" | grep -E "^\| [0-9]|floor|failed|Error" | head -12
  done
}
suite_long_mla() {  # DeepSeek-V2-Lite (27 layers) at a 30k-token context: the fused step's variants (MLA splits ls=N, merge lm=N) at bs 1 and 8
  bench long_mla
  local bs
  for bs in ${LONG_MLA_BATCH:-1 8}; do
    t "variants_v2_lite_bs$bs.log" variants --preset deepseek_v2_lite --num-layers 27 --batch "$bs" --prompt-len 30000 \
      --cache-len 32768 --prefill-chunk 4096 --replays 20 --repeats 3 --variants $D_STEP ${LONG_MLA_VARIANTS:-} \
      --out "$D/variants_v2_lite_bs$bs.md" --json "$D/variants_v2_lite_bs$bs.json" | grep -E "^\| [0-9]|failed|Error"
  done
}
suite_capture() {  # capture time of buckets 1-64, cold and warm Triton cache, at capture.warmup auto (the default), 1 and 3, with a re-capture
  bench capture_time
  local w
  for w in ${WARMUPS:-auto 1 3}; do
    t "capture_time_w$w.log" python3 experiments/capture_time.py --preset qwen1_5_moe_a2_7b --warmup $w --recapture \
      --out "$D/capture_time_w$w.md" --json "$D/capture_time_w$w.json" | grep -E "^\| (cold|warm)|re-capture|target"
  done
}
suite_capture_precompile() {  # capture time with and without the precompile pass; a host-side cProfile of each run
  bench capture_time
  local pre tag
  for pre in "" "--no-precompile"; do
    tag=${pre:+_no_precompile}
    t "capture_time_precompile$tag.log" python3 experiments/capture_time.py --preset qwen1_5_moe_a2_7b $pre \
      --out "$D/capture_time_precompile$tag.md" --json "$D/capture_time_precompile$tag.json" | grep -E "^\| (cold|warm)|target"
  done
  t capture_time_profiled.log python3 experiments/capture_time.py --preset qwen1_5_moe_a2_7b \
    --out "$D/capture_time_profiled.md" --json "$D/capture_time_profiled.json" --profile "$D/capture_profile" | tail -3
}
suite_fidelity() {  # the trained stdlib models on the fused step (Triton) against HF eager: free-running, teacher-forced, margins
  bench fidelity
  t stdlib_fidelity.log python3 experiments/fidelity_fused.py --preset ${STDLIB_MODELS:-mixtral_stdlib qwen2_moe_stdlib deepseek_v3_stdlib} --backend triton \
    --device cuda | tail -6
}
suite_profile() {  # per kernel without PDL (each kernel's time its own), and the default step beside it
  bench profile
  local spec preset layers tag
  for spec in "qwen3_30b_a3b 12 qwen3" "qwen1_5_moe_a2_7b 24 qwen15"; do
    read -r preset layers tag <<< "$spec"
    t "profile_$tag.log" variants --preset "$preset" --num-layers "$layers" --batch 1 \
      --variants $D_STEP slot+overlap+router+gemv --profile slot+overlap+router+gemv \
      --out "$D/profile_$tag.md" --json "$D/profile_$tag.json" | grep -E "^\| [0-9]|failed"
  done
}
suite_profile_step() {  # torch.profiler totals per kernel of the captured fused step (profile_step.py)
  bench profile
  local b
  for b in 1 8; do
    t "profile_step_qwen1_5_bs$b.txt" python3 experiments/profile_step.py --preset qwen1_5_moe_a2_7b --batch $b | head -30
  done
}
. "$(dirname "${BASH_SOURCE[0]}")/gpu_step.sh"  # the fused step's suites: variants, tiles, kernel checks, the table
suite_capacity() {  # capacity on equal kernels: its Triton kernels' GPU tests, one MoE layer per dispatcher as the fused step calls it
  bench capacity
  t gpu_tests.log python3 -m pytest -q -s -m gpu tests -k "capacity_kernel or moe_kernel_matches_reference_and_counts or \
moe_kernel_gpt_oss_experts or fused_full_capture_matches_hf_eager" | grep -E "passed|failed|error|FAILED" | tail -8
  t dispatch.log python3 experiments/bench_dispatch.py --preset qwen1_5_moe_a2_7b mixtral_8x7b qwen3_30b_a3b --batch 1 8 \
    --scope experts fused --only dropless fused capacity-1.0 capacity-1.25 --repeats 10 \
    --out "$D/dispatch.md" --json "$D/dispatch.json" | tail -30
}
suite_capacity_non_bucket() {  # capacity at a batch that is not a bucket size, through the CLI: captured vs eager drops
  bench capacity_non_bucket
  local spec model layers cf tag dt s k run
  for spec in "mixtral_8x7b 2 1.25 mixtral_8x7b_L2_cf1.25" "qwen1_5_moe_a2_7b 4 1.0 qwen1_5_L4_cf1.0"; do
    read -r model layers cf tag <<< "$spec"
    for dt in bf16 fp32; do
      for s in eager capacity; do
        for k in hf fused; do
          run="$D/$tag/cap_bs5_${dt}_${s}_${k}"
          # hydra.output_subdir=null: no .hydra/ folder (it records this machine's working directory)
          t "${tag}_${dt}_${s}_${k}.log" python3 -m moecg.run strategy=$s capture.kernels=$k model.dtype=$dt model=$model \
            model.num_layers=$layers dispatch=capacity dispatch.capacity_factor=$cf batch_size=5 new_tokens=32 prompt_len=32 \
            measure.repeats=3 hydra.output_subdir=null hydra.run.dir="$run" > /dev/null \
            || echo "run $tag $dt $s $k failed: $(tail -1 "$D/${tag}_${dt}_${s}_${k}.log")"
        done
      done
    done
    python3 - "$D/$tag" "$D/capacity_bs5_$tag" <<'PY'
import json, sys, pathlib
out, stem = pathlib.Path(sys.argv[1]), sys.argv[2]
rows, raw = [], []
for f in sorted(out.glob("cap_bs5_*/results.json")):
    r = json.loads(f.read_text())
    raw.append(r)
    if r.get("status") != "ok":
        rows.append(f"| {f.parent.name} | failed: {r.get('error')} |")
        continue
    rows.append(f"| {r['dtype']} | {r['strategy']} | {r['kernels']} | {r['batch_size']} | {r['bucket']} | {r['captured']} | "
                f"{r['capacity']} | {r['capacity_buffer']} | {r['dropped_assignments']} / {r['routed_assignments']} | "
                f"{r['drop_rate']:.4f} | {r['ms_per_token_p50']:.3f} | {r['token_agreement_forced_vs_eager']:.3f} |")
table = ("| dtype | strategy | kernels | batch | bucket | captured | C applied | C buffer | dropped / routed | drop rate | "
         "ms/step p50 | forced agreement vs dropless eager |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
         + "\n".join(rows))
print(table)
pathlib.Path(stem + ".md").write_text(table + "\n")
pathlib.Path(stem + ".json").write_text(json.dumps(raw, indent=1))
PY
  done
}
suite_dispatch() {  # one MoE layer per dispatcher, eager and graph, bs 1-64
  bench dispatch
  t dispatch.log python3 experiments/bench_dispatch.py --preset qwen1_5_moe_a2_7b mixtral_8x7b --batch 1 4 8 16 32 64 \
    --scope experts block --out "$D/dispatch.md" --json "$D/dispatch.json" | tail -30
}
suite_attn_splits() {  # the decode attention's time by split count at short and long contexts (the data behind attn_splits)
  bench attn_splits
  t attn_splits.log python3 experiments/bench_attn_splits.py --out "$D/attn_splits.md" --json "$D/attn_splits.json" | tail -20
}
suite_mla_attn() {  # the MLA decode attention alone: time, bandwidth and share of the copy bandwidth by rows, context, splits
  bench mla_attn
  t mla_attn.log python3 experiments/bench_mla_attn.py ${MLA_ATTN_ARGS:-} --out "$D/mla_attn.md" --json "$D/mla_attn.json" | tail -50
}
suite_kernels() {  # per-op us of the fused path on one real-shape layer in a CUDA graph, MoE tile configs, vs dropless and SDPA
  bench kernels
  local p
  for p in qwen1_5_moe_a2_7b mixtral_8x7b qwen3_30b_a3b; do
    t "kernels_$p.log" python3 experiments/bench_kernels.py --preset $p --batch 1 8 32 --out "$D/kernels_$p.md" \
      --json "$D/kernels_$p.json" | tail -8
  done
}
suite_kernels_matrix() {  # experiment=kernels_matrix: {hf, fused} step kernels x {dropless, fused} dispatch (Hydra jobs)
  bench kernels_matrix
  t kernels_matrix.log python3 -m moecg.run experiment=kernels_matrix measure.eager_baseline=false \
    hydra.sweep.dir="$D/sweep" | tail -12
}
suite_strategies() {  # ms/step of every strategy on the full Qwen1.5-MoE shape, one build, one process
  bench strategies
  t strategies.log python3 experiments/bench_strategies.py --preset qwen1_5_moe_a2_7b --batch 1 8 32 --repeats 2 \
    --out "$D/strategies.md" --json "$D/strategies.json" | grep -vE "^\{" | tail -30
}
sweep() {  # EXPERIMENT PRESET LAYERS OVERRIDES...: one Hydra sweep, layers cut to fit a 10-minute device call
  local exp=$1 preset=$2 layers=$3; shift 3
  t "${preset}_L$layers.log" python3 -m moecg.run experiment=$exp model=$preset model.num_layers=$layers "$@" \
    new_tokens=16 prompt_len=32 measure.repeats=2 isolate=false hydra.sweep.dir="$D/${preset}_L$layers" | tail -4
}
suite_strategy_matrix() {  # experiment=strategy_matrix on the Qwen1.5-MoE (4 layers) and Mixtral-8x7B (2 layers) shapes
  bench strategy_matrix
  sweep strategy_matrix qwen1_5_moe_a2_7b 4
  sweep strategy_matrix mixtral_8x7b 2
}
suite_capacity_sweep() {  # experiment=capacity_sweep (strategy=capacity, drop_policy=probs) on the same two shapes, bs 8-64
  bench capacity_sweep
  sweep capacity_sweep qwen1_5_moe_a2_7b 4 batch_size=8,32,64 measure.eager_baseline=false
  sweep capacity_sweep mixtral_8x7b 2 batch_size=8,32,64 measure.eager_baseline=false
}
suite_vs_compile() {  # HF generate, torch.compile(reduce-overhead) and moecg's strategies, one process per shape, fresh caches
  bench vs_compile
  local spec preset layers name
  for spec in "qwen1_5_moe_a2_7b - qwen1_5" "mixtral_8x7b 8 mixtral" "qwen3_30b_a3b 12 qwen3"; do
    read -r preset layers name <<< "$spec"
    [ "$layers" = - ] && layers=""
    TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) t "vs_compile_$name.log" vs_compile \
      --preset "$preset" ${layers:+--num-layers "$layers"} --batch 1 8 \
      --strategies partial full capacity full+fused capacity+fused \
      --out "$D/vs_compile_$name.md" --json "$D/vs_compile_$name.json" | grep -E "^\| [0-9]|failed|Error"
  done
}
suite_vs_compile_families() {  # the same per newer family at bs 1 and 8 (HF-module strategies for MLA, whose fused step is refused)
  bench vs_compile
  local spec name layers strategies
  for spec in "glm4_5_air 8 F" "olmoe_1b_7b 16 F" "gpt_oss_20b ${GPT_OSS_LAYERS:-24} F" \
              "deepseek_v2_lite ${V2_LITE_LAYERS:-27} H" "deepseek_v3 5 H"; do
    read -r name layers strategies <<< "$spec"
    [ "$strategies" = F ] && strategies="partial full capacity full+fused capacity+fused" || strategies="partial full capacity"
    t "vs_compile_$name.log" timeout ${BENCH_TIMEOUT:-170} python3 experiments/bench_vs_compile.py --preset "$name" \
      --num-layers "$layers" --batch 1 8 ${BENCH_ARGS:-} --strategies $strategies --out "$D/vs_compile_$name.md" \
      --json "$D/vs_compile_$name.json" | tail -4
  done
}
suite_vs_compile_mla() {  # the fused latent-attention step (DeepSeek-V3, V2-Lite, Kimi-K2 shapes) against torch.compile, one process per shape
  bench vs_compile_mla
  local spec name layers
  for spec in ${MLA_SHAPES:-deepseek_v3:8 deepseek_v2_lite:27 kimi_k2:4}; do
    name=${spec%%:*} layers=${spec##*:}
    TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) t "vs_compile_$name.log" \
      timeout ${BENCH_TIMEOUT:-400} python3 experiments/bench_vs_compile.py --preset "$name" --num-layers "$layers" \
      --batch 1 8 --skip-hf-generate ${BENCH_ARGS:-} --strategies ${MLA_STRATEGIES:-full full+fused capacity+fused} \
      --out "$D/vs_compile_$name.md" --json "$D/vs_compile_$name.json" | grep -E "^\| [0-9]|floor|failed|Error" | head -12
  done
}
suite_serving() {  # moecg's serving against transformers' continuous batching, exactness of continuous batching; the plot
  bench serving
  t serving.log timeout ${SERVING_TIMEOUT:-300} python3 experiments/bench_serving.py --variants full capacity full+fused \
    --out "$D" ${SERVING_ARGS:-} | grep -vE "warn|^\s*$" | tail -30
  [ -f "$D/serving.json" ] && python3 experiments/plot_serving.py "$D/serving.json" "$D/serving.png"
}
suite_ragged_cost() {  # what per-row positions cost on the fused step, and GPU idle between decode steps
  bench ragged_cost
  t ragged_cost.log timeout ${COST_TIMEOUT:-90} python3 experiments/bench_ragged_cost.py --batch 8 32 \
    --out "$D/ragged_cost.md" --json "$D/ragged_cost.json" | tail -8
}
suite_serving_stdlib() {  # the trained models served on the fused step: each request's tokens vs it decoded alone eagerly
  bench serving_stdlib
  local m
  for m in ${STDLIB_MODELS:-mixtral_stdlib qwen2_moe_stdlib deepseek_v3_stdlib}; do
    t "serve_$m.log" timeout 120 python3 -m moecg.run model=$m workload=poisson workload.rate=100 workload.n_requests=32 \
      workload.output_len=64 'workload.prompt_len=[16,128]' workload.max_batch=16 capture.kernels=fused dispatch=fused \
      strategy=full measure.fidelity_rows=32 hydra.output_subdir=null hydra.run.dir="$D/serve_$m" > /dev/null \
      || echo "serve $m failed: $(tail -2 "$D/serve_$m.log")"
    python3 -c "import json,sys; r=json.load(open('$D/serve_$m/results.json')); print('$m', {k: r.get(k) for k in ('status','captured','kernels','n_requests','token_agreement_vs_eager','output_tokens_per_s','tpot_ms_p90','gpu_idle_share','batch_size_hist')})" \
      | tee -a "$D/serving_stdlib.md"
  done
}
suite_ep1() {  # parallel.ep=1 under torchrun (one process group of one rank) gives the plain run's record
  bench ep1
  local s d common="model=qwen1_5_moe_a2_7b model.num_layers=4 batch_size=8 new_tokens=16 prompt_len=32 measure.repeats=2
          hydra.output_subdir=null"
  for s in full capacity; do
    d=$([ $s = capacity ] && echo "dispatch=capacity" || echo "dispatch=dropless")
    t "plain_$s.log" timeout 120 python3 -m moecg.run strategy=$s $d $common hydra.run.dir="$D/plain_$s" > /dev/null \
      || echo "plain $s failed: $(tail -2 "$D/plain_$s.log")"
    t "torchrun_$s.log" timeout 120 torchrun --standalone --nproc-per-node 1 -m moecg.run parallel.ep=1 strategy=$s $d \
      $common hydra.run.dir="$D/torchrun_$s" > /dev/null || echo "torchrun $s failed: $(tail -2 "$D/torchrun_$s.log")"
  done
  python3 - "$D" <<'PY' | tee "$D/ep1.md"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
keys = ["status", "ep", "captured", "dropped_assignments", "routed_assignments", "capacity", "token_agreement_vs_eager",
        "token_agreement_forced_vs_eager", "max_logit_diff_vs_eager", "ms_per_token_p50"]
print("| run | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
for s in ("full", "capacity"):
    for kind in ("plain", "torchrun"):
        f = out / f"{kind}_{s}" / "results.json"
        r = json.loads(f.read_text()) if f.exists() else {}
        print(f"| {kind} {s} | " + " | ".join(str(r.get(k)) for k in keys) + " |")
PY
}
suite_ep() {  # expert parallelism on one host of GPUs (nvidia-h200-x8; EPS="1 2" on an x2): GPU tests, bench_ep.py, moecg.run jobs
  # MODELS: preset:num_layers (empty: whole depth). Qwen3-235B-A22B is cut to 16 of 94 layers: every rank builds the
  # whole model before keeping its experts, so the cut must fit one GPU (16 layers: 82 GB in bf16).
  bench ep
  local eps=${EPS:-"1 2 4 8"} models=${MODELS:-"mixtral_8x7b: qwen3_30b_a3b: qwen3_235b_a22b:16"}
  local batch=${BATCH:-"1 8 32"} run_batch=${RUN_BATCH:-"8"} strategies=${STRATEGIES:-"full capacity"} m p l ep s bs d
  t gpu_tests.log python3 -m pytest -q -s -m gpu tests -k parallel | tail -5
  for m in $models; do
    p=${m%%:*}; l=${m#*:}
    for ep in $eps; do
      t "bench_${p}_ep${ep}.log" torchrun --standalone --nproc-per-node "$ep" experiments/bench_ep.py --preset "$p" \
        ${l:+--layers "$l"} --batch $batch --new-tokens 16 --prompt-len 32 --out "$D/bench_${p}_ep${ep}.md" \
        --json "$D/bench_${p}_ep${ep}.json" > /dev/null || echo "bench $p ep$ep failed: $(tail -3 "$D/bench_${p}_ep${ep}.log")"
      for s in $strategies; do
        for bs in $run_batch; do
          d="run_${p}_ep${ep}_${s}_bs${bs}"
          t "$d.log" torchrun --standalone --nproc-per-node "$ep" -m moecg.run parallel.ep="$ep" model="$p" \
            ${l:+model.num_layers="$l"} strategy="$s" batch_size="$bs" new_tokens=32 prompt_len=32 measure.repeats=3 \
            hydra.output_subdir=null hydra.run.dir="$D/$d" > /dev/null || echo "run $p ep$ep $s bs$bs failed: $(tail -1 "$D/$d.log")"
        done
      done
    done
  done
  python3 - "$D" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = ["| model | layers | ep | strategy | dispatch | rows/rank | ms/step p50 | eager ms | floor ms | exchange floor ms | "
        "drop rate | forced agreement |", "|" + "---|" * 12]
f = lambda v, p="{:.3f}": "-" if v is None else p.format(v)
for j in sorted(out.glob("run_*/results.json")):
    r = json.loads(j.read_text())
    if r.get("status") != "ok":
        rows.append(f"| {j.parent.name} | failed: {r.get('error')} |")
        continue
    rows.append(f"| {r['model']} | {r['num_layers']} | {r['ep']} | {r['strategy']} | {r['dispatch']} | {r['batch_size']} | "
                f"{f(r['ms_per_token_p50'])} | {f(r['eager_ms_per_token_p50'])} | {f(r['floor_ms'])} | "
                f"{f(r['exchange_floor_ms'])} | {f(r['drop_rate'], '{:.4f}')} | "
                f"{f(r['token_agreement_forced_vs_eager'])} |")
(out / "runs.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
}
suite_ep_projection() {  # one EP-R rank measured on this one GPU, its all-to-alls modelled: R 1-8, bs 1 and 8, three shapes
  # PROJ_MODELS: preset:num_layers, one process each (cut as the floor and ep suites cut them); PROJ_TIMEOUT per shape
  bench ep_projection
  local m p l
  for m in ${PROJ_MODELS:-mixtral_8x7b:8 qwen3_30b_a3b:12 qwen3_235b_a22b:16}; do
    p=${m%%:*}; l=${m#*:}
    t "$p.log" timeout ${PROJ_TIMEOUT:-110} python3 experiments/ep_projection.py --preset "$p" ${l:+--layers "$l"} \
      --ranks 1 2 4 8 --batch 1 8 --out "$D/$p.md" --json "$D/$p.json" | grep -E "^ep_projection|Error" | tail -16 \
      || echo "ep_projection $p failed: $(tail -2 "$D/$p.log")"
  done
  compgen -G "$D/*.json" > /dev/null && python3 experiments/ep_projection.py --md "$D"/*.json | tee "$D/projection.md"
}
suite_smoke() {  # the three real-shape presets build in bf16 and decode
  bench smoke_real_shapes
  t smoke_real_shapes.log python3 experiments/smoke_real_shapes.py
}
suite_diag_rope() {  # which rope_cache configuration gives Triton != the PyTorch reference bits
  bench diag_rope
  t diag_rope.log timeout 60 python3 experiments/diag_rope_gpu.py
}
suite_train_stdlib() {  # trains the shipped byte-level models (1.5 min each); checkpoints under train_stdlib/checkpoints/
  bench train_stdlib
  local m
  for m in ${TRAIN_MODELS:-mixtral_stdlib qwen2_moe_stdlib deepseek_v3_stdlib}; do
    t "train_$m.log" python3 experiments/train_stdlib.py --model $m --device cuda --minutes ${MINUTES:-1.5} \
      --out "$D/checkpoints" | grep -v "Loading weights\|Writing model" | tail -3
  done
}

# -- main ----------------------------------------------------------------------------------------------------------
suites() { declare -F | sed -n 's/^declare -f suite_//p'; }
if [ $# -eq 0 ] || [ "$1" = list ]; then
  for s in $(suites); do
    printf '%-22s %s\n' "$s" "$(declare -f "suite_$s" | sed -n 's/^ *bench \([a-z0-9_]*\);*$/\1/p' | head -1)"
  done
  [ $# -eq 0 ] && { echo "usage: bash experiments/gpu.sh <suite> [<suite>...]" >&2; exit 2; }
  exit 0
fi
for s in "$@"; do
  declare -F "suite_$s" > /dev/null || { echo "gpu.sh: no suite '$s'; the suites: $(suites | tr '\n' ' ')" >&2; exit 2; }
done
WHEELS=${WHEELS-.whl}
if [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || { echo "gpu.sh: installing $WHEELS/*.whl failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
[ -n "${MOECG_GIT_SHA:-}" ] || MOECG_GIT_SHA=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
export MOECG_GIT_SHA
for s in "$@"; do
  echo "== $s (commit $MOECG_GIT_SHA)"
  PASS=new
  "suite_$s"
  if [ -n "${OLD:-}" ]; then
    echo "== $s on $OLD/moecg (commit ${OLD_SHA:-unknown})"
    PASS=old
    PYTHONPATH="$OLD:$PYTHONPATH" MOECG_GIT_SHA=${OLD_SHA:-unknown} "suite_$s"
  fi
done
exit 0
