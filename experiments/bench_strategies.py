"""ms per decode step for every capture strategy on one model, several batch sizes, in one process.

  python experiments/bench_strategies.py --preset qwen1_5_moe_a2_7b --batch 1 8 32 --out experiments/results/strategies/strategies.md

Timing: CUDA events around each decode step, after one untimed warm generate; the first `--skip` steps of
each repeat are left out; median and p90 over all remaining steps of `--repeats` generates. Fidelity: greedy
token agreement with dropless eager on the same prompts. One model build serves every row of the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from moecg.capture import Capture, bucket_for
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import DecodeEngine
from moecg.floor import bench_bandwidth_gbps, step_floor_ms
from moecg.report import env_fields, percentile, write_report
from moecg.models import build_model

DEFAULT = [  # label, strategy, layers, dispatch, dispatch kwargs
    ("eager", "eager", None, "dropless", {}),
    ("eager-dynamic", "eager", None, "dynamic", {}),
    ("partial-dynamic", "partial", None, "dynamic", {}),
    ("partial", "partial", None, "dropless", {}),
    ("layer", "layer", None, "dropless", {}),
    ("full", "full", None, "dropless", {}),
    ("capacity-1.25", "capacity", None, "capacity", {"capacity_factor": 1.25}),
]


def time_generate(engine, prompts, new_tokens, repeats, skip):
    engine.generate(prompts, new_tokens, timing=False, count_prefill=False)
    steps, res = [], None
    for _ in range(repeats):
        res = engine.generate(prompts, new_tokens, count_prefill=False)
        steps += res.step_ms[skip:]
    return steps, res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen1_5_moe_a2_7b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--bandwidth-gbps", type=float, default=None,
                    help="HBM GB/s for the floor (default: moecg.floor's device table, else a copy measured here)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    built = build_model(args.preset, num_layers=args.num_layers, device=args.device)
    model = built.model
    bw, bw_source = bench_bandwidth_gbps(built.device, args.bandwidth_gbps)
    cases = [c for c in DEFAULT if args.only is None or c[0] in args.only]
    max_rows = max(max(bucket_for(b, tuple(args.buckets)) or b, b) for b in args.batch)
    cache_len = args.prompt_len + args.new_tokens
    rows = []
    print(f"# {args.preset} layers={len(built.adapter.layers(model))} dtype={built.dtype} "
          f"device={env_fields()['device_name']} build {built.build_s:.1f}s", flush=True)
    for bs in args.batch:
        prompts = torch.randint(0, model.config.vocab_size, (bs, args.prompt_len),
                                generator=torch.Generator().manual_seed(bs))
        attach(model, make_dispatcher("dropless"), max_rows=max_rows)
        ref_engine = DecodeEngine(model, cache_len, max_rows)
        ref = ref_engine.generate(prompts, args.new_tokens, timing=False)
        detach(model)
        del ref_engine
        for label, strategy, layers, dispatch, kw in cases:
            attach(model, make_dispatcher(dispatch, **kw), max_rows=max_rows)
            engine = DecodeEngine(model, cache_len, max_rows)
            t0 = time.perf_counter()
            try:
                cap = Capture(engine, strategy, layers=layers, buckets=args.buckets, backend="auto").apply()
            except Exception as e:  # noqa: BLE001 - report and go on (validated combos only)
                print(f"{label} bs={bs}: FAILED {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
                detach(model)
                continue
            apply_s = time.perf_counter() - t0
            state = state_of(model)
            state.reset()
            steps, res = time_generate(engine, prompts, args.new_tokens, args.repeats, args.skip)
            snap = state.snapshot()
            floor_ms = step_floor_ms(engine, built.adapter, prompts, bw,
                                     args.prompt_len + args.new_tokens // 2, dispatch == "capacity")
            p50 = statistics.median(steps)
            stats = cap.stats()
            row = {
                "label": label, "strategy": strategy, "dispatch": dispatch, "batch_size": bs,
                "ms_per_token_p50": p50, "ms_per_token_p90": percentile(steps, 0.9),
                "capture_s": stats["capture_s"], "apply_s": apply_s, "graphs": stats["graphs"],
                "graph_mem_mib": stats["graph_mem_mib"], "captured": stats["captured"],
                "drop_rate": snap["drop_rate"], "token_agreement_vs_eager": (res.tokens == ref.tokens).float().mean().item(),
                "floor_ms": floor_ms, "floor_ratio": p50 / floor_ms if floor_ms else None, "bandwidth_gbps": bw,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            cap.unwrap()
            detach(model)
            del cap, engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    eager = {(r["batch_size"]): r["ms_per_token_p50"] for r in rows if r["label"] == "eager"}

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"{args.preset}, {len(built.adapter.layers(model))} layers, {built.dtype}, {env_fields()['device_name']}, "
             f"prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.repeats} repeats, buckets {args.buckets}; "
             + (f"floor at {bw:.0f} GB/s ({bw_source})" if bw else "no floor (bandwidth unknown)"),
             "",
             "| strategy | dispatch | bs | ms/step p50 | p90 | vs eager | capture s (all buckets) | graph MiB | "
             "floor ms | x floor | drop rate | token agreement |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = eager.get(r["batch_size"])
        lines.append(f"| {r['label']} | {r['dispatch']} | {r['batch_size']} | {r['ms_per_token_p50']:.2f} | "
                     f"{r['ms_per_token_p90']:.2f} | {sp / r['ms_per_token_p50']:.2f}x | {r['capture_s']:.2f} | "
                     f"{r['graph_mem_mib']:.0f} | {fmt(r['floor_ms'], '.2f')} | {fmt(r['floor_ratio'], '.1f')} | "
                     f"{r['drop_rate']:.3f} | {r['token_agreement_vs_eager']:.3f} |" if sp else "")
    write_report("\n".join(lines), rows, args, args.out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
