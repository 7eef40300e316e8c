"""The HBM floor of a decode step: the bytes it must read, over the device's memory bandwidth.

Dims: B rows, D hidden, L layers, E experts, H kv heads, Dh head dim, S live context.
A step must read every non-expert weight, the experts it routes to (all E for a dispatcher that
`reads_all_experts`), one embedding row per row and the live KV. Bandwidth is a fact of the device: known
devices have a measured value below; anywhere else the floor is null unless `measure.hbm_bandwidth_gbps` is set.
"""
from __future__ import annotations

import torch

from moecg.dispatch import state_of

# Measured copy bandwidth (GB/s), by torch.cuda.get_device_name(); add a device by measuring it the same way.
DEVICE_BANDWIDTH_GBPS = {
    "NVIDIA H200": 4300.0,  # torch copy of a 4 GiB tensor, H200 SXM 141 GB (this project's reference machine)
}


def device_bandwidth_gbps(device: torch.device) -> tuple[float | None, str]:
    """(GB/s, where it came from) for this device; (None, 'unknown') where no measured value exists (CPUs)."""
    if device.type != "cuda":
        return None, "unknown"
    name = torch.cuda.get_device_name(device)
    for known, bw in DEVICE_BANDWIDTH_GBPS.items():
        if name.startswith(known):
            return bw, "device table"
    return None, "unknown"


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
        total += hit * expert_bytes(experts)
    kv_bytes = next(model.parameters()).element_size()
    # a sliding-window layer reads only the keys inside its window
    live = sum(min(context, w) if w else context for w in adapter.attention_windows(cfg))
    # keys + values per token as the cache holds them (MLA: its latent, FamilyAdapter.kv_shapes)
    total += rows * adapter.kv_elems_per_token(cfg) * live * kv_bytes
    return float(total)


def expert_bytes(experts) -> int:
    """Bytes of one expert's weights (and biases): what a step reads per expert it touches."""
    return sum(p[0].numel() for p in _expert_params(experts)) * experts.gate_up_proj.element_size()


def _expert_params(experts) -> list:
    """The [E, ...] parameters of an experts module: weights, and biases where it has them (GPT-OSS)."""
    names = ["gate_up_proj", "down_proj"]
    if getattr(experts, "has_bias", False):
        names += ["gate_up_proj_bias", "down_proj_bias"]
    return [getattr(experts, n) for n in names]


def step_floor_ms(engine, adapter, prompts, bandwidth_gbps: float | None, context: int,
                  pads_all_experts: bool) -> float | None:
    """HBM floor of one decode step: prefill, count which experts ONE step touches, price the bytes it must read.

    `pads_all_experts`: the dispatcher reads every expert's weights whatever is routed (`reads_all_experts`).
    Leaves the drop counters reset to that one step. None when the bandwidth is unknown.
    """
    if bandwidth_gbps is None:
        return None
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
