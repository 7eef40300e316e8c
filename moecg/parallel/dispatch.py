"""Expert-parallel dispatchers: `dropless` and `capacity` with the experts spread over R ranks, graph-safe.

Dims: T tokens of this rank (rows run: a padded bucket), K top-k, S = T*K assignments, E experts, R ranks,
El = E/R experts per rank, C capacity per expert, Sm = T*min(K, El) rows one rank may send another, D hidden.

Each rank routes its own tokens (attention is data-parallel: every rank decodes its own rows), sends every kept
assignment to the rank holding its expert, computes its El experts on what it received, and sends the outputs back,
where they are combined with the router weights exactly as on one process. Both all-to-alls have equal splits, so
every size is fixed by T and no count is read on the host: megatron-core's MoEAlltoAllTokenDispatcher reads its
split sizes on the host (`.tolist()`/`.cpu()`), which is what keeps it out of CUDA graphs.

- `capacity`: the slots are chosen at the source exactly as on one process (Megatron's C of this rank's real tokens,
  `probs` or `position` order), so the drops happen, and are counted, where the token lives. The [E, C, D] slot
  buffer is already [R, El, C, D] by destination: one all-to-all there, one back; a rank receives C x R x El rows.
- `dropless`: nothing can be dropped, so the buffer to each rank is its worst case, Sm = T*min(K, El) rows (a token
  picks an expert once, so it sends at most min(K, El) rows to one rank). Assignments sorted by expert are already
  grouped by destination rank and, inside, by local expert; each rank also sends its [R, El] counts, from which the
  receiver recovers every row's local expert without reading anything on the host.

Counters are those of the single-process dispatcher for this rank's tokens (at the source, pad rows masked out);
the harness sums them over ranks. With R = 1 both equal `dropless` / `capacity` bit for bit (tested).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moecg.dispatch.base import expert_mlp_grouped, expert_mlp_padded
from moecg.dispatch.capacity import Capacity
from moecg.dispatch.dropless import Dropless, weigh_unsort
from moecg.moe_math import count_valid, route_counts, routed_mass


class ExpertParallel:
    """What both variants add to their single-process dispatcher: the exchange they run over (an EPGroup, or any
    object with `size`, `rank` and `all_to_all`) and the bytes it moves."""

    exchanges: ClassVar[bool] = True  # holds collectives: every rank must run it as often, with the same shapes
    exchange = None

    def bind(self, exchange) -> "ExpertParallel":
        self.exchange = exchange
        return self

    def _local(self, experts) -> int:
        E, R = experts.num_experts, self.exchange.size
        El = experts.gate_up_proj.shape[0]
        if El * R != E:
            raise RuntimeError(f"this rank holds {El} of {E} experts but the exchange has {R} ranks: shard the model "
                               "with moecg.parallel.shard_experts over the same group")
        return El


@dataclass
class EPCapacity(ExpertParallel, Capacity):
    name: ClassVar[str] = "capacity"

    def use_triton(self, *args, **kwargs) -> bool:
        """Never: the Triton capacity kernels (moecg.kernels.capacity) compute every expert in place, with no
        exchange; expert parallelism runs the padded path, whose experts_padded is the all-to-all below."""
        return False

    def experts_padded(self, experts, x):
        """x [E, C, D] slot buffers by global expert -> [E, C, D] outputs, computed on the experts' ranks."""
        E, C, D = x.shape
        R, El = self.exchange.size, self._local(experts)
        recv = self.exchange.all_to_all(x.reshape(R, El, C, D))  # [R source, El, C, D]
        y = expert_mlp_padded(experts, recv.transpose(0, 1).reshape(El, R * C, D))  # [El, R*C, D]
        back = self.exchange.all_to_all(y.reshape(El, R, C, D).transpose(0, 1))  # [R owner, El, C, D]
        return back.reshape(E, C, D)

    def exchange_bytes(self, num_tokens: int, top_k: int, num_experts: int, hidden: int, elem: int) -> int:
        """Bytes one call sends to other ranks (there and back): the slot buffer of the other ranks' experts."""
        R = self.exchange.size
        C = self.capacity_for(num_tokens, top_k, num_experts)
        return 2 * num_experts * C * hidden * elem * (R - 1) // R


