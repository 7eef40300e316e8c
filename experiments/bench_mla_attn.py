"""The absorbed MLA decode attention (moecg.kernels.triton_ops.mla_attn_decode) alone: time and bandwidth by rows,
context and split count, against the measured copy bandwidth of the same device.

  python experiments/bench_mla_attn.py --out experiments/results/mla_attn/mla_attn.md \
      --json experiments/results/mla_attn/mla_attn.json    # bash experiments/gpu.sh mla_attn

Shapes: DeepSeek-V3 / Kimi-K2 (128 / 64 heads) and DeepSeek-V2-Lite (16 heads), 512 latent + 64 rotary dims. Per row
count T and cache (L slots, position p): ms per call (CUDA events, median of --iters, one call per event pair, after
warmup) for each split count, and the bandwidth of the bytes the kernel must read: the live latent and rotary keys,
T x (p+1) x (512 + 64) x 2 bytes, plus q and the output. `copy GB/s` is a device-to-device copy of a 4 GiB tensor
timed the same way (moecg.floor's device figure is measured so). `auto` = mla_splits' choice.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from moecg.kernels import ref
from moecg.kernels import triton_ops as tri
from moecg.kernels.mla import mla_splits
from moecg.report import env_fields, write_report

SHAPES = {"deepseek_v3": 128, "kimi_k2": 64, "deepseek_v2_lite": 16}
C, R = 512, 64


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


def copy_gbps(iters: int) -> float:
    """Read + write GB/s of a 4 GiB device copy (the bytes moved both ways over the time)."""
    x = torch.empty(2 ** 31, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = time_call(lambda: y.copy_(x), iters)
    gbps = 2 * x.numel() * x.element_size() / 1e9 / (ms / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return gbps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--contexts", nargs="+", default=["4096:4000", "32768:30000"], help="L:p")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs CUDA")
    dev = torch.device("cuda")
    copy = copy_gbps(args.iters)
    print(f"copy {copy:.0f} GB/s", flush=True)
    rows = []
    for name in args.shapes:
        H = SHAPES[name]
        for ctx in args.contexts:
            L, p = map(int, ctx.split(":"))
            for T in args.rows:
                g = torch.Generator(device=dev).manual_seed(T)
                lat = torch.randn(T, 1, L, C, device=dev, generator=g).to(torch.bfloat16)
                kr = torch.randn(T, 1, L, R, device=dev, generator=g).to(torch.bfloat16)
                q_lat = torch.randn(H, T, C, device=dev, generator=g).to(torch.bfloat16).transpose(0, 1)  # as the step
                q_pe = torch.randn(T, H, R, device=dev, generator=g).to(torch.bfloat16)
                pos = torch.tensor(p, device=dev)
                scale = 192 ** -0.5
                want = ref.mla_attn_decode(q_lat[:1], q_pe[:1], lat[:1], kr[:1], pos, scale).float()
                gb = (T * (p + 1) * (C + R) * 2 + 2 * T * H * C * 2 + T * H * R * 2) / 1e9
                n_hb = -(-H // 16)
                auto = mla_splits(T, n_hb, L)
                row = {"shape": name, "heads": H, "T": T, "L": L, "pos": p, "auto": auto, "copy_gbps": copy, "ms": {}}
                for sp in sorted({*args.splits, auto}):
                    if sp > max(1, L // 64):
                        continue
                    o = tri.mla_attn_decode(q_lat, q_pe, lat, kr, pos, scale, splits=sp)
                    err = float((o[:1].float() - want).abs().max())
                    assert err < 2e-2, (name, T, L, sp, err)
                    row["ms"][sp] = time_call(lambda: tri.mla_attn_decode(q_lat, q_pe, lat, kr, pos, scale, splits=sp),
                                              args.iters)
                best = min(row["ms"], key=row["ms"].get)
                row["best"] = best
                row["gbps_auto"], row["gbps_best"] = gb / row["ms"][auto] * 1e3, gb / row["ms"][best] * 1e3
                row["copy_share_auto"], row["copy_share_best"] = row["gbps_auto"] / copy, row["gbps_best"] / copy
                rows.append(row)
                print(json.dumps(row), flush=True)
                del lat, kr, q_lat, q_pe
    lines = [f"mla_attn_decode on {env_fields()['device_name']}, bf16, latent {C} + rotary {R}; ms per call by split "
             f"count (auto = mla_splits); copy {copy:.0f} GB/s", "",
             "| shape (heads) | T | L (pos) | auto | " + " | ".join(str(s) for s in args.splits)
             + " | best | GB/s auto / best | of copy, auto / best |",
             "|---|---|---|---|" + "---|" * len(args.splits) + "---|---|---|"]
    for r in rows:
        cells = [f"{r['ms'][s]:.4f}" if s in r["ms"] else "-" for s in args.splits]
        lines.append(f"| {r['shape']} ({r['heads']}) | {r['T']} | {r['L']} ({r['pos']}) | {r['auto']} | "
                     + " | ".join(cells) + f" | {r['best']} | {r['gbps_auto']:.0f} / {r['gbps_best']:.0f} | "
                     f"{r['copy_share_auto']:.0%} / {r['copy_share_best']:.0%} |")
    write_report("\n".join(lines), rows, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
