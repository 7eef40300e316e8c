"""The absorbed MLA decode attention (moecg.kernels.triton_ops.mla_attn_decode) alone: time, bandwidth and compute by
rows, context, split count, tiles and merge, against the measured copy bandwidth of the same device.

  python experiments/bench_mla_attn.py --out experiments/results/mla_attn/mla_attn.md \
      --json experiments/results/mla_attn/mla_attn.json    # bash experiments/gpu.sh mla_attn

Shapes: DeepSeek-V3 (128 heads), Kimi-K2 (64) and DeepSeek-V2-Lite (16), 512 latent + 64 rotary dims. Per row count T
and cache (L slots, position p), each variant (tiles heads x slots w warps s stages, `m2` the separate merge kernel)
at each split count is timed as moecg's step runs it: --reps calls back to back in one CUDA graph, median replay over
--replays, divided by --reps (launch gaps as inside a captured step). GB/s counts the bytes the kernel must read:
the live latent and rotary keys, T x (p+1) x (512 + 64) x 2 bytes, plus q and the output; TFLOP/s the scores and the
value products, T x H x (p+1) x (512 + 64 + 512) x 2. `copy GB/s`: a device-to-device copy of a 4 GiB tensor, read +
write bytes over its time (moecg.floor's device figure is measured so). `auto`: mla_tiles' and mla_splits' choice.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_attn_splits import time_call  # same directory: one call per CUDA-event pair, median
from bench_kernels import graph_time_us  # same directory: calls back to back in one CUDA graph, median replay
from profile_step import kernel_table  # same directory: per-kernel device time (torch profiler)

from moecg.floor import measure_copy_gbps
from moecg.kernels import ref
from moecg.kernels import triton_ops as tri
from moecg.kernels.mla import mla_splits
from moecg.kernels.tiles import MlaTiles, mla_tiles
from moecg.report import env_fields, write_report

SHAPES = {"deepseek_v3": 128, "kimi_k2": 64, "deepseek_v2_lite": 16}
C, R = 512, 64
TILES = {"16x32w8s3": MlaTiles(16, 32, 8, 3), "16x64w8s2": MlaTiles(16, 64, 8, 2), "16x32w4s3": MlaTiles(16, 32, 4, 3),
         "32x32w8s2": MlaTiles(32, 32, 8, 2), "64x32w8s2": MlaTiles(64, 32, 8, 2), "64x16w8s2": MlaTiles(64, 16, 8, 2),
         "64x32w4s2": MlaTiles(64, 32, 4, 2)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--contexts", nargs="+", default=["256:48", "4096:4000", "32768:30000"], help="L:p")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128])
    ap.add_argument("--tiles", nargs="+", default=list(TILES), choices=list(TILES))
    ap.add_argument("--merges", type=int, nargs="+", default=None,
                    help="merges to time at every split count > 1 (default: 1 up to 8 splits, 1 and 2 up to 32, 2 above)")
    ap.add_argument("--kernel-times", action="store_true",
                    help="also split the auto and best variants' time by kernel (attention, merge; torch profiler)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs CUDA")
    dev = torch.device("cuda")
    copy = measure_copy_gbps(torch.device("cuda"), iters=args.replays)
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
                want = ref.mla_attn_decode(q_lat, q_pe, lat, kr, pos, scale).float()  # every row
                gb = (T * (p + 1) * (C + R) * 2 + 2 * T * H * C * 2 + T * H * R * 2) / 1e9
                tflop = T * H * (p + 1) * (C + R + C) * 2 / 1e12
                auto_t = mla_tiles(T, H, C, L)
                auto = mla_splits(T, -(-H // min(auto_t.heads, 1 << (H - 1).bit_length())), L)
                row = {"shape": name, "heads": H, "T": T, "L": L, "pos": p, "auto_splits": auto, "auto_tiles":
                       f"{auto_t.heads}x{auto_t.block_l}w{auto_t.warps}s{auto_t.stages}", "copy_gbps": copy, "ms": {}}
                seen = set()
                for tn in args.tiles:
                    tiles = TILES[tn]
                    hb = min(tiles.heads, 1 << (H - 1).bit_length())
                    key = (hb, tiles.block_l, tiles.warps, tiles.stages)
                    if key in seen:  # more heads per program than the model has: the same launch as another
                        continue
                    seen.add(key)
                    n_hb = -(-H // hb)
                    for sp in sorted({*(args.splits if L > 256 else (1,)), mla_splits(T, n_hb, L)}):
                        if sp > max(1, L // 64):
                            continue
                        merges = ((1,) if sp <= 8 else (1, 2) if sp <= 32 else (2,)) if args.merges is None else (
                            args.merges if sp > 1 else (1,))
                        for merge in merges:
                            def fn(sp=sp, tiles=tiles, merge=merge):
                                return tri.mla_attn_decode(q_lat, q_pe, lat, kr, pos, scale, splits=sp, tiles=tiles,
                                                           merge=merge)
                            err = float((fn().float() - want).abs().max())
                            assert err < 2e-2, (name, T, L, tn, sp, merge, err)
                            ms0 = time_call(fn, 3)  # long calls: fewer per graph and fewer replays
                            reps = max(2, min(args.reps, int(2 / max(ms0, 1e-3))))
                            row["ms"][f"{tn}:{sp}:m{merge}"] = graph_time_us(
                                fn, reps, args.replays if ms0 < 0.5 else 5) / 1e3
                a = f"{row['auto_tiles']}:{auto}:m{1 if auto <= tri.mla.MERGE_INLINE_MAX else 2}"
                best = min(row["ms"], key=row["ms"].get)
                row["auto"], row["best"] = a, best
                if args.kernel_times:
                    row["kernels_us"] = {}
                    for k in {a, best} & set(row["ms"]):
                        tn, sp, merge = k.split(":")
                        fn = lambda: tri.mla_attn_decode(q_lat, q_pe, lat, kr, pos, scale, splits=int(sp),  # noqa: E731
                                                         tiles=TILES[tn], merge=int(merge[1:]))
                        row["kernels_us"][k] = {name.split("(")[0][:40]: round(us, 2)
                                                for name, us, _ in kernel_table(fn, 20)}
                for k in ("auto", "best"):
                    ms = row["ms"].get(row[k], float("nan"))
                    row[f"ms_{k}"], row[f"gbps_{k}"], row[f"tflops_{k}"] = ms, gb / ms * 1e3, tflop / ms * 1e3
                    row[f"copy_share_{k}"] = row[f"gbps_{k}"] / copy
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "ms"}), flush=True)
                del lat, kr, q_lat, q_pe
    lines = [f"mla_attn_decode on {env_fields()['device_name']}, bf16, latent {C} + rotary {R}, timed in CUDA graphs "
             f"({args.reps} calls per graph); copy {copy:.0f} GB/s. Variant = tiles (heads x slots w warps s stages) : "
             "splits : merge (m1 in the kernel, m2 the merge kernel); auto = moecg's choice", "",
             "| shape (heads) | T | L (pos) | auto | ms | GB/s | of copy | TFLOP/s | best | ms | GB/s | of copy | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} ({r['heads']}) | {r['T']} | {r['L']} ({r['pos']}) | {r['auto']} | "
                     f"{r['ms_auto']:.4f} | {r['gbps_auto']:.0f} | {r['copy_share_auto']:.0%} | {r['tflops_auto']:.0f} | "
                     f"{r['best']} | {r['ms_best']:.4f} | {r['gbps_best']:.0f} | {r['copy_share_best']:.0%} | "
                     f"{r['tflops_best']:.0f} |")
    if args.kernel_times:
        lines += ["", "per kernel (us a call, torch profiler, outside a graph):", ""]
        lines += [f"- {r['shape']} T {r['T']} L {r['L']}: " + "; ".join(
            f"{k}: " + ", ".join(f"{n} {us}" for n, us in ks.items()) for k, ks in r["kernels_us"].items())
            for r in rows]
    write_report("\n".join(lines), rows, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
