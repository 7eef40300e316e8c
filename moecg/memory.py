"""What a run holds in memory at its peak, estimated from its plan before any weights exist, and the refusal of a
run that cannot fit this machine (with the override that fits).

`plan` below is a moecg.plan.RunPlan (read, never imported: the plan imports this module).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from moecg.config.readers import PlanError
from moecg.engine import chunk_bounds
from moecg.models.adapter import ADAPTERS
from moecg.models.weights import quantize_model
from moecg.models.zoo import FAMILIES, family_of_config

MEMORY_HEADROOM = 0.85  # refuse a run whose estimate exceeds this share of the memory available now


def _param_bytes(config, dtype: torch.dtype, weights: str = "full") -> tuple[int, int]:
    """(all parameters, one decoder layer's) in bytes as stored in format `weights` (values and scales), counted on
    the meta device (no memory, no init)."""
    family = family_of_config(config)
    _, cls = FAMILIES[family]
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            m = cls(config)
            quantize_model(m, ADAPTERS[family], weights, values=False)
    finally:
        torch.set_default_dtype(prev)

    def size(mod):
        return sum(p.numel() * p.element_size() for p in mod.parameters())

    return size(m), max(size(layer) for layer in m.model.layers)


def _kv_bytes_per_layer(plan, dtype_bytes: int) -> int:
    cfg = plan.model.config
    # keys + values per token as the cache holds them (MLA: its latent, not per-head K/V)
    per_token = ADAPTERS[plan.model.family].kv_elems_per_token(cfg)
    return plan.max_rows * per_token * plan.max_cache_len * dtype_bytes


def _prefill_tokens(plan) -> int:
    """Prompt tokens per row in the largest prefill forward (the engine's chunk_bounds)."""
    return max(e - s for s, e in chunk_bounds(plan.prompt_len, plan.prefill_chunk))


def estimate_memory(plan) -> int:
    """Bytes the run holds at its peak: weights, the KV caches of the reference and measured engines, logits."""
    nbytes = torch.empty((), dtype=plan.dtype).element_size()
    weights, _ = _param_bytes(plan.model.config, plan.dtype, plan.model.weights)
    engines = 2 if plan.measure.fidelity else 1
    if plan.serving:  # fidelity decodes one request at a time; the anchor's paged cache holds the KV again
        engines = 1 + (1 if plan.workload.anchor else 0)
    kv = engines * plan.model.layers * _kv_bytes_per_layer(plan, nbytes)
    cfg = plan.model.config
    # prefill transient, per forward (a chunk with prefill_chunk): hidden states and the MLP's widest activation for
    # every token, and HF's [B, 1, S, L] boolean mask over the whole cache; fp32 logits kept
    width = max(getattr(cfg, "intermediate_size", 0), getattr(cfg, "moe_intermediate_size", 0) or 0) * 2
    tokens = plan.max_rows * _prefill_tokens(plan)
    transient = tokens * (cfg.hidden_size * 4 + width) * 4 + tokens * plan.max_cache_len
    logits = plan.max_rows * cfg.vocab_size * 4 * (plan.new_tokens + 2)
    return int(weights + kv + transient + logits)


def grouped_fallback_bytes(plan) -> int:
    """The sort + grouped-GEMM experts (dropless, fused's prefill, the fidelity reference) on CUDA outside bf16 take
    grouped_mm's sync-free fallback, which gathers one expert weight per assignment: [S, Din, Dout] for the prefill."""
    if plan.device.type != "cuda" or plan.dtype == torch.bfloat16:
        return 0
    cfg = plan.model.config
    k = ADAPTERS[plan.model.family].top_k(cfg)
    inter = ADAPTERS[plan.model.family].expert_intermediate(cfg)
    nbytes = torch.empty((), dtype=plan.dtype).element_size()
    return plan.max_rows * _prefill_tokens(plan) * k * cfg.hidden_size * 2 * inter * nbytes


def available_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(plan, available: int | None = None) -> None:
    """Refuse a run that cannot fit this machine's memory, with what it needs and the override that fits."""
    avail = available_memory(plan.device) if available is None else available
    if avail is not None and plan.device.type == "cpu" and plan.parallel.ep > 1:
        avail //= plan.parallel.ep  # the ranks of one torchrun share this machine's RAM, each builds the whole model
    fallback = grouped_fallback_bytes(plan)
    if avail is not None and fallback and (plan.measure.fidelity or not plan.dispatcher.reads_all_experts) \
            and plan.memory_bytes + fallback > MEMORY_HEADROOM * avail:
        raise PlanError(f"model.dtype={plan.model.dtype} on CUDA: grouped_mm has a fast kernel only for bf16, and its "
                        f"fallback gathers an expert weight per assignment, {fallback / 2**30:.0f} GiB for this prefill "
                        f"(batch {plan.max_rows} x prompt {_prefill_tokens(plan)} per forward): use model.dtype=bf16 (or "
                        "auto), or a smaller batch_size/prompt_len/prefill_chunk")
    if avail is None or plan.memory_bytes <= MEMORY_HEADROOM * avail:
        return
    nbytes = torch.empty((), dtype=plan.dtype).element_size()
    weights, per_layer = _param_bytes(plan.model.config, plan.dtype, plan.model.weights)
    engines = 2 if plan.measure.fidelity else 1
    per_layer_total = per_layer + engines * _kv_bytes_per_layer(plan, nbytes)
    fixed = plan.memory_bytes - plan.model.layers * per_layer_total
    fit = int((MEMORY_HEADROOM * avail - fixed) // per_layer_total) if per_layer_total else 0
    least = ADAPTERS[plan.model.family].min_layers(plan.model.config)  # a cut must keep a routed layer
    fix = (f"model.num_layers={fit} fits" if fit >= least else
           "no depth that keeps a routed layer fits: use a smaller preset, model.dtype=bf16 on a GPU, or a machine "
           "with more memory")
    where = "GPU" if plan.device.type == "cuda" else "CPU RAM" + (" per rank" if plan.parallel.ep > 1 else "")
    raise PlanError(f"this run needs about {plan.memory_bytes / 2**30:.1f} GiB ({plan.model.layers} layers, "
                    f"{plan.dtype}, batch {plan.max_rows}, cache {plan.max_cache_len}) but {avail / 2**30:.1f} GiB of "
                    f"{where} is available: {fix}")
