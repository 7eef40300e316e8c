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


@register
@dataclass
class Fused(Dropless):
    name = "fused"
    graph_safe = True
    max_assignments: int = 1024  # above this (prefill), the sort + grouped GEMM path is faster
    kernels: str = "auto"  # auto | triton | torch

    def __post_init__(self):
        from moecg.kernels import OPS_BACKENDS

        if self.kernels not in OPS_BACKENDS:
            raise ValueError(f"dispatch.kernels={self.kernels!r}: choose auto, triton or torch")
        if int(self.max_assignments) < 0:
            raise ValueError(f"dispatch.max_assignments={self.max_assignments}: must be >= 0")

    def unreduced(self, experts, hidden, idx, w, valid, counters):
        if self._use_triton(experts, hidden, idx):
            from moecg.kernels import triton_ops

            return triton_ops.moe_experts(hidden, idx.contiguous(), w, experts.gate_up_proj, experts.down_proj,
                                          valid, counters)
        return super().unreduced(experts, hidden, idx, w, valid, counters)

    def _use_triton(self, experts, hidden, idx) -> bool:
        if self.kernels == "torch" or idx.numel() > self.max_assignments:
            return False
        from moecg.kernels import triton_ok

        ok = triton_ok(hidden.device) and _kernel_layout(experts)
        if self.kernels == "triton" and not ok:
            raise RuntimeError("dispatch.kernels=triton: Triton cannot run here (needs CUDA + triton, and bias-free "
                               "[E, 2I, D] experts with SiLU(gate) * up); use dispatch.kernels=auto")
        return ok


def _kernel_layout(experts) -> bool:
    """What `triton_ops.moe_experts` computes: bias-free [E, 2I, D] / [E, D, I] weights and HF's default gate, SiLU on
    the first half times the second. Anything else (GPT-OSS's biased, transposed, interleaved clamped SwiGLU) takes
    the grouped path, which applies the module's own biases and `_apply_gate`."""
    from transformers.integrations.moe import _default_apply_gate

    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False) \
            or type(experts)._apply_gate is not _default_apply_gate:
        return False
    act = getattr(experts, "act_fn", None)
    return getattr(act, "__name__", type(act).__name__) in ("silu", "SiLU", "SiLUActivation")
