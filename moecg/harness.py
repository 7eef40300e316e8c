"""The one measurement harness: a resolved run plan -> a results record (`moecg.schema`).

Dims: B rows, V vocab, R expert-parallel ranks. The same order of work for every strategy, so numbers compare, each a
phase the user sees:
  plan (validate everything, no CUDA work) -> parallel (process groups) -> build -> reference (dropless eager: tokens
  and logits) -> baseline (eager with the run's dispatch, timed) -> capture -> timed repeats (counters from the
  first) -> fidelity -> floor (one counted step) -> quality (byte-level models) -> the record.
A serving workload (workload=poisson | trace) runs on moecg.ragged.RaggedEngine instead (one process):
  plan -> build -> reference (the first measure.fidelity_rows requests, each decoded alone, dropless eager)
  -> anchor (transformers' continuous batching, workload.anchor) -> capture -> warm (one request) -> serve (the
  requests in real time, moecg.serving) -> quality -> the record.

With R ranks (moecg.parallel) every rank runs this same sequence on its own B rows, with its E/R experts and the
expert-parallel variant of each dispatcher, so every all-to-all has its partner on every rank. The record is the
job's: counters summed over ranks, step times the slowest rank's, fidelity over every rank's rows. One rank (an
`EPGroup()` of size 1) goes through the same calls, each of them the identity.
"""
from __future__ import annotations

import resource
import statistics
import sys
import time
import warnings
from contextlib import contextmanager

import torch

from moecg.anchor import serve_hf, token_agreement
from moecg.capture import Capture
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import DecodeEngine
from moecg.fidelity import agreement, logit_agreement
from moecg.floor import exchange_floor_ms, kv_bytes_per_token, step_floor_ms
from moecg.models import build_model
from moecg.models.weights import weight_bytes
from moecg.parallel import EPGroup, parallelize, shard_experts
from moecg.plan import RunPlan, resolve_plan
from moecg.quality import heldout_bpb
from moecg.ragged import RaggedEngine
from moecg.report import env_fields, percentile
from moecg.schema import NAMES, PERCENTILES, SERVING, ok_record
from moecg.serving import decode_alone, request_metrics, serve, step_metrics, warm

NOISY_SPREAD = 1.5  # p90/p50 above this: the steps were not steady (a busy machine, or a coarse clock)


class Phases:
    """One line per phase (`moecg: [phase] ...`) with its wall time, so a long run is never silent. A failure is
    tagged with the phase it happened in (`exc.moecg_phase`) for the failed record."""

    def __init__(self, out=None):
        self.out = out if out is not None else sys.stdout

    def say(self, msg: str) -> None:
        print(f"moecg: {msg}", file=self.out, flush=True)

    @contextmanager
    def __call__(self, name: str, what: str):
        self.say(f"[{name}] {what} ...")
        t0 = time.perf_counter()
        try:
            yield
        except BaseException as e:
            if not hasattr(e, "moecg_phase"):
                e.moecg_phase = name
            raise
        self.say(f"[{name}] done in {time.perf_counter() - t0:.1f} s")


def _timed_generate(engine, plan: RunPlan, phases: Phases | None = None, progress=None, steps_left: int = 0,
                    group: EPGroup | None = None):
    """One untimed warm call, then `repeats` timed calls; returns (per-step ms pooled, first (result, counters)).

    group: step times are the slowest rank's, counters the sum over ranks."""
    group = group or EPGroup()
    m = plan.measure
    t0 = time.perf_counter()
    engine.generate(plan.prompts, plan.new_tokens, timing=False)
    if phases is not None and steps_left:
        per = (time.perf_counter() - t0) / max(plan.new_tokens - 1, 1)
        phases.say(f"estimate: ~{per * steps_left:.0f} s for the remaining ~{steps_left} decode steps "
                   f"({per * 1e3:.1f} ms per step, warm call)")
    state = state_of(engine.model)
    steps, first = [], None
    for r in range(m.repeats):
        if r == 0:
            state.reset()
        res = engine.generate(plan.prompts, plan.new_tokens, progress=progress, count_prefill=False)
        if group.size > 1:
            res.step_ms, res.prefill_ms = group.max_each(res.step_ms), group.max(res.prefill_ms)
        if r == 0:
            first = (res, state.snapshot(reduce=group.sum_ if group.size > 1 else None))
        steps += res.step_ms[m.skip_steps:]
    return steps, first


