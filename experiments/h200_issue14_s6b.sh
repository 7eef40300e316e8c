#!/usr/bin/env bash
# Issue 14 on one H200, session 6, round B: the split attention runs only the splits that hold keys at the step's
# position (one: it writes the output, no merge); the merge's loads unrolled (mb=N); against the previous package.
#   MOECG_GIT_SHA=<sha> OLD=.gpu/old bash experiments/h200_issue14_s6b.sh OUTDIR [tests,short,long,qwen15]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue14_s6}
WHAT=${2:-tests,short,long,qwen15}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
has() { [[ ",$WHAT," == *",$1,"* ]]; }
D=slot+overlap+router+gemv+pdl
source experiments/h200_issue14_lib.sh  # variants(), old()
LONG="--prompt-len 30000 --cache-len 32768 --prefill-chunk 4096 --replays 20 --repeats 3"
if has tests; then
  python3 -m pytest -q -m gpu tests/test_fast_gpu.py 2>&1 | tail -3 | tee "$OUT/gpu_tests_b.log"
fi
if has short; then
  variants qwen3_b qwen3_30b_a3b 12 --batch 1 8 --variants $D $D+as=1
  old qwen3_b_old qwen3_30b_a3b 12 --batch 1 8 --variants $D
fi
if has long; then
  variants qwen3_long_b qwen3_30b_a3b 12 --batch 1 $LONG --variants $D $D+mb=2 $D+mb=4 $D+as=128
  old qwen3_long_b_old qwen3_30b_a3b 12 --batch 1 $LONG --variants $D
fi
if has qwen15; then
  variants qwen15_b qwen1_5_moe_a2_7b 24 --batch 1 8 --variants $D $D+as=1
  old qwen15_b_old qwen1_5_moe_a2_7b 24 --batch 1 8 --variants $D
fi
exit 0
