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

            spec = _kernel_spec(experts)
            bias = spec.has_bias
            return triton_ops.moe_experts(hidden, idx.contiguous(), w, experts.gate_up_proj, experts.down_proj,
                                          valid, counters, spec=spec,
                                          gate_up_bias=experts.gate_up_proj_bias if bias else None,
                                          down_bias=experts.down_proj_bias if bias else None)
        return super().unreduced(experts, hidden, idx, w, valid, counters)

    def _use_triton(self, experts, hidden, idx) -> bool:
        if self.kernels == "torch" or idx.numel() > self.max_assignments:
            return False
        from moecg.kernels import triton_ok

        ok = triton_ok(hidden.device) and _kernel_spec(experts) is not None
        if self.kernels == "triton" and not ok:
            raise RuntimeError("dispatch.kernels=triton: Triton cannot run here (needs CUDA + triton, and experts "
                               "with SiLU(gate) * up or GPT-OSS's clamped SwiGLU); use dispatch.kernels=auto")
        return ok


def _kernel_spec(experts):
    """The family adapter's ExpertSpec when `triton_ops.moe_experts` computes these experts, else None (the grouped
    path, which applies the module's own biases and `_apply_gate`). The kernel takes either HF layout (strides),
    halves or interleaved gate/up, biases, and two activations: HF's default gate with SiLU, or GPT-OSS's clamped
    SwiGLU (the adapter's act "swiglu_clamp", which names that family's own `_apply_gate`)."""
    from transformers.integrations.moe import _default_apply_gate

    from moecg.models.adapter import adapter_for

    try:
        spec = adapter_for(experts.config).expert_spec(experts)
    except (AttributeError, ValueError, KeyError):  # experts of a model moecg has no adapter for
        return None
    if spec.act == "swiglu_clamp":
        return spec
    act = getattr(experts, "act_fn", None)
    if type(experts)._apply_gate is not _default_apply_gate or \
            getattr(act, "__name__", type(act).__name__) not in ("silu", "SiLU", "SiLUActivation"):
        return None
    return spec