def _spread(steps) -> float | None:
    if not steps:
        return None
    p50 = statistics.median(steps)
    return percentile(steps, 0.9) / p50 if p50 > 0 else None


def run_experiment(cfg_or_plan, progress=None, phases: Phases | None = None, group: EPGroup | None = None) -> dict:
    """Run one configuration end to end; returns the flat results record (see README 'Results schema').

    group: this rank's expert-parallel group (moecg.parallel.init_group) when the plan has parallel.ep > 1."""
    phases = phases or Phases()
    plan = plan_of(cfg_or_plan, phases)
    phases.say(f"plan: {plan.describe()}")
    group = group or EPGroup(device=plan.device)
    if group.size != plan.parallel.ep:
        raise ValueError(f"the plan has parallel.ep={plan.parallel.ep} but this process is one of {group.size} "
                         "expert-parallel ranks: pass moecg.parallel.init_group(...) of the plan's size")
    return _run(plan, progress, phases, group)


def plan_of(cfg_or_plan, phases: Phases) -> RunPlan:
    """The run plan, resolved (as phase `plan`) unless one is given: read nothing from a raw config before this."""
    if isinstance(cfg_or_plan, RunPlan):
        return cfg_or_plan
    with phases("plan", "resolving and validating the config (no CUDA work)"):
        return resolve_plan(cfg_or_plan)


def _build(plan: RunPlan, phases: Phases, group: EPGroup | None = None):
    mp = plan.model
    with phases("build", f"building {mp.preset or mp.pretrained_path} ({mp.layers} layers) on {plan.device.type}"):
        built = build_model(mp.preset, pretrained_path=mp.pretrained_path, num_layers=mp.num_layers,
                            dtype=mp.dtype, device=str(plan.device), seed=plan.seed, router_skew=mp.router_skew,
                            attn_implementation=mp.attn_implementation, weights=mp.weights,
                            activations=mp.activations)
        span = shard_experts(built.model, group) if group is not None else None  # the same seed on every rank
        if span is not None:
            phases.say(f"rank {group.rank} of {group.size} holds experts {span[0]}..{span[1] - 1}")
        return built


def _capture_kwargs(plan: RunPlan) -> dict:
    """Capture's keyword arguments from the plan's capture group (pdl None: auto)."""
    c = plan.capture
    return {"buckets": c.buckets, "backend": c.backend, "warmup": c.warmup, "compile": c.compile,
              "compile_mode": c.compile_mode, "kernels": c.kernels, "kernel_backend": c.kernel_backend,
            "pdl": c.pdl, "preload": c.preload, "overlap_shared": c.overlap_shared, "fuse_router": c.fuse_router,
            "precompile": c.precompile}


