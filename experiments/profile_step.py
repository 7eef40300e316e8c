"""Where a decode step's GPU time goes: kernel-level totals of a captured step, via torch.profiler (GPU).

  python experiments/profile_step.py --preset qwen1_5_moe_a2_7b --batch 8 --kernels fused --dispatch fused

Profiles --steps replays of the captured step (strategy full; kernels inside CUDA graphs are traced by CUPTI)
and prints the kernels by total device time, with the share of the step each takes.
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from moecg.capture import Capture
from moecg.dispatch import attach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.models import build_model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen1_5_moe_a2_7b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kernels", default="fused")
    ap.add_argument("--dispatch", default="fused")
    ap.add_argument("--strategy", default="full")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--weights", default=None, help="the weight format (model.weights; default: as built)")
    ap.add_argument("--activations", default="full", help="how block-FP8 GEMMs take their inputs (model.activations)")
    ap.add_argument("--pdl", type=int, default=None, help="capture.pdl (0: off, so each kernel's time is its own; "
                    "with PDL a kernel launched early counts its wait for its predecessor)")
    args = ap.parse_args(argv)
    built = build_model(args.preset, num_layers=args.num_layers, device="cuda", weights=args.weights,
                        activations=args.activations)
    model = built.model
    attach(model, make_dispatcher(args.dispatch), max_rows=args.batch)
    eng = DecodeEngine(model, 256, args.batch)
    Capture(eng, args.strategy, buckets=(args.batch,), kernels=args.kernels, pdl=args.pdl).apply()
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, 32), generator=torch.Generator().manual_seed(0))
    eng.generate(prompts, 4, timing=False)
    rows = kernel_table(lambda: eng.step_impl(eng.ids, args.batch), args.steps)  # the cache goes on from above
    total = sum(r[1] for r in rows)
    print(f"{args.preset} weights={built.weights} activations={args.activations} pdl={args.pdl} bs {args.batch} kernels={args.kernels} dispatch={args.dispatch} strategy={args.strategy}: "
          f"{total / 1e3:.3f} ms device time per step (decode steps only)")
    print(f"{'kernel':90s} {'us/step':>9s} {'share':>6s} {'calls/step':>10s}")
    for name, t, n in rows[: args.top]:
        print(f"{name:90s} {t:9.1f} {t / total:6.1%} {n:10.1f}")
    return 0


def kernel_table(step, steps: int) -> list[tuple[str, float, float]]:
    """Profile `steps` calls of step() (CUDA kernels, CUPTI sees those inside graphs) -> [(kernel name (90 chars),
    us per step, calls per step)], most device time first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = sorted(((k.key, k.device_time_total, k.count) for k in prof.key_averages() if k.device_time_total > 0),
                  key=lambda r: -r[1])
    return [(name[:90], t / steps, n / steps) for name, t, n in rows]


if __name__ == "__main__":
    sys.exit(main())
