"""One measurement harness for every strategy: latency, drops, fidelity, HBM floor -> a flat results dict.

Dims: B rows, V vocab, D hidden, I expert intermediate, E experts, L layers.
Order of work in `run_experiment` (the same for every strategy, so numbers compare):
  validate everything (no CUDA work yet) -> build model -> reference (dropless eager: tokens and logits)
  -> eager baseline with the run's dispatch (timed) -> apply the strategy (capture) -> timed repeats
  -> counters from the first timed repeat -> HBM floor from one counted step -> results.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import warnings
from pathlib import Path

import torch

from moecg.capture import Capture, bucket_for, validate, validate_buckets
from moecg.dispatch import attach, detach, make_dispatcher, state_of
from moecg.engine import DecodeEngine
from moecg.models import build_model


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def make_prompts(cfg, vocab: int) -> torch.Tensor:
    B, S = cfg.batch_size, cfg.prompt_len
    kind = cfg.get("prompts", "random")
    if kind == "random":
        g = torch.Generator().manual_seed(int(cfg.seed))
        return torch.randint(0, vocab, (B, S), generator=g)  # [B, S]
    if kind == "file":
        if not cfg.get("prompt_file"):
            raise ValueError("prompts=file needs prompt_file=/path (one line of space-separated token ids per row)")
        rows = [[int(t) for t in line.split()] for line in Path(cfg.prompt_file).read_text().splitlines() if line.strip()]
        if len(rows) < B or any(len(r) < S for r in rows[:B]):
            raise ValueError(f"prompt_file {cfg.prompt_file}: need {B} rows of at least prompt_len={S} token ids")
        ids = torch.tensor([r[:S] for r in rows[:B]])
        if ids.max() >= vocab or ids.min() < 0:
            raise ValueError(f"prompt_file {cfg.prompt_file}: token ids must lie in [0, {vocab})")
        return ids
    if kind == "heldout":
        from moecg.quality import heldout_prompts

        return heldout_prompts(B, S, int(cfg.seed))
    raise ValueError(f"prompts={kind!r}: choose random, heldout or file")


def env_fields() -> dict:
    import transformers

    import moecg

    # MOECG_GIT_SHA names the commit where the tree has no .git (e.g. a copy shipped to a GPU machine)
    sha = os.environ.get("MOECG_GIT_SHA")
    if not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
        except Exception:  # noqa: BLE001 - no git is fine
            sha = None
    return {
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "moecg_version": moecg.__version__, "git_sha": sha,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def dispatcher_from_cfg(d) -> object:
    kwargs = {k: v for k, v in dict(d).items() if k not in ("name", "prefill")}
    return make_dispatcher(d.name, **kwargs)


def prefill_dispatcher_from_cfg(d):
    """dispatch.prefill: `same` (default) or another dispatcher's name for the eager prefill."""
    from moecg.dispatch import REGISTRY

    name = d.get("prefill", "same") or "same"
    if name != "same" and name not in REGISTRY:
        raise ValueError(f"dispatch.prefill={name!r}: choose same or one of {sorted(REGISTRY)}")
    return None if name == "same" or name == d.name else make_dispatcher(name)


