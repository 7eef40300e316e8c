"""Strategies (policy): which scope each decoder layer is captured at, and what each strategy demands.

Scopes: `step` (the whole decode step, one graph per bucket), `layer` (one graph per decoder layer:
attention + MoE), `attn` (one graph per layer's attention; the MoE FFN runs eagerly), `eager` (no graph).
"""
from __future__ import annotations

from dataclasses import dataclass

from moecg.dispatch import REGISTRY
from moecg.models.adapter import KERNELS  # hf | fused: one definition, beside the audit per path

LAYER_SCOPES = ("layer", "attn", "eager")


@dataclass(frozen=True)
class StrategySpec:
    name: str
    scope: str  # step | layer | attn | eager | mixed
    requires: str | None  # a dispatcher capability this strategy needs (a class variable of Dispatcher), if any
    doc: str
    dispatch: str | None = None  # the dispatcher `strategy=<name>` selects on the CLI (dispatch=<name> still overrides)
    layers: str | None = None  # the CLI's default strategy.layers (mixed: scopes for the 2-layer tiny presets)


STRATEGIES = {
    "eager": StrategySpec("eager", "eager", None, "no graphs: the baseline, same engine and dispatch"),
    "full": StrategySpec("full", "step", None, "whole decode step (embedding to argmax) as one graph per bucket"),
    "partial": StrategySpec("partial", "attn", None, "per layer: attention captured, MoE FFN eager (any dispatch)"),
    "capacity": StrategySpec("capacity", "step", "drops",
                             "whole step captured with capacity-padded experts (dispatch=capacity)", dispatch="capacity"),
    "layer": StrategySpec("layer", "layer", None, "one graph per decoder layer (attention + MoE)"),
    "mixed": StrategySpec("mixed", "mixed", None, "per-layer scopes from strategy.layers, e.g. '0-11:layer,12-23:attn'",
                          layers="0-0:layer,1-1:attn"),
}

NOT_GRAPH_SAFE = ("dispatch={d} is not graph-safe: use dispatch=dropless, dispatch=capacity, or strategy=partial")


class StrategyError(ValueError):
    pass


def parse_layers(spec: str, num_layers: int) -> list[str]:
    """'0-11:layer,12-23:attn' -> a scope per layer; layers not named run eagerly. Ranges are inclusive."""
    scopes = ["eager"] * num_layers
    seen = set()
    for part in [p.strip() for p in str(spec).split(",") if p.strip()]:
        try:
            rng, scope = part.split(":")
            lo, _, hi = rng.partition("-")
            lo, hi = int(lo), int(hi or lo)
        except ValueError:
            raise StrategyError(f"strategy.layers: cannot read {part!r}; write ranges like '0-11:layer,12-23:attn'")
        if scope not in LAYER_SCOPES:
            raise StrategyError(f"strategy.layers: scope {scope!r} in {part!r}: choose one of {LAYER_SCOPES}")
        if not 0 <= lo <= hi < num_layers:
            raise StrategyError(f"strategy.layers: range {lo}-{hi} is outside the model's layers 0-{num_layers - 1}")
        overlap = seen & set(range(lo, hi + 1))
        if overlap:
            raise StrategyError(f"strategy.layers: layers {sorted(overlap)} are given twice")
        seen |= set(range(lo, hi + 1))
        scopes[lo : hi + 1] = [scope] * (hi - lo + 1)
    return scopes


def resolve(name: str, num_layers: int, layers: str | None = None) -> tuple[StrategySpec, list[str] | None]:
    """Strategy spec and per-layer scopes (None for the whole-step and eager strategies)."""
    if name not in STRATEGIES:
        raise StrategyError(f"unknown strategy {name!r}: choose one of {sorted(STRATEGIES)}")
    spec = STRATEGIES[name]
    if spec.scope == "mixed":
        if not layers:
            raise StrategyError("strategy=mixed needs strategy.layers, e.g. strategy.layers='0-11:layer,12-23:attn'")
        return spec, parse_layers(layers, num_layers)
    if layers:
        raise StrategyError(f"strategy.layers is only read by strategy=mixed (got strategy={name})")
    if spec.scope in ("layer", "attn"):
        return spec, [spec.scope] * num_layers
    return spec, None


def validate(name: str, dispatcher, num_layers: int, layers: str | None = None):
    """Check a strategy x dispatch combination before any CUDA work; returns (spec, per-layer scopes)."""
    spec, scopes = resolve(name, num_layers, layers)
    if spec.requires is not None and not getattr(dispatcher, spec.requires):
        takers = " or dispatch=".join(sorted(n for n, c in REGISTRY.items() if getattr(c, spec.requires)))
        raise StrategyError(f"strategy={name} needs dispatch={takers} (a dispatcher with `{spec.requires}`; got "
                            f"dispatch={dispatcher.name}); use strategy=full for a whole-step graph with "
                            f"dispatch={dispatcher.name}")
    captures_moe = spec.scope == "step" or (scopes is not None and "layer" in scopes)
    if captures_moe and not dispatcher.graph_safe:
        where = "" if spec.scope == "step" else \
            f" (layers {[i for i, s in enumerate(scopes) if s == 'layer']} capture their MoE)"
        raise StrategyError(NOT_GRAPH_SAFE.format(d=dispatcher.name) + where)
    return spec, scopes


COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def validate_capture(spec: StrategySpec, kernels: str, compile: bool, compile_mode: str) -> None:
    """Check capture.kernels / capture.compile against the strategy before any CUDA work (the run plan and Capture
    both call this one function)."""
    if compile and compile_mode not in COMPILE_MODES:
        raise StrategyError(f"capture.compile_mode={compile_mode!r}: use default or max-autotune-no-cudagraphs "
                            "(reduce-overhead and max-autotune add Inductor's own CUDA graphs; moecg captures "
                            "the compiled code itself)")
    if kernels not in KERNELS:
        raise StrategyError(f"capture.kernels={kernels!r}: choose one of {KERNELS}")
    if kernels == "fused":
        if spec.scope not in ("step", "eager"):
            raise StrategyError(f"capture.kernels=fused replaces the whole decoder stack at decode, so it combines "
                                f"with strategy=full, capacity or eager, not strategy={spec.name} (per-layer "
                                "graphs wrap HF's decoder layers): use capture.kernels=hf for that strategy")
        if compile:
            raise StrategyError("capture.kernels=fused and capture.compile=true exclude each other: pick one")
