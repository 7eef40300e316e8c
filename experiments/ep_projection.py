"""What expert parallelism would buy, projected from one GPU: one rank of an EP-R job measured, its exchange modelled.

  python experiments/ep_projection.py --preset qwen3_30b_a3b --ranks 1 2 4 8 --batch 1 8 \\
      --out $D/qwen3_30b_a3b.md --json $D/qwen3_30b_a3b.json     # D=experiments/results/ep_projection
  (or: bash experiments/gpu.sh ep_projection, the three shapes)
  python experiments/ep_projection.py --md experiments/results/ep_projection/*.json      # one table from the records
  python experiments/ep_projection.py --preset mixtral_8x7b --measured ...  # >= 8 GPUs: the torchrun jobs beside it
  python experiments/ep_projection.py --preset mixtral_tiny --ranks 1 2 --batch 2 --hbm-gbps 100   # CPU smoke

Dims: R ranks, B rows per rank (the job decodes R x B), E experts, El = E/R, K top-k, C capacity, D hidden,
Sm = B*min(K, El), L MoE layers.

The rank, measured. Every rank of an EP-R job runs attention and the dense layers for its own B rows and its El experts
on the rows the all-to-alls deliver; this script builds exactly that rank on one GPU with moecg.parallel's own code:
the whole model from the seed, `shard_experts` over a stand-in group of size R (the rank keeps experts
[rank*El, (rank+1)*El)), `parallelize` for the EP dispatcher (R = 1: today's dispatcher, as `parallel.ep=1`), the
engine and the capture strategy a `moecg.run parallel.ep=R` rank runs (`dropless` in `full`, `capacity` in
`capacity`, the `ep` suite's pair). Only the network is replaced: `StandInExchange.all_to_all` hands back the same
buffer rolled by the rank, recv[j] = x[(rank + j) % R], i.e. source j is this rank's own batch with its expert ids
shifted by j*El. So the receive buffers have a real rank's shapes (capacity: [R, El, C, D]; dropless: the worst-case
[R, Sm, D] and the [R, El] counts, on the device), and the rank computes exactly its own batch's B*K assignments
spread over its El experts as the batch spreads them over the R slices: the mean load of a real rank, with the experts
hit by R batches rather than one. The returned expert outputs are this rank's, not the owners' (tokens are
meaningless; only time is read). The roll is one copy of each buffer per collective, in place of the copy NCCL makes
of a rank's own block. Not modelled: the slowest rank's wait (a real step ends when its slowest rank does).

The exchange, modelled (per step, per rank, one MoE layer after another, no overlap in moecg today):
  exchange ms = bytes / bandwidth + collectives x latency
  bytes       = the dispatcher's `exchange_bytes` (its static buffers to the other ranks, there and back; the function
                behind `exchange_floor_ms`) x L; collectives = the all-to-alls one eager decode step ran (counted)
  bandwidth   = NVLINK_EFFECTIVE_GBPS, latency = A2A_LATENCY_US (below, with their sources; --nvlink-gbps, --latency-us)
  overlap     = a separate column, exchange hidden behind compute by the fraction --overlap (default 1: the bound
                max(rank, exchange) that a two-batch overlap could at best reach; moecg does not overlap today)
  floor       = the rank's HBM floor (moecg.floor.step_floor_ms over the stand-in group: its own weights, its experts
                that the R batches hit, its KV) + the exchange at NVLink line rate (`exchange_floor_ms`, moecg.floor's
                450 GB/s), as the `floor_ms` of a real EP job's record; floor ratio = projected ms / floor.
Timing: one warm generate, then the decode steps of one generate after --skip (CUDA events; perf_counter on CPU);
the median. On CPU the graphs are emulated and the times measure nothing worth quoting: the CPU run checks the
script.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import DecodeEngine
from moecg.floor import NVLINK_BANDWIDTH_GBPS, device_bandwidth_gbps, exchange_floor_ms, step_floor_ms
from moecg.models import build_model, resolve_device
from moecg.parallel import EPGroup, parallelize, shard_experts
from moecg.report import env_fields, write_json

# NCCL's effective NVLink 4 bandwidth per GPU and direction (GB/s): "450GB/s is the line rate. With the protocol
# overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s, which you can observe as BusBw when running
# non-allreduce operations" (NCCL maintainer, 8x H100, https://github.com/NVIDIA/nccl-tests/issues/212). The H200 SXM
# has the same 18 NVLink 4 links (moecg.floor's 450 GB/s line rate is the floor's).
NVLINK_EFFECTIVE_GBPS = 370.0
# One NCCL all-to-all of a small buffer on 8 GPUs over NVLink (us): pplx-kernels' README, "Torch AtA", EP8, 1 token per
# GPU: 24.4 us +- 16.3 us, i.e. torch.distributed.all_to_all_single of a [8, 32, 7392 B] buffer (1.9 MB) timed by CUDA
# events (tests/bench_all_to_all.py), measured on H100 nodes (https://github.com/perplexityai/pplx-kernels, README;
# hardware: https://github.com/perplexityai/pplx-kernels/issues/10). An upper estimate of the latency: it includes
# that buffer's own ~4 us at 370 GB/s; the same figure is used for 2 and 4 ranks (no smaller-group number published).
A2A_LATENCY_US = 24.4
SOURCES = {
    "nvlink_gbps": "https://github.com/NVIDIA/nccl-tests/issues/212 (NCCL's effective NVLink 4 bandwidth, 8x H100)",
    "latency_us": "https://github.com/perplexityai/pplx-kernels README, Torch AtA EP8 1 tok/GPU (H100: issues/10)",
}
CASES = [("dropless", "full"), ("capacity", "capacity")]  # (dispatch, strategy): the `ep` suite's pair


@dataclass
class StandInExchange(EPGroup):
    """Rank `rank` of `size` with the network replaced (module docstring): every all-to-all returns the buffer rolled
    by the rank, every other collective is this rank's own value (sums: the R rolled batches)."""

    num_experts: int = 0

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, ...] -> [R, ...], block j = x[(rank + j) % R]: what source j would send if its batch were this rank's
        with expert ids shifted by j*El."""
        return x if self.size == 1 else torch.roll(x, -self.rank, dims=0)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Counters summed over the R stand-in sources: [L, E] per-expert ones rolled as the batches are."""
        if self.size == 1:
            return t
        if t.dim() == 2 and t.shape[-1] == self.num_experts:
            El = self.num_experts // self.size
            t.copy_(sum(torch.roll(t, -j * El, dims=-1) for j in range(self.size)))
        else:
            t.mul_(self.size)
        return t

    def _reduce(self, values, op):
        return values  # max / mean over identical stand-ins

    def broadcast(self, obj, src: int = 0):
        return obj

    def close(self) -> None:
        pass


