"""moecg.dispatch: graph-safe MoE dispatchers plugged into transformers' ExpertsInterface.

`attach(model, dispatcher)` registers `moecg_<name>` in the ExpertsInterface, switches the model to it and
binds each experts module to a model-wide `DispatchState` (row mask + counters). `detach` restores HF's own.
"""
from __future__ import annotations

import importlib
import pkgutil

from transformers.integrations.moe import ExpertsInterface

from moecg.dispatch.base import REGISTRY, Dispatcher, check_experts, make_dispatcher
from moecg.dispatch.capacity import Capacity
from moecg.dispatch.state import DispatchState, LayerCounters
from moecg.models.adapter import adapter_for
from moecg.moe_math import capacity_slots

# Every module of this package is imported (in file-name order), so a dispatcher is one file whose class carries
# @register: its name is then a REGISTRY key, a `dispatch=` choice and an ExpertsInterface implementation.
for _mod in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["REGISTRY", "Dispatcher", "DispatchState", "LayerCounters", "Capacity", "attach", "detach",
           "make_dispatcher", "capacity_slots", "state_of", "impl_name", "register_experts_impl"]


def impl_name(name: str) -> str:
    return f"moecg_{name}"


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    state: DispatchState = self._moecg_state
    valid = state.token_valid(hidden_states.shape[0])
    return state.dispatcher.forward(self, hidden_states, top_k_index, top_k_weights, valid,
                                    state.layer(self._moecg_slot))


def register_experts_impl(name: str) -> None:
    """Make `moecg_<name>` an ExpertsInterface implementation that runs the attached dispatcher (the registry's, and
    dispatchers built elsewhere, e.g. megatron-core's in moecg.parallel.megatron)."""
    ExpertsInterface.register(impl_name(name), _experts_forward)


for _name in REGISTRY:
    register_experts_impl(_name)


def attach(model, dispatcher: Dispatcher, max_rows: int = 64) -> DispatchState:
    """Route every MoE layer of `model` through `dispatcher`; returns the (device-side) dispatch state."""
    adapter = adapter_for(model)
    layers = adapter.moe_layers(model)
    if not layers:
        raise ValueError("model has no MoE layers (check mlp_only_layers / decoder_sparse_step)")
    device = next(model.parameters()).device
    state = DispatchState(dispatcher, [i for i, _ in layers], layers[0][1].num_experts, max_rows, device)
    for slot, (_, experts) in enumerate(layers):
        check_experts(experts)
        experts._moecg_state = state
        experts._moecg_slot = slot
    model._moecg_dispatch_prev = getattr(model, "_moecg_dispatch_prev", model.config._experts_implementation)
    register_experts_impl(dispatcher.name)  # idempotent: also a dispatcher registered after this package loaded
    model.set_experts_implementation(impl_name(dispatcher.name))
    model._moecg_state = state
    return state


def detach(model) -> None:
    for _, experts in adapter_for(model).moe_layers(model):
        for attr in ("_moecg_state", "_moecg_slot"):
            experts.__dict__.pop(attr, None)
    prev = model.__dict__.pop("_moecg_dispatch_prev", None)
    if prev is not None:
        model.set_experts_implementation(prev)
    model.__dict__.pop("_moecg_state", None)


def state_of(model) -> DispatchState | None:
    return getattr(model, "_moecg_state", None)


