"""µs per MoE layer for each dispatcher at decode batch sizes, eager and captured in a CUDA graph.

  python experiments/bench_dispatch.py --out experiments/results/dispatch/dispatch.md \
      --json experiments/results/dispatch/dispatch.json
  python experiments/bench_dispatch.py --device cpu --preset mixtral_tiny --batch 1 4 --repeats 5  # CPU: no graphs
  python experiments/bench_dispatch.py --scope fused --only dropless fused capacity-1.25  # equal kernels (gpu.sh capacity)

Dims: B batch rows (one decode token each, so T = B tokens), K top-k, E experts, D hidden.
One model of each preset with a single decoder layer. Scope `experts`: the experts forward alone (HF's module,
through the dispatcher's `forward`) on a routing computed once by the layer's own router; scope `block`: the whole
sparse MoE block (router, experts and, for Qwen2-MoE, the shared expert); scope `fused`: the experts as the fused
decode step (capture.kernels=fused) calls them, `unreduced` where the dispatcher has it: Triton kernels for `fused`
and `capacity` on CUDA (column `kernel`), dropless's sort + grouped GEMM. Timing: CUDA events around `--inner`
back-to-back calls after `--warmup` calls, divided by `--inner`; median over `--repeats`. On CPU, time.perf_counter
the same way. `dynamic` is never captured (it is not graph-safe). Drop rate: the share of routed assignments the
capacity dispatcher dropped on these inputs. Floor: the expert weights a call must read (every expert's for a
dispatcher that `reads_all_experts`, else the experts these tokens hit) over --bandwidth-gbps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from moecg.dispatch import attach, detach, make_dispatcher
from moecg.floor import device_bandwidth_gbps, expert_bytes
from moecg.report import env_fields, write_json
from moecg.models import build_model

CASES = [  # label, dispatch, kwargs
    ("dynamic", "dynamic", {}),
    ("dropless", "dropless", {}),
    ("fused", "fused", {}),
    ("capacity-1.0", "capacity", {"capacity_factor": 1.0}),
    ("capacity-1.25", "capacity", {"capacity_factor": 1.25}),
    ("capacity-2.0", "capacity", {"capacity_factor": 2.0}),
]


def time_us(fn, device: torch.device, warmup: int, inner: int, repeats: int) -> float:
    """Median µs per call of `fn` over `repeats` timings of `inner` back-to-back calls."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / inner)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) * 1e6 / inner)
    return statistics.median(samples)


