"""`capacity`: fixed [E, C, D] expert buffers, overflow dropped (Megatron's capacity factor + pad-to-capacity).

Dims: T tokens, K top-k, E experts, C capacity per expert, D hidden, I expert intermediate.
Every shape depends only on (T, K, E, capacity_factor), so the whole layer captures. The price: one batched
GEMM reads all E experts' weights every step, even at batch 1 where dropless reads only K of them.

Buffers are sized for the T tokens run (a padded bucket), but the drop threshold is Megatron's capacity of the
*real* tokens, computed on the device from the row mask: the same workload keeps the same assignments whether it
runs eagerly at its own batch size or padded up to a captured bucket.

Two implementations of one function. HF's modules call `forward`: the PyTorch path above (Megatron's layout). The
fused decode step (capture.kernels=fused) calls `unreduced`: on CUDA with Triton (S <= max_assignments) the capacity
kernels of `moecg.kernels.capacity`, which choose the same slots on the device, count inside the kernels and run
the GEMMs on the kept assignments only, still reading every expert's weights once (what a padded GEMM costs); else
the same PyTorch path. Both keep the same assignments and count the same (tests/test_capacity_kernel.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moecg.dispatch.base import Dispatcher, expert_mlp_padded, register
from moecg.dispatch.triton_path import TritonPath, kernel_spec
from moecg.models.formats import EXPERT_PARAMS
from moecg.models.weights import compute_dtype, stored
from moecg.moe_math import DROP_POLICIES, add_counters, assign_slots, capacity, kept_weights


@register
@dataclass
class Capacity(Dispatcher, TritonPath):
    name = "capacity"
    graph_safe = True
    drops = True
    reads_all_experts = True  # the padded GEMM, and the kernels too: every expert's weights once per call
    fused_unreduced = True
    capacity_factor: float = 1.25  # C = ceil(T*K*cf/E), clamped to [min_capacity, T]
    drop_policy: str = "probs"  # probs: keep each expert's highest-probability tokens | position: earliest first
    min_capacity: int = 1
    renormalize: bool = False  # rescale surviving top-k weights to the token's original sum

    def __post_init__(self):
        super().__post_init__()  # kernels, max_assignments
        if not self.capacity_factor > 0:
            raise ValueError(f"dispatch.capacity_factor={self.capacity_factor}: must be > 0 (1.0-2.0 is typical)")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"dispatch.drop_policy={self.drop_policy!r}: choose one of {DROP_POLICIES}")
        if self.min_capacity < 1:
            raise ValueError(f"dispatch.min_capacity={self.min_capacity}: must be >= 1")

    def describe(self) -> dict:
        return {"dispatch": self.name, "capacity_factor": self.capacity_factor, "drop_policy": self.drop_policy}

    def capacity_for(self, num_tokens: int, top_k: int, num_experts: int) -> int:
        return capacity(num_tokens, top_k, num_experts, self.capacity_factor, self.min_capacity)

    def forward(self, experts, hidden, idx, w, valid, counters):
        return self._padded(experts, hidden, idx, w, valid, counters).sum(1).to(hidden.dtype)  # [T, D]

    def unreduced(self, experts, hidden, idx, w, valid, counters, xq=None):
        """[T, K, D] fp32 weighted expert outputs (dropped assignments and pad rows zero); the fused step sums them.
        xq: as Dropless.unreduced's."""
        if self.use_triton(experts, hidden, idx):
            from moecg.kernels import capacity as capacity_kernels  # Triton: optional, imported only where it runs

            spec = kernel_spec(experts)
            bias = spec.has_bias
            return capacity_kernels.capacity_experts(
                hidden, idx.contiguous(), w, *(stored(experts, n) for n in EXPERT_PARAMS), valid, counters,
                capacity_factor=self.capacity_factor, drop_policy=self.drop_policy, min_capacity=self.min_capacity,
                renormalize=self.renormalize, spec=spec, gate_up_bias=experts.gate_up_proj_bias if bias else None,
                down_bias=experts.down_proj_bias if bias else None, xq=xq)
        return self._padded(experts, hidden, idx, w, valid, counters)

    def _padded(self, experts, hidden, idx, w, valid, counters):
        """The PyTorch path: [E, C, D] buffers, one batched GEMM over all experts -> [T, K, D] fp32."""
        T, K = idx.shape
        E = experts.num_experts
        sl = assign_slots(idx, w, valid, E, self.capacity_factor, self.min_capacity, self.drop_policy)
        C = sl.buffer
        x = hidden[sl.slot_token]  # [E, C, D]
        y = self.experts_padded(experts, x.to(compute_dtype(experts)))  # [E, C, D]
        # Where each kept (token, expert) sits: slot_of[t, e] = c.
        slot_of = torch.zeros(T, E, dtype=torch.int64, device=idx.device)
        slots = torch.arange(C, device=idx.device).expand(E, C)  # [E, C]
        slot_of.scatter_(0, sl.slot_token.t(), slots.t())  # [T, E]
        e_k = idx.clamp(max=E - 1)  # [T, K]
        keep_k, w_k = kept_weights(idx, w, sl.kept, valid, self.renormalize)  # [T, K], [T, K]
        flat = e_k * C + slot_of.gather(1, e_k)  # [T, K] row in y.view(E*C, D)
        out_k = y.reshape(E * C, -1)[flat]  # [T, K, D]
        if counters is not None:
            add_counters(counters, sl)
        return torch.where(keep_k[..., None], out_k.float() * w_k[..., None], 0.0)  # [T, K, D]

    def experts_padded(self, experts, x):
        """x [E, C, D] slot buffers -> [E, C, D] expert outputs: the one step expert parallelism replaces (an
        all-to-all to the experts' ranks and back, moecg.parallel.dispatch), selection and combine staying as here."""
        return expert_mlp_padded(experts, x)
