#!/usr/bin/env bash
# Issue 11 checks on one H200: the GPU tests after the run-plan / capacity / sliding-window changes, and a capacity
# run at a batch that is not a bucket size through the CLI, captured and eager (the same drops expected).
#   MOECG_GIT_SHA=$(git rev-parse --short HEAD) bash experiments/h200_issue11.sh OUTDIR [tests|cli|all]
set -u -o pipefail
OUT=${1:-experiments/results/h200/issue11}
WHAT=${2:-all}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  python3 -m pytest -q -s -m gpu tests/test_capture_gpu.py tests/test_fast_gpu.py tests/test_dispatch_gpu.py \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|FAILED|drops as eager|bs=" | tail -40
fi
if [ "$WHAT" = cli ] || [ "$WHAT" = all ]; then
  # hydra.output_subdir=null: no .hydra/ folder (it records this machine's working directory)
  COMMON="${MODEL:-model=qwen1_5_moe_a2_7b model.num_layers=4} dispatch=capacity dispatch.capacity_factor=${CF:-1.0} batch_size=5
          new_tokens=32 prompt_len=32 measure.repeats=3 hydra.output_subdir=null"
  for dt in bf16 fp32; do
    for s in eager capacity; do
      for k in hf fused; do
        python3 -m moecg.run strategy=$s capture.kernels=$k model.dtype=$dt $COMMON \
          hydra.run.dir="$OUT/cap_bs5_${dt}_${s}_${k}" > "$OUT/cap_bs5_${dt}_${s}_${k}.log" 2>&1 \
          || echo "run $dt $s $k failed: $(tail -1 "$OUT/cap_bs5_${dt}_${s}_${k}.log")"
      done
    done
  done
  python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
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
(out / "capacity_bs5.md").write_text(table + "\n")
(out / "capacity_bs5.json").write_text(json.dumps(raw, indent=1))
PY
fi