def capture(fn, pool):
    """Warm up 3x on a side stream (as torch's CUDA-graph docs do), then capture one call of `fn`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        fn()
    return g


def bench_preset(preset: str, args) -> list[dict]:
    built = build_model(preset, num_layers=1, dtype=args.dtype, device=args.device, router_skew=args.router_skew)
    model, dev = built.model, built.device
    layer = built.adapter.layers(model)[0]
    block, router = built.adapter.moe_block(layer), built.adapter.router_of(layer)
    experts = built.adapter.experts_of(layer)
    D, E, K = model.config.hidden_size, built.adapter.num_experts(model.config), built.adapter.top_k(model.config)
    print(f"# {preset}: 1 layer, E={E} K={K} D={D}, {built.dtype}, {env_fields()['device_name']}", flush=True)
    use_graph = dev.type == "cuda" and not args.no_graph
    bw = args.bandwidth_gbps or device_bandwidth_gbps(dev)[0]
    rows = []
    for B in args.batch:
        g = torch.Generator(device=dev).manual_seed(B)
        hidden = torch.randn(B, D, device=dev, dtype=built.dtype, generator=g)  # [T, D] static input
        with torch.no_grad():
            _, w, idx = router(hidden)  # [T, K], [T, K]: the layer's own routing of these tokens
        hit = int(torch.unique(idx).numel())
        for label, dispatch, kw in CASES:
            if args.only and label not in args.only:
                continue
            disp = make_dispatcher(dispatch, **kw)
            state = attach(model, disp, max_rows=max(args.batch))
            counters = state.layer(experts._moecg_slot)
            # what FastDecode._experts calls: unreduced where the dispatcher has it
            step = disp.unreduced if disp.fused_unreduced else disp.forward
            calls = {"experts": lambda: experts(hidden, idx, w),
                     "block": lambda: block(hidden[:, None]),  # the block takes [B, S=1, D]
                     "fused": lambda: step(experts, hidden, idx, w, None, counters)}  # noqa: B023
            use_triton = getattr(disp, "use_triton", None)
            kernel = "triton" if use_triton is not None and use_triton(experts, hidden, idx) else "torch"
            floor_us = (E if disp.reads_all_experts else hit) * expert_bytes(experts) / (bw * 1e3) if bw else None
            try:
                with torch.no_grad():
                    state.reset()
                    experts(hidden, idx, w)
                    drop = state.snapshot()["drop_rate"]
                    for scope in args.scope:
                        fn = calls[scope]
                        eager = time_us(fn, dev, args.warmup, args.inner, args.repeats)
                        graph = None
                        if use_graph and dispatch != "dynamic":
                            # a private pool per graph: reusing a shared pool after `del cg` trips the
                            # caching allocator's use_count assert (seen on torch 2.11)
                            cg = capture(fn, None)
                            graph = time_us(cg.replay, dev, args.warmup, args.inner, args.repeats)
                            del cg
                        row = {"preset": preset, "scope": scope, "dispatch": label, "batch_size": B, "tokens": B,
                               "eager_us": eager, "graph_us": graph, "drop_rate": drop, "experts_hit": hit,
                               "kernel": kernel if scope == "fused" else "-", "floor_us": floor_us}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            finally:
                detach(model)
    del built, model, block, router, experts
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], header: str) -> str:
    dyn = {(r["preset"], r["scope"], r["batch_size"]): r["eager_us"] for r in rows if r["dispatch"] == "dynamic"}
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [header, "",
             "| preset | scope | dispatch | kernel | B | eager µs | graph µs | graph speedup | best vs dynamic eager | "
             "drop rate | floor µs | best / floor |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    order = lambda r: (presets.index(r["preset"]), r["scope"] != "experts", r["batch_size"])  # noqa: E731
    for r in sorted(rows, key=order):
        best = min(v for v in (r["eager_us"], r["graph_us"]) if v is not None)
        ref = dyn.get((r["preset"], r["scope"], r["batch_size"]))
        speed = f"{r['eager_us'] / r['graph_us']:.2f}x" if r["graph_us"] else "-"
        vs_dyn = f"{ref / best:.2f}x" if ref else "-"
        floor = r.get("floor_us")
        lines.append(f"| {r['preset']} | {r['scope']} | {r['dispatch']} | {r.get('kernel', '-')} | {r['batch_size']} | "
                     f"{fmt(r['eager_us'])} | {fmt(r['graph_us'])} | {speed} | {vs_dyn} | {r['drop_rate']:.3f} | "
                     f"{fmt(floor)} | {f'{best / floor:.2f}x' if floor else '-'} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["qwen1_5_moe_a2_7b", "mixtral_8x7b"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--scope", nargs="+", choices=["experts", "block", "fused"], default=["experts", "block", "fused"])
    ap.add_argument("--only", nargs="*", default=None,
                    help=f"dispatch labels to run (default all: {', '.join(c[0] for c in CASES)})")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto = bf16 on cuda, fp32 on cpu")
    ap.add_argument("--router-skew", type=float, default=0.0)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-graph", action="store_true", help="eager only, even on cuda")
    ap.add_argument("--bandwidth-gbps", type=float, default=None,
                    help="HBM bandwidth for the floor column (default: moecg.floor's device table; none on CPU)")
    ap.add_argument("--out", default=None, help="markdown table path")
    ap.add_argument("--json", default=None, help="rows + environment as JSON")
    args = ap.parse_args(argv)
    known = {c[0] for c in CASES}
    if args.only and not set(args.only) <= known:
        ap.error(f"--only {sorted(set(args.only) - known)}: choose from {sorted(known)}")

    rows = []
    for preset in args.preset:
        rows += bench_preset(preset, args)
    env = env_fields()
    header = (f"MoE layer time per dispatcher, {env['device_name']}, torch {env['torch_version']}, "
              f"transformers {env['transformers_version']}, git {env['git_sha']}; median of {args.repeats} x "
              f"{args.inner} calls, router skew {args.router_skew}")
    text = table(rows, header)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, {"env": env, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