def _capture(engine, plan: RunPlan, rows: int, phases: Phases) -> Capture:
    with phases("capture", f"strategy={plan.strategy.name}"
                + (f", buckets {[b for b in plan.capture.buckets if b <= rows]}" if plan.captures else " (no graphs)")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cap = Capture(engine, plan.strategy.name, layers=plan.strategy_layers, **_capture_kwargs(plan)).apply()
        for w in caught:
            phases.say(f"warning: {w.message}")
    return cap


def _identity(plan: RunPlan, built, state, stats: dict, group: EPGroup) -> dict:
    """What ran and how: the fields every record opens with, fixed or serving."""
    model, d = built.model, plan.dispatcher.describe()
    return {
        "model": built.name, "family": built.family, "num_layers": len(built.adapter.layers(model)),
        "num_experts": state.num_experts, "top_k": built.adapter.top_k(model.config),
        "dtype": str(built.dtype).replace("torch.", ""), "weights": built.weights,
        "activations": built.activations, "weight_bytes": weight_bytes(model), "device": built.device.type,
        "attn_implementation": model.config._attn_implementation,
        "strategy": plan.strategy.name, "strategy_layers": plan.strategy_layers,
        "dispatch": d["dispatch"], "capacity_factor": d["capacity_factor"], "drop_policy": d["drop_policy"],
        "prefill_dispatch": plan.prefill_dispatcher.name if plan.prefill_dispatcher else d["dispatch"],
        "router_skew": plan.model.router_skew, "kernels": stats["kernels"], "kernel_backend": stats["kernel_backend"],
        "ep": group.size, "ep_backend": group.backend if group.size > 1 else None,
    }


def _capture_fields(plan: RunPlan, stats: dict) -> dict:
    return {"captured": stats["captured"], "capture_backend": stats["capture_backend"], "compiled": stats["compiled"],
            "capture_s": stats["capture_s"], "graph_mem_mib": stats["graph_mem_mib"], "graphs": stats["graphs"],
            "warmup": stats["warmup"],
            "capture_buckets": {str(k): v for k, v in stats["buckets"].items()}, **plan.capture.record()}


def _memory_fields(plan: RunPlan, built, group: EPGroup) -> dict:
    cuda = built.device.type == "cuda"
    return {"peak_mem_mib": group.max((torch.cuda.max_memory_allocated(built.device) if cuda else
                                       resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**20),
            "peak_mem_kind": "cuda_allocated" if cuda else "process_rss",
            "memory_estimate_mib": plan.memory_bytes / 2**20, "build_s": built.build_s}


def _drop_fields(drops: dict) -> dict:
    keys = ("drop_rate", "dropped_prob_mass", "tokens_lost_all_rate", "per_layer_drop_rate", "per_expert_drop_rate",
            "routed_assignments", "dropped_assignments", "expert_load_imbalance", "per_layer_load_imbalance")
    return {k: drops[k] for k in keys}


def _run(plan: RunPlan, progress, phases: Phases, group: EPGroup) -> dict:
    if plan.serving:  # one process (the plan refuses serving with parallel.ep > 1)
        return _serve(plan, progress, phases, group)
    m = plan.measure
    # every dispatcher this run attaches, as its expert-parallel variant over `group` (itself on one rank)
    par = lambda d: parallelize(d, group)  # noqa: E731
    dispatcher = par(plan.dispatcher)
    built = _build(plan, phases, group)
    model, dev = built.model, built.device
    prompts, B, rows = plan.prompts, plan.batch_size, plan.max_rows
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    per_pass = max(plan.new_tokens - 1, 1)
    left = plan.decode_steps

    ref = None
    keep = m.fidelity_rows
    if m.fidelity:
        with phases("reference", "dropless eager decode (the fidelity reference)"):
            attach(model, par(make_dispatcher("dropless")), max_rows=rows)
            ref = DecodeEngine(model, plan.max_cache_len, rows, plan.prefill_chunk).generate(
                prompts, plan.new_tokens, keep_logits=keep, timing=False)
            detach(model)
            left -= per_pass
    attach(model, dispatcher, max_rows=rows).prefill_dispatcher = par(plan.prefill_dispatcher)
    engine = DecodeEngine(model, plan.max_cache_len, rows, plan.prefill_chunk)
    eager_steps = None
    if plan.needs_baseline:
        with phases("baseline", f"strategy=eager with dispatch={dispatcher.name}, {m.repeats} timed repeats"):
            eager_steps, _ = _timed_generate(engine, plan, phases, steps_left=left - per_pass, group=group)
            left -= (m.repeats + 1) * per_pass

    cap = _capture(engine, plan, rows, phases)
    with phases("timed", f"{m.repeats} timed repeats of {plan.new_tokens} tokens x {B} rows"):
        steps, (first_res, drops) = _timed_generate(engine, plan, phases if eager_steps is None else None,
                                                    progress, steps_left=left - per_pass, group=group)
    res = forced = None
    if ref is not None:
        with phases("fidelity", "greedy and teacher-forced decode vs the reference"):
            res = engine.generate(prompts, plan.new_tokens, keep_logits=keep, timing=False)
            forced = engine.generate(prompts, plan.new_tokens, timing=False, force_tokens=ref.tokens)

    state = state_of(model)
    with phases("floor", "HBM floor from one counted step"):
        floor_ms = step_floor_ms(engine, built.adapter, prompts, m.hbm_bandwidth_gbps,
                                 plan.prompt_len + plan.new_tokens // 2, dispatcher.reads_all_experts, group)
        xfloor_ms = exchange_floor_ms(dispatcher, model, built.adapter, engine.rows_for(B), m.nvlink_bandwidth_gbps)
        if floor_ms is not None and xfloor_ms is not None:
            floor_ms += xfloor_ms
    stats = cap.stats()
    p50 = statistics.median(steps) if steps else float("nan")
    # no graphs and HF's modules: the run executed the baseline's own code path, a ratio would only measure noise
    same_path = not stats["captured"] and plan.capture.kernels == "hf" and not plan.capture.compile
    eager_p50 = statistics.median(eager_steps) if eager_steps else (p50 if same_path else None)
    spreads = [s for s in (_spread(steps), _spread(eager_steps)) if s is not None]
    spread = max(spreads) if spreads else None
    rows_run = engine.rows_for(B)
    if dispatcher.drops:
        cap_used = drops["capacity_used"]
        cap_buffer = dispatcher.capacity_for(rows_run, built.adapter.top_k(model.config), state.num_experts)
    else:
        cap_used = cap_buffer = None

    out: dict = {
        **_identity(plan, built, state, stats, group), "workload": "fixed",
        "batch_size": B, "bucket": rows_run if stats["captured"] else None,
        "prompt_len": plan.prompt_len, "new_tokens": plan.new_tokens, "max_cache_len": plan.max_cache_len,
        "prefill_chunk": plan.prefill_chunk, "seed": plan.seed, "prompts": plan.prompts_kind, "capacity": cap_used,
        "capacity_buffer": cap_buffer,
        **_capture_fields(plan, stats),
        "ms_per_token_p50": p50, "ms_per_token_p90": percentile(steps, 0.9),
        "latency_spread": spread, "latency_noisy": bool(spread is not None and spread > NOISY_SPREAD),
        "tokens_per_s": B * group.size * 1e3 / p50 if p50 == p50 and p50 > 0 else None,
        "step_ms": first_res.step_ms, "prefill_ms": first_res.prefill_ms,
        "eager_ms_per_token_p50": eager_p50,
        "speedup_vs_eager": None if same_path or not eager_p50 or not p50 > 0 else eager_p50 / p50,
        **_memory_fields(plan, built, group),
        "floor_ms": floor_ms, "floor_ratio": p50 / floor_ms if floor_ms else None,
        "kv_bytes_per_token": kv_bytes_per_token(model, built.adapter),
        "hbm_bandwidth_gbps": m.hbm_bandwidth_gbps, "bandwidth_source": m.bandwidth_source,
        "exchange_floor_ms": xfloor_ms, "nvlink_bandwidth_gbps": m.nvlink_bandwidth_gbps if group.size > 1 else None,
        **_drop_fields(drops),
        "token_agreement_vs_eager": None, "max_logit_diff_vs_eager": None, "token_agreement_forced_vs_eager": None,
        **{n: None for n in SERVING},
    }
    if out["latency_noisy"]:
        phases.say(f"warning: latency p90/p50 = {spread:.2f}: the steps were not steady (busy machine?); "
                   "re-run before quoting ms_per_token")
    if ref is not None:
        agree, diff = logit_agreement(ref, res, keep)
        # every rank has B rows and as many steps: the mean of the ranks' rates is the job's rate
        out["token_agreement_vs_eager"], out["max_logit_diff_vs_eager"] = group.mean(agree), group.max(diff)
        # teacher-forced: every step gets eager's tokens as input, so one early flip does not fail every later one
        out["token_agreement_forced_vs_eager"] = group.mean(agreement(ref.tokens, res.tokens, forced.tokens)[1])
    if m.heldout_bpb:
        with phases("quality", f"held-out bits per byte ({m.heldout_bytes} bytes), this dispatch and dropless"):
            out.update(_quality(m.heldout_bytes, model, dispatcher, par))
    else:
        out.update(heldout_bpb=None, heldout_bpb_delta_vs_dropless=None)
    out.update(env_fields())
    out["status"], out["config"] = "ok", None
    cap.unwrap()
    detach(model)
    return ok_record(out)


def _serve(plan: RunPlan, progress, phases: Phases, group: EPGroup) -> dict:
    """A serving workload on RaggedEngine (module docstring): one pass over the requests, in real time."""

    m, wl, dispatcher = plan.measure, plan.workload, plan.dispatcher
    reqs, prompts = list(wl.requests), list(wl.prompts)
    built = _build(plan, phases)
    model, dev = built.model, built.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    alone = None
    if m.fidelity and m.fidelity_rows:
        k = min(m.fidelity_rows, len(reqs))
        with phases("reference", f"the first {k} requests decoded alone (dropless eager, one row each)"):
            attach(model, make_dispatcher("dropless"), max_rows=1)
            alone = decode_alone(model, reqs[:k], prompts[:k], plan.max_cache_len)
            detach(model)
    hf = None
    if wl.anchor:
        with phases("anchor", f"transformers' continuous batching, {len(reqs)} requests in real time"):
            hf = serve_hf(model, reqs, prompts, wl.max_batch, plan.max_cache_len)
    state = attach(model, dispatcher, max_rows=plan.max_rows)
    state.prefill_dispatcher = plan.prefill_dispatcher
    engine = RaggedEngine(model, plan.max_cache_len, plan.max_rows)
    cap = _capture(engine, plan, plan.max_rows, phases)
    with phases("warm", "one request in and out before timing"):
        warm(engine, prompts[0])
    state.reset()
    with phases("serve", wl.describe()):
        tl = serve(engine, reqs, prompts, wl.max_batch, prefill_tokens=wl.prefill_tokens, progress=progress)
    drops = state.snapshot()
    stats = cap.stats()
    out: dict = {n: None for n in NAMES}
    out.update(_identity(plan, built, state, stats, group))
    out.update(workload=wl.name, workload_rate=wl.rate, workload_file=wl.file, max_batch=wl.max_batch,
               max_cache_len=plan.max_cache_len, seed=plan.seed, prompts=plan.prompts_kind,
               capacity=drops["capacity_used"] if dispatcher.drops else None, **_capture_fields(plan, stats),
               **_memory_fields(plan, built, group),
               kv_bytes_per_token=kv_bytes_per_token(model, built.adapter),
               hbm_bandwidth_gbps=m.hbm_bandwidth_gbps, bandwidth_source=m.bandwidth_source, **_drop_fields(drops))
    out.update(request_metrics(tl.requests))
    out.update(step_metrics(tl.steps, tl.prefills, tl.drops_by_batch))
    spread = out["latency_spread"]
    out["latency_noisy"] = bool(spread is not None and spread > NOISY_SPREAD)
    if out["latency_noisy"]:
        phases.say(f"warning: p90/p50 = {spread:.2f} over decode steps of equal rows: the steps were not steady (busy "
                   "machine?); re-run before quoting output_tokens_per_s and the latencies")
    if alone is not None:
        out["token_agreement_vs_eager"] = token_agreement(alone, tl.tokens)
    if hf is not None:
        a = request_metrics(hf["times"])
        out.update({f"anchor_{k}": a[k] for k in ("output_tokens_per_s", "serving_s", *(
            f"{x}_p{p}" for x in ("ttft_ms", "tpot_ms", "e2e_ms") for p in PERCENTILES))})
        out.update(anchor_token_agreement=token_agreement(hf["tokens"], tl.tokens),
                   anchor_cuda_graphs=list(hf["cuda_graphs"]), anchor_attn_implementation=hf["attn_implementation"])
    if m.heldout_bpb:
        with phases("quality", f"held-out bits per byte ({m.heldout_bytes} bytes), this dispatch and dropless"):
            out.update(_quality(m.heldout_bytes, model, dispatcher))
    out.update(env_fields())
    out["status"], out["config"] = "ok", None
    cap.unwrap()
    detach(model)
    # gpu_idle_share on CPU: perf_counter gaps between steps, i.e. the host's own scheduling time, no GPU involved
    idle = "GPU idle" if dev.type == "cuda" else "host time between steps"
    phases.say(f"served {out['n_requests']} requests: {out['output_tokens_per_s']:.1f} output tokens/s, p90 TPOT "
               f"{_ms(out['tpot_ms_p90'])}, {idle} {_pct(out['gpu_idle_share'])}"
               + (f"; transformers' continuous batching {out['anchor_output_tokens_per_s']:.1f} tokens/s, p90 TPOT "
                  f"{_ms(out['anchor_tpot_ms_p90'])}" if hf is not None else ""))
    return ok_record(out)


def _ms(x) -> str:
    return "n/a" if x is None else f"{x:.2f} ms"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _quality(n: int, model, dispatcher, par=lambda d: d) -> dict:
    """Held-out bits-per-byte under the run's dispatch and its delta vs dropless (byte-level models only).

    With expert parallelism every rank scores the same windows (so the all-to-alls pair up) and gets the same number."""

    state_of(model).n_rows = None  # teacher-forced windows: every row is real
    bpb = heldout_bpb(model, max_bytes=n)
    detach(model)
    attach(model, par(make_dispatcher("dropless")))
    base = heldout_bpb(model, max_bytes=n)
    detach(model)
    attach(model, dispatcher)
    return {"heldout_bpb": bpb, "heldout_bpb_delta_vs_dropless": bpb - base}
