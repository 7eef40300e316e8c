"""Device-side dispatch state shared by every MoE layer of a model: the valid-row mask and drop counters.

Dims: L = MoE layers, E = experts, B = batch rows, T = tokens (B rows x S tokens each).
Everything here lives on the model's device at fixed addresses, so a captured graph that updates it keeps
updating the same memory on every replay; the host reads it only in `snapshot()`, between measurements.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields

import torch


def _counter(per_expert: bool, dtype: torch.dtype = torch.int64, optional: bool = False):
    """A LayerCounters field: [E] (per_expert) or [] per layer, so [L, E] or [L] in DispatchState, of `dtype`.
    optional: only a capacity dispatcher adds to it (None in LayerCounters.zeros without capacity)."""
    meta = {"per_expert": per_expert, "dtype": dtype}
    return field(default=None, metadata=meta) if optional else field(metadata=meta)


@dataclass
class LayerCounters:
    """Views into the model-wide counters for one MoE layer (fixed addresses, updated in place).

    Its fields are the counters, named once: DispatchState's tensors, reset/save/restore and snapshot's reads all
    follow them (COUNTERS, in this order)."""

    routed: torch.Tensor = _counter(True)  # [E] int64  token-expert assignments routed (valid rows only)
    dropped: torch.Tensor = _counter(True)  # [E] int64  assignments dropped by capacity
    routed_mass: torch.Tensor = _counter(True, torch.float32)  # [E] fp32  routing weight routed
    dropped_mass: torch.Tensor = _counter(True, torch.float32)  # [E] fp32  routing weight dropped
    tokens: torch.Tensor = _counter(False)  # [] int64  valid tokens seen
    lost_all: torch.Tensor = _counter(False)  # [] int64  valid tokens that lost all K experts
    # [] int64  sum over calls of the capacity C applied (capacity only); calls: those that applied a capacity
    capacity: torch.Tensor | None = _counter(False, optional=True)
    calls: torch.Tensor | None = _counter(False, optional=True)  # [] int64

    @classmethod
    def zeros(cls, n_experts: int, device=None, capacity: bool = False) -> "LayerCounters":
        """Fresh zero counters of one layer, not views of a DispatchState's: for calling a kernel or a dispatcher on
        its own (tests, benchmarks). capacity: with the capacity and calls scalars a capacity dispatcher adds to."""
        return cls(**{f.name: torch.zeros((n_experts,) if f.metadata["per_expert"] else (), dtype=f.metadata["dtype"],
                                          device=device)
                      for f in fields(cls) if capacity or f.default is MISSING})

    def add_routed(self, routed, routed_mass, tokens):
        """A dispatcher that never drops: three in-place adds instead of six."""
        self.routed.add_(routed)
        self.routed_mass.add_(routed_mass)
        self.tokens.add_(tokens)

    def add(self, routed, dropped, routed_mass, dropped_mass, tokens, lost_all):
        self.routed.add_(routed)
        self.dropped.add_(dropped)
        self.routed_mass.add_(routed_mass)
        self.dropped_mass.add_(dropped_mass)
        self.tokens.add_(tokens)
        self.lost_all.add_(lost_all)

    def add_capacity(self, cap) -> None:
        """cap: the C this call applied (int or device scalar: the real tokens' capacity, not the bucket's)."""
        if self.capacity is not None:
            self.capacity.add_(cap)
            self.calls.add_(1)


COUNTERS = tuple(f.name for f in fields(LayerCounters))


class DispatchState:
    """Model-wide dispatch state: which dispatcher runs, the row mask for padded batches, and the counters."""

    def __init__(self, dispatcher, layer_ids: list[int], num_experts: int, max_rows: int, device):
        self.dispatcher = dispatcher
        self.prefill_dispatcher = None  # None: the prefill uses `dispatcher` too
        self.layer_ids = list(layer_ids)  # decoder-layer index of each MoE slot
        self.num_experts = num_experts
        L, E = len(layer_ids), num_experts
        for f in fields(LayerCounters):  # self.routed [L, E], ..., self.tokens [L], ...: every layer's counters
            shape = (L, E) if f.metadata["per_expert"] else (L,)
            setattr(self, f.name, torch.zeros(shape, dtype=f.metadata["dtype"], device=device))
        self.row_valid = torch.ones(max_rows, dtype=torch.bool, device=device)  # [B_max]
        self.n_rows: int | None = None  # rows of the forward being traced/run; None: no masking
        self.n_valid: int | None = None  # real rows among them (host-side, from set_rows)
        # True while graphs that contain MoE layers exist: they must always apply the mask, because one graph
        # serves every real-row count of its bucket. Eager MoE can skip it when no row is padding.
        self.mask_in_graphs = False
        self.counting = True

    # -- counters ---------------------------------------------------------------------------------
    def layer(self, slot: int) -> LayerCounters | None:
        if not self.counting:
            return None
        return LayerCounters(*(t[slot] for t in self._tensors()))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in COUNTERS)

    def reset(self) -> None:
        for t in self._tensors():
            t.zero_()

    def save(self) -> list[torch.Tensor]:
        return [t.clone() for t in self._tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self._tensors(), saved):
            t.copy_(s)

    def snapshot(self, reduce=None) -> dict:
        """Host copy of the counters (one sync): per layer and per expert, plus derived rates.

        reduce: applied to a copy of each counter tensor first, e.g. a sum over expert-parallel ranks (each rank
        counts the assignments of its own tokens, at the source, so the sum counts every assignment once)."""
        tensors = self._tensors() if reduce is None else [reduce(t.detach().clone()) for t in self._tensors()]
        c = {name: t.detach().cpu() for name, t in zip(COUNTERS, tensors)}
        routed, dropped, rmass, dmass = c["routed"], c["dropped"], c["routed_mass"], c["dropped_mass"]
        tokens, lost, cap, calls = c["tokens"], c["lost_all"], c["capacity"], c["calls"]
        r_tot, d_tot = int(routed.sum()), int(dropped.sum())
        per_layer_routed = routed.sum(1).clamp(min=1)
        load = routed.sum(0).double()  # [E] assignments per expert, all layers
        layer_load = routed.double()  # [L, E]
        imb = (layer_load.max(1).values / layer_load.mean(1).clamp(min=1e-9))  # [L]
        return {
            "routed": routed.tolist(), "dropped": dropped.tolist(),
            "routed_assignments": r_tot, "dropped_assignments": d_tot,
            "drop_rate": d_tot / r_tot if r_tot else 0.0,
            "dropped_prob_mass": float(dmass.sum() / rmass.sum().clamp(min=1e-12)),
            "tokens": int(tokens.sum()), "tokens_lost_all": int(lost.sum()),
            "tokens_lost_all_rate": float(lost.sum() / tokens.sum().clamp(min=1)),
            "per_layer_drop_rate": (dropped.sum(1) / per_layer_routed).tolist(),
            "per_expert_drop_rate": (dropped.sum(0) / routed.sum(0).clamp(min=1)).tolist(),
            "per_layer_load_imbalance": imb.tolist(),
            # max/mean expert load, averaged over layers: 1.0 is perfectly balanced, E is one hot expert
            "expert_load_imbalance": float(imb.mean()) if r_tot else 0.0,
            "experts_hit_per_layer": (routed > 0).sum(1).tolist(),
            # mean C applied per MoE call (the real tokens' capacity); None when no capacity was applied
            "capacity_used": float(cap.sum() / calls.sum()) if int(calls.sum()) else None,
            "global_load": load.tolist(),
        }

    @contextmanager
    def prefill(self):
        """Run the (eager) prefill with `prefill_dispatcher` when one is set, e.g. dropless before capacity decode."""
        main = self.dispatcher
        if self.prefill_dispatcher is not None:
            self.dispatcher = self.prefill_dispatcher
        try:
            yield
        finally:
            self.dispatcher = main

    # -- row mask ---------------------------------------------------------------------------------
    def set_rows(self, n_valid: int, n_rows: int) -> None:
        """Rows [0, n_valid) are real, [n_valid, n_rows) are padding (a batch padded up to a bucket)."""
        if n_rows > self.row_valid.numel():
            raise ValueError(f"{n_rows} rows exceed the dispatch mask size {self.row_valid.numel()}")
        self.row_valid[:n_valid].fill_(True)
        self.row_valid[n_valid:].fill_(False)
        self.n_rows, self.n_valid = n_rows, n_valid

    @contextmanager
    def rows(self, n_rows: int):
        """Trace/run a forward over `n_rows` rows (the mask's first n_rows entries apply)."""
        prev, self.n_rows = self.n_rows, n_rows
        try:
            yield
        finally:
            self.n_rows = prev

    def token_valid(self, num_tokens: int) -> torch.Tensor | None:
        """[T] bool mask of real tokens for a forward over `n_rows` rows, or None when nothing is padded."""
        if self.n_rows is None:
            return None
        rows = self.n_rows
        if self.n_valid is not None and self.n_valid >= rows and not self.mask_in_graphs:
            return None  # nothing padded and nothing captured: skip the masking kernels
        if num_tokens % rows:
            raise RuntimeError(f"{num_tokens} tokens do not split into {rows} rows")
        mask = self.row_valid[:rows]  # [B]
        per_row = num_tokens // rows
        return mask if per_row == 1 else mask.repeat_interleave(per_row)  # [T]
