"""megatron-core's token dispatchers inside moecg's decode: the anchor moecg's expert-parallel dispatch is measured by.

Dims: T tokens of this rank, K top-k, E experts, El = E/R local experts, C capacity, D hidden.
HF's router picks the experts (as for every moecg dispatcher); megatron-core's dispatcher permutes the tokens, runs
its exchange and un-permutes; this rank's HF experts slice computes (one grouped GEMM, the outputs scaled by the
permuted probabilities, as megatron-core's experts do):
  - `megatron_alltoall`: MoEAlltoAllTokenDispatcher, dropless. Its all-to-all-v splits are read on the host
    (`.tolist()`, a device-to-host copy on its side stream and a sync), so it cannot be captured: `graph_safe` is
    False and `partial` (the MoE eager between attention graphs) is the most of the step a graph can hold.
  - `megatron_alltoall_capacity`: the same dispatcher with `moe_pad_expert_input_to_capacity` (drop-and-pad): the
    router's `apply_router_token_dropping(..., pad_to_capacity=True)` fills exactly C slots per expert (`probs` order),
    the all-to-all has equal splits and `permute` an argsort: megatron-core wrote this path for CUDA graphs, and with
    the experts run as one batched GEMM over the fixed [El, R*C, D] (no token counts from the host) the whole layer is
    graph-safe here too. Unlike moecg's `capacity`, C comes from the T rows run (a padded bucket), not the real ones,
    so a padded batch keeps more than it would unpadded.
  - `megatron_allgather`: MoEAllGatherTokenDispatcher, dropless: every rank gathers every token, keeps those of its
    experts (`.cpu()` of the counts), and reduce-scatters the outputs back.
They need CUDA: the all-to-all dispatcher creates a `torch.cuda.Stream` when constructed, and both allocate their
gathered / all-to-all-v outputs on `torch.cuda.current_device()` (megatron-core 0.16). On a CPU build the drop-and-pad
path alone runs once that stream is stood in for (`cpu_stream_stand_in`, which moecg's CPU test uses; that path never
touches the stream), so the wrapper's routing, expert and combine logic is tested against moecg's `capacity`, eagerly
and in emulated graphs.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch

from moecg.dispatch import register_experts_impl
from moecg.dispatch.base import Dispatcher, expert_mlp_grouped, expert_mlp_padded
from moecg.moe_math import count_valid, route_counts, routed_mass


def _megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Transformer Engine / Apex absent: megatron-core falls back to torch
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    return ProcessGroupCollection, TransformerConfig, moe_utils, token_dispatcher


@contextmanager
def cpu_stream_stand_in():
    """Let MoEAlltoAllTokenDispatcher be constructed without CUDA (its class-level device-to-host stream is set to a
    stand-in); only the drop-and-pad path, which never uses that stream, can then run. For CPU tests only."""
    td = _megatron()[3]
    cls = td.MoEAlltoAllTokenDispatcher
    prev = cls.cuda_dtoh_stream
    if prev is None:
        cls.cuda_dtoh_stream = object()
    try:
        yield
    finally:
        cls.cuda_dtoh_stream = prev


@dataclass
class _Megatron(Dispatcher):
    """One megatron-core dispatcher per (T, E, K, D, dtype), built on first use over megatron-core's own EP group."""

    graph_safe: ClassVar[bool] = False  # dropless: split sizes and token counts read on the host
    exchanges: ClassVar[bool] = True
    kind: ClassVar[str] = "alltoall"
    capacity_factor: float = 0.0  # > 0: drop-and-pad (megatron_alltoall_capacity)

    def __post_init__(self):
        self._cache: dict = {}

    def bind(self, exchange) -> "_Megatron":
        self.exchange = exchange
        return self

    def _dispatcher(self, E: int, K: int, D: int, dtype):
        key = (E, K, D, dtype)
        if key not in self._cache:
            PGC, TC, _, td = _megatron()
            R = self.exchange.size
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecation notes about training options not used here
                cfg = TC(num_layers=1, hidden_size=D, num_attention_heads=1, num_moe_experts=E, moe_router_topk=K,
                         moe_token_dispatcher_type=self.kind, expert_model_parallel_size=R, add_bias_linear=False,
                         moe_expert_capacity_factor=self.capacity_factor or None,
                         moe_pad_expert_input_to_capacity=self.capacity_factor > 0,
                         bf16=dtype == torch.bfloat16, params_dtype=dtype, use_cpu_initialization=True)
            pgs = PGC.use_mpu_process_groups(required_pgs=["ep", "expt_tp", "tp_ep"])
            lo, hi = self.exchange.experts(E)
            cls = td.MoEAlltoAllTokenDispatcher if self.kind == "alltoall" else td.MoEAllGatherTokenDispatcher
            self._cache[key] = cls(hi - lo, list(range(lo, hi)), cfg, pg_collection=pgs)
        return self._cache[key]

    def forward(self, experts, hidden, idx, w, valid, counters):
        if getattr(experts, "has_bias", False):
            raise NotImplementedError("megatron dispatchers here run bias-free experts only")
        T, K = idx.shape
        E = experts.num_experts
        idx_m, counts = route_counts(idx, valid, E)  # [T, K] (pad rows: sentinel E), [E]
        routed = torch.zeros(T, E + 1, dtype=torch.bool, device=idx.device).scatter_(1, idx_m, True)[:, :E]  # [T, E]
        probs = torch.zeros(T, E, dtype=torch.float32, device=idx.device)
        probs.scatter_(1, idx.clamp(max=E - 1), w.float())
        probs = routed_probs = probs * routed  # [T, E]
        routing_map, kept = routed, routed
        if self.capacity_factor > 0:
            mu = _megatron()[2]
            probs, routing_map = mu.apply_router_token_dropping(probs, routed, K, self.capacity_factor,
                                                                drop_policy="probs", pad_to_capacity=True)
            kept = routing_map & routed  # pad_to_capacity also fills each expert's slots with unrouted tokens
        disp = self._dispatcher(E, K, hidden.shape[-1], hidden.dtype)
        x, p = disp.dispatch_preprocess(hidden, routing_map, probs)
        x, p = disp.token_dispatch(x, p)
        x, tokens_per_expert, p = disp.dispatch_postprocess(x, p)  # x sorted by local expert
        if self.capacity_factor > 0:
            El = experts.gate_up_proj.shape[0]
            # drop-and-pad: R*C rows per local expert, fixed; tokens_per_expert is a host tensor a graph cannot read
            y = expert_mlp_padded(experts, x.reshape(El, -1, x.shape[-1])).reshape(x.shape)  # [El*R*C, D]
        else:
            offsets = torch.cumsum(tokens_per_expert.to(x.device), 0).to(torch.int32)  # [El] (host counts)
            y = expert_mlp_grouped(experts, x, offsets)  # [S_local, D]
        y = (y.float() * p.float()[:, None]).to(hidden.dtype)  # megatron-core's experts scale by the probabilities
        out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(y)))  # [T, D]
        if counters is not None:
            dropped = routed & ~kept  # [T, E]
            counters.add(counts, dropped.sum(0), routed_mass(idx_m, w, E), (routed_probs * dropped).sum(0),
                         count_valid(valid, T, hidden.device), (routed.any(1) & ~kept.any(1)).sum())
            if self.drops:
                counters.add_capacity(self.capacity_for(T, K, E))
        return out.to(hidden.dtype)

    def exchange_bytes(self, num_tokens: int, top_k: int, num_experts: int, hidden: int, elem: int) -> int | None:
        return None  # all-to-all-v / all-gather: the bytes depend on the routing


