"""The floor of a decode step: the bytes it must read over the device's memory bandwidth, plus, with expert
parallelism, the bytes its all-to-alls send over the NVLink bandwidth.

Dims: B rows, D hidden, L layers, E experts, H kv heads, Dh head dim, S live context, R expert-parallel ranks.
A step must read every non-expert weight, the experts it routes to (all E for a dispatcher that
`reads_all_experts`), one embedding row per row and the live KV. Bandwidth is a fact of the device: known
devices have a measured value below; anywhere else the floor is null unless `measure.hbm_bandwidth_gbps` is set.
With R ranks each rank reads its own weights, its experts that any rank's tokens hit and its KV; the step's floor
is the slowest rank's, plus the exchange's bytes (what a rank sends to the others, there and back) over the
per-direction NVLink bandwidth (a rank sends and receives at once).
"""
from __future__ import annotations

import torch

from moecg.dispatch import state_of

# Measured copy bandwidth (GB/s), by torch.cuda.get_device_name(); add a device by measuring it the same way.
DEVICE_BANDWIDTH_GBPS = {
    "NVIDIA H200": 4300.0,  # torch copy of a 4 GiB tensor, H200 SXM 141 GB (this project's reference machine)
    # the same copy (measure_copy_gbps) on two H100 SXM hosts: 3048 GB/s (experiments/results/mla_attn/, its log's
    # first line) and 3007-3011 (experiments/results/capture_time/h100/copy.txt)
    "NVIDIA H100 80GB HBM3": 3030.0,
}


# NVLink bandwidth per GPU and direction (GB/s), by device name: a datasheet figure, not measured by moecg (no
# multi-GPU machine has been lent yet). H200 SXM: "NVLink: 900GB/s" in NVIDIA's H200 Tensor Core GPU datasheet
# (nvidia.com/en-us/data-center/h200), the bidirectional total of 18 NVLink 4 links, i.e. 450 GB/s each way.
NVLINK_BANDWIDTH_GBPS = {
    "NVIDIA H200": 450.0,
}


def _by_name(device: torch.device, table: dict) -> tuple[float | None, str]:
    if device.type != "cuda":
        return None, "unknown"
    name = torch.cuda.get_device_name(device)
    for known, bw in table.items():
        if name.startswith(known):
            return bw, "device table"
    return None, "unknown"


def device_nvlink_gbps(device: torch.device) -> tuple[float | None, str]:
    """(GB/s per direction, source) of this device's NVLink; (None, 'unknown') off the table (CPUs, gloo)."""
    return _by_name(device, NVLINK_BANDWIDTH_GBPS)


def exchange_floor_ms(dispatcher, model, adapter, rows: int, nvlink_gbps: float | None) -> float | None:
    """The all-to-all bytes one decode step of `rows` rows sends from a rank, over NVLink (None: no exchange, the
    bandwidth is unknown, or the bytes depend on the routing). moecg's buffers are static, so the bytes are those of
    the buffers, not of the routing."""
    if not dispatcher.exchanges or nvlink_gbps is None:
        return None
    cfg = model.config
    elem = next(model.parameters()).element_size()
    E, K = adapter.num_experts(cfg), adapter.top_k(cfg)
    per_layer = dispatcher.exchange_bytes(rows, K, E, cfg.hidden_size, elem)
    if per_layer is None:
        return None
    return per_layer * len(adapter.moe_layers(model)) / (float(nvlink_gbps) * 1e9) * 1e3


def device_bandwidth_gbps(device: torch.device) -> tuple[float | None, str]:
    """(GB/s, where it came from) for this device; (None, 'unknown') where no measured value exists (CPUs)."""
    return _by_name(device, DEVICE_BANDWIDTH_GBPS)


def measure_copy_gbps(device: torch.device, gib: int = 4, iters: int = 20) -> float:
    """The table's measurement: a device-to-device copy of a `gib` GiB tensor, read + write bytes over its time
    (CUDA events after a warmup copy, median of `iters`)."""
    x = torch.empty(gib * 2**29, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    ms = sorted(times)[len(times) // 2]
    del x, y
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / 1e9 / (ms / 1e3)


def bench_bandwidth_gbps(device: torch.device, given: float | None = None) -> tuple[float | None, str]:
    """A benchmark's floor bandwidth: `given` (a flag), else the device table's, else on a GPU measured here now
    (measure_copy_gbps); with where it came from, for the report's header. (None, 'unknown') on a CPU."""
    if given is not None:
        return float(given), "given"
    bw, source = device_bandwidth_gbps(device)
    if bw is not None or device.type != "cuda":
        return bw, source
    return measure_copy_gbps(device), "measured copy"


def kv_bytes_per_token(model, adapter) -> int:
    """Bytes one token adds to the KV cache over all layers: each layer caches FamilyAdapter.kv_shapes (MLA: its latent,
    kv_lora_rank + qk_rope_head_dim values; standard: K and V of every KV head) in the model's dtype. moecg's caches are
    linear, so a sliding-window layer holds every token too (the floor reads only its window)."""
    elem = next(model.parameters()).element_size()
    return adapter.kv_elems_per_token(model.config) * len(adapter.layers(model)) * elem


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
    """Bytes of one expert's weights as stored (values, block scales of a quantized format, biases): what a step reads
    per expert it touches."""
    E = experts.gate_up_proj.shape[0]  # the experts this module holds (an expert-parallel rank: its own)
    return sum(p[0].numel() * p.element_size() for p in experts.parameters(recurse=False) if p.shape[0] == E)


def step_floor_ms(engine, adapter, prompts, bandwidth_gbps: float | None, context: int,
                  pads_all_experts: bool, group=None) -> float | None:
    """HBM floor of one decode step: prefill, count which experts ONE step touches, price the bytes it must read.

    `pads_all_experts`: the dispatcher reads every expert's weights whatever is routed (`reads_all_experts`).
    group (moecg.parallel.EPGroup, R ranks): each rank prices its own experts that any rank's tokens hit; the floor
    is the slowest rank's. Leaves the drop counters reset to that one step. None when the bandwidth is unknown.
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
    if group is None or group.size == 1:
        hits = state.snapshot()["experts_hit_per_layer"]
        if pads_all_experts:
            hits = [state.num_experts] * len(hits)
        return floor_bytes(engine.model, adapter, hits, B, context) / (float(bandwidth_gbps) * 1e9) * 1e3
    routed = torch.tensor(state.snapshot(reduce=group.sum_)["routed"])  # [L, E] every rank's tokens
    lo, hi = group.experts(state.num_experts)
    hits = [hi - lo] * routed.shape[0] if pads_all_experts else (routed[:, lo:hi] > 0).sum(1).tolist()
    return group.max(floor_bytes(engine.model, adapter, hits, B, context) / (float(bandwidth_gbps) * 1e9) * 1e3)
