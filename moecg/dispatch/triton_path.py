"""Where a dispatcher runs its Triton MoE kernels: the `kernels` and `max_assignments` options `fused` and
`capacity` share, and which experts those kernels compute.

Dims: T tokens, K top-k, S = T*K assignments.
The kernels scan the [S] expert ids inside every program instead of sorting them, which wins at decode sizes;
above `max_assignments` (a prefill) the dispatcher's PyTorch path is faster. Both paths compute the same function
and count the same way (tests/test_dispatch_gpu.py, tests/test_capacity_kernel.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from transformers.integrations.moe import _default_apply_gate

from moecg.kernels import OPS_BACKENDS, triton_ok
from moecg.models.adapter import adapter_for


@dataclass
class TritonPath:
    max_assignments: int = 1024  # above this (prefill), the PyTorch path is faster
    kernels: str = "auto"  # auto | triton | torch

    def __post_init__(self):
        if self.kernels not in OPS_BACKENDS:
            raise ValueError(f"dispatch.kernels={self.kernels!r}: choose auto, triton or torch")
        if int(self.max_assignments) < 0:
            raise ValueError(f"dispatch.max_assignments={self.max_assignments}: must be >= 0")

    def use_triton(self, experts, hidden, idx) -> bool:
        if self.kernels == "torch" or idx.numel() > self.max_assignments:
            return False
        ok = triton_ok(hidden.device) and kernel_spec(experts) is not None
        if self.kernels == "triton" and not ok:
            raise RuntimeError("dispatch.kernels=triton: Triton cannot run here (needs CUDA + triton, and experts "
                               "with SiLU(gate) * up or GPT-OSS's clamped SwiGLU); use dispatch.kernels=auto")
        return ok


def kernel_spec(experts):
    """The family adapter's ExpertSpec when the Triton MoE kernels compute these experts, else None (the PyTorch
    path, which applies the module's own biases and `_apply_gate`). The kernels take either HF layout (strides),
    halves or interleaved gate/up, biases, and two activations: HF's default gate with SiLU, or GPT-OSS's clamped
    SwiGLU (the adapter's act "swiglu_clamp", which names that family's own `_apply_gate`)."""
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
