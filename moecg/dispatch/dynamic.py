"""`dynamic`: HF's own eager experts loop, the reference. `nonzero()` + a Python loop over hit experts: not graph-safe.
Quantized experts (moecg.models.formats) run the same loop on their dequantized weights; with
`model.activations=fp8_dynamic`, moecg's copy of that loop that quantizes each GEMM's input (weights.reference_loop).

Dims: T tokens, K top-k, E experts, D hidden.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moecg.dispatch.base import Dispatcher, register
from moecg.models.weights import reference_loop
from moecg.moe_math import count_valid, route_counts, routed_mass


@register
@dataclass
class Dynamic(Dispatcher):
    name = "dynamic"
    graph_safe = False

    def forward(self, experts, hidden, idx, w, valid, counters):
        E = experts.num_experts
        idx_m, counts = route_counts(idx, valid, E)  # [T, K], [E]
        # HF's own loop, whatever experts implementation is set, as the format's reference runs it
        loop = reference_loop(experts, type(experts).forward.__wrapped__)
        out = self._loop(loop, experts, hidden, idx, w, valid)  # [T, D]
        if counters is not None:
            counters.add_routed(counts, routed_mass(idx_m, w, E), count_valid(valid, hidden.shape[0], hidden.device))
        return out

    @staticmethod
    def _loop(loop, experts, hidden, idx, w, valid):
        if valid is None:
            return loop(experts, hidden, idx, w)  # [T, D]
        # Pad rows leave before the loop rather than routing to sentinel id E: GPT-OSS's loop one-hots over E
        # classes, where E is out of range. Each expert then sees exactly the real rows it sees unpadded, and
        # pad rows stay zero. nonzero syncs, as HF's loop does anyway.
        rows = valid.nonzero().squeeze(1)  # [n]
        out = torch.zeros_like(hidden)  # [T, D]
        out[rows] = loop(experts, hidden[rows], idx[rows], w[rows])
        return out