@dataclass
class MegatronAlltoAll(_Megatron):
    name: ClassVar[str] = "megatron_alltoall"


@dataclass
class MegatronAlltoAllCapacity(_Megatron):
    name: ClassVar[str] = "megatron_alltoall_capacity"
    graph_safe: ClassVar[bool] = True  # drop-and-pad: fixed shapes, equal splits (module docstring)
    drops: ClassVar[bool] = True
    capacity_factor: float = 1.25

    def capacity_for(self, num_tokens: int, top_k: int, num_experts: int) -> int:
        return _megatron()[2].get_capacity(num_tokens=num_tokens * top_k, num_experts=num_experts,
                                           capacity_factor=self.capacity_factor)

    def exchange_bytes(self, num_tokens: int, top_k: int, num_experts: int, hidden: int, elem: int) -> int:
        """Tokens there and back (probabilities too, fp32, on the way there), as moecg's capacity: the C x E slots."""
        R = self.exchange.size
        slots = self.capacity_for(num_tokens, top_k, num_experts) * num_experts * (R - 1) // R
        return slots * (2 * hidden * elem + 4)


@dataclass
class MegatronAllGather(_Megatron):
    name: ClassVar[str] = "megatron_allgather"
    kind: ClassVar[str] = "allgather"


MEGATRON = {c.name: c for c in (MegatronAlltoAll, MegatronAlltoAllCapacity, MegatronAllGather)}
for _name in MEGATRON:
    register_experts_impl(_name)
