"""`strategy=<name>`: one option per strategy in moecg.capture.plan.STRATEGIES (which scope each decoder layer is
captured at). A strategy that selects a dispatcher (`StrategySpec.dispatch`: strategy=capacity picks
dispatch=capacity) gets a defaults-list override of the dispatch group; dispatch=<name> on the CLI still wins."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from moecg.capture.plan import STRATEGIES


@dataclass
class StrategyConfig:
    """`strategy.*`; the combination with the dispatcher and the model's depth is checked by the run plan
    (moecg.capture.plan.validate)."""

    name: Any = MISSING  # a key of moecg.capture.plan.STRATEGIES (set by strategy=<name>)
    # strategy=mixed: per-layer scopes, inclusive ranges ('0-11:layer,12-23:attn'); unnamed layers run eagerly
    layers: Any = None


def options() -> dict[str, tuple[object, str | None]]:
    """strategy=<name> -> (its node, its package: None for the group's own, `_global_` when it also selects a
    dispatcher through a defaults-list override)."""
    out = {}
    for name, spec in STRATEGIES.items():
        node = StrategyConfig(name=name, layers=spec.layers)
        if spec.dispatch is None:
            out[name] = (node, None)
        else:
            out[name] = ({"defaults": [{"override /dispatch": spec.dispatch}], "strategy": node}, "_global_")
    return out
