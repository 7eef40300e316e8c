"""Typed reads of config values, shared by every config group, the workload and the run plan.

Each reader returns the value as its type or raises `PlanError` with one line that names the key, what it must be
and an example (`batch_size=2.5: must be an integer >= 1 (e.g. batch_size=4)`). Config dataclasses declare their
fields `Any` to OmegaConf and are read here instead: a refusal then happens in the plan phase (a failed
results.json, one line on stderr), not inside Hydra's composition, and OmegaConf's conversions (1 -> true,
1 -> "1") never stand in for a check.
"""
from __future__ import annotations

import dataclasses
import difflib
import math

from omegaconf import OmegaConf


class PlanError(ValueError):
    """A config that cannot run: the message names the key and the fix."""


def as_int(value, key: str, lo: int | None = None, example=None) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok and isinstance(value, float) and value.is_integer():
        value, ok = int(value), True
    if not ok or (lo is not None and value < lo):
        bound = f" >= {lo}" if lo is not None else ""
        raise PlanError(f"{key}={value!r}: must be an integer{bound} (e.g. {key}={example if example is not None else max(lo or 0, 1)})")
    return value


def as_float(value, key: str, lo: float | None = None, strict: bool = False, example=None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{key}={value!r}: must be a number (e.g. {key}={example if example is not None else 1.0})")
    value = float(value)
    bad = not math.isfinite(value) or (lo is not None and (value <= lo if strict else value < lo))
    if bad:
        rel = ">" if strict else ">="
        raise PlanError(f"{key}={value!r}: must be a finite number {rel} {lo} (e.g. {key}={example})")
    return value


def as_bool(value, key: str) -> bool:
    if not isinstance(value, bool):
        raise PlanError(f"{key}={value!r}: must be true or false")
    return value


def as_choice(value, key: str, choices) -> str:
    if value not in choices:
        raise PlanError(f"{key}={value!r}: choose one of {', '.join(map(str, choices))}")
    return value


# -- whole groups ------------------------------------------------------------------------------------------------
def plain(node) -> dict:
    """A config node (DictConfig, structured or not, or a dict) as a plain dict, interpolations resolved."""
    if node is None:
        return {}
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)


def unknown_key(key: str, group: str | None, known) -> PlanError:
    """The refusal of a key no config group declares, with the nearest one it does."""
    leaf = key.rsplit(".", 1)[-1]
    near = difflib.get_close_matches(leaf, list(known), n=1)
    where = f"not a key of {group}" if group else "not a config key"
    hint = f" (did you mean {key[:len(key) - len(leaf)]}{near[0]}?)" if near else ""
    return PlanError(f"{key}: {where}{hint}: fix the spelling or drop it (the keys: {', '.join(known)})")


def read_group(cls, node, group: str):
    """The group's dataclass from its config node: a key the dataclass does not declare is refused (a `+key=`
    override Hydra let through), a missing one takes the dataclass default. Values are checked by the group."""
    d = plain(node)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in d:
        if k not in names:
            raise unknown_key(f"{group}.{k}", group, names)
    return cls(**d)
