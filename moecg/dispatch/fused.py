"""`fused`: dropless, as `dropless`, but at decode sizes one Triton kernel per projection does the routing too.

Dims: T tokens, K top-k, S = T*K assignments, E experts, D hidden, I expert intermediate.
On CUDA with Triton, for S <= max_assignments, `moecg.kernels.triton_ops.moe_experts` runs: a grid over
(expert, row block, column block) where each program finds its expert's assignments itself (no sort, no
prefix sum, no grouped-GEMM offsets), experts nobody picked exit at once, and the drop counters are updated
inside the kernel. Anything else (CPU, prefill-sized S, no Triton) takes `dropless`'s sort + grouped GEMM, so
both paths compute the same function and count the same way (tested against each other).
"""
from __future__ import annotations

from dataclasses import dataclass

from moecg.dispatch.base import register
from moecg.dispatch.dropless import Dropless
from moecg.dispatch.triton_path import TritonPath, kernel_spec
from moecg.models.formats import EXPERT_PARAMS
from moecg.models.weights import stored


@register
@dataclass
class Fused(Dropless, TritonPath):
    name = "fused"
    graph_safe = True

    def unreduced(self, experts, hidden, idx, w, valid, counters, xq=None):
        if self.use_triton(experts, hidden, idx):
            from moecg.kernels import triton_ops  # Triton: optional, imported only where it runs

            spec = kernel_spec(experts)
            bias = spec.has_bias
            return triton_ops.moe_experts(hidden, idx.contiguous(), w, *(stored(experts, n) for n in EXPERT_PARAMS),
                                          valid, counters, spec=spec,
                                          gate_up_bias=experts.gate_up_proj_bias if bias else None,
                                          down_bias=experts.down_proj_bias if bias else None, xq=xq)
        return super().unreduced(experts, hidden, idx, w, valid, counters)
