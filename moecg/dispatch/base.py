"""Dispatcher interface, registry and the pieces every dispatcher shares.

Dims: T tokens, K top-k, E experts, C capacity, D hidden, I expert intermediate.
A dispatcher computes `sum_k w[t,k] * expert_{idx[t,k]}(x[t])` for the routed experts of one MoE layer and
records what it routed and dropped. It knows nothing about CUDA graphs beyond declaring `graph_safe`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from moecg.dispatch.state import LayerCounters
from moecg.models.formats import EXPERT_PARAMS
from moecg.models.weights import dense, stored, weight_input

REGISTRY: dict[str, type["Dispatcher"]] = {}


def register(cls):
    REGISTRY[cls.name] = cls
    return cls


class DispatchOptionError(ValueError):
    pass


@dataclass
class Dispatcher:
    """Capabilities are declared here, per class, and asked for by name of the capability, never of the class."""

    name: ClassVar[str] = "base"
    graph_safe: ClassVar[bool] = False  # no host sync and shapes fixed by the token count: CUDA graphs can hold it
    drops: ClassVar[bool] = False  # may drop assignments (a capacity); drop counters and capacity fields apply
    reads_all_experts: ClassVar[bool] = False  # every call reads every expert's weights (padded GEMM): the floor
    fused_unreduced: ClassVar[bool] = False  # has unreduced() -> [T, K, D] fp32, which the fused step sums itself
    exchanges: ClassVar[bool] = False  # holds all-to-alls over expert-parallel ranks (moecg.parallel): the floor adds
    #                                    their bytes, and every rank must run it as often with the same shapes

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The `dispatch.<option>` keys this dispatcher reads (its dataclass fields)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def capabilities(cls) -> dict:
        return {"graph_safe": cls.graph_safe, "drops": cls.drops, "reads_all_experts": cls.reads_all_experts,
                "exchanges": cls.exchanges}

    def forward(self, experts, hidden, idx, w, valid: torch.Tensor | None, counters: LayerCounters | None):
        raise NotImplementedError

    def describe(self) -> dict:
        return {"dispatch": self.name, "capacity_factor": None, "drop_policy": None}


_KINDS = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}


def _coerce(name: str, key: str, value, default):
    kind = type(default)
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise DispatchOptionError(f"dispatch.{key}={value!r}: dispatch={name} needs a finite number here "
                                          f"(default {default!r})")
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    else:
        return value
    raise DispatchOptionError(f"dispatch.{key}={value!r}: dispatch={name} needs {_KINDS[kind]} here "
                              f"(default {default!r})")


def make_dispatcher(name: str, **kwargs) -> Dispatcher:
    """Build a dispatcher from its options; an option it does not read is refused, not ignored."""
    if name not in REGISTRY:
        raise DispatchOptionError(f"unknown dispatch {name!r}: choose one of {sorted(REGISTRY)} (dispatch=<name>)")
    cls = REGISTRY[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        takers = sorted(n for n, c in REGISTRY.items() if set(unknown) <= set(c.options()))
        hint = f"it belongs to dispatch={' or dispatch='.join(takers)}" if takers else "no dispatcher reads it"
        own = ", ".join(cls.options()) or "none"
        raise DispatchOptionError(f"dispatch.{unknown[0]} does not apply to dispatch={name} ({hint}; "
                                  f"dispatch={name}'s options: {own}): remove the override or change dispatch")
    return cls(**{k: _coerce(name, k, v, fields[k].default) for k, v in kwargs.items()})


def check_experts(experts) -> None:
    """moecg's dispatchers cover gated experts in either HF layout ([E, 2I, D] / [E, D, I], or `is_transposed`
    [E, D, 2I] / [E, I, D]), with or without biases, applying the module's own `_apply_gate` (HF's chunked
    act(gate) * up, or a family's own, e.g. GPT-OSS's interleaved clamped SwiGLU): every family moecg knows."""
    if not getattr(experts, "has_gate", True) or getattr(experts, "has_post_expert_norm", False):
        raise NotImplementedError(
            f"{type(experts).__name__}: moecg dispatchers support gated experts (gate_up_proj) without a post-expert "
            "norm; use dispatch=dynamic for this model"
        )


def expert_weights(experts):
    """(gate_up [E, D, 2I], down [E, I, D], gate_up_bias [E, 2I] | None, down_bias [E, D] | None): the weights as
    [E, Din, Dout] views whatever the module's layout (HF's `is_transposed`: GPT-OSS stores them that way), in the
    model dtype: quantized experts are dequantized by the format's reference (moecg.models.formats), every call."""
    gate_up, down = (dense(stored(experts, n)) for n in EXPERT_PARAMS)
    if not getattr(experts, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if getattr(experts, "has_bias", False):
        return gate_up, down, experts.gate_up_proj_bias, experts.down_proj_bias
    return gate_up, down, None, None


def expert_mlp_grouped(experts, x_sorted, offsets, sorted_ids=None):
    """x_sorted [S, D] grouped by expert, offsets [E] int32 cumulative -> [S, D]; rows past offsets[-1] undefined.

    sorted_ids [S]: each row's expert (pad rows: sentinel E), needed for the biases of biased experts. Each GEMM takes
    its input as its weight does (weight_input: model.activations=fp8_dynamic quantizes row by row, so a sorted row is
    quantized as its token is)."""
    gate_up, down, b_gate_up, b_down = expert_weights(experts)
    h = grouped_mm(weight_input(experts, "gate_up_proj", x_sorted), gate_up, offsets)  # [S, 2I]
    if b_gate_up is not None:
        # pad rows (sentinel) sort past offsets[-1]: clamping keeps the bias gather in bounds, their rows are dropped;
        # the bias's own row count, not num_experts: an expert-parallel rank holds a slice of the experts
        e = sorted_ids.clamp(max=b_gate_up.shape[0] - 1)  # [S]
        h = h + b_gate_up[e]  # as HF's grouped_mm path: the bias before the gate
    h = experts._apply_gate(h)  # [S, I]
    y = grouped_mm(weight_input(experts, "down_proj", h), down, offsets)  # [S, D]
    return y + b_down[e] if b_down is not None else y


def expert_mlp_padded(experts, x):
    """x [E, C, D] capacity buffers -> [E, C, D]: one batched GEMM over all experts (graph-safe, reads all E).

    Empty slots get the biases too; the combine never reads them. Inputs as in expert_mlp_grouped: row by row, so a
    slot's row is quantized as its token is."""
    gate_up, down, b_gate_up, b_down = expert_weights(experts)
    h = torch.bmm(weight_input(experts, "gate_up_proj", x), gate_up)  # [E, C, 2I]
    if b_gate_up is not None:
        h = h + b_gate_up[:, None, :]
    h = experts._apply_gate(h)  # [E, C, I]
    y = torch.bmm(weight_input(experts, "down_proj", h), down)  # [E, C, D]
    return y + b_down[:, None, :] if b_down is not None else y


def grouped_mm(x, w, offsets):
    """x [S, Din] sorted by group, w [E, Din, Dout], offsets [E] int32 -> [S, Dout]; graph-safe either way."""
    x = x.to(w.dtype)
    if hasattr(torch.nn.functional, "grouped_mm") and _grouped_ok(x, w):
        return torch.nn.functional.grouped_mm(x, w, offs=offsets)
    # Fallback without host sync: each row's group from the offsets, then a per-row batched GEMV.
    rows = torch.arange(x.shape[0], device=x.device)
    group = torch.searchsorted(offsets, rows, right=True).clamp(max=w.shape[0] - 1)  # [S]
    return torch.bmm(x.unsqueeze(1), w[group]).squeeze(1)


def _grouped_ok(x, w) -> bool:
    aligned = x.shape[-1] * x.element_size() % 16 == 0 and w.shape[-1] * w.element_size() % 16 == 0
    if torch.compiler.is_compiling() and (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16):
        return False  # Inductor's grouped_mm (and its fake kernel) takes bf16 only
    if x.device.type == "cuda":
        # ATen's CUDA _grouped_mm has a kernel only for bf16 on sm90/sm100; anything else (fp32, fp16, sm80)
        # takes its fallback, which copies `offs` to the host: a sync that breaks capture.
        return torch.cuda.get_device_capability(x.device)[0] in (9, 10) and x.dtype == torch.bfloat16 \
            and w.dtype == torch.bfloat16 and aligned
    return aligned
