#!/usr/bin/env bash
# Issue 14 on one H200, session 6, round A: the GPU tests after the last session's CPU-only mends and the blocked
# attention merge; the merge and the MoE tiles inside the captured step (Qwen3 12 layers, short and 30k contexts),
# against the previous commit's package (OLD, a `git archive` of moecg/ without its checkpoints); in-process re-capture.
#   MOECG_GIT_SHA=<sha> OLD=.gpu/old bash experiments/h200_issue14_s6.sh OUTDIR [tests,short,old,long,capture]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_s6}
WHAT=${2:-tests,short,old,long,capture}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
has() { [[ ",$WHAT," == *",$1,"* ]]; }
D=slot+overlap+router+gemv+pdl  # every default switch of the step today
source experiments/h200_issue14_lib.sh  # variants(), old()
Q3="qwen3_30b_a3b 12"
if has tests; then
  python3 -m pytest -q -m gpu tests/test_fast_gpu.py tests/test_capacity_kernel_gpu.py 2>&1 | tail -4 \
    | tee "$OUT/gpu_tests.log"
fi
if has short; then
  variants qwen3_short $Q3 --batch 1 8 --variants $D $D+mb=1 $D+as=1 $D+up_n=32 $D+up_n=128 $D+up_k=256 $D+down_n=32 \
    $D+down_n=128 $D+down_k=256 $D+warps=8
fi
if has old; then  # the same default step on the previous commit's package, short and long
  old qwen3_old_short $Q3 --batch 1 8 --variants $D
  old qwen3_old_long $Q3 --batch 1 --prompt-len 30000 --cache-len 32768 \
    --prefill-chunk 4096 --replays 20 --repeats 3 --variants $D
fi
if has long; then
  variants qwen3_long $Q3 --batch 1 --prompt-len 30000 --cache-len 32768 --prefill-chunk 4096 --replays 20 --repeats 3 \
    --variants $D $D+mb=1 $D+as=128 $D+as=32
fi
if has capture; then
  python3 experiments/capture_time.py --preset qwen1_5_moe_a2_7b --warmup 1 --recapture \
    --out "$OUT/capture_time_recapture.md" --json "$OUT/capture_time_recapture.json" 2>&1 \
    | tee "$OUT/capture_time_recapture.log" | grep -E "^\| |target"
fi
exit 0
