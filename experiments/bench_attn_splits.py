"""Decode attention (moecg.kernels.triton_ops.attn_decode) vs the number of context splits, short and long contexts:
the data behind attn_splits' choice (the split heuristic tuned for long contexts, not only 256 slots).

  python experiments/bench_attn_splits.py --out experiments/results/attn_splits/attn_splits.md \
      --json experiments/results/attn_splits/attn_splits.json    # bash experiments/gpu.sh attn_splits

Per shape (q heads / kv heads / head dim of one layer), rows T and cache (L slots, position p): ms per call (CUDA
events, median of --iters after warmup, one call per event pair) for each split count, and the live-KV bandwidth
(T x Hkv x (p+1) x Dh x 2 tensors x 2 bytes / time). `auto` = attn_splits' current choice.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from moecg.kernels import triton_ops as tri
from moecg.report import env_fields, write_report

SHAPES = {"qwen1_5_moe": (16, 16, 128), "qwen3_30b_a3b": (32, 4, 128), "mixtral_8x7b": (32, 8, 128)}


def time_call(fn, iters):
    for _ in range(3):
        fn()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in evs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--contexts", nargs="+", default=["256:48", "4096:4000", "32768:30000"], help="L:p")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows, lines = [], []
    for name, (Hq, Hkv, Dh) in SHAPES.items():
        for ctx in args.contexts:
            L, p = map(int, ctx.split(":"))
            for T in args.rows:
                q = torch.randn(T, Hq, Dh, device=dev, dtype=torch.bfloat16)
                k = torch.randn(T, Hkv, L, Dh, device=dev, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                pos = torch.tensor(p, device=dev)
                ref = tri.attn_decode(q, k, v, pos, 0.08, splits=1)
                auto = tri.attn_splits(T, Hkv, L)
                gb = T * Hkv * (p + 1) * Dh * 2 * 2 / 1e9
                row = {"shape": name, "T": T, "L": L, "pos": p, "auto": auto, "ms": {}}
                for sp in sorted({*args.splits, auto}):
                    if sp > max(1, L // 64):
                        continue
                    o = tri.attn_decode(q, k, v, pos, 0.08, splits=sp)
                    err = float((o.float() - ref.float()).abs().max())
                    assert err < 2e-2, (name, T, L, sp, err)
                    row["ms"][sp] = time_call(lambda: tri.attn_decode(q, k, v, pos, 0.08, splits=sp), args.iters)
                best = min(row["ms"], key=row["ms"].get)
                row["best"], row["gbps_best"], row["gbps_auto"] = best, gb / row["ms"][best] * 1e3, gb / row["ms"][auto] * 1e3
                rows.append(row)
                print(json.dumps(row), flush=True)
    lines = [f"attn_decode on {env_fields()['device_name']}, bf16; ms per call by split count (auto = attn_splits)", "",
             "| shape | T | L (pos) | auto | " + " | ".join(str(s) for s in args.splits) + " | best | GB/s auto / best |",
             "|---|---|---|---|" + "---|" * len(args.splits) + "---|---|"]
    for r in rows:
        cells = [f"{r['ms'][s]:.4f}" if s in r["ms"] else "-" for s in args.splits]
        lines.append(f"| {r['shape']} | {r['T']} | {r['L']} ({r['pos']}) | {r['auto']} | " + " | ".join(cells)
                     + f" | {r['best']} | {r['gbps_auto']:.0f} / {r['gbps_best']:.0f} |")
    write_report("\n".join(lines), rows, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