# -- HBM floor --------------------------------------------------------------------------------------------
def floor_bytes(model, adapter, experts_hit: list[int], rows: int, context: int) -> float:
    """Bytes one decode step must read: non-expert weights, the experts actually hit, and the live KV."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name or "embed_tokens" in name:
            continue
        total += p.numel() * p.element_size()
    total += rows * cfg.hidden_size * next(model.parameters()).element_size()  # embedding rows
    moe = adapter.moe_layers(model)
    for (_, experts), hit in zip(moe, experts_hit):
        per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * experts.gate_up_proj.element_size()
        total += hit * per_expert
    heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = next(model.parameters()).element_size()
    total += 2 * len(adapter.layers(model)) * rows * heads * head_dim * context * kv_bytes
    return float(total)


def step_floor_ms(engine, adapter, prompts, bandwidth_gbps: float, context: int, pads_all_experts: bool) -> float:
    """HBM floor of one decode step: prefill, count which experts ONE step touches, price the bytes it must read.

    `pads_all_experts`: the capacity dispatcher's padded GEMM reads every expert's weights whatever is routed.
    Leaves the drop counters reset to that one step.
    """
    state = state_of(engine.model)
    B = prompts.shape[0]
    engine.prefill(prompts)
    state.reset()
    engine.ids[:B] = 0
    rows_run = engine.rows_for(B)
    state.set_rows(B, rows_run)
    engine.step_impl(engine.ids, rows_run)
    hits = state.snapshot()["experts_hit_per_layer"]
    if pads_all_experts:
        hits = [state.num_experts] * len(hits)
    return floor_bytes(engine.model, adapter, hits, B, context) / (float(bandwidth_gbps) * 1e9) * 1e3


def write_report(table: str, rows, args, out: str | None, json_path: str | None) -> None:
    """Print a benchmark's markdown table; optionally write it and the raw rows (with the environment)."""
    print(table)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(table + "\n")
    if json_path:
        Path(json_path).write_text(json.dumps({"env": env_fields(), "args": vars(args), "rows": rows}, indent=2))


def _timed_generate(engine, prompts, cfg, progress=None):
    """One untimed warm call, then `repeats` timed calls; returns (per-step ms pooled, last result, first result)."""
    m = cfg.measure
    engine.generate(prompts, cfg.new_tokens, timing=False)
    state = state_of(engine.model)
    steps, first = [], None
    for r in range(int(m.repeats)):
        if r == 0:
            state.reset()
        res = engine.generate(prompts, cfg.new_tokens, progress=progress, count_prefill=False)
        if r == 0:
            first = (res, state.snapshot())
        steps += res.step_ms[int(m.skip_steps):]
    return steps, first


def top2_margins(logits: list[torch.Tensor]) -> torch.Tensor:
    """Per-step logits [n, V] -> [n, steps]: top-1 minus top-2 logit, how close each greedy choice was to a tie."""
    return torch.stack([(lambda v: v[:, 0] - v[:, 1])(lg.topk(2, dim=-1).values) for lg in logits], 1)


def agreement(ref_tokens, free_tokens, forced_tokens, margins=None) -> tuple[float, float, float | None]:
    """(free-running agreement, teacher-forced agreement, largest reference margin where forced disagrees).

    Free-running: after a row's first disagreement its inputs differ, so every later token may too.
    Teacher-forced (`generate(force_tokens=ref_tokens)`): each step judged on the reference's inputs.
    """
    ref_tokens = ref_tokens.cpu()
    miss = forced_tokens.cpu() != ref_tokens
    worst = None if margins is None else (float(margins[miss].max()) if miss.any() else 0.0)
    return float((free_tokens.cpu() == ref_tokens).float().mean()), float((~miss).float().mean()), worst


def _fidelity(ref, res, rows: int) -> tuple[float, float | None]:
    agree = (ref.tokens == res.tokens).float().mean().item()
    if ref.logits is None or res.logits is None:
        return agree, None
    # max |logit diff| over the steps where the row's greedy prefix still agrees (after that the inputs differ)
    worst = 0.0
    n = ref.tokens.shape[0]
    ok = torch.ones(n, dtype=torch.bool)
    for t, (la, lb) in enumerate(zip(ref.logits, res.logits)):
        k = min(rows, la.shape[0], lb.shape[0])
        rows_ok = ok[:k]
        if rows_ok.any():
            worst = max(worst, (la[:k][rows_ok] - lb[:k][rows_ok]).abs().max().item())
        ok &= ref.tokens[:, t] == res.tokens[:, t]
    return agree, worst


