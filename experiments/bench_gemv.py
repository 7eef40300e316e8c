"""The decode step's qkv and o projections at small batches: cuBLAS (F.linear) against moecg's Triton GEMV
(triton_ops.linear) over a grid of tiles, per shape and batch, on one GPU. Sets moecg.kernels.tiles.GEMV_RULES.

  python experiments/bench_gemv.py --presets qwen1_5_moe_a2_7b qwen3_30b_a3b mixtral_8x7b --batch 1 2 4 8 16 \
      --out experiments/results/gemv/gemv.md --json experiments/results/gemv/gemv.json

Each op runs `--reps` times back to back in one CUDA graph (as inside the captured step: no launch overhead) on a
ring of distinct weight copies larger than L2 (each call streams its weight from HBM, as each layer does), median of
`--repeats` replays; GB/s counts the weight bytes. `max diff` is against F.linear (fp32 accumulation both; the
summation order differs).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F
from bench_kernels import graph_time_us  # same directory: `reps` calls in one graph, median of replays

from moecg.kernels import triton_ops
from moecg.kernels.tiles import GemvTiles
from moecg.models import build_model
from moecg.report import env_fields, write_report

CONFIGS = [GemvTiles(16, 256, 4, 4), GemvTiles(16, 512, 4, 3), GemvTiles(16, 128, 4, 6), GemvTiles(32, 256, 4, 4),
           GemvTiles(32, 128, 4, 4), GemvTiles(64, 128, 4, 4), GemvTiles(16, 256, 8, 4), GemvTiles(32, 256, 8, 3)]


def shapes(preset: str) -> list[tuple[str, int, int, bool]]:
    """(projection, N, K, has bias) of one decoder layer's qkv and o projections."""
    b = build_model(preset, num_layers=1, device="cuda")
    at = b.adapter.layers(b.model)[0].self_attn
    qkv, bias = b.adapter.qkv_of(at)
    o = b.adapter.o_of(at)
    out = [("qkv", sum(p.shape[0] for p in qkv), qkv[0].shape[1], all(x is not None for x in bias)),
           ("o", o.weight.shape[0], o.weight.shape[1], o.bias is not None)]
    del b
    torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["qwen1_5_moe_a2_7b", "qwen3_30b_a3b", "mixtral_8x7b"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ring-mib", type=int, default=512, help="weight copies per shape, in MiB (> L2)")
    ap.add_argument("--pdl", type=int, default=0, help="triton_ops.PDL for the GEMV calls (0: plain launches, as "
                                                        "cuBLAS's; 2 chains the back-to-back GEMVs, flattering them)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("bench_gemv.py times CUDA kernels: run it on a GPU")
    dt = torch.bfloat16
    triton_ops.PDL = args.pdl
    rows = []
    for preset in args.presets:
        for proj, N, K, has_bias in shapes(preset):
            n_ring = max(2, args.ring_mib * 2**20 // (N * K * 2))
            ring = [(torch.randn(N, K, device="cuda", dtype=dt) * 0.02,
                     torch.randn(N, device="cuda", dtype=dt) if has_bias else None) for _ in range(n_ring)]
            gb = N * K * 2 / 1e9
            for T in args.batch:
                x = torch.randn(T, K, device="cuda", dtype=dt)
                want = F.linear(x, *ring[0])
                variants = [("cublas", None)] + [(f"gemv[{c.block_n},{c.block_k},{c.warps},{c.stages}]", c)
                                                 for c in CONFIGS]
                for name, tiles in variants:
                    if tiles is None:
                        op = lambda wb: F.linear(x, wb[0], wb[1])  # noqa: E731
                    else:
                        op = lambda wb, t=tiles: triton_ops.linear(x, wb[0], wb[1], tiles=t)  # noqa: E731
                    try:
                        diff = float((op(ring[0]).float() - want.float()).abs().max())
                        weights = itertools.cycle(ring)  # each captured call streams the next copy
                        us = graph_time_us(lambda: op(next(weights)), args.reps, args.repeats)
                    except Exception as e:  # noqa: BLE001 - a config that does not fit must not lose the others
                        print(f"{preset} {proj} T={T} {name}: failed: {type(e).__name__}: {e}", flush=True)
                        continue
                    row = {"preset": preset, "proj": proj, "N": N, "K": K, "bias": has_bias, "T": T,
                           "variant": name, "us": us, "gbps": gb / (us * 1e-6), "max_diff": diff}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del ring
            torch.cuda.empty_cache()
    env = env_fields()
    lines = [f"qkv / o projections, bf16, {env['device_name']}, torch {env['torch_version']}, commit {env['git_sha']}: "
             f"µs per call in a CUDA graph of {args.reps} calls on a > L2 weight ring, median of {args.repeats}, "
             f"triton_ops.PDL {args.pdl}; "
             "best GEMV config per row and its speed-up on cuBLAS", "",
             "| preset | proj | N x K | T | cuBLAS µs (GB/s) | best GEMV | µs (GB/s) | cuBLAS / GEMV | max diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["preset"], r["proj"], r["T"]) for r in rows}, key=lambda k: (args.presets.index(k[0]),
                                                                                    k[1] != "qkv", k[2]))
    for k in keys:
        rs = [r for r in rows if (r["preset"], r["proj"], r["T"]) == k]
        cb = next((r for r in rs if r["variant"] == "cublas"), None)
        gv = [r for r in rs if r["variant"] != "cublas"]
        if cb is None or not gv:
            continue
        best = min(gv, key=lambda r: r["us"])
        lines.append(f"| {k[0]} | {k[1]} | {cb['N']} x {cb['K']} | {k[2]} | {cb['us']:.2f} ({cb['gbps']:.0f}) | "
                     f"{best['variant']} | {best['us']:.2f} ({best['gbps']:.0f}) | {cb['us'] / best['us']:.2f} | "
                     f"{best['max_diff']:.1e} |")
    write_report("\n".join(lines), rows, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