@dataclass
class EPDropless(ExpertParallel, Dropless):
    name: ClassVar[str] = "dropless"

    def unreduced(self, experts, hidden, idx, w, valid, counters, xq=None):
        """[T, K, D] fp32 weighted expert outputs (pad rows zero), as Dropless.unreduced (xq unused: the experts'
        PyTorch GEMMs quantize their inputs themselves)."""
        T, K = idx.shape
        E, D = experts.num_experts, hidden.shape[-1]
        R, El = self.exchange.size, self._local(experts)
        Sm = T * min(K, El)
        idx_m, counts = route_counts(idx, valid, E)  # [T, K] (pad rows: sentinel E), [E]
        sorted_ids, perm = torch.sort(idx_m.reshape(-1), stable=True)  # [S]: by expert, so by rank, then local expert
        dest = sorted_ids // El  # [S] destination rank; pad rows: R
        per_rank = counts.view(R, El).sum(1)  # [R]
        start = torch.cat([torch.cumsum(per_rank, 0) - per_rank, per_rank.new_zeros(1)])  # [R + 1]
        pos = torch.arange(sorted_ids.numel(), device=idx.device) - start[dest]  # [S] row inside its rank's block
        # pad rows all go to one spare row past the buffer, which is never sent
        slot = torch.where(dest < R, dest * Sm + pos, R * Sm)  # [S]
        send = hidden.new_zeros(R * Sm + 1, D)  # zeros: rows nobody fills are computed by no one, sent as zeros
        send[slot] = hidden[perm // K]
        recv = self.exchange.all_to_all(send[: R * Sm].view(R, Sm, D)).reshape(R * Sm, D)  # [R*Sm, D]
        recv_counts = self.exchange.all_to_all(counts.view(R, El))  # [R source, El]
        # each source's block is sorted by local expert: row j of source s belongs to the first expert whose running
        # count passes j (El: an empty row)
        ends = torch.cumsum(recv_counts, 1)  # [R, El]
        rows = torch.arange(Sm, device=idx.device).expand(R, Sm).contiguous()  # [R, Sm]
        local = torch.searchsorted(ends, rows, right=True).reshape(-1)  # [R*Sm] in [0, El]
        local_sorted, rperm = torch.sort(local, stable=True)  # [R*Sm]
        offsets = torch.cumsum(recv_counts.sum(0), 0).to(torch.int32)  # [El]
        y = expert_mlp_grouped(experts, recv[rperm], offsets, local_sorted)  # [R*Sm, D]
        # grouped_mm leaves rows past offsets[-1] uninitialised: zero them before they travel
        y = torch.where((local_sorted < El)[:, None], y, 0.0).to(hidden.dtype)
        y_back = torch.empty_like(y)
        y_back[rperm] = y
        back = self.exchange.all_to_all(y_back.view(R, Sm, D)).reshape(R * Sm, D)  # [R*Sm, D] at the sent slots
        out_sorted = torch.cat([back, back.new_zeros(1, D)])[slot]  # [S, D]
        out = weigh_unsort(out_sorted, sorted_ids, perm, w, E)  # [S, D] fp32, (token, k) order
        if counters is not None:
            counters.add_routed(counts, routed_mass(idx_m, w, E), count_valid(valid, T, hidden.device))
        return out.view(T, K, D)

    def exchange_bytes(self, num_tokens: int, top_k: int, num_experts: int, hidden: int, elem: int) -> int:
        """Bytes one call sends to other ranks: the worst-case buffers there and back, and the counts."""
        R = self.exchange.size
        El = num_experts // R
        Sm = num_tokens * min(top_k, El)
        return (2 * Sm * hidden * elem + El * 8) * (R - 1)


# the single-process dispatcher each expert-parallel variant distributes, by its registry name
EP_VARIANTS: dict[str, type] = {"dropless": EPDropless, "capacity": EPCapacity}


def parallelize(dispatcher, exchange):
    """The expert-parallel variant of `dispatcher` over `exchange`, with the same options; None stays None.

    One rank keeps the dispatcher itself: `parallel.ep=1` runs today's dispatchers, unchanged."""
    if dispatcher is None or exchange.size == 1:
        return dispatcher
    cls = EP_VARIANTS.get(dispatcher.name)
    if cls is None:
        raise ValueError(f"dispatch={dispatcher.name} has no expert-parallel variant: use dispatch="
                         f"{' or dispatch='.join(EP_VARIANTS)} with parallel.ep > 1")
    return cls(**{k: getattr(dispatcher, k) for k in dispatcher.options()}).bind(exchange)
