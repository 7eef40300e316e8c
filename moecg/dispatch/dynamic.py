"""`dynamic`: HF's own eager experts loop, the reference. `nonzero()` + a Python loop over hit experts: not graph-safe.

Dims: T tokens, K top-k, E experts, D hidden.
"""
from __future__ import annotations

from dataclasses import dataclass

from moecg.dispatch.base import Dispatcher, count_valid, register, route_counts, routed_mass


@register
@dataclass
class Dynamic(Dispatcher):
    name = "dynamic"
    graph_safe = False

    def forward(self, experts, hidden, idx, w, valid, counters):
        E = experts.num_experts
        idx_m, counts = route_counts(idx, valid, E)  # [T, K], [E]
        # HF's loop skips expert id E (its one_hot has E+1 classes), so pad rows route nowhere.
        out = type(experts).forward.__wrapped__(experts, hidden, idx_m, w)  # [T, D]
        if counters is not None:
            counters.add_routed(counts, routed_mass(idx_m, w, E), count_valid(valid, hidden.shape[0], hidden.device))
        return out
