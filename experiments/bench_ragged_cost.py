"""What per-row positions cost on the fused step, and whether host scheduling starves the GPU.

  python experiments/bench_ragged_cost.py --preset qwen1_5_moe_a2_7b --batch 8 32 --out experiments/results/ragged_cost/ragged_cost.md
  python experiments/bench_ragged_cost.py --preset qwen3_moe_tiny --device cpu --batch 2 --steps 4   # smoke

Per batch B, both captured once in bucket B with `strategy=full capture.kernels=fused dispatch=fused`:
  equal   DecodeEngine: every row at one position (prompts of --prompt-len tokens), ms per step from its
          generate's CUDA events (the step's own replay, as every moecg table)
  ragged  RaggedEngine: B requests with prompt lengths spread over prompt-len/2 .. 3*prompt-len/2 (the same mean),
          each row at its own position; ms per step from CUDA events around the same replay (step_impl), next
          tokens fed back on the device
  ragged_cost = ragged / equal (target <= 1.05)
GPU idle between decode steps (target <= 10% of the step at bs 8): events at each step's start and end; idle =
start(i+1) - end(i), summed over steps, over the summed step time. Measured for two host loops:
  replay_loop  step_impl + device-side token feedback only (the loop a serving scheduler with no per-step stop
               check runs)
  step_api     RaggedEngine.step(): the host bookkeeping of every request each step (its tokens to host:
               one sync per step)
Timing: CUDA events after --warmup steps, median over --steps (perf_counter on CPU, where idle is not measured).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.models import build_model
from moecg.ragged import RaggedEngine
from moecg.report import env_fields, write_report


def _capture(engine, B, backend):
    return Capture(engine, "full", buckets=(B,), kernels="fused", backend=backend).apply()


def equal_ms(model, B, args, backend):
    attach(model, make_dispatcher("fused"), max_rows=B)
    try:
        eng = DecodeEngine(model, args.cache_len, B)
        cap = _capture(eng, B, backend)
        prompts = torch.randint(0, model.config.vocab_size, (B, args.prompt_len), generator=torch.Generator().manual_seed(B))
        steps = []
        for _ in range(args.repeats):
            steps += eng.generate(prompts, args.warmup + args.steps + 1).step_ms[args.warmup:]
        cap.unwrap()
        return statistics.median(steps), cap.stats()["captured"]
    finally:
        detach(model)


def _timed_loop(eng, B, n, step, cuda):
    """Run `step()` n times -> (median step ms, idle share); CUDA events at each step's start and end."""
    if cuda:
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for a, b in evs:
            a.record()
            step()
            b.record()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        ms = [a.elapsed_time(b) for a, b in evs]
        idle = sum(evs[i][1].elapsed_time(evs[i + 1][0]) for i in range(n - 1))  # end(i) -> start(i+1)
        return statistics.median(ms), idle / sum(ms[:-1]), wall / n
    ms = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms), None, statistics.median(ms)


def ragged_ms(model, B, args, backend):
    attach(model, make_dispatcher("fused"), max_rows=B)
    try:
        eng = RaggedEngine(model, args.cache_len, B)
        cap = _capture(eng, B, backend)
        g = torch.Generator().manual_seed(B)
        lo, hi = args.prompt_len // 2, args.prompt_len * 3 // 2
        lens = torch.linspace(lo, hi, B).round().long().tolist()
        total = args.warmup + 2 * args.steps + 2
        for i, S in enumerate(lens):
            eng.add(i, torch.randint(0, model.config.vocab_size, (S,), generator=g), max_new_tokens=total)
        eng._set_rows(B, B)
        cuda = eng.device.type == "cuda"

        def replay():
            nxt, _ = eng.step_impl(eng.ids, B)
            eng.ids[:B].copy_(nxt[:B])

        for _ in range(args.warmup):
            replay()
        r_ms, r_idle, r_wall = _timed_loop(eng, B, args.steps, replay, cuda)
        eng.host_len.update({rid: eng.host_len[rid] + args.warmup + args.steps for rid in eng.order})
        s_ms, s_idle, s_wall = _timed_loop(eng, B, args.steps, eng.step, cuda)
        spread = [int(x) for x in eng.cache.lengths[:B].tolist()]
        cap.unwrap()
        return {"ragged_ms": r_ms, "replay_loop_idle": r_idle, "replay_loop_wall_ms": r_wall,
                "step_api_ms": s_ms, "step_api_idle": s_idle, "step_api_wall_ms": s_wall,
                "final_lengths": [min(spread), max(spread)]}
    finally:
        detach(model)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen1_5_moe_a2_7b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--cache-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    built = build_model(args.preset, num_layers=args.num_layers, device=args.device)
    model = built.model
    backend = "auto" if built.device.type == "cuda" else "emulate"
    rows = []
    for B in args.batch:
        eq, captured = equal_ms(model, B, args, backend)
        row = {"batch_size": B, "equal_ms": eq, "captured": captured, **ragged_ms(model, B, args, backend)}
        row["ragged_cost"] = row["ragged_ms"] / eq
        rows.append(row)
        print(json.dumps(row), flush=True)
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [f"{args.preset}, {len(built.adapter.layers(model))} layers, {built.dtype}, {env_fields()['device_name']}, "
             f"strategy=full capture.kernels=fused dispatch=fused, cache {args.cache_len}, prompts {args.prompt_len} "
             f"(ragged: {args.prompt_len // 2}-{args.prompt_len * 3 // 2}); ms per step, median of {args.steps}", "",
             "| bs | equal ms | ragged ms | ragged / equal | GPU idle, replay loop | GPU idle, step() | step() ms | "
             "wall ms per step, replay loop / step() |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch_size']} | {r['equal_ms']:.3f} | {r['ragged_ms']:.3f} | {r['ragged_cost']:.3f} | "
                     f"{f(r['replay_loop_idle'])} | {f(r['step_api_idle'])} | {r['step_api_ms']:.3f} | "
                     f"{r['replay_loop_wall_ms']:.3f} / {r['step_api_wall_ms']:.3f} |")
    write_report("\n".join(lines), rows, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