@dataclass
class CountingExchange:
    """Wraps an exchange for one eager step: the shapes of the buffers each all-to-all sends."""

    inner: object
    shapes: list = field(default_factory=list)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_to_all(self, x):
        self.shapes.append(list(x.shape))
        return self.inner.all_to_all(x)


# -- one rank, built and run as a real rank is ----------------------------------------------------------------------
def build_rank(preset, layers, R, rank, dtype="auto", device="auto", seed=0):
    """(built model with rank `rank`'s El experts, its StandInExchange): build_model + moecg.parallel.shard_experts."""
    built = build_model(preset, num_layers=layers, dtype=dtype, device=device, seed=seed)
    E = built.adapter.num_experts(built.model.config)
    if E % R:
        raise SystemExit(f"--ranks {R} does not divide {preset}'s {E} experts: choose divisors of {E}")
    group = StandInExchange(size=R, rank=rank, device=built.device, num_experts=E)
    shard_experts(built.model, group)
    return built, group


def rank_prompts(vocab, R, B, rank, prompt_len, seed=0):
    """Rank `rank`'s B rows of the R*B prompts a job makes (rows rank*B..(rank+1)*B-1, as moecg.plan gives them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (R * B, prompt_len), generator=g)[rank * B:(rank + 1) * B]


def case_dispatcher(name, cf, exchange):
    """The dispatcher a `moecg.run parallel.ep=R dispatch=name` rank runs over `exchange` (itself when R = 1)."""
    return parallelize(make_dispatcher(name, **({"capacity_factor": cf} if name == "capacity" else {})), exchange)


def measure(model, adapter, disp, group, strategy, prompts, args, backend, hbm=None, nvl_line=None, keep=False):
    """One case on one rank: {ms (median step), captured, shapes (the buffers one eager step's all-to-alls send),
    floor_ms (rank HBM floor + exchange at line rate; None without hbm)}, plus `result` (the timed generate, logits
    kept) when keep. group: the floor's collectives (a real EPGroup or the stand-in)."""
    B = prompts.shape[0]
    attach(model, disp, max_rows=B)
    engine = DecodeEngine(model, args.prompt_len + args.new_tokens, B)
    cap = None
    try:
        shapes = []
        if getattr(disp, "exchanges", False):  # probe: one eager decode step with its all-to-alls counted
            engine.prefill(prompts)
            disp.exchange = probe = CountingExchange(disp.exchange)
            rows = engine.rows_for(B)
            state_of(model).set_rows(B, rows)
            engine.eager_step(engine.ids, rows)
            disp.exchange, shapes = probe.inner, probe.shapes
        cap = Capture(engine, strategy, buckets=[B], backend=backend if strategy != "eager" else "none",
                      warmup=args.warmup).apply()
        engine.generate(prompts, args.new_tokens, timing=False)
        res = engine.generate(prompts, args.new_tokens, keep_logits=keep)
        steps = group.max_each(res.step_ms)[args.skip:]
        floor = None
        if hbm is not None:
            floor = step_floor_ms(engine, adapter, prompts, hbm, args.prompt_len + args.new_tokens // 2,
                                  disp.reads_all_experts, group)
            if group.size > 1:
                floor += exchange_floor_ms(disp, model, adapter, engine.rows_for(B), nvl_line)
        out = {"ms": statistics.median(steps), "captured": cap.stats()["captured"], "shapes": shapes,
               "floor_ms": floor}
        return {**out, "result": res} if keep else out
    finally:
        if cap is not None:
            cap.unwrap()
        detach(model)


def project(rank_ms, bytes_, calls, R, B, floor_ms, nvl, lat_us, overlap) -> dict:
    """The projection of one measured rank step: exchange, step, rates, share, overlap column, floor ratio."""
    bw_ms = bytes_ / (nvl * 1e9) * 1e3
    lat_ms = calls * lat_us * 1e-3
    x = bw_ms + lat_ms
    step = rank_ms + x
    step_ov = max(rank_ms + (1 - overlap) * x, x)
    return {"exchange_bw_ms": bw_ms, "exchange_latency_ms": lat_ms, "exchange_ms": x, "step_ms": step,
            "tokens_per_s": R * B / step * 1e3, "tokens_per_s_per_gpu": B / step * 1e3,
            "exchange_share": x / step, "step_ms_overlap": step_ov, "tokens_per_s_overlap": R * B / step_ov * 1e3,
            "floor_ms": floor_ms, "floor_ratio": step / floor_ms if floor_ms else None}


# -- the run --------------------------------------------------------------------------------------------------------
def run_projection(args, save=None) -> list[dict]:
    """Every (R, B, case) record; save(records) after each R (a run cut short keeps what it measured)."""
    device = resolve_device(args.device)
    backend = "auto" if device.type == "cuda" else "emulate"
    hbm = args.hbm_gbps or device_bandwidth_gbps(device)[0]
    nvl_line = NVLINK_BANDWIDTH_GBPS["NVIDIA H200"]  # the floor's line rate: the target host is an H200 x8
    records = []
    for R in args.ranks:
        built, group = build_rank(args.preset, args.layers, R, args.rank % R, args.dtype, str(device), args.seed)
        model, adapter = built.model, built.adapter
        cfg = model.config
        E, K, L = adapter.num_experts(cfg), adapter.top_k(cfg), len(adapter.moe_layers(model))
        elem = next(model.parameters()).element_size()
        for B in args.batch:
            prompts = rank_prompts(cfg.vocab_size, R, B, group.rank, args.prompt_len, args.seed)
            for name, strategy in CASES:
                disp = case_dispatcher(name, args.cf, group)
                m = measure(model, adapter, disp, group, strategy, prompts, args, backend, hbm, nvl_line)
                per_layer = disp.exchange_bytes(B, K, E, cfg.hidden_size, elem) if R > 1 else 0
                rec = {"preset": args.preset, "layers": len(adapter.layers(model)), "moe_layers": L, "experts": E,
                       "top_k": K, "ranks": R, "rank": group.rank, "experts_per_rank": E // R, "batch_per_rank": B,
                       "dispatch": name, "strategy": strategy, "captured": m["captured"], "rank_ms": m["ms"],
                       "buffers": m["shapes"][: len(m["shapes"]) // max(L, 1)], "collectives": len(m["shapes"]),
                       "exchange_bytes": per_layer * L, "nvlink_gbps": args.nvlink_gbps,
                       "latency_us": args.latency_us, "overlap": args.overlap,
                       **project(m["ms"], per_layer * L, len(m["shapes"]), R, B, m["floor_ms"], args.nvlink_gbps,
                                 args.latency_us, args.overlap)}
                records.append(rec)
                print(f"ep_projection: {args.preset} R={R} B={B} {name}:{strategy} rank {m['ms']:.3f} ms + exchange "
                      f"{rec['exchange_ms']:.3f} ms ({rec['collectives']} all-to-alls, "
                      f"{rec['exchange_bytes'] / 1e6:.2f} MB) = {rec['step_ms']:.3f} ms/step", flush=True)
        if save is not None:
            save(records)
        del model, built, disp
        gc.collect()  # HF modules hold reference cycles: the next R's build needs this one's memory back
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def run_measured(args, records) -> None:
    """The real torchrun job of every record (the `ep` suite's moecg.run command), its record's times beside."""
    out = Path(args.measured_dir)
    for r in records:
        d = out / f"run_{r['preset']}_ep{r['ranks']}_{r['strategy']}_bs{r['batch_per_rank']}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={r['ranks']}",
               "-m", "moecg.run", f"parallel.ep={r['ranks']}", f"model={r['preset']}",
               *([f"model.num_layers={args.layers}"] if args.layers else []), f"strategy={r['strategy']}",
               f"dispatch={r['dispatch']}", *([f"dispatch.capacity_factor={args.cf}"] if r["dispatch"] == "capacity"
                                             else []),
               f"batch_size={r['batch_per_rank']}", f"new_tokens={args.new_tokens}", f"prompt_len={args.prompt_len}",
               "measure.repeats=3", "measure.eager_baseline=false", "hydra.output_subdir=null", f"hydra.run.dir={d}"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.measured_timeout)
        f = d / "results.json"
        res = json.loads(f.read_text()) if f.exists() else {"status": "failed", "error": p.stderr[-300:]}
        r["measured_status"] = res.get("status")
        r["measured_ms"] = res.get("ms_per_token_p50") if res.get("status") == "ok" else None
        r["measured_floor_ms"] = res.get("floor_ms")
        r["measured_vs_projected"] = r["measured_ms"] / r["step_ms"] if r["measured_ms"] else None
        print(f"ep_projection --measured: R={r['ranks']} B={r['batch_per_rank']} {r['dispatch']}: projected "
              f"{r['step_ms']:.3f} ms, measured {r['measured_ms']} ms ({res.get('status')})", flush=True)


def check_measured(ranks) -> None:
    """--measured runs EP-R as R processes with a GPU each: refuse before any work where fewer are visible."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < max(ranks):
        raise SystemExit(f"--measured runs EP-{max(ranks)} as a torchrun job of {max(ranks)} processes with one GPU "
                         f"each, but {n} GPU(s) are visible here: run it on a host with >= {max(ranks)} GPUs "
                         f"(nvidia-h200-x8), or pass --ranks up to {n}; without --measured the projection needs one "
                         "GPU")


# -- tables ------------------------------------------------------------------------------------------------------------
def table(records, assumptions) -> str:
    f = lambda v, p="{:.3f}": "-" if v is None else p.format(v)  # noqa: E731
    measured = any("measured_ms" in r for r in records)
    head = ["model", "layers", "R", "rows/rank", "dispatch", "strategy", "rank ms", "exchange MB", "all-to-alls",
            "exchange ms", "projected ms/step", "tok/s", "tok/s/GPU", "exchange share", "overlap ms", "floor ms",
            "/ floor"] + (["measured ms", "measured / projected"] if measured else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        row = [r["preset"], r["layers"], r["ranks"], r["batch_per_rank"], r["dispatch"], r["strategy"], f(r["rank_ms"]),
               f(r["exchange_bytes"] / 1e6, "{:.2f}"), r["collectives"], f(r["exchange_ms"]), f(r["step_ms"]),
               f(r["tokens_per_s"], "{:.0f}"), f(r["tokens_per_s_per_gpu"], "{:.0f}"),
               f(r["exchange_share"], "{:.0%}"), f(r["step_ms_overlap"]), f(r["floor_ms"]),
               f(r["floor_ratio"], "{:.2f}")]
        if measured:
            row += [f(r.get("measured_ms")), f(r.get("measured_vs_projected"), "{:.2f}")]
        lines.append("| " + " | ".join(map(str, row)) + " |")
    a = assumptions
    lines.append(f"\nExchange = bytes / {a['nvlink_gbps']:g} GB/s + all-to-alls x {a['latency_us']:g} us "
                 f"(bandwidth: {a['sources']['nvlink_gbps']}; latency: {a['sources']['latency_us']}); overlap ms: "
                 f"{a['overlap']:g} of the exchange hidden behind the rank's compute, at best max(rank, exchange); "
                 f"floor: rank HBM floor + exchange at {a['nvlink_line_gbps']:g} GB/s line rate. Per-rank step "
                 f"measured on {a['device_name']} (commit {a['git_sha']}).")
    return "\n".join(lines)


def md_from(paths) -> str:
    """One markdown table from records JSON files (the docs table: regenerate after a GPU run)."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    records = [r for d in docs for r in d["records"]]
    return table(records, docs[0]["assumptions"]) if docs else ""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="mixtral_tiny")
    ap.add_argument("--layers", type=int, default=None, help="cut the depth (model.num_layers)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8], help="EP sizes R to project")
    ap.add_argument("--rank", type=int, default=0, help="which rank of R to measure (mod R)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="rows per rank")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--skip", type=int, default=2, help="first decode steps left out")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cf", type=float, default=1.25, help="capacity factor of the capacity case")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hbm-gbps", type=float, default=None, help="HBM GB/s of the floor (default: moecg.floor's table)")
    ap.add_argument("--nvlink-gbps", type=float, default=NVLINK_EFFECTIVE_GBPS, help="exchange bandwidth, GB/s/dir")
    ap.add_argument("--latency-us", type=float, default=A2A_LATENCY_US, help="per all-to-all latency, us")
    ap.add_argument("--overlap", type=float, default=1.0, help="fraction of the exchange hidden (overlap column)")
    ap.add_argument("--measured", action="store_true", help="also run the real torchrun jobs (needs max(--ranks) GPUs)")
    ap.add_argument("--measured-dir", default="ep_projection_runs", help="--measured: the jobs' hydra.run.dir root")
    ap.add_argument("--measured-timeout", type=float, default=600)
    ap.add_argument("--md", nargs="+", metavar="JSON", help="print the table of these records files, run nothing")
    ap.add_argument("--out")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.md:
        print(md_from(args.md))
        return
    if not 0 <= args.overlap <= 1:
        raise SystemExit(f"--overlap {args.overlap}: a fraction in [0, 1]")
    if args.measured:
        check_measured(args.ranks)
    env = env_fields()
    assumptions = {"nvlink_gbps": args.nvlink_gbps, "latency_us": args.latency_us, "overlap": args.overlap,
                   "nvlink_line_gbps": NVLINK_BANDWIDTH_GBPS["NVIDIA H200"], "sources": SOURCES,
                   "device_name": env["device_name"], "git_sha": env["git_sha"]}

    def save(records) -> str:
        text = table(records, assumptions)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text + "\n")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            write_json(args.json, {"env": env, "args": vars(args), "assumptions": assumptions, "records": records},
                       indent=1)
        return text

    records = run_projection(args, save)
    if args.measured:
        run_measured(args, records)
    print(save(records))

if __name__ == "__main__":
    sys.exit(main())
