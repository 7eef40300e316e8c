"""`capacity`: fixed [E, C, D] expert buffers, overflow dropped (Megatron's capacity factor + pad-to-capacity).

Dims: T tokens, K top-k, E experts, C capacity per expert, D hidden, I expert intermediate.
Every shape depends only on (T, K, E, capacity_factor), so the whole layer captures. The price: one batched
GEMM reads all E experts' weights every step, even at batch 1 where dropless reads only K of them.

Buffers are sized for the T tokens run (a padded bucket), but the drop threshold is Megatron's capacity of the
*real* tokens, computed on the device from the row mask: the same workload keeps the same assignments whether it
runs eagerly at its own batch size or padded up to a captured bucket.

Two implementations of one function. HF's modules call `forward`: the PyTorch path above (Megatron's layout). The
fused decode step (capture.kernels=fused) calls `unreduced`: on CUDA with Triton (S <= max_assignments) the capacity
kernels of `moecg.kernels.capacity_ops`, which choose the same slots on the device, count inside the kernels and run
the GEMMs on the kept assignments only, still reading every expert's weights once (what a padded GEMM costs); else
the same PyTorch path. Both keep the same assignments and count the same (tests/test_capacity_kernel.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from moecg.dispatch.base import Dispatcher, count_valid, expert_mlp_padded, register
from moecg.dispatch.triton_path import TritonPath, kernel_spec

DROP_POLICIES = ("probs", "position")


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float, min_capacity: int = 1) -> int:
    """C = ceil(T*K*cf / E) (Megatron's get_capacity on T*K assignments), clamped to [min_capacity, T]."""
    c = math.ceil(num_tokens * top_k / num_experts * capacity_factor)
    return max(1, min(max(c, min_capacity), num_tokens))


def capacity_on_device(n_valid: torch.Tensor, top_k: int, num_experts: int, capacity_factor: float,
                       min_capacity: int = 1) -> torch.Tensor:
    """`capacity` of a device scalar token count, without a host sync: the same float64 ops in the same order as
    the host formula, so both give the same C for every n (tested)."""
    c = torch.ceil(n_valid.to(torch.float64) * top_k / num_experts * capacity_factor)
    c = torch.maximum(c, torch.full_like(c, float(min_capacity)))
    c = torch.minimum(c, n_valid.to(torch.float64))
    return torch.clamp(c, min=1.0).to(torch.int64)  # []


def capacity_slots(idx, w, valid, num_experts: int, cap: int, drop_policy: str, cap_used: torch.Tensor | None = None):
    """Which assignments keep a slot.

    idx [T, K], w [T, K], valid [T] | None -> (slot_token [E, C] token index per slot, slot_ok [E, C] bool,
    routed [T, E] bool, kept [T, E] bool, probs [T, E] fp32). Pure device ops: a sort and a static slice.
    cap: the buffer's slots per expert; cap_used (device scalar <= cap, default cap): how many of them may be
    filled, i.e. the capacity of the real tokens when the batch is padded.
    """
    T = idx.shape[0]
    routed = torch.zeros(T, num_experts + 1, dtype=torch.bool, device=idx.device)
    routed.scatter_(1, idx, True)
    routed = routed[:, :num_experts]  # [T, E]
    if valid is not None:
        routed = routed & valid[:, None]
    probs = torch.zeros(T, num_experts, dtype=torch.float32, device=idx.device)
    probs.scatter_(1, idx.clamp(max=num_experts - 1), w.float())  # [T, E] (sentinel ids never used below)
    if drop_policy == "probs":
        score = probs  # keep each expert's highest-probability tokens (Megatron's "probs")
    elif drop_policy == "position":
        # earliest token first: a descending score T - t
        score = (T - torch.arange(T, device=idx.device, dtype=torch.float32))[:, None].expand(T, num_experts)
    else:
        raise ValueError(f"dispatch.drop_policy={drop_policy!r}: choose one of {DROP_POLICIES}")
    score = torch.where(routed, score, -1.0)  # [T, E]; unrouted and pad rows rank last
    # A stable sort, not topk: equal weights (identical rows, e.g. a sliding window over repeated tokens) go to the
    # earlier token, so a tie is broken the same way whether or not pad rows follow (topk's order for ties is not).
    top, slot_token = torch.sort(score, dim=0, descending=True, stable=True)  # [T, E]
    top, slot_token = top[:cap], slot_token[:cap]  # [C, E]
    slot_ok = top >= 0  # [C, E]
    if cap_used is not None:
        # sorted descending, so the first cap_used slots hold exactly the real batch's top-C choice
        slot_ok = slot_ok & (torch.arange(cap, device=idx.device)[:, None] < cap_used)  # [C, E]
    kept = torch.zeros(T, num_experts, dtype=torch.bool, device=idx.device)
    kept.scatter_(0, slot_token, slot_ok)  # [T, E]
    return slot_token.t(), slot_ok.t(), routed, kept, probs


class Slots(NamedTuple):
    """One call's slot assignment (`assign_slots`)."""

    buffer: int  # C: slots per expert the buffers hold, from the (padded) token count
    n_valid: torch.Tensor  # [] int64 real tokens
    cap: int | torch.Tensor  # the drop threshold: C, or the real tokens' capacity (device scalar) when padded
    slot_token: torch.Tensor  # [E, C]
    slot_ok: torch.Tensor  # [E, C] bool
    routed: torch.Tensor  # [T, E] bool
    kept: torch.Tensor  # [T, E] bool
    probs: torch.Tensor  # [T, E] fp32


def assign_slots(idx, w, valid, num_experts: int, capacity_factor: float, min_capacity: int, drop_policy: str) -> Slots:
    """Megatron's capacity on the tokens run (buffer) and on the real ones (threshold), then `capacity_slots`."""
    T, K = idx.shape
    C = capacity(T, K, num_experts, capacity_factor, min_capacity)  # buffer slots: a function of the shape only
    n_valid = count_valid(valid, T, idx.device)  # []
    # the drop threshold: Megatron's capacity of the real tokens (pad rows never count)
    cap_used = None if valid is None else capacity_on_device(n_valid, K, num_experts, capacity_factor, min_capacity)
    slot_token, slot_ok, routed, kept, probs = capacity_slots(idx, w, valid, num_experts, C, drop_policy, cap_used)
    return Slots(C, n_valid, C if cap_used is None else cap_used, slot_token, slot_ok, routed, kept, probs)


def kept_weights(idx, w, kept, valid, renormalize: bool):
    """-> (keep_k [T, K] bool, w_k [T, K] fp32): which of each token's K assignments hold a slot, and their combine
    weights (0 where dropped; renormalize: the survivors rescaled to the token's original total)."""
    E = kept.shape[1]
    keep_k = kept.gather(1, idx.clamp(max=E - 1))  # [T, K]
    if valid is not None:
        keep_k = keep_k & valid[:, None]
    w_k = torch.where(keep_k, w.float(), 0.0)  # [T, K]
    if renormalize:
        # surviving weights rescaled to the token's original total (1 when the router normalises top-k)
        w_k = w_k * (w.float().sum(1, keepdim=True) / w_k.sum(1, keepdim=True).clamp(min=1e-20))
    return keep_k, w_k


def add_counters(counters, slots: Slots) -> None:
    """The drop counters of one call: routed, dropped, their weight, real tokens, tokens that lost all K, C applied."""
    routed, kept, probs = slots.routed, slots.kept, slots.probs
    dropped = routed & ~kept  # [T, E]
    lost = (routed.any(1) & ~kept.any(1)).sum()
    counters.add(routed.sum(0), dropped.sum(0), (probs * routed).sum(0), (probs * dropped).sum(0), slots.n_valid, lost)
    counters.add_capacity(slots.cap)


@register
@dataclass
class Capacity(Dispatcher, TritonPath):
    name = "capacity"
    graph_safe = True
    drops = True
    reads_all_experts = True  # the padded GEMM, and the kernels too: every expert's weights once per call
    fused_unreduced = True
    capacity_factor: float = 1.25
    drop_policy: str = "probs"
    min_capacity: int = 1
    renormalize: bool = False

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

    def unreduced(self, experts, hidden, idx, w, valid, counters):
        """[T, K, D] fp32 weighted expert outputs (dropped assignments and pad rows zero); the fused step sums them."""
        if self.use_triton(experts, hidden, idx):
            from moecg.kernels import capacity_ops

            spec = kernel_spec(experts)
            bias = spec.has_bias
            return capacity_ops.capacity_experts(
                hidden, idx.contiguous(), w, experts.gate_up_proj, experts.down_proj, valid, counters,
                capacity_factor=self.capacity_factor, drop_policy=self.drop_policy, min_capacity=self.min_capacity,
                renormalize=self.renormalize, spec=spec, gate_up_bias=experts.gate_up_proj_bias if bias else None,
                down_bias=experts.down_proj_bias if bias else None)
        return self._padded(experts, hidden, idx, w, valid, counters)

    def _padded(self, experts, hidden, idx, w, valid, counters):
        """The PyTorch path: [E, C, D] buffers, one batched GEMM over all experts -> [T, K, D] fp32."""
        T, K = idx.shape
        E = experts.num_experts
        sl = assign_slots(idx, w, valid, E, self.capacity_factor, self.min_capacity, self.drop_policy)
        C = sl.buffer
        x = hidden[sl.slot_token]  # [E, C, D]
        y = self.experts_padded(experts, x.to(experts.gate_up_proj.dtype))  # [E, C, D]
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
