"""`dropless`: sort assignments by expert, one grouped GEMM per projection with offsets on the device.

Dims: T tokens, K top-k, S = T*K assignments, E experts, D hidden, I expert intermediate.
No host sync and no drops: graph-safe. Pad rows go to sentinel expert E, sort to the tail and are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moecg.dispatch.base import Dispatcher, expert_mlp_grouped, register
from moecg.moe_math import count_valid, route_counts, routed_mass


@register
@dataclass
class Dropless(Dispatcher):
    name = "dropless"
    graph_safe = True
    fused_unreduced = True

    def forward(self, experts, hidden, idx, w, valid, counters):
        return self.unreduced(experts, hidden, idx, w, valid, counters).sum(1).to(hidden.dtype)  # [T, D]

    def unreduced(self, experts, hidden, idx, w, valid, counters, xq=None):
        """[T, K, D] fp32 weighted expert outputs (pad rows zero); forward() sums them over K in fp32. xq: hidden's
        act_quant from its producer (the fused step's norms), which the Triton kernels read instead of quantizing
        hidden for experts taking fp8_dynamic inputs; the PyTorch paths quantize hidden themselves (the same values)."""
        T, K = idx.shape
        E = experts.num_experts
        idx_m, counts = route_counts(idx, valid, E)  # [T, K], [E]
        flat = idx_m.reshape(-1)  # [S]
        sorted_ids, perm = torch.sort(flat, stable=True)  # [S]
        x = hidden[perm // K]  # [S, D]
        offsets = torch.cumsum(counts, 0).to(torch.int32)  # [E]
        y = expert_mlp_grouped(experts, x, offsets, sorted_ids)  # [S, D]
        # Rows past offsets[-1] (pad rows) are left uninitialised by grouped_mm: weigh_unsort zeroes them
        out = weigh_unsort(y, sorted_ids, perm, w, E)  # [S, D] fp32
        if counters is not None:
            counters.add_routed(counts, routed_mass(idx_m, w, E), count_valid(valid, T, hidden.device))
        return out.view(T, K, -1)  # [T, K, D]; summed in fp32 over K as HF's grouped_mm path


def weigh_unsort(y, sorted_ids, perm, w, E: int):
    """Expert outputs in expert-sorted order y [S, D] -> [S, D] fp32 in (token, k) order, each weighted by its
    routing weight; rows of pad assignments (sorted id E) are zero, never NaN times 0."""
    keep = (sorted_ids < E)[:, None]  # [S, 1]
    y = torch.where(keep, y.float() * w.reshape(-1)[perm, None].float(), 0.0)  # [S, D] fp32
    out = torch.empty_like(y)
    out[perm] = y  # back to (token, k) order
    return out
