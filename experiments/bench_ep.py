"""ms per decode step with expert parallelism: moecg's graph-safe all-to-all dispatch against megatron-core's token
dispatchers on the same model, rows and ranks, per strategy, with the share of the step spent in the exchange.

  torchrun --nproc-per-node 8 experiments/bench_ep.py --preset mixtral_8x7b --batch 1 8 32 \\
      --out experiments/results/ep/bench_mixtral_8x7b_ep8.md --json experiments/results/ep/bench_mixtral_8x7b_ep8.json
  torchrun --nproc-per-node 2 experiments/bench_ep.py --preset mixtral_tiny --batch 2 --new-tokens 4   # CPU, gloo

Dims: R ranks, B rows per rank (the job decodes R x B), E experts, El = E/R.
Every rank builds the model from the same seed, keeps its El experts (moecg.parallel.shard_experts) and decodes B rows
of its own. Cases (dispatch x strategy): moecg `dropless` (eager, partial, layer, full) and `capacity` (eager,
partial, capacity), megatron-core's `megatron_alltoall` and `megatron_allgather` (eager, partial: they read split
sizes on the host, so no graph can hold them) and `megatron_alltoall_capacity` (drop-and-pad: eager, partial and, its
shapes being fixed, capacity; moecg.parallel.megatron).
Timing: one warm generate, then the decode steps of one generate after --skip, each the slowest rank's (CUDA events
on a GPU, perf_counter on CPU); the median. Exchange share: the same case with every exchange replaced by a local
copy of the same buffers (moecg: `LocalExchange`; megatron-core: its all_to_all / gather / reduce-scatter swapped for
local stand-ins of the same output size), share = 1 - t_local / t; the local run's tokens are wrong, only its time is
read. Floor: the slowest rank's HBM floor plus the static all-to-all bytes over NVLink (moecg.floor); for
megatron-core's dropless dispatchers the bytes depend on the routing (n/a).
megatron-core's dispatchers need CUDA (moecg.parallel.megatron says why): elsewhere their rows are skipped with that
reason. On CPU the graph strategies run on the emulated backend (re-executed, so they save nothing) and the times
measure gloo on shared cores: the CPU run checks that the script works, it measures nothing worth quoting.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher
from moecg.engine import DecodeEngine
from moecg.floor import device_bandwidth_gbps, device_nvlink_gbps, exchange_floor_ms, step_floor_ms
from moecg.models import build_model, resolve_device
from moecg.parallel import EPGroup, init_group, parallelize, shard_experts, torchrun_env
from moecg.report import env_fields, write_json

CASES = [  # dispatch, strategy
    ("dropless", "eager"), ("dropless", "partial"), ("dropless", "layer"), ("dropless", "full"),
    ("capacity", "eager"), ("capacity", "partial"), ("capacity", "capacity"),
    ("megatron_alltoall", "eager"), ("megatron_alltoall", "partial"),
    ("megatron_alltoall_capacity", "eager"), ("megatron_alltoall_capacity", "partial"),
    ("megatron_alltoall_capacity", "capacity"),
    ("megatron_allgather", "eager"), ("megatron_allgather", "partial"),
]
MEGATRON_NEEDS_CUDA = ("megatron-core's token dispatchers need CUDA (MoEAlltoAllTokenDispatcher makes a torch.cuda.Stream "
                       "when built; both allocate their all-to-all-v / all-gather outputs on torch.cuda.current_device())")


class LocalExchange:
    """The exchange's shape without the network: every all-to-all becomes a local copy of the same buffer."""

    def __init__(self, group: EPGroup):
        self.size, self.rank, self.group = group.size, group.rank, group

    def experts(self, num_experts):
        return self.group.experts(num_experts)

    def all_to_all(self, x):
        return x.clone()