def run_experiment(cfg, progress=None) -> dict:
    """Run one configuration end to end; returns the flat results dict (see README 'Results schema')."""
    mcfg = cfg.model
    # ---- validate before any CUDA work -----------------------------------------------------------------
    dispatcher = dispatcher_from_cfg(cfg.dispatch)
    prefill_dispatcher = prefill_dispatcher_from_cfg(cfg.dispatch)
    buckets = validate_buckets(cfg.capture.buckets)
    if cfg.batch_size < 1 or cfg.prompt_len < 1 or cfg.new_tokens < 1:
        raise ValueError("batch_size, prompt_len and new_tokens must all be >= 1")
    max_cache_len = cfg.max_cache_len or cfg.prompt_len + cfg.new_tokens
    if cfg.prompt_len + cfg.new_tokens > max_cache_len:
        raise ValueError(f"prompt_len + new_tokens = {cfg.prompt_len + cfg.new_tokens} exceeds max_cache_len="
                         f"{max_cache_len}: raise max_cache_len or lower new_tokens")
    from moecg.models.zoo import make_config

    n_layers = mcfg.num_layers or (make_config(mcfg.preset).num_hidden_layers if mcfg.preset else None)
    if n_layers is not None:
        validate(cfg.strategy.name, dispatcher, n_layers, cfg.strategy.get("layers"))

    # ---- model ------------------------------------------------------------------------------------------
    built = build_model(mcfg.preset, pretrained_path=mcfg.pretrained_path, num_layers=mcfg.num_layers,
                        dtype=mcfg.dtype, device=cfg.device, seed=int(cfg.seed),
                        router_skew=float(mcfg.router_skew), attn_implementation=mcfg.attn_implementation)
    model, dev = built.model, built.device
    validate(cfg.strategy.name, dispatcher, len(built.adapter.layers(model)), cfg.strategy.get("layers"))
    prompts = make_prompts(cfg, model.config.vocab_size)
    B = cfg.batch_size
    bucket = bucket_for(B, buckets) or B
    max_rows = max(bucket, B)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)

    m = cfg.measure
    out: dict = {}
    ref = None
    keep = int(m.fidelity_rows)
    if m.fidelity:
        attach(model, make_dispatcher("dropless"), max_rows=max_rows)
        ref = DecodeEngine(model, max_cache_len, max_rows).generate(prompts, cfg.new_tokens, keep_logits=keep,
                                                                   timing=False)
        detach(model)
    attach(model, dispatcher, max_rows=max_rows).prefill_dispatcher = prefill_dispatcher
    engine = DecodeEngine(model, max_cache_len, max_rows)
    eager_steps = None
    if m.eager_baseline and cfg.strategy.name != "eager":
        eager_steps, _ = _timed_generate(engine, prompts, cfg)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cap = Capture(engine, cfg.strategy.name, layers=cfg.strategy.get("layers"), buckets=buckets,
                      backend=cfg.capture.backend, warmup=int(cfg.capture.warmup),
                      compile=bool(cfg.capture.get("compile", False)),
                      compile_mode=cfg.capture.get("compile_mode", "default"),
                      kernels=cfg.capture.get("kernels", "hf"),
                      kernel_backend=cfg.capture.get("kernel_backend", "auto")).apply()
    for w in caught:
        print(f"warning: {w.message}")
    steps, (first_res, drops) = _timed_generate(engine, prompts, cfg, progress)
    res = engine.generate(prompts, cfg.new_tokens, keep_logits=keep, timing=False) if ref is not None else None
    forced = engine.generate(prompts, cfg.new_tokens, timing=False, force_tokens=ref.tokens) \
        if ref is not None else None

    state = state_of(model)
    floor_ms = step_floor_ms(engine, built.adapter, prompts, m.hbm_bandwidth_gbps,
                             cfg.prompt_len + cfg.new_tokens // 2, dispatcher.name == "capacity")
    rows_run = engine.rows_for(B)
    stats = cap.stats()
    p50 = statistics.median(steps) if steps else float("nan")
    eager_p50 = statistics.median(eager_steps) if eager_steps else (p50 if cfg.strategy.name == "eager" else None)

    d = dispatcher.describe()
    out.update({
        "model": built.name, "family": built.family, "num_layers": len(built.adapter.layers(model)),
        "num_experts": state.num_experts, "top_k": built.adapter.top_k(model.config),
        "dtype": str(built.dtype).replace("torch.", ""), "device": dev.type,
        "strategy": cfg.strategy.name, "strategy_layers": cfg.strategy.get("layers"),
        "dispatch": d["dispatch"], "capacity_factor": d["capacity_factor"], "drop_policy": d["drop_policy"],
        "prefill_dispatch": prefill_dispatcher.name if prefill_dispatcher else d["dispatch"],
        "router_skew": float(mcfg.router_skew), "batch_size": B, "bucket": rows_run if stats["captured"] else None,
        "prompt_len": cfg.prompt_len, "new_tokens": cfg.new_tokens, "max_cache_len": max_cache_len,
        "seed": int(cfg.seed), "prompts": cfg.get("prompts", "random"),
        "captured": stats["captured"], "capture_backend": stats["capture_backend"], "compiled": stats["compiled"],
        "kernels": stats["kernels"], "kernel_backend": stats["kernel_backend"],
        "ms_per_token_p50": p50, "ms_per_token_p90": percentile(steps, 0.9),
        "tokens_per_s": B * 1e3 / p50 if p50 == p50 and p50 > 0 else None,
        "step_ms": first_res.step_ms,
        "prefill_ms": first_res.prefill_ms,
        "eager_ms_per_token_p50": eager_p50,
        "speedup_vs_eager": (eager_p50 / p50) if eager_p50 and p50 > 0 else None,
        "capture_s": stats["capture_s"], "graph_mem_mib": stats["graph_mem_mib"], "graphs": stats["graphs"],
        "capture_buckets": {str(k): v for k, v in stats["buckets"].items()},
        "peak_mem_mib": torch.cuda.max_memory_allocated(dev) / 2**20 if cuda else None,
        "build_s": built.build_s,
        "floor_ms": floor_ms, "floor_ratio": p50 / floor_ms if floor_ms > 0 else None,
        "hbm_bandwidth_gbps": float(m.hbm_bandwidth_gbps),
        "drop_rate": drops["drop_rate"], "dropped_prob_mass": drops["dropped_prob_mass"],
        "tokens_lost_all_rate": drops["tokens_lost_all_rate"],
        "per_layer_drop_rate": drops["per_layer_drop_rate"], "per_expert_drop_rate": drops["per_expert_drop_rate"],
        "expert_load_imbalance": drops["expert_load_imbalance"],
        "per_layer_load_imbalance": drops["per_layer_load_imbalance"],
        "routed_assignments": drops["routed_assignments"], "dropped_assignments": drops["dropped_assignments"],
    })
    if ref is not None:
        agree, diff = _fidelity(ref, res, keep)
        out["token_agreement_vs_eager"], out["max_logit_diff_vs_eager"] = agree, diff
        # teacher-forced: every step gets eager's tokens as input, so one early flip does not fail every later one
        out["token_agreement_forced_vs_eager"] = agreement(ref.tokens, res.tokens, forced.tokens)[1]
    else:
        out["token_agreement_vs_eager"], out["max_logit_diff_vs_eager"] = None, None
        out["token_agreement_forced_vs_eager"] = None
    out.update(_quality(cfg, model, dispatcher))
    out.update(env_fields())
    cap.unwrap()
    detach(model)
    return out


def _quality(cfg, model, dispatcher) -> dict:
    """Held-out bits-per-byte under the run's dispatch and its delta vs dropless (byte-level models only)."""
    want = cfg.measure.get("heldout_bpb", "auto")
    if want is False or (want == "auto" and model.config.vocab_size != 256):
        return {"heldout_bpb": None, "heldout_bpb_delta_vs_dropless": None}
    from moecg.quality import heldout_bpb

    n = int(cfg.measure.heldout_bytes)
    state_of(model).n_rows = None  # teacher-forced windows: every row is real
    bpb = heldout_bpb(model, max_bytes=n)
    detach(model)
    attach(model, make_dispatcher("dropless"))
    base = heldout_bpb(model, max_bytes=n)
    detach(model)
    attach(model, dispatcher)
    return {"heldout_bpb": bpb, "heldout_bpb_delta_vs_dropless": bpb - base}