@contextmanager
def megatron_local_collectives(size: int):
    """megatron-core's dispatcher collectives swapped for local stand-ins with the same output sizes."""
    from moecg.parallel.megatron import _megatron

    td = _megatron()[3]
    saved = {n: getattr(td, n) for n in ("all_to_all", "gather_from_sequence_parallel_region",
                                          "reduce_scatter_to_sequence_parallel_region")}

    def a2a(group, input_, output_split_sizes_=None, input_split_sizes=None):
        if output_split_sizes_ is None:
            return input_.clone()
        out = input_.new_zeros(int(sum(output_split_sizes_)), *input_.shape[1:])
        k = min(out.shape[0], input_.shape[0])
        out[:k] = input_[:k]
        return out

    def gather(input_, group=None, output_split_sizes=None, use_global_buffer=False):
        return input_.repeat(size, *([1] * (input_.dim() - 1)))

    def reduce_scatter(input_, group=None, input_split_sizes=None, use_global_buffer=False):
        return input_[: input_.shape[0] // size].clone()

    td.all_to_all, td.gather_from_sequence_parallel_region = a2a, gather
    td.reduce_scatter_to_sequence_parallel_region = reduce_scatter
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(td, n, f)


def make_case(name: str, cf: float, exchange):
    """The dispatcher of a case over `exchange` (the EP group, or LocalExchange for the exchange share)."""
    if name.startswith("megatron"):
        from moecg.parallel.megatron import MEGATRON

        kw = {"capacity_factor": cf} if name == "megatron_alltoall_capacity" else {}
        return MEGATRON[name](**kw).bind(exchange)
    return parallelize(make_dispatcher(name, **({"capacity_factor": cf} if name == "capacity" else {})), exchange)


def measure(model, disp, strategy, prompts, args, group, backend, floor=None):
    """(median decode-step ms, the slowest rank's; captured; floor(engine) or None), model left as it was."""
    B = prompts.shape[0]
    attach(model, disp, max_rows=B)
    engine = DecodeEngine(model, args.prompt_len + args.new_tokens, B)
    cap = Capture(engine, strategy, buckets=[B], backend=backend if strategy != "eager" else "none",
                  warmup=args.warmup).apply()
    try:
        engine.generate(prompts, args.new_tokens, timing=False)
        steps = group.max_each(engine.generate(prompts, args.new_tokens).step_ms)[args.skip:]
        return statistics.median(steps), cap.stats()["captured"], floor(engine, disp) if floor else None
    finally:
        cap.unwrap()
        detach(model)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="mixtral_tiny")
    ap.add_argument("--layers", type=int, default=None, help="cut the depth (model.num_layers)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="rows per rank")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--skip", type=int, default=2, help="first decode steps left out")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cf", type=float, default=1.25, help="capacity factor of the capacity cases")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--cases", nargs="*", default=None, help="dispatch:strategy pairs (default: all)")
    ap.add_argument("--no-share", action="store_true", help="skip the local-exchange runs (no exchange share)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hbm-gbps", type=float, default=None, help="HBM GB/s for the floor (default: moecg.floor's table)")
    ap.add_argument("--nvlink-gbps", type=float, default=None, help="NVLink GB/s per direction (default: the table)")
    ap.add_argument("--out")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    env = torchrun_env()
    if env is None:
        raise SystemExit("bench_ep.py runs under torchrun, one process per rank (megatron-core's groups come from it): "
                         "torchrun --nproc-per-node N experiments/bench_ep.py ... (N=1 included)")
    R = env["world_size"]
    device = resolve_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", env["local_rank"])
    group = init_group(R, "nccl" if device.type == "cuda" else "gloo", device, 600)
    say = (lambda *a: print(*a, flush=True)) if group.rank == 0 else (lambda *a: None)
    cases = CASES if args.cases is None else [tuple(c.split(":")) for c in args.cases]
    built = build_model(args.preset, num_layers=args.layers, dtype=args.dtype, device=str(device), seed=args.seed)
    model, adapter = built.model, built.adapter
    E = adapter.num_experts(model.config)
    if E % R:
        raise SystemExit(f"{R} ranks do not divide {args.preset}'s {E} experts: launch a divisor of {E} processes")
    shard_experts(model, group)
    backend = "auto" if device.type == "cuda" else "emulate"
    hbm = args.hbm_gbps or device_bandwidth_gbps(device)[0]
    nvl = args.nvlink_gbps or device_nvlink_gbps(device)[0]

    def floor(engine, disp):
        """The slowest rank's HBM floor, plus moecg's all-to-all bytes over NVLink (megatron-core's: n/a)."""
        if hbm is None:
            return None
        f = step_floor_ms(engine, adapter, engine_prompts[0], hbm, args.prompt_len + args.new_tokens // 2,
                          disp.reads_all_experts, group)
        if R == 1:
            return f
        x = exchange_floor_ms(disp, model, adapter, engine_prompts[0].shape[0], nvl)  # None: routing-dependent bytes
        return None if x is None else f + x

    rows, skipped, engine_prompts = [], set(), [None]
    for B in args.batch:
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, model.config.vocab_size, (R * B, args.prompt_len), generator=g)
        prompts = engine_prompts[0] = prompts[group.rank * B:(group.rank + 1) * B]
        for name, strategy in cases:
            if name.startswith("megatron") and device.type != "cuda":
                skipped.add(name)
                continue
            ms, captured, fl = measure(model, make_case(name, args.cf, group), strategy, prompts, args, group, backend,
                                       floor)
            share = None
            if not args.no_share and R > 1:
                with megatron_local_collectives(R) if name.startswith("megatron") else _null():
                    local = measure(model, make_case(name, args.cf, LocalExchange(group)), strategy, prompts, args,
                                    group, backend)[0]
                share = max(0.0, 1 - local / ms)
            rows.append({"preset": args.preset, "layers": len(adapter.layers(model)), "ranks": R, "batch_per_rank": B,
                         "dispatch": name, "strategy": strategy, "captured": captured, "ms_per_step": ms,
                         "exchange_share": share, "floor_ms": fl, "floor_ratio": ms / fl if fl else None})
            say(f"bench_ep: {name:27s} {strategy:8s} B={B:<3d} R={R} {ms:8.3f} ms/step"
                + (f", exchange {share:.0%}" if share is not None else ""))
    for name in sorted(skipped):
        say(f"bench_ep: {name} skipped on {device.type}: {MEGATRON_NEEDS_CUDA}")
    if group.rank == 0:
        table = _table(rows, skipped, device)
        print(table)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(table + "\n")
        if args.json:
            write_json(args.json, {"env": env_fields(), "args": vars(args), "ranks": R,
                                   "skipped": {n: MEGATRON_NEEDS_CUDA for n in sorted(skipped)}, "rows": rows})
    group.close()


@contextmanager
def _null():
    yield


def _table(rows, skipped, device) -> str:
    head = ("| preset | layers | ranks | rows/rank | dispatch | strategy | captured | ms/step | exchange share | "
            "floor ms | / floor |")
    lines = [head, "|" + "---|" * 11]
    f = lambda v, p="{:.3f}": "-" if v is None else p.format(v)  # noqa: E731
    for r in rows:
        lines.append(f"| {r['preset']} | {r['layers']} | {r['ranks']} | {r['batch_per_rank']} | {r['dispatch']} | "
                     f"{r['strategy']} | {r['captured']} | {f(r['ms_per_step'])} | {f(r['exchange_share'], '{:.0%}')} | "
                     f"{f(r['floor_ms'])} | {f(r['floor_ratio'], '{:.2f}')} |")
    if skipped:
        lines.append(f"\nSkipped on {device.type}: {', '.join(sorted(skipped))}: {MEGATRON_NEEDS_CUDA}.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
